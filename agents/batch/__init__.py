"""Many agent tasks over a pool of workers that share one store (`agentwin batch`).

A task file is JSON Lines, one task per line:

    {"id": "q1", "kind": "doc", "source": "report.pdf", "question": "Who signed?", "max_steps": 8}
    {"id": "w1", "kind": "web", "source": "http://127.0.0.1:8000/", "task": "Find the opening hours"}

`read_tasks(path)` checks every line (`parse_task`): a line that is not a JSON object, an unknown
kind or field, a missing source or question becomes a failed result record for that line (the
others run); a file that cannot be used at all (missing, not text, a JSON array, no task in it)
raises `TaskFileError`. Relative sources are resolved against the task file's folder.

Per-task fields: id (default "line N"), kind (doc | web | video), source (a path, or a URL for
web), question or task, and optionally max_steps, budget_tokens, max_new_tokens, rank ("budget",
N or "exact"), patch (origin-akin | origin-similar | origin | fresh | none), patch_bytes (with
rank "budget"), max_kl (a fidelity target, `agentwin.Window`), max_chars (doc), allow_hosts
(web), segment_seconds and fps (video), and script: a list of actions (dicts or JSON strings)
replayed instead of the model's own decisions (`agents.batch.reads.ReadingScript`): each decision
still reads the window after its prompt, so the chunks computed, forwards and store counts are
the model's real work (all but the reply's tokens).

A `Worker` loads its model once, opens the store once (`WorkerConfig.store`: None for RAM only, a
directory, or a redis:// URL) and runs tasks one after another, each on a fresh window over that
store; `Worker.run` returns a JSON-able result record and never raises for a task's failure.
`run_batch` drives a pool of workers: in this process (`backend="inline"`, one worker), in spawned
processes (`"processes"`, each takes tasks from its own queue), or as Ray actors (`"ray"`). A task
that fails (an error, or its worker died under it) is retried once on the next free worker; the
rest go on. Results arrive through `on_result` in completion order. Ctrl-C (KeyboardInterrupt)
stops the workers and propagates; what was already reported stays reported.

This package imports no tensors library at import time (the worker imports the model when built).

Modules: `tasks` (task records, parsing and checks, errors), `worker` (`WorkerConfig`, `Worker`),
`reads` (what each read of a task's window held: chunks computed, placements, `ReadingScript`),
`executors` (inline / process / Ray pools, `make_pool`), `runner` (`Scheduler`, `run_batch`,
`BatchOutcome`, `summarize`). Every name is re-exported here: import from `agents.batch`.
`cli` (the `agentwin batch` command's run) is not re-exported.
"""

from agents.batch.tasks import (COMMON_FIELDS, KIND_DEFAULTS, KIND_FIELDS, KINDS, PATCHES, BatchError, Task, TaskError,
                                TaskFileError, failed_record, missing_sources, parse_task, read_tasks, task_to_json)
from agents.batch.worker import Worker, WorkerConfig, make_env, open_task_store, redact, worker_store_location
from agents.batch.reads import ReadingScript, ReadLedger, distinct_reads, placements_of
from agents.batch.executors import BACKENDS, InlinePool, ProcessPool, RayPool, make_pool
from agents.batch.runner import BatchOutcome, Scheduler, died_record, run_batch, summarize

__all__ = ["BatchError", "BatchOutcome", "KINDS", "ReadLedger", "ReadingScript", "Scheduler", "Task", "TaskError",
           "TaskFileError", "Worker", "WorkerConfig", "distinct_reads", "failed_record", "make_env", "missing_sources",
           "open_task_store", "parse_task", "placements_of", "read_tasks", "redact", "run_batch", "summarize",
           "task_to_json", "worker_store_location"]
