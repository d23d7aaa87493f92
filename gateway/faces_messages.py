"""Anthropic's Messages API as a face over the chat completions mapping, as ``vllm serve``
answers it: the body mapped in (``gateway.messages_request``), the whole response mapped out
(``gateway.messages_response``), a stream framed as Anthropic's events
(``gateway.messages_stream``), errors in Anthropic's shape (``gateway.messages_errors``).
"""

from __future__ import annotations

from typing import Any

from gateway.faces import Face
from gateway.messages_errors import anthropic_error_body
from gateway.messages_request import messages_to_chat
from gateway.messages_response import message_of
from gateway.messages_stream import MessagesFraming
from gateway.sse import Framing
from producer.openai_api.endpoints import CHAT_COMPLETIONS
from producer.openai_api.errors import ApiError
from producer.openai_api.responses import ResponseMeta

MESSAGES_PATH = "/v1/messages"


class MessagesFace(Face):
    """``/v1/messages``: Anthropic's body in, Anthropic's message or events out."""

    resumes = "Last-Event-ID does not resume a Messages stream: send the request again"

    def __init__(self) -> None:
        super().__init__(CHAT_COMPLETIONS)

    def openai_body(self, body: Any) -> Any:
        return messages_to_chat(body)

    def whole(self, response: dict[str, Any], body: Any) -> dict[str, Any]:
        return message_of(response)

    def framing(self, meta: ResponseMeta, body: Any) -> Framing:
        return MessagesFraming()

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return anthropic_error_body(error)


MESSAGES_FACE = MessagesFace()
