"""`agentwin`: the project's command line.

    agentwin demo                           document navigator on SmolLM2: evictions, recalls, KL, savings
    agentwin relocation-demo                KV moved 30000 positions by RoPE re-rotation (= demo --relocation)
    agentwin doc FILE.pdf --question Q      document navigator (the model decides every step)
    agentwin web URL --task T               web agent in headless Chromium
    agentwin video FILE --question Q        long-video loop (a vision-language model)
    agentwin batch TASKS.jsonl --workers N  many agent tasks on a pool of workers sharing one store
    agentwin bench engine --json FILE       the KV engine: recall, decode over segments, memory of a long loop
    agentwin bench relocate --json FILE     CPU relocation throughput vs a plain copy
    agentwin bench patches --json FILE      conditioning patches vs blind reuse (SmolLM2)
    agentwin bench recall --json FILE       recall to first token vs re-prefill (SmolLM2 text, 64-frame video)
    agentwin bench window --json FILE       window operations: blind vs rank-16 vs exact patches
    agentwin bench eval [--quick]           every reuse method on one harness; writes docs/RESULTS.md
    agentwin bench fleet --json FILE        a pool of agent workers: shared store vs private stores
    agentwin bench steps --json FILE        agent step time: the model's forwards vs everything else
    agentwin bench trace --json FILE        agent traces: re-prefill vs prefix cache vs streaming vs agentwin (docs/results/TRACE.md)
    agentwin bench fidelity --json FILE     patches under byte budgets and stale patches on the traces (docs/results/FIDELITY.md)
    agentwin bench sessions --json FILE     chat sessions: the default window vs prefix caching, survival and repairs (docs/results/SESSIONS.md)
    agentwin diagnose --a-file A --b-file B --question Q   deficit diagnostics for any chunks
    agentwin diagnose --case code           the same on a built-in hard case (code, roles, table, steps)

"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import NoReturn, Sequence


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): `agentwin doc: error: argument --store: ...
    (agentwin doc --help lists the options)`, exit status 2. Subcommands inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def _command(subparsers: argparse._SubParsersAction, name: str, module: ModuleType, help: str) -> None:
    """One subcommand backed by a module with `add_arguments(parser)` and `run(args) -> int`;
    the module docstring's first paragraph is the command's description."""
    parser = subparsers.add_parser(name, help=help, description=(module.__doc__ or "").split("\n\n")[0])
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    """The `agentwin` parser with every subcommand."""
    from tools import batch_cli, bench_fleet, bench_steps
    from tools import bench_fidelity, bench_sessions, bench_trace
    from tools import agents_cli, bench_engine, bench_eval, bench_patches, bench_recall, bench_relocate, bench_window, demo, diagnose, relocation_demo

    parser = _Parser(prog="agentwin", description="Multimodal agents with a reversible context window.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _command(sub, "demo", demo, "document navigator on the real SmolLM2: evictions, recalls, KL vs re-prefill, savings")
    _command(sub, "relocation-demo", relocation_demo, "exact relocation of KV encoded 30000 positions away, on SmolLM2")
    _command(sub, "doc", agents_cli.DOC, "answer a question from a PDF (document navigator)")
    _command(sub, "web", agents_cli.WEB, "do a task in a web browser (web agent)")
    _command(sub, "video", agents_cli.VIDEO, "answer a question about a video (long-video loop)")
    _command(sub, "batch", batch_cli, "run many agent tasks from a JSON Lines file on workers sharing one store")
    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    _command(kinds, "engine", bench_engine, "the KV engine on SmolLM2: recall to first token, decode over segments, memory of a long loop")
    _command(kinds, "relocate", bench_relocate, "CPU relocation throughput as a ratio to a plain copy")
    _command(kinds, "patches", bench_patches, "conditioning patches vs blind reuse on the real SmolLM2 (KL vs bytes)")
    _command(kinds, "eval", bench_eval, "Kamera vs blind, CacheBlend, EPIC, VLCache: accuracy and KL per byte and per compute (docs/RESULTS.md)")
    _command(kinds, "recall", bench_recall, "time from recall of an evicted chunk to the first token vs re-prefill and blind reuse")
    _command(kinds, "fleet", bench_fleet, "agent workers with one shared store vs a private store each: encodes, hit rate, wall time")
    _command(kinds, "trace", bench_trace, "agent traces through re-prefill, prefix caching, streaming and agentwin: tokens, fidelity")
    _command(kinds, "sessions", bench_sessions, "chat sessions on a real model: the default window against prefix caching, "
             "survival, its repair and the patch policies: tokens, wall time, fidelity (docs/results/SESSIONS.md)")
    _command(kinds, "fidelity", bench_fidelity, "patch fidelity under byte budgets and stale patches vs blind reuse on the traces")
    _command(kinds, "steps", bench_steps, "median agent step time on SmolLM2, the model's forwards vs everything else")
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
