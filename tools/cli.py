"""`agentwin`: the project's command line.

    agentwin demo ...                       relocation demo (tools/demo.py)
    agentwin bench relocate --json FILE     CPU relocation throughput vs a plain copy
    agentwin bench patches --json FILE      conditioning patches vs blind reuse (SmolLM2)
    agentwin bench window --json FILE       window operations: blind vs rank-16 vs exact patches
    agentwin diagnose --a-file A --b-file B --question Q   deficit diagnostics for any chunks

"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Sequence


def _command(subparsers: argparse._SubParsersAction, name: str, module: ModuleType, help: str) -> None:
    """One subcommand backed by a module with `add_arguments(parser)` and `run(args) -> int`;
    the module docstring's first paragraph is the command's description."""
    parser = subparsers.add_parser(name, help=help, description=(module.__doc__ or "").split("\n\n")[0])
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    """The `agentwin` parser with every subcommand."""
    from tools import bench_patches, bench_relocate, bench_window, demo, diagnose

    parser = argparse.ArgumentParser(prog="agentwin", description="Multimodal agents with a reversible context window.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _command(sub, "demo", demo, "relocation demo on the real embedded model")
    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    _command(kinds, "relocate", bench_relocate, "CPU relocation throughput as a ratio to a plain copy")
    _command(kinds, "patches", bench_patches, "conditioning patches vs blind reuse on the real SmolLM2 (KL vs bytes)")
    _command(kinds, "window", bench_window, "KL vs re-prefill after recall / evict / reorder / slide on SmolLM2")
    _command(sub, "diagnose", diagnose, "the deficit of chunk B after chunk A, per layer, and what patches recover")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the command, return its exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
