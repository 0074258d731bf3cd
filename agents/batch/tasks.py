"""Task records, task-file parsing and checks, and the batch's errors (see `agents.batch`).

Imports no tensors library.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

KINDS = ("doc", "web", "video")
# Per kind: (window budget in tokens, step limit), as `agentwin doc | web | video` use by default.
KIND_DEFAULTS = {"doc": (1024, 12), "web": (2048, 12), "video": (4096, 16)}
COMMON_FIELDS = ("id", "kind", "source", "question", "task", "script", "max_steps", "budget_tokens",
                 "max_new_tokens", "rank", "patch", "patch_bytes", "max_kl")
KIND_FIELDS = {"doc": ("max_chars",), "web": ("allow_hosts",), "video": ("segment_seconds", "fps")}
PATCHES = ("exact", "survive", "refresh", "origin-akin", "origin-similar", "origin", "fresh", "none")
PATCH_SETTINGS = ("rank", "patch_bytes", "max_kl")  # only for the patch policies (canonical KV + patch)



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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise TaskError(f'"{what}" must be a positive, finite number, got {value!r}')
    return float(value)


def _fraction(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise TaskError(f'"{what}" must be a fraction of the chunk\'s KV bytes in (0, 1], got {value!r}')
    return float(value)


def _positive_finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise TaskError(f'"{what}" must be a positive KL in nats (such as 0.0024), got {value!r}')
    return float(value)


def _check_rank(value: Any) -> int | str | None:
    if isinstance(value, str) and value.lower() in ("exact", "none", "full"):
        return None
    if isinstance(value, str) and value.lower() == "budget":
        return "budget"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TaskError(f'"rank" must be "budget", a positive integer or "exact", got {value!r}')
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
    "patch_bytes": lambda v: _fraction(v, "patch_bytes"),
    "max_kl": lambda v: _positive_finite(v, "max_kl"),
    "allow_hosts": _check_hosts,
}


def _check_option(name: str, value: Any) -> Any:
    if name == "patch":
        if value not in PATCHES:
            raise TaskError(f'"patch" must be one of {", ".join(PATCHES)}, got {value!r}')
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
    options = {k: _check_option(k, v) for k, v in obj.items() if k in _OPTION_CHECKS or k == "patch"}
    rank = options.get("rank", "budget")
    given = [k for k in PATCH_SETTINGS if k in options and not (k == "rank" and options[k] in ("budget", None))]
    if given and options.get("patch", "exact") in ("exact", "survive", "refresh"):
        raise TaskError(f'{", ".join(given)} set(s) the patches of a patch policy; give "patch": "origin-akin" (or '
                        f'another patch policy) with it, not {options.get("patch", "exact")!r} (the default is exact)')
    if "patch_bytes" in options and rank != "budget":
        raise TaskError(f'"patch_bytes" sets the patch ranks itself: give it with "rank": "budget" (or no "rank"), '
                        f'not {obj["rank"]!r}')
    if "max_kl" in options and "rank" in options and rank is None:
        raise TaskError('"max_kl" is a fidelity target for low-rank patches; exact ones ("rank": "exact") meet any: '
                        'drop one of the two')
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



def missing_sources(tasks: list[Task], path: str | os.PathLike) -> tuple[list[Task], list[dict[str, Any]]]:
    """(tasks whose document or video is a file here, failed records for the others), so that a
    missing file is refused before a worker loads a model. URLs (web tasks, and sources with a
    scheme) are left to the environment: a server may be down now and up when the task runs."""
    kept, bad = [], []
    for task in tasks:
        if task.kind == "web" or "://" in task.source or Path(task.source).is_file():
            kept.append(task)
            continue
        what = "a PDF" if task.kind == "doc" else "a video file"
        why = "no such file" if not Path(task.source).exists() else "not a file"
        bad.append(failed_record(task.id, f"{path}:{task.line}: {task.source}: {why}; give the path of {what}",
                                 line=task.line, kind=task.kind, source=task.source))
    return kept, bad


def task_to_json(task: Task) -> dict[str, Any]:
    """A task back as its JSON object (for writing task files)."""
    out = {"id": task.id, "kind": task.kind, "source": task.source, "question": task.question, **task.options}
    if task.script is not None:
        out["script"] = list(task.script)  # each reply as JSON text, as ScriptedDecider takes them
    return out

