"""docker-compose.yml is valid and describes a scalable deployment.

No Docker engine runs here; Debian's docker-compose still parses and validates
the file (``docker-compose config``). CI installs it; a developer machine without
it skips, CI does not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

COMPOSE_FILE = Path(__file__).parents[2] / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose_config() -> dict[str, Any]:
    if shutil.which("docker-compose") is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed; .ci/run installs it")
        pytest.skip("docker-compose is not installed")
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), "config"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


def test_compose_defines_redis_workers_and_a_producer(compose_config: dict[str, Any]) -> None:
    assert {"redis", "worker", "producer"} <= set(compose_config["services"])


def test_workers_can_scale_out(compose_config: dict[str, Any]) -> None:
    worker = compose_config["services"]["worker"]
    # A fixed container name or host port would make `--scale worker=N` fail.
    assert "container_name" not in worker
    assert "ports" not in worker
    assert worker["environment"]["REDIS_URL"] == "redis://redis:6379"
    assert worker["command"][:3] == ["python", "-m", "worker"]


def test_workers_reserve_a_gpu(compose_config: dict[str, Any]) -> None:
    devices = compose_config["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_producer_example_runs_the_cli(compose_config: dict[str, Any]) -> None:
    producer = compose_config["services"]["producer"]
    assert producer["entrypoint"] == ["python", "-m", "producer"]
    assert producer["environment"]["REDIS_URL"] == "redis://redis:6379"


def test_gateway_serves_the_openai_api_with_a_health_check(compose_config: dict[str, Any]) -> None:
    gateway = compose_config["services"]["gateway"]
    assert gateway["command"][:3] == ["python", "-m", "gateway"]
    assert gateway["environment"]["REDIS_URL"] == "redis://redis:6379"
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["restart"] == "unless-stopped"


def _redis_options(compose_config: dict[str, Any]) -> dict[str, str]:
    command = compose_config["services"]["redis"]["command"]
    assert command[0] == "redis-server"
    flags = command[1:]
    return {flag.removeprefix("--"): value for flag, value in zip(flags[::2], flags[1::2], strict=True)}


def test_redis_never_evicts(compose_config: dict[str, Any]) -> None:
    # An evicted job, lease or log entry is a request lost or a stream cut short.
    assert _redis_options(compose_config)["maxmemory-policy"] == "noeviction"


def test_redis_persists_to_an_append_only_file_on_a_volume(compose_config: dict[str, Any]) -> None:
    # A restart keeps queued jobs: every write in the AOF, fsynced each second, on a named volume.
    options = _redis_options(compose_config)
    assert options["appendonly"] == "yes"
    assert options["appendfsync"] == "everysec"
    redis = compose_config["services"]["redis"]
    data = [v for v in redis["volumes"] if (v["target"] if isinstance(v, dict) else v.split(":")[1]) == "/data"]
    assert data, "the Redis data directory is not on a volume"
    source = data[0]["source"] if isinstance(data[0], dict) else data[0].split(":")[0]
    assert source in compose_config["volumes"]
