"""The PATCHES.md renderer: every figure on the page comes from the JSON it is given."""

from tools.bench import patches_page
from tools.bench.harness import BUDGETS


def _data():
    table = {m: {f"{b:.3f}": {"kl": 0.01 * (i + 1) / (j + 1), "bytes_frac": b * 0.9} for j, b in enumerate(BUDGETS)}
             for i, m in enumerate(("svd", "query", "alloc"))}
    table["query"]["0.015"]["kl"] = 0.001  # query beats svd at 1.5% only
    return {
        "command": "agentwin bench patches --json x.json", "machine": {"cpus": 2}, "storage": "fp16", "threads": 1,
        "load_average_start": [1.5, 1.0, 1.0], "load_average_end": [2.25, 1.0, 1.0], "seconds_total": 600.0,
        "cases": [{"a_tokens": 200, "b_tokens": 401, "questions": 6}, {"a_tokens": 210, "b_tokens": 399, "questions": 8}],
        "blind_kl": 0.0209, "blind_kl_per_seed": [0.0144, 0.0277], "table": table,
        "token_recompute": {"0.05": 0.0101, "0.50": 0.0023},
        "full_rank_max_rel_reconstruction_err": 9e-7, "full_rank_max_logit_diff": 6.5e-5,
        "best_method_at_6pct": "alloc", "best_kl_at_6pct": 0.002, "best_kl_at_6pct_over_blind": 0.097,
        "best_method_at_25pct": "query", "best_kl_at_25pct": 0.00044, "orbit_kl_over_blind": 0.14,
        "build_cost_in_reprefills": 1.19, "reuses_to_break_even": 1.2,
        "orbit": [{"seed": 0, "budget": 0.12, "mean": {"blind": 0.0468, "origin": 0.0097, "orbit": 0.0074}}],
        "plot": "patches_smollm2.png",
    }


def test_page_shows_the_json_figures():
    page = patches_page.render(_data())
    assert "Measured by `agentwin bench patches --json x.json` on a 2-core CPU" in page
    assert "load average 1.50 at the start and 2.25 at the end, 10.0 min" in page
    assert "A (200-210 tokens)" in page and "B (399-401 tokens)" in page and "6-8 questions" in page
    assert "**0.0209** (per seed: 0.0144, 0.0277)" in page
    assert "| svd | 0.0100 | 0.0050 | 0.0033 | 0.0025 | 0.0020 |" in page
    assert "5% → 0.0101, 50% → 0.0023" in page
    assert "alloc 0.0020 = 9.7% of blind" in page and "14.0% of blind (seeds 0)" in page
    assert "origin patch (fitted on one order) 0.0097, orbit patch 0.0074 (12% of each chunk's KV bytes)" in page
    assert "beat plain SVD at 1.5% and not at 3%, 6%, 12%, 25%" in page
    assert "![KL versus patch bytes](patches_smollm2.png)" in page


def test_command_writes_json_and_page_beside_it(tmp_path, monkeypatch, capsys):
    import json

    import tools.bench_patches as cmd
    from agentwin.models import zoo

    d = _data()
    summary = {k: v for k, v in d.items() if k not in ("command", "machine", "storage", "threads", "cases", "orbit",
                                                        "plot", "seconds_total", "load_average_start",
                                                        "load_average_end")}
    summary["seeds"] = [0]
    monkeypatch.setattr(zoo, "load_smollm2", lambda dtype: (None, None))
    monkeypatch.setattr(cmd, "measure_case", lambda model, tok, seed, storage: d["cases"][0])
    monkeypatch.setattr(cmd, "measure_orbit", lambda model, tok, seed, storage: d["orbit"][0])
    monkeypatch.setattr(cmd, "summarise", lambda cases, orbits: summary)
    monkeypatch.setattr(cmd, "print_report", lambda summary: None)
    out = tmp_path / "patches.json"
    args = cmd.argparse.ArgumentParser()
    cmd.add_arguments(args)
    assert cmd.run(args.parse_args(["--seeds", "1", "--orbit-seeds", "1", "--json", str(out)])) == 0
    written = json.loads(out.read_text())
    assert written["command"] == f"agentwin bench patches --seeds 1 --orbit-seeds 1 --json {out}"
    page = (tmp_path / "PATCHES.md").read_text()
    assert page == patches_page.render(written)
    assert f"page written to {tmp_path / 'PATCHES.md'}" in capsys.readouterr().out
