"""Shared fixtures: a real Redis server, a tiny model, real worker processes.

An engine takes ~20 s to start, so workers are session-scoped and
shared; each test uses fresh request ids instead of flushing Redis under them.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer, free_port
from devkit.tiny_model import build_tiny_model
from devkit.worker_process import WorkerProcess, tiny_engine_flags, worker_env
from producer.internal_client import InternalClient
from streamq.broker.registry import WorkerRegistry
from streamq.env_vars import CALLBACK_SECRET_ENV, FILES_URL_ENV
from streamq.protocol import WorkerRegistration
from streamq.protocol.roles import GATEWAY, PRODUCER, WORKER
from tests.support.callback_receiver import CALLBACK_SECRET
from tests.support.reference_generate import bare_engine_outputs
from tests.support.session import MAX_MODEL_LEN, OPERATOR_KEY

# vLLM's CPU platform runs the model in a process of its own beside the engine core (its
# multiprocessing executor): a third Python process per engine, about 18 s of imports on a
# 2-core machine to start and 5 s to stop, for the suite's forty-odd engines. Every
# engine the suite starts (workers, `vllm serve`, the bare references: they inherit this
# environment) runs the model in its engine core instead: vLLM's single-process executor,
# which this variable selects on CPU. The engine core is still a process of its own (what
# the fault tests kill), and the model, scheduler and outputs are the same. Set it to 1 to
# run the suite on vLLM's default executor.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture
def garbage_collected() -> Iterator[None]:
    """The test's garbage collected as it ends, its frame gone: a connection it left open
    warns (an error, by the suite's filters) in this test, under this test's own filters,
    not in whichever later test the collector next happens to run in."""
    yield
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def shared_file_storage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every gateway of the session keeps the Batch API's files in one directory, as every
    gateway of a deployment shares one storage: any of them may run any batch on the
    session's Redis. A test that wants its own storage passes ``--files-url``."""
    directory = tmp_path_factory.mktemp("files")
    before = os.environ.get(FILES_URL_ENV)
    os.environ[FILES_URL_ENV] = str(directory)
    yield directory
    if before is None:
        os.environ.pop(FILES_URL_ENV, None)
    else:
        os.environ[FILES_URL_ENV] = before


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's Redis admits only ACL users with passwords: the harness's own
    (granted everything), and one per role of docs/internals.md ("Redis roles"), under which
    the session's workers, clients, CLI runs and gateways work."""
    with RedisServer(user="streamq", password=uuid.uuid4().hex) as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    """The harness's URL, granted everything: for what no component does (inspecting
    or faking what Redis holds, flushing)."""
    return redis_server.url


@pytest.fixture(scope="session")
def worker_url(redis_server: RedisServer) -> str:
    return redis_server.url_for(WORKER)


@pytest.fixture(scope="session")
def producer_url(redis_server: RedisServer) -> str:
    """The producer role's URL: the client library and the command line."""
    return redis_server.url_for(PRODUCER)


@pytest.fixture(scope="session")
def gateway_url(redis_server: RedisServer) -> str:
    return redis_server.url_for(GATEWAY)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _free_port() -> int:
    """A TCP port nothing uses now, from outside the range the kernel hands out
    (``devkit.redis_server.free_port``): the worker binds it only once its engine is up."""
    return free_port()


@pytest.fixture(scope="session")
def worker(worker_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One real ``python -m worker`` on the tiny model, shared by the session, as the worker role."""
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    # Callback retries back off from 0.5 s, not 2: the same doubling, five tries in 7.5 s, not 30.
    flags = tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN) + ["--callback-backoff-s", "0.5"]
    env = worker_env(**{CALLBACK_SECRET_ENV: CALLBACK_SECRET})  # signs completion callbacks
    process = WorkerProcess(worker_url, flags, log_path=log_path, metrics_port=_free_port(), env=env)
    process.start().wait_ready()
    yield process
    code = process.stop()
    assert code == 0, f"worker exited with {code}:\n{process.log_tail()}"


@pytest.fixture(scope="session")
def reference_outputs(tiny_model: Path, worker: WorkerProcess) -> dict[str, dict]:
    """What a bare AsyncLLM (vLLM's async_llm_streaming.py pattern) generates for the
    reference prompts; started after the session worker, so that the two engines do not
    start at once."""
    return bare_engine_outputs(tiny_model, MAX_MODEL_LEN)


@pytest.fixture
async def client(worker: WorkerProcess, producer_url: str) -> AsyncIterator[InternalClient]:
    """A client library as the producer role."""
    async with await InternalClient.connect(producer_url, queue=worker.queue) as client:
        yield client


@pytest.fixture
async def raw_redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain redis-py client, for checking what Redis itself holds."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def request_id() -> str:
    return f"test-{uuid.uuid4().hex}"


@pytest.fixture
async def parked_model(raw_redis: aioredis.Redis) -> AsyncIterator[WorkerRegistration]:
    """A model registered by a 'worker' that never takes jobs: its requests stay queued."""
    name = f"parked-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=name, model=name, queue=f"streamq:queue:{name}")
    registry = WorkerRegistry(raw_redis)
    await registry.register(registration, ttl_ms=600_000)
    yield registration
    await registry.unregister(registration)
    await raw_redis.delete(registration.queue)


@pytest.fixture(scope="module")
def gateway(
    worker: WorkerProcess, gateway_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A gateway as the gateway role, in front of the session worker (one per test module
    that asks: modules that need another gateway define their own)."""
    process = GatewayProcess(gateway_url, tmp_path_factory.mktemp("gateway") / "gateway.log").wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def keyed_gateway(
    worker: WorkerProcess, gateway_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A gateway that needs a key (``OPERATOR_KEY``, from its command line), as the gateway
    role, in front of the session worker."""
    log_path = tmp_path_factory.mktemp("keyed-gateway") / "gateway.log"
    process = GatewayProcess(gateway_url, log_path, "--api-key", OPERATOR_KEY).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> str:
    """The session worker's served model name: ``--model`` (no ``--served-model-name``)."""
    return str(tiny_model)


@pytest.fixture
def sdk(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    """The official OpenAI SDK on ``gateway``."""
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
