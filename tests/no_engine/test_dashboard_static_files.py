"""The dashboard page's files: self-contained (nothing fetched from another host, as many
deployments have no internet), data inserted as text only, reading only fields the
Snapshot has, and shipped in the package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from gateway.dashboard.batches import BatchRow
from gateway.dashboard.snapshot import ModelRow, WorkerRow

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


def test_the_script_reads_only_fields_the_snapshot_has() -> None:
    """A field renamed on one side only would show "–" (or "NaN%") on the page, silently:
    every ``model.<field>`` of an overview card, ``w.<field>`` of a worker row and
    ``b.<field>`` of a batch row is one of ``ModelRow``'s, ``WorkerRow``'s and ``BatchRow``'s."""
    script = (STATIC / "dashboard.js").read_text()
    for variable, row in (("model", ModelRow), ("w", WorkerRow), ("b", BatchRow)):
        read = set(re.findall(rf"\b{variable}\.([a-z_]+)\b", script))
        assert read, f"no {variable}.<field> in dashboard.js"
        assert read <= set(row.__struct_fields__), f"{row.__name__} lacks {sorted(read - set(row.__struct_fields__))}"


def test_the_overview_and_workers_show_prefix_aware_pickup_and_the_prefix_cache() -> None:
    script = (STATIC / "dashboard.js").read_text()
    for field in ("affinity_hit_rate", "affinity_expired", "prefix_cache_hit_rate"):
        assert f"model.{field}" in script, f"the overview's cards do not show {field}"
    for testid in ("model-affinity-hit-rate", "model-affinity-expired", "model-prefix-cache-hit-rate"):
        assert f'"{testid}"' in script, testid
    assert "w.affinity_hits" in script and "w.affinity_misses" in script, "the workers' rows show their hits"


def test_the_files_are_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "gateway.dashboard" in config["packages"]
    assert config["package-data"]["gateway.dashboard"] == ["static/*"]
    assert {path.name for path in STATIC.iterdir()} == {"index.html", "dashboard.js", "dashboard.css"}
