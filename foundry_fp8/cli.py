"""`foundry-fp8` command line; `SUBCOMMANDS` below is the one list of its subcommands.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
Those modules import torch only inside `run`, so `foundry-fp8 lint` stays fast and GPU-free.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from foundry_fp8 import __version__

SUBCOMMANDS = {
    "lint": ("foundry_fp8.lint.cli", "check LLM-Foundry train YAMLs and Accelerate configs for FP8 mistakes"),
    "report": ("foundry_fp8.report", "plot a run's fp8_stats metrics (PNG heatmaps, time series) and summarise them in markdown"),
    "bench": ("foundry_fp8.tools.bench", "MPT-1B training throughput: FP8 variants against BF16"),
    "doctor": ("foundry_fp8.doctor", "the environment FP8 training needs (GPU, torch, TE), and what is wrong"),
    "tiny-data": ("foundry_fp8.tools.tiny_data", "build a tiny local tokenizer and text dataset for a CPU try (nothing downloaded)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foundry-fp8",
        description=f"FP8 training tools for Composer and LLM-Foundry: {', '.join(SUBCOMMANDS)}.")
    parser.add_argument("--version", action="version", version=f"foundry-fp8 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
