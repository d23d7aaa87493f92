"""What the tests share that is not a fixture: fake endpoints, readers of the raw wire,
reference runs, fault helpers. Fixtures live in tests/conftest.py."""
