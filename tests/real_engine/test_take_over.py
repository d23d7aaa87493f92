"""A request taken over mid-stream sends what an undisturbed run would have sent, or
ends with ``worker_lost`` saying why it cannot.

The engine tests crash a real second worker (SIGKILL, engine processes too) while it
streams, with the session worker paused until then, so the session worker takes the
requests over; where the crash must fall on a chosen token, the test logs the first
attempt's events itself. Each taken-over request's events (as the replay log
holds them, exactly what was published) are compared with an undisturbed run of the
same request on the session worker. How a take-over continues, at every point,
on the scripted engine: tests/scripted_engine/test_take_over_continuation.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient
from streamq.broker.replay_log import LogEvent, ReplayLog
from streamq.protocol import (
    DEFAULT_QUEUE,
    JOB_KEY_PREFIX,
    RETRY_KEY_PREFIX,
    WAKEUP_CHANNEL,
    events_channel,
    serialize_job,
)
from tests.support.events import assert_well_formed, capture_events, job_result
from tests.support.schemas import PERSON
from tests.support.worker_faults import paused, second_worker

NEVER = "@@ no such words in the answer @@"
"""A stop string the tiny model never writes: vLLM holds back its length - 1 characters."""

PERSON_PROMPT = "The key to happiness is"
"""The tiny model's greedy answer to it under ``PERSON`` ends in about 270 tokens (most of
them whitespace the grammar allows), well inside ``max_tokens``."""


async def logged_events(raw_redis: aioredis.Redis, request_id: str) -> list[dict[str, Any]]:
    """Every event of a finished request as published (the replay log's copy)."""
    await job_result(raw_redis, request_id, timeout_s=120)
    return [json.loads(raw) for raw in await ReplayLog(raw_redis).read(request_id)]


def answers(events: list[dict[str, Any]]) -> tuple[dict[int, tuple[str, list[int]]], list[Any] | None]:
    """Per completion index, the text and token ids a subscriber assembles; and the
    finish reasons."""
    per_index: dict[int, tuple[str, list[int]]] = {}
    for chunk in (e for e in events if e["type"] == "chunk"):
        text, tokens = per_index.get(chunk["index"], ("", []))
        per_index[chunk["index"]] = (text + chunk["text"], tokens + chunk["token_ids"])
    return per_index, events[-1].get("finish_reasons")


def answer(events: list[dict[str, Any]]) -> tuple[str, list[int], list[Any]]:
    """Text, token ids and finish reasons a subscriber assembles from the events."""
    chunks = [e for e in events if e["type"] == "chunk"]
    text = "".join(c["text"] for c in chunks)
    return text, [t for c in chunks for t in c["token_ids"]], events[-1].get("finish_reasons")


async def tokens_logged(raw_redis: aioredis.Redis, request_id: str) -> int:
    """The generated tokens a request's log holds so far (every completion's)."""
    events = [json.loads(fields[b"event"]) for _, fields in await raw_redis.xrange(events_channel(request_id))]
    return sum(len(event.get("token_ids", ())) for event in events)


async def undisturbed(client: StreamqClient, raw_redis: aioredis.Redis, **request: Any) -> list[dict[str, Any]]:
    handle = await client.submit(request_id=f"calm-{uuid.uuid4().hex}", **request)
    return await logged_events(raw_redis, handle.request_id)


async def crashed(
    worker: WorkerProcess,
    doomed: WorkerProcess,
    client: StreamqClient,
    raw_redis: aioredis.Redis,
    requests: dict[str, dict[str, Any]],
    *,
    after_tokens: int,
) -> dict[str, list[dict[str, Any]]]:
    """Run ``requests`` (request id -> submit arguments) on ``doomed``, SIGKILL it once
    each has logged ``after_tokens`` tokens, and return each request's events once
    the session worker has finished it. Tokens, not chunks: a loaded worker merges a
    request's tokens into fewer chunks, and a request counted in chunks could end first."""
    try:
        with paused(worker):
            for request_id, request in requests.items():
                await client.submit(request_id=request_id, **request)
            for request_id in requests:
                async with asyncio.timeout(60):
                    while await tokens_logged(raw_redis, request_id) < after_tokens:
                        await asyncio.sleep(0.005)
            doomed.kill()
    finally:
        doomed.kill()
    return {request_id: await logged_events(raw_redis, request_id) for request_id in requests}


async def test_taken_over_requests_send_the_text_of_an_undisturbed_run(
    worker: WorkerProcess,
    client: StreamqClient,
    raw_redis: aioredis.Redis,
    redis_url: str,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    long = {"max_tokens": 240, "ignore_eos": True}
    requests = {
        # vLLM holds back text while a stop string might be forming, but sends the tokens.
        "held-back": {"prompt": "In a galaxy far, far away", "temperature": 0, "stop": [NEVER], **long},
        "chat": {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about the stars."},
            ],
            "temperature": 0,
            "stop": [NEVER],
            **long,
        },
        # Presence and frequency penalties count generated tokens only.
        "penalties": {
            "prompt": "The key to happiness is",
            "temperature": 0,
            "presence_penalty": 1.5,
            "frequency_penalty": 0.5,
            **long,
        },
        # A seeded sampler's random state cannot be carried to another worker.
        "seeded": {"prompt": "The future of artificial intelligence is", "temperature": 1.0, "seed": 7, **long},
        # Several completions share one engine request (vLLM allows n > 1 only when sampling).
        "n2-seeded": {"prompt": "Once upon a time", "n": 2, "temperature": 1.0, "seed": 11, **long},
        # No seed given: the worker assigns one at the first attempt, the same on every worker.
        "n2-assigned-seed": {"prompt": "A queue of requests", "n": 2, "temperature": 1.0, **long},
        # The grammar's state cannot be carried over to a continued prompt.
        "json": {"prompt": PERSON_PROMPT, "temperature": 0, "max_tokens": 400, "structured_outputs": {"json": PERSON}},
    }
    doomed = second_worker(worker, tiny_model, tmp_path)
    ids = {f"take-over-{name}-{uuid.uuid4().hex}": name for name in requests}
    # One request is also followed live, as a subscriber sees it across the crash.
    (followed,) = [request_id for request_id, name in ids.items() if name == "held-back"]
    subscribed = asyncio.Event()

    async def on_subscribed() -> None:
        subscribed.set()

    live = asyncio.create_task(capture_events(redis_url, followed, on_subscribed))
    await subscribed.wait()
    taken_over = await crashed(
        worker, doomed, client, raw_redis, {i: requests[name] for i, name in ids.items()}, after_tokens=25
    )
    seen_live = await live
    assert_well_formed(seen_live, followed)  # one stream: no gap, no repeat, one final
    assert seen_live == taken_over[followed], "the subscriber saw what the log holds"
    assert [e["attempt"] for e in seen_live] == sorted(e["attempt"] for e in seen_live)

    for request_id, events in taken_over.items():
        name = ids[request_id]
        assert_well_formed(events, request_id)
        assert {e["attempt"] for e in events} == {1, 2}, f"{name}: not interrupted mid-stream"
        calm = dict(requests[name])
        if name == "n2-assigned-seed":  # the seed every attempt of this request id drew with
            calm["seed"] = _assigned_seed(request_id)
        expected = answers(await undisturbed(client, raw_redis, **calm))
        assert answers(events) == expected, name
        assert len(expected[0]) == calm.get("n", 1), name
        assert events[-1]["completion_tokens"] == sum(len(tokens) for _, tokens in expected[0].values())
    (json_events,) = [events for request_id, events in taken_over.items() if ids[request_id] == "json"]
    (text, _), finish_reasons = answers(json_events)[0][0], answers(json_events)[1]
    assert finish_reasons == ["stop"]
    person = json.loads(text)
    assert person["name"] in ("ann", "bob", "eve") and 0 <= person["age"] <= 99


async def test_a_stop_string_spanning_the_take_over_point_ends_the_answer(
    worker: WorkerProcess, client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    """The first attempt died after ``cut`` tokens, inside a stop string it had begun to
    write (its text held back). Up to there its events are those of an undisturbed run of
    the same request, so the test logs exactly those for a request that then runs as
    attempt 2 (a crash at a chosen token, where a SIGKILL would race a fast engine): the
    answer taken over must stop where the undisturbed one does, with the same text."""
    request: dict[str, Any] = {
        "prompt": "Redis streams carry tokens",
        "temperature": 0,
        "max_tokens": 300,
        "ignore_eos": True,
    }
    calm = await undisturbed(client, raw_redis, **request)
    free_text, free_tokens, _ = answer(calm)
    # Where the text of the first k tokens ends (no stop string: nothing held back).
    offsets = [0]
    for chunk in (e for e in calm if e["type"] == "chunk"):
        offsets += [offsets[-1]] * (len(chunk["token_ids"]) - 1) + [offsets[-1] + len(chunk["text"])]
    cut = 60
    start, end = offsets[cut] - 12, offsets[cut] + 30
    stop = free_text[start:end]
    assert free_text.find(stop) == start, "the stop string must first occur there"
    request["stop"] = [stop]
    stopped = await undisturbed(client, raw_redis, **request)

    request_id = f"take-over-span-{uuid.uuid4().hex}"
    sent: list[dict[str, Any]] = []
    for event in stopped:
        if sum(len(e["token_ids"]) for e in sent) >= cut:
            break
        sent.append({**event, "request_id": request_id})
    assert all(e["type"] == "chunk" for e in sent)
    assert "".join(e["text"] for e in sent) != free_text[: offsets[cut]], "text is held back at the crash"
    events = await as_attempt_two(raw_redis, request_id, request, sent)

    assert_well_formed(events, request_id)
    assert {e["attempt"] for e in events} == {1, 2}
    text, tokens, finish_reasons = answer(events)
    assert (text, finish_reasons) == (free_text[:start], ["stop"])
    assert (text, tokens, finish_reasons) == answer(stopped)
    assert tokens == free_tokens[: len(tokens)]


async def as_attempt_two(
    raw_redis: aioredis.Redis, request_id: str, request: dict[str, Any], sent: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Run ``request`` (``submit`` arguments) as attempt 2 after a first attempt that
    published the events ``sent`` (logged here, as that attempt would have) and died;
    return every event once the job has ended."""
    await ReplayLog(raw_redis).append([LogEvent(request_id, e["seq"], 1, json.dumps(e).encode()) for e in sent])
    await raw_redis.set(RETRY_KEY_PREFIX + request_id, 1, ex=600)  # one try used: this one is attempt 2
    job = {"t": 1, "f": "generate", "a": [{"request_id": request_id, **_as_request(request)}], "k": {}}
    await raw_redis.set(JOB_KEY_PREFIX + request_id, serialize_job({**job, "et": int(time.time() * 1000)}), px=60_000)
    await raw_redis.zadd(DEFAULT_QUEUE, {request_id: int(time.time() * 1000)})
    await raw_redis.publish(WAKEUP_CHANNEL, DEFAULT_QUEUE)
    return await logged_events(raw_redis, request_id)


async def test_a_completion_that_had_finished_is_not_sent_again(
    client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    """An ``n = 2`` request whose first attempt died after one completion had finished
    (a stop string) and the other had not: the second attempt generates both again and
    sends only the rest of the unfinished one."""
    request: dict[str, Any] = {"prompt": "Once upon a time", "n": 2, "temperature": 1.0, "seed": 5}
    request.update(max_tokens=200, stop=[" "])
    calm = await undisturbed(client, raw_redis, **request)
    chunks = [e for e in calm if e["type"] == "chunk"]
    first_done = next(i for i, e in enumerate(chunks) if e["finish_reason"] is not None)
    other = 1 - chunks[first_done]["index"]
    rest = [e for e in chunks[first_done + 1 :] if e["index"] == other]
    assert len(rest) >= 2, "the other completion must go on for a while after the first finished"

    request_id = f"take-over-finished-{uuid.uuid4().hex}"
    sent = [{**e, "request_id": request_id} for e in calm[: first_done + 1]]
    events = await as_attempt_two(raw_redis, request_id, request, sent)

    assert_well_formed(events, request_id)
    assert answers(events) == answers(calm)
    again = [e for e in events if e["attempt"] == 2 and e["type"] == "chunk"]
    assert again and {e["index"] for e in again} == {other}


async def test_a_regeneration_that_differs_from_what_was_sent_ends_with_worker_lost(
    client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    """The log says completion 1 sent a token the engine does not generate again (as a
    nondeterministic engine would): nothing more goes out but a ``worker_lost`` error
    naming the completion and the token."""
    request: dict[str, Any] = {"prompt": "Once upon a time", "n": 2, "temperature": 1.0, "seed": 9}
    request.update(max_tokens=40, ignore_eos=True)
    calm = await undisturbed(client, raw_redis, **request)
    request_id = f"take-over-differs-{uuid.uuid4().hex}"
    sent = [{**e, "request_id": request_id} for e in calm if e["type"] == "chunk"][:12]
    of_one = [e for e in sent if e["index"] == 1]
    assert len(of_one) >= 2
    forged = of_one[1]
    position = len(of_one[0]["token_ids"]) + 1  # its first token, counted within completion 1
    # Completions are generated in lockstep: completion 0 has nothing new to send yet.
    assert position <= sum(len(e["token_ids"]) for e in sent if e["index"] == 0)
    forged["token_ids"] = [forged["token_ids"][0] + 1, *forged["token_ids"][1:]]
    total = sum(len(e["token_ids"]) for e in of_one)

    events = await as_attempt_two(raw_redis, request_id, request, sent)

    assert_well_formed(events, request_id)
    error = events[-1]
    assert (error["type"], error["code"], error["attempt"]) == ("error", "worker_lost", 2)
    assert f"completion 1 had sent: token {position} of the {total} sent differs" in error["message"]
    assert [e for e in events if e["attempt"] == 2] == [error]  # nothing of the regeneration went out


def _assigned_seed(request_id: str) -> int:
    """The seed workers assign ``request_id`` (importing vLLM raises torch's warnings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from worker.regeneration import assigned_seed

    return assigned_seed(request_id)


def _as_request(submitted: dict[str, Any]) -> dict[str, Any]:
    """``submit`` keyword arguments as the job's request object (sampling nested)."""
    top = {k: v for k, v in submitted.items() if k in ("prompt", "messages")}
    return {**top, "sampling": {k: v for k, v in submitted.items() if k not in top}}


async def test_the_worker_log_holds_no_prompt(worker: WorkerProcess, client: StreamqClient) -> None:
    secret = f"pw{uuid.uuid4().hex[:10]}"  # short, like the id: a line of the request's arguments would show it
    plain = await client.submit(secret, request_id=f"p{uuid.uuid4().hex[:6]}", max_tokens=4)
    chat = await client.submit(
        messages=[{"role": "user", "content": secret}], request_id=f"c{uuid.uuid4().hex[:6]}", max_tokens=4
    )
    await plain.result()
    await chat.result()
    finished = [f"request {plain.request_id} finished", f"request {chat.request_id} finished"]
    deadline = time.monotonic() + 10  # each logged once its end is settled, after its client has it
    while not all(line in (log := worker.log_path.read_text(errors="replace")) for line in finished):
        assert time.monotonic() < deadline, f"the worker logged no line for {finished}"
        await asyncio.sleep(0.05)
    assert secret not in log


async def test_a_batch_whose_worker_is_killed_mid_batch_answers_each_line_once_with_the_undisturbed_text(
    worker: WorkerProcess,
    client: StreamqClient,
    raw_redis: aioredis.Redis,
    producer_url: str,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """``streamq batch`` (none of its requests streamed) on a worker that checkpoints every
    16 tokens, SIGKILLed once some lines are done and others have checkpoints logged: the
    session worker takes the rest over, from their checkpoints (greedy lines go on from the
    tokens logged, the seeded one is generated again and what was logged is checked)."""
    checkpoint = 16
    doomed = second_worker(worker, tiny_model, tmp_path, "--checkpoint-tokens", str(checkpoint))
    model = str(tiny_model)
    prompts = [f"Line {i} of a nightly batch says" for i in range(10)]
    bodies: dict[str, dict[str, Any]] = {
        f"greedy-{i}": {"model": model, "prompt": p, "max_tokens": 40 + 20 * i, "temperature": 0, "ignore_eos": True}
        for i, p in enumerate(prompts)
    }
    bodies["seeded"] = {"model": model, "prompt": "A seeded line", "max_tokens": 150, "temperature": 1.0, "seed": 3}
    bodies["seeded"]["ignore_eos"] = True
    rows = [{"custom_id": key, "method": "POST", "url": "/v1/completions", "body": b} for key, b in bodies.items()]
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    in_path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    command = [sys.executable, "-m", "producer", "batch", str(in_path), str(out_path), "--no-progress"]
    command += ["--redis-url", producer_url, "--queue", worker.queue]

    def answered() -> int:
        return len(out_path.read_text().splitlines()) if out_path.exists() else 0

    async def checkpointed() -> int:
        """Requests on the queue with a checkpoint (or more) logged and no end yet."""
        count = 0
        for job in await raw_redis.zrange(worker.queue, 0, -1):
            last = await ReplayLog(raw_redis).last(job.decode())
            count += last is not None and json.loads(last)["type"] == "chunk"
        return count

    try:
        with paused(worker):
            batch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            async with asyncio.timeout(120):  # the shortest lines done, longer ones checkpointed
                while answered() < 2 or await checkpointed() < 4:
                    await asyncio.sleep(0.01)
            doomed.kill()
        output, _ = await asyncio.to_thread(batch.communicate, timeout=240)
    finally:
        doomed.kill()
    assert batch.returncode == 0, output
    written = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert sorted(row["custom_id"] for row in written) == sorted(bodies), "each line answered once"
    taken_over = 0
    for row in written:
        request_id = row["response"]["request_id"]
        events = [json.loads(raw) for raw in await ReplayLog(raw_redis).read(request_id)]
        assert_well_formed(events, request_id)
        taken_over += {e["attempt"] for e in events} == {1, 2}
        body = dict(bodies[row["custom_id"]])
        body.pop("model")
        calm = await client.generate(**body)
        assert row["response"]["body"]["choices"][0]["text"] == calm.text, row["custom_id"]
        assert row["response"]["body"]["usage"]["completion_tokens"] == body["max_tokens"]
    assert taken_over >= 3, f"only {taken_over} lines were taken over mid-run"
