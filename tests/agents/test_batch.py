"""agents.batch and `agentwin batch`: task files, retries, and pools of workers sharing one store.

Twelve document tasks over three PDFs written here (tiny Llama, scripted decisions that still read
the window, so answers are fixed while every chunk computed is real), plus one task whose PDF is
missing. One worker in this process is the reference; two spawned processes and two Ray actors
must give the same answers, and a shared directory store must compute fewer chunks than private
stores: each distinct placement (a chunk after the chunks before it) once."""

from __future__ import annotations

import json

import pytest

from agents.batch import Task, WorkerConfig, parse_task, run_batch, summarize
from agents.doc import write_text_pdf
from tests.support import write_lines
from tests.agentwin.store.test_store_remote import server  # noqa: F401 (the redis-server fixture)

MODEL = "tiny-llama-gqa"
DOCS = {
    "harbour": ["Harbour. Anja Roth is the harbour master and keeps the tide log.",
                "Ferry. Lena Okafor sails the Grey Heron from the north pier.",
                "Market. The fish market opens at five on weekdays."],
    "hill": ["Observatory. Tobias Mertens polishes the big lens every Monday.",
             "Chapel. Pavel Ilic plays the organ on Sundays.",
             "Orchard. The pear trees were planted in 1911."],
    "mill": ["Mill. The wheel turns twelve times a minute in spring.",
             "Bakery. Greta bakes rye bread before dawn.",
             "Bridge. The stone bridge has seven arches."],
}
DISTINCT_CHUNKS = sum(len(p) for p in DOCS.values()) + len(DOCS)  # 9 pages + one search result per PDF
SEARCH = {"harbour": "fish", "hill": "pear", "mill": "arches"}  # a word on page 3


def _script(kind: int, name: str) -> list[dict]:
    """Three ways through a PDF; the budget keeps two pages, so a page seen again is recalled."""
    return [
        [{"action": "next"}, {"action": "next"}, {"action": "goto", "page": 1}],
        [{"action": "goto", "page": 3}, {"action": "previous"}, {"action": "previous"}, {"action": "goto", "page": 3}],
        [{"action": "next"}, {"action": "search", "text": SEARCH[name]}, {"action": "goto", "page": 3}],
    ][kind]


def _task(i: int, names: list[str], pdfs: dict) -> dict:
    name = names[i % len(names)]
    script = _script((i // len(names)) % 3, name) + [{"action": "answer", "text": f"{name} answer {i}"}]
    return {"id": f"t{i:02d}", "kind": "doc", "source": str(pdfs[name]), "question": f"What is on page {1 + i % 3}?",
            "script": script, "budget_tokens": 170}


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """(tasks: 12 over 3 PDFs + one with a missing PDF, the folder)."""
    folder = tmp_path_factory.mktemp("batch")
    pdfs = {name: write_text_pdf(folder / f"{name}.pdf", pages) for name, pages in DOCS.items()}
    objs = [_task(i, list(DOCS), pdfs) for i in range(12)]
    objs.append({"id": "missing", "kind": "doc", "source": str(folder / "gone.pdf"), "question": "x",
                 "script": [{"action": "answer", "text": "x"}]})
    return [parse_task(o, n + 1) for n, o in enumerate(objs)], folder


@pytest.fixture(scope="module")
def reference(workload):
    """The tasks on one worker in this process, with a directory store."""
    tasks, folder = workload
    return run_batch(tasks, WorkerConfig(model=MODEL, store=str(folder / "store-one"), threads=1))


def _by_id(records):
    return {r["id"]: r for r in records}


def _check_against_reference(outcome, reference):
    got, ref = _by_id(outcome.records), _by_id(reference.records)
    assert set(got) == set(ref) and len(outcome.records) == 13
    for tid, r in ref.items():
        assert (got[tid]["ok"], got[tid]["answer"], got[tid]["steps"], got[tid]["stopped"]) == \
               (r["ok"], r["answer"], r["steps"], r["stopped"]), tid
    missing = got["missing"]
    assert missing["ok"] is False and missing["attempts"] == 2 and "gone.pdf: no such file" in missing["error"]
    assert missing["first_error"] == missing["error"]


def test_one_worker_runs_every_task_and_retries_a_failure_once(reference):
    records = _by_id(reference.records)
    assert len(reference.records) == 13 and reference.workers[0]["model"] == MODEL
    for i in range(12):
        r = records[f"t{i:02d}"]
        assert r["ok"] and r["answer"] == f"{list(DOCS)[i % 3]} answer {i}" and r["attempts"] == 1 and r["worker"] == 0
        assert r["encodes"] == r["forwards"].get("encode", 0) == 0 and r["seconds"] > 0  # the exact window: none
        assert r["forwards"]["query"] == len(r["read_orders"]) == r["steps"]  # every decision read the window
    # One worker, one store: every distinct placement is computed once, by the first task that reads it.
    # Tasks 0-2 go 1, 2, 3, back to 1 with room for two pages: [1] [1 2] [2 3] [3 1], six placements;
    # tasks 3-5 go 1, 3, 2, 1, 3: [1 3], [3 2] and [2 1] are new; tasks 6-8 search (a new chunk) in
    # between, its pages' lengths deciding what is evicted; tasks 9-11 repeat tasks 0-2: all from the store.
    computed = [records[f"t{i:02d}"]["chunks_computed"] for i in range(12)]
    total = summarize(reference.records)
    assert computed == [6, 6, 6, 3, 3, 3, 1, 3, 3, 0, 0, 0]
    assert sum(computed) == total["chunks_computed"] == total["distinct_placements"] > total["distinct_chunks"]
    assert total["distinct_chunks"] == DISTINCT_CHUNKS  # from the digests of what the reads held
    # One forward computes every chunk a read finds waiting: after the slide [2 3] two chunks, one forward.
    first = records["t00"]
    assert first["forwards"]["in_context"] + first["forwards"]["recompute"] == first["chunks_computed"] - 1
    assert all(records[f"t{i:02d}"]["chunks_from_store"] > 0 for i in range(3, 12))
    assert all(records[f"t{i:02d}"]["recalls"] >= 1 for i in (0, 1, 2, 3, 9))  # pages seen again came back
    missing = records["missing"]
    assert missing["attempts"] == 2 and missing["error"].endswith("no such file; give the path of a PDF")
    assert total["failed"] == 1


def test_result_lines_name_what_each_store_count_counts(reference):
    """chunks_computed: chunks whose in-context KV a task computed at their placement; exact_hits:
    placements served from the store instead (a chunk recalled to its old place included), which
    are its chunks_from_store under the exact window. So chunks_computed + chunks_from_store is the
    same for two tasks that read the same chunks in the same order, whoever came first.
    store_lookups: the store's own counters over the task, every entry kind, its own writes read
    back included. The names that read alike ("store_hits" beside "store") are gone."""
    records = _by_id(reference.records)
    for i in range(12):
        r = records[f"t{i:02d}"]
        assert "store_hits" not in r and "store" not in r
        assert set(r["store_lookups"]) == {"hits", "misses", "remote_hits", "remote_misses", "lease_waits",
                                           "lease_hits", "lease_takeovers"}
        assert r["store_lookups"]["lease_waits"] == r["waited"] == 0  # one worker: nobody else holds a lease
        assert r["chunks_from_store"] == r["exact_hits"] and r["exact_hit_tokens"] >= r["exact_hits"]
        assert r["store_lookups"]["hits"] >= r["chunks_from_store"]
        # each looked up, then again once its lease is held (another worker may have stored it in
        # between: a shared directory), then computed
        assert r["store_lookups"]["misses"] == 2 * r["chunks_computed"]
        assert (r["chunk_tokens_computed"] > 0) == (r["chunks_computed"] > 0)
    first, again = records["t00"], records["t09"]  # the same PDF and the same moves
    assert again["read_orders"] == first["read_orders"]
    assert first["chunks_from_store"] == 0 and first["store_lookups"]["hits"] > 0  # its own entries read back
    assert again["chunks_computed"] == again["chunk_tokens_computed"] == 0
    assert again["chunks_from_store"] == first["chunks_computed"] > 0
    total = summarize(reference.records)
    assert total["chunks_from_store"] == sum(r.get("chunks_from_store", 0) for r in reference.records)
    assert total["store_lookups"]["hits"] == sum(r["store_lookups"]["hits"] for r in reference.records)


def _placements_per_worker(records):
    """The distinct placements of the tasks each worker ran, summed over the workers."""
    from agents.batch import distinct_reads

    by_worker = {}
    for r in records:
        by_worker.setdefault(r.get("worker"), []).append(r)
    return sum(distinct_reads(rs)[1] for rs in by_worker.values())


def test_quiet_batch_prints_no_weight_loading_bars(tmp_path, workload, monkeypatch, capfd):
    """--quiet: the workers' model loading writes no progress bar (transformers' "Loading weights"
    bars, as SmolLM2 shows them); other lines of the load, such as warnings, stay."""
    import sys

    from agentwin import KameraModel
    from tools.cli import main

    real = KameraModel.from_pretrained

    def loading(name, *args, **kwargs):
        sys.stderr.write("Loading weights:   0%|          | 0/272 [00:00<?, ?it/s]\r"
                         "Loading weights: 100%|##########| 272/272 [00:00<00:00, 7549.65it/s]\n")
        sys.stderr.write("UserWarning: something worth seeing\n")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(KameraModel, "from_pretrained", staticmethod(loading))
    path = _cli_tasks(tmp_path, workload)
    args = ["batch", str(path), "--model", MODEL, "--threads", "1", "--out", str(tmp_path / "r.jsonl")]
    assert main(args + ["--quiet"]) == 0
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "something worth seeing" in err
    assert main(args) == 0  # without --quiet the load shows its progress
    assert "Loading weights" in capfd.readouterr().err


@pytest.mark.slow
def test_two_processes_match_one_worker_and_a_shared_store_computes_each_placement_once(workload, reference):
    tasks, folder = workload
    shared = run_batch(tasks, WorkerConfig(model=MODEL, store=str(folder / "store-shared"), threads=1),
                       workers=2, backend="processes", wait_for_workers=True)
    private = run_batch(tasks, WorkerConfig(model=MODEL, store=str(folder / "store-private"), private=True, threads=1),
                        workers=2, backend="processes", wait_for_workers=True)
    for outcome in (shared, private):
        _check_against_reference(outcome, reference)
        assert sorted(w["worker"] for w in outcome.workers) == [0, 1]
    assert (folder / "store-private" / "worker-0").is_dir() and (folder / "store-private" / "worker-1").is_dir()
    distinct = summarize(reference.records)["distinct_placements"]
    assert summarize(shared.records)["distinct_placements"] == summarize(private.records)["distinct_placements"] == distinct
    # Shared: each placement once across both workers (one that needs a placement the other is computing waits for
    # it); private: once per worker that reads it.
    total_shared, total_private = summarize(shared.records), summarize(private.records)
    print(f"chunks computed: distinct placements {distinct}, shared {total_shared['chunks_computed']}, "
          f"private {total_private['chunks_computed']}, waited {total_shared['waited']}")
    assert total_shared["chunks_computed"] == distinct
    assert total_private["chunks_computed"] == _placements_per_worker(private.records) > distinct
    assert total_private["waited"] == 0 and total_shared["waited"] <= total_shared["exact_hits"]
    assert total_shared["chunks_from_store"] > total_private["chunks_from_store"]


@pytest.mark.slow
def test_two_ray_actors_match_one_worker(workload, reference):
    ray = pytest.importorskip("ray")
    tasks, folder = workload
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        outcome = run_batch(tasks, WorkerConfig(model=MODEL, store=str(folder / "store-ray"), threads=1),
                            workers=2, backend="ray", wait_for_workers=True)
        assert ray.is_initialized()  # a Ray the caller started is left running
    finally:
        ray.shutdown()
    _check_against_reference(outcome, reference)
    assert summarize(outcome.records)["chunks_computed"] == summarize(reference.records)["distinct_placements"]
    assert {w["worker"] for w in outcome.workers} == {0, 1}


def test_a_patch_policy_task_counts_canonical_encodes_not_placements(workload):
    """Under a patch policy a chunk is served from its canonical KV (encoded alone, counted in
    encodes) and a patch: chunks_computed, which counts exact placements, is None there."""
    tasks, _ = workload
    base = tasks[0]
    patched = Task(id="patched", kind=base.kind, source=base.source, question=base.question, script=base.script,
                   options={**base.options, "patch": "origin-akin"})
    records = _by_id(run_batch([patched], WorkerConfig(model=MODEL, threads=1)).records)
    r = records["patched"]
    assert r["ok"] and r["chunks_computed"] is None and r["encodes"] == r["forwards"]["encode"] > 0
    assert r["exact_hits"] == 0 and summarize([r])["chunks_computed"] is None


# ---- task files --------------------------------------------------------------------------------

def test_patch_bytes_and_max_kl_reach_each_tasks_window(workload):
    """Under a patch policy, a fidelity target, per task or for the batch, makes the window probe
    each new page's patch (forwards counted as "guard"); the window's default budget does not (its
    guard is off)."""
    tasks, _ = workload
    base = tasks[0]
    plain = Task(id="plain", kind=base.kind, source=base.source, question=base.question, script=base.script,
                 options={**base.options, "patch": "origin-akin"})
    own = Task(id="own", kind=base.kind, source=base.source, question=base.question, script=base.script,
               options={**base.options, "patch": "origin-akin", "max_kl": 1e-9, "patch_bytes": 0.03})
    assert own.options["patch_bytes"] == 0.03
    records = _by_id(run_batch([plain, own], WorkerConfig(model=MODEL, threads=1)).records)
    assert records["plain"]["ok"] and records["own"]["ok"]
    assert records["plain"]["forwards"].get("guard", 0) == 0 < records["own"]["forwards"]["guard"]
    batch = _by_id(run_batch([plain], WorkerConfig(model=MODEL, threads=1, max_kl=1e-9)).records)
    assert batch["plain"]["forwards"]["guard"] > 0
    exact = Task(id="exact", kind=base.kind, source=base.source, question=base.question, script=base.script,
                 options={**base.options, "patch": "origin-akin", "rank": None})
    cfg = WorkerConfig(model=MODEL, threads=1, max_kl=1e-9, patch_bytes=0.03)  # the batch's, where the task's rank allows
    assert _by_id(run_batch([exact], cfg).records)["exact"]["ok"]


# ---- the driver without models -----------------------------------------------------------------

def _cli_tasks(tmp_path, workload, extra=()):
    tasks, folder = workload
    lines = [_task_json(t, folder) for t in tasks[:4]] + list(extra)
    return write_lines(tmp_path / "tasks.jsonl", lines)


def _task_json(task, folder):
    from agents.batch import task_to_json

    out = task_to_json(task)
    out["source"] = str(task.source)
    return out


def test_cli_writes_one_result_line_per_task_and_reports_bad_lines(tmp_path, workload, capsys):
    from tools.cli import main

    path = _cli_tasks(tmp_path, workload, extra=['{"id": "broken", "kind": '])
    out = tmp_path / "results.jsonl"
    code = main(["batch", str(path), "--model", MODEL, "--store", str(tmp_path / "store"), "--out", str(out),
                 "--threads", "1", "--quiet"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 1  # one line failed
    assert [r["id"] for r in records][0] == "line 5" and "not a JSON object" in records[0]["error"]
    assert sorted(r["id"] for r in records[1:]) == ["t00", "t01", "t02", "t03"] and all(r["ok"] for r in records[1:])
    err = capsys.readouterr().err
    assert "5 tasks: 4 answered, 1 failed" in err and "line 5:" in err
    assert f"{summarize(records)['chunks_from_store']} read from the store instead" in err


def test_closing_line_counts_the_chunks_computed_against_the_distinct_placements(reference, capsys):
    from tools.batch_cli import report

    report(reference.records, 1.5, "r.jsonl")
    total = summarize(reference.records)
    assert total["chunks_computed"] == total["distinct_placements"] > 0 and total["encodes"] == 0
    assert (f"13 tasks: 12 answered, 1 failed, 0 without an answer; {total['chunks_computed']} chunks computed "
            f"({total['distinct_placements']} distinct placements), {total['chunks_from_store']} read from the store "
            "instead; 1.5 s; results in r.jsonl") in capsys.readouterr().err


def test_cli_ctrl_c_keeps_finished_results_and_resume_runs_the_rest(tmp_path, workload, monkeypatch, capsys):
    import agents.batch as batch
    from tools.cli import main

    path = _cli_tasks(tmp_path, workload)
    out = tmp_path / "results.jsonl"
    original, calls = batch.Worker.run, []

    def interrupted(self, task, attempt=1):
        calls.append(task.id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, task, attempt)

    monkeypatch.setattr(batch.Worker, "run", interrupted)
    args = ["batch", str(path), "--model", MODEL, "--out", str(out), "--threads", "1", "--quiet"]
    assert main(args) == 130
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["t00", "t01"]
    assert "interrupted: 2 of 4 tasks finished" in capsys.readouterr().err
    monkeypatch.setattr(batch.Worker, "run", original)
    assert main(args + ["--resume"]) == 0
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["t00", "t01", "t02", "t03"]


@pytest.mark.parametrize("args, message", [
    (["--resume"], "--resume needs --out"),
    (["--retries", "-1"], "--retries must be 0 or more"),
    (["--patch", "origin-akin", "--rank", "exact", "--max-kl", "0.01"], "--max-kl is a fidelity target for low-rank patches"),
    (["--patch", "origin-akin", "--rank", "8", "--patch-bytes", "0.1"], "use it with --rank budget, not --rank 8"),
    (["--rank", "8"], "--rank set(s) the patches of a patch policy, and --patch exact fits none"),
])
def test_cli_refuses_bad_options(tmp_path, args, message, capsys):
    from tools.cli import main

    path = write_lines(tmp_path / "t.jsonl", [{"kind": "doc", "source": "a.pdf", "question": "x"}])
    assert main(["batch", str(path), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_unusable_task_file_is_exit_2(tmp_path, capsys):
    from tools.cli import main

    assert main(["batch", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such file; give a JSON Lines file" in capsys.readouterr().err


# ---- a Redis store -----------------------------------------------------------------------------

def test_workers_share_placements_through_redis(workload, reference, server):
    """Two workers one after the other (each a fresh store object: empty RAM) on a test-started
    redis-server: the second computes nothing and reads every placement from the remote tier."""
    tasks, _ = workload
    config = WorkerConfig(model=MODEL, store=server.url, threads=1)
    first = run_batch(tasks[:12], config)
    second = run_batch(tasks[:12], config)
    distinct = summarize(first.records)["distinct_placements"]
    assert distinct == summarize(reference.records)["distinct_placements"]
    assert summarize(first.records)["chunks_computed"] == distinct and summarize(second.records)["chunks_computed"] == 0
    for outcome in (first, second):
        assert {r["id"]: r["answer"] for r in outcome.records} == \
               {r["id"]: r["answer"] for r in reference.records if r["id"] != "missing"}
    remote = summarize(second.records)["store_lookups"]
    assert remote["remote_hits"] >= distinct and summarize(first.records)["store_lookups"]["remote_hits"] == 0


# ---- bad input is refused before a model loads -------------------------------------------------

@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test (the batch's workers load theirs with from_pretrained)."""
    from agentwin import KameraModel

    def load(*args, **kwargs):
        raise AssertionError("a worker loaded a model although no task could run")

    monkeypatch.setattr(KameraModel, "from_pretrained", staticmethod(load))


@pytest.mark.parametrize("lines, first", [
    ([{"id": "a", "kind": "doc", "source": "a.pdf", "question": "  "}], '"question" (or "task") is missing or empty'),
    ([{"id": "a", "kind": "doc", "source": "gone.pdf", "question": "Who?"}], "gone.pdf: no such file"),
    ([{"id": "a", "kind": "video", "source": "a.mp4", "question": "What?", "fps": float("inf")}],
     '"fps" must be a positive, finite number'),
    (['{"id": "a", "kind": "video", "source": "a.mp4", "question": "What?", "segment_seconds": Infinity}',
      {"id": "b", "kind": "web", "source": "http://127.0.0.1:1/", "task": ""}],
     '"segment_seconds" must be a positive, finite number'),
])
def test_a_task_file_where_no_task_can_run_is_exit_2_before_a_model_loads(lines, first, tmp_path, capsys,
                                                                           no_model_load):
    from tools.cli import main

    for name in ("a.pdf", "a.mp4"):
        (tmp_path / name).write_bytes(b"")
    path = write_lines(tmp_path / "t.jsonl", lines)
    out = tmp_path / "r.jsonl"
    assert main(["batch", str(path), "--model", MODEL, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: no task in {path} can run ({len(lines)} refused)")
    assert first in err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(lines) and all(r["attempts"] == 0 and first in records[0]["error"] for r in records)


def test_a_task_whose_file_is_missing_fails_before_any_worker_starts(tmp_path, workload, capsys):
    """A missing document or video is a failed result line (attempts 0) like any bad line; the
    other tasks run."""
    from tools.cli import main

    path = _cli_tasks(tmp_path, workload, extra=[{"id": "gone", "kind": "doc", "source": "gone.pdf", "question": "x"},
                                                 {"id": "clip", "kind": "video", "source": "clip.mp4", "question": "x"}])
    out = tmp_path / "r.jsonl"
    assert main(["batch", str(path), "--model", MODEL, "--out", str(out), "--threads", "1", "--quiet"]) == 1
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for tid, name in (("gone", "gone.pdf"), ("clip", "clip.mp4")):
        assert records[tid]["attempts"] == 0 and records[tid]["worker"] is None
        assert f"{tmp_path / name}: no such file" in records[tid]["error"]
    assert all(records[f"t0{i}"]["ok"] for i in range(4))
