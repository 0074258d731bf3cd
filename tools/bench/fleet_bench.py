"""A pool of agent workers with one shared store vs a private store each (`agentwin bench fleet`).

The workload: `--docs` PDFs written here (3 pages each, distinct text) and `--tasks` document
tasks over them, round robin, so every PDF is read by several tasks. Each task replays a fixed
script (next, next, goto 1, answer) through `agents.batch` (`agents.batch.reads.ReadingScript`:
each decision reads the window after its prompt, as the model's own would, then takes the
script's reply): both runs do the same navigation, and every chunk computed and every forward is
the model's real work. Tasks over one PDF read the same pages in the same order, so after the
first of them every placement they need is one a store can already hold. The default model is
the real SmolLM2 with 12 tasks over 3 PDFs; `--quick` uses tiny-llama-gqa and 6 tasks.

The same tasks run on `--workers` spawned worker processes (each loads the model once,
`--threads` torch threads each, the same on both sides), `--repeats` times per side, the order of the
two sides alternating between repeats (shared first, then private first, ...) so that neither side
always gets the cold first run:
- shared: every worker opens the same store: `--store redis://...` (a fresh tenant per run, so
  the server starts cold for this run) or, without --store, one directory;
- private: every worker has its own directory store (nothing is shared between workers).

Figures (JSON with `--json FILE`). A *placement* is a chunk after a given sequence of chunks: the
workers' windows (the default, exact) compute a chunk's in-context KV once per placement and keep
it in the store under its placement key (`agentwin.prefix`), so a worker that reads the same chunks
in the same order is served it with no forward:
- encodes_shared / encodes_private: the chunk computations of the run, summed over tasks: chunks
  computed at their placement (`chunks_computed` of the batch records: in-context passes of
  chunks, first ones and recomputes; one forward may compute several) plus canonical encodes
  (`encodes`, which only the patch policies run: 0 here);
- distinct_placements: the different placements the tasks' reads held (from each task's
  `read_orders`, the chunks its window held at each read), the fewest computations any run can
  do; a shared run does exactly that many: a placement is computed by the first worker that needs
  it, and a worker that needs it while another computes it waits for that worker's entry (the
  store's lease on the placement key, taken by the window). The bench checks that every repeat
  of either side read the same placements. distinct_chunks: the different chunks read (pages, and
  the chat head of a model with a chat format);
- distinct_placements_private: the same per private store, summed over them: the distinct
  placements of the tasks each worker ran (what private stores compute, since they share
  nothing); *_private_runs: every repeat's, as the tasks' split over the workers varies;
- waited_shared: placements a worker's window waited for while another worker computed them,
  summed over the tasks of the first shared repeat (the window's `waited`); *_runs: every
  repeat's; exact_hits_shared / exact_hits_private: placements served from the store's
  in-context KV instead of computed (another task's, or the task's own for a chunk recalled to its
  old place); chunk_tokens_computed_shared / _private: the tokens of the chunk computations;
- lease_waits_shared / lease_hits_shared / lease_takeovers_shared: the counters of the store's
  `get_or_compute` lease (the vision-tower cache goes through it; a text model's tasks never do,
  and these are 0), summed over the tasks of the first shared repeat: a worker asking for an entry
  another worker was computing, the entry then read from that worker (a compute it did not run),
  or computed after all (the holder's lease lapsed or ran out of time); *_runs: every repeat's;
- remote_hit_rate: with Redis, remote hits / (remote hits + remote misses) of the shared run (the
  store's counters, summed over tasks); with a directory, the shared directory's hit rate for
  chunks instead: chunks read from the store / (read + computed) (`hit_rate_kind` says which);
  store_hits_shared / store_hits_private: the chunks read from the store (`chunks_from_store`);
- wall_s_shared / wall_s_private: the median over repeats of the time from the moment every
  worker is ready (tasks are held until then) to the last result; wall_s_*_min the least and
  wall_s_*_runs every repeat; model loading is reported apart as startup_s_* (median);
- encodes_*, store hits and exact hits are those of the first repeat of each side;
  encodes_*_runs has every repeat's (each repeat starts from an empty store: a fresh directory,
  or a fresh Redis tenant);
- remote_get_mb_s: read throughput of the shared tier on this machine: `--get-entries` entries of
  `--get-entry-mb` MiB are put, then a fresh store object (empty RAM tier) times `store.get` of
  each; with a directory this reads local files (likely from the page cache; `get_tier` says so);
- the load average before and after each run (other work on the machine slows both runs):
  loadavg holds the first repeat's, loadavg_runs every repeat's.

`check(args)` refuses bad options, `measure(args)` runs both and returns the figures,
`format_table(figures)` is what the command prints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

DOC_TOPICS = ("harbour", "observatory", "orchard", "railway", "library", "mill")


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None."""
    if not 2 <= args.workers <= 4:
        return f"--workers must be 2 to 4, got {args.workers}"
    for name in ("tasks", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name} must be >= 1, got {value}"
    if not 1 <= args.docs <= len(DOC_TOPICS):
        return f"--docs must be 1 to {len(DOC_TOPICS)}, got {args.docs}"
    if args.repeats < 1:
        return f"--repeats must be >= 1, got {args.repeats}"
    if args.get_entries < 1 or not args.get_entry_mb > 0:
        return "--get-entries and --get-entry-mb must be positive"
    if args.store is not None and not args.store.startswith(("redis://", "rediss://")):
        return f"--store must be a redis:// or rediss:// URL, got {args.store!r} (without it a shared directory is used)"
    return None


# ---- the workload ---------------------------------------------------------------------------

def doc_pages(index: int, quick: bool) -> list[str]:
    """Three pages of generated prose about topic `index` (shorter with quick: the tiny model
    reads bytes)."""
    topic = DOC_TOPICS[index]
    facts = 3 if quick else 10
    pages = []
    for page in range(1, 4):
        lines = [f"The {topic} report, page {page}."]
        lines += [f"Entry {page}.{k}: the {topic} keeps ledger {index * 100 + page * 10 + k} in cabinet "
                  f"{(k * 7 + page) % 13}, checked by clerk number {(index + 3) * (k + 1) + page}." for k in range(facts)]
        pages.append(" ".join(lines))
    return pages


def write_workload(folder: Path, tasks: int, docs: int, quick: bool) -> list[Any]:
    """Write the PDFs into `folder` and return the tasks (round robin over the PDFs)."""
    from agents.batch import Task
    from agents.doc import write_text_pdf

    pdfs = [write_text_pdf(folder / f"{DOC_TOPICS[i]}.pdf", doc_pages(i, quick)) for i in range(docs)]
    out = []
    for t in range(tasks):
        d = t % docs
        script = [{"action": "next"}, {"action": "next"}, {"action": "goto", "page": 1},
                  {"action": "answer", "text": f"{DOC_TOPICS[d]} task {t}"}]
        out.append(Task(id=f"t{t:02d}", kind="doc", source=str(pdfs[d]), question=f"Which ledger is in cabinet {t % 13}?",
                        script=tuple(json.dumps(s) for s in script), options={"max_steps": 6}))
    return out


# ---- the runs -------------------------------------------------------------------------------

def run_fleet(tasks: list[Any], model: str, workers: int, threads: int, store: str, private: bool, tenant: str,
              label: str, progress: bool) -> dict[str, Any]:
    """One run of `tasks` on spawned workers; its records, totals and times."""
    from tqdm.auto import tqdm

    from agents.batch import WorkerConfig, run_batch, summarize

    config = WorkerConfig(model=model, store=store, private=private, tenant=tenant, threads=threads)
    bar = tqdm(total=len(tasks), desc=f"{label}: starting workers", unit="task", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    load_before = os.getloadavg()

    def on_result(record: dict[str, Any]) -> None:
        bar.set_description_str(label)
        bar.update(1)

    try:
        outcome = run_batch(tasks, config, workers=workers, backend="processes", on_result=on_result,
                            wait_for_workers=True)
    finally:
        bar.close()
    total = summarize(outcome.records)
    if total["failed"]:
        first = next(r for r in outcome.records if r.get("error"))
        raise RuntimeError(f"{label} run: {total['failed']} task(s) failed, e.g. {first['id']}: {first['error']}")
    return {"total": total, "records": outcome.records, "workers": outcome.workers,
            "startup_s": outcome.startup_s, "wall_s": outcome.wall_s - outcome.startup_s,
            "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}


def computations(run: dict[str, Any]) -> int:
    """The chunk computations of one run: chunks computed at their placement plus canonical encodes."""
    total = run["total"]
    if total["chunks_computed"] is None:
        raise RuntimeError("the batch records do not count the chunks computed (a window policy other than exact); "
                           "this indicates a bug")
    return total["chunks_computed"] + total["encodes"]


def placements_read(run: dict[str, Any]) -> tuple[int, int, int]:
    """(distinct chunks, distinct placements, the sum over workers of the distinct placements of
    the tasks each ran) that one run's reads held."""
    from agents.batch import distinct_reads

    seen = distinct_reads(run["records"])
    if seen is None:
        raise RuntimeError("the batch records do not name the chunks read (a vision-language model); "
                           "this indicates a bug")
    by_worker: dict[Any, list[dict[str, Any]]] = {}
    for r in run["records"]:
        by_worker.setdefault(r.get("worker"), []).append(r)
    return seen[0], seen[1], sum(distinct_reads(rs)[1] for rs in by_worker.values())


def hit_rate(run: dict[str, Any], redis: bool) -> tuple[float | None, str]:
    """(rate, what it is) of a shared run; see the module docstring."""
    if redis:
        store = run["total"]["store_lookups"]
        hits, misses = store.get("remote_hits", 0), store.get("remote_misses", 0)
        return (hits / (hits + misses) if hits + misses else None,
                "redis remote tier: remote hits / (remote hits + remote misses), summed over tasks")
    hits, computed = run["total"]["chunks_from_store"], computations(run)
    return (hits / (hits + computed) if hits + computed else None,
            "shared directory (no Redis): chunks read from the store / (read + computed)")


def measure_get(location: str, fingerprint: str, entries: int, entry_mb: float) -> dict[str, Any]:
    """Put `entries` entries of `entry_mb` MiB, then time `get` of each from a fresh store object."""
    import torch

    from agents.batch import open_task_store
    from agentwin.store import ChunkKey

    tenant = f"fleet-get-{uuid.uuid4().hex[:8]}"
    numel = max(1, int(entry_mb * (1 << 20)) // 2)
    keys = [ChunkKey.of(fingerprint, "text", [i, 7, 7], tenant=tenant) for i in range(entries)]
    writer = open_task_store(location, fingerprint, tenant)
    try:
        for i, key in enumerate(keys):
            writer.put(key, {"kv": torch.full((numel,), float(i), dtype=torch.float16)}, {"bench": "fleet"})
    finally:
        getattr(writer, "close", lambda: None)()
    reader = open_task_store(location, fingerprint, tenant)
    got, seconds = 0, 0.0
    try:
        for key in keys:
            t0 = time.perf_counter()
            hit = reader.get(key)
            seconds += time.perf_counter() - t0
            if hit is None:
                raise RuntimeError(f"remote_get_mb_s: entry {key} written a moment ago is missing from {location}")
            got += sum(t.numel() * t.element_size() for t in hit[0].values())
        for key in keys:
            reader.delete(key)
    finally:
        getattr(reader, "close", lambda: None)()
    return {"mb_s": got / (1 << 20) / seconds, "entries": entries, "entry_mb": entry_mb, "seconds": seconds}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both runs and the get throughput; the figures as a dict."""
    from agents.batch import redact

    model = args.model or ("tiny-llama-gqa" if args.quick else "smollm2")
    n_tasks = args.tasks or (6 if args.quick else 12)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    redis = args.store is not None
    with tempfile.TemporaryDirectory(prefix="agentwin-fleet-") as tmp:
        folder = Path(tmp)
        tasks = write_workload(folder, n_tasks, args.docs, args.quick)
        progress = not args.quiet
        runs: dict[str, list[dict[str, Any]]] = {"shared": [], "private": []}
        for r in range(args.repeats):
            for side in (("shared", "private") if r % 2 == 0 else ("private", "shared")):
                label = f"{side} store{'s' if side == 'private' else ''}" + (f" ({r + 1}/{args.repeats})" if args.repeats > 1 else "")
                if side == "shared":
                    location = args.store or str(folder / f"shared-{r}")
                    tenant = f"fleet-{uuid.uuid4().hex[:8]}-" if redis else ""
                    runs["shared"].append(run_fleet(tasks, model, args.workers, threads, location, False, tenant, label,
                                                    progress))
                else:
                    runs["private"].append(run_fleet(tasks, model, args.workers, threads, str(folder / f"private-{r}"),
                                                     True, "", label, progress))
        shared, private = runs["shared"][0], runs["private"][0]
        read = {side: [placements_read(x) for x in runs[side]] for side in runs}
        if any(seen[:2] != read["shared"][0][:2] for side in runs for seen in read[side]):
            raise RuntimeError(f"the runs read different chunks or placements ({read}) although their tasks are the "
                               "same; this indicates a bug")
        fingerprint = shared["workers"][0]["fingerprint"]
        get_location = args.store or str(folder / "shared-get")
        get = measure_get(get_location, fingerprint, args.get_entries, args.get_entry_mb)
    rate, kind = hit_rate(shared, redis)
    return {
        "benchmark": "fleet", "model": model, "quick": bool(args.quick), "workers": args.workers,
        "threads_per_worker": threads, "cpu_count": os.cpu_count(), "tasks": n_tasks, "docs": args.docs,
        "distinct_chunks": read["shared"][0][0], "distinct_placements": read["shared"][0][1],
        "distinct_placements_private": read["private"][0][2],
        "distinct_placements_private_runs": [seen[2] for seen in read["private"]],
        "shared_store": redact(args.store) if redis else "a directory on local disk shared by the workers",
        "private_store": "a directory per worker",
        "encodes_shared": computations(shared), "encodes_private": computations(private),
        "remote_hit_rate": rate, "hit_rate_kind": kind,
        "store_hits_shared": shared["total"]["chunks_from_store"],
        "store_hits_private": private["total"]["chunks_from_store"],
        "exact_hits_shared": shared["total"]["exact_hits"], "exact_hits_private": private["total"]["exact_hits"],
        "chunk_tokens_computed_shared": shared["total"]["chunk_tokens_computed"],
        "chunk_tokens_computed_private": private["total"]["chunk_tokens_computed"],
        "waited_shared": shared["total"]["waited"], "waited_shared_runs": [x["total"]["waited"] for x in runs["shared"]],
        "forwards_shared": shared["total"]["forwards"], "forwards_private": private["total"]["forwards"],
        "repeats": args.repeats,
        "encodes_shared_runs": [computations(x) for x in runs["shared"]],
        "encodes_private_runs": [computations(x) for x in runs["private"]],
        **{f"{k}_shared": leases(shared)[k] for k in LEASE_COUNTERS},
        **{f"{k}_shared_runs": [leases(x)[k] for x in runs["shared"]] for k in LEASE_COUNTERS},
        **{f"{k}_{side}": v for side in ("shared", "private") for k, v in walls(runs[side]).items()},
        "tasks_per_worker_shared": per_worker(shared["records"]), "tasks_per_worker_private": per_worker(private["records"]),
        "remote_get_mb_s": get["mb_s"], "get_entries": get["entries"], "get_entry_mb": get["entry_mb"],
        "get_tier": (f"redis ({redact(args.store)})" if redis else
                     "directory: local disk tier, files likely in the page cache (not a network tier)"),
        "loadavg": {"shared": [shared["loadavg_before"], shared["loadavg_after"]],
                    "private": [private["loadavg_before"], private["loadavg_after"]]},
        "loadavg_runs": {side: [[x["loadavg_before"], x["loadavg_after"]] for x in runs[side]] for side in runs},
        "answers_agree": all(answers(x["records"]) == answers(shared["records"]) for side in runs for x in runs[side]),
    }


LEASE_COUNTERS = ("lease_waits", "lease_hits", "lease_takeovers")


def leases(run: dict[str, Any]) -> dict[str, int]:
    """The store's lease counters of one run, summed over its tasks."""
    lookups = run["total"]["store_lookups"]
    return {k: int(lookups.get(k, 0)) for k in LEASE_COUNTERS}


def walls(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, least and every repeat's task wall time, and the median start-up, of one side."""
    wall = [x["wall_s"] for x in runs]
    return {"wall_s": statistics.median(wall), "wall_s_min": min(wall), "wall_s_runs": wall,
            "startup_s": statistics.median(x["startup_s"] for x in runs)}


def per_worker(records: list[dict[str, Any]]) -> dict[str, int]:
    """Tasks run by each worker."""
    out: dict[str, int] = {}
    for r in records:
        out[str(r.get("worker"))] = out.get(str(r.get("worker")), 0) + 1
    return dict(sorted(out.items()))


def answers(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each task's answer by task id."""
    return {r["id"]: r.get("answer") for r in records}


def format_table(r: dict[str, Any]) -> str:
    """The figures as the command prints them."""
    rate = "n/a" if r["remote_hit_rate"] is None else f"{r['remote_hit_rate']:.2f}"
    rows = [
        ("model / workers x threads", f"{r['model']} / {r['workers']} x {r['threads_per_worker']}"),
        ("tasks over documents", f"{r['tasks']} over {r['docs']} PDFs ({r['distinct_chunks']} distinct chunks, "
                                 f"{r['distinct_placements']} distinct placements)"),
        ("chunks computed shared / private", f"{r['encodes_shared']} / {r['encodes_private']} (distinct placements "
                                             f"{r['distinct_placements']} / {r['distinct_placements_private']})"),
        ("placements waited for (shared)", f"{r['waited_shared']}"),
        ("lease waits / hits / takeovers (shared)",
         f"{r['lease_waits_shared']} / {r['lease_hits_shared']} / {r['lease_takeovers_shared']}"),
        ("hit rate (shared)", f"{rate} ({r['hit_rate_kind']})"),
        (f"tasks wall s shared / private, median of {r['repeats']}",
         f"{r['wall_s_shared']:.2f} / {r['wall_s_private']:.2f} (min {r['wall_s_min_shared']:.2f} / "
         f"{r['wall_s_min_private']:.2f}; + startup {r['startup_s_shared']:.1f} / {r['startup_s_private']:.1f})"),
        ("shared tier get", f"{r['remote_get_mb_s']:.0f} MiB/s ({r['get_entries']} x {r['get_entry_mb']:g} MiB; "
                            f"{r['get_tier']})"),
        ("load average (1 min) before", f"shared {r['loadavg']['shared'][0][0]:.2f}, private {r['loadavg']['private'][0][0]:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
