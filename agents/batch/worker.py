"""The Worker that runs one task at a time on one model and one store (see `agents.batch`).

The model (and torch) are imported when a Worker is built, not at import time.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.batch.tasks import KIND_DEFAULTS, BatchError, Task

@dataclass(frozen=True)
class WorkerConfig:
    """What every worker of a batch shares.

    store: None (RAM only), a directory, or a redis:// URL, opened once per worker. private:
    each worker gets a store of its own instead (a subfolder `worker-N` of a directory, or tenant
    `worker-N` on Redis; RAM stores are private anyway). threads: torch threads per worker (None:
    leave torch's default). quiet: the model loads without progress bars (other lines of the load,
    such as warnings, are kept). budget_tokens / max_steps / max_new_tokens / rank / patch /
    patch_bytes / max_kl: defaults for tasks that do not set them (None budget / max_steps: the
    kind's default; None patch_bytes / max_kl: the window's)."""

    model: str = "smollm2"
    store: str | None = None
    private: bool = False
    tenant: str = ""
    threads: int | None = None
    quiet: bool = False
    budget_tokens: int | None = None
    max_steps: int | None = None
    max_new_tokens: int = 48
    rank: int | str | None = "budget"  # the window's default: within 6% of each chunk's KV bytes
    patch: str = "exact"
    patch_bytes: float | None = None
    max_kl: float | None = None


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
    """The store's lookup counters, and its lease counters: waits on another worker computing the
    same entry, those it served (a compute this worker did not run), and takeovers."""
    stats = store.stats()
    names = ("hits", "misses", "remote_hits", "remote_misses", "lease_waits", "lease_hits", "lease_takeovers")
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
            if config.quiet:
                from agents.console import load_model

                self.km = load_model(config.model, progress=False)
            else:
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
            summary, stats, ledger = self._run(task)
        except Exception as err:  # any failure of one task is recorded; the worker goes on
            record.update(ok=False, stopped="error", answer=None, steps=0, error=_error_text(err))
            if not _expected(err):
                record["traceback"] = _short_traceback(err)
        else:
            error = summary.stopped[len("error: "):] if summary.stopped.startswith("error") else None
            record.update(_summary_fields(summary, stats, ledger), ok=summary.stopped == "answer", error=error)
        after = _store_counters(self.store)
        record["store_lookups"] = {k: after[k] - before.get(k, 0) for k in after}
        record.update(attempts=attempt, worker=self.worker_id, host=socket.gethostname(),
                      seconds=round(time.perf_counter() - t0, 4))
        return _ordered(record)

    def _run(self, task: Task) -> tuple[Any, Any, Any]:
        """The task run on a fresh window: (its RunSummary, the window's stats, the `ReadLedger` of its reads)."""
        from agents.batch.reads import ReadingScript, ReadLedger
        from agents.loop import AgentLoop
        from agents.model import WindowDecider
        from agentwin import Window

        cfg, opt = self.config, task.options
        budget, steps = KIND_DEFAULTS[task.kind]
        if task.kind == "video" and not getattr(self.km, "is_vlm", False):
            raise BatchError(f"{cfg.model} is a text-only model; video tasks need a vision-language model "
                             "(--model with a local path or Hugging Face id of a Qwen2-VL, Qwen2.5-VL or "
                             "Qwen3-VL checkpoint)")
        from agentwin.patches.policies import PATCH_POLICIES

        rank = opt.get("rank", cfg.rank)  # the batch's patch_bytes / max_kl hold where the task's rank allows them
        patch = opt.get("patch", cfg.patch)
        settings = {} if patch not in PATCH_POLICIES else dict(
            rank=rank, patch_bytes=opt.get("patch_bytes", cfg.patch_bytes if rank == "budget" else None),
            max_kl=opt.get("max_kl", cfg.max_kl if rank is not None else None))
        window = Window(self.km, budget_tokens=opt.get("budget_tokens", cfg.budget_tokens or budget), patch=patch,
                        store=self.store, **settings)
        decider = (ReadingScript(task.script) if task.script is not None
                   else WindowDecider(opt.get("max_new_tokens", cfg.max_new_tokens)))
        ledger = ReadLedger(decider, counts=window.policy == "exact", digests=not getattr(self.km, "is_vlm", False))
        env = make_env(task, self.km)
        try:
            result = AgentLoop(env, window, ledger, task.question,
                               max_steps=opt.get("max_steps", cfg.max_steps or steps)).run()
        finally:
            env.close()
        return result.summary, window.stats(), ledger


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


_FIRST = ("id", "ok", "answer", "stopped", "steps", "error", "chunks_computed", "encodes", "chunks_from_store",
          "waited", "attempts", "worker", "seconds")


def _ordered(record: dict[str, Any]) -> dict[str, Any]:
    """The record with the fields people read first at the front."""
    return {**{k: record[k] for k in _FIRST if k in record}, **record}


def _summary_fields(summary: Any, stats: Any, ledger: Any) -> dict[str, Any]:
    """A finished task's fields (what each counts: `tools/batch_cli.py`)."""
    forwards = {k: int(v) for k, v in stats.forwards.items() if v}
    tokens = {k: int(v) for k, v in stats.forward_tokens.items() if v}
    return {"stopped": summary.stopped, "answer": summary.answer, "steps": summary.steps,
            "chunks_computed": ledger.chunks_computed(stats),
            "chunk_tokens_computed": tokens.get("in_context", 0) + tokens.get("recompute", 0),
            "encodes": forwards.get("encode", 0), "exact_hits": stats.exact_hits,
            "exact_hit_tokens": stats.exact_hit_tokens, "waited": stats.waited,
            "chunks_from_store": stats.canonical_hits + stats.exact_hits, "forwards": forwards, "forward_tokens": tokens,
            "content_hits": summary.content_hits, "evictions": summary.evictions, "recalls": summary.recalls,
            "encoder_calls": summary.encoder_calls, "encoder_hits": summary.encoder_hits,
            "malformed_replies": summary.malformed_replies, "refused_actions": summary.refused_actions,
            "read_orders": ledger.read_orders}


def _expected(err: BaseException) -> bool:
    """An error that explains itself (bad input, an environment that cannot start)."""
    from agents.base import EnvError

    return isinstance(err, (EnvError, BatchError))


def _error_text(err: BaseException) -> str:
    return str(err) if _expected(err) else f"{type(err).__name__}: {err}"


def _short_traceback(err: BaseException, frames: int = 3) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=-frames)).strip()
