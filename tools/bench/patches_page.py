"""The results page of `agentwin bench patches` (docs/results/PATCHES.md), rendered from the
command's JSON only, so the page and the file never disagree."""

from __future__ import annotations

from typing import Any

from tools.bench.harness import BUDGETS

METHODS_TEXT = (
    "Methods: `svd` plain truncated SVD of Δ, same rank for K and V in every layer; `query` K fitted in the "
    "query second-moment metric; `query+value` also V rows weighted by attention mass; `alloc` ranks spread "
    "over layers and K/V by the greedy byte-budget allocator (plain fits, gains relative to each block's "
    "deficit energy). Uniform methods use the largest rank that fits the budget, so their byte share sits "
    "a little under it."
)


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _pct(b: float) -> str:
    return f"{b * 100:g}%"


def render(data: dict[str, Any]) -> str:
    """The page for one run's JSON (as `agentwin bench patches --json` writes it)."""
    cases = data["cases"]
    table = data["table"]
    lines = [
        "# Conditioning patches on SmolLM2-135M-Instruct",
        "",
        f"Measured by `{data['command']}` on a {data['machine']['cpus']}-core CPU ({data['storage']} patch factors), "
        f"torch threads {data['threads']}, load average {data['load_average_start'][0]:.2f} at the start and "
        f"{data['load_average_end'][0]:.2f} at the end, {data['seconds_total'] / 60:.1f} min. Each seed is a "
        f"generated case: A ({_span([c['a_tokens'] for c in cases])} tokens) defines entities, B "
        f"({_span([c['b_tokens'] for c in cases])} tokens) refers to them only by role, ordinal or description, "
        f"{_span([c['questions'] for c in cases])} questions name them. Figures are mean next-token KL (nats) "
        "against a full re-prefill of [A, B, question].",
        "",
        f"Blind reuse (exact relocation, no patch): **{data['blind_kl']:.4f}** (per seed: "
        + ", ".join(f"{x:.4f}" for x in data["blind_kl_per_seed"]) + ").",
        "",
        "| method | " + " | ".join(_pct(b) for b in BUDGETS[:-1]) + f" | {_pct(BUDGETS[-1])} of B's KV bytes |",
        "| --- | " + " | ".join("---" for _ in BUDGETS) + " |",
    ]
    for method, row in table.items():
        lines.append(f"| {method} | " + " | ".join(f"{row[f'{b:.3f}']['kl']:.4f}" for b in BUDGETS) + " |")
    lines += ["", METHODS_TEXT, "",
              "Oracle token recompute (top x% of B's tokens by ‖Δ‖ per layer take their exact KV): "
              + ", ".join(f"{float(f):.0%} → {v:.4f}" for f, v in data["token_recompute"].items()) + ".", ""]
    orbit = data.get("orbit") or []
    orbit_line = ("not measured" if data["orbit_kl_over_blind"] is None else
                  f"{data['orbit_kl_over_blind']:.1%} of blind (seeds {', '.join(str(o['seed']) for o in orbit)})")
    lines += [
        "| target | measured |",
        "| --- | --- |",
        f"| full-rank patch reproduces KV(B\\|A) and logits (≤ 1e-4) | max relative KV error "
        f"{data['full_rank_max_rel_reconstruction_err']:.1e}, max logit diff {data['full_rank_max_logit_diff']:.1e} |",
        f"| best ≤ 6% bytes: KL ≤ 10% of blind | {data['best_method_at_6pct']} {data['best_kl_at_6pct']:.4f} = "
        f"{data['best_kl_at_6pct_over_blind']:.1%} of blind |",
        f"| best ≤ 25% bytes: KL ≤ 1e-3 | {data['best_method_at_25pct']} {data['best_kl_at_25pct']:.5f} |",
        f"| orbit patch, 3 chunks × 6 orders: KL ≤ 50% of blind | {orbit_line} |",
        f"| build cost (B alone + fit) in re-prefills of B; reuses to break even (aim ≤ 2) | "
        f"{data['build_cost_in_reprefills']:.2f}; {data['reuses_to_break_even']:.2f} |",
        "",
    ]
    for o in orbit:
        m = o["mean"]
        lines.append(f"Orbit seed {o['seed']}: blind {m['blind']:.4f}, origin patch (fitted on one order) "
                     f"{m['origin']:.4f}, orbit patch {m['orbit']:.4f} ({o['budget']:.0%} of each chunk's KV bytes).")
    if orbit:
        lines.append("")
    if "svd" in table and "query" in table:
        better = [_pct(b) for b in BUDGETS if table["query"][f"{b:.3f}"]["kl"] < table["svd"][f"{b:.3f}"]["kl"]]
        worse = [_pct(b) for b in BUDGETS if _pct(b) not in better]
        lines += [f"The query metric (fitted on B's own queries, read by the questions' queries) beat plain SVD at "
                  f"{', '.join(better) or 'no budget'} and not at {', '.join(worse) or 'any other'}.", ""]
    if data.get("plot"):
        lines += [f"![KL versus patch bytes]({data['plot']})", ""]
    return "\n".join(lines)
