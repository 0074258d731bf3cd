"""The results page of `agentwin bench fidelity` (docs/results/FIDELITY.md), from its JSON."""

from __future__ import annotations

from typing import Any

from tools.bench.fidelity import DEFAULT_FIT, FITS, HEADLINE, TARGET_POINTS, window_default_patch
from tools.bench.runs import describe_bf16_path
from tools.bench.trace_bench import _f, _pct


def _met(flag: bool) -> str:
    return "met" if flag else "missed"


def _kl(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _rate(x: Any) -> str:
    return "n/a" if x is None else _pct(x)


def _rank_cell(entry: dict[str, Any], budget: str) -> str:
    rank = entry["ranks"].get(budget)
    if rank is None:
        return ""
    return f"{rank} ({entry['bytes_fraction'][budget]:.2%})" if rank else "0 (none fits)"


def _bf16_path(result: dict[str, Any]) -> str:
    """The CPU path the floor ran on, which moves it (`tools.bench.runs.bf16_path`); older results lack it."""
    path = result.get("bf16_path")
    if not path:
        return ""
    return f"; it depends on the CPU's bfloat16 path, here {describe_bf16_path(path)}"


def _target_section(result: dict[str, Any]) -> list[str]:
    """`Window(max_kl=...)` against the window's default budget on the agent traces."""
    m = result.get("max_kl")
    if not m:
        return []

    def share(x: Any) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    lines = ["", "## A fidelity target instead of a budget", "",
             (f"`Window(max_kl={m['target']:g})` with the window's other defaults (policy "
              f"`{window_default_patch()}`): each text chunk's patch is measured on the chunk's last rows (next-token "
              "KL against its own pass): blind reuse, then the default fit within the default budget, √2 times "
              "that and so on, until the rows read within the target; the lowest-KL option is kept. The target "
              f"is fixed, not this run's floor ({m['target']:g} nats: a bf16 re-prefill's KL measured on SmolLM2, "
              "`tools.bench.harness.TARGET_KL`). Bytes: the patches' bytes over their chunks' canonical KV "
              "bytes as the window holds them (float32); probe tokens: those of the forwards that measured them "
              "(\"guard\")."), "",
             "| trace | window | decisions | KL mean | top-1 | greedy-16 | patch bytes / chunks' KV | probe tokens |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = [(n, e) for n, e in m["traces"].items()] + [("pooled", {"max_kl": m["max_kl"], "default": m["default"]})]
    for name, entry in rows:
        for label, key in ((f"`max_kl={m['target']:g}`", "max_kl"), (f"default, ≤ {HEADLINE:.0%} bytes", "default")):
            r = entry[key]
            lines.append(f"| {name} | {label} | {r.get('decisions', 0)} | {_kl(r.get('kl_mean'))} | "
                         f"{_rate(r.get('top1'))} | {_rate(r.get('greedy16'))} | {share(r.get('share'))} | "
                         f"{r.get('guard_tokens', 0)} |")
    return lines


def render_page(result: dict[str, Any]) -> str:
    """Markdown of a results dict (the `--json` layout)."""
    s, t = result["settings"], result["target"]
    head = f"{HEADLINE:g}"
    lines = ["# Patch fidelity under byte budgets, and stale patches", "",
             f"Written by `{result['command']}` (do not edit by hand; run it again).", "",
             (f"Model: {result['model']}. Torch threads: {result['threads']}. Load average at start "
             f"{', '.join(f'{x:.2f}' for x in result['loadavg_start'])}, at end "
             f"{', '.join(f'{x:.2f}' for x in result['loadavg_end'])} (a shared {result['cpus']}-CPU machine). "
             f"Total {result['wall_s_total']:.0f} s. Grid: budgets {', '.join(f'{b:.1%}' for b in s['budgets'])} of "
             f"a chunk's canonical KV bytes; fits {', '.join(s['fits'])}; stale-patch guards "
             f"{', '.join(s['guards']) or 'none'}; traces {', '.join(s['traces'])}; greedy {s['greedy']} tokens"
             f"{'; quick sizes' if s['quick'] else ''}."), "",
             "## Targets", "", t["statement"], "",
             (f"The window's default: patch policy `{window_default_patch()}` (`{_policy(result)}` below), its defaults "
              f"fit at ≤ {HEADLINE:.0%} bytes."), "",
             (f"- KL at ≤ {HEADLINE:.0%} bytes (`{_policy(result)}`, pooled over the agent traces' decisions): "
             f"{_kl(result['kl_at_6pct'])} against the bf16 noise floor's {_kl(result['noise_floor_kl'])}: "
             f"**{_met(t['kl_met'])}**."),
             (f"- Greedy-16 agreement at ≤ {HEADLINE:.0%} bytes: {_rate(result['greedy16_at_6pct'])} against the "
             f"floor's {_rate(result['noise_floor_greedy16'])} (target: within {TARGET_POINTS * 100:.0f} points): "
             f"**{_met(t['greedy_met'])}**."),
             (f"- Stale cases on all traces (agent and hard-case): {result['stale_cases']}; the window further from "
             f"the re-prefill than blind reuse in {result['stale_worse_than_blind']} of them (target 0): "
             f"**{_met(t['stale_met'])}**."),
             *_hard_line(result), "",
             f"**Targets {'met' if t['met'] else 'missed'}.**", "",
             "| pooled over the agent traces | decisions | KL mean | top-1 | greedy-16 | same action |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    rows = [(f"agentwin `{_policy(result)}` at ≤ {HEADLINE:.0%} bytes (the window's default)", result["at_6pct"])]
    if _policy(result) != DEFAULT_FIT and result.get("origin_at_6pct"):
        rows.append((f"agentwin `{DEFAULT_FIT}` (no stale-patch guard)", result["origin_at_6pct"]))
    for label, row in (*rows,
                       ("blind reuse", result["blind"]), ("bf16 re-prefill (noise floor)", result["noise_floor"])):
        if row.get("decisions"):
            lines.append(f"| {label} | {row['decisions']} | {_kl(row['kl_mean'])} | {_pct(row['top1'])} | "
                         f"{_pct(row['greedy16'])} | {_pct(row['same_action'])} |")
    lines += _target_section(result)
    lines += ["", "## Ranks from byte budgets", "",
              ("The window's default fit (`origin`, `origin+guard`) takes each chunk's own ranks within the budget "
               "(`Window(patch_bytes=b)`; int8 factors cost T + F + 8 bytes per rank, 4-bit ones of the mixed "
               "storage (T + F)/2 + 8). The rank-based fits "
               "(`origin-svd`, `orbit`) take one rank per trace: "
               "a rank-r patch costs r · (T + F) · 2 bytes per layer for keys and as much for values (fp16 factors, "
              "`kamera_core.budget.bytes_per_rank`; T the chunk's tokens, F the features per token), against "
              "T · F · 4 bytes of canonical float32 KV. The rank of a trace is the largest whose patch fits the "
              "budget for every chunk of the trace that takes a patch (appended after another chunk; the shortest "
              "decides). Cells: rank (largest patch bytes "
              "over canonical bytes among the trace's chunks)."), "",
              "| trace | chunk tokens | " + " | ".join(f"{b:.1%}" for b in s["budgets"]) + " |",
              "| --- | --- | " + " | ".join("---:" for _ in s["budgets"]) + " |"]
    for name, e in result["traces"].items():
        cells = [_rank_cell(e, f"{b:g}") for b in s["budgets"]]
        tokens = e["chunk_tokens"]
        span = f"{min(tokens)}–{max(tokens)}" if tokens else "no chunk takes a patch"
        lines.append(f"| {name} | {span} | " + " | ".join(cells) + " |")
    lines += ["", "## Fits × budgets × traces", "",
              ("KL mean (nats) / greedy-16 agreement against the float32 re-prefill at every decision of the trace; "
              "blind reuse and the noise floor for comparison. A budget too small for rank 1 has no rank-based entry. The "
              f"hard-case traces (validation of the stale guard) run the by-bytes fits at {HEADLINE:.0%} only "
              "and have no noise floor."), "",
              "| trace | fit | " + " | ".join(f"{b:.1%}" for b in s["budgets"]) + " |",
              "| --- | --- | " + " | ".join("---" for _ in s["budgets"]) + " |"]
    for name, e in result["traces"].items():
        rows = e["strategies"]
        for fit in s["fits"]:
            cells = []
            for b in s["budgets"]:
                strategy = e["grid"].get(fit, {}).get(f"{b:g}")
                cells.append("" if strategy is None else f"{_kl(rows[strategy]['kl_mean'])} / "
                             f"{_pct(rows[strategy]['greedy16'])}")
            lines.append(f"| {name} | {fit} | " + " | ".join(cells) + " |")
        blind = rows["blind"]
        lines.append(f"| {name} | blind reuse | {_kl(blind['kl_mean'])} / {_pct(blind['greedy16'])} (any budget) |"
                     + " |" * (len(s["budgets"]) - 1))
        if "reprefill-bf16" in rows:
            fl = rows["reprefill-bf16"]
            lines.append(f"| {name} | bf16 noise floor | {_kl(fl['kl_mean'])} / {_pct(fl['greedy16'])} |"
                         + " |" * (len(s["budgets"]) - 1))
    lines += _stale_section(result, head)
    lines += ["", "## How it was measured", "",
              ("The agent traces are recorded as for `agentwin bench trace` (`tools.bench.traces`: the project's "
              "agents run by the agent loop with a scripted decider); the hard-case traces are built from "
              "`tools.bench.hard_cases` (`tools.bench.fidelity.hard_case_trace`): a filler chunk, then the "
              f"case's two chunks A and B, read after its first {s.get('hard_case_questions', 2)} question(s); then A "
              "evicted, A recalled to the front, "
              "the filler evicted, each read after the same questions. Every strategy replays the identical "
              "operations in this one process on the same model and threads (`tools.bench.trace.replay`)."),
              "",
              ("At every decision: the next-token distribution after the query and the greedy continuation "
              f"({s['greedy']} tokens). KL(reference ‖ strategy) in nats against the float32 re-prefill of the same "
              "tokens, greedy-16 agreement (the continuations identical), same action (`agents.actions."
              "parse_action`; the hard cases' replies are not actions). The noise floor is a bfloat16 copy of the "
              "model re-prefilling the same inputs (agent traces only)" + _bf16_path(result) + "."), "",
              "| fit | what it is |", "| --- | --- |",
              ("| origin | `Window(patch=\"origin\", patch_bytes=b)`, the window's defaults: the patch fitted at append "
               f"within the budget (`fit=\"{result.get('window_fit', 'alloc')}\"`, "
               f"`storage=\"{result.get('window_storage', 'int8')}\"`"
               f"{': int8 and 4-bit factors split by the allocator' if result.get('window_storage') == 'auto' else ''}; "
               "the patch guard on below 6%), "
               "served after any antecedent |"),
              ("| origin-alloc | the same with `fit=\"alloc\"`: ranks spread over layers and K/V by the allocator on "
               "each block's gains normalised by its energy |"),
              ("| origin-output | the same with `fit=\"output\"`: ranks spread by the first-order error each block "
               "leaves in its layer's attention output (keys in the metric of the chunk's own queries scaled by "
               "its values' spread), relative to that layer's values' spread |"),
              ("| origin-output-half, origin-output-abs | the same with `fit=\"output-half\"` / `\"output-abs\"`: each "
               "layer's error relative to the square root of its values' spread / absolute |"),
              ("| origin-residual | the same with `fit=\"residual\"`: each block's error where it lands in the residual "
               "stream (through the layer's output projection), relative to the stream's size there in the pass; "
               "`-int8` / `-mixed`: with `storage=\"int8\"` / `\"mixed\"` (int8 for each block's leading components, "
               "4 bits for the rest, split by the allocator) |"),
              ("| origin-svd | `Window(patch=\"origin\", rank=r, fit=\"svd\", storage=\"fp16\")`: the window's earlier "
               "default fit |"),
              ("| origin+guard | the same with `guard=True` at every budget (`agentwin.patches.guard`: a patch component kept "
              "only where it beats blind reuse on the chunk's last rows) |"),
              "| orbit | `Window(patch=OrbitPolicy(), rank=r, fit=\"svd\", storage=\"fp16\")` (`tools.bench.orbit`), no `fit_orders` orders |",
              "| blind reuse | `Window(patch=\"none\")`: canonical KV re-rotated, no patch |"]
    unused = [f for f in FITS if f not in s["fits"]]
    if unused:
        lines.append(f"\nNot in this run's grid: {', '.join(unused)}.")
    return "\n".join(lines + [""])


def _policy(result: dict[str, Any]) -> str:
    """The candidate name of the window's default stale-patch policy in this run."""
    return result.get("window_policy", DEFAULT_FIT)


def _hard_line(result: dict[str, Any]) -> list[str]:
    hard = (result.get("hard_cases") or {}).get("stale")
    agent = result.get("stale")
    if not hard or not agent:
        return []
    lines = [(f"  - of which the agent traces {agent['stale_cases']} ({agent['worse_than_blind']} worse than blind), the "
             f"hard-case traces (built to read chunks after antecedents they were not fitted on) "
             f"{hard['stale_cases']} ({hard['worse_than_blind']} worse). The hard-case traces are validation traces "
             "of the stale-patch guard (below): their count is not a held-out figure.")]
    unguarded = result.get("stale_unguarded")
    if unguarded and _policy(result) != DEFAULT_FIT:
        lines.append(f"  - `{DEFAULT_FIT}` with no stale-patch guard: {unguarded['worse_than_blind']} of "
                     f"{unguarded['stale_cases']} worse than blind.")
    return lines


def _lower(x: Any, y: Any) -> str:
    if x is None or y is None:
        return "not comparable"
    return "lower" if x < y else "the same" if x == y else "higher"


def _stale_section(result: dict[str, Any], head: str) -> list[str]:
    st, guard = result["stale"], result["stale_guard"]
    hard = result.get("hard_cases") or {}
    lines = ["", "## Stale patches", "",
             (f"A stale case is a decision where the `{DEFAULT_FIT}` fit at ≤ {HEADLINE:.0%} bytes (no stale-patch "
             "guard) served some chunk with a patch fitted after another antecedent than the one it has now "
             "(evictions, recalls or reorders before it), as `WindowStats.stale_patches` counts. At each one, KL "
             "of the window is set against KL of blind reuse at the same decision: below for the window's "
             f"default (`{_policy(result)}`); per guard in the tables after it."), "",
             ("| traces | stale cases | window worse than blind | mean KL ratio window / blind | KL window | "
             "KL blind |"), "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, x in (("agent traces", st), ("hard-case traces", hard.get("stale"))):
        if x:
            lines.append(f"| {label} | {x['stale_cases']} | {x['worse_than_blind']} | {_f(x['mean_ratio'])} | "
                         f"{_kl(x['kl_mean'])} | {_kl(x['kl_blind_mean'])} |")
    lines += ["", "Stale cases per trace: " + ", ".join(f"{n} {c}" for n, c in result["stale_cases_by_trace"].items())
              + ".", "", "| trace | step | stale placements | KL origin | KL blind | "
              + " | ".join(f"KL {g}" for g in result["settings"]["guards"]) + " | greedy-16 origin / blind |",
              "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in result["settings"]["guards"])
              + " | --- |"]
    for name, e in result["traces"].items():
        for c in e["stale"]:
            guards = " | ".join(_kl(c["kl_guards"].get(g)) for g in result["settings"]["guards"])
            lines.append(f"| {name} | {c['step']} | {c['stale_placements']} | {_kl(c['kl'])} | {_kl(c['kl_blind'])} | "
                         f"{guards} | {'yes' if c['greedy'] else 'no'} / {'yes' if c['greedy_blind'] else 'no'} |")
    lines += ["", "### Stale-patch guard", "",
              "Tried: " + ", ".join(f"`{g}`" for g in ["origin (no guard)"] + result["settings"]["guards"])
              + f", each with the window's default fit at {HEADLINE:.0%} of the bytes. `origin-neighbour` serves the origin patch only when "
              "the chunk right before is the one that was right before it at its origin (the antecedents' last "
              "chunks agree), `origin-present` only while every chunk before it at its origin is before it still (in "
              "any order), `origin-either` where either of the two holds, `origin-similar@t` as `origin-either` and "
              "also behind a new neighbour whose key summary (mean canonical keys per layer) has cosine at least t "
              "with that of its neighbour at its origin, `origin-akin@t` as `origin-similar@t` and also behind a "
              "new neighbour at least as close to that one as the chunk's own summary is; blind reuse otherwise. "
              "Ties go to the earlier candidate (thresholds from low to high: the one serving the patch more "
              "often). Chosen on the "
              "validation traces ("
              + ", ".join(guard["validation"]) + ") by the fewest stale cases worse than blind, then the lower mean "
              "KL there; reported on the test traces (" + (", ".join(guard["test"]) or "none") + ").", "",
              ("| candidate | validation: cases / worse than blind / mean KL | test: cases / worse than blind / "
              "mean KL |"), "| --- | --- | --- |"]
    for name, f in guard["figures"].items():
        v, te = f["validation"], f["test"]
        lines.append(f"| {name} | {v['stale_cases']} / {v['worse_than_blind']} / {_kl(v['kl_mean'])} | "
                     f"{te['stale_cases']} / {te['worse_than_blind']} / {_kl(te['kl_mean'])} |")
    lines += ["", (f"Chosen on validation: `{guard['chosen']}`. Each guard against `{DEFAULT_FIT}` as it is: on the "
              "test traces' stale cases, and over every decision of the agent traces (a guard also changes what "
              "later chunks' in-context passes read):")]
    base = guard["figures"][DEFAULT_FIT]["test"]
    for g, row in guard.get("pooled", {}).items():
        test = guard["figures"].get(g, {}).get("test")
        if row.get("decisions") and test:
            lines.append(f"- `{g}`: test stale KL mean {_kl(test['kl_mean'])} against {_kl(base['kl_mean'])} "
                         f"({_lower(test['kl_mean'], base['kl_mean'])}); all decisions: KL mean {_kl(row['kl_mean'])} "
                         f"against {_kl(result['kl_at_6pct'])} ({_lower(row['kl_mean'], result['kl_at_6pct'])}), "
                         f"greedy-16 {_pct(row['greedy16'])} against {_rate(result['greedy16_at_6pct'])}.")
    lines.append(f"\nThe window's default policy in this run: `{window_default_patch()}` (`{_policy(result)}`): "
                 + ("the one chosen on validation." if guard["chosen"] == _policy(result)
                    else f"not the one chosen on validation (`{guard['chosen']}`)."))
    return lines
