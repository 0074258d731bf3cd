"""`agentwin bench patches`: conditioning patches against blind reuse on the real SmolLM2.

For each seed, a generated case (A ~200 tokens defining entities, B ~400 tokens referring to them
indirectly, questions naming the entities) is measured against a full re-prefill of
[A, B, question] by next-token KL. Reported per seed and in aggregate:
- per layer: relative ‖Δ‖ of K and V and the deficit energy in the top 8/16/32/64 directions;
- blind reuse; the oracle token-recompute curve (top x% tokens by ‖Δ‖ take their exact KV);
- KL against patch bytes (fraction of B's KV bytes) for each fitting method, uniform ranks and the
  byte-budget allocator; a full-rank patch's exactness;
- the orbit patch for the set {B, E1, E2} read after A in all 6 orders;
- patch build cost in units of one re-prefill of B, and the reuses after which it has paid off.
Writes a table to stdout, JSON (`--json`) and a PNG plot of KL versus bytes (`--plot`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from typing import Any, Sequence

import torch

BUDGETS = (0.015, 0.03, 0.06, 0.12, 0.25)
UNIFORM_METHODS = ("svd", "query", "query+value")
TOKEN_FRACS = (0.05, 0.15, 0.30, 0.50)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=5, help="number of generated cases (default 5)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--orbit-seeds", type=int, default=2,
                        help="cases on which the 3-chunk orbit experiment runs (6 orders each; default 2)")
    parser.add_argument("--storage", choices=("fp16", "bf16", "int8"), default="fp16",
                        help="patch factor storage (default fp16)")
    parser.add_argument("--json", metavar="FILE", help="write all figures to FILE")
    parser.add_argument("--plot", metavar="PNG", help="write the KL-versus-bytes plot to PNG")


def _encode(tokenizer: Any, text: str, special: bool = False) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=special).input_ids)


def _layer_diagnostics(p) -> list[dict]:
    from kamera_core import patch as kp

    rows = []
    for layer, ((dk, dv), (xk, xv)) in enumerate(zip(p.deltas(), p.conditioned)):
        row = {"layer": layer}
        for name, d, x in (("k", dk, xk), ("v", dv, xv)):
            g, total = kp.gains(d)
            row[f"rel_delta_{name}"] = float(d.norm() / x.float().norm().clamp_min(1e-30))
            for top in (8, 16, 32, 64):
                row[f"energy_top{top}_{name}"] = float(g[:top].sum() / total) if total > 0 else 1.0
        rows.append(row)
    return rows


def _uniform_rank(p, budget: float, storage: str) -> int:
    from kamera_core import patch as kp

    per_layer = sum(kp.bytes_per_rank(p.b_len, t[0].numel(), storage) for t in p.canonical[0])
    return int(budget * p.kv_bytes() // (per_layer * len(p.canonical)))


def measure_case(model: Any, tokenizer: Any, seed: int, storage: str, log=print) -> dict:
    """All single-case figures for one generated case."""
    from tools.patch_texts import make_case

    case = make_case(seed)
    return {"seed": seed, **measure_texts(model, tokenizer, case.a, case.b, case.queries, storage, log, f"seed {seed}")}


def measure_texts(model: Any, tokenizer: Any, a_text: str, b_text: str, questions_text: Sequence[str],
                  storage: str, log=print, label: str = "case") -> dict:
    """All single-case figures for chunk A, chunk B and questions given as text."""
    from kamera_core import patch as kp
    from tools import patch_eval as pe

    a, b = _encode(tokenizer, a_text, special=True), _encode(tokenizer, b_text)
    questions = [_encode(tokenizer, q) for q in questions_text]
    p = pe.prepare(model, a, b, questions)
    kv_bytes = p.kv_bytes()
    blind = p.kl(p.canonical)
    log(f"{label}: A {p.a_len} tokens, B {p.b_len} tokens, {len(questions)} questions; blind KL {blind:.4f}")

    full_rank = max(t[0].numel() for t in p.canonical[0])
    exact = kp.build_patch(p.deltas(), [(full_rank, full_rank)] * len(p.canonical), "svd", storage="fp32")
    exact_kv = pe.patched(p, exact)
    reconstruction = max(float((e[i].float() - c[i].float()).abs().max() / c[i].float().abs().max())
                         for e, c in zip(exact_kv, p.conditioned) for i in (0, 1))

    curve = []
    for method in UNIFORM_METHODS:
        for budget in BUDGETS:
            rank = _uniform_rank(p, budget, storage)
            patch = pe.fit_uniform(p, method, rank, storage)
            curve.append({"method": method, "budget": budget, "rank": rank,
                          "bytes_frac": patch.nbytes / kv_bytes, "kl": p.kl(pe.patched(p, patch))})
    fit_s = 0.0
    for budget in BUDGETS:
        t0 = time.perf_counter()
        patch = pe.fit_allocated(p, int(budget * kv_bytes), storage)
        if budget == 0.06:
            fit_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            pe.patched(p, patch)
            apply_s = time.perf_counter() - t0
        curve.append({"method": "alloc", "budget": budget, "rank": None, "ranks": patch.ranks(),
                      "bytes_frac": patch.nbytes / kv_bytes, "kl": p.kl(pe.patched(p, patch))})
    tokens = [{"frac_tokens": f, "kl": p.kl(pe.token_recompute(p, f))} for f in TOKEN_FRACS]

    build = p.alone_s + fit_s
    saving = p.reprefill_s - apply_s
    return {
        "a_tokens": p.a_len, "b_tokens": p.b_len, "questions": len(questions),
        "kv_bytes": kv_bytes, "blind_kl": blind,
        "full_rank": {"kl": p.kl(exact_kv), "max_logit_diff": p.max_logit_diff(exact_kv),
                      "max_rel_reconstruction_err": reconstruction},
        "curve": curve, "token_recompute": tokens, "layers": _layer_diagnostics(p),
        "cost": {"alone_s": p.alone_s, "fit_s": fit_s, "apply_s": apply_s, "reprefill_s": p.reprefill_s,
                 "build_in_reprefills": build / p.reprefill_s,
                 "reuses_to_break_even": build / saving if saving > 0 else math.inf},
    }


def measure_orbit(model: Any, tokenizer: Any, seed: int, storage: str, budget: float = 0.12, log=print) -> dict:
    """{B, E1, E2} after A in all 6 orders: blind reuse, an origin patch fitted on one order, and
    the orbit patch (fitted to each chunk's deficit averaged over all orders)."""
    from agentwin.models.kv import build_cache, concat_kv, extract_kv, relocate_kv
    from kamera_core import kv_layout, patch as kp, rope_specs
    from tools import patch_eval as pe
    from tools.patch_texts import make_case

    case = make_case(seed)
    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    a = _encode(tokenizer, case.a, special=True)
    chunks = [_encode(tokenizer, t) for t in (case.b, *case.extra_chunks)]
    questions = [_encode(tokenizer, q) for q in case.queries]
    canonical = [extract_kv(pe.forward(model, c, 0).cache, layout) for c in chunks]
    orders = list(itertools.permutations(range(len(chunks))))
    deltas: dict[tuple, list] = {}
    a_kv = None
    for order in orders:
        seq = torch.cat([a, *[chunks[i] for i in order]])
        kv = extract_kv(pe.forward(model, seq, 0).cache, layout)
        a_kv = [(k[: len(a)].clone(), v[: len(a)].clone()) for k, v in kv]
        start = len(a)
        for i in order:
            n = len(chunks[i])
            rows = [(k[start : start + n], v[start : start + n]) for k, v in kv]
            deltas[(order, i)] = kp.deficit(relocate_kv(rows, specs, layout, -start), canonical[i])
            start += n

    def patch_for(delta):
        budget_bytes = int(budget * 2 * sum(dk.numel() + dv.numel() for dk, dv in delta))  # fp16 KV bytes
        return pe.allocate_patch(delta, budget_bytes, storage, "orbit")

    orbit = [patch_for(kp.orbit_deficit([deltas[(o, i)] for o in orders])) for i in range(len(chunks))]
    origin = [patch_for(deltas[(orders[0], i)]) for i in range(len(chunks))]

    references: dict[tuple, list[torch.Tensor]] = {}

    def kl_for(order, patches) -> float:
        seq = torch.cat([a, *[chunks[i] for i in order]])
        if order not in references:
            references[order] = [pe.forward(model, torch.cat([seq, q]), 0).logits[0, -1] for q in questions]
        parts, start = [a_kv], len(a)
        for i in order:
            local = canonical[i] if patches is None else kp.apply_patch(canonical[i], patches[i])
            parts.append(relocate_kv(local, specs, layout, start))
            start += len(chunks[i])
        placed = concat_kv(*parts)
        total = 0.0
        for q, ref in zip(questions, references[order]):
            logits = pe.forward(model, q, start, build_cache(placed, model.config, layout)).logits[0, -1]
            total += pe.kl_div(ref, logits)
        return total / len(questions)

    rows = []
    for order in orders:
        rows.append({"order": list(order), "blind": kl_for(order, None), "origin": kl_for(order, origin),
                     "orbit": kl_for(order, orbit)})
    mean = {k: statistics.fmean(r[k] for r in rows) for k in ("blind", "origin", "orbit")}
    log(f"seed {seed} orbit over 6 orders: blind {mean['blind']:.4f}, origin {mean['origin']:.4f}, "
        f"orbit {mean['orbit']:.4f} (budget {budget:.0%} of each chunk's KV bytes)")
    return {"seed": seed, "budget": budget, "orders": rows, "mean": mean,
            "orbit_over_blind": mean["orbit"] / mean["blind"]}


def summarise(cases: list[dict], orbits: list[dict]) -> dict:
    """Aggregate figures across seeds: mean KL per (method, budget), targets, costs."""
    blind = statistics.fmean(c["blind_kl"] for c in cases)
    table: dict[str, dict[str, float]] = {}
    for method in (*UNIFORM_METHODS, "alloc"):
        table[method] = {}
        for budget in BUDGETS:
            kls = [r["kl"] for c in cases for r in c["curve"] if r["method"] == method and r["budget"] == budget]
            fracs = [r["bytes_frac"] for c in cases for r in c["curve"] if r["method"] == method and r["budget"] == budget]
            table[method][f"{budget:.3f}"] = {"kl": statistics.fmean(kls), "bytes_frac": statistics.fmean(fracs)}

    def best_at(budget: float) -> tuple[str, float]:
        options = [(m, v[f"{budget:.3f}"]["kl"]) for m, v in table.items()]
        return min(options, key=lambda t: t[1])

    best6, best25 = best_at(0.06), best_at(0.25)
    costs = [c["cost"] for c in cases]
    return {
        "blind_kl": blind,
        "blind_kl_per_seed": [c["blind_kl"] for c in cases],
        "best_kl_at_6pct": best6[1], "best_method_at_6pct": best6[0],
        "best_kl_at_6pct_over_blind": best6[1] / blind,
        "best_kl_at_25pct": best25[1], "best_method_at_25pct": best25[0],
        "orbit_kl_over_blind": statistics.fmean(o["orbit_over_blind"] for o in orbits) if orbits else None,
        "reuses_to_break_even": statistics.fmean(c["cost"]["reuses_to_break_even"] for c in cases),
        "build_cost_in_reprefills": statistics.fmean(c["build_in_reprefills"] for c in costs),
        "full_rank_max_logit_diff": max(c["full_rank"]["max_logit_diff"] for c in cases),
        "full_rank_max_rel_reconstruction_err": max(c["full_rank"]["max_rel_reconstruction_err"] for c in cases),
        "token_recompute": {f"{f:.2f}": statistics.fmean(r["kl"] for c in cases for r in c["token_recompute"]
                                                           if r["frac_tokens"] == f) for f in TOKEN_FRACS},
        "table": table,
        "seeds": [c["seed"] for c in cases],
    }


def print_report(summary: dict, log=print) -> None:
    log("")
    log(f"mean next-token KL vs full re-prefill over seeds {summary['seeds']} (blind reuse {summary['blind_kl']:.4f})")
    header = "method        " + "".join(f"{b:>9.1%}" for b in BUDGETS) + "   (patch bytes / B's KV bytes)"
    log(header)
    for method, row in summary["table"].items():
        log(f"{method:<14}" + "".join(f"{row[f'{b:.3f}']['kl']:>9.4f}" for b in BUDGETS))
    log("oracle token recompute: " + ", ".join(f"{float(f):.0%} -> {v:.4f}" for f, v in summary["token_recompute"].items()))
    log(f"best at <=6% bytes: {summary['best_method_at_6pct']} KL {summary['best_kl_at_6pct']:.4f} "
        f"= {summary['best_kl_at_6pct_over_blind']:.1%} of blind (target <= 10%)")
    log(f"best at <=25% bytes: {summary['best_method_at_25pct']} KL {summary['best_kl_at_25pct']:.5f} (target <= 1e-3)")
    if summary["orbit_kl_over_blind"] is not None:
        log(f"orbit patch, 3 chunks x 6 orders: KL = {summary['orbit_kl_over_blind']:.1%} of blind (target <= 50%)")
    log(f"full-rank patch: max logit diff {summary['full_rank_max_logit_diff']:.1e} (target <= 1e-4), "
        f"max relative KV reconstruction error {summary['full_rank_max_rel_reconstruction_err']:.1e}")
    log(f"build cost (B alone + fit) = {summary['build_cost_in_reprefills']:.2f} re-prefills of B; "
        f"pays for itself after {summary['reuses_to_break_even']:.2f} reuses (paper: ~9; aim <= 2)")


def run(args: argparse.Namespace) -> int:
    from agentwin.models.zoo import load_smollm2
    from tools.plots import plot_kl_vs_bytes

    if args.seeds < 1 or args.orbit_seeds < 0:
        print("error: --seeds must be >= 1 and --orbit-seeds >= 0", file=sys.stderr)
        return 2
    print("loading SmolLM2-135M-Instruct ...", flush=True)
    model, tokenizer = load_smollm2(torch.float32)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    cases = []
    for seed in seeds:
        t0 = time.perf_counter()
        cases.append(measure_case(model, tokenizer, seed, args.storage))
        print(f"  seed {seed} measured in {time.perf_counter() - t0:.0f} s", flush=True)
    orbits = [measure_orbit(model, tokenizer, seed, args.storage) for seed in seeds[: args.orbit_seeds]]
    summary = summarise(cases, orbits)
    print_report(summary)
    if args.plot:
        rows = [{"method": m, "bytes_frac": v["bytes_frac"], "kl": v["kl"]}
                for m, per in summary["table"].items() for v in per.values()]
        rows.append({"method": "blind", "bytes_frac": 0.0, "kl": summary["blind_kl"]})
        plot_kl_vs_bytes(rows, args.plot, f"SmolLM2-135M: KL vs patch bytes ({len(seeds)} seeds)")
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**summary, "cases": cases, "orbit": orbits, "storage": args.storage}, fh, indent=1)
        print(f"figures written to {args.json}")
    return 0
