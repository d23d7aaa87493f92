"""``streamq keys``: the gateway's API keys in Redis, managed by name.

    streamq keys create team-a --rpm 600 --tpm 200000 --max-streams 16 --models llama-1b
    streamq keys list
    streamq keys set team-a --rpm 1200 --tpm none
    streamq keys revoke team-a

``create`` prints the secret once (only its SHA-256 is stored); ``list`` shows names,
limits and usage, never secrets. Every gateway on the same Redis applies a change from
its next request on.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from streamq.broker.api_keys import ApiKeyError, ApiKeyStore, KeyRecord
from streamq.broker.connection import add_redis_url_option, close_pool, create_pool, redis_settings_for

KEYS_DESCRIPTION = "Create, list, change and revoke the gateway's API keys (stored in Redis, secrets hashed)."
LIMITS = ("rpm", "tpm", "max_streams")


def limit_value(text: str) -> int | None:
    """A limit on the command line: a number >= 1, or ``none`` for no limit."""
    if text.lower() in ("none", "-"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'none'") from None
    if value < 1:
        raise argparse.ArgumentTypeError("a limit is at least 1 (or 'none')")
    return value


def models_value(text: str) -> list[str] | None:
    """``a,b`` as the allow-list ``["a", "b"]``; ``*`` for every model."""
    if text.strip() == "*":
        return None
    models = [model.strip() for model in text.split(",") if model.strip()]
    if not models:
        raise argparse.ArgumentTypeError("give model names separated by commas, or '*' for all")
    return models


def _limit_options(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--rpm", type=limit_value, default=default, help="requests per minute ('none': no limit)")
    parser.add_argument(
        "--tpm", type=limit_value, default=default, help="prompt + completion tokens per minute ('none': no limit)"
    )
    parser.add_argument(
        "--max-streams", type=limit_value, default=default, help="requests open at once ('none': no limit)"
    )
    parser.add_argument(
        "--models", type=models_value, default=default, metavar="A,B", help="the models it may use ('*': all)"
    )


def add_keys_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(title="actions", dest="action", required=True)
    create = actions.add_parser("create", help="create a key and print its secret (shown only this once)")
    create.add_argument("name")
    _limit_options(create, None)
    listing = actions.add_parser("list", help="every key: name, limits and usage (never secrets)")
    del listing
    change = actions.add_parser("set", help="change a key's limits (the options given; the rest stay)")
    change.add_argument("name")
    _limit_options(change, argparse.SUPPRESS)
    revoke = actions.add_parser("revoke", help="delete a key: every gateway refuses it from now on")
    revoke.add_argument("name")
    for action in (create, actions.choices["list"], change, revoke):
        add_redis_url_option(action)


async def run_keys(args: argparse.Namespace) -> int:
    pool = await create_pool(redis_settings_for(args.redis_url))
    try:
        store = ApiKeyStore(pool)
        if args.action == "create":
            models = args.models
            record = KeyRecord(args.name, rpm=args.rpm, tpm=args.tpm, max_streams=args.max_streams, models=models)
            secret = await store.create(record)
            print(f"created key {args.name!r} ({record.limits_text()}); its secret, shown only now:", file=sys.stderr)
            print(secret)
        elif args.action == "list":
            records = await store.all()
            usage = await store.usage([record.name for record in records])
            for record in records:
                per_model = usage[record.name]
                requests = sum(u.requests for u in per_model.values())
                tokens = sum(u.prompt_tokens + u.completion_tokens for u in per_model.values())
                print(f"{record.name}\t{record.limits_text()}\trequests={requests} tokens={tokens}")
        elif args.action == "set":
            current = await store.get(args.name)
            if current is None:
                raise ApiKeyError(f"no key named {args.name!r}")
            changes = {field: getattr(args, field) for field in (*LIMITS, "models") if hasattr(args, field)}
            fields = {field: getattr(current, field) for field in (*LIMITS, "models")} | changes
            record = KeyRecord(args.name, **fields)
            await store.update(record)
            print(f"{args.name}: {record.limits_text()}")
        else:
            await store.revoke(args.name)
            print(f"revoked {args.name!r}")
    except ApiKeyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        await close_pool(pool)
    return 0


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run_keys(args))
