"""The ``--affinity-key KEY`` and ``--no-affinity`` options of the commands that submit
requests (``submit``, ``batch``): prefix-aware pickup (docs/features/prefix-aware-pickup.md).

A key is checked by argparse (exit status 2 with the reason) with the library's own rule,
``check_affinity_key``, so the command line refuses exactly what ``submit`` would.
"""

from __future__ import annotations

import argparse
from typing import Any

from streamq.protocol.affinity import MAX_AFFINITY_KEY_CHARS, check_affinity_key


def affinity_key_argument(value: str) -> str:
    """An ``--affinity-key``: a non-empty string of at most ``MAX_AFFINITY_KEY_CHARS``."""
    try:
        checked = check_affinity_key(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert checked is not None
    return checked


def add_affinity_arguments(parser: argparse.ArgumentParser, *, scope: str) -> None:
    """Add both options to ``parser``; ``scope`` says which requests they apply to, for the
    help. They exclude each other: a key for requests that opt out would be ignored."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--affinity-key",
        type=affinity_key_argument,
        default=None,
        metavar="KEY",
        help=f"name the conversation or document of {scope}, so that the worker that served it gets first "
        f"pick (prefix cache reuse; at most {MAX_AFFINITY_KEY_CHARS} characters; default: the prompt's prefix)",
    )
    group.add_argument(
        "--no-affinity",
        dest="affinity",
        action="store_false",
        help=f"opt {scope} out of prefix-aware pickup: any worker takes them (docs/features/prefix-aware-pickup.md)",
    )


def affinity_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``submit``'s keyword arguments for the parsed options; only those set, so that a
    default leaves the library's own default in force."""
    kwargs: dict[str, Any] = {}
    if args.affinity_key is not None:
        kwargs["affinity_key"] = args.affinity_key
    if not args.affinity:
        kwargs["affinity"] = False
    return kwargs
