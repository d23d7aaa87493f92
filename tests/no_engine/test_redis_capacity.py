"""The Redis capacity benchmark plays valid request streams and derives its figures soundly."""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import pytest

from bench.redis_capacity import CapacityConfig, capacity_table, cluster_shards, figures, run_arm
from bench.redis_capacity_load import SimulatedWorker, group_by, grouping_argument, slots_of
from streamq.protocol import ChunkEvent, FinalEvent, decode_event


def _worker(requests: int, tokens_per_event: int, output_len: int) -> SimulatedWorker:
    args = argparse.Namespace(
        run="t", requests_per_worker=requests, tokens_per_event=tokens_per_event, output_len=output_len
    )
    return SimulatedWorker(0, args, log=None, counts=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens_per_event", [1, 3, 16])
def test_simulated_flushes_are_whole_request_streams(tokens_per_event: int) -> None:
    worker = _worker(requests=4, tokens_per_event=tokens_per_event, output_len=20)
    worker.ready = [3] * 4  # the first four requests of every slot are followed
    streams: dict[str, list[ChunkEvent | FinalEvent]] = defaultdict(list)
    for _ in range(100):
        events, tokens, _ = worker.batch()
        decoded = [decode_event(event.payload) for event in events]
        assert tokens == sum(len(e.token_ids) for e in decoded if isinstance(e, ChunkEvent))
        assert all(len(e.token_ids) <= tokens_per_event for e in decoded if isinstance(e, ChunkEvent))
        for event, logged in zip(decoded, events, strict=True):
            assert isinstance(event, ChunkEvent | FinalEvent)
            assert (logged.seq, logged.terminal) == (event.seq, isinstance(event, FinalEvent))
            streams[event.request_id].append(event)
    assert not [rid for rid in streams if rid.endswith("-g4")], "a request started before it was followed"
    ended = [events for events in streams.values() if isinstance(events[-1], FinalEvent)]
    assert len(ended) == 4 * 4
    for events in ended:
        *chunks, final = events
        assert [e.seq for e in events] == list(range(len(events)))
        assert isinstance(final, FinalEvent) and final.completion_tokens == sum(len(c.token_ids) for c in chunks)
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_subscribers_share_every_slot_exactly_once() -> None:
    shares = [slots_of(i, 3, workers=2, requests_per_worker=5) for i in range(3)]
    every = sorted(slot for share in shares for slot in share)
    assert every == [(w, r) for w in range(2) for r in range(5)]


def test_one_core_figure_is_measured_only_near_saturation() -> None:
    config = CapacityConfig(measure_s=10.0)
    counts = {"flushes": 1_000, "events": 400_000, "tokens": 1_600_000}
    busy = figures(config, 4, counts, {"events": 400_000}, {"redis": 95.0}, 0, 0.0)
    assert busy.redis_us_per_token == pytest.approx(1e6 * 0.95 * 10 / 1_600_000)
    assert busy.one_core_measured and busy.one_core_tokens_s == pytest.approx(160_000 / 0.95)
    idle = figures(config, 4, counts, {"events": 400_000}, {"redis": 30.0}, 0, 0.0)
    assert not idle.one_core_measured and idle.one_core_tokens_s == pytest.approx(1e6 / idle.redis_us_per_token)
    assert "1e6 / µs per token" in capacity_table([idle]) and "(measured)" in capacity_table([busy])


@pytest.mark.parametrize("grouping", ["request", "buckets-3"])
def test_a_flush_split_into_calls_keeps_every_event_once_and_each_request_whole(grouping: str) -> None:
    worker = _worker(requests=8, tokens_per_event=2, output_len=6)
    worker.ready = [1] * 8
    events, _, _ = worker.batch()
    events += worker.batch()[0]
    groups = group_by(events, grouping)
    assert sorted(e for group in groups for e in group) == sorted(events)
    assert len(groups) == (len({e.request_id for e in events}) if grouping == "request" else 3)
    for group in groups:  # a request lies in one group, in its order
        for rid in {e.request_id for e in group}:
            assert [e for e in group if e.request_id == rid] == [e for e in events if e.request_id == rid]
    assert all(len({e.request_id for e in group}) == 1 for group in groups) == (grouping == "request")


@pytest.mark.parametrize("bad", ["buckets", "buckets-0", "slots", "buckets-x"])
def test_an_unknown_grouping_is_a_usage_error(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="grouping must be one of"):
        grouping_argument(bad)


@pytest.mark.parametrize("bad", ["cluster-", "cluster-0", "cluster-x"])
def test_a_cluster_arm_names_its_shards(bad: str) -> None:
    assert cluster_shards("cluster-3") == 3 and cluster_shards("flush") is None
    with pytest.raises(argparse.ArgumentTypeError, match="cluster-<shards>"):
        cluster_shards(bad)


@pytest.mark.parametrize("grouping", ["flush", "request", "cluster-2", "unix"])
def test_a_short_run_delivers_every_event_to_its_subscriber(tmp_path: Path, grouping: str) -> None:
    config = CapacityConfig(
        workers=2,
        requests_per_worker=4,
        output_len=8,
        subscribers=2,
        warmup_s=0.5,
        measure_s=1.5,
        results_dir=tmp_path,
    )
    result = run_arm(config, tokens_per_event=4, grouping=grouping)
    assert result.errors == 0
    # Redis's count of script calls over the publishers' count of flushes, in the same window
    # (give or take the calls in flight at its edges): one call per flush, or one per request
    # (on a cluster, one per bucket: each request of a worker in a bucket of its own or not).
    assert result.grouping == grouping
    # the unix arm's processes (each simulated worker and subscriber) on the Unix socket, no other arm's
    assert (
        (result.unix_clients >= config.workers + config.subscribers) if grouping == "unix" else not result.unix_clients
    )
    if grouping in ("flush", "unix"):
        assert result.calls_per_flush == pytest.approx(1, rel=0.05)
    else:
        assert 1.5 < result.calls_per_flush <= 4 * 1.1
    assert result.tokens_s > 0 and result.events_s > 0 and result.delivered_events_s > 0
    assert result.tokens_s == pytest.approx(4 * (result.events_s - result.events_s / 3), rel=0.2)
    assert 0 < result.redis_us_per_token < result.redis_us_per_event
