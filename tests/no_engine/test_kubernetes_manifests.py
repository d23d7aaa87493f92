"""deploy/kubernetes/ is valid for Kubernetes 1.34 and KEDA, and holds together: KEDA scales
the worker Deployment on streamq's queue keys, from zero; a worker's grace period covers its
drain; the probes ask the worker's metrics server; nothing runs as root; no secret is in a
committed file.

No cluster runs here. The overlay is rendered by the few kustomize features it uses
(``render``; where ``kubectl`` is installed, a test holds the result against ``kubectl
kustomize``), built-in kinds are checked by kubernetes-validate's schemas, KEDA's by its own
CRDs (``tests/support/keda/``), and KEDA's Redis script runs on a real Redis under the Redis
user docs/operations/kubernetes.md gives KEDA.
"""

from __future__ import annotations

import base64
import copy
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml
from redis.exceptions import NoPermissionError, ResponseError

from devkit.keda import LIST_LENGTH_SCRIPT
from devkit.redis_server import RedisServer
from streamq.protocol.names import DEFAULT_QUEUE, queue_waiting_key

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
BASE = DEPLOY / "base"
OVERLAY = DEPLOY / "overlays" / "example"
SECRETS_ENV = OVERLAY / "secrets.env"
SECRETS_EXAMPLE = OVERLAY / "secrets.env.example"
KEDA = ROOT / "tests" / "support" / "keda"
DOC = ROOT / "docs" / "operations" / "kubernetes.md"
KUBERNETES_VERSION = "1.34.0"
WAITING_KEY = queue_waiting_key(DEFAULT_QUEUE)
METRICS_PORT = 9400  # the worker's --metrics-port default
SECRET_NAME = "streamq-secrets"
# What secrets.env holds in these tests: values no committed file may contain.
SECRET_VALUES = {
    "redis-password": "0f1e2d3c4b5a69788796a5b4c3d2e1f0",
    "redis-url": "redis://:0f1e2d3c4b5a69788796a5b4c3d2e1f0@redis:6379",
    "api-keys": "sq-kubernetes-test-1,sq-kubernetes-test-2",
    "hf-token": "hf_kubernetesTestToken",
}
SECRET_ENV_NAMES = {"REDIS_URL", "STREAMQ_API_KEYS", "HF_TOKEN", "REDIS_PASSWORD", "REDISCLI_AUTH"}
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
CLUSTER_SCOPED = {"Namespace"}
# The metadata KEDA's redis scaler reads (the `keda:"name=..."` tags of redisMetadata and
# redisConnectionInfo, pkg/scalers/redis_scaler.go), and `<name>FromEnv` for those it may
# also take from the target's environment. KEDA ignores any other key without a word.
REDIS_SCALER_METADATA = {
    "listName", "listLength", "activationListLength", "databaseIndex", "enableTLS", "unsafeSsl",
    "address", "addresses", "host", "hosts", "port", "ports", "username", "password",
    "sentinelUsername", "sentinelPassword", "sentinelMaster",
    "addressFromEnv", "addressesFromEnv", "hostFromEnv", "hostsFromEnv", "portFromEnv", "portsFromEnv",
    "usernameFromEnv", "passwordFromEnv", "sentinelUsernameFromEnv", "sentinelPasswordFromEnv",
    "sentinelMasterFromEnv",
}  # fmt: skip
# The Redis user docs/operations/kubernetes.md gives KEDA: PING when it connects, then EVAL of
# its script, which calls TYPE, then ZCARD (a sorted set) or LLEN (an absent key), on the two keys.
KEDA_ACL_RULES = f"+ping +eval +type +zcard +llen ~{DEFAULT_QUEUE} ~{WAITING_KEY}"

# --- rendering -------------------------------------------------------------------------

KUSTOMIZE_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "components",
    "images",
    "patches",
    "secretGenerator",
}


def render(directory: Path, files: Mapping[Path, str], kustomization: dict[str, Any] | None = None) -> list[Any]:
    """The objects ``kubectl kustomize directory`` prints, for the kustomize features these
    files use (any other fails the test): resources and components, a secretGenerator of env
    files with fixed names, JSON 6902 patches by kind and name, images, namespace. ``files``
    stands in for files that are not committed (secrets.env)."""
    spec = kustomization or yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(spec) - KUSTOMIZE_FIELDS
    assert not unsupported, f"{directory}: kustomize fields this test does not apply: {sorted(unsupported)}"
    objects: list[Any] = []
    for entry in spec.get("resources", []) + spec.get("components", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path, files)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for generator in spec.get("secretGenerator", []):
        objects.append(generated_secret(directory, generator, files))
    for patch in spec.get("patches", []):
        targets = [
            obj
            for obj in objects
            if obj["kind"] == patch["target"]["kind"] and obj["metadata"]["name"] == patch["target"]["name"]
        ]
        assert len(targets) == 1, f"patch target {patch['target']} matches {len(targets)} objects"
        for operation in yaml.safe_load(patch["patch"]):
            apply_operation(targets[0], operation)
    for image in spec.get("images", []):
        for obj in objects:
            for container in containers(obj):
                name = re.split(r"[:@]", container["image"], maxsplit=1)[0]
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    return objects


def generated_secret(directory: Path, generator: dict[str, Any], files: Mapping[Path, str]) -> dict[str, Any]:
    assert set(generator) <= {"name", "envs", "options"}, generator
    # A fixed name: the TriggerAuthentication names the Secret, and kustomize renames only
    # the references of built-in kinds to a hashed name.
    assert generator["options"] == {"disableNameSuffixHash": True}
    data = {}
    for env in generator["envs"]:
        path = directory / env
        text = files[path] if path in files else path.read_text()
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                key, _, value = line.partition("=")
                data[key.strip()] = base64.b64encode(value.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": generator["name"]},
        "type": "Opaque",
        "data": data,
    }


def apply_operation(obj: dict[str, Any], operation: dict[str, Any]) -> None:
    """One JSON 6902 ``replace`` or ``add`` (the two the overlay uses)."""
    assert operation["op"] in {"replace", "add"}, operation
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    for part in parents:
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    if operation["op"] == "replace":
        assert last in obj, f"{operation['path']} is not there to replace"
    obj[last] = operation["value"]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    template = obj.get("spec", {}).get("template") if obj["kind"] in {"Deployment", "StatefulSet"} else None
    return template["spec"] if template else None


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    return [] if spec is None else spec.get("initContainers", []) + spec["containers"]


def example_lines() -> dict[str, str]:
    """The keys secrets.env.example lists, and their values."""
    lines = SECRETS_EXAMPLE.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if re.match(r"[a-z-]+=", line))


def secrets_env() -> str:
    """secrets.env as a deployment fills it in: the example with every value set."""
    lines = SECRETS_EXAMPLE.read_text().splitlines()
    return "\n".join(
        f"{line.split('=', 1)[0]}={SECRET_VALUES[line.split('=', 1)[0]]}" if re.match(r"[a-z-]+=", line) else line
        for line in lines
    )


@pytest.fixture(scope="module")
def overlay() -> list[Any]:
    return render(OVERLAY, {SECRETS_ENV: secrets_env()})


@pytest.fixture(scope="module")
def base() -> list[Any]:
    return render(BASE, {})


def find(objects: list[Any], kind: str, name: str) -> dict[str, Any]:
    found = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    only: dict[str, Any] = found[0]
    return only


def container(objects: list[Any], kind: str, name: str) -> dict[str, Any]:
    (only,) = containers(find(objects, kind, name))
    return only


def command(container: dict[str, Any]) -> list[str]:
    return list(container.get("command", [])) + list(container.get("args", []))


def flag(container: dict[str, Any], name: str) -> str | None:
    line = command(container)
    return line[line.index(name) + 1] if name in line else None


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(number)


def committed_yaml() -> list[Path]:
    return sorted(DEPLOY.rglob("*.yaml"))


# --- the files as Kubernetes and KEDA read them ------------------------------------------


def test_the_overlay_renders_as_kubectl_kustomize_renders_it(overlay: list[Any], tmp_path: Path) -> None:
    # Holds `render` to kustomize itself, where kubectl (which includes it) is installed.
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (the checks below use the test's own rendering)")
    shutil.copytree(DEPLOY, tmp_path / "kubernetes")
    (tmp_path / "kubernetes" / "overlays" / "example" / "secrets.env").write_text(secrets_env())
    result = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path / "kubernetes" / "overlays" / "example")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr

    def by_name(objects: list[Any]) -> dict[tuple[str, str], Any]:
        # A Secret's values compared decoded: kustomize wraps long base64 lines.
        return {
            (obj["kind"], obj["metadata"]["name"]): obj
            if obj["kind"] != "Secret"
            else {**obj, "data": {key: base64.b64decode(value) for key, value in obj["data"].items()}}
            for obj in objects
        }

    assert by_name(list(yaml.safe_load_all(result.stdout))) == by_name(overlay)


@pytest.mark.parametrize("rendering", ["overlay", "base"])
def test_every_built_in_object_is_valid_for_kubernetes_1_34(rendering: str, request: pytest.FixtureRequest) -> None:
    objects = request.getfixturevalue(rendering)
    built_in = [obj for obj in objects if obj["kind"] not in KEDA_KINDS]
    assert {"Deployment", "PodDisruptionBudget", "Service", "ConfigMap"} <= {obj["kind"] for obj in built_in}
    for obj in built_in:
        # Strict: a field Kubernetes does not know fails, as `kubectl apply` refuses it.
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def keda_schema(kind: str) -> dict[str, Any]:
    """The v1alpha1 schema of KEDA's CRD for ``kind``, strict as the API server's field
    validation is: a field a schema does not list is an error."""
    crd = yaml.safe_load((KEDA / f"keda.sh_{kind.lower()}s.yaml").read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema: dict[str, Any] = copy.deepcopy(version["schema"]["openAPIV3Schema"])

    def strict(node: Any) -> None:
        if isinstance(node, dict):
            listed = "properties" in node and "additionalProperties" not in node
            if listed and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)

    strict(schema)
    return schema


@pytest.mark.parametrize("rendering", ["overlay", "base"])
def test_the_keda_objects_are_valid_for_kedas_crds(rendering: str, request: pytest.FixtureRequest) -> None:
    objects = request.getfixturevalue(rendering)
    keda = [obj for obj in objects if obj["kind"] in KEDA_KINDS]
    assert {obj["kind"] for obj in keda} == KEDA_KINDS
    for obj in keda:
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        jsonschema.validate(obj, keda_schema(obj["kind"]))


def test_the_keda_schemas_refuse_a_field_keda_does_not_know(overlay: list[Any]) -> None:
    scaled = copy.deepcopy(find(overlay, "ScaledObject", "streamq-worker"))
    scaled["spec"]["minReplicas"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, keda_schema("ScaledObject"))


def test_min_replicas_do_not_exceed_max_replicas(overlay: list[Any]) -> None:
    # The CRD's CEL rule (x-kubernetes-validations), which jsonschema does not run.
    spec = find(overlay, "ScaledObject", "streamq-worker")["spec"]
    assert spec["minReplicaCount"] <= spec.get("maxReplicaCount", 100)


# --- what scales on what -------------------------------------------------------------------


def redis_triggers(objects: list[Any]) -> list[dict[str, Any]]:
    triggers: list[dict[str, Any]] = find(objects, "ScaledObject", "streamq-worker")["spec"]["triggers"]
    assert {trigger["type"] for trigger in triggers} == {"redis"}
    return triggers


def test_the_scaled_object_scales_the_worker_deployment(overlay: list[Any]) -> None:
    target = find(overlay, "ScaledObject", "streamq-worker")["spec"]["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    worker = find(overlay, "Deployment", target["name"])
    assert containers(worker)[0]["command"][:3] == ["python", "-m", "worker"]
    # The HPA that KEDA makes owns the replica count: an apply must not reset it.
    assert "replicas" not in worker["spec"]


def test_workers_scale_to_zero_and_any_request_wakes_the_first(overlay: list[Any]) -> None:
    spec = find(overlay, "ScaledObject", "streamq-worker")["spec"]
    assert spec["minReplicaCount"] == 0
    assert spec["maxReplicaCount"] == 4
    assert spec["pollingInterval"] == 15
    assert spec["cooldownPeriod"] == 300
    for trigger in redis_triggers(overlay):
        assert trigger["metadata"]["activationListLength"] == "0"


def test_the_triggers_read_the_waiting_key_and_the_queue(overlay: list[Any]) -> None:
    lengths = {t["metadata"]["listName"]: t["metadata"]["listLength"] for t in redis_triggers(overlay)}
    # One worker per 8 waiting requests; and one per 64 waiting or running, which keeps the
    # last worker while a request still runs.
    assert lengths == {WAITING_KEY: "8", DEFAULT_QUEUE: "64"}


def test_the_triggers_use_only_metadata_kedas_redis_scaler_reads(overlay: list[Any]) -> None:
    for trigger in redis_triggers(overlay):
        assert set(trigger["metadata"]) <= REDIS_SCALER_METADATA, trigger["metadata"]
        assert all(isinstance(value, str) for value in trigger["metadata"].values())


def test_keda_reaches_the_redis_service_of_the_namespace(overlay: list[Any]) -> None:
    # KEDA's operator runs in its own namespace, so the address must name this one.
    namespace = find(overlay, "Deployment", "streamq-worker")["metadata"]["namespace"]
    service = find(overlay, "Service", "redis")
    assert service["metadata"]["namespace"] == namespace
    for trigger in redis_triggers(overlay):
        host, _, port = trigger["metadata"]["address"].rpartition(":")
        assert host in {f"redis.{namespace}.svc", f"redis.{namespace}.svc.cluster.local"}
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}


def test_keda_logs_in_with_the_password_from_the_secret(overlay: list[Any]) -> None:
    for trigger in redis_triggers(overlay):
        assert not {"password", "passwordFromEnv"} & set(trigger["metadata"])
        authentication = find(overlay, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        refs = {ref["parameter"]: ref for ref in authentication["spec"]["secretTargetRef"]}
        assert refs["password"]["name"] == SECRET_NAME
        assert refs["password"]["key"] == "redis-password"
        secret = find(overlay, "Secret", SECRET_NAME)
        assert base64.b64decode(secret["data"]["redis-password"]).decode() == SECRET_VALUES["redis-password"]


# --- workers: stopping, probes, GPU ------------------------------------------------------


def test_the_grace_period_covers_the_drain_and_the_hand_back(overlay: list[Any]) -> None:
    worker = container(overlay, "Deployment", "streamq-worker")
    drain_seconds = int(flag(worker, "--drain-seconds") or 30)
    grace = pod_spec(find(overlay, "Deployment", "streamq-worker"))["terminationGracePeriodSeconds"]  # type: ignore[index]
    # Drain, then 30 s to hand the rest back to the queue and shut the engine down.
    assert grace >= drain_seconds + 30


def test_workers_drain_on_sigterm_without_a_pre_stop_hook(overlay: list[Any]) -> None:
    # The worker drains on SIGTERM itself, and no Service routes to it: a preStop hook would
    # only take time from the drain.
    assert "lifecycle" not in container(overlay, "Deployment", "streamq-worker")


def test_worker_probes_ask_the_metrics_server_for_ready_and_health(overlay: list[Any]) -> None:
    worker = container(overlay, "Deployment", "streamq-worker")
    port = int(flag(worker, "--metrics-port") or METRICS_PORT)
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = worker[probe]["httpGet"]
        assert port_number(worker, get["port"]) == port, probe
        paths[probe] = get["path"]
    assert paths == {"startupProbe": "/ready", "readinessProbe": "/ready", "livenessProbe": "/health"}
    annotations = find(overlay, "Deployment", "streamq-worker")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)


def test_the_startup_probe_waits_out_a_long_model_load(overlay: list[Any]) -> None:
    deployment = find(overlay, "Deployment", "streamq-worker")
    startup = container(overlay, "Deployment", "streamq-worker")["startupProbe"]
    budget_s = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert budget_s >= 600  # a large model takes 10+ minutes to download and load
    # ...and a rollout still loading its model is not reported as failed.
    assert deployment["spec"]["progressDeadlineSeconds"] > budget_s


def test_each_worker_gets_a_gpu_shared_memory_and_a_model_cache(overlay: list[Any]) -> None:
    worker = container(overlay, "Deployment", "streamq-worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    volumes = {v["name"]: v for v in pod_spec(find(overlay, "Deployment", "streamq-worker"))["volumes"]}  # type: ignore[index]
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes[mounts["/home/streamq/.cache/huggingface"]]


def test_the_model_reaches_the_worker_and_the_gateway(overlay: list[Any]) -> None:
    model = find(overlay, "ConfigMap", "streamq-config")["data"]["model"]
    assert model == "Qwen/Qwen2.5-0.5B-Instruct"
    worker = container(overlay, "Deployment", "streamq-worker")
    assert flag(worker, "--model") == "$(MODEL)"
    gateway = container(overlay, "Deployment", "streamq-gateway")
    for each, name in ((worker, "MODEL"), (gateway, "STREAMQ_DECLARED_MODELS")):
        (env,) = [e for e in each["env"] if e["name"] == name]
        assert env["valueFrom"]["configMapKeyRef"] == {"name": "streamq-config", "key": "model"}


def test_the_overlay_sets_the_namespace_and_the_image(overlay: list[Any]) -> None:
    namespace = find(overlay, "Namespace", "streamq")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert {obj["metadata"].get("namespace") for obj in overlay if obj["kind"] != "Namespace"} == {"streamq"}
    images = {c["image"] for obj in overlay for c in containers(obj)}
    assert images == {"registry.example.com/streamq:0.1.0", "redis:7-alpine"}


# --- the gateway --------------------------------------------------------------------------


def test_the_gateway_serves_with_health_probes_and_a_pre_stop_pause(overlay: list[Any]) -> None:
    gateway = container(overlay, "Deployment", "streamq-gateway")
    assert command(gateway) == ["python", "-m", "gateway", "--host", "0.0.0.0", "--port", "8000"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"  # out of the Service while Redis is away
    assert port_number(gateway, gateway["readinessProbe"]["httpGet"]["port"]) == 8000
    assert port_number(gateway, gateway["livenessProbe"]["tcpSocket"]["port"]) == 8000  # never restarted for it
    pause_s = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause_s == 5
    grace = pod_spec(find(overlay, "Deployment", "streamq-gateway"))["terminationGracePeriodSeconds"]  # type: ignore[index]
    assert grace >= pause_s + 5  # uvicorn's own graceful shutdown takes up to 5 s
    service = find(overlay, "Service", "streamq-gateway")
    assert [p["port"] for p in service["spec"]["ports"]] == [8000]


def test_node_drains_take_one_worker_and_one_gateway_at_a_time(overlay: list[Any]) -> None:
    for name in ("streamq-worker", "streamq-gateway"):
        budget = find(overlay, "PodDisruptionBudget", name)["spec"]
        labels = find(overlay, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert budget["maxUnavailable"] == 1
        assert budget["selector"]["matchLabels"].items() <= labels.items()


# --- Redis ---------------------------------------------------------------------------------


def test_redis_never_evicts_and_persists_every_write(overlay: list[Any]) -> None:
    redis_container = container(overlay, "StatefulSet", "redis")
    line = command(redis_container)
    flags = line[line.index("redis-server") + 1 :]
    options = dict(zip(flags[::2], flags[1::2], strict=True))
    assert options["--appendonly"] == "yes"
    assert options["--appendfsync"] == "everysec"
    assert options["--save"] == ""
    assert options["--maxmemory-policy"] == "noeviction"
    assert options["--dir"] == "/data"
    # Below the memory limit: full, Redis refuses writes instead of being killed.
    assert int(options["--maxmemory"].removesuffix("mb")) * 2**20 < 2 * 2**30
    assert redis_container["resources"]["limits"]["memory"] == "2Gi"
    statefulset = find(overlay, "StatefulSet", "redis")
    assert statefulset["spec"]["replicas"] == 1
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in redis_container["volumeMounts"]


def test_redis_takes_its_password_from_the_secret_and_not_on_its_command_line(overlay: list[Any]) -> None:
    redis_container = container(overlay, "StatefulSet", "redis")
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis_container["env"]}
    assert env["REDIS_PASSWORD"] == {"name": SECRET_NAME, "key": "redis-password"}
    assert not any("$(" in part for part in command(redis_container))  # no Kubernetes expansion into argv
    assert "requirepass" in " ".join(command(redis_container))


def test_the_external_redis_layout_drops_the_bundled_one(overlay: list[Any]) -> None:
    # docs/operations/kubernetes.md: an overlay without the redis component deploys no Redis.
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    kustomization.pop("components")
    objects = render(OVERLAY, {SECRETS_ENV: secrets_env()}, kustomization)
    assert not [obj for obj in objects if obj["metadata"]["name"] == "redis"]
    assert {(obj["kind"], obj["metadata"]["name"]) for obj in objects} == {
        (obj["kind"], obj["metadata"]["name"]) for obj in overlay if obj["metadata"]["name"] != "redis"
    }


# --- privileges and secrets ------------------------------------------------------------------


def test_every_container_runs_as_non_root_without_privileges(overlay: list[Any]) -> None:
    # The `restricted` Pod Security Standard, which the namespace enforces.
    with_pods = [obj for obj in overlay if pod_spec(obj) is not None]
    assert len(with_pods) == 3
    for obj in with_pods:
        spec = pod_spec(obj)
        assert spec is not None
        pod = spec.get("securityContext", {})
        assert spec.get("automountServiceAccountToken") is False
        for each in containers(obj):
            context = {**pod, **each.get("securityContext", {})}
            where = f"{obj['kind']}/{obj['metadata']['name']}: {each['name']}"
            assert context["runAsNonRoot"] is True, where
            assert context["runAsUser"] != 0, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in context["capabilities"], where
            assert context["seccompProfile"]["type"] == "RuntimeDefault", where
            assert context["readOnlyRootFilesystem"] is True, where
            assert not each.get("securityContext", {}).get("privileged"), where
    # streamq's image runs as its user `streamq` (Dockerfile: useradd --uid 10001).
    assert "--uid 10001" in (ROOT / "Dockerfile").read_text()
    for name in ("streamq-worker", "streamq-gateway"):
        assert pod_spec(find(overlay, "Deployment", name))["securityContext"]["runAsUser"] == 10001  # type: ignore[index]


def test_every_container_has_requests_and_a_memory_limit(overlay: list[Any]) -> None:
    for obj in overlay:
        for each in containers(obj):
            resources = each["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), each["name"]
            assert "memory" in resources["limits"], each["name"]


def test_every_secret_comes_from_the_secret_by_reference(overlay: list[Any]) -> None:
    referenced = set()
    for obj in overlay:
        for each in containers(obj):
            for env in each.get("env", []):
                if env["name"] in SECRET_ENV_NAMES:
                    assert "value" not in env, f"{env['name']} is written into the manifest"
                    ref = env["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == SECRET_NAME
                    referenced.add(ref["key"])
    for ref in find(overlay, "TriggerAuthentication", "streamq-redis")["spec"]["secretTargetRef"]:
        referenced.add(ref["key"])
    # Every key the manifests name is one secrets.env.example lists, and it lists no other.
    assert referenced == set(example_lines()) == set(SECRET_VALUES)
    # Only hf-token may be missing.
    optional = {
        env["valueFrom"]["secretKeyRef"]["key"]
        for obj in overlay
        for each in containers(obj)
        for env in each.get("env", [])
        if env.get("valueFrom", {}).get("secretKeyRef", {}).get("optional")
    }
    assert optional == {"hf-token"}


def test_no_secret_value_is_in_a_committed_file(overlay: list[Any]) -> None:
    committed = committed_yaml() + [SECRETS_EXAMPLE]
    texts = {path: path.read_text() for path in committed}
    for path, text in texts.items():
        for value in SECRET_VALUES.values():
            assert value not in text, f"{path} holds a secret"
        # A Redis URL with a password in it (redis://user:password@ or redis://:password@).
        assert not re.search(r"rediss?://[^\s@/]*:[^\s@/<]+@", text), f"{path} holds a Redis password"
    for path in committed_yaml():
        kinds = [doc["kind"] for doc in yaml.safe_load_all(path.read_text()) if doc]
        assert "Secret" not in kinds, f"{path} commits a Secret"
    # The example's every value is empty, as .env.example's are.
    assert all(value == "" for value in example_lines().values())
    # The one place the values go: the generated Secret.
    secret = find(overlay, "Secret", SECRET_NAME)
    assert {key: base64.b64decode(value).decode() for key, value in secret["data"].items()} == SECRET_VALUES


def test_the_secret_env_file_is_git_ignored() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", "-q", str(SECRETS_ENV.relative_to(ROOT))],
        timeout=10,
    )
    assert result.returncode == 0, f"{SECRETS_ENV.relative_to(ROOT)} is not git-ignored"


# --- KEDA's Redis user ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def keda_user() -> Iterator[tuple[redis.Redis, redis.Redis]]:
    """An admin connection to a Redis of the test's own (the queue keys are real streamq
    names), and one as a Redis user with exactly KEDA's rules."""
    name, password = "keda", uuid.uuid4().hex
    with RedisServer() as server:
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *KEDA_ACL_RULES.split())
        keda = redis.Redis(host="127.0.0.1", port=server.port, username=name, password=password)
        try:
            yield admin, keda
        finally:
            keda.close()
            admin.close()


def test_the_documented_keda_user_can_run_kedas_script_and_nothing_else(
    keda_user: tuple[redis.Redis, redis.Redis],
) -> None:
    assert f"`{KEDA_ACL_RULES}`" in DOC.read_text()
    admin, keda = keda_user
    script = LIST_LENGTH_SCRIPT

    def size(key: str) -> Any:
        return keda.eval(script, 1, key)

    assert keda.ping()
    # No key yet (an empty sorted set is deleted): KEDA's script takes its LLEN branch.
    for key in (WAITING_KEY, DEFAULT_QUEUE):
        assert size(key) == 0
    admin.zadd(DEFAULT_QUEUE, {"req-a": 1, "req-b": 2, "req-c": 3})
    admin.zadd(WAITING_KEY, {"req-c": 3})
    assert size(WAITING_KEY) == 1
    assert size(DEFAULT_QUEUE) == 3
    with pytest.raises(ResponseError):  # a script's call on another key: "ACL failure in script" or NOPERM
        size("arq:job:req-a")
    with pytest.raises(NoPermissionError):
        keda.zrange(DEFAULT_QUEUE, 0, -1)
