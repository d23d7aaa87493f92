"""The Responses API through the openai SDK, against the session's real worker behind a
real gateway: ``responses.create`` and ``responses.stream`` give the same greedy text, the
stream's events are numbered from 0 without a gap, and the response id names the queued
request. A stored response is read back by any gateway: a background one is retrieved until
it completes, cancelled queued or running, and its events resumed with ``starting_after``
on a second gateway after the first was killed mid-stream, the same events as read whole;
``previous_response_id`` gives what a chat of the same turns gives. (Texts against
``vllm serve``'s: ``test_gateway_matches_vllm_serve.py``; function calls:
``test_tool_calls_match_vllm_serve.py``.)"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from devkit.gateway_process import GatewayProcess
from devkit.worker_process import WorkerProcess
from streamq.protocol import WorkerRegistration

MAX_TOKENS = 12


def test_create_and_stream_give_the_same_greedy_text(sdk: openai.OpenAI, model: str) -> None:
    asked = {"model": model, "input": "The key to happiness is", "max_output_tokens": MAX_TOKENS, "temperature": 0}
    whole = sdk.responses.create(instructions="Be kind.", **asked)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status in ("completed", "incomplete")
    assert whole.usage is not None and 0 < whole.usage.output_tokens <= MAX_TOKENS
    with sdk.responses.stream(instructions="Be kind.", **asked) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens


def test_message_items_and_text_format_reach_the_model(sdk: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    response = sdk.responses.create(
        model=model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Is it fine?"}]}],
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    if response.status == "completed":  # a random model's JSON is whole once it stopped by itself
        assert response.output_text.replace(" ", "") in ('{"ok":true}', '{"ok":false}')


def test_a_refused_input_item_is_a_400_in_openais_shape(sdk: openai.OpenAI, model: str) -> None:
    try:
        sdk.responses.create(model=model, input=[{"type": "web_search_call", "id": "ws_1"}])  # type: ignore[list-item]
    except openai.BadRequestError as refused:
        assert refused.body is not None and refused.param == "input"  # type: ignore[union-attr]
    else:
        raise AssertionError("an unsupported input item was accepted")


def test_a_background_response_is_queued_then_retrieved_until_completed(sdk: openai.OpenAI, model: str) -> None:
    queued = sdk.responses.create(
        model=model, input="In a galaxy far", max_output_tokens=MAX_TOKENS, temperature=0, background=True
    )
    assert queued.status in ("queued", "in_progress") and queued.background is True
    deadline = time.monotonic() + 120
    while (retrieved := sdk.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"still {retrieved.status}"
        time.sleep(0.2)
    assert retrieved.status in ("completed", "incomplete") and retrieved.id == queued.id
    whole = sdk.responses.create(model=model, input="In a galaxy far", max_output_tokens=MAX_TOKENS, temperature=0)
    assert retrieved.output_text == whole.output_text
    assert retrieved.created_at == queued.created_at


def test_a_queued_background_response_is_cancelled(sdk: openai.OpenAI, parked_model: WorkerRegistration) -> None:
    queued = sdk.responses.create(model=parked_model.model, input="Hi", background=True)
    assert sdk.responses.retrieve(queued.id).status == "queued"
    cancelled = sdk.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    assert sdk.responses.retrieve(queued.id).status == "cancelled"


def test_a_running_background_response_is_cancelled(sdk: openai.OpenAI, model: str) -> None:
    with sdk.responses.create(
        model=model,
        input="Once upon a time",
        max_output_tokens=1000,
        background=True,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as stream:
        for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta":
                break  # it runs: cancel it
    cancelled = sdk.responses.cancel(response_id)
    assert cancelled.status == "cancelled"
    assert cancelled.usage is not None and cancelled.usage.output_tokens < 1000


def test_a_stored_response_is_unknown_with_store_false(sdk: openai.OpenAI, model: str) -> None:
    unstored = sdk.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)
    stored = sdk.responses.create(model=model, input="Hi", max_output_tokens=2)
    assert sdk.responses.retrieve(stored.id).output_text == stored.output_text


def test_previous_response_id_continues_the_conversation(sdk: openai.OpenAI, model: str) -> None:
    first = sdk.responses.create(
        model=model, instructions="Be brief.", input="Name a colour.", max_output_tokens=MAX_TOKENS, temperature=0
    )
    second = sdk.responses.create(
        model=model, previous_response_id=first.id, input="Another?", max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another?"},
    ]
    chat = sdk.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)  # type: ignore[arg-type]
    assert second.output_text == chat.choices[0].message.content


def test_a_background_stream_resumes_on_another_gateway_after_the_first_is_killed(
    worker: WorkerProcess, gateway_url: str, model: str, tmp_path: Path
) -> None:
    first = GatewayProcess(gateway_url, tmp_path / "first.log").wait_ready()
    second = GatewayProcess(gateway_url, tmp_path / "second.log").wait_ready()
    try:
        seen: list[Any] = []
        with openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0) as on_first:
            stream = on_first.responses.create(
                model=model,
                input="The key to happiness is",
                max_output_tokens=48,
                temperature=0,
                background=True,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for event in stream:
                seen.append(event)
                if sum(e.type == "response.output_text.delta" for e in seen) == 3:
                    break
            first.process.send_signal(signal.SIGKILL)  # the gateway dies mid-stream; the job goes on
            first.process.wait()
            stream.close()
        response_id = seen[0].response.id
        with openai.OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0) as on_second:
            after = seen[-1].sequence_number
            resumed = list(on_second.responses.retrieve(response_id, stream=True, starting_after=after))
            again = list(on_second.responses.retrieve(response_id, stream=True))
        assert [e.sequence_number for e in seen + resumed] == list(range(len(seen) + len(resumed)))
        assert [e.model_dump() for e in seen + resumed] == [e.model_dump() for e in again]
        assert resumed[-1].type == "response.completed"
        assert resumed[-1].response.usage.output_tokens == 48
    finally:
        assert second.stop() == 0, second.log_tail()
        if first.process.poll() is None:
            first.stop()


def test_logprobs_are_included_when_asked(sdk: openai.OpenAI, model: str) -> None:
    asked: Any = {
        "model": model,
        "input": "The key to happiness is",
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    whole = sdk.responses.create(**asked)
    (text,) = whole.output[0].content  # type: ignore[union-attr]
    assert text.logprobs and all(len(entry.top_logprobs) == 2 for entry in text.logprobs)  # type: ignore[union-attr]
    with sdk.responses.stream(**asked) as stream:
        streamed = [lp for event in stream if event.type == "response.output_text.delta" for lp in event.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in text.logprobs]  # type: ignore[union-attr]
