"""Summaries of scored rows and the choice of each method's settings on the validation split.

Every method family is tuned the same way: among its settings whose mean cost on validation stays
within a cap, the one with the best validation metric (highest accuracy, or lowest KL) is chosen,
ties going to the cheaper setting; only then is it read on the test split. Each family is capped
in its own cost unit: recompute anchors by compute at reuse, patch methods and the token-sparse
baseline by stored bytes. Nothing in the choice looks at test rows.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

COMPUTE_CAPS = (0.10, 0.25, 0.50)
BYTE_CAPS = (0.03, 0.06, 0.12, 0.25)
FAMILIES = {"cacheblend": ("compute_frac", COMPUTE_CAPS), "epic": ("compute_frac", COMPUTE_CAPS),
            "vlcache": ("compute_frac", COMPUTE_CAPS), "kamera": ("bytes_frac", BYTE_CAPS),
            "token-sparse": ("bytes_frac", BYTE_CAPS)}
AMORTISE = (1, 10)  # reuses over which the one-time work is spread in the combined time figures


def family(method: str) -> str:
    return "kamera" if method.startswith("kamera") else method


def _key(row: dict) -> tuple[str, str]:
    return row["method"], row["setting"]


def summarise(rows: Sequence[dict], group: Sequence[str]) -> list[dict]:
    """Per (group..., method, setting): the mean metrics and costs, and for accuracy rows the
    gap recovered, (acc − acc(blind)) / (acc(full) − acc(blind)), per item set and on the whole.
    Costs: bytes_frac (patch bytes / the reused chunks' fp16 KV), compute_frac (token-layers at
    reuse / a re-prefill of the reused chunks), build_compute_frac (one-time token-layers, same
    unit), ms and build_ms (measured), ms_at_N and compute_at_N (time and compute per reuse with
    the one-time work spread over N reuses). Rows naming their item ("set", "item": the binding
    task) are also compared with blind reuse on the same item: `worse_kl_than_blind`, the items
    whose next-token KL is above blind reuse's, `lost_to_blind`, those blind reuse answers
    right and this method wrong, and `lost_to_blind_full_right`, those of them the full re-prefill
    answers right too (the others are the model's own error, which blind reuse missed). Kamera
    rows that carry the item's antecedent `similarity` (the cosine of the key summaries of A′ and
    of the A the patch was fitted after) and `own_similarity` (of B's and A's) are also read as the
    window's stale-patch guards would serve them (`agentwin.patches.policies`: `origin-similar`, the patch
    where the cosine is at least `SIMILAR`; `origin-akin`, also where it is at least B's own;
    blind reuse elsewhere): `guarded[policy]` with `kept` (items served the patch), `acc`, `gap`,
    `lost_to_blind` and `worse_kl_than_blind`."""
    keys = list(dict.fromkeys(tuple(r[g] for g in group) + _key(r) for r in rows))
    by: dict[tuple, list[dict]] = {}
    blind: dict[tuple, dict] = {}
    full: dict[tuple, dict] = {}
    for r in rows:
        by.setdefault(tuple(r[g] for g in group) + _key(r), []).append(r)
        if r["method"] in ("blind", "full") and "item" in r:
            (blind if r["method"] == "blind" else full)[tuple(r[g] for g in group) + (r.get("set", 0), r["item"])] = r
    out = []
    for key in keys:
        sel = by[key]
        s = {**dict(zip(group, key)), "method": key[-2], "setting": key[-1], "n": len(sel),
             "param": sel[0].get("param"),
             "kl": statistics.fmean(r["kl"] for r in sel),
             "top1": statistics.fmean(r["top1"] for r in sel)}
        for cost in ("bytes_frac", "compute_frac", "build_compute_frac"):
            s[cost] = statistics.fmean(r[cost] for r in sel)
        s["ms"] = 1e3 * statistics.fmean(r["seconds"] for r in sel)
        s["build_ms"] = 1e3 * statistics.fmean(r["build_seconds"] for r in sel)
        for n in AMORTISE:
            s[f"ms_at_{n}"] = s["ms"] + s["build_ms"] / n
            s[f"compute_at_{n}"] = s["compute_frac"] + s["build_compute_frac"] / n
        if "correct" in sel[0]:
            s["acc"] = statistics.fmean(r["correct"] for r in sel)
            sets = sorted({r.get("set", 0) for r in sel})
            s["acc_per_set"] = [statistics.fmean(r["correct"] for r in sel if r.get("set", 0) == t) for t in sets]
        pairs = [(r, blind.get(tuple(r[g] for g in group) + (r.get("set", 0), r.get("item")))) for r in sel]
        pairs = [(r, b) for r, b in pairs if b is not None]
        if pairs:
            s["worse_kl_than_blind"] = sum(r["kl"] > b["kl"] for r, b in pairs)
            s["lost_to_blind"] = sum(b["correct"] > r["correct"] for r, b in pairs)
            refs = [full.get(tuple(r[g] for g in group) + (r.get("set", 0), r.get("item"))) for r, _ in pairs]
            if "correct" in sel[0] and all(f is not None for f in refs):
                s["lost_to_blind_full_right"] = sum(b["correct"] > r["correct"] and f["correct"] >= b["correct"]
                                                    for (r, b), f in zip(pairs, refs))
            if family(key[-2]) == "kamera" and all("similarity" in r for r, _ in pairs):
                _add_guarded(s, pairs)
        if "greedy_same" in sel[0]:
            weights = [len(r["kls"]) for r in sel]
            s["greedy_same"] = sum(r["greedy_same"] * w for r, w in zip(sel, weights)) / sum(weights)
        out.append(s)
    if out and "acc" in out[0]:
        _add_gaps(out, group)
    return out


def _add_guarded(s: dict, pairs: Sequence[tuple[dict, dict]]) -> None:
    """The stale-patch guards' figures of one summary row from (row, blind row) pairs of the same
    items: `guarded[policy]` for `origin-similar` and `origin-akin` at the window's threshold."""
    from agentwin.patches.policies import SIMILAR, serves_akin

    tests = {"origin-similar": lambda r: r["similarity"] >= SIMILAR,
             "origin-akin": lambda r: serves_akin(r["similarity"], r.get("own_similarity", 2.0))}
    s["guarded"] = {}
    for name, keeps in tests.items():
        served = [(r if keeps(r) else b, b) for r, b in pairs]
        g = {"kept": sum(keeps(r) for r, _ in pairs), "worse_kl_than_blind": sum(r["kl"] > b["kl"] for r, b in served)}
        if "correct" in pairs[0][0]:
            g["acc"] = statistics.fmean(r["correct"] for r, _ in served)
            g["lost_to_blind"] = sum(b["correct"] > r["correct"] for r, b in served)
        s["guarded"][name] = g


def _add_gaps(summary: list[dict], group: Sequence[str]) -> None:
    ref = {}
    for s in summary:
        if s["method"] in ("full", "blind"):
            ref[(tuple(s[g] for g in group), s["method"])] = s
    for s in summary:
        g = tuple(s[k] for k in group)
        full, blind = ref.get((g, "full")), ref.get((g, "blind"))
        if full is None or blind is None:
            s["gap"], s["gap_per_set"] = math.nan, []
            continue
        s["gap"] = gap(s["acc"], full["acc"], blind["acc"])
        for g in s.get("guarded", {}).values():
            if "acc" in g:
                g["gap"] = gap(g["acc"], full["acc"], blind["acc"])
        s["gap_per_set"] = [gap(a, f, b) for a, f, b in zip(s["acc_per_set"], full["acc_per_set"], blind["acc_per_set"])]


def gap(acc: float, full: float, blind: float) -> float:
    """Share of the full-versus-blind accuracy gap recovered (NaN when there is no gap)."""
    return (acc - blind) / (full - blind) if full > blind else math.nan


def select(summary: Sequence[dict], group: Sequence[str], metric: str, higher_better: bool) -> list[dict]:
    """For every group value, family and cap: the setting chosen on the validation rows of
    `summary` and the test summary row of that setting (None when the test split lacks it)."""
    val = [s for s in summary if s["split"] == "validation"]
    test = {tuple(s[g] for g in group) + _key(s): s for s in summary if s["split"] == "test"}
    sign = 1.0 if higher_better else -1.0
    out = []
    for gval in dict.fromkeys(tuple(s[g] for g in group) for s in val):
        rows = [s for s in val if tuple(s[g] for g in group) == gval]
        for fam, (unit, caps) in FAMILIES.items():
            cands = [s for s in rows if family(s["method"]) == fam]
            for cap in caps:
                fit = [s for s in cands if s[unit] <= cap + 1e-12]
                if not fit:
                    continue
                best = max(fit, key=lambda s: (sign * s[metric], -s[unit]))
                out.append({**dict(zip(group, gval)), "family": fam, "unit": unit, "cap": cap,
                            "method": best["method"], "setting": best["setting"],
                            "validation": {metric: best[metric], unit: best[unit]},
                            "test": test.get(gval + _key(best))})
    return out


def window_default(results: Sequence[dict], cap: float = 0.06) -> dict:
    """The patch fit a window should use by default, from evaluation results (`eval_binding.json`,
    `eval_smollm2.json`): in every group of each (a binding condition, a SmolLM2 trace), the Kamera
    methods within `cap` bytes are ranked by their best validation score (accuracy, or KL); the
    method with the lowest mean rank over all groups wins (only methods run in every group take
    part), ties to the one chosen in more groups. Votes alone (the method chosen in the most groups)
    ignore margins: a fit that tops two groups of one model wins over fits that split the other
    model's groups between them, however badly it ranks there. Only validation rows decide.
    Returns {"method", "mean_rank": {method: mean rank}, "votes": {method: groups chosen in},
    "groups": [(group, method chosen there)]}."""
    groups: list[tuple[str, str]] = []
    ranks: dict[str, list[int]] = {}
    n_groups = 0
    for res in results:
        for s in res["selected"]:
            if s["family"] == "kamera" and abs(s["cap"] - cap) < 1e-12:
                group = s.get("condition") or s.get("trace")
                groups.append((group, s["method"]))
        # each Kamera method's rank among the Kamera methods on validation at the cap, per group
        keys = ("condition", "trace")
        val = [s for s in res["summary"] if s["split"] == "validation" and family(s["method"]) == "kamera"
               and s["bytes_frac"] <= cap + 1e-12]
        metric, sign = ("acc", -1.0) if val and "acc" in val[0] else ("kl", 1.0)
        for g in dict.fromkeys(next(s[k] for k in keys if k in s) for s in val):
            n_groups += 1
            best: dict[str, float] = {}
            for s in val:
                if next(s[k] for k in keys if k in s) == g:
                    best[s["method"]] = min(best.get(s["method"], math.inf), sign * s[metric])
            for r, m in enumerate(sorted(best, key=best.get)):
                ranks.setdefault(m, []).append(r)
    votes: dict[str, int] = {}
    for _, m in groups:
        votes[m] = votes.get(m, 0) + 1
    mean_rank = {m: statistics.fmean(r) for m, r in ranks.items() if len(r) == n_groups}
    if not mean_rank:
        raise ValueError(f"no Kamera method was ranked in every group at a {cap:.0%} cap in these results")
    method = min(mean_rank, key=lambda m: (mean_rank[m], -votes.get(m, 0)))
    return {"method": method, "mean_rank": mean_rank, "votes": votes, "groups": groups}
