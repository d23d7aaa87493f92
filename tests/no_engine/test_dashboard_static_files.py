"""The dashboard page's files: self-contained (nothing fetched from another host, as many
deployments have no internet), data inserted as text only, and shipped in the package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "gateway" / "dashboard" / "static"
SVG_NAMESPACE = "http://www.w3.org/2000/svg"  # a name, never fetched


def test_the_page_loads_only_its_own_files() -> None:
    page = (STATIC / "index.html").read_text()
    referenced = re.findall(r'(?:src|href)="([^"#]+)"', page)
    assert "/dashboard/static/dashboard.js" in referenced and "/dashboard/static/dashboard.css" in referenced
    for path in referenced:
        if path.startswith("/dashboard/static/"):
            assert (STATIC / path.removeprefix("/dashboard/static/")).is_file(), path
        else:
            assert path == "data:,", f"index.html loads {path!r}: only the dashboard's own files"


def test_no_file_reaches_another_host() -> None:
    for path in STATIC.iterdir():
        text = path.read_text().replace(SVG_NAMESPACE, "")
        found = re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, flags=re.IGNORECASE)
        assert not found, f"{path.name} names other hosts (fonts, CDNs?): {found}"
        assert "@import" not in text, f"{path.name} imports a stylesheet"


def test_the_script_inserts_data_as_text_only() -> None:
    script = (STATIC / "dashboard.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, f"dashboard.js uses {sink}: data must reach the page as text"


def test_the_files_are_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "gateway.dashboard" in config["packages"]
    assert config["package-data"]["gateway.dashboard"] == ["static/*"]
    assert {path.name for path in STATIC.iterdir()} == {"index.html", "dashboard.js", "dashboard.css"}
