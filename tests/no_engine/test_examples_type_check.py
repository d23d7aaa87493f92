"""The docs' examples type-check as a user's project would see streamq: installed from its
wheel (not this checkout), its types visible only through the ``py.typed`` markers it
ships. A deliberate mistake beside them must be reported, or the check saw no types."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
MISTAKES = """\
from producer import StreamqClient
from producer.sync import StreamqClient as BlockingClient


async def misspelt() -> None:
    async with StreamqClient.connect() as client:
        completion = await client.generate("Hi", max_tokens=8)
        print(completion.txt)


def wrong_type() -> None:
    with BlockingClient.connect() as client:
        tokens: int = client.generate("Hi").text
        print(tokens)
"""


@pytest.fixture(scope="module")
def site_packages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A virtual environment (its python and site-packages) holding streamq's wheel, with
    this environment's packages (redis, msgspec, openai, flask, ...) beside it by a path
    file, as a user's would have them installed."""
    where = tmp_path_factory.mktemp("user-env")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", where / "wheel", ROOT],
        check=True,
        cwd=where,
    )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", where / "venv"], check=True)
    python = where / "venv" / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (wheel,) = (where / "wheel").glob("streamq-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", purelib, wheel], check=True)
    (purelib / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, purelib


def test_the_wheel_ships_a_py_typed_marker_in_every_package(site_packages: tuple[Path, Path]) -> None:
    _, purelib = site_packages
    for package in ("streamq", "producer", "worker", "gateway"):
        assert (purelib / package / "py.typed").exists(), f"{package} has no py.typed in the wheel"


def test_the_examples_type_check_against_the_installed_package(
    site_packages: tuple[Path, Path], tmp_path: Path
) -> None:
    python, _ = site_packages
    project = tmp_path / "project"
    project.mkdir()
    for example in EXAMPLES:
        shutil.copy(example, project / example.name)
    (project / "mistakes.py").write_text(MISTAKES)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--python-executable",
            python,
            "--cache-dir",
            tmp_path / "cache",
            "--no-error-summary",
            "--hide-error-context",
            ".",
        ],
        cwd=project,
        capture_output=True,
        text=True,
    )
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert not [line for line in errors if not line.startswith("mistakes.py")], run.stdout + run.stderr
    assert any('"Completion" has no attribute "txt"' in line for line in errors), run.stdout + run.stderr
    assert any('expression has type "str", variable has type "int"' in line for line in errors), run.stdout
