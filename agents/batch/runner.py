"""The driver: retry scheduling, `run_batch`, its outcome, and totals over result records."""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from agents.batch.reads import distinct_reads
from agents.batch.tasks import BatchError, Task, failed_record
from agents.batch.worker import WorkerConfig

# ---- scheduling -----------------------------------------------------------------------------

class Scheduler:
    """Tasks waiting, attempts, and retries: a failed attempt goes to the back of the queue
    until it has been tried `1 + retries` times."""

    def __init__(self, tasks: Iterable[Task], retries: int = 1) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        self.retries = retries
        self.waiting: deque[tuple[Task, int]] = deque((t, 1) for t in tasks)
        self.running = 0
        self.first_errors: dict[str, str] = {}

    @property
    def finished(self) -> bool:
        return not self.waiting and self.running == 0

    def take(self) -> tuple[Task, int] | None:
        if not self.waiting:
            return None
        self.running += 1
        return self.waiting.popleft()

    def settle(self, task: Task, attempt: int, record: dict[str, Any]) -> dict[str, Any] | None:
        """The final record, or None when the task was queued again for another attempt."""
        self.running -= 1
        if record.get("error") and attempt <= self.retries:
            self.first_errors.setdefault(task.id, record["error"])
            self.waiting.append((task, attempt + 1))
            return None
        if task.id in self.first_errors:
            record["first_error"] = self.first_errors[task.id]
        return record

    def abandon(self, reason: str) -> list[dict[str, Any]]:
        """Final records for every waiting task (no worker is left to run them)."""
        out = []
        while self.waiting:
            task, attempt = self.waiting.popleft()
            out.append({**failed_record(task.id, reason, task.line, task.kind, task.source), "attempts": attempt - 1})
        return out


def died_record(task: Task, attempt: int, worker_id: int, why: str) -> dict[str, Any]:
    """The record of an attempt whose worker died under it."""
    return {**failed_record(task.id, f"worker {worker_id} {why} while running this task", task.line,
                            task.kind, task.source), "attempts": attempt, "worker": worker_id}


# ---- the driver -----------------------------------------------------------------------------

@dataclass
class BatchOutcome:
    """What `run_batch` returns: final records (completion order), the workers' info, the time
    until the first task was handed out (worker start-up) and the whole run's wall time."""

    records: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    startup_s: float
    wall_s: float

    def counts(self) -> dict[str, int]:
        return {"tasks": len(self.records), "ok": sum(1 for r in self.records if r.get("ok")),
                "failed": sum(1 for r in self.records if r.get("error"))}


def run_batch(tasks: Iterable[Task], config: WorkerConfig, workers: int = 1, backend: str = "inline",
              ray_address: str | None = None, retries: int = 1,
              on_result: Callable[[dict[str, Any]], None] | None = None,
              on_status: Callable[[str], None] | None = None, wait_for_workers: bool = False) -> BatchOutcome:
    """Run `tasks` on `workers` workers; see the module docstring. `on_result` gets each final
    record as it is settled, `on_status` one-line news (workers ready, retries, deaths).
    wait_for_workers: hand out no task before every worker has started (or failed to), so
    that timings measure the tasks alone; by default tasks start on the first ready worker.
    Raises BatchError when no worker could start; KeyboardInterrupt stops the workers and
    propagates."""
    t0 = time.perf_counter()
    sched = Scheduler(tasks, retries)
    records: list[dict[str, Any]] = []
    say = on_status or (lambda text: None)

    def emit(record: dict[str, Any] | None) -> None:
        if record is not None:
            records.append(record)
            if on_result is not None:
                on_result(record)

    # Looked up on the package, so that replacing `agents.batch.make_pool` (as tests do) takes effect.
    pool = sys.modules[__package__].make_pool(config, workers, backend, ray_address)
    infos: dict[int, dict[str, Any]] = {}
    failures: list[tuple[int, str]] = []
    idle: list[int] = []
    busy: dict[int, tuple[Task, int]] = {}
    alive = set(range(workers))
    startup = None
    interrupted = True
    try:
        while not sched.finished:
            if startup is None and infos and (not wait_for_workers or len(infos) + len(failures) >= workers):
                startup = time.perf_counter() - t0
            while startup is not None and idle and sched.waiting:
                wid = idle.pop(0)
                busy[wid] = sched.take()
                pool.submit(wid, *busy[wid])
            if not alive:
                if not infos:
                    raise BatchError("no worker could start: " + _failure_text(failures))
                for r in sched.abandon("not run: every worker has exited (" + _failure_text(failures) + ")"):
                    emit(r)
                break
            for kind, wid, payload in pool.poll(0.5):
                if kind == "ready":
                    infos[wid] = payload
                    idle.append(wid)
                    say(f"worker {wid} ready ({len(infos)}/{workers})")
                elif kind == "done":
                    task, attempt = busy.pop(wid)
                    idle.append(wid)
                    final = sched.settle(task, attempt, payload)
                    if final is None:
                        say(f"task {task.id} failed ({payload['error']}); retrying")
                    emit(final)
                else:  # "failed" (could not start) or "died"
                    alive.discard(wid)
                    failures.append((wid, str(payload)))
                    say(f"worker {wid} {'could not start' if kind == 'failed' else 'died'}: {payload}")
                    if wid in busy:
                        task, attempt = busy.pop(wid)
                        emit(sched.settle(task, attempt, died_record(task, attempt, wid, str(payload))))
        interrupted = False
    finally:
        pool.close(interrupted=interrupted)
    return BatchOutcome(records, [infos[w] for w in sorted(infos)], startup or 0.0, time.perf_counter() - t0)


def _failure_text(failures: list[tuple[int, str]]) -> str:
    """'worker 0, 1: why; worker 2: why else' (workers that failed the same way together)."""
    by_text: dict[str, list[int]] = {}
    for wid, text in failures:
        by_text.setdefault(text, []).append(wid)
    return "; ".join(f"worker {', '.join(map(str, sorted(w)))}: {text}" for text, w in by_text.items())


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over result records, under the records' own names (see `tools/batch_cli.py` for what
    each counts): tasks, ok, failed, chunks_computed (None when a record's is None: a policy
    other than exact), chunk_tokens_computed, encodes, exact_hits, waited, chunks_from_store,
    forwards by kind, store_lookups; and distinct_chunks / distinct_placements, the different
    chunks and placements the tasks' reads held (`agents.batch.reads.distinct_reads`; None on a
    vision-language model). With one store and nothing dropped from it, the exact window computes
    each distinct placement once: chunks_computed == distinct_placements."""
    forwards: dict[str, int] = {}
    lookups: dict[str, int] = {}
    for r in records:
        for k, v in (r.get("forwards") or {}).items():
            forwards[k] = forwards.get(k, 0) + v
        for k, v in (r.get("store_lookups") or {}).items():
            lookups[k] = lookups.get(k, 0) + v
    ran = [r for r in records if "chunks_computed" in r]  # records of tasks that ran to a summary
    computed = None if any(r["chunks_computed"] is None for r in ran) else sum(r["chunks_computed"] for r in ran)
    seen = distinct_reads(records)
    return {"tasks": len(records), "ok": sum(1 for r in records if r.get("ok")),
            "failed": sum(1 for r in records if r.get("error")), "chunks_computed": computed,
            **{k: sum(r.get(k, 0) for r in records)
               for k in ("chunk_tokens_computed", "encodes", "exact_hits", "waited", "chunks_from_store")},
            "distinct_chunks": None if seen is None else seen[0],
            "distinct_placements": None if seen is None else seen[1],
            "forwards": forwards, "store_lookups": lookups}
