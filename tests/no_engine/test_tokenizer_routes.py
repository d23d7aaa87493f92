"""Which model a tokenizer route answers for (``gateway/routes/tokenizer.py``): the one it
names, else the gateway's ``--tokenizer-model``, else the one model live workers serve; with
several and none named, a 400 that lists them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.routes.tokenizer import resolve_model
from producer.openai_api.errors import ApiError
from streamq.broker.registry import Routes
from streamq.protocol import WorkerRegistration


def request(models: list[str], default: str | None = None) -> Any:
    workers = [WorkerRegistration(worker_id=f"w{i}", model=m, queue=f"q:{m}") for i, m in enumerate(models)]

    async def routes() -> Routes:
        return Routes(workers=workers, known_models={m: f"q:{m}" for m in models})

    state = SimpleNamespace(
        services=SimpleNamespace(client=SimpleNamespace(routes=routes)),
        config=SimpleNamespace(tokenizer_model=default),
    )
    return SimpleNamespace(app=SimpleNamespace(state=state), state=SimpleNamespace())


async def test_a_named_model_is_the_one() -> None:
    assert await resolve_model(request(["a", "b"]), "b") == "b"


async def test_without_a_name_the_gateways_default_answers() -> None:
    assert await resolve_model(request(["a", "b"], default="a"), None) == "a"


async def test_without_a_name_or_default_the_one_live_model_answers() -> None:
    assert await resolve_model(request(["a"]), None) == "a"


async def test_several_live_models_and_no_name_is_a_400_listing_them() -> None:
    with pytest.raises(ApiError) as caught:
        await resolve_model(request(["a", "b"]), None)
    assert caught.value.status == 400 and "a, b" in str(caught.value)
