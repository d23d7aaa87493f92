"""Usage per API key on the gateway's ``/metrics``: requests, prompt and completion tokens
by key name (never the secret) and model.

The totals live in Redis (``streamq:key-usage:<name>``, written by every gateway when a
request ends), so each replica reports the same deployment-wide figures, read at scrape
time: scrape one replica for them, or take ``max`` across replicas, not ``sum``.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from streamq.broker.api_keys import ApiKeyStore, Usage


class _Snapshot(Collector):
    def __init__(self, usage: dict[str, dict[str, Usage]]) -> None:
        self.usage = usage

    def collect(self) -> Iterable[CounterMetricFamily]:
        families = {
            "requests": CounterMetricFamily(
                "streamq_key_requests", "Completion requests answered, by API key and model", labels=["key", "model"]
            ),
            "prompt_tokens": CounterMetricFamily(
                "streamq_key_prompt_tokens", "Prompt tokens, by API key and model", labels=["key", "model"]
            ),
            "completion_tokens": CounterMetricFamily(
                "streamq_key_completion_tokens",
                "Completion tokens sent to clients, by API key and model",
                labels=["key", "model"],
            ),
        }
        for key, by_model in sorted(self.usage.items()):
            for model, usage in sorted(by_model.items()):
                for field, family in families.items():
                    family.add_metric([key, model], getattr(usage, field))
        return families.values()


async def key_usage_exposition(store: ApiKeyStore, static_names: Iterable[str]) -> bytes:
    """The usage of every key (stored ones and the command line's) in Prometheus's text format."""
    names = sorted({*static_names, *(record.name for record in await store.all())})
    usage = await store.usage(names) if names else {}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(usage))
    return generate_latest(registry)
