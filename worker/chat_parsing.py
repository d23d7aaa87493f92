"""Tool calls and reasoning in chat output, read by vLLM's own parsers where the tokens are.

``vllm serve`` renders a chat request with tools through its ``OnlineRenderer`` (the
template sees the tools; the tool parser's ``adjust_request`` turns a named or required
``tool_choice`` into a grammar) and reads every chat output with the ``Parser`` its flags
name (``--enable-auto-tool-choice --tool-call-parser NAME``, ``--reasoning-parser``). A
worker does the same with the same flags and vLLM's same classes, so the calls, their
deltas and their finish reasons are vLLM's: the parsers need the model's tokenizer and
the generated token ids, which only the worker holds (docs/internals.md, "Tool calls").

A streamed request gets each chunk's delta (``ParsedOutput.message``); a request that is
not streamed gets the whole message on each completion's last chunk, parsed from the whole
text as ``vllm serve`` parses a whole response. A request taken over mid-stream has its
parsers fed what the earlier attempts sent first, so the calls continue where they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import ValidationError
from vllm.entrypoints.generate.base.protocol import DeltaMessage, ToolCall
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatMessage,
)
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
from vllm.exceptions import VLLMValidationError
from vllm.parser.abstract_parser import Parser
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers import ToolParserManager

from streamq.protocol import ChatTemplateOptions, FinishReason, GenerateRequest, InvalidRequest, ParsedOutput

TOOL_CALLS: str = "tool_calls"
"""The finish reason ``vllm serve`` reports for a completion that called tools."""


@dataclass(frozen=True)
class ParserFlags:
    """``vllm serve``'s flags for tools and reasoning, which a worker takes as they are."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    tool_parser_plugin: str = ""
    tool_strict_level: str = "auto"

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


@dataclass(frozen=True)
class RenderedChat:
    """A chat request rendered by vLLM's renderer: the prompt's tokens, and vLLM's request
    after its parsers adjusted it (the grammar a named or required tool choice needs)."""

    prompt_token_ids: list[int]
    vllm_request: ChatCompletionRequest

    @property
    def structured_outputs(self) -> StructuredOutputsParams | None:
        return self.vllm_request.structured_outputs

    @property
    def skip_special_tokens(self) -> bool:
        """``False`` where a tool parser needs its markup tokens in the text."""
        return self.vllm_request.skip_special_tokens


class ChatParsing:
    """A worker's renderer for chat requests with tools, and its parser class (none unless
    ``ParserFlags`` or the engine's ``--reasoning-parser`` name one)."""

    def __init__(self, engine: Any, flags: ParserFlags) -> None:
        if flags.tool_parser_plugin:
            ToolParserManager.import_tool_parser(flags.tool_parser_plugin)
        self.flags = flags
        self._model_config = engine.model_config
        self._tokenizer = engine.get_tokenizer()
        self._renderer = OnlineRenderer(
            engine.model_config,
            engine.renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            enable_auto_tools=flags.enable_auto_tool_choice,
            tool_parser=flags.tool_call_parser,
            reasoning_parser=engine.vllm_config.structured_outputs_config.reasoning_parser,
            tool_strict_level=flags.tool_strict_level,
        )

    @property
    def parser_cls(self) -> type[Parser] | None:
        return self._renderer.parser

    def vllm_request(self, request: GenerateRequest) -> ChatCompletionRequest:
        """vLLM's request for ``request``'s messages, tools and template options (its sampling
        is streamq's own), validated by vLLM: a bad tool or tool choice is refused as
        ``vllm serve`` refuses it."""
        assert request.messages is not None, "a chat request"
        options = request.chat_options or ChatTemplateOptions()
        body: dict[str, Any] = {
            "model": request.model or "",
            "messages": [msgspec.to_builtins(m) for m in request.messages],
            "add_generation_prompt": options.add_generation_prompt,
            "continue_final_message": options.continue_final_message,
            "documents": options.documents,
            "chat_template_kwargs": options.kwargs,
            "add_special_tokens": bool(request.add_special_tokens),
            "include_reasoning": request.include_reasoning,
        }
        if request.tools is not None:
            body.update(msgspec.to_builtins(request.tools))
        if request.sampling.structured_outputs is not None:  # combined with the tools' grammar, as vLLM does
            body["structured_outputs"] = msgspec.to_builtins(request.sampling.structured_outputs)
        try:
            return ChatCompletionRequest.model_validate(body)
        except (ValidationError, VLLMValidationError, ValueError) as exc:
            raise InvalidRequest(_first_error(exc)) from None

    async def render(self, request: GenerateRequest) -> RenderedChat:
        """Render a request with tools as ``vllm serve`` does (its tool choice checked
        against this worker's flags, its grammar set)."""
        vllm_request = self.vllm_request(request)
        try:
            result = await self._renderer.render_chat(vllm_request)
        except (VLLMValidationError, ValueError) as exc:
            raise InvalidRequest(str(exc)) from None
        if isinstance(result, ErrorResponse):
            raise InvalidRequest(result.error.message)
        _, inputs = result
        return RenderedChat(list(inputs[0]["prompt_token_ids"]), vllm_request)  # type: ignore[typeddict-item]

    def for_request(
        self,
        request: GenerateRequest,
        rendered: RenderedChat | None,
        n: int,
        *,
        streamed: bool,
        prompt_token_ids: Sequence[int],
    ) -> OutputParsing | None:
        """The parsing of one chat request's output; ``None`` for a prompt, or on a worker
        without parsers (the text is all there is, as on ``vllm serve`` without them)."""
        parser_cls = self.parser_cls
        if request.messages is None or parser_cls is None:
            return None
        vllm_request = rendered.vllm_request if rendered is not None else self.vllm_request(request)
        kwargs = vllm_request.chat_template_kwargs or {}
        tools: list[Any] | None = vllm_request.tools  # vLLM's parsers take any of its tool kinds
        parsers = [
            parser_cls(self._tokenizer, tools, chat_template_kwargs=kwargs, model_config=self._model_config)
            for _ in range(n)
        ]
        return OutputParsing(
            vllm_request,
            parsers,
            streamed=streamed,
            auto_tools=self.flags.enable_auto_tool_choice and parser_cls.tool_parser_cls is not None,
            prompt_token_ids=list(prompt_token_ids),
            count_every_chunk=request.reasoning_per_chunk,
        )


class OutputParsing:
    """One request's parsers, one per completion (they keep state), fed its chunks in order."""

    def __init__(
        self,
        vllm_request: ChatCompletionRequest,
        parsers: list[Parser],
        *,
        streamed: bool,
        auto_tools: bool,
        prompt_token_ids: list[int],
        count_every_chunk: bool = False,
    ) -> None:
        self._request = vllm_request
        self._parsers = parsers
        self._streamed = streamed
        self._auto_tools = auto_tools
        self._prompt_token_ids = prompt_token_ids
        self._named = isinstance(vllm_request.tool_choice, ChatCompletionNamedToolChoiceParam)
        self._counts_reasoning = parsers[0].reasoning_parser is not None
        self._count_every_chunk = count_every_chunk and self._streamed
        self._tools_streamed = [False] * len(parsers)
        self._texts: list[list[str]] = [[] for _ in parsers]
        self._token_ids: list[list[int]] = [[] for _ in parsers]
        for parser in parsers:
            parser.set_prompt_token_ids(prompt_token_ids)

    def engine_kwargs(self) -> dict[str, Any]:
        """What ``engine.generate`` takes beside the prompt, as ``vllm serve`` passes it:
        whether the prompt already ended the reasoning (a grammar applies only once it has:
        from the first token, or after ``</think>``), and the template variables the
        engine's own reasoning parser reads (``enable_thinking``, ...)."""
        parser = self._parsers[0]
        kwargs: dict[str, Any] = {
            "reasoning_ended": self._request.resolve_reasoning_ended(parser, self._prompt_token_ids)
        }
        if parser.reasoning_parser is not None:
            kwargs["reasoning_parser_kwargs"] = {"chat_template_kwargs": self._request.chat_template_kwargs or {}}
        return kwargs

    def replay(self, index: int, texts: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        """Feed completion ``index`` what an earlier attempt sent (chunk by chunk), its
        output dropped: the subscriber has it already."""
        for text, ids in zip(texts, token_ids, strict=True):
            self.chunk(index, text, ids, None)

    def chunk(self, index: int, text: str, token_ids: Sequence[int], finish_reason: str | None) -> ParsedOutput | None:
        """What the parsers make of one chunk of completion ``index``: its delta (streamed),
        or on its last chunk the whole message (not streamed); ``None``: nothing to send."""
        if not self._streamed or self._counts_reasoning:
            self._token_ids[index].extend(token_ids)
        if self._streamed:
            parsed = self._delta(index, text, token_ids, finish_reason)
        else:
            self._texts[index].append(text)
            if finish_reason is None:
                return None
            parsed = self._whole(index, "".join(self._texts[index]), self._token_ids[index], finish_reason)
        if self._counts_reasoning and (finish_reason is not None or self._count_every_chunk):
            reasoning_tokens = self._parsers[index].count_reasoning_tokens(tuple(self._token_ids[index]))
            parsed = msgspec.structs.replace(parsed, reasoning_tokens=reasoning_tokens)
        return parsed

    def _delta(self, index: int, text: str, token_ids: Sequence[int], finish_reason: str | None) -> ParsedOutput:
        """As ``vllm serve``'s streamed chat: ``parse_delta``, one call in a completion, and
        ``tool_calls`` for a last chunk that ends with ``stop`` after calls (not named ones)."""
        delta = self._parsers[index].parse_delta(
            delta_text=text,
            delta_token_ids=list(token_ids),
            request=self._request,
            prompt_token_ids=self._prompt_token_ids,
            finished=finish_reason is not None,
        )
        if delta is not None and delta.tool_calls:
            self._tools_streamed[index] = True
        reason = None
        if finish_reason == FinishReason.STOP and self._tools_streamed[index] and not self._named:
            reason = TOOL_CALLS
        if delta is None:
            return ParsedOutput(message=None, finish_reason=reason)
        delta = maybe_filter_parallel_tool_calls(delta, self._request)
        return ParsedOutput(message=_dump(delta), finish_reason=reason)

    def _whole(self, index: int, text: str, token_ids: list[int], finish_reason: str) -> ParsedOutput:
        """As ``vllm serve``'s whole chat response (``chat_completion_full_generator``)."""
        request = self._request
        parser = self._parsers[index]
        reasoning, content, calls = parser.parse(
            text, request, enable_auto_tools=self._auto_tools, model_output_token_ids=token_ids
        )
        if not request.include_reasoning:
            reasoning = None
        required = request.tool_choice == "required"
        auto = request.tool_choice in ("auto", None) and bool(request.tools) and self._auto_tools
        tool_calls: list[Any] = []
        if self._named or required:
            content = content or ""
            tool_calls = list(calls or [])
        elif auto and calls:
            tool_calls = list(calls)
        if request.parallel_tool_calls is False:
            tool_calls = tool_calls[:1]
        # vLLM gives a call the parser left without an id one of its own.
        calls_out = [ToolCall(id=call.id or make_tool_call_id(), function=call) for call in tool_calls]
        message = ChatMessage(role="assistant", reasoning=reasoning, content=content, tool_calls=calls_out)
        called = (auto and bool(calls)) or (required and finish_reason == FinishReason.STOP)
        return ParsedOutput(message=_dump(message), finish_reason=TOOL_CALLS if called else None)


def _dump(message: DeltaMessage | ChatMessage) -> dict[str, Any]:
    """As ``vllm serve`` writes it: a delta's fields that were set, a whole message's all."""
    if isinstance(message, DeltaMessage):
        return message.model_dump(mode="json", exclude_unset=True)
    return message.model_dump(mode="json")


def _first_error(exc: Exception) -> str:
    """A pydantic error's first message (vLLM's validators raise inside them), else the error."""
    if isinstance(exc, ValidationError) and exc.errors():
        error = exc.errors()[0]
        cause = error.get("ctx", {}).get("error")
        return str(cause) if cause is not None else str(error.get("msg"))
    return str(exc)
