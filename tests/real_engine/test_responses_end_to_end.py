"""The Responses API through the openai SDK, against the session's real worker behind a
real gateway: ``responses.create`` and ``responses.stream`` give the same greedy text, the
stream's events are numbered from 0 without a gap, and the response id names the queued
request. (Its texts against ``vllm serve``'s: ``test_gateway_matches_vllm_serve.py``.)"""

from __future__ import annotations

import openai

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
