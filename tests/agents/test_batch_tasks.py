"""agents.batch: task files read and checked line by line, and the scheduler's retries and
failures, with no model loaded (a fake pool stands for the workers)."""

from __future__ import annotations

import json

import pytest

from agents.batch import BatchError, Scheduler, Task, TaskFileError, WorkerConfig, parse_task, read_tasks, run_batch
from tests.support import write_lines


def test_task_file_lines_are_checked_one_by_one(tmp_path):
    good = {"id": "a", "kind": "doc", "source": "docs/a.pdf", "question": "Who?", "max_steps": 3, "rank": "exact"}
    path = write_lines(tmp_path / "tasks.jsonl", [
        good,
        '{"id": "b", "kind": "doc", "source": "a.pdf", "question": "x"',  # cut off
        {"id": "c", "kind": "audio", "source": "a.wav", "question": "x"},
        {"id": "d", "kind": "doc", "source": "a.pdf"},
        {"id": "e", "kind": "doc", "source": "a.pdf", "question": "x", "max_step": 3},
        {"id": "a", "kind": "doc", "source": "b.pdf", "question": "again"},
        "",
        {"kind": "web", "source": "http://127.0.0.1:1/", "task": "Find it", "allow_hosts": "127.0.0.1",
         "script": [{"action": "answer", "text": "-"}]},
        [1, 2],
        {"id": "f", "kind": "doc", "source": "a.pdf", "question": "x", "rank": "Budget"},
    ])
    tasks, bad = read_tasks(path)
    assert [t.id for t in tasks] == ["a", "line 8", "f"]
    a, web, f = tasks
    assert f.options == {"rank": "budget"}  # the window's byte-budget patches, by name
    assert a.source == str(tmp_path / "docs" / "a.pdf") and a.options == {"max_steps": 3, "rank": None}
    assert web.kind == "web" and web.source == "http://127.0.0.1:1/" and web.question == "Find it"
    assert web.options == {"allow_hosts": ["127.0.0.1"]} and json.loads(web.script[0])["action"] == "answer"
    errors = {b["id"]: b["error"] for b in bad}
    assert f"{path}:2: not a JSON object" in errors["line 2"] and "each line must be one complete JSON object" in errors["line 2"]
    assert "unknown \"kind\" 'audio'; use one of doc, web, video" in errors["c"]
    assert '"question" (or "task") is missing' in errors["d"]
    assert "unknown field(s) 'max_step'" in errors["e"] and "max_steps" in errors["e"]
    assert "duplicate id 'a' (first on line 1)" in errors["a"]
    assert "a task must be a JSON object, got list" in errors["line 9"]
    assert all(b["ok"] is False and b["attempts"] == 0 for b in bad)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ('[{"kind": "doc"}]', "the file is a JSON array; write one task object per line"),
    ("\n\n", "no tasks in the file"),
    ('{\n  "kind": "doc",\n  "source": "a.pdf"\n}\n', "no line is a JSON object"),
    (b"\xff\xfe{}", "not UTF-8 text"),
])
def test_a_task_file_that_cannot_be_used_at_all(tmp_path, content, message):
    path = tmp_path / "tasks.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(TaskFileError, match=message):
        read_tasks(path)


@pytest.mark.parametrize("obj, message", [
    ({"kind": "doc", "source": "", "question": "x"}, '"source" is missing or empty; give the path'),
    ({"kind": "web", "question": "x"}, "give a start URL"),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "task": "y"}, 'either "question" or "task"'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "max_steps": 0}, '"max_steps" must be a positive integer'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "rank": "low"}, '"rank" must be "budget", a positive integer or "exact"'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "patch": "all"}, '"patch" must be one of exact, survive'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "script": []}, '"script" must be a non-empty list'),
    ({"kind": "video", "source": "a.mp4", "question": "x", "fps": -1}, '"fps" must be a positive, finite number'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "fps": 2}, "unknown field(s) 'fps' for a doc task"),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "patch_bytes": 2}, '"patch_bytes" must be a fraction'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "patch_bytes": 0.1, "patch": "origin-akin", "rank": 8},
     '"patch_bytes" sets the patch ranks itself'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "patch_bytes": 0.1},
     'patch_bytes set(s) the patches of a patch policy; give "patch": "origin-akin"'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "max_kl": 0}, '"max_kl" must be a positive KL'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "max_kl": 0.01, "patch": "origin", "rank": "exact"},
     '"max_kl" is a fidelity target for low-rank patches'),
    ({"kind": "doc", "source": "a.pdf", "question": "x", "max_kl": 0.01, "patch": "survive"},
     "max_kl set(s) the patches of a patch policy; give \"patch\": \"origin-akin\" (or another patch policy) with it, "
     "not 'survive'"),
])
def test_parse_task_says_what_to_fix(obj, message):
    from agents.batch import TaskError

    with pytest.raises(TaskError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_task(obj, 1)


class _FakePool:
    """Worker 0 dies under its first task; worker 1 runs everything it gets."""

    def __init__(self):
        self.size, self.events, self.closed = 2, [("ready", 0, {"worker": 0}), ("ready", 1, {"worker": 1})], None

    def submit(self, wid, task, attempt):
        if wid == 0:
            self.events.append(("died", 0, "exited with code -9"))
        else:
            self.events.append(("done", 1, {"id": task.id, "ok": True, "error": None, "attempts": attempt, "worker": 1}))

    def poll(self, timeout):
        out, self.events = self.events, []
        return out

    def close(self, interrupted=False):
        self.closed = interrupted


def test_a_task_whose_worker_died_is_retried_on_another(monkeypatch):
    import agents.batch as batch

    pool = _FakePool()
    monkeypatch.setattr(batch, "make_pool", lambda *a, **k: pool)
    tasks = [Task(id=f"x{i}", kind="doc", source="a.pdf", question="q") for i in range(3)]
    news = []
    outcome = run_batch(tasks, WorkerConfig(model="tiny-llama-gqa"), workers=2, backend="processes", on_status=news.append)
    records = {r["id"]: r for r in outcome.records}
    assert set(records) == {"x0", "x1", "x2"} and all(r["ok"] for r in records.values())
    assert records["x0"]["attempts"] == 2 and records["x0"]["first_error"] == \
        "worker 0 exited with code -9 while running this task"
    assert any("worker 0 died" in n for n in news) and pool.closed is False


def test_no_worker_starting_is_one_clear_error(tmp_path):
    model = str(tmp_path / "no-model")  # a path, not a hub name: nothing is looked up online
    with pytest.raises(BatchError, match=f"no worker could start: worker 0: cannot load model '{model}'"):
        run_batch([Task(id="a", kind="doc", source="a.pdf", question="q")], WorkerConfig(model=model))


def test_scheduler_retries_once_then_gives_up():
    task = Task(id="a", kind="doc", source="a.pdf", question="q")
    sched = Scheduler([task], retries=1)
    t, attempt = sched.take()
    assert sched.settle(t, attempt, {"id": "a", "error": "boom"}) is None and not sched.finished
    t, attempt = sched.take()
    final = sched.settle(t, attempt, {"id": "a", "error": "boom again"})
    assert attempt == 2 and final["first_error"] == "boom" and sched.finished
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        Scheduler([], retries=-1)


# ---- the command -------------------------------------------------------------------------------
