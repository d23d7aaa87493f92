"""The gateway's routes, one module per endpoint family, each an ``APIRouter`` that
``gateway.app.create_app`` includes: ``completions`` (OpenAI's completions and chat
completions), ``messages`` (Anthropic's Messages API), ``requests`` (a request's status),
``tokenizer`` (vLLM's tokenizer routes), ``service`` (health, models, metrics); the
dashboard's are ``gateway.dashboard.routes``. They reach what the app holds through
``gateway.state``."""
