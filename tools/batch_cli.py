"""`agentwin batch`: many agent tasks from a JSON Lines file on a pool of workers sharing one store
(`agents.batch` runs them; this module parses the options, reads the file and reports).

    agentwin batch tasks.jsonl --workers 4 --store /srv/kv --out results.jsonl
    agentwin batch tasks.jsonl --workers 8 --store redis://kv.internal:6379/0 --ray auto --out r.jsonl
    agentwin batch tasks.jsonl --workers 2 --ray local --model tiny-llama-gqa

One task per line: {"id": ..., "kind": "doc"|"web"|"video", "source": path-or-url, "question" (or
"task"): ..., optional "max_steps", "budget_tokens", "max_new_tokens", "rank", "patch",
"patch_bytes", "max_kl",
"max_chars" (doc), "allow_hosts" (web), "segment_seconds", "fps" (video), and
"script": [actions...] to replay fixed decisions instead of the model's}. Relative sources are
resolved against the task file's folder.

Each worker loads the model (`--model`, default smollm2) once and takes tasks one at a time: one
worker runs in this process; `--workers N` runs N spawned processes; `--ray ADDRESS` runs them as
Ray actors (`--ray local`: a local Ray with N CPUs; `--ray auto` or host:port: a running
cluster, where sources must be readable by every node). The workers share `--store`, a directory
or a redis:// URL, so KV one worker computed is read back by the others; without `--store`
every worker keeps its own RAM store. `--threads` torch threads per worker (default: the CPUs
divided by the workers). A task with a "script" reads the window at each decision as the model
would (its next-token distribution after the prompt) and then replies from the script, so the
window computes what a model-driven run computes, except the reply's tokens.

Results go to `--out` (default stdout), one JSON line per task as it finishes: id, ok, stopped,
answer, steps, error, attempts, worker, seconds, forwards and forward_tokens by kind, and what the
window computed and what it read from the store instead. A *placement* is a chunk after a given
sequence of chunks; the exact window (patch "exact", `WorkerConfig`'s default) computes a chunk's
in-context KV once per placement and keeps it in the store under that placement, for any window
that reads the same chunks in the same order:
- `chunks_computed`: chunks whose in-context KV the task computed at their placement (a first
  pass, or again after the chunks before it changed); one forward may compute several, so this
  is not `forwards`. Counted from the order of chunks at each read (`agents.batch.reads`); None
  under the other policies. `chunk_tokens_computed`: the tokens those passes computed (any policy;
  rows reused from an earlier pass after the same prefix are not computed).
- `encodes`: canonical encodes (a chunk alone, forward kind "encode"): the patch policies' work
  (under the others, only a recall by query needs one, for a chunk never read: its key summary).
- `exact_hits` / `exact_hit_tokens`: placements the task's window was served from in-context KV
  in the store instead of computing them: kept by another task, worker or run, or by this task
  itself before (a chunk recalled to its old place); `waited`: those another worker was computing
  when this task needed them, read once its entry was stored (this task waited on the store's
  lease instead of computing them too).
- `chunks_from_store`: chunks whose KV the task read from the store instead of computing it:
  its exact hits, plus canonical KV read instead of encoded (patch policies). Under exact,
  `chunks_computed + chunks_from_store` is the same for two tasks that read the same chunks in
  the same order, whichever ran first.
- `read_orders`: for each read, the chunks the window held, in order, as 16-hex-digit digests of
  their token ids (None on a vision-language model): the placements a task read, from which the
  batch's `distinct_placements` is counted.
- `store_lookups`: the store's own counters over the task (hits, misses, and the Redis tier's
  remote_hits, remote_misses): every lookup of any entry (in-context KV, canonical KV, patches,
  page pixels, vision-tower outputs), the task's own writes read back included, so its hits can
  exceed `chunks_from_store` even on an empty store; and the counters of `get_or_compute`'s lease
  (lease_waits: entries another worker was computing when this task asked, lease_hits: those it
  then read from that worker instead of computing, lease_takeovers: those it computed after all),
  which the vision-tower cache goes through; the window's waits on placements are `waited`.
`--quiet` prints no progress: no task bar, and the workers load their model without its
progress bars. A failed task is retried once on the next free worker; the rest
go on. A line of the task file that cannot be used gives a failed record saying what to fix, and so
does a document or video task whose file is missing; both before any worker loads a model.
Ctrl-C stops the workers; the results written so far stay in --out, and `--resume` runs only the
tasks without a finished result there.

Exit status: 0 when every task answered, 1 when some did not (failed or ran out of steps), 2 when
the task file or the model cannot be used or no task in the file can run (their failed records are
written all the same), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from agents.batch.tasks import PATCHES
from tools.options import fraction_arg, kl_arg, positive_arg, rank_arg, window_option_error
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
    problem = window_option_error(args)
    if problem:
        print(f"agentwin batch: error: {problem}", file=sys.stderr)
        return 2
    return run_tasks(args)



def default_threads(args: argparse.Namespace) -> int | None:
    """torch threads per worker: --threads, else the CPUs divided by the workers (None on a cluster)."""
    if args.threads is not None:
        return args.threads
    if args.ray not in (None, "local"):
        return None  # a cluster's nodes have their own CPU counts; torch's default there
    return max(1, (os.cpu_count() or 1) // args.workers)


def worker_config(args: argparse.Namespace) -> Any:
    """The `WorkerConfig` the options describe."""
    from agents.batch import WorkerConfig

    return WorkerConfig(model=args.model, store=args.store, threads=default_threads(args), quiet=bool(args.quiet),
                        budget_tokens=args.budget_tokens, max_steps=args.max_steps,
                        max_new_tokens=args.max_new_tokens, rank=args.rank, patch=args.patch,
                        patch_bytes=getattr(args, "patch_bytes", None), max_kl=getattr(args, "max_kl", None))


def finished_results(path: Path) -> list[dict[str, Any]]:
    """The records in an earlier --out whose task finished (no error); unreadable lines are
    skipped (a run killed mid-write leaves at most one)."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("id") is not None and not record.get("error"):
            kept.append(record)
    return kept


def _open_out(args: argparse.Namespace) -> tuple[TextIO, set[str]]:
    """The results stream and the ids already finished there (with --resume)."""
    if args.out is None:
        return sys.stdout, set()
    path = Path(args.out)
    kept = finished_results(path) if args.resume else []
    path.parent.mkdir(parents=True, exist_ok=True)
    out = path.open("w", encoding="utf-8")
    for record in kept:
        out.write(json.dumps(record, default=repr) + "\n")
    out.flush()
    return out, {str(r["id"]) for r in kept}


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None."""
    if args.resume and args.out is None:
        return "--resume needs --out (the file whose finished results to keep)"
    if args.retries < 0:
        return f"--retries must be 0 or more, got {args.retries}"
    problem = window_option_error(args)
    if problem:
        return problem
    if args.ray is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            return "--ray needs Ray: pip install ray==2.60.0"
    return None


def report(outcome_records: list[dict[str, Any]], wall_s: float, out_name: str) -> None:
    """The totals and the first failures, on stderr."""
    from agents.batch import summarize

    total = summarize(outcome_records)
    failed = [r for r in outcome_records if r.get("error")]
    print(f"\n{total['tasks']} tasks: {total['ok']} answered, {total['failed']} failed, "
          f"{total['tasks'] - total['ok'] - total['failed']} without an answer; "
          f"{_computed(total)}, {total['chunks_from_store']} read from the store instead; "
          f"{wall_s:.1f} s; results in {out_name}",
          file=sys.stderr)
    for r in failed[:10]:
        print(f"  {r['id']}: {r['error']}", file=sys.stderr)
    if len(failed) > 10:
        print(f"  ... and {len(failed) - 10} more", file=sys.stderr)


def _computed(total: dict[str, Any]) -> str:
    """What the tasks computed, for the closing line: chunks at their placement and canonical encodes."""
    parts = []
    if total["chunks_computed"] is not None:
        distinct = total["distinct_placements"]
        parts.append(f"{total['chunks_computed']} chunks computed"
                     + (f" ({distinct} distinct placements)" if distinct is not None else ""))
    if total["encodes"] or not parts:
        parts.append(f"{total['encodes']} canonical encodes")
    return ", ".join(parts)


def run_tasks(args: argparse.Namespace) -> int:
    """Run the tasks of `args.tasks`; the exit status."""
    import time

    from tqdm.auto import tqdm

    from agents.batch import BatchError, TaskFileError, missing_sources, read_tasks, run_batch

    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        tasks, bad = read_tasks(args.tasks)
    except TaskFileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tasks, missing = missing_sources(tasks, args.tasks)
    bad = sorted(bad + missing, key=lambda b: b["line"])
    out, done_ids = _open_out(args)
    tasks = [t for t in tasks if t.id not in done_ids]
    bad = [b for b in bad if b["id"] not in done_ids]
    if bad and not tasks:  # bad input only: refused before any worker loads a model
        for record in bad:
            out.write(json.dumps(record, default=repr) + "\n")
        if out is not sys.stdout:
            out.close()
        print(f"error: no task in {args.tasks} can run ({len(bad)} refused); first: {bad[0]['error']}",
              file=sys.stderr)
        return 2
    records: list[dict[str, Any]] = []
    news = [""]
    bar = tqdm(total=len(tasks) + len(bad), desc="tasks", unit="task", disable=args.quiet, file=sys.stderr,
               dynamic_ncols=True)

    def show() -> None:
        counts = (f"{sum(1 for r in records if r.get('ok'))} ok, "
                  f"{sum(1 for r in records if r.get('error'))} failed")
        bar.set_postfix_str(counts + (f" | {news[0][:48]}" if news[0] else ""))

    def on_result(record: dict[str, Any]) -> None:
        out.write(json.dumps(record, default=repr) + "\n")
        out.flush()
        records.append(record)
        bar.update(1)
        show()

    def on_status(text: str) -> None:
        news[0] = text
        show()

    for record in bad:
        on_result(record)
    backend = "ray" if args.ray is not None else "processes" if args.workers > 1 else "inline"
    t0 = time.perf_counter()
    out_name = args.out or "stdout"
    try:
        if tasks:
            run_batch(tasks, worker_config(args), workers=args.workers, backend=backend, ray_address=args.ray,
                      retries=args.retries, on_result=on_result, on_status=on_status)
    except KeyboardInterrupt:
        bar.close()
        print(f"\ninterrupted: {len(records)} of {len(tasks) + len(bad)} tasks finished, their results are in "
              f"{out_name}" + ("; rerun with --resume to run the rest" if args.out else ""), file=sys.stderr)
        return 130
    except BatchError as err:
        bar.close()
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if out is not sys.stdout:
            out.close()
    bar.close()
    report(records, time.perf_counter() - t0, out_name)
    return 0 if all(r.get("ok") for r in records) else 1
