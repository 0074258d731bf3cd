"""`agentwin bench sessions`: generated chat sessions replayed through re-prefill, prefix caching, the
default window, survival, the survival repair and the patch policies, on a real model; tokens
forwarded, wall time and fidelity against the float32 re-prefill at every read, with the
bfloat16 noise floor (`tools.bench.session_bench`).

`--json FILE` writes the figures (top-level keys, pooled over the test seeds:
`default_kl_over_floor`, `default_greedy16`, `floor_greedy16`, `default_tokens_over_prefix`,
`worst_session_tokens_over_prefix`, `default_tokens_over_lower_bound`, `default_wall_over_prefix`,
`frontier` (per strategy: `tokens_over_prefix`, `kl_over_floor`, `greedy16`, ...); then
`sessions`, `selection`, `per_kind`, `contract`, `settings`, `command`, load averages). The page
(`--page`, default docs/results/SESSIONS.md except with --quick) is written from this run's figures
and from the other model's JSON in docs/results/sessions_<model>.json when there is one.
`--quick` runs two short session kinds on two seeds: a check of the command, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

DEFAULT_PAGE = "docs/results/SESSIONS.md"
MODELS = ("smollm2", "gemma3-270m")
QUICK_KINDS = ("notes", "thread")
QUICK_IN_VIEW = 2.5  # parts in view in --quick sessions: short sessions still slide and recall


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tools.bench.sessions import KINDS

    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    parser.add_argument("--page", metavar="FILE", help=f"write the results page to FILE (default {DEFAULT_PAGE}; "
                                                        "none with --quick unless given)")
    parser.add_argument("--quick", action="store_true", help="short sessions: a check of the command, not a measurement")
    parser.add_argument("--model", choices=MODELS, default="smollm2", help="the real model (default smollm2)")
    parser.add_argument("--kinds", default=None, help=f"comma-separated session kinds (default all: {','.join(KINDS)})")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads for every strategy (default 2)")
    parser.add_argument("--greedy", type=int, default=None, help="greedy tokens per read (default 16; 4 with --quick)")
    parser.add_argument("--reads", type=int, default=None, help="reads per session (default 30; 7 with --quick)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes running sessions side by side, each with --threads threads (default 1: "
                             "this process); every strategy of a session runs in one process")
    parser.add_argument("--repeats", type=int, default=None,
                        help="replays of the timed strategies for wall time (default 3; 1 with --quick)")
    parser.add_argument("--test-seeds", default=None,
                        help="comma-separated seeds of the test split (default 1,2,3; the validation seed is 0)")


def _command(args: argparse.Namespace) -> str:
    parts = ["agentwin bench sessions", "--model", args.model]
    for flag, value in (("--json", args.json), ("--kinds", args.kinds), ("--greedy", args.greedy),
                        ("--jobs", args.jobs if args.jobs != 1 else None),
                        ("--reads", args.reads), ("--repeats", args.repeats),
                        ("--test-seeds", None if args.test_seeds is None else ",".join(map(str, args.test_seeds)))):
        if value is not None:
            parts += [flag, str(value)]
    if args.threads != 2:
        parts += ["--threads", str(args.threads)]
    return " ".join(parts + (["--quick"] if args.quick else []))


def _commit() -> str | None:
    """The checkout's commit (and "+changes" when the tree differs from it), None outside git."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def run(args: argparse.Namespace) -> int:
    from tools.bench.sessions import IN_VIEW, KINDS, TEST_SEEDS, VALIDATION_SEEDS

    kinds = KINDS if args.kinds is None else tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if args.quick and args.kinds is None:
        kinds = QUICK_KINDS
    bad = [k for k in kinds if k not in KINDS]
    greedy = args.greedy if args.greedy is not None else (4 if args.quick else 16)
    reads = args.reads if args.reads is not None else (7 if args.quick else 30)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if args.test_seeds is not None:
        try:
            args.test_seeds = tuple(dict.fromkeys(int(x) for x in args.test_seeds.split(",") if x.strip()))
        except ValueError:
            args.test_seeds = ()
        if not args.test_seeds or set(args.test_seeds) & set(VALIDATION_SEEDS) or min(args.test_seeds) < 0:
            print(f"error: --test-seeds must be comma-separated seeds >= 0 other than the validation seeds "
                  f"{list(VALIDATION_SEEDS)}", file=sys.stderr)
            return 2
    if bad or not kinds:
        print(f"error: --kinds must name session kinds among {','.join(KINDS)}, got {args.kinds!r}", file=sys.stderr)
        return 2
    if args.threads < 1 or greedy < 1 or repeats < 1 or reads < 3 or args.jobs < 1:
        print("error: --threads, --jobs, --greedy and --repeats must be positive and --reads at least 3", file=sys.stderr)
        return 2
    from agentwin import KameraModel
    from tools.bench.session_bench import Runner, run_benchmark
    from tools.bench.sessions import make_session
    from tools.bench.sessions_page import render_page
    from tools.bench.trace import to_jsonable
    from agentwin.models.zoo import REAL, load_real

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    load_start = os.getloadavg()
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    runner = None
    try:
        torch.manual_seed(0)
        km = KameraModel.from_pretrained(args.model)
        test_seeds = TEST_SEEDS if args.test_seeds is None else args.test_seeds
        seeds = (VALIDATION_SEEDS[:1] + test_seeds[:1]) if args.quick else VALIDATION_SEEDS + test_seeds
        in_view = QUICK_IN_VIEW if args.quick else IN_VIEW
        sessions = [make_session(kind, seed, km, reads, in_view=in_view) for kind in kinds for seed in seeds]
        if args.jobs > 1:
            runner = Runner(args.model, args.threads, args.jobs)
        else:
            runner = Runner(args.model, args.threads, 1, km, load_real(args.model, torch.bfloat16)[0])
        result = run_benchmark(runner, sessions, greedy=greedy, repeats=repeats, quick=args.quick, log=log)
    finally:
        if runner is not None:
            runner.close()
        torch.set_num_threads(saved)
    result = to_jsonable({
        **result, "model": f"{REAL[args.model][0]} ({args.model}; GGUF de-quantized to float32; noise floor: the same "
                           "model loaded in bfloat16)",
        "model_name": args.model, "command": _command(args),
        "settings": {"threads": args.threads, "jobs": args.jobs, "greedy": greedy, "reads": reads, "repeats": repeats, "quick": args.quick,
                     "kinds": list(kinds), "seeds": list(seeds)},
        "commit": _commit(), "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": time.perf_counter() - t0})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    page = args.page if args.page else (None if args.quick else DEFAULT_PAGE)
    if page:
        results = []
        for model in MODELS:
            if model == args.model:
                results.append(result)
                continue
            other = Path(DEFAULT_PAGE).parent / f"sessions_{model}.json"
            if other.is_file():
                results.append(json.loads(other.read_text()))
        Path(page).parent.mkdir(parents=True, exist_ok=True)
        Path(page).write_text(render_page(results))
    f = result
    print(f"default: KL {f['default_kl_over_floor']:.3g}x the floor, greedy-16 {f['default_greedy16']:.0%} "
          f"(floor {f['floor_greedy16']:.0%}); tokens {f['default_tokens_over_prefix']:.3f} of prefix caching's "
          f"(worst session {f['worst_session_tokens_over_prefix']:.3f}); {time.perf_counter() - t0:.0f} s")
    return 0
