"""The `specserve` command. Each subcommand lives in its own module with `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specserve_operator import runner, status_cli
from specserve_operator.api import crd
from specserve_operator.local import cli as local_cli
from specserve_operator.simulator import cli as simulate_cli

SUBCOMMANDS = (runner, status_cli, crd, local_cli, simulate_cli)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
