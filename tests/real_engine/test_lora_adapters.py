"""LoRA adapters served as models: two real workers started as ``vllm serve`` would be
with LoRA (``--enable-lora --lora-modules ... --max-loras 2``), on a queue of their own,
behind a real gateway. They serve different adapters: the first lists two and loads
others at run time (vLLM's filesystem resolver), the second lists one of them only.

The adapters are generated here (random A and B, so each visibly changes the text), and
every text under an adapter is compared with a bare ``AsyncLLM`` given the same
``LoRARequest``. The workers get the module's requests concurrently, so base-model and
adapter requests share the engine's batches (the CPU build's LoRA kernels applied an
adapter to base requests in such batches: ``worker/lora_plugin.py``).
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import free_ports
from devkit.tiny_adapter import build_tiny_adapter
from devkit.worker_process import WorkerProcess, tiny_engine_flags, worker_env
from producer.errors import RequestError
from producer.internal_client import InternalClient
from streamq.broker.api_keys import ApiKeyStore, KeyRecord
from streamq.broker.replay_log import ReplayLog
from streamq.protocol import events_channel
from tests.support.metrics import scrape, value
from tests.support.reference_generate import LORA_RANK, PROMPTS, bare_engine_lora_outputs
from tests.support.session import MAX_MODEL_LEN, OPERATOR_KEY
from tests.support.worker_faults import paused, pid_of
from worker.lora_plugin import LOAD_LINE

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "streamq:queue:lora"
BASE = "tiny-lora"
"""The workers' served model name: the session worker serves the same weights under their path."""
LISTED = ("sql", "poet")
"""Adapters the first worker lists with ``--lora-modules``."""
SHARED = LISTED[0]
"""The one adapter the second worker lists (and so the one a take-over can move)."""
FOUND = "pirate"
"""An adapter only in the resolver's directory, which only the first worker searches: loaded
at run time."""


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three adapters of the tiny model; ``FOUND``'s in the directory the resolver searches."""
    root = tmp_path_factory.mktemp("adapters")
    made = {name: build_tiny_adapter(tiny_model, root / "listed" / name, seed=i) for i, name in enumerate(LISTED)}
    made[FOUND] = build_tiny_adapter(tiny_model, root / "resolver" / FOUND, seed=len(LISTED))
    return made


@pytest.fixture(scope="module")
def lora_workers(
    worker: WorkerProcess, tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    """Two LoRA workers on ``QUEUE``, started together, ready once both registered: the
    first lists ``LISTED`` and finds others in ``FOUND``'s directory, the second lists
    ``SHARED`` alone."""
    flags = [
        *tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN),
        "--served-model-name",
        BASE,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        str(LORA_RANK),
        "--lora-modules",
    ]
    first = (
        [*flags, *(f"{name}={adapters[name]}" for name in LISTED)],
        worker_env(VLLM_LORA_RESOLVER_CACHE_DIR=str(adapters[FOUND].parent)),
    )
    second = ([*flags, f"{SHARED}={adapters[SHARED]}"], worker_env())
    logs = tmp_path_factory.mktemp("lora-workers")
    workers = [
        WorkerProcess(
            worker.redis_url, flags, queue=QUEUE, log_path=logs / f"worker-{i}.log", env=env, metrics_port=port
        ).start()
        for i, ((flags, env), port) in enumerate(zip((first, second), free_ports(2), strict=True))
    ]
    try:
        deadline = time.monotonic() + 300
        for process in workers:
            while "registered model" not in process.log_tail(400):
                assert process.process is not None and process.process.poll() is None, process.log_tail()
                assert time.monotonic() < deadline, process.log_tail()
                time.sleep(0.2)
        yield workers
    finally:
        codes = [process.stop() for process in workers]
    assert codes[1] == 0, workers[1].log_tail()  # the first is killed by the take-over test


@pytest.fixture(scope="module")
def reference(
    tiny_model: Path, adapters: dict[str, Path], lora_workers: list[WorkerProcess]
) -> dict[str, dict[str, dict]]:
    """A bare AsyncLLM's greedy texts of ``PROMPTS`` under the base model ("") and each
    adapter (started after the workers, so that no two engines start at once)."""
    return bare_engine_lora_outputs(tiny_model, MAX_MODEL_LEN, adapters)


@pytest.fixture(scope="module")
def lora_gateway(
    lora_workers: list[WorkerProcess], gateway_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    log_path = tmp_path_factory.mktemp("lora-gateway") / "gateway.log"
    process = GatewayProcess(gateway_url, log_path, "--api-key", OPERATOR_KEY).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture
async def lora_client(lora_workers: list[WorkerProcess], producer_url: str) -> Any:
    async with await InternalClient.connect(producer_url, queue=QUEUE) as client:
        yield client


async def test_each_listed_adapter_is_a_model_on_its_base_models_queue(
    lora_client: InternalClient, adapters: dict[str, Path], lora_gateway: GatewayProcess
) -> None:
    live = await lora_client.live_models()
    assert {name: live[name] for name in (BASE, *LISTED)} == dict.fromkeys((BASE, *LISTED), QUEUE)
    async with httpx.AsyncClient(base_url=lora_gateway.url) as http:
        reply = await http.get("/v1/models", headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    cards = {card["id"]: card for card in reply.json()["data"]}
    for name in LISTED:  # as vllm serve lists an adapter: its path as root, its base as parent
        assert cards[name]["root"] == str(adapters[name])
        assert cards[name]["parent"] == BASE
        assert cards[name]["workers"] == (2 if name == SHARED else 1)
    assert "parent" not in cards[BASE]


async def test_every_text_under_an_adapter_equals_the_bare_engine_with_its_lora_request(
    lora_client: InternalClient, reference: dict[str, dict[str, dict]], lora_workers: list[WorkerProcess]
) -> None:
    """... and each request runs on a worker that serves its adapter."""
    models = {"": BASE, **{name: name for name in LISTED}}
    # All at once, twice over: base and adapter requests share batches on both workers.
    asked = [(name, prompt) for _ in range(2) for name in models for prompt in PROMPTS]
    completions = await asyncio.gather(
        *(
            lora_client.generate(prompt, model=models[name], max_tokens=24, temperature=0, affinity=False)
            for name, prompt in asked
        )
    )
    served_by: dict[str, set[int]] = {name: set() for name in models}
    for (name, prompt), completion in zip(asked, completions, strict=True):
        expected = reference[name][prompt]
        assert (completion.text, completion.token_ids[0]) == (expected["text"], expected["token_ids"]), (name, prompt)
        served_by[name].add(pid_of(completion.worker_id))
    pids = [w.process.pid for w in lora_workers if w.process is not None]
    assert served_by[LISTED[1]] == {pids[0]}, "only the first worker lists it: each of its requests ran there"
    for name in LISTED:
        assert reference[name] != reference[""], f"adapter {name} changes nothing: the test could not fail"


async def test_requests_for_an_adapter_go_to_the_worker_that_ran_it_last(
    lora_client: InternalClient, lora_workers: list[WorkerProcess]
) -> None:
    """... and that worker's metrics count them, and their tokens, under the adapter's name."""
    pids = [w.process.pid for w in lora_workers if w.process is not None]
    before = [scrape(w) for w in lora_workers]
    ran_on: dict[str, int] = {}
    for name in LISTED:
        first = await lora_client.generate("Hello", model=name, max_tokens=2, ignore_eos=True)
        followers = [
            await lora_client.generate("Hello again", model=name, max_tokens=2, ignore_eos=True) for _ in range(4)
        ]
        assert {c.worker_id for c in followers} == {first.worker_id}, name
        ran_on[name] = pids.index(pid_of(first.worker_id))
    after = [scrape(w) for w in lora_workers]
    for name, home in ran_on.items():
        for i, (then, now) in enumerate(zip(before, after, strict=True)):
            counted = [
                value(now, metric, model=name) - value(then, metric, model=name)
                for metric in ("streamq_model_requests_finished_total", "streamq_model_completion_tokens_total")
            ]
            assert counted == ([5, 10] if i == home else [0, 0]), (name, i)


def test_the_docs_example_runs_against_workers_with_adapters(
    lora_workers: list[WorkerProcess], producer_url: str
) -> None:
    """docs/features/lora-adapters.md's example, run as a reader runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REDIS_URL": producer_url, "STREAMQ_QUEUE": QUEUE}
    run = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "lora_adapters.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    listed, *served = run.stdout.splitlines()
    assert {BASE, *LISTED} <= set(ast.literal_eval(listed))
    assert [line.split()[0] for line in served] == ["sql", "poet", "sql"]
    assert served[0].split()[1] == served[2].split()[1], "the second sql request ran where the first did"


async def test_an_adapter_not_listed_is_found_at_run_time_and_listed_from_then_on(
    lora_workers: list[WorkerProcess],
    lora_client: InternalClient,
    reference: dict[str, dict[str, dict]],
    adapters: dict[str, Path],
) -> None:
    prompt = PROMPTS[0]
    completion = await lora_client.generate(prompt, model=FOUND, max_tokens=24, temperature=0)
    assert (completion.text, completion.token_ids[0]) == (
        reference[FOUND][prompt]["text"],
        reference[FOUND][prompt]["token_ids"],
    )
    routes = await lora_client.routes()
    (loaded_by,) = [w for w in routes.workers if w.worker_id == completion.worker_id]
    assert [(a.name, a.path) for a in loaded_by.adapters] == [
        *((name, str(adapters[name])) for name in LISTED),
        (FOUND, str(adapters[FOUND])),
    ]
    assert [w.loads_adapters for w in routes.workers if w.queue == QUEUE].count(True) == 1
    assert pid_of(completion.worker_id) == lora_workers[0].process.pid  # type: ignore[union-attr]  # the one that searches
    assert f"{LOAD_LINE}: {FOUND} ({adapters[FOUND]})" in lora_workers[0].log_tail(2000)


async def test_an_adapter_nobody_can_find_ends_with_an_error_naming_it(lora_client: InternalClient) -> None:
    with pytest.raises(RequestError) as refused:
        await lora_client.generate("Hello", model="no-such-adapter", max_tokens=2)
    assert refused.value.code == "invalid_request"
    assert "no-such-adapter" in str(refused.value)
    assert (await lora_client.generate("Hello", model=LISTED[0], max_tokens=2)).text  # the worker goes on


async def test_a_keys_allowed_models_name_adapters(lora_gateway: GatewayProcess, raw_redis: aioredis.Redis) -> None:
    name, store = f"lora-key-{uuid.uuid4().hex[:8]}", ApiKeyStore(raw_redis)
    secret = await store.create(KeyRecord(name, models=[LISTED[0]]))
    headers = {"Authorization": f"Bearer {secret}"}
    try:
        async with httpx.AsyncClient(base_url=lora_gateway.url, headers=headers, timeout=120) as http:
            listed = [card["id"] for card in (await http.get("/v1/models")).json()["data"]]
            body = {"prompt": "Hi", "max_tokens": 2}
            allowed = await http.post("/v1/completions", json={**body, "model": LISTED[0]})
            refused = await http.post("/v1/completions", json={**body, "model": LISTED[1]})
            base = await http.post("/v1/completions", json={**body, "model": BASE})
    finally:  # a key in Redis makes every gateway of the session ask for one
        await store.revoke(name)
    assert listed == [LISTED[0]]
    assert allowed.status_code == 200, allowed.text
    assert allowed.json()["model"] == LISTED[0]
    assert refused.status_code == base.status_code == 404, (refused.text, base.text)  # as for any model not allowed


def test_the_command_line_and_batch_files_name_adapters_as_models(
    lora_workers: list[WorkerProcess], producer_url: str, reference: dict[str, dict[str, dict]], tmp_path: Path
) -> None:
    """``--model`` and a batch line's ``model`` run under the adapter: its bare-engine text."""
    env = {**os.environ, "REDIS_URL": producer_url}
    prompt, name = PROMPTS[2], LISTED[0]
    sampling = ["--max-tokens", "24", "--temperature", "0", "--json"]
    cli = subprocess.run(
        [sys.executable, "-m", "producer", "--model", name, *sampling, prompt],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    chunks = [event for event in map(json.loads, cli.stdout.splitlines()) if event["type"] == "chunk"]
    streamed = ("".join(c["text"] for c in chunks), [t for c in chunks for t in c["token_ids"]])
    assert streamed == (reference[name][prompt]["text"], reference[name][prompt]["token_ids"])

    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {
            "custom_id": model,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0},
        }
        for model in (BASE, *LISTED)
    ]
    in_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch = subprocess.run(
        [sys.executable, "-m", "producer", "batch", str(in_path), str(out_path), "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert batch.returncode == 0, batch.stderr
    answered = [json.loads(line) for line in out_path.read_text().splitlines()]
    bodies = {line["custom_id"]: line["response"]["body"] for line in answered}
    for adapter, model in {"": BASE, **{n: n for n in LISTED}}.items():
        assert bodies[model]["model"] == model
        assert bodies[model]["choices"][0]["text"] == reference[adapter][prompt]["text"], model


async def test_a_request_under_an_adapter_is_taken_over_with_the_text_of_an_undisturbed_run(
    lora_workers: list[WorkerProcess], lora_client: InternalClient, raw_redis: aioredis.Redis
) -> None:
    """Last in the module: it kills the first worker."""
    doomed, survivor = lora_workers
    request = {"model": SHARED, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "affinity": False}
    request_id = f"lora-take-over-{uuid.uuid4().hex}"
    try:
        with paused(survivor):
            handle = await lora_client.submit(PROMPTS[1], request_id=request_id, **request)
            async with asyncio.timeout(120):
                while await raw_redis.xlen(events_channel(request_id)) < 25:
                    await asyncio.sleep(0.005)
            doomed.kill()
    finally:
        doomed.kill()
    taken_over = await handle.result()
    attempts = {json.loads(raw)["attempt"] for raw in await ReplayLog(raw_redis).read(request_id)}
    assert attempts == {1, 2}, "not interrupted mid-stream"
    calm = await lora_client.generate(PROMPTS[1], **request)
    assert pid_of(taken_over.worker_id) == pid_of(calm.worker_id) == survivor.process.pid  # type: ignore[union-attr]
    assert (taken_over.text, taken_over.token_ids) == (calm.text, calm.token_ids)
