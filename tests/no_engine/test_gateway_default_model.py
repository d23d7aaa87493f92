"""The model of a request that names none (``gateway/default_model.py``): the one base model
live workers serve, as ``vllm serve`` uses the model it serves; with several, or none, a 400
that lists them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.default_model import with_default_model
from producer.openai_api.errors import ApiError
from streamq.broker.registry import Routes
from streamq.protocol import AdapterCard, WorkerRegistration


def request(*workers: WorkerRegistration) -> Any:
    async def routes() -> Routes:
        return Routes(workers=list(workers), known_models={w.model: w.queue for w in workers})

    state = SimpleNamespace(services=SimpleNamespace(client=SimpleNamespace(routes=routes)))
    return SimpleNamespace(app=SimpleNamespace(state=state))


def serving(model: str, worker: str = "w", adapters: tuple[AdapterCard, ...] = ()) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker, model=model, queue=f"q:{model}", adapters=adapters)


@pytest.mark.parametrize("body", [{"prompt": "Hi"}, {"prompt": "Hi", "model": None}, {"prompt": "Hi", "model": ""}])
async def test_a_request_without_a_model_goes_to_the_one_live_model(body: dict[str, Any]) -> None:
    assert await with_default_model(request(serving("a"), serving("a", "w2")), body) == {"prompt": "Hi", "model": "a"}


async def test_a_base_model_with_adapters_is_one_model() -> None:
    lora = AdapterCard(name="a-lora", path="/adapters/a")
    assert (await with_default_model(request(serving("a", adapters=(lora,))), {}))["model"] == "a"


async def test_a_named_model_is_kept_without_reading_the_registry() -> None:
    assert await with_default_model(SimpleNamespace(), {"model": "b"}) == {"model": "b"}


@pytest.mark.parametrize(("workers", "listed"), [((serving("a"), serving("b", "w2")), "a, b"), ((), "none")])
async def test_without_one_live_model_a_request_must_name_one(
    workers: tuple[WorkerRegistration, ...], listed: str
) -> None:
    with pytest.raises(ApiError) as caught:
        await with_default_model(request(*workers), {"prompt": "Hi"})
    assert caught.value.status == 400 and f"live workers serve {listed}" in str(caught.value)
