"""An OpenAI-compatible HTTP gateway in front of streamq: ``python -m gateway``.

Needs FastAPI and uvicorn (the ``gateway`` extra; a vLLM install brings both). The
rest of ``producer`` does not import this package, so producers without them work.
"""

from gateway.app import REQUEST_ID_HEADER, create_app

__all__ = ["REQUEST_ID_HEADER", "create_app"]
