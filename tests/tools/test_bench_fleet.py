"""`agentwin bench fleet --quick`: two worker processes on tiny-llama-gqa, shared directory store vs
a private store each; the JSON has every figure, and the shared run computes each distinct
placement once: with one PDF every task reads the same pages in the same order, both workers
open its first page at the same moment, and the window's lease on the placement makes one of
them compute it while the other waits for its entry."""

import json

import pytest

from tools.bench import fleet_bench
from tools.cli import main

FIELDS = ("encodes_shared", "encodes_private", "remote_hit_rate", "hit_rate_kind", "wall_s_shared", "wall_s_private",
          "remote_get_mb_s", "get_tier", "threads_per_worker", "loadavg", "distinct_chunks", "distinct_placements",
          "distinct_placements_private", "distinct_placements_private_runs", "waited_shared", "waited_shared_runs",
          "exact_hits_shared", "exact_hits_private", "chunk_tokens_computed_shared", "chunk_tokens_computed_private",
          "startup_s_shared", "lease_waits_shared", "lease_hits_shared", "lease_takeovers_shared",
          "lease_hits_shared_runs")


@pytest.mark.slow
def test_quick_run_writes_the_figures(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(["bench", "fleet", "--quick", "--quiet", "--repeats", "2", "--docs", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert all(f in r for f in FIELDS), [f for f in FIELDS if f not in r]
    assert r["model"] == "tiny-llama-gqa" and r["workers"] == 2 and r["tasks"] == 6 and r["answers_agree"]
    # What the tasks read: one PDF's three pages (the tiny model has no chat head), each after the pages before it.
    assert r["distinct_chunks"] == 3 and r["distinct_placements"] >= r["distinct_chunks"]
    # The shared store computes each placement once across the fleet, in every repeat: what one worker is
    # computing, the other waits for. A private store computes the placements of the tasks its worker ran:
    # both workers ran tasks of the one PDF, so each computed all of them. Tasks go to whichever worker is
    # idle (the split varies with timing), but no task is handed out before both workers have started, so
    # each takes one of the first two.
    assert r["encodes_shared"] == r["distinct_placements"] and r["encodes_shared_runs"] == [r["distinct_placements"]] * 2
    for side in ("shared", "private"):
        split = r[f"tasks_per_worker_{side}"]
        assert set(split) == {"0", "1"} and min(split.values()) >= 1 and sum(split.values()) == 6, (side, split)
    assert r["encodes_private_runs"] == r["distinct_placements_private_runs"] == [2 * r["distinct_placements"]] * 2
    assert r["encodes_private"] == r["distinct_placements_private"] > r["encodes_shared"]
    assert r["chunk_tokens_computed_private"] == 2 * r["chunk_tokens_computed_shared"] > 0
    # Every placement a task needs is computed or read from the store, on either side alike.
    assert r["encodes_shared"] + r["exact_hits_shared"] == r["encodes_private"] + r["exact_hits_private"]
    assert r["store_hits_shared"] == r["exact_hits_shared"] > r["exact_hits_private"]
    # A worker waits only for a placement the other is computing: at most one wait per computation.
    assert all(0 <= w <= e for w, e in zip(r["waited_shared_runs"], r["encodes_shared_runs"]))
    # The store's get_or_compute lease is the vision-tower cache's: a text model's tasks never take it.
    assert r["lease_waits_shared_runs"] == r["lease_hits_shared_runs"] == [0, 0] and r["lease_takeovers_shared"] == 0
    assert r["remote_hit_rate"] == r["store_hits_shared"] / (r["store_hits_shared"] + r["encodes_shared"])
    assert 0 < r["remote_hit_rate"] < 1 and "shared directory" in r["hit_rate_kind"]
    assert r["remote_get_mb_s"] > 0 and r["get_tier"].startswith("directory")
    assert r["wall_s_shared"] > 0 and r["wall_s_private"] > 0 and len(r["loadavg"]["shared"]) == 2
    # Two repeats a side, each from an empty store: the median and least wall times are those of the repeats.
    assert r["repeats"] == 2 and len(r["wall_s_runs_shared"]) == len(r["encodes_private_runs"]) == 2
    assert r["wall_s_min_private"] == min(r["wall_s_runs_private"]) <= r["wall_s_private"] <= max(r["wall_s_runs_private"])
    assert "chunks computed shared / private" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--workers", "5"], "--workers must be 2 to 4"),
    (["--docs", "0"], "--docs must be 1 to 6"),
    (["--store", "/tmp/x"], "--store must be a redis:// or rediss:// URL"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--get-entries", "0"], "--get-entries and --get-entry-mb must be positive"),
])
def test_bad_options_are_refused(args, message, capsys):
    assert main(["bench", "fleet", *args]) == 2
    assert message in capsys.readouterr().err


def test_hit_rate_by_tier():
    run = {"total": {"store_lookups": {"remote_hits": 3, "remote_misses": 1}, "chunks_from_store": 6,
                     "chunks_computed": 1, "encodes": 1}}
    assert fleet_bench.hit_rate(run, redis=True)[0] == 0.75
    assert fleet_bench.hit_rate(run, redis=False) == (0.75, fleet_bench.hit_rate(run, redis=False)[1])
    assert "remote hits" in fleet_bench.hit_rate(run, True)[1] and "directory" in fleet_bench.hit_rate(run, False)[1]
    with pytest.raises(RuntimeError, match="do not count the chunks computed"):  # a policy other than exact
        fleet_bench.computations({"total": {**run["total"], "chunks_computed": None}})
    from agents.batch import redact

    assert redact("redis://u:secret@h:6379/0") == "redis://u:***@h:6379/0" and redact("/srv/kv") == "/srv/kv"
