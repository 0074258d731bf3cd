"""The session benchmark (`agentwin bench sessions`): generated chat sessions (`tools.bench.sessions`)
replayed through every context strategy in one process, on one model, with the same threads.

Strategies (each replays the identical operations; `tools.bench.strategies`):
- `reprefill`: the window's tokens and the query through the model's own forward at every read,
  float32: the reference; a bfloat16 copy doing the same is the noise floor;
- `prefix`: prefix caching, a radix tree of every earlier sequence (window, query and reply) at
  token granularity, unbounded, reusing the longest common token prefix;
- `default`: `agentwin.Window` at its defaults (exact);
- `survive`: survivors keep their KV, moved by RoPE re-rotation (StreamingLLM-style, the pinned
  system head as the sink);
- `refresh`: survival with the repair of `agentwin.patches.policies.Refresh` (survivors near a change and
  those too many evictions old recomputed), its setting chosen on the validation split;
- `blind`, `origin`, `origin-akin`, `orbit`, `fresh`: canonical KV with the patch policies, at the
  window's patch defaults (6% of each chunk's KV bytes); origin-akin's byte budget is also swept
  on validation.

Protocol: the validation seeds run prefix caching and every setting of the swept strategies; each
swept strategy's setting is chosen there (the fewest forwarded tokens among the settings that meet the
contract on validation, pooled: KL at most `KL_OVER_FLOOR` times the floor's and greedy-16 within
`GREEDY_POINTS` of the floor's; else the lowest KL); the test seeds run each strategy once at its
chosen setting, and the figures are pooled over the test seeds. Forwarded tokens count every token
any forward computed (chunks, queries, decoding, encodes, conditioned passes); the lower bound is
each distinct chunk token once plus every query and reply token. Wall times are min and median of
`repeats` back-to-back replays of each timed strategy on each test session.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from tools.bench.prefix_cache import PrefixCache
from tools.bench.stale_guards import policy_named
from tools.bench.strategies import Reprefill, Strategy, WindowStrategy
from tools.bench.trace import Run, Trace, measure, row_of, score, summarize
from agentwin.patches.policies import Refresh

STRATEGIES = ("prefix", "default", "survive", "refresh", "blind", "origin", "origin-akin", "orbit", "fresh")
TIMED = ("prefix", "default")  # replayed `repeats` times for their wall time (the targets' ratio)
KL_OVER_FLOOR = 2.0
GREEDY_POINTS = 0.05
TOKENS_TARGET = 0.6
WALL_TARGET = 0.8
# Settings swept on validation: Refresh(near_tokens, max_age), and origin-akin's patch bytes.
REFRESH_GRID = ((0, 2), (64, 2), (128, 2), (128, None))
QUICK_REFRESH_GRID = ((64, 2), (128, 2))
AKIN_BYTES = (0.06, 0.25)
PREFIX_CAPACITY = 1 << 30  # tokens: every earlier sequence is kept


def setting_name(strategy: str, setting: Any) -> str:
    if strategy == "refresh":
        near, age = setting
        return f"refresh(near={near},age={age})"
    if strategy == "origin-akin" and setting is not None:
        return f"origin-akin@{setting:g}"
    return strategy


def make_strategy(km: Any, trace: Trace, strategy: str, setting: Any = None) -> Strategy:
    """A fresh strategy for one replay of `trace`."""
    budget = trace.budget_tokens
    if strategy == "prefix":
        return PrefixCache(km, PREFIX_CAPACITY, replies=True)
    if strategy == "default":
        return WindowStrategy(km, "default", budget)
    if strategy == "survive":
        return WindowStrategy(km, "survive", budget, patch="survive")
    if strategy == "refresh":
        near, age = setting
        return WindowStrategy(km, setting_name(strategy, setting), budget, patch=Refresh(near, age))
    if strategy == "blind":
        return WindowStrategy(km, "blind", budget, patch="none")
    if strategy == "origin-akin" and setting is not None:
        return WindowStrategy(km, setting_name(strategy, setting), budget, patch="origin-akin", patch_bytes=setting)
    if strategy in ("origin", "origin-akin", "orbit", "fresh"):
        return WindowStrategy(km, strategy, budget, patch=policy_named(strategy))
    raise ValueError(f"unknown strategy {strategy!r}; one of {STRATEGIES}")


def grid(strategy: str, quick: bool) -> tuple:
    """The settings swept on validation (one None for strategies without a sweep)."""
    if strategy == "refresh":
        return QUICK_REFRESH_GRID if quick else REFRESH_GRID
    if strategy == "origin-akin":
        return (AKIN_BYTES[0],) if quick else AKIN_BYTES
    return (None,)


def lower_bound(km: Any, trace: Trace, reference: Run) -> int:
    """Each distinct chunk token once, plus every query token and every reply token (the
    reference's decoding) of the session."""
    chunks = {op["chunk"] for op in trace.ops if op["op"] == "append"}
    queries = sum(int(km.tokenize(op["query"]).numel()) for op in trace.ops if op["op"] == "decide")
    return sum(int(km.tokenize(trace.chunks[c]).numel()) for c in chunks) + queries + \
        int(reference.forward_tokens.get("decode", 0))


def run_session(km: Any, bf16: Any, trace: Trace, plan: Sequence[tuple[str, Any]], greedy: int, repeats: int,
                log: Callable[[str], None]) -> dict[str, Any]:
    """Every (strategy, setting) of `plan` on one session, with its reference and noise floor."""
    reference, ref_timing = measure(trace, lambda: Reprefill(km), 1, greedy, log)
    # Every other run reads the reference's greedy reply by teacher forcing: one pass per read
    # instead of `greedy` one-token steps; its greedy-16 agreement is that of its own decoding.
    forced = [r.tokens for r in reference.readings]
    floor_run, floor_timing = measure(trace, lambda: Reprefill(km, bf16, "reprefill-bf16"), 1, greedy, log, forced)
    floor_scored = score(trace, reference, floor_run, km.tokenizer, greedy)
    rows: dict[str, Any] = {"reprefill": row_of(reference, ref_timing, summarize(score(trace, reference, reference,
                                                                                      km.tokenizer, greedy)))}
    per_read: dict[str, list] = {"floor": floor_scored}
    for strategy, setting in plan:
        name = setting_name(strategy, setting)
        times = repeats if strategy in TIMED else 1
        run, timing = measure(trace, lambda: make_strategy(km, trace, strategy, setting), times, greedy, log, forced)
        scored = score(trace, reference, run, km.tokenizer, greedy)
        rows[name] = {**row_of(run, timing, summarize(scored)), "strategy": strategy,
                      "setting": list(setting) if isinstance(setting, tuple) else setting}
        per_read[name] = scored
    return {"name": trace.name, **trace.summary(), "lower_bound_tokens": lower_bound(km, trace, reference),
            "strategies": rows, "floor": row_of(floor_run, floor_timing, summarize(floor_scored)),
            "per_read": {name: [{"kl": r["kl"], "greedy": r["greedy"], "top1": r["top1"]} for r in rs]
                         for name, rs in per_read.items()}}


def pooled(sessions: Sequence[dict], name: str) -> dict[str, Any] | None:
    """One strategy's figures pooled over `sessions` (the reads of all of them; tokens and wall
    time summed), against prefix caching and the noise floor of the same reads."""
    if not sessions or any(name not in s["strategies"] for s in sessions):
        return None
    reads = [r for s in sessions for r in s["per_read"][name]]
    floor = [r for s in sessions for r in s["per_read"]["floor"]]
    tokens = sum(s["strategies"][name]["forwarded_tokens"] for s in sessions)
    prefix = sum(s["strategies"]["prefix"]["forwarded_tokens"] for s in sessions)
    floor_kl = statistics.fmean(r["kl"] for r in floor)
    out = {"reads": len(reads), "tokens": tokens, "tokens_over_prefix": tokens / prefix,
           "tokens_over_lower_bound": tokens / sum(s["lower_bound_tokens"] for s in sessions),
           "kl_mean": statistics.fmean(r["kl"] for r in reads), "kl_max": max(r["kl"] for r in reads),
           "kl_over_floor": statistics.fmean(r["kl"] for r in reads) / floor_kl,
           "greedy16": statistics.fmean(r["greedy"] for r in reads),
           "floor_greedy16": statistics.fmean(r["greedy"] for r in floor), "floor_kl_mean": floor_kl,
           "worst_session_tokens_over_prefix": max(s["strategies"][name]["forwarded_tokens"] /
                                                   s["strategies"]["prefix"]["forwarded_tokens"] for s in sessions)}
    if all("wall_s_min" in s["strategies"][name] and s["strategies"][name].get("repeats", 1) > 1 for s in sessions):
        out["wall_s_min"] = sum(s["strategies"][name]["wall_s_min"] for s in sessions)
        out["wall_s_median"] = sum(s["strategies"][name]["wall_s"] for s in sessions)
        prefix_min = sum(s["strategies"]["prefix"]["wall_s_min"] for s in sessions)
        out["wall_over_prefix"] = out["wall_s_min"] / prefix_min
    return out


def meets(figures: dict[str, Any]) -> bool:
    """The contract: KL within `KL_OVER_FLOOR` times the floor's, greedy-16 within `GREEDY_POINTS`."""
    return figures["kl_over_floor"] <= KL_OVER_FLOOR and figures["greedy16"] >= figures["floor_greedy16"] - GREEDY_POINTS


def choose(sessions: Sequence[dict], strategy: str, settings: Sequence[Any]) -> dict[str, Any]:
    """The setting of `strategy` chosen on the validation `sessions` (see the module docstring)."""
    scored = []
    for setting in settings:
        figures = pooled(sessions, setting_name(strategy, setting))
        if figures is not None:
            scored.append((setting, figures))
    if not scored:
        raise RuntimeError(f"{strategy}: no validation figures to choose a setting from; this indicates a bug")
    good = [(s, f) for s, f in scored if meets(f)]
    setting, figures = (min(good, key=lambda sf: sf[1]["tokens"]) if good else
                        min(scored, key=lambda sf: sf[1]["kl_over_floor"]))
    return {"chosen": list(setting) if isinstance(setting, tuple) else setting, "met_on_validation": bool(good),
            "validation": {setting_name(strategy, s): f for s, f in scored}}


class Runner:
    """Runs sessions in this process, or on `jobs` spawned worker processes (each loads the model
    and its bfloat16 copy once and runs `threads` torch threads): sessions are independent, and
    every strategy of one session runs in the same process, back to back."""

    def __init__(self, model: str, threads: int, jobs: int = 1, km: Any = None, floor_model: Any = None) -> None:
        self.model, self.threads, self.jobs = model, threads, jobs
        self.km, self.floor_model = km, floor_model
        self._pool = None
        if jobs > 1:
            import multiprocessing as mp

            self._pool = mp.get_context("spawn").Pool(jobs, initializer=_init_worker, initargs=(model, threads))

    def run(self, traces: Sequence[Trace], plans: Sequence[Sequence[tuple[str, Any]]], greedy: int, repeats: int,
            log: Callable[[str], None]) -> list[dict[str, Any]]:
        if self._pool is None:
            out = []
            for trace, plan in zip(traces, plans):
                log(f"{trace.name} ({trace.meta.get('split')}): {trace.decisions} reads, budget {trace.budget_tokens}")
                out.append(run_session(self.km, self.floor_model, trace, plan, greedy, repeats, log))
            return out
        jobs = [self._pool.apply_async(_run_in_worker, (trace, list(plan), greedy, repeats)) for trace, plan in
                zip(traces, plans)]
        out = []
        for trace, job in zip(traces, jobs):
            out.append(job.get())
            log(f"{trace.name} ({trace.meta.get('split')}) done")
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()


_WORKER: dict[str, Any] = {}


def _init_worker(model: str, threads: int) -> None:
    import torch

    from agentwin import KameraModel
    from agentwin.models.zoo import load_real

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    _WORKER["km"] = KameraModel.from_pretrained(model)
    _WORKER["floor"] = load_real(model, torch.bfloat16)[0].eval()


def _run_in_worker(trace: Trace, plan: list, greedy: int, repeats: int) -> dict[str, Any]:
    return run_session(_WORKER["km"], _WORKER["floor"], trace, plan, greedy, repeats, lambda _: None)


def run_benchmark(runner: Runner, sessions: Sequence[Trace], greedy: int = 16, repeats: int = 3,
                  quick: bool = False, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Validation then test (see the module docstring), sessions run by `runner` (its floor model:
    the same model loaded in bfloat16, not cast, so its RoPE frequencies stay float32 as in
    bfloat16 serving). Layout: {"sessions": {name: ...}, "selection": {strategy: ...},
    "per_kind": {kind: {strategy: pooled}}, "frontier": {...}, and the top-level figures of the
    default pooled over the test sessions}."""
    validation = [t for t in sessions if t.meta.get("split") == "validation"]
    test = [t for t in sessions if t.meta.get("split") == "test"]
    if not validation or not test:
        raise ValueError("the benchmark needs validation and test sessions (seeds of both splits)")
    strategies = [s for s in STRATEGIES if not quick or s in ("prefix", "default", "survive", "refresh", "blind",
                                                                "origin-akin")]
    out: dict[str, Any] = {"sessions": {}, "selection": {}}
    swept = [s for s in strategies if len(grid(s, quick)) > 1]
    plan = [("prefix", None)] + [(s, setting) for s in swept for setting in grid(s, quick)]
    done_validation = runner.run(validation, [plan] * len(validation), greedy, 1, log)
    for entry in done_validation:
        out["sessions"][entry["name"]] = entry
    chosen: dict[str, Any] = {s: grid(s, quick)[0] for s in strategies}
    for strategy in swept:
        out["selection"][strategy] = choose(done_validation, strategy, grid(strategy, quick))
        c = out["selection"][strategy]["chosen"]
        chosen[strategy] = tuple(c) if isinstance(c, list) else c
    test_plan = [(s, chosen[s]) for s in strategies]
    names = {s: setting_name(s, chosen[s]) for s in strategies}
    done_test = runner.run(test, [test_plan] * len(test), greedy, repeats, log)
    for entry in done_test:
        out["sessions"][entry["name"]] = entry
    kinds = sorted({s["kind"] for s in done_test})
    out["per_kind"] = {kind: {s: pooled([e for e in done_test if e["kind"] == kind], names[s]) for s in strategies}
                       for kind in kinds}
    out["frontier"] = {s: _point(pooled(done_test, names[s])) | {"setting": names[s]} for s in strategies}
    out["frontier_per_kind"] = {kind: {s: _point(out["per_kind"][kind][s]) for s in strategies} for kind in kinds}
    default = pooled(done_test, "default")
    revisits = [e for e in done_test if e["revisits"]]
    default_revisits = pooled(revisits, "default") if revisits else None
    out.update({
        "default_kl_over_floor": default["kl_over_floor"], "default_greedy16": default["greedy16"],
        "floor_greedy16": default["floor_greedy16"], "default_kl_max": default["kl_max"],
        "default_tokens_over_prefix": (default_revisits or default)["tokens_over_prefix"],
        "worst_session_tokens_over_prefix": default["worst_session_tokens_over_prefix"],
        "default_tokens_over_lower_bound": default["tokens_over_lower_bound"],
        "default_wall_over_prefix": (default_revisits or default).get("wall_over_prefix"),
        "floor_kl_mean": default["floor_kl_mean"], "test_reads": default["reads"],
        "revisit_sessions": len(revisits),
    })
    out["contract"] = {"faithful": meets(default), "never_more_than_prefix": default["worst_session_tokens_over_prefix"] <= 1.0,
                       "cheaper_on_revisits": (out["default_tokens_over_prefix"] <= TOKENS_TARGET and
                                               (out["default_wall_over_prefix"] or 9) <= WALL_TARGET)}
    out["at_floor_cheaper"] = {s: f for s, f in out["frontier"].items()
                               if f["kl_over_floor"] <= KL_OVER_FLOOR and f["greedy16"] >= f["floor_greedy16"] - GREEDY_POINTS
                               and f["tokens_over_prefix"] < 1.0}
    return out


def _point(figures: dict[str, Any] | None) -> dict[str, Any]:
    if figures is None:
        return {}
    keep = ("tokens_over_prefix", "kl_over_floor", "greedy16", "floor_greedy16", "kl_max",
            "tokens_over_lower_bound", "worst_session_tokens_over_prefix", "wall_over_prefix", "reads")
    return {k: figures[k] for k in keep if k in figures}
