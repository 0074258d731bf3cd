"""`agentwin bench engine --quick` on the real SmolLM2 (small sizes): the command runs end to end
and its figures say what the engine promises — a recall writes no KV bytes, decoding through
segments gives the same greedy tokens as SDPA over a materialised cache, and the long loop's
memory does not grow with the chunks it has evicted."""

import json

import pytest

from tools.cli import main


@pytest.mark.slow
def test_quick_run_writes_the_figures(tmp_path):
    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["recall_bytes_written"] == 0
    assert result["recall"]["materialised_bytes_written"] > 0
    assert len(set(result["recall"]["first_tokens"].values())) == 1  # segment, materialised, re-prefill agree
    assert result["recall"]["kl_vs_reprefill"] < 0.05
    for row in result["decode"].values():
        assert row["same_greedy_tokens"] and row["segment"]["steps"] >= 3
    assert {"decode_ratio_vs_sdpa_16seg", "recall_over_query_forward", "loadavg_before", "loadavg_after"} <= set(result)
    rows = result["rss"]["checkpoints"]
    assert [r["checkpoint"] for r in rows] == [2, 5, 20] and rows[-1]["evicted"] >= 20
    assert rows[-1]["window_tokens"] <= result["rss"]["budget_tokens"]
    # Evicted chunks leave the window: what it holds stays flat while evictions go from 2 to 20.
    assert rows[-1]["window_held_mb"] <= 1.5 * rows[0]["window_held_mb"]
    assert result["rss_growth_10_to_200"] < 1.25
