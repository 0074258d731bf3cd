"""The patch benchmark on the real SmolLM2, one seed end to end (the full run is
`agentwin bench patches`): full-rank exactness, every method and budget measured, the report,
the plot and the JSON keys."""

import json
import math

import pytest

from tools.bench import harness as bp
from tools.bench.plots import plot_kl_vs_bytes


@pytest.mark.slow
def test_one_seed_end_to_end(smollm2, tmp_path):
    model, tokenizer = smollm2
    # Three of the case's eight questions: the same code path at a third of the question forwards
    # (each of the 26 measured KVs is read by every question).
    case = bp.measure_case(model, tokenizer, seed=3, storage="fp16", log=lambda *a: None, max_questions=3)
    assert case["questions"] == 3
    # A full-rank patch reproduces KV(B|A) to fp32 precision and the logits to 1e-4.
    assert case["full_rank"]["max_rel_reconstruction_err"] <= 1e-5
    assert case["full_rank"]["max_logit_diff"] <= 1e-4
    assert case["blind_kl"] > 100 * case["full_rank"]["kl"]
    methods = {(r["method"], r["budget"]) for r in case["curve"]}
    assert methods == {(m, b) for m in (*bp.UNIFORM_METHODS, "alloc") for b in bp.BUDGETS}
    for r in case["curve"]:
        assert r["bytes_frac"] <= r["budget"] + 1e-9 and math.isfinite(r["kl"])
    best25 = min(r["kl"] for r in case["curve"] if r["budget"] == 0.25)
    assert best25 < case["blind_kl"] / 5
    assert case["cost"]["reuses_to_break_even"] > 0
    assert [row["layer"] for row in case["layers"]] == list(range(model.config.num_hidden_layers))

    summary = bp.summarise([case], [])
    for key in ("blind_kl", "best_kl_at_6pct", "best_kl_at_25pct", "orbit_kl_over_blind",
                "reuses_to_break_even", "seeds", "table"):
        assert key in summary
    json.dumps(summary)
    lines = []
    bp.print_report(summary, log=lines.append)
    assert any("best at <=6% bytes" in line for line in lines)
    rows = [{"method": m, "bytes_frac": v["bytes_frac"], "kl": v["kl"]}
            for m, per in summary["table"].items() for v in per.values()]
    plot_kl_vs_bytes(rows, str(tmp_path / "p.png"), "test")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
