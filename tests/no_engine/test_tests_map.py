"""tests/README.md maps each product module to the test files that exercise it: it must
match the tree, and name every test file that imports a module (or a group holding it)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
MAP = TESTS / "README.md"
PACKAGES = ("streamq", "producer", "gateway", "worker", "devkit")
WORKER_TIERS = ("scripted_engine", "real_engine")
GATEWAY_IMPORTS = {"devkit.gateway_process", "tests.support.gateway_in_process"}
GATEWAY_FIXTURES = {"gateway", "keyed_gateway", "sdk"}
RUNS_A_WORKER = "every test that runs a worker"
STARTS_A_GATEWAY = "every test that starts a gateway"
IMPORTS_IT = "every test that imports it"
_ROW = re.compile(r"^\| `([^`]+)` \| (.*) \|$", re.MULTILINE)
_TEST_FILE = re.compile(r"`(test_\w+\.py)`")


def _rows() -> dict[str, str]:
    """Each row's module and its tests cell (the map's table, after its header)."""
    table = MAP.read_text().split("| module | tests |", 1)[1]
    return dict(_ROW.findall(table))


def _test_files() -> dict[str, Path]:
    """Every test file by its name (unique across the tiers: ``test_suite_layout.py``)."""
    return {path.name: path for path in sorted(TESTS.glob("*/test_*.py"))}


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _source(dotted: str) -> Path | None:
    """The file of a module of this checkout (a package is its ``__init__.py``)."""
    base = ROOT / dotted.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _reexported(package: Path, name: str) -> Path | None:
    """The module that a package's ``__init__.py`` imports ``name`` from, followed through
    packages that re-export it in turn."""
    for node in _tree(package).body:
        if isinstance(node, ast.ImportFrom) and node.module and any(alias.name == name for alias in node.names):
            source = _source(node.module)
            if source is not None and source.name == "__init__.py":
                return _reexported(source, name) or source
            return source
    return None


def _imported_modules(path: Path) -> set[str]:
    """The product modules a file imports, anywhere in it: ``import a.b``, ``from a.b import c``
    (``c`` a module, or a name that ``a/b/__init__.py`` re-exports from its module)."""
    found: set[Path | None] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found |= {_source(alias.name) for alias in node.names if alias.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in PACKAGES:
                continue
            module = _source(node.module)
            for alias in node.names:
                submodule = _source(f"{node.module}.{alias.name}")
                if submodule is not None:
                    found.add(submodule)
                elif module is not None and module.name == "__init__.py":
                    found.add(_reexported(module, alias.name) or module)
                else:
                    found.add(module)
    return {str(module.relative_to(ROOT)) for module in found if module is not None}


def _is_trivial(path: Path) -> bool:
    """An ``__init__.py`` or ``__main__.py`` with nothing of its own: a docstring, imports,
    ``__all__``, a lazy ``__getattr__`` or one call (``sys.exit(main())``)."""

    def plain(node: ast.stmt) -> bool:
        if isinstance(node, ast.Assign):
            return all(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets)
        if isinstance(node, ast.FunctionDef):
            return node.name == "__getattr__"
        return isinstance(node, ast.Import | ast.ImportFrom | ast.Expr)

    return path.name in ("__init__.py", "__main__.py") and all(plain(node) for node in _tree(path).body)


def _needs_a_row(module: str, importers: dict[str, set[str]]) -> bool:
    """Every product module but a trivial ``__init__.py``/``__main__.py``; a devkit module
    only where a test imports it."""
    if _is_trivial(ROOT / module):
        return False
    return not module.startswith("devkit/") or bool(importers.get(module))


def _importers() -> dict[str, set[str]]:
    """Each product module, and the test files (by name) that import it."""
    importers: dict[str, set[str]] = {}
    for name, path in _test_files().items():
        for module in _imported_modules(path):
            importers.setdefault(module, set()).add(name)
    return importers


def _starts_a_gateway(path: Path) -> bool:
    """Imports a gateway starter, or takes a fixture that starts one."""
    tree = _tree(path)
    imports = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    parameters = {
        arg.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for arg in node.args.args
    }
    return bool(imports & GATEWAY_IMPORTS or parameters & GATEWAY_FIXTURES)


def _groups(cell: str, module: str, importers: dict[str, set[str]]) -> set[str]:
    """The test files of the groups a row's cell names."""
    files = _test_files()
    members: set[str] = set()
    if RUNS_A_WORKER in cell:
        members |= {name for name, path in files.items() if path.parent.name in WORKER_TIERS}
    if STARTS_A_GATEWAY in cell:
        members |= {name for name, path in files.items() if _starts_a_gateway(path)}
    if IMPORTS_IT in cell:
        members |= importers.get(module, set())
    return members


def test_the_import_reader_follows_reexports() -> None:
    """``from producer import StreamqClient`` is an import of ``producer/client.py``; a
    submodule imported by name is that submodule."""
    imported = _imported_modules(TESTS / "no_engine" / "test_client_api.py")
    assert "producer/client.py" in imported
    assert "producer/tenants_cli.py" in _imported_modules(TESTS / "no_engine" / "test_priority_inputs.py")


def test_every_product_module_has_a_row() -> None:
    rows, importers = _rows(), _importers()
    assert rows, f"{MAP.relative_to(ROOT)} has no table"
    modules = sorted(str(path.relative_to(ROOT)) for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
    missing = [module for module in modules if _needs_a_row(module, importers) and module not in rows]
    assert not missing, (
        f"add a row to tests/README.md for each of these modules (the tests that exercise it): {missing}"
    )


def test_every_row_names_a_module_and_existing_test_files() -> None:
    files = _test_files()
    bad = [f"{module}: no such module" for module in _rows() if not (ROOT / module).is_file()]
    bad += [
        f"{module}: no test file {name}"
        for module, cell in _rows().items()
        for name in _TEST_FILE.findall(cell)
        if name not in files
    ]
    assert not bad, f"fix these rows of tests/README.md: {bad}"


def test_every_test_that_imports_a_module_is_in_its_row() -> None:
    importers, rows, files = _importers(), _rows(), _test_files()
    unlisted = []
    for module, cell in sorted(rows.items()):
        covered = set(_TEST_FILE.findall(cell)) | _groups(cell, module, importers)
        unlisted += [
            f"{module}: {files[name].parent.name}/{name}" for name in sorted(importers.get(module, set()) - covered)
        ]
    assert not unlisted, (
        "these test files import a module its row in tests/README.md does not name: add each to its"
        f" module's row, under its tier (or end the row with a group that holds it): {unlisted}"
    )
