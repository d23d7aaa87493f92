"""API keys as tenants, stored in Redis so that every gateway replica agrees.

Only a SHA-256 of each secret is stored, beside the key's name and limits; the secret is
shown once, when the key is created. Key names and formats: ``streamq.protocol`` and
PROTOCOL.md.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import msgspec
from redis.asyncio import Redis

from streamq.broker.replies import as_text
from streamq.protocol.names import (
    API_KEY_NAME_PATTERN,
    API_KEY_NAMES_KEY,
    API_KEYS_KEY,
    KEY_STREAMS_PREFIX,
    KEY_USAGE_PREFIX,
    KEY_WINDOW_PREFIX,
)
from streamq.protocol.script_calls import RevokeApiKey, SaveApiKey
from streamq.protocol.scripts import Script

SECRET_PREFIX = "sq-"
"""Secrets start with this, so a leaked one is recognisable (e.g. by secret scanners)."""


class ApiKeyError(Exception):
    """A key operation that cannot be done: an unknown or duplicate name, a bad limit."""


class KeyRecord(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """What Redis holds for one key (the JSON of ``streamq:api-keys``). A limit left out
    is no limit; the Lua scripts rely on absent fields, never ``null``."""

    name: str
    rpm: int | None = None
    """Requests per minute."""
    tpm: int | None = None
    """Prompt plus completion tokens per minute."""
    max_streams: int | None = None
    """Requests open at once."""
    models: list[str] | None = None
    """The models it may use; absent: all."""

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def limits_text(self) -> str:
        """The limits for a person: ``rpm=60 tpm=- max_streams=4 models=*``."""

        def shown(value: int | None) -> str:
            return "-" if value is None else str(value)

        models = "*" if self.models is None else ",".join(self.models)
        return f"rpm={shown(self.rpm)} tpm={shown(self.tpm)} max_streams={shown(self.max_streams)} models={models}"


_record_decoder = msgspec.json.Decoder(KeyRecord)


def decode_record(raw: bytes | str) -> KeyRecord:
    return _record_decoder.decode(raw)


def encode_record(record: KeyRecord) -> bytes:
    return msgspec.json.encode(record)


def secret_hash(secret: str) -> str:
    """The stored form of a secret: its SHA-256 in hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def check_name(name: str) -> str:
    if API_KEY_NAME_PATTERN.fullmatch(name) is None:
        raise ApiKeyError(f"key name {name!r} must match {API_KEY_NAME_PATTERN.pattern}")
    return name


def window_key(name: str) -> str:
    return KEY_WINDOW_PREFIX + name


def streams_key(name: str) -> str:
    return KEY_STREAMS_PREFIX + name


def usage_key(name: str) -> str:
    return KEY_USAGE_PREFIX + name


@dataclass(frozen=True)
class Usage:
    """One key's totals for one model."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ApiKeyStore:
    """Creates, lists, changes and revokes keys; looks a secret up by its hash."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._save = Script(redis, SaveApiKey)
        self._revoke = Script(redis, RevokeApiKey)

    async def create(self, record: KeyRecord) -> str:
        """Store a new key; its secret, which nothing can show again."""
        check_name(record.name)
        secret = new_secret()
        saved = await self._save(
            SaveApiKey(
                api_keys_key=API_KEYS_KEY,
                api_key_names_key=API_KEY_NAMES_KEY,
                name=record.name,
                secret_hash=secret_hash(secret),
                record=encode_record(record),
                create=1,
            )
        )
        if not saved:
            raise ApiKeyError(f"a key named {record.name!r} exists already (revoke it first, or change it with set)")
        return secret

    async def update(self, record: KeyRecord) -> None:
        """Replace the limits of the key named ``record.name``; its secret stays."""
        call = SaveApiKey(
            api_keys_key=API_KEYS_KEY,
            api_key_names_key=API_KEY_NAMES_KEY,
            name=record.name,
            record=encode_record(record),
            create=0,
        )
        saved = await self._save(call)
        if not saved:
            raise ApiKeyError(f"no key named {record.name!r}")

    async def revoke(self, name: str) -> None:
        """Delete the key at once (every gateway refuses it from its next request on) and its
        rate windows; its usage totals stay."""
        call = RevokeApiKey(
            api_keys_key=API_KEYS_KEY, api_key_names_key=API_KEY_NAMES_KEY, window_key=window_key(name), name=name
        )
        if not await self._revoke(call):
            raise ApiKeyError(f"no key named {name!r}")

    async def get(self, name: str) -> KeyRecord | None:
        digest = await self._redis.hget(API_KEY_NAMES_KEY, name)  # type: ignore[misc]
        if digest is None:
            return None
        return await self.lookup(as_text(digest))

    async def lookup(self, digest: str) -> KeyRecord | None:
        """The key whose secret hashes to ``digest``, if any."""
        raw = await self._redis.hget(API_KEYS_KEY, digest)  # type: ignore[misc]
        return None if raw is None else decode_record(raw)

    async def all(self) -> list[KeyRecord]:
        """Every key, by name."""
        raw = await self._redis.hvals(API_KEYS_KEY)  # type: ignore[misc]
        return sorted((decode_record(r) for r in raw), key=lambda record: record.name)

    async def usage(self, names: list[str]) -> dict[str, dict[str, Usage]]:
        """Each key's totals by model, in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(usage_key(name))
            replies = await pipe.execute()
        return {name: parse_usage(reply) for name, reply in zip(names, replies, strict=True)}


def parse_usage(fields: dict[bytes, bytes] | dict[str, str]) -> dict[str, Usage]:
    """``{"requests:<model>": n, ...}`` as ``{model: Usage}``."""
    counts: dict[str, dict[str, int]] = {}
    for field, value in fields.items():
        kind, _, model = as_text(field).partition(":")
        counts.setdefault(model, {})[kind] = int(value)
    kinds = Usage.__dataclass_fields__
    return {model: Usage(**{k: v for k, v in c.items() if k in kinds}) for model, c in counts.items()}
