"""The fast tier (``make test-fast``): pure parts and Redis-only checks, no engine and
no worker process, under a minute in all."""
