"""Patch fidelity under byte budgets, on the agent traces and on stale patches.

Every trace (`tools.bench.trace`) is replayed in one process on one model through the float32
re-prefill (the reference), a bfloat16 re-prefill (the noise floor), blind reuse
(`Window(patch="none")`) and the agentwin window with byte-limited patches. A byte budget is a
fraction of a chunk's canonical KV bytes (float32 here). Fits: "origin" (the window's defaults:
origin patches, each chunk's patch fitted within the budget, `Window(patch_bytes=b)`: ranks
spread over layers and K/V, the window's default factor storage, the patch guard on below 6%), "origin+guard" (the same
with `guard=True` at every budget), "origin-alloc", "origin-output", "origin-output-half",
"origin-output-abs", "origin-residual" and "origin-residual-int8" / "-mixed" (the defaults with
`Window(fit="alloc")`, `fit="output"` and its variants, `fit="residual"` (with int8 or mixed
factors): normalised per block, or by the attention
outputs' error relative to each layer's scale, its root, or absolute, or by that error in the
residual stream relative to the stream's size; one of them is the window's default fit), "origin-svd"
(the fit the window used before: plain SVD, fp16 factors, one rank for the trace), "orbit"
(orbit patches, no extra orders, at that rank). For the rank-based fits `rank_for_budget` turns
the budget into the largest rank whose fp16 patch (`kamera_core.budget.bytes_per_rank`, every
layer's keys and values) fits it for every chunk of the trace.

A decision is a stale case when the `origin` fit (origin patches after any antecedent) served
some chunk with a patch fitted after another antecedent than the one it has now
(`WindowStats.stale_patches` grew while the window's KV was read for that decision). At each stale
case KL(reference || agentwin) is set against KL(reference || blind reuse) at the same decision.
Stale-patch guards (`agentwin.patches.policies`, e.g. "origin-neighbour", or "origin-similar@0.95" for
that policy at that threshold) are replayed at the headline budget and chosen on the validation
traces (the doc trace and the hard-case traces); the other traces report the choice. The headline
figures are those of the window's default policy (`window_policy`): the `origin` fit, or the
guard run that is the default; `stale_worse_than_blind` counts its stale cases worse than blind
reuse over every trace, agent and hard-case.

The hard-case traces (`hard_case_trace`) put each of `tools.bench.hard_cases` after a filler
chunk, then evict and recall around it so that its second chunk is read after antecedents it
was not fitted on.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tools.bench.hard_cases import hard_case, hard_case_names
from tools.bench.harness import TARGET_KL
from tools.bench.strategies import AgentwinStrategy, Reprefill
from tools.bench.trace import Trace, measure, row_of, score, summarize
from agentwin.patches.policies import SIMILAR
from kamera_core.budget import bytes_per_rank

BUDGETS = (0.015, 0.03, 0.06, 0.12)
HEADLINE = 0.06
# name: (patch policy, guard, by bytes (the window's default fit) or else by rank (svd, fp16))
FITS = {"origin": ("origin", "auto", True), "origin+guard": ("origin", True, True),
        "origin-svd": ("origin", False, False), "orbit": ("orbit", False, False),
        "origin-alloc": ("origin", "auto", True), "origin-output": ("origin", "auto", True),
        "origin-output-half": ("origin", "auto", True), "origin-output-abs": ("origin", "auto", True),
        "origin-residual": ("origin", "auto", True), "origin-residual-int8": ("origin", "auto", True),
        "origin-residual-mixed": ("origin", "auto", True)}
# Window arguments of a by-bytes fit other than the window's default fit (`Window(fit=...)`).
FIT_ARGS = {"origin-alloc": {"fit": "alloc"}, "origin-output": {"fit": "output"},
            "origin-output-half": {"fit": "output-half"}, "origin-output-abs": {"fit": "output-abs"},
            "origin-residual": {"fit": "residual"}, "origin-residual-int8": {"fit": "residual", "storage": "int8"},
            "origin-residual-mixed": {"fit": "residual", "storage": "mixed"}}
RANK_FIT = {"fit": "svd", "storage": "fp16"}
DEFAULT_FITS = ("origin", "origin+guard", "origin-residual-int8", "origin-alloc", "origin-output", "origin-svd")
DEFAULT_FIT = "origin"
# `origin-similar@t`: the `origin-similar` policy at key-summary cosine threshold t (a sweep; the
# window's default threshold is `agentwin.patches.policies.SIMILAR`).
SIMILAR_SWEEP = (0.9, 0.95, 0.98, 0.995)
# `origin-akin@t`: `origin-similar@t`, and also behind a new neighbour at least as close to the old
# one as the chunk itself is; at the window's threshold only.
STALE_GUARDS = ("origin-neighbour", "origin-present", "origin-either",
                *(f"origin-similar@{t:g}" for t in SIMILAR_SWEEP), f"origin-akin@{SIMILAR:g}")
AGENT_TRACES = ("doc", "web", "video")
VALIDATION = ("doc",)  # plus every hard-case trace
TARGET_POINTS = 0.05
TARGET = (f"At ≤ {HEADLINE:.0%} of a chunk's canonical KV bytes, the patched window's mean next-token KL is at most "
          f"the bf16 noise floor's and its greedy-16 agreement within {TARGET_POINTS * 100:.0f} points of the floor's; "
          "no stale case where the patched window is further from the re-prefill than blind reuse "
          "(stale_worse_than_blind = 0).")
FILLER = ("Weather note for the bay: a light westerly wind, scattered cloud over the hills and a dry afternoon. "
          "The ferry timetable is unchanged and the market opens at nine.")
STORAGE = RANK_FIT["storage"]  # the rank-based fits' patch storage


def kv_shapes(km: Any) -> list[tuple[int, int, int, int]]:
    """Per layer (key features, key bytes per element, value features, value bytes per element)
    of the model's canonical KV, read from a one-token encode."""
    kv = km.encode(km.tokenize("a")[:1])
    return [(k[0].numel(), k.element_size(), v[0].numel(), v.element_size()) for k, v in kv]


def patch_fraction(shapes: Sequence[tuple[int, int, int, int]], tokens: int, rank: int, storage: str = STORAGE) -> float:
    """Bytes of a rank-`rank` patch on every layer's keys and values of a `tokens`-token chunk over
    the chunk's canonical KV bytes."""
    patch = sum(rank * (bytes_per_rank(tokens, fk, storage) + bytes_per_rank(tokens, fv, storage))
                for fk, _, fv, _ in shapes)
    canonical = sum(tokens * (fk * ik + fv * iv) for fk, ik, fv, iv in shapes)
    return patch / canonical


def rank_for_budget(shapes: Sequence[tuple[int, int, int, int]], chunk_tokens: Sequence[int], fraction: float,
                    storage: str = STORAGE) -> int:
    """The largest rank whose patch is at most `fraction` of the canonical KV bytes of every chunk
    (`chunk_tokens`: their token counts); 0 when not even rank 1 fits."""
    if not chunk_tokens or fraction <= 0:
        return 0
    per_rank = max(patch_fraction(shapes, t, 1, storage) for t in chunk_tokens)
    return int(fraction / per_rank + 1e-9)  # floor, with a margin for the division's rounding


def hard_case_trace(name: str, questions: int = 2) -> Trace:
    """[filler, A, B] of the hard case `name`, read after its questions; then B after the filler
    alone (A evicted), after A and the filler (A recalled to the front), after A alone (filler
    evicted). B's origin patch was fitted after (filler, A): the last three states are stale."""
    case = hard_case(name)
    ops: list[dict[str, Any]] = [{"op": "append", "chunk": c} for c in (0, 1, 2)]
    steps = [[], [{"op": "evict", "chunk": 1}], [{"op": "recall", "chunk": 1, "at": 0}], [{"op": "evict", "chunk": 0}]]
    step = 0
    for before in steps:
        ops += before
        for q in case.questions[:questions]:
            ops.append({"op": "decide", "step": step, "query": q})
            step += 1
    return Trace(f"hard-{name}", 4096, {0: FILLER, 1: case.a, 2: case.b}, ops,
                 {"agent": f"hard case {name!r} (tools.bench.hard_cases) after a filler chunk",
                  "source": "evict A, recall it to the front, evict the filler"})


def hard_case_traces(names: Sequence[str] | None = None, questions: int = 2) -> list[Trace]:
    return [hard_case_trace(n, questions) for n in (names if names is not None else hard_case_names())]


def patched_chunks(trace: Trace) -> list[int]:
    """The chunks appended after another chunk (those the window fits a patch for)."""
    order: list[int] = []
    out = []
    for op in trace.ops:
        if op["op"] == "append":
            if order:
                out.append(op["chunk"])
            order.append(op["chunk"])
        elif op["op"] == "evict":
            order.remove(op["chunk"])
        elif op["op"] == "recall":
            order.insert(int(op["at"]), op["chunk"])
    return out


def trace_ranks(km: Any, trace: Trace, shapes: Sequence, budgets: Sequence[float]) -> dict[str, Any]:
    """Token counts of the trace's patched chunks and the rank of each budget."""
    tokens = [int(km.tokenize(trace.chunks[c]).numel()) for c in patched_chunks(trace)]
    ranks = {f"{b:g}": rank_for_budget(shapes, tokens, b) for b in budgets}
    return {"chunk_tokens": tokens, "ranks": ranks,
            "bytes_fraction": {k: (max(patch_fraction(shapes, t, r) for t in tokens) if r else 0.0)
                               for k, r in ranks.items()}}


def run_trace(km: Any, bf16: Any, trace: Trace, shapes: Sequence, budgets: Sequence[float] = BUDGETS,
              fits: Sequence[str] = DEFAULT_FITS, guards: Sequence[str] = STALE_GUARDS, greedy: int = 16,
              floor: bool = True, log: Callable[[str], None] = lambda _: None,
              max_kl: float | None = None) -> dict[str, Any]:
    """Every strategy over one trace; per-decision rows against the reference and the stale cases.
    With `max_kl`, also the window at its defaults with that fidelity target instead of a budget
    (run "max_kl")."""
    sizing = trace_ranks(km, trace, shapes, budgets)
    budget = trace.budget_tokens
    reference, ref_timing = measure(trace, lambda: Reprefill(km), 1, greedy, log)
    runs: dict[str, tuple[Any, dict, list]] = {}

    def add(name: str, make: Callable[[], Any]) -> None:
        run, timing = measure(trace, make, 1, greedy, log)
        runs[name] = (run, timing, score(trace, reference, run, km.tokenizer, greedy))

    if floor:
        add("reprefill-bf16", lambda: Reprefill(km, bf16, "reprefill-bf16"))
    add("blind", lambda: AgentwinStrategy(km, "blind", "none", 16, budget))
    done: dict[tuple[str, int], str] = {}
    grid: dict[str, dict[str, str]] = {fit: {} for fit in fits}
    for b in budgets:
        rank = sizing["ranks"][f"{b:g}"]
        for fit in fits:
            patch, guard, by_bytes = FITS[fit]
            if by_bytes:
                name = f"{fit}-b{b:g}"
                add(name, lambda p=patch, g=guard, b=b, n=name, f=fit: AgentwinStrategy(
                    km, n, p, "budget", budget, g, patch_bytes=b, **FIT_ARGS.get(f, {})))
            elif rank < 1:
                continue
            else:
                name = done.get((fit, rank))
                if name is None:
                    name = done[(fit, rank)] = f"{fit}-r{rank}"
                    add(name, lambda p=patch, g=guard, r=rank, n=name: AgentwinStrategy(km, n, p, r, budget, g,
                                                                                        **RANK_FIT))
            grid[fit][f"{b:g}"] = name
    default = grid.get(DEFAULT_FIT, {}).get(f"{HEADLINE:g}")
    if max_kl is not None:
        add("max_kl", lambda: AgentwinStrategy(km, "max_kl", window_default_patch(), "budget", budget, "auto",
                                               max_kl=max_kl))
    for policy in guards:
        add(f"{policy}-b{HEADLINE:g}", lambda g=policy: guard_strategy(km, g, budget))
    stale = stale_cases(runs, default, [f"{p}-b{HEADLINE:g}" for p in guards])
    return {"trace": trace.summary(), "revisits": trace.revisits, **sizing, "grid": grid, "default": default,
            "reference": row_of(reference, ref_timing, summarize(score(trace, reference, reference, km.tokenizer,
                                                                        greedy))),
            "strategies": {n: row_of(run, timing, summarize(rows)) for n, (run, timing, rows) in runs.items()},
            "per_decision": {n: rows for n, (_, _, rows) in runs.items()}, "stale": stale}


def guard_strategy(km: Any, guard: str, budget_tokens: int) -> AgentwinStrategy:
    """The window at its defaults and the headline budget under the stale-patch policy `guard`
    ("origin-neighbour", ..., or "origin-similar@t" for that policy at threshold t)."""
    policy, _, threshold = guard.partition("@")
    try:
        similar = float(threshold) if threshold else None
    except ValueError:
        raise ValueError(f"stale guard {guard!r}: the part after '@' must be a number") from None
    return AgentwinStrategy(km, f"{guard}-b{HEADLINE:g}", policy, "budget", budget_tokens, "auto", similar,
                            patch_bytes=HEADLINE)


def window_default(argument: str) -> Any:
    """The default of `Window(argument=...)` ("patch", "fit", ...)."""
    from agentwin.window_config import WindowConfig

    return getattr(WindowConfig(), argument)


def window_default_patch() -> str:
    """The patch policy a window takes when it is asked for patches without naming a policy
    (`agentwin.patches.policies.DEFAULT_PATCH_POLICY`; the window's own default, "exact", fits none)."""
    from agentwin.patches.policies import DEFAULT_PATCH_POLICY

    return DEFAULT_PATCH_POLICY


def window_policy() -> str:
    """The stale-patch policy of `Window()` at its defaults, named as a candidate of the sweep:
    the fit `origin` when it serves origin patches everywhere, else the guard run that is it."""
    from agentwin.patches.policies import OriginAkin, OriginSimilar

    patch = window_default_patch()
    if patch == "origin":
        return DEFAULT_FIT
    return f"{patch}@{SIMILAR:g}" if patch in (OriginSimilar.name, OriginAkin.name) else patch


def stale_cases(runs: dict[str, tuple[Any, dict, list]], default: str | None, guards: Sequence[str]) -> list[dict]:
    """The decisions where the default fit served a stale patch, with KL of it, of blind reuse and
    of each stale guard there."""
    if default is None:
        return []
    run, _, rows = runs[default]
    out = []
    for index, count in enumerate(run.info["stale_per_decision"]):
        if count > 0:
            case = {"decision": index, "step": rows[index]["step"], "stale_placements": count,
                    "kl": rows[index]["kl"], "kl_blind": runs["blind"][2][index]["kl"],
                    "greedy": rows[index]["greedy"], "greedy_blind": runs["blind"][2][index]["greedy"]}
            case["kl_guards"] = {g.rsplit("-b", 1)[0]: runs[g][2][index]["kl"] for g in guards}
            out.append(case)
    return out


def stale_summary(cases: Sequence[dict], key: str = "kl") -> dict[str, Any]:
    """Counts over stale cases of the patched KL in `key` against blind reuse's."""
    kl = [c[key] if key == "kl" else c["kl_guards"][key] for c in cases]
    ratios = [k / c["kl_blind"] for k, c in zip(kl, cases) if c["kl_blind"] > 0]
    return {"stale_cases": len(cases), "worse_than_blind": sum(k > c["kl_blind"] for k, c in zip(kl, cases)),
            "mean_ratio": sum(ratios) / len(ratios) if ratios else None,
            "kl_mean": sum(kl) / len(kl) if kl else None,
            "kl_blind_mean": sum(c["kl_blind"] for c in cases) / len(cases) if cases else None}


def pooled(traces: dict[str, Any], names: Sequence[str], pick: Callable[[dict], str | None]) -> dict[str, Any]:
    """`summarize` over the decisions of `names`, the strategy of each trace given by `pick`."""
    rows: list[dict] = []
    for name in names:
        strategy = pick(traces[name])
        if strategy is None:
            return {"decisions": 0}
        rows += traces[name]["per_decision"][strategy]
    return summarize(rows)


def choose_guard(traces: dict[str, Any], validation: Sequence[str], test: Sequence[str],
                 guards: Sequence[str]) -> dict[str, Any]:
    """Each candidate ("origin" as it is, and each guard) on the validation traces' stale cases:
    the fewest cases worse than blind, ties by the lower mean KL; the test traces' figures of all."""
    def cases(names: Sequence[str]) -> list[dict]:
        return [c for n in names for c in traces[n]["stale"]]

    candidates = [DEFAULT_FIT] + [g for g in guards if all(g in c["kl_guards"] for c in cases(validation))]
    figures = {c: {"validation": stale_summary(cases(validation), "kl" if c == DEFAULT_FIT else c),
                   "test": stale_summary(cases(test), "kl" if c == DEFAULT_FIT else c)} for c in candidates}
    valid = [c for c in candidates if figures[c]["validation"]["stale_cases"]]
    chosen = min(valid, key=lambda c: (figures[c]["validation"]["worse_than_blind"],
                                       figures[c]["validation"]["kl_mean"])) if valid else None
    return {"validation": list(validation), "test": list(test), "figures": figures, "chosen": chosen}


def run_fidelity(km: Any, traces: Sequence[Trace], budgets: Sequence[float] = BUDGETS,
                 fits: Sequence[str] = DEFAULT_FITS, guards: Sequence[str] = STALE_GUARDS, greedy: int = 16,
                 log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Results over every trace; the headline fields pool the agent traces' decisions (the traces
    not named `hard-*`), the hard-case traces are reported on their own."""
    if HEADLINE not in budgets or DEFAULT_FIT not in fits:
        raise ValueError(f"budgets must include {HEADLINE} and fits {DEFAULT_FIT!r}")
    unknown = [f for f in fits if f not in FITS]
    if unknown:
        raise ValueError(f"unknown fits {unknown}; choose from {list(FITS)}")
    window = window_policy()
    if window != DEFAULT_FIT and window not in guards:
        raise ValueError(f"the window's default stale-patch policy {window!r} must be among the guards")
    shapes = kv_shapes(km)
    bf16 = copy.deepcopy(km.model).to(torch.bfloat16).eval()
    out: dict[str, Any] = {"traces": {}}
    for trace in traces:
        log(f"{trace.name}: {trace.decisions} decisions, {len(trace.chunks)} chunks, budget {trace.budget_tokens}")
        if trace.name.startswith("hard-"):  # validation of the stale guard: the headline budget, by-bytes fits only
            by_bytes = [f for f in fits if FITS[f][2] and FITS[f][1] is not True]  # not the always-guarded run
            out["traces"][trace.name] = run_trace(km, bf16, trace, shapes, [HEADLINE], by_bytes, guards, greedy,
                                                  False, log)
        else:
            out["traces"][trace.name] = run_trace(km, bf16, trace, shapes, budgets, fits, guards, greedy, True, log,
                                                  TARGET_KL)
    agent = [n for n in out["traces"] if not n.startswith("hard-")]
    hard = [n for n in out["traces"] if n.startswith("hard-")]
    entries = out["traces"]
    key = "kl" if window == DEFAULT_FIT else window  # the window default's KL in a stale case

    def served(e: dict) -> str | None:  # the run of the window's default policy on a trace
        return e["default"] if window == DEFAULT_FIT else f"{window}-b{HEADLINE:g}"

    head = pooled(entries, agent, served)
    floor = pooled(entries, agent, lambda e: "reprefill-bf16")
    stale = [c for n in agent for c in entries[n]["stale"]]
    hard_stale = [c for n in hard for c in entries[n]["stale"]]
    s, every = stale_summary(stale, key), stale_summary(stale + hard_stale, key)
    out.update({"window_policy": window, "window_fit": window_default("fit"), "window_storage": window_default("storage"),
                "greedy16_at_6pct": head.get("greedy16"), "kl_at_6pct": head.get("kl_mean"),
                "noise_floor_greedy16": floor.get("greedy16"), "noise_floor_kl": floor.get("kl_mean"),
                "stale_worse_than_blind": every["worse_than_blind"], "stale_cases": every["stale_cases"],
                "stale_cases_by_trace": {n: len(entries[n]["stale"]) for n in entries},
                "stale_mean_ratio": every["mean_ratio"], "stale_all": every, "stale": s,
                "stale_unguarded": stale_summary(stale + hard_stale), "at_6pct": head, "noise_floor": floor,
                "origin_at_6pct": pooled(entries, agent, lambda e: e["default"]),
                "blind": pooled(entries, agent, lambda e: "blind"),
                "ranks_at_6pct": {n: entries[n]["ranks"][f"{HEADLINE:g}"] for n in entries},
                "hard_cases": {"stale": stale_summary(hard_stale, key),
                               "at_6pct": pooled(entries, hard, served),
                               "blind": pooled(entries, hard, lambda e: "blind")} if hard else None})
    validation = [n for n in entries if n in VALIDATION or n.startswith("hard-")]
    out["stale_guard"] = choose_guard(entries, validation, [n for n in entries if n not in validation], guards)
    for g in guards:
        out["stale_guard"].setdefault("pooled", {})[g] = pooled(
            entries, agent, lambda e, g=g: next((n for n in e["strategies"] if n.startswith(g + "-b")), None))
    out["max_kl"] = fidelity_target(entries, agent, served)
    out["target"] = verdict(out)
    return out


def fidelity_target(entries: dict[str, Any], agent: Sequence[str], served: Callable[[dict], str | None]
                    ) -> dict[str, Any] | None:
    """`Window(max_kl=TARGET_KL)` (run "max_kl") against the window's default at 6% (`served`), per
    agent trace and pooled: KL and agreement, and the patches' bytes as a share of their chunks'
    canonical KV (`WindowStats.patch_bytes / patched_kv_bytes`), with the probe forwards' tokens."""
    names = [n for n in agent if "max_kl" in entries[n]["strategies"]]
    if not names:
        return None

    def spend(rows: Sequence[dict]) -> dict[str, Any]:
        patch, kv = (sum(r["info"][k] for r in rows) for k in ("patch_bytes", "patched_kv_bytes"))
        return {"patch_bytes": patch, "patched_kv_bytes": kv, "share": patch / kv if kv else None,
                "guard_tokens": sum(r["forward_tokens"].get("guard", 0) for r in rows)}

    out: dict[str, Any] = {"target": TARGET_KL, "traces": {}}
    for label, pick in (("max_kl", lambda e: "max_kl"), ("default", served)):
        rows = {n: entries[n]["strategies"][pick(entries[n])] for n in names}
        for n, row in rows.items():
            out["traces"].setdefault(n, {})[label] = {**{k: row.get(k) for k in ("kl_mean", "greedy16", "top1")},
                                                      **spend([row]), "decisions": row["decisions"]}
        out[label] = {**pooled(entries, names, pick), **spend(list(rows.values()))}
    return out


def verdict(out: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets on the pooled figures."""
    kl, floor_kl = out["kl_at_6pct"], out["noise_floor_kl"]
    agree, floor_agree = out["greedy16_at_6pct"], out["noise_floor_greedy16"]
    kl_met = kl is not None and floor_kl is not None and kl <= floor_kl
    greedy_met = agree is not None and floor_agree is not None and agree >= floor_agree - TARGET_POINTS - 1e-12
    stale_met = out["stale_worse_than_blind"] == 0
    return {"statement": TARGET, "kl_met": kl_met, "greedy_met": greedy_met, "stale_met": stale_met,
            "met": kl_met and greedy_met and stale_met}
