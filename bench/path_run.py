"""What the three path modules share: their command line and their result file.

The parent runs ``python -m bench.<path module> CONFIG.json OUT.json``; the child
measures every concurrency level and writes its ``PathResult`` rows as JSON.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from bench.config import BenchConfig
from bench.timing import PathResult


def parse_path_args(description: str) -> tuple[BenchConfig, Path]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("config", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    return BenchConfig.load(args.config), args.out


def write_results(out: Path, results: list[PathResult]) -> None:
    out.write_text(json.dumps([asdict(r) for r in results], indent=1))


def read_results(path: Path) -> list[PathResult]:
    return [PathResult(**row) for row in json.loads(path.read_text())]
