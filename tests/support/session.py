"""What the session's shared fixtures (tests/conftest.py) are set up with, for the tests
that need the same numbers."""

MAX_MODEL_LEN = 1024
"""The session worker's context (``--max-model-len``); other real workers match it."""

OPERATOR_KEY = "sq-operator-test-key"
"""``keyed_gateway``'s key, given on its command line (an operator's key)."""
