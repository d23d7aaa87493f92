"""An OpenAI-compatible HTTP gateway in front of streamq: ``python -m gateway``.

Needs FastAPI, uvicorn and prometheus-client (the ``gateway`` extra); the client
library in ``producer`` works without them.
"""

from gateway.app import create_app
from gateway.routes.completions import REQUEST_ID_HEADER

__all__ = ["REQUEST_ID_HEADER", "create_app"]
