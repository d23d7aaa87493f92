"""The Responses API as a face over chat completions (``gateway.faces``): its body mapped in
by ``gateway.responses_input``, the chat response and chunks mapped out by
``gateway.responses_output``. One face per request: it keeps the conversation the request
continues and, once answered, the response's head (its id and time) for the route to store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.faces import Face
from gateway.responses_input import chat_body
from gateway.responses_output import ResponseHead, ResponsesFraming, check_echoed, dump, whole_response
from gateway.sse import Framing
from producer.openai_api.endpoints import CHAT_COMPLETIONS
from producer.openai_api.responses import ResponseMeta


class ResponsesFace(Face):
    """``POST /v1/responses`` answered through the chat mapping; ``history``: the chat
    messages of the stored conversation it continues (``previous_response_id``)."""

    resumes = (
        "Last-Event-ID does not resume a Responses stream: read a stored response's events again with "
        "GET /v1/responses/{id}?stream=true&starting_after=<sequence_number>"
    )

    def __init__(self, history: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(CHAT_COMPLETIONS)
        self.history = history
        self.head: ResponseHead | None = None
        """The answered response's head (``None`` until it is answered)."""

    def openai_body(self, body: Any) -> Any:
        chat = chat_body(body, self.history)
        check_echoed(body)
        return chat

    def whole(self, response: dict[str, Any], body: Any) -> dict[str, Any]:
        request_id = str(response["id"]).removeprefix("chatcmpl-")
        self.head = ResponseHead(request_id, response["model"], response["created"], body)
        return dump(whole_response(response, self.head))

    def framing(self, meta: ResponseMeta, body: Any) -> Framing:
        self.head = ResponseHead(meta.request_id, meta.model, meta.created, body)
        return ResponsesFraming(self.head)
