"""The Prometheus config, the compose service and the Grafana dashboard match the
metrics the worker defines (no engine, no Redis: they are files)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import REGISTRY, generate_latest

from worker.metrics import DEFAULT_METRICS_PORT

ROOT = Path(__file__).parents[2]


def test_prometheus_scrapes_every_worker_replica_on_the_metrics_port() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "streamq-worker")
    assert job["dns_sd_configs"] == [
        {"names": ["worker"], "type": "A", "port": DEFAULT_METRICS_PORT, "refresh_interval": "10s"}
    ]


def test_prometheus_scrapes_every_gateway_replica_on_its_api_port() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "streamq-gateway")
    gateway = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["gateway"]
    port = int(gateway["command"][gateway["command"].index("--port") + 1])
    assert job["dns_sd_configs"] == [{"names": ["gateway"], "type": "A", "port": port, "refresh_interval": "10s"}]


def test_compose_runs_prometheus_with_that_config() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    prometheus = compose["services"]["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert prometheus["healthcheck"] and prometheus["restart"] == "unless-stopped"


def test_dashboard_queries_only_metrics_the_worker_defines() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {re.sub(r"_(bucket|sum|count|total)$", "", name) for e in exprs for name in re.findall(r"streamq_\w+", e)}
    exposed = generate_latest(REGISTRY).decode()
    missing = sorted(name for name in used if not re.search(rf"^# TYPE {name}(_total)? ", exposed, re.MULTILINE))
    assert used and not missing, f"the dashboard queries metrics nobody defines: {missing}"
