"""Many agent tasks over a pool of workers that share one store (`agentwin batch`).

A task file is JSON Lines, one task per line:

    {"id": "q1", "kind": "doc", "source": "report.pdf", "question": "Who signed?", "max_steps": 8}
    {"id": "w1", "kind": "web", "source": "http://127.0.0.1:8000/", "task": "Find the opening hours"}

`read_tasks(path)` checks every line (`parse_task`): a line that is not a JSON object, an unknown
kind or field, a missing source or question becomes a failed result record for that line (the
others run); a file that cannot be used at all (missing, not text, a JSON array, no task in it)
raises `TaskFileError`. Relative sources are resolved against the task file's folder.

Per-task fields: id (default "line N"), kind (doc | web | video), source (a path, or a URL for
web), question or task, and optionally max_steps, budget_tokens, max_new_tokens, rank (N or
"exact"), patch (origin | fresh | none), measure_prefill (bool), max_chars (doc), allow_hosts
(web), segment_seconds and fps (video), and script: a list of actions (dicts or JSON strings)
replayed by `agents.model.ScriptedDecider` instead of the model's own decisions; the model still
encodes every observation, so encodes, forwards and store hits are real.

A `Worker` loads its model once, opens the store once (`WorkerConfig.store`: None for RAM only, a
directory, or a redis:// URL) and runs tasks one after another, each on a fresh window over that
store; `Worker.run` returns a JSON-able result record and never raises for a task's failure.
`run_batch` drives a pool of workers: in this process (`backend="inline"`, one worker), in spawned
processes (`"processes"`, each takes tasks from its own queue), or as Ray actors (`"ray"`). A task
that fails (an error, or its worker died under it) is retried once on the next free worker; the
rest go on. Results arrive through `on_result` in completion order. Ctrl-C (KeyboardInterrupt)
stops the workers and propagates; what was already reported stays reported.

This module imports no tensors library at import time (the worker imports the model when built).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

KINDS = ("doc", "web", "video")
# Per kind: (window budget in tokens, step limit), as `agentwin doc | web | video` use by default.
KIND_DEFAULTS = {"doc": (1024, 12), "web": (2048, 12), "video": (4096, 16)}
COMMON_FIELDS = ("id", "kind", "source", "question", "task", "script", "max_steps", "budget_tokens",
                 "max_new_tokens", "rank", "patch", "measure_prefill")
KIND_FIELDS = {"doc": ("max_chars",), "web": ("allow_hosts",), "video": ("segment_seconds", "fps")}
PATCHES = ("origin", "fresh", "none")
BACKENDS = ("inline", "processes", "ray")


class TaskFileError(ValueError):
    """The task file cannot be used at all; the message says what to fix."""


class TaskError(ValueError):
    """One task line is invalid; the message says what to fix."""


class BatchError(RuntimeError):
    """The batch cannot run (no worker could start); the message says why."""


# ---- tasks ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """One validated task. `options` holds the optional per-task fields that were given."""

    id: str
    kind: str
    source: str
    question: str
    line: int = 0
    script: tuple[str, ...] | None = None  # replies for ScriptedDecider (JSON text each)
    options: dict[str, Any] = field(default_factory=dict)


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TaskError(f'"{what}" must be a positive integer, got {value!r}')
    return value


def _positive_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TaskError(f'"{what}" must be a positive number, got {value!r}')
    return float(value)


def _check_rank(value: Any) -> int | None:
    if isinstance(value, str) and value.lower() in ("exact", "none", "full"):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TaskError(f'"rank" must be a positive integer or "exact", got {value!r}')
    return value


def _check_script(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise TaskError('"script" must be a non-empty list of actions, e.g. [{"action": "next"}, '
                        '{"action": "answer", "text": "..."}]')
    bad = [r for r in value if not isinstance(r, (dict, str))]
    if bad:
        raise TaskError(f'"script" entries must be action objects or strings, got {bad[0]!r}')
    return tuple(json.dumps(r) if isinstance(r, dict) else r for r in value)


def _check_hosts(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(h, str) and h for h in value):
        raise TaskError(f'"allow_hosts" must be a host name or a list of them, got {value!r}')
    return list(value)


_OPTION_CHECKS: dict[str, Callable[[Any], Any]] = {
    "max_steps": lambda v: _positive_int(v, "max_steps"),
    "budget_tokens": lambda v: _positive_int(v, "budget_tokens"),
    "max_new_tokens": lambda v: _positive_int(v, "max_new_tokens"),
    "max_chars": lambda v: _positive_int(v, "max_chars"),
    "segment_seconds": lambda v: _positive_number(v, "segment_seconds"),
    "fps": lambda v: _positive_number(v, "fps"),
    "rank": _check_rank,
    "allow_hosts": _check_hosts,
}


def _check_option(name: str, value: Any) -> Any:
    if name == "patch":
        if value not in PATCHES:
            raise TaskError(f'"patch" must be one of {", ".join(PATCHES)}, got {value!r}')
        return value
    if name == "measure_prefill":
        if not isinstance(value, bool):
            raise TaskError(f'"measure_prefill" must be true or false, got {value!r}')
        return value
    return _OPTION_CHECKS[name](value)


def _resolve_source(kind: str, source: Any, base: Path | None) -> str:
    if not isinstance(source, str) or not source.strip():
        what = "a start URL (http or https)" if kind == "web" else "the path of the file to read"
        raise TaskError(f'"source" is missing or empty; give {what}')
    source = source.strip()
    if kind == "web" or "://" in source or base is None:
        return source
    path = Path(source).expanduser()
    return str(path if path.is_absolute() else base / path)


def parse_task(obj: Any, line: int = 0, base: str | os.PathLike | None = None) -> Task:
    """A `Task` from one decoded JSON value; `TaskError` says what is wrong and how to fix it.
    `base`: the folder relative sources are resolved against (None: left as given)."""
    if not isinstance(obj, dict):
        raise TaskError(f"a task must be a JSON object, got {type(obj).__name__}; write "
                        '{"kind": "doc", "source": "file.pdf", "question": "..."}')
    kind = obj.get("kind")
    if kind not in KINDS:
        raise TaskError(f'unknown "kind" {kind!r}; use one of {", ".join(KINDS)}')
    allowed = set(COMMON_FIELDS) | set(KIND_FIELDS[kind])
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise TaskError(f"unknown field(s) {', '.join(map(repr, unknown))} for a {kind} task; "
                        f"known fields: {', '.join(sorted(allowed))}")
    if "question" in obj and "task" in obj:
        raise TaskError('give either "question" or "task", not both')
    question = obj.get("question", obj.get("task"))
    if not isinstance(question, str) or not question.strip():
        raise TaskError('"question" (or "task") is missing or empty; say what the agent should find out or do')
    raw_id = obj.get("id", f"line {line}")
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or str(raw_id) == "":
        raise TaskError(f'"id" must be a non-empty string or an integer, got {raw_id!r}')
    source = _resolve_source(kind, obj.get("source"), None if base is None else Path(base))
    options = {k: _check_option(k, v) for k, v in obj.items() if k in _OPTION_CHECKS or k in ("patch", "measure_prefill")}
    script = _check_script(obj["script"]) if "script" in obj else None
    return Task(id=str(raw_id), kind=kind, source=source, question=question.strip(), line=line,
                script=script, options=options)


def failed_record(task_id: str, error: str, line: int = 0, kind: Any = None, source: Any = None) -> dict[str, Any]:
    """The result record of a task that never ran (bad input)."""
    return {"id": task_id, "ok": False, "answer": None, "stopped": "error", "steps": 0, "error": error,
            "attempts": 0, "worker": None, "seconds": 0.0, "line": line, "kind": kind, "source": source}


def _read_text(path: Path) -> str:
    if not path.exists():
        raise TaskFileError(f"{path}: no such file; give a JSON Lines file with one task object per line")
    if not path.is_file():
        raise TaskFileError(f"{path}: not a file; give a JSON Lines file with one task object per line")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise TaskFileError(f"{path}: not UTF-8 text ({err}); save the task file as UTF-8 JSON Lines") from None
    except OSError as err:
        raise TaskFileError(f"{path}: cannot be read ({err.strerror or err})") from None


def read_tasks(path: str | os.PathLike) -> tuple[list[Task], list[dict[str, Any]]]:
    """(valid tasks, failed records for invalid lines) of a JSON Lines task file; blank lines
    are skipped. Raises TaskFileError when the file as a whole cannot be used."""
    path = Path(path)
    text = _read_text(path)
    if text.lstrip().startswith("["):
        raise TaskFileError(f"{path}: the file is a JSON array; write one task object per line (JSON Lines), "
                            'e.g. {"id": "q1", "kind": "doc", "source": "a.pdf", "question": "..."}')
    tasks: list[Task] = []
    bad: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    lines = [(n, raw) for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not lines:
        raise TaskFileError(f"{path}: no tasks in the file; write one task object per line")
    for n, raw in lines:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            bad.append(failed_record(f"line {n}", f"{path}:{n}: not a JSON object ({err.msg} at column {err.colno}); "
                                     "each line must be one complete JSON object", line=n))
            continue
        task_id = str(obj.get("id", f"line {n}")) if isinstance(obj, dict) else f"line {n}"
        try:
            task = parse_task(obj, n, base=path.parent.resolve())
        except TaskError as err:
            bad.append(failed_record(task_id, f"{path}:{n}: {err}", line=n,
                                     kind=obj.get("kind") if isinstance(obj, dict) else None))
            continue
        if task.id in seen:
            bad.append(failed_record(task.id, f"{path}:{n}: duplicate id {task.id!r} (first on line {seen[task.id]}); "
                                     "give every task its own id", line=n, kind=task.kind, source=task.source))
            continue
        seen[task.id] = n
        tasks.append(task)
    if not tasks and len(bad) == len(lines) and all("not a JSON object" in b["error"] for b in bad):
        raise TaskFileError(f"{path}: no line is a JSON object (first: {bad[0]['error'].split(': ', 1)[1]}); "
                            "write one task object per line (JSON Lines), not a pretty-printed document")
    return tasks, bad


# ---- the worker -----------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerConfig:
    """What every worker of a batch shares.

    store: None (RAM only), a directory, or a redis:// URL, opened once per worker. private:
    each worker gets a store of its own instead (a subfolder `worker-N` of a directory, or tenant
    `worker-N` on Redis; RAM stores are private anyway). threads: torch threads per worker (None:
    leave torch's default). budget_tokens / max_steps / max_new_tokens / rank / patch: defaults
    for tasks that do not set them (None budget / max_steps: the kind's default)."""

    model: str = "smollm2"
    store: str | None = None
    private: bool = False
    tenant: str = ""
    threads: int | None = None
    budget_tokens: int | None = None
    max_steps: int | None = None
    max_new_tokens: int = 48
    rank: int | None = 16
    patch: str = "origin"
    measure_prefill: bool = False


def open_task_store(location: str | None, model_fingerprint: str, tenant: str = "") -> Any:
    """The store at `location` (None: RAM only; a directory; a redis:// or rediss:// URL), via
    `agentwin.store.open_store`; its ValueError says which forms a location may take."""
    from agentwin.store import open_store

    return open_store(location, model_fingerprint=model_fingerprint, tenant=tenant)


def redact(location: str) -> str:
    """A store location fit for logs: a URL's password replaced by ***."""
    from urllib.parse import urlsplit

    if "://" not in location:
        return location
    try:
        password = urlsplit(location).password
    except ValueError:
        return location
    return location if password is None else location.replace(f":{password}@", ":***@", 1)


def worker_store_location(config: WorkerConfig, worker_id: int) -> tuple[str | None, str]:
    """(location, tenant) of worker `worker_id`'s store under `config`."""
    location, tenant = config.store, config.tenant
    if not config.private or location is None:
        return location, tenant
    if location.startswith(("redis://", "rediss://")):
        return location, f"{tenant}worker-{worker_id}"
    return str(Path(location) / f"worker-{worker_id}"), tenant


def _store_counters(store: Any) -> dict[str, int]:
    stats = store.stats()
    names = ("hits", "misses", "remote_hits", "remote_misses")
    return {n: int(getattr(stats, n)) for n in names if hasattr(stats, n)}


class Worker:
    """One model and one store, running tasks one at a time; see the module docstring."""

    def __init__(self, config: WorkerConfig, worker_id: int = 0) -> None:
        import torch

        from agentwin import KameraModel

        self.config, self.worker_id = config, worker_id
        self._threads_before = torch.get_num_threads()
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        t0 = time.perf_counter()
        location, tenant = worker_store_location(config, worker_id)
        try:
            self.km = KameraModel.from_pretrained(config.model)
        except (ValueError, OSError) as err:
            torch.set_num_threads(self._threads_before)
            raise BatchError(f"cannot load model {config.model!r}: {err}") from err
        try:
            self.store = open_task_store(location, self.km.fingerprint, tenant)
        except (ValueError, TypeError, OSError) as err:
            torch.set_num_threads(self._threads_before)
            raise BatchError(f"cannot open store {redact(str(location))!r}: {err}") from err
        self.store_location = None if location is None else redact(location)
        self.load_s = time.perf_counter() - t0

    def info(self) -> dict[str, Any]:
        """Where and how this worker runs (for logs and reports)."""
        import torch

        return {"worker": self.worker_id, "host": socket.gethostname(), "pid": os.getpid(),
                "model": self.config.model, "fingerprint": self.km.fingerprint, "threads": torch.get_num_threads(),
                "store": self.store_location, "load_s": round(self.load_s, 3)}

    def close(self) -> None:
        import torch

        close = getattr(self.store, "close", None)
        if close is not None:
            close()
        torch.set_num_threads(self._threads_before)

    def run(self, task: Task, attempt: int = 1) -> dict[str, Any]:
        """Run `task` on a fresh window; a result record (never raises for the task's failure)."""
        t0 = time.perf_counter()
        before = _store_counters(self.store)
        record = {"id": task.id, "line": task.line, "kind": task.kind, "source": task.source}
        try:
            summary, stats = self._run(task)
        except Exception as err:  # any failure of one task is recorded; the worker goes on
            record.update(ok=False, stopped="error", answer=None, steps=0, error=_error_text(err))
            if not _expected(err):
                record["traceback"] = _short_traceback(err)
        else:
            error = summary.stopped[len("error: "):] if summary.stopped.startswith("error") else None
            record.update(_summary_fields(summary, stats), ok=summary.stopped == "answer", error=error)
        after = _store_counters(self.store)
        record["store"] = {k: after[k] - before.get(k, 0) for k in after}
        record.update(attempts=attempt, worker=self.worker_id, host=socket.gethostname(),
                      seconds=round(time.perf_counter() - t0, 4))
        return _ordered(record)

    def _run(self, task: Task) -> tuple[Any, Any]:
        from agents.loop import AgentLoop
        from agents.model import ScriptedDecider, WindowDecider
        from agentwin import Window

        cfg, opt = self.config, task.options
        budget, steps = KIND_DEFAULTS[task.kind]
        if task.kind == "video" and not getattr(self.km, "is_vlm", False):
            raise BatchError(f"{cfg.model} is a text-only model; video tasks need a vision-language model "
                             "(--model tiny-qwen2.5-vl, or a Qwen2/2.5/3-VL path)")
        window = Window(self.km, budget_tokens=opt.get("budget_tokens", cfg.budget_tokens or budget),
                        patch=opt.get("patch", cfg.patch), rank=opt.get("rank", cfg.rank), store=self.store)
        decider = (ScriptedDecider(list(task.script)) if task.script is not None
                   else WindowDecider(opt.get("max_new_tokens", cfg.max_new_tokens)))
        env = make_env(task, self.km)
        try:
            result = AgentLoop(env, window, decider, task.question, max_steps=opt.get("max_steps", cfg.max_steps or steps),
                               measure_prefill=opt.get("measure_prefill", cfg.measure_prefill)).run()
        finally:
            env.close()
        return result.summary, window.stats()


def make_env(task: Task, km: Any) -> Any:
    """The environment of `task` (EnvError when its source cannot be opened)."""
    vlm = bool(getattr(km, "is_vlm", False))
    if task.kind == "doc":
        from agents.doc import PdfEnv

        return PdfEnv(task.source, render=vlm, max_chars=task.options.get("max_chars", 1500))
    if task.kind == "web":
        from agents.web import BrowserEnv

        return BrowserEnv(task.source, allow_hosts=task.options.get("allow_hosts"), screenshot=vlm)
    from agents.video import VideoEnv

    return VideoEnv(task.source, segment_seconds=task.options.get("segment_seconds", 4.0),
                    fps=task.options.get("fps", 2.0))


_FIRST = ("id", "ok", "answer", "stopped", "steps", "error", "encodes", "store_hits", "attempts", "worker", "seconds")


def _ordered(record: dict[str, Any]) -> dict[str, Any]:
    """The record with the fields people read first at the front."""
    return {**{k: record[k] for k in _FIRST if k in record}, **record}


def _summary_fields(summary: Any, stats: Any) -> dict[str, Any]:
    forwards = {k: int(v) for k, v in stats.forwards.items() if v}
    return {"stopped": summary.stopped, "answer": summary.answer, "steps": summary.steps,
            "encodes": forwards.get("encode", 0), "forwards": forwards,
            "forward_tokens": {k: int(v) for k, v in stats.forward_tokens.items() if v},
            "store_hits": summary.store_hits, "content_hits": summary.content_hits,
            "evictions": summary.evictions, "recalls": summary.recalls,
            "encoder_calls": summary.encoder_calls, "encoder_hits": summary.encoder_hits,
            "encode_tokens_avoided": summary.encode_tokens_avoided,
            "prefill_tokens_avoided": summary.prefill_tokens_avoided,
            "malformed_replies": summary.malformed_replies, "refused_actions": summary.refused_actions,
            "time_saved_s": summary.time_saved_s}


def _expected(err: BaseException) -> bool:
    """An error that explains itself (bad input, an environment that cannot start)."""
    from agents.base import EnvError

    return isinstance(err, (EnvError, BatchError))


def _error_text(err: BaseException) -> str:
    return str(err) if _expected(err) else f"{type(err).__name__}: {err}"


def _short_traceback(err: BaseException, frames: int = 3) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=-frames)).strip()


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
            root = str(Path(__file__).resolve().parent.parent)
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

    pool = make_pool(config, workers, backend, ray_address)
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
    """Totals over result records: tasks, ok, failed, encodes, forwards by kind, store hits."""
    forwards: dict[str, int] = {}
    store: dict[str, int] = {}
    for r in records:
        for k, v in (r.get("forwards") or {}).items():
            forwards[k] = forwards.get(k, 0) + v
        for k, v in (r.get("store") or {}).items():
            store[k] = store.get(k, 0) + v
    return {"tasks": len(records), "ok": sum(1 for r in records if r.get("ok")),
            "failed": sum(1 for r in records if r.get("error")),
            "encodes": sum(r.get("encodes", 0) for r in records),
            "store_hits": sum(r.get("store_hits", 0) for r in records),
            "forwards": forwards, "store": store}


def task_to_json(task: Task) -> dict[str, Any]:
    """A task back as its JSON object (for writing task files)."""
    out = {"id": task.id, "kind": task.kind, "source": task.source, "question": task.question, **task.options}
    if task.script is not None:
        out["script"] = list(task.script)  # each reply as JSON text, as ScriptedDecider takes them
    return out


__all__ = ["BatchError", "BatchOutcome", "KINDS", "Scheduler", "Task", "TaskError", "TaskFileError", "Worker",
           "WorkerConfig", "failed_record", "make_env", "open_task_store", "parse_task", "read_tasks", "redact", "run_batch",
           "summarize", "task_to_json", "worker_store_location"]
