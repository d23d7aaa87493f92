"""Secrets kept out of logs and error messages: what may be shown of a Redis URL.

A Redis URL may carry a password (``redis://user:password@host``); wherever one is logged,
printed or put in an error, it goes through ``redact_url`` first.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import urlsplit, urlunsplit

MASK: Final = "***"


def redact_url(url: str) -> str:
    """``url`` with its password masked: ``redis://user:***@host:6379/0`` (the user name stays,
    it says which ACL user is meant). Every scheme, Sentinel's host lists included."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK  # not a URL we can take apart: show none of it
    credentials, at, hosts = parts.netloc.rpartition("@")
    if not at:
        return url
    user, colon, _password = credentials.partition(":")
    if not colon:
        return url  # redis://user@host: a user name, no password
    return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{hosts}"))
