"""The suite's own layout: the tiers are folders without ``__init__.py``, so pytest imports
each test module by its file name alone, and two modules of one name in two tiers make the
second fail to collect ("import file mismatch")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_file_name() -> None:
    names = Counter(path.name for path in TESTS.glob("*/test_*.py"))
    assert not [name for name, count in names.items() if count > 1]
