"""Run many agent tasks from a JSON Lines file on a pool of workers sharing one store.

    agentwin batch tasks.jsonl --workers 4 --store /srv/kv --out results.jsonl

The task file's format, the workers, the results and the exit status: `agents.batch.cli`.
"""

from __future__ import annotations

import argparse
import sys

from agents.batch.tasks import PATCHES
from tools.agents_cli import fraction_arg, kl_arg, positive_arg, rank_arg
from tools.store_args import add_store_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tasks", metavar="TASKS.jsonl", help="the task file, one JSON object per line")
    parser.add_argument("--workers", type=positive_arg, default=1, help="workers, one model each (default 1)")
    parser.add_argument("--model", default="smollm2", help="smollm2, a tiny-* name, a local path or a hub name (default smollm2)")
    add_store_argument(parser, "shared by every worker (default: a private RAM store per worker)")
    parser.add_argument("--out", metavar="FILE", help="write results as JSON lines to FILE (default stdout)")
    parser.add_argument("--resume", action="store_true", help="keep the finished results already in --out and run the rest")
    parser.add_argument("--ray", metavar="ADDRESS", help="run the workers as Ray actors: 'local' starts a local Ray "
                                                         "with --workers CPUs, 'auto' or HOST:PORT joins a cluster")
    parser.add_argument("--threads", type=positive_arg, help="torch threads per worker (default: CPUs / workers)")
    parser.add_argument("--retries", type=int, default=1, help="extra attempts for a failed task (default 1)")
    group = parser.add_argument_group("window defaults (a task's own fields win)")
    group.add_argument("--budget-tokens", type=positive_arg, help="window size in tokens (default: 1024 doc, 2048 web, 4096 video)")
    group.add_argument("--max-steps", type=positive_arg, help="decisions before giving up (default: 12 doc and web, 16 video)")
    group.add_argument("--max-new-tokens", type=positive_arg, default=48, help="tokens per decision (default 48)")
    group.add_argument("--patch", choices=PATCHES, default="exact",
                       help="how a chunk is served where the chunks before it changed: exact (recomputed; the "
                            "default, as the window's), survive, refresh, or a patch policy (origin-akin, "
                            "origin-similar, origin, fresh, none)")
    group.add_argument("--rank", type=rank_arg, default="budget",
                       help="patch policies: 'budget' (each patch within 6%% of the chunk's KV bytes), a rank "
                            "(checked by the patch guard), or 'exact' (default budget)")
    group.add_argument("--patch-bytes", type=fraction_arg, default=None,
                       help="patch policies with --rank budget: the patch's share of a chunk's canonical KV bytes "
                            "(default 0.06)")
    group.add_argument("--max-kl", type=kl_arg, default=None, metavar="NATS",
                       help="patch policies: a fidelity target: each text chunk's patch grows from its budget (or "
                            "rank), doubling, until the chunk's last rows read within NATS of KL of its own pass "
                            "(default: none)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from agents.batch.cli import run as run_tasks
    from agents.console import window_option_error

    problem = window_option_error(args)
    if problem:
        print(f"agentwin batch: error: {problem}", file=sys.stderr)
        return 2
    return run_tasks(args)
