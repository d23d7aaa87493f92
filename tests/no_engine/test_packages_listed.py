"""Every package of the product is in ``pyproject.toml``'s list: a package left out installs
nowhere but in an editable checkout (a wheel, a container image), and imports then fail."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("streamq", "producer", "worker", "gateway")


def test_every_package_of_the_product_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in PRODUCT
        for init in (ROOT / top).rglob("__init__.py")
        if "static" not in init.parts
    }
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
