"""docker-compose.yml is valid and describes a scalable, hardened deployment.

No Docker engine runs here; Debian's docker-compose still parses and validates
the file (``docker-compose config``). CI installs it; a developer machine without
it skips, CI does not. The secrets come from an env file, as ``.env`` gives them
in a deployment (``.env.example`` lists them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
REDIS_PASSWORD = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
API_KEYS = "sq-compose-test-1,sq-compose-test-2"
SECRETS = {"REDIS_PASSWORD": REDIS_PASSWORD, "STREAMQ_API_KEYS": API_KEYS}
REDIS_URL = f"redis://:{REDIS_PASSWORD}@redis:6379"


def compose(env_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``docker-compose`` on the project's file with ``env_file`` as its .env, and no secret from this shell."""
    if shutil.which("docker-compose") is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed; .ci/run installs it")
        pytest.skip("docker-compose is not installed")
    environ = {name: value for name, value in os.environ.items() if name not in SECRETS}
    return subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), "--env-file", str(env_file), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environ,
    )


@pytest.fixture(scope="module")
def compose_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env_file = tmp_path_factory.mktemp("compose") / ".env"
    env_file.write_text("".join(f"{name}={value}\n" for name, value in SECRETS.items()))
    result = compose(env_file, "--profile", "example", "--profile", "monitoring", "config")
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
    assert worker["environment"]["REDIS_URL"] == REDIS_URL
    assert worker["command"][:3] == ["python", "-m", "worker"]


def test_workers_reserve_a_gpu(compose_config: dict[str, Any]) -> None:
    devices = compose_config["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_producer_example_runs_the_cli(compose_config: dict[str, Any]) -> None:
    producer = compose_config["services"]["producer"]
    assert producer["entrypoint"] == ["python", "-m", "producer"]
    assert producer["environment"]["REDIS_URL"] == REDIS_URL


def test_gateway_serves_the_openai_api_with_a_health_check(compose_config: dict[str, Any]) -> None:
    gateway = compose_config["services"]["gateway"]
    assert gateway["command"][:3] == ["python", "-m", "gateway"]
    assert gateway["environment"]["REDIS_URL"] == REDIS_URL
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["restart"] == "unless-stopped"


def _redis_options(compose_config: dict[str, Any]) -> dict[str, str]:
    redis = compose_config["services"]["redis"]
    assert redis["entrypoint"][-1] == "redis-server"  # the flags below are redis-server's
    flags = redis["command"]
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


def test_every_secret_is_required_and_none_is_in_the_file(tmp_path: Path) -> None:
    text = COMPOSE_FILE.read_text()
    assert REDIS_PASSWORD not in text
    for name in SECRETS:
        assert re.search(rf"\$\{{{name}:\?", text), f"${name} is not required"
        others = "".join(f"{other}={value}\n" for other, value in SECRETS.items() if other != name)
        (tmp_path / ".env").write_text(others)
        result = compose(tmp_path / ".env", "config")
        assert result.returncode != 0 and name in result.stderr, f"compose starts without ${name}"


def test_env_example_names_every_secret_and_env_is_not_committed() -> None:
    example = (ROOT / ".env.example").read_text()
    for name in SECRETS:
        assert re.search(rf"^{name}=$", example, re.MULTILINE), f".env.example does not list {name} (empty)"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT, check=False)
    assert ignored.returncode == 0, ".env is not git-ignored"


def test_redis_requires_the_password_and_publishes_no_port(compose_config: dict[str, Any]) -> None:
    redis = compose_config["services"]["redis"]
    assert "ports" not in redis
    assert redis["environment"]["REDIS_PASSWORD"] == REDIS_PASSWORD
    script = redis["entrypoint"][2]
    assert "requirepass" in script and "REDIS_PASSWORD" in script
    assert REDIS_PASSWORD not in " ".join(redis["command"])  # never on a command line
    assert "PONG" in " ".join(redis["healthcheck"]["test"])  # NOAUTH is not healthy


def test_redis_is_reachable_on_the_internal_network_only(compose_config: dict[str, Any]) -> None:
    assert set(compose_config["services"]["redis"]["networks"]) == {"backend"}
    assert compose_config["networks"]["backend"]["internal"] is True


def test_the_gateway_is_the_only_port_published_beyond_this_host(compose_config: dict[str, Any]) -> None:
    published = {
        name: [str(port) for port in service.get("ports", [])]
        for name, service in compose_config["services"].items()
        if service.get("ports")
    }
    wide = {name for name, ports in published.items() if any(not p.startswith("127.0.0.1:") for p in ports)}
    assert wide <= {"gateway"}, f"published beyond loopback: {published}"
    assert published["gateway"] == ["127.0.0.1:8000:8000/tcp"]  # wider only by GATEWAY_ADDRESS
    assert "backend" in compose_config["services"]["gateway"]["networks"]


def test_the_gateway_requires_an_api_key(compose_config: dict[str, Any]) -> None:
    gateway = compose_config["services"]["gateway"]
    assert gateway["environment"]["STREAMQ_API_KEYS"] == API_KEYS
    assert "--api-key" not in gateway["command"]  # keys stay off the command line


def test_workers_and_the_gateway_run_as_an_unprivileged_user(compose_config: dict[str, Any]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
    assert users and users[-1] not in ("root", "0"), "the image runs as root"
    for name in ("worker", "gateway", "producer"):
        assert compose_config["services"][name].get("user", users[-1]) not in ("root", "0"), name


def test_the_model_cache_is_in_the_unprivileged_users_home(compose_config: dict[str, Any]) -> None:
    volumes = compose_config["services"]["worker"]["volumes"]
    targets = [v["target"] if isinstance(v, dict) else v.split(":")[1] for v in volumes]
    assert "/home/streamq/.cache/huggingface" in targets


def test_the_cluster_override_puts_the_data_plane_on_a_redis_cluster(tmp_path: Path) -> None:
    """``deploy/docker-compose.cluster.yml`` over the base file: six cluster nodes joined
    once as 3 primaries with a replica each, and every component told where they are."""
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{name}={value}\n" for name, value in SECRETS.items()))
    override = ROOT / "deploy" / "docker-compose.cluster.yml"
    result = compose(env_file, "-f", str(override), "--profile", "example", "config")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    nodes = [name for name in services if name.startswith("redis-node-")]
    assert len(nodes) == 6
    for name in nodes:
        assert services[name]["command"][:2] == ["--cluster-enabled", "yes"]
        assert "ports" not in services[name]  # on the internal network only, as `redis`
    assert "--cluster-replicas 1" in " ".join(services["cluster-init"]["entrypoint"])
    for component in ("worker", "gateway", "producer"):
        environment = services[component]["environment"]
        assert environment["REDIS_URL"] == REDIS_URL
        assert environment["STREAMQ_EVENTS_REDIS_URL"].startswith(
            f"redis+cluster://:{REDIS_PASSWORD}@redis-node-1:6379"
        )
        assert services[component]["depends_on"]["cluster-init"]["condition"] == "service_completed_successfully"
