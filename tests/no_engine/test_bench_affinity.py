"""The prefix-aware pickup benchmark's pure parts (``bench/affinity.py``): the conversations
it sends, the counters it scrapes, and the figures and targets it prints."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from bench.affinity import (
    BIND_ENV,
    Turn,
    Workload,
    build_conversations,
    counters,
    delta,
    engine_env,
    summarize,
    table,
    target_checks,
)
from streamq.protocol.affinity import messages_keys
from streamq.protocol.messages import ChatMessage


def keys(messages: list[dict[str, str]]) -> list[str]:
    return messages_keys([ChatMessage(**m) for m in messages])


def test_conversations_open_with_a_shared_system_message_then_one_of_their_own_of_the_sizes_asked() -> None:
    workload = Workload(conversations=3, turns=4, shared_chars=700, system_chars=900, user_chars=120)
    conversations = build_conversations(workload, "on")
    assert [c.index for c in conversations] == [0, 1, 2]
    for c in conversations:
        assert [m["role"] for m in c.messages] == ["system", "system", "user"]
        assert [len(m["content"]) for m in c.messages] == [700, 900, 120]
        assert [len(u) for u in c.pending] == [120] * 3  # the turns after the first
    assert len({c.messages[0]["content"] for c in conversations}) == 1
    assert len({c.messages[1]["content"] for c in conversations}) == 3
    assert len({c.messages[2]["content"] for c in conversations}) == 3


def test_each_mode_and_seed_gets_texts_of_its_own_and_the_same_ones_again_when_repeated() -> None:
    workload = Workload(conversations=2)
    on, off = build_conversations(workload, "run-on"), build_conversations(workload, "run-off")
    other_seed = build_conversations(Workload(conversations=2, seed=1), "run-on")
    texts = {m["content"] for c in on for m in c.messages}
    assert texts.isdisjoint(m["content"] for c in off for m in c.messages)
    assert texts.isdisjoint(m["content"] for c in other_seed for m in c.messages)
    assert [c.messages for c in build_conversations(workload, "run-on")] == [c.messages for c in on]
    # Not even the first characters are shared: vLLM caches whole blocks from the start.
    assert on[0].messages[0]["content"][:32] != off[0].messages[0]["content"][:32]


def test_a_turn_appends_the_reply_as_the_assistant_message_and_the_next_user_message() -> None:
    (conversation,) = build_conversations(Workload(conversations=1, turns=3), "t")
    first_user, second_user = conversation.pending
    conversation.add_turn("the reply")
    assert conversation.messages[-2:] == [
        {"role": "assistant", "content": "the reply"},
        {"role": "user", "content": first_user},
    ]
    conversation.add_turn("")
    assert conversation.messages[-1] == {"role": "user", "content": second_user}
    assert len(conversation.messages) == 7 and not conversation.pending


def test_the_workload_gives_the_affinity_keys_a_follow_up_and_a_new_conversation_route_by() -> None:
    first, second = build_conversations(Workload(conversations=2, turns=2), "t")
    turn_1 = keys(first.messages)
    first.add_turn("a reply the worker wrote")
    turn_2 = keys(first.messages)
    assert turn_1[0] in turn_2  # the whole first turn: the follow-up finds its worker
    shared = keys(first.messages[:1])
    assert len(shared) == 1 and shared[0] in keys(second.messages)  # the shared system message


def test_counters_sum_each_family_over_its_label_sets_and_are_zero_when_absent() -> None:
    registry = CollectorRegistry()  # the exposition as a worker's /metrics writes it
    queries = Counter("vllm:prefix_cache_queries", "", ["engine", "model_name"], registry=registry)
    queries.labels("0", "m").inc(1000)
    queries.labels("1", "m").inc(500)
    Counter("vllm:prefix_cache_hits", "", ["engine", "model_name"], registry=registry).labels("0", "m").inc(600)
    Counter("streamq_affinity_hits", "", registry=registry).inc(7)
    Counter("streamq_affinity_misses", "", registry=registry).inc(2)
    Counter("streamq_jobs", "", registry=registry).inc(99)
    ttft = Histogram("vllm:time_to_first_token_seconds", "", ["engine"], registry=registry, buckets=(0.1, 1.0))
    ttft.labels("0").observe(0.25)
    ttft.labels("1").observe(0.5)
    exposition = generate_latest(registry).decode()
    assert counters(exposition) == {
        "queries": 1500.0,
        "hits": 600.0,
        "affinity_hits": 7.0,
        "affinity_misses": 2.0,
        "affinity_expired": 0.0,
        "engine_ttft_sum": 0.75,
        "engine_ttft_count": 2.0,
        "engine_waiting_sum": 0.0,
        "engine_waiting_count": 0.0,
        "engine_prefill_sum": 0.0,
        "engine_prefill_count": 0.0,
    }
    before = [dict.fromkeys(counters(""), 1.0), counters("")]
    after = [dict.fromkeys(counters(""), 3.0), counters(exposition)]
    assert delta(before, after)["queries"] == 2.0 + 1500.0


def turn(conversation: int, k: int, ttft_ms: float, worker: str | None) -> Turn:
    return Turn(conversation, k, ttft_ms / 1000, worker, prompt_tokens=100 * k, completion_tokens=32)


NO_COUNTS = {"queries": 0.0, "hits": 0.0, "affinity_hits": 0.0, "affinity_misses": 0.0, "affinity_expired": 0.0}


def test_a_follow_up_counts_as_same_worker_when_it_ran_where_its_own_previous_turn_did() -> None:
    turns = [
        turn(0, 1, 900, "a"),
        turn(0, 2, 100, "a"),  # same
        turn(0, 3, 300, "b"),  # moved
        turn(1, 1, 1000, "b"),
        turn(1, 2, 200, "b"),  # same, though conversation 0's turn 2 was on "a"
        turn(1, 3, 400, None),  # no worker named: not the same
    ]
    result = summarize("on", reversed(turns), 2.0, NO_COUNTS | {"queries": 10.0, "hits": 4.0}, ["c", "b", "a"])
    assert (result.requests, result.follow_ups, result.same_worker) == (6, 4, 2)
    assert result.same_worker_rate == 0.5
    assert result.follow_up_ttft_p50_ms == pytest.approx(250.0)  # numpy's linear percentile of 100, 200, 300, 400
    assert result.follow_up_ttft_p90_ms == pytest.approx(370.0)
    assert result.first_ttft_p50_ms == pytest.approx(950.0)
    assert result.tok_s == 6 * 32 / 2.0
    assert result.cache_hit_rate == 0.4
    assert result.max_prompt_tokens == 300
    assert result.requests_by_worker == {"c": 0, "b": 3, "a": 2, "?": 1}
    assert result.same_worker_ttft_p50_ms == pytest.approx(150.0)  # of 100 and 200, the two that stayed


def test_the_table_puts_the_ratios_beside_the_targets_and_says_which_are_met() -> None:
    on = summarize("on", [turn(0, 1, 1000, "a"), turn(0, 2, 100, "a"), turn(1, 1, 1000, "b"), turn(1, 2, 120, "b")],
                   1.0, NO_COUNTS | {"affinity_hits": 2.0, "affinity_misses": 2.0})  # fmt: skip
    off = summarize("off", [turn(0, 1, 1000, "a"), turn(0, 2, 300, "b"), turn(1, 1, 1000, "b"), turn(1, 2, 360, "b")],
                    1.1, NO_COUNTS)  # fmt: skip
    checks = target_checks(on, off)
    assert checks["same_worker_rate_on"] == (1.0, True)
    assert checks["follow_up_ttft_p50_off_over_on"] == (pytest.approx(3.0), True)
    assert checks["tok_s_on_over_off"] == (pytest.approx(1.1), True)
    text = table(on, off, workers=2)
    assert "| follow-up TTFT p50 (ms) | 110 | 330 | off/on 3.00x | off/on >= 1.5x | yes |" in text
    assert "| same-worker rate of follow-ups | 100.0% (2/2) | 50.0% (1/2) |  | on >= 90% (off: ~1 in 2) | yes |" in text
    assert "| streamq affinity hits / misses / expired | 2 / 2 / 0 | 0 / 0 / 0 |" in text
    assert "on/off 1.10x | on/off >= 0.98x | yes |" in text
    assert "n/a (0 / 0)" in text  # no cache queries: no rate, not a division by zero
    assert "| follow-ups on their previous turn's worker: TTFT / queue wait p50 (ms) | 110 / n/a | 360 / n/a |" in text

    slower = summarize("on", [turn(0, 1, 1000, "a"), turn(0, 2, 300, "b")], 2.0, NO_COUNTS)
    checks = target_checks(slower, off)
    assert checks["same_worker_rate_on"] == (0.0, False)
    assert checks["follow_up_ttft_p50_off_over_on"] == (pytest.approx(1.1), False)
    assert "**no**" in table(slower, off, workers=2)
    lone = summarize("on", [turn(0, 1, 1000, "a")], 1.0, NO_COUNTS)
    assert target_checks(lone, lone)["same_worker_rate_on"] == (None, None)  # no follow-ups


def test_each_worker_s_engine_gets_a_cpu_of_its_own_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BIND_ENV, raising=False)
    assert [engine_env(i, cpus=2, bind=True)[BIND_ENV] for i in range(3)] == ["0", "1", "0"]
    assert BIND_ENV not in engine_env(1, cpus=2, bind=False)  # vLLM's 'auto'
    monkeypatch.setenv(BIND_ENV, "0-1")
    assert engine_env(1, cpus=2, bind=True)[BIND_ENV] == "0-1"  # the caller's own binding wins
