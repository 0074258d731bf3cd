"""The agent-trace benchmark: every strategy over every trace, in one process, on one model, with
the same threads; fidelity against the float32 re-prefill of the same inputs, and the noise floor
of a bfloat16 re-prefill against it. `tools/bench_trace.py` is its command line; `render_page`
writes the results page.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch

from tools.bench.prefix_cache import PrefixCache
from tools.bench.strategies import AgentwinStrategy, Reprefill, Strategy, Streaming
from tools.bench.trace import Trace, measure, row_of, score, summarize

STRATEGIES = ("reprefill", "prefix", "streaming", "agentwin-r16", "agentwin-orbit", "agentwin-exact")
TARGET_RATIO = 0.30
TARGET_POINTS = 0.10
TARGET = (f"On traces with revisits, agentwin rank-16 forwards at most {TARGET_RATIO:.0%} of the tokens prefix "
          f"caching forwards, with greedy-16 agreement within {TARGET_POINTS * 100:.0f} points of the bf16 noise "
          "floor.")


def factories(km: Any, trace: Trace, prefix_capacity: int, sinks: int) -> dict[str, Callable[[], Strategy]]:
    budget = trace.budget_tokens
    return {
        "reprefill": lambda: Reprefill(km),
        "prefix": lambda: PrefixCache(km, prefix_capacity),
        "streaming": lambda: Streaming(km, sinks),
        "agentwin-r16": lambda: AgentwinStrategy(km, "agentwin-r16", "origin", 16, budget),
        "agentwin-orbit": lambda: AgentwinStrategy(km, "agentwin-orbit", "orbit", 16, budget),
        "agentwin-exact": lambda: AgentwinStrategy(km, "agentwin-exact", "origin", None, budget),
    }


def run_benchmark(km: Any, traces: Sequence[Trace], greedy: int = 16, repeats: int = 1,
                  prefix_capacity: int = 16384, sinks: int = 4, strategies: Sequence[str] = STRATEGIES,
                  log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Results laid out as `{"traces": {name: {"revisits", "strategies": {...}, "noise_floor"}},
    "noise_floor_greedy16", "noise_floor", "target"}` (see `tools/bench_trace.py`)."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or "reprefill" not in strategies:
        raise ValueError(f"strategies must include reprefill and come from {STRATEGIES}, got {list(strategies)}")
    bf16 = copy.deepcopy(km.model).to(torch.bfloat16).eval()
    out: dict[str, Any] = {"traces": {}}
    floor_rows: list[dict] = []
    for trace in traces:
        log(f"{trace.name}: {trace.decisions} decisions, {len(trace.chunks)} chunks, budget {trace.budget_tokens}")
        make = factories(km, trace, prefix_capacity, sinks)
        reference, timing = measure(trace, make["reprefill"], repeats, greedy, log)
        rows: dict[str, Any] = {}
        per_decision: dict[str, list] = {}
        for name in strategies:
            run, timing = (reference, timing) if name == "reprefill" else measure(trace, make[name], repeats, greedy, log)
            scored = score(trace, reference, run, km.tokenizer, greedy)
            rows[name] = row_of(run, timing, summarize(scored))
            per_decision[name] = scored
        floor_run, floor_timing = measure(trace, lambda: Reprefill(km, bf16, "reprefill-bf16"), 1, greedy, log)
        floor = score(trace, reference, floor_run, km.tokenizer, greedy)
        floor_rows += floor
        entry = {"revisits": trace.revisits, "strategies": rows,
                 "noise_floor": row_of(floor_run, floor_timing, summarize(floor)),
                 "trace": trace.summary(), "per_decision": {**per_decision, "reprefill-bf16": floor}}
        if "prefix" in rows:
            entry["tokens_over_prefix"] = {name: rows[name]["forwarded_tokens"] / rows["prefix"]["forwarded_tokens"]
                                           for name in rows}
        out["traces"][trace.name] = entry
    pooled = summarize(floor_rows)
    out["noise_floor"] = pooled
    out["noise_floor_greedy16"] = pooled.get("greedy16")
    out["target"] = verdict(out["traces"])
    return out


def verdict(traces: dict[str, Any]) -> dict[str, Any]:
    """The target on every trace with revisits: tokens of agentwin-r16 over prefix, and its
    greedy-16 agreement against that trace's bf16 noise floor."""
    per: dict[str, Any] = {}
    for name, entry in traces.items():
        rows = entry["strategies"]
        if not entry["revisits"] or "agentwin-r16" not in rows or "prefix" not in rows:
            continue
        ratio = rows["agentwin-r16"]["forwarded_tokens"] / rows["prefix"]["forwarded_tokens"]
        floor = entry["noise_floor"]["greedy16"]
        agree = rows["agentwin-r16"]["greedy16"]
        per[name] = {"tokens_over_prefix": ratio, "greedy16": agree, "noise_floor_greedy16": floor,
                     "tokens_met": ratio <= TARGET_RATIO, "fidelity_met": agree >= floor - TARGET_POINTS - 1e-12}
        per[name]["met"] = per[name]["tokens_met"] and per[name]["fidelity_met"]
    return {"statement": TARGET, "per_trace": per, "met": bool(per) and all(p["met"] for p in per.values())}


# ---- the results page --------------------------------------------------------------------------

DESCRIPTIONS = {
    "reprefill": "the whole window and the query through the model's own forward at every decision (the reference)",
    "prefix": "prefix caching (radix tree of every earlier decision's sequence, token granular): reuses the longest "
              "common token prefix, computes the rest",
    "streaming": "StreamingLLM-style: KV kept, survivors re-rotated when chunks leave, first tokens kept as attention "
                 "sinks, a recalled chunk is its canonical KV re-rotated, no repair",
    "agentwin-r16": "agentwin Window, origin patches of rank 16",
    "agentwin-orbit": "agentwin Window, orbit patches of rank 16 (the deficits seen at append and in passes; no extra "
                      "OrbitPolicy.fit_orders orders)",
    "agentwin-exact": "agentwin Window, exact (full-rank, float32) patches",
}


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-2 and x != 0 else f"{x:.{digits}f}".rstrip("0").rstrip(".") or "0"
    return str(x)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def render_page(result: dict[str, Any]) -> str:
    """Markdown of a results dict (the `--json` layout)."""
    s = result["settings"]
    lines = [f"# Agent traces: work and fidelity per context strategy", "",
             f"Written by `{result['command']}` (do not edit by hand; run it again).", "",
             f"Model: {result['model']}. Torch threads: {result['threads']}. Load average at start "
             f"{', '.join(f'{x:.2f}' for x in result['loadavg_start'])}, at end "
             f"{', '.join(f'{x:.2f}' for x in result['loadavg_end'])} (a shared {result['cpus']}-CPU machine; wall "
             f"times move with the load). Total {result['wall_s_total']:.0f} s. "
             f"Settings: greedy {s['greedy']} tokens, {s['repeats']} run(s) per strategy, prefix cache capacity "
             f"{s['prefix_capacity_tokens']} tokens, {s['sinks']} attention sinks{', quick sizes' if s['quick'] else ''}.", "",
             "## Target", "", TARGET, ""]
    target = result["target"]
    for name, t in target["per_trace"].items():
        r16 = result["traces"][name]["strategies"]["agentwin-r16"]["forward_tokens"]
        prefix = result["traces"][name]["strategies"]["prefix"]["forwarded_tokens"]
        prompts = r16.get("query", 0) + r16.get("decode", 0)
        lines.append(f"- {name}: agentwin-r16 forwards {_pct(t['tokens_over_prefix'])} of prefix caching's tokens "
                     f"({'met' if t['tokens_met'] else 'missed'}); greedy-16 agreement {_pct(t['greedy16'])} against "
                     f"a bf16 noise floor of {_pct(t['noise_floor_greedy16'])} "
                     f"({'met' if t['fidelity_met'] else 'missed'}). The decisions' prompts and replies alone "
                     f"(query and decode tokens, which every strategy forwards) are {_pct(prompts / prefix)} of prefix "
                     f"caching's tokens.")
    lines += ["", f"**Target {'met' if target['met'] else 'missed'}.**" if target["per_trace"] else
              "**No trace with revisits: the target was not evaluated.**", "",
              "## How it was measured", "",
              "Each trace is the sequence of window operations (append a chunk, evict it, recall it, decide after a "
              "query) recorded from one of the project's agents run by the agent loop (`agents.loop.AgentLoop`) with "
              "a scripted decider: a fixed navigation with returns to earlier pages, back and forward, and recalls "
              "(the 135M model does not navigate reliably on its own). A decision's query is the prompt the loop "
              "showed the decider plus the reply's opening `{\"action\": \"`. Every strategy replays the identical "
              "operations in this one process, on the same model and threads; evictions come from the window's token "
              "budget (FIFO), as in `agentwin.Window`.", "",
              "At every decision each strategy gives the next-token distribution after the query and its greedy "
              f"continuation of {s['greedy']} tokens (stopped at end of sequence). Against the float32 re-prefill of "
              "the same tokens: mean next-token KL (nats), top-1 agreement, greedy-16 agreement (the continuations "
              "identical), and same action (the replies parse to the same action with `agents.actions.parse_action`; "
              "an unparseable reply counts as the action \"malformed\"). The noise floor is a bfloat16 copy of the "
              "model re-prefilling the same inputs, scored the same way.", "",
              "Forwarded tokens count every token passed through the model: canonical encodes, in-context and "
              "conditioned passes, prefills, queries and decoded tokens. Vision-tower runs are 0 throughout: every "
              "trace is text (the video's frames are rendered as text, see below). Peak RSS is the process's resident "
              "high-water mark during the strategy's runs (model weights included).", "",
              "| strategy | what it does |", "| --- | --- |"]
    lines += [f"| {n} | {DESCRIPTIONS[n]} |" for n in s["strategies"]]
    for name, entry in result["traces"].items():
        tr = entry["trace"]
        lines += ["", f"## Trace: {name}", "",
                  f"{tr.get('agent', name)}; {tr.get('source', '')}. {tr['decisions']} decisions, {tr['chunks']} "
                  f"distinct chunks, operations {tr['ops']}, window budget {tr['budget_tokens']} tokens, revisits: "
                  f"{'yes' if entry['revisits'] else 'no'}.", "",
                  "| strategy | forwarded tokens | vs prefix | vision-tower runs | wall s (min / median) | CPU s "
                  "| peak RSS MB (growth) | KL mean | top-1 | greedy-16 | same action |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        ratios = entry.get("tokens_over_prefix", {})
        rows = list(entry["strategies"].items()) + [("bf16 re-prefill (noise floor)", entry["noise_floor"])]
        for strategy, r in rows:
            ratio = ratios.get(strategy)
            lines.append(f"| {strategy} | {r['forwarded_tokens']} | {'' if ratio is None else _pct(ratio)} | "
                         f"{r['vision_tower_runs']} | {r['wall_s_min']:.1f} / {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                         f"{r['peak_rss_mb']:.0f} ({r['rss_growth_mb']:+.0f}) | {_f(r['kl_mean'])} | {_pct(r['top1'])} | "
                         f"{_pct(r['greedy16'])} | {_pct(r['same_action'])} |")
        lines += ["", "Forwarded tokens by kind: " + "; ".join(
            f"{strategy}: " + ", ".join(f"{k} {v}" for k, v in r["forward_tokens"].items()) for strategy, r in rows
            if r.get("forward_tokens")) + "."]
    lines += ["", "## Notes", "",
              "- The video trace uses SmolLM2 too: each frame becomes a line of text (timestamp, nearest named "
              "background colour, where the white square is), so fidelity there is measured on real weights; no "
              "vision tower runs in this benchmark.",
              "- The web agent's browser has no forward action: going forward after a back is a click on the same "
              "link, which reaches the same content (a revisit).",
              "- Prefix caching here matches at token granularity and keeps every earlier decision's sequence up to "
              "its capacity, which is at least what vLLM (block granularity) or SGLang can reuse. It reuses the "
              "window up to the first token that differs from every stored sequence: all of the old window after an "
              "append at the end, nothing after an eviction at the front; the prompt after the window is computed at "
              "every decision.",
              "- agentwin forwards a new chunk twice: its in-context pass (served exactly while the chunk keeps its "
              "place) and its canonical encode (the position-free copy that later placements and recalls reuse); "
              "once when nothing is before it.",
              "- Wall times are single measurements on a shared CPU unless the settings say more runs, and move with "
              "the machine's load (CPU s, the process's CPU time, moves less); forwarded tokens and fidelity do not "
              "depend on the load. Peak RSS includes the model weights and the bfloat16 copy; growth is over the "
              "resident size when the strategy started."]
    same = [n for n, e in result["traces"].items() if {"agentwin-r16", "agentwin-orbit"} <= set(e["strategies"])
            and all(e["strategies"]["agentwin-r16"][k] == e["strategies"]["agentwin-orbit"][k]
                    for k in ("forwarded_tokens", "kl_mean", "greedy16"))]
    if same:
        lines.append(f"- agentwin-orbit gave agentwin-r16's figures on {', '.join(same)}: without `OrbitPolicy.fit_orders` orders "
                     "and conditioned passes, a chunk's orbit holds only the deficit of the antecedent it was appended "
                     "after, and its rank-16 fit is the origin patch.")
    return "\n".join(lines + [""])
