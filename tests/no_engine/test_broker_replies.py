"""Redis replies read the same whether the client decodes them or not."""

from __future__ import annotations

from streamq.broker.replies import as_text


def test_bytes_and_str_replies_read_as_the_same_text() -> None:
    assert as_text(b"streamq:events:r\xc3\xa9") == as_text("streamq:events:ré") == "streamq:events:ré"
