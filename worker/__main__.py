"""``python -m worker``: run a streamq worker.

Worker options come first in --help; every other flag is a vLLM engine argument,
spelled as ``vllm serve`` spells it (``worker/startup.py``). Example::

    python -m worker --model Qwen/Qwen2.5-0.5B-Instruct --max-model-len 4096
"""

from __future__ import annotations

import sys

from worker.front_ends import serve_front_ends
from worker.startup import config_from_args, configure_logging, parse_args, run_worker


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    configure_logging(args, front_ends=args.front_ends > 1)
    if args.front_ends > 1:
        sys.exit(serve_front_ends(argv, args))
    sys.exit(run_worker(config_from_args(args)))


if __name__ == "__main__":
    main()
