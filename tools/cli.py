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
from typing import Sequence


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from tools import bench_relocate

    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    relocate = kinds.add_parser(
        "relocate",
        help="CPU relocation throughput as a ratio to a plain copy",
        description=(bench_relocate.__doc__ or "").split("\n\n")[0],
    )
    bench_relocate.add_arguments(relocate)
    relocate.set_defaults(func=bench_relocate.run)
    from tools import bench_patches

    patches = kinds.add_parser(
        "patches",
        help="conditioning patches vs blind reuse on the real SmolLM2 (KL vs bytes)",
        description=(bench_patches.__doc__ or "").split("\n\n")[0],
    )
    bench_patches.add_arguments(patches)
    patches.set_defaults(func=bench_patches.run)
    from tools import bench_window

    window = kinds.add_parser(
        "window",
        help="KL vs re-prefill after recall / evict / reorder / slide on SmolLM2",
        description=(bench_window.__doc__ or "").split("\n\n")[0],
    )
    bench_window.add_arguments(window)
    window.set_defaults(func=bench_window.run)


def build_parser() -> argparse.ArgumentParser:
    """The `agentwin` parser with every subcommand."""
    from tools import demo

    parser = argparse.ArgumentParser(prog="agentwin", description="Multimodal agents with a reversible context window.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo_parser = sub.add_parser("demo", help="relocation demo on the real embedded model",
                                 description=(demo.__doc__ or "").split("\n\n")[0])
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.run)
    _add_bench(sub)
    from tools import diagnose

    diag = sub.add_parser("diagnose", help="the deficit of chunk B after chunk A, per layer, and what patches recover",
                          description=(diagnose.__doc__ or "").split("\n\n")[0])
    diagnose.add_arguments(diag)
    diag.set_defaults(func=diagnose.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the command, return its exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
