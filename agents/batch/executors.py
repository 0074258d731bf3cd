"""Executors: pools of Workers in this process, in spawned processes, or as Ray actors.

`_process_main` and `Worker` are sent to child processes / Ray by reference, so they stay at the
top level of importable modules (`agents.batch.executors`, `agents.batch.worker`).
"""

from __future__ import annotations

import os
import queue
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any

from agents.batch.tasks import BatchError, Task
from agents.batch.worker import Worker, WorkerConfig, _error_text

BACKENDS = ("inline", "processes", "ray")

# ---- pools: the same protocol in this process, in child processes, and on Ray ----------------
# A pool starts `workers` Workers and reports events from poll(): ("ready", wid, info),
# ("failed", wid, message) for a worker that could not start, ("done", wid, record), and
# ("died", wid, message) for a worker that is gone.

class InlinePool:
    """One Worker in this process; submit runs the task at once."""

    def __init__(self, config: WorkerConfig, workers: int = 1) -> None:
        if workers != 1:
            raise ValueError(f"the inline backend runs one worker, got workers={workers}; use processes or ray")
        self.size, self._events = 1, deque()
        try:
            self._worker = Worker(config, 0)
        except BatchError as err:
            self._worker = None
            self._events.append(("failed", 0, str(err)))
        else:
            self._events.append(("ready", 0, self._worker.info()))

    def submit(self, wid: int, task: Task, attempt: int) -> None:
        self._events.append(("done", wid, self._worker.run(task, attempt)))

    def poll(self, timeout: float) -> list[tuple[str, int, Any]]:
        out = list(self._events)
        self._events.clear()
        return out

    def close(self, interrupted: bool = False) -> None:
        if self._worker is not None:
            self._worker.close()


def _process_main(config: WorkerConfig, worker_id: int, inbox: Any, outbox: Any) -> None:
    """A worker process: load once, then run (task, attempt) items from `inbox` until None."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        worker = Worker(config, worker_id)
    except Exception as err:  # reported to the parent, which decides whether the batch can run
        outbox.put(("failed", worker_id, _error_text(err)))
        return
    outbox.put(("ready", worker_id, worker.info()))
    try:
        while (item := inbox.get()) is not None:
            outbox.put(("done", worker_id, worker.run(*item)))
    finally:
        worker.close()


class ProcessPool:
    """Workers in spawned processes, one inbox queue each, one shared outbox."""

    def __init__(self, config: WorkerConfig, workers: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.size = workers
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(workers)]
        self._procs = [ctx.Process(target=_process_main, args=(config, i, self._inboxes[i], self._outbox),
                                   name=f"agentwin-batch-{i}", daemon=True) for i in range(workers)]
        self._gone: set[int] = set()
        self._ready: set[int] = set()
        for p in self._procs:
            p.start()

    def submit(self, wid: int, task: Task, attempt: int) -> None:
        self._inboxes[wid].put((task, attempt))

    def poll(self, timeout: float) -> list[tuple[str, int, Any]]:
        try:
            events = [self._outbox.get(timeout=timeout)]
        except queue.Empty:
            events = []
        while True:
            try:
                events.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        for event in events:
            if event[0] == "failed":
                self._gone.add(event[1])
            elif event[0] == "ready":
                self._ready.add(event[1])
        if not events:  # only look for dead workers when nothing else is pending
            for wid, p in enumerate(self._procs):
                if wid not in self._gone and not p.is_alive():
                    self._gone.add(wid)
                    events.append(("died", wid, f"exited with code {p.exitcode}"))
        return events

    def close(self, interrupted: bool = False) -> None:
        """Ready workers finish their task and exit; the rest (still loading, or everyone when
        interrupted) are terminated."""
        if not interrupted:
            done = [wid for wid in self._ready if wid not in self._gone]
            for wid in done:
                self._inboxes[wid].put(None)
            for wid in done:
                self._procs[wid].join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        for q in (*self._inboxes, self._outbox):
            q.cancel_join_thread()
            q.close()
        # Drop the queues now: their semaphores are released when the objects go, and a traceback
        # that keeps this pool alive until exit would otherwise make them look leaked.
        self._inboxes, self._outbox, self._procs = [], None, []


class RayPool:
    """Workers as Ray actors (one CPU each). Uses the running Ray when `ray.init` was called,
    else starts one: `address="local"` (or None) a local Ray with `num_cpus=workers`, otherwise
    `ray.init(address=address)`; a Ray started here is shut down by close()."""

    def __init__(self, config: WorkerConfig, workers: int, address: str | None = None) -> None:
        import ray

        self._ray, self.size, self._started = ray, workers, False
        if not ray.is_initialized():
            if address in (None, "local"):
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
            self._started = True
        actor = ray.remote(num_cpus=1, max_restarts=0)(Worker)
        if _ray_is_local(ray):  # actors import this checkout, as the driver does
            root = str(Path(__file__).resolve().parent.parent.parent)  # agents/batch/ -> checkout
            path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
            actor = actor.options(runtime_env={"env_vars": {"PYTHONPATH": path}})
        self._actors = [actor.remote(config, i) for i in range(workers)]
        self._pending: dict[Any, tuple[str, int]] = {a.info.remote(): ("ready", i) for i, a in enumerate(self._actors)}

    def submit(self, wid: int, task: Task, attempt: int) -> None:
        self._pending[self._actors[wid].run.remote(task, attempt)] = ("done", wid)

    def poll(self, timeout: float) -> list[tuple[str, int, Any]]:
        ray = self._ray
        if not self._pending:
            time.sleep(timeout)
            return []
        done, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout)
        events = []
        for ref in done:
            kind, wid = self._pending.pop(ref)
            try:
                events.append((kind, wid, ray.get(ref)))
            except ray.exceptions.RayActorError as err:
                events.append(("failed" if kind == "ready" else "died", wid, _actor_error(err)))
        return events

    def close(self, interrupted: bool = False) -> None:
        ray = self._ray
        for a in self._actors:
            ray.kill(a)
        if self._started:
            ray.shutdown()


def _ray_is_local(ray: Any) -> bool:
    """Whether every live node of the Ray cluster is this machine (then the actors can import
    agentwin from this checkout; on other machines it must be installed)."""
    hosts = {n.get("NodeManagerHostname") for n in ray.nodes() if n.get("Alive")}
    return hosts == {socket.gethostname()}


def _actor_error(err: BaseException) -> str:
    """The cause of an actor's death, in one line (Ray's message is a page long)."""
    cause = getattr(err, "cause", None) or getattr(err, "error_msg", None)
    text = str(cause) if cause is not None else str(err)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln
    return lines[-1] if lines else type(err).__name__



def make_pool(config: WorkerConfig, workers: int, backend: str, ray_address: str | None = None) -> Any:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if backend == "inline":
        return InlinePool(config, workers)
    if backend == "processes":
        return ProcessPool(config, workers)
    return RayPool(config, workers, ray_address)

