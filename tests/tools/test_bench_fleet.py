"""`agentwin bench fleet --quick`: two worker processes on tiny-llama-gqa, shared directory store vs
a private store each; the JSON has every figure, and the shared run encodes each distinct page
once: with one PDF both workers open its first page at the same moment, and the store's lease
makes one of them encode it while the other waits."""

import json

import pytest

from agentwin.eval import fleet_bench
from tools.cli import main

FIELDS = ("encodes_shared", "encodes_private", "remote_hit_rate", "hit_rate_kind", "wall_s_shared", "wall_s_private",
          "remote_get_mb_s", "get_tier", "threads_per_worker", "loadavg", "distinct_chunks", "startup_s_shared",
          "lease_waits_shared", "lease_hits_shared", "lease_takeovers_shared", "lease_hits_shared_runs")


@pytest.mark.slow
def test_quick_run_writes_the_figures(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(["bench", "fleet", "--quick", "--quiet", "--repeats", "2", "--docs", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert all(f in r for f in FIELDS), [f for f in FIELDS if f not in r]
    assert r["model"] == "tiny-llama-gqa" and r["workers"] == 2 and r["tasks"] == 6 and r["answers_agree"]
    # A private store encodes each page once per worker that reads it; the shared store, once across
    # the fleet, in every repeat: what one worker is encoding, the other waits for.
    assert r["distinct_chunks"] == 3 and r["distinct_chunks"] <= r["encodes_private"] <= r["workers"] * r["distinct_chunks"]
    assert r["encodes_shared"] == r["distinct_chunks"] and r["encodes_shared_runs"] == [r["distinct_chunks"]] * 2
    assert all(0 <= h <= w for h, w in zip(r["lease_hits_shared_runs"], r["lease_waits_shared_runs"]))
    assert r["lease_hits_shared"] + r["lease_takeovers_shared"] == r["lease_waits_shared"]
    assert 0 < r["remote_hit_rate"] <= 1 and "shared directory" in r["hit_rate_kind"]
    assert r["remote_get_mb_s"] > 0 and r["get_tier"].startswith("directory")
    assert r["wall_s_shared"] > 0 and r["wall_s_private"] > 0 and len(r["loadavg"]["shared"]) == 2
    # Two repeats a side, each from an empty store: every repeat's encodes obey the same bounds, and the
    # median and least wall times are those of the repeats.
    assert r["repeats"] == 2 and len(r["wall_s_runs_shared"]) == len(r["encodes_private_runs"]) == 2
    assert all(r["distinct_chunks"] <= e <= r["workers"] * r["distinct_chunks"] for e in r["encodes_shared_runs"])
    assert r["wall_s_min_private"] == min(r["wall_s_runs_private"]) <= r["wall_s_private"] <= max(r["wall_s_runs_private"])
    assert "encodes shared / private" in capsys.readouterr().out


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
    run = {"total": {"store": {"remote_hits": 3, "remote_misses": 1}, "store_hits": 6, "encodes": 2}}
    assert fleet_bench.hit_rate(run, redis=True)[0] == 0.75
    assert fleet_bench.hit_rate(run, redis=False) == (0.75, fleet_bench.hit_rate(run, redis=False)[1])
    assert "remote hits" in fleet_bench.hit_rate(run, True)[1] and "directory" in fleet_bench.hit_rate(run, False)[1]
    from agents.batch import redact

    assert redact("redis://u:secret@h:6379/0") == "redis://u:***@h:6379/0" and redact("/srv/kv") == "/srv/kv"
