"""``streamq tenants``: the weights of fair share between tenants, in Redis.

    streamq tenants set team-a --weight 3
    streamq tenants list
    streamq tenants reset team-a

Within a priority, workers take jobs from the tenants with jobs waiting in proportion to
their weights (default 1): a tenant of weight 3 gets three jobs for each one of a tenant
of weight 1. Every worker reads the weights at each claim, so a change applies at once.
"""

from __future__ import annotations

import argparse
import asyncio
import math

from streamq.broker.connection import (
    add_redis_url_option,
    close_pool,
    create_pool,
    redis_settings_for,
    redis_url_from_args,
)
from streamq.broker.replies import as_text
from streamq.protocol.names import TENANT_PATTERN, TENANT_WEIGHTS_KEY

TENANTS_DESCRIPTION = (
    "Set, list and reset the weights of fair share between tenants (default 1; a tenant of weight 3 "
    "gets three jobs for each one of a tenant of weight 1 while both have jobs waiting)."
)
MAX_WEIGHT = 1_000_000.0


def tenant_name(text: str) -> str:
    if TENANT_PATTERN.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a tenant name: {TENANT_PATTERN.pattern} (letters, digits, '._-', at most 64)"
        )
    return text


def weight_value(text: str) -> float:
    """A weight on the command line: a number > 0 and at most ``MAX_WEIGHT``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and 0 < value <= MAX_WEIGHT):
        raise argparse.ArgumentTypeError(f"a weight is a number > 0 and at most {MAX_WEIGHT:g}, got {text}")
    return value


def add_tenants_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(title="actions", dest="action", required=True)
    change = actions.add_parser("set", help="set a tenant's weight")
    change.add_argument("name", type=tenant_name)
    change.add_argument("--weight", type=weight_value, required=True, help="a number > 0 (default of every tenant: 1)")
    actions.add_parser("list", help="every tenant with a weight set")
    reset = actions.add_parser("reset", help="give a tenant the default weight (1) again")
    reset.add_argument("name", type=tenant_name)
    for action in actions.choices.values():
        add_redis_url_option(action)


async def run_tenants(args: argparse.Namespace) -> int:
    pool = await create_pool(redis_settings_for(redis_url_from_args(args)))
    try:
        if args.action == "set":
            await pool.execute_command("HSET", TENANT_WEIGHTS_KEY, args.name, repr(args.weight))
            print(f"{args.name}: weight {args.weight:g}")
        elif args.action == "list":
            flat = await pool.execute_command("HGETALL", TENANT_WEIGHTS_KEY)
            weights = flat.items() if isinstance(flat, dict) else zip(flat[::2], flat[1::2], strict=True)
            for name, weight in sorted((as_text(n), as_text(w)) for n, w in weights):
                print(f"{name}\t{weight}")
        else:
            await pool.execute_command("HDEL", TENANT_WEIGHTS_KEY, args.name)
            print(f"{args.name}: weight 1 (the default)")
    finally:
        await close_pool(pool)
    return 0


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run_tenants(args))
