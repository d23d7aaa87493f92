"""The core both sides of streamq share: the wire contract (``streamq.protocol``) and
the Redis layer (``streamq.broker``). Imports neither vllm nor fastapi."""
