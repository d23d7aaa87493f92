"""The module table of docs/development.md is the map a newcomer reads first: it must match the tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("streamq", "producer", "gateway", "worker")
_FIRST_CELL = re.compile(r"^\| ([^|]+) \|", re.MULTILINE)
_PATH = re.compile(r"`([^`]+)`")


def _table_paths() -> list[str]:
    page = (ROOT / "docs" / "development.md").read_text()
    section = page.split("| module | what it holds |", 1)[1].split("\n\n", 1)[0]
    return [path for cell in _FIRST_CELL.findall(section) for path in _PATH.findall(cell)]


def _product_modules() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for package in PRODUCT_PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py" or path.parent.name != package
    )


def test_every_path_in_the_module_table_exists() -> None:
    missing = [path for path in _table_paths() if not (ROOT / path).exists()]
    assert _table_paths(), "docs/development.md has no module table"
    assert not missing, f"the module table names paths that are not in the tree: {missing}"


def test_every_product_module_is_in_the_module_table() -> None:
    listed = _table_paths()

    def covered(module: str) -> bool:
        return any(module == path or (path.endswith("/") and module.startswith(path)) for path in listed)

    unlisted = [module for module in _product_modules() if not covered(module)]
    assert not unlisted, f"modules missing from the module table (a row each, or their folder/): {unlisted}"
