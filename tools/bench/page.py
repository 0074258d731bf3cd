"""The results page of `agentwin bench eval`: the protocol, the targets, one section per workload
and the plots, from the workloads' summaries and the settings chosen on validation
(`tools.bench.suite` runs them). Costs are shown in their own units side by side; the page
compares methods within one unit at a time."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from tools.bench.selection import AMORTISE
from agentwin.patches.policies import SIMILAR

UNIT_NAMES = {"bytes_frac": "bytes", "compute_frac": "compute at reuse"}


def _label(r: dict) -> str:
    return r["method"] + (f" {r['setting']}" if r["setting"] else "")


def _spread(values: Sequence[float]) -> str:
    vals = [v for v in values if not math.isnan(v)]
    if len(vals) < 2:
        return ""
    return f" ({min(vals):.2f}–{max(vals):.2f})"


def _kl(x: float) -> str:
    return f"{x:.4f}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


def _costs(r: dict) -> str:
    return (f"{r['bytes_frac']:.1%} | {r['compute_frac']:.1%} | {r['build_compute_frac']:.0%} | {r['ms']:.2f} | "
            + " | ".join(f"{r[f'ms_at_{n}']:.2f}" for n in AMORTISE))


COST_HEAD = ("extra bytes | compute at reuse | one-time compute | ms at reuse | "
             + " | ".join(f"ms per reuse, build over {n}" for n in AMORTISE))
COST_COLS = "--- | --- | --- | --- | " + " | ".join("---" for _ in AMORTISE)


def protocol_lines() -> list[str]:
    return [
        "## Protocol", "",
        "- **Splits.** Validation and test items come from separate seed streams (and the binding model's training "
        "stream is a third). Each method family's setting is chosen on validation alone: at each cost cap, the "
        "setting with the best validation accuracy (binding) or lowest validation KL (SmolLM2) among those whose "
        "validation cost stays within the cap; ties go to the cheaper setting. Recompute anchors are capped by "
        "compute at reuse, patch methods (the four Kamera variants pooled) and the token-sparse baseline by bytes. "
        "The chosen settings are then read on test; every figure below is a test figure unless marked.",
        "- **Reuse in another context.** No patch is scored in the context it was fitted in. Binding: B's patch is "
        "fitted after A and B is read after A′ ≠ A. SmolLM2: recall reads [A′, B] with A′ = a preamble + A; reorder "
        "and slide read the chunks in another order or without A; orbit patches are fitted on the five orders of "
        "{B, E1, E2} other than the scored one. Multimodal: patches fitted with another first chunk.",
        "- **Costs, each in its own unit.** Extra bytes: stored correction (fp16 factors; int8 with float32 scales "
        "for the -int8 methods; for -mixed, int8 for the leading components the allocator picks and 4-bit codes "
        "packed two to a byte for the rest; fp16 rows plus an int32 index for token-sparse) over the reused chunks' fp16 KV. "
        "Compute, in token-layers (one token through one decoder layer) over a re-prefill of the reused chunks: at "
        "reuse (recomputed tokens; 100% for the re-prefill) and one-time (the canonical encode, 100%, for every "
        "method that reuses canonical KV; plus the conditioned pass, another 100%, for Kamera and token-sparse, "
        "even where a window would have run it anyway as the chunk's first in-context prefill; plus one forward "
        "per fitted order for orbit patches). Time: measured ms of the method's work at reuse (placement, "
        "patching, recompute), and per reuse with the one-time work (canonical encode, conditioned pass, fit) "
        f"spread over {' and '.join(str(n) for n in AMORTISE)} reuse(s).",
        "- **Anchors.** CacheBlend-style (layer 0 over every reused token, then gradual filtering: at each later "
        "layer the selected tokens whose values deviate most from the reused ones are kept, 2·r of each chunk at "
        "layer 1 narrowing linearly to r at the last layer; paper setting r = 15%), EPIC-style LegoLink (first k "
        "tokens of each reused chunk in every layer; paper setting k = 16), VLCache-style (first ⌈r·T⌉ tokens of "
        "each reused image/frame chunk, of each reused chunk on text-only workloads; setting r = 5%), each also "
        "swept over its ratio. Token-sparse: from the same conditioned pass as the patches, the exact deficit of "
        "the (layer, token) rows with the largest deficit norm, as many as fit in the byte budget.", ""]


def selected_table(selected: Sequence[dict], metric: str) -> list[str]:
    """The validation-chosen settings: cap, choice, validation metric, then test figures."""
    acc = metric == "acc"
    head = ("| family | cap | chosen on validation | validation " + ("accuracy" if acc else "KL") + " | test "
            + ("accuracy | gap recovered" if acc else "KL | top-1 | greedy identical") + f" | {COST_HEAD} |")
    lines = [head, "| --- | --- | --- | --- | " + ("--- | --- | " if acc else "--- | --- | --- | ") + COST_COLS + " |"]
    for s in selected:
        t = s["test"]
        if t is None:
            continue
        cap = f"≤ {s['cap']:.0%} {UNIT_NAMES[s['unit']]}"
        v = s["validation"][metric]
        if acc:
            figs = f"{v:.3f} | {t['acc']:.3f}{_spread(t['acc_per_set'])} | {_gap(t)}"
        else:
            figs = f"{_kl(v)} | {_kl(t['kl'])} | {t['top1']:.3f} | {t.get('greedy_same', math.nan):.3f}"
        lines.append(f"| {s['family']} | {cap} | {_label(s)} | {figs} | {_costs(t)} |")
    return lines + [""]


def _gap(r: dict) -> str:
    if r["method"] in ("full", "blind") or math.isnan(r.get("gap", math.nan)):
        return "—"
    return f"{r['gap']:.2f}{_spread(r['gap_per_set'])}"


def reference_table(rows: Sequence[dict], metric: str) -> list[str]:
    """Fixed rows (full, blind, the anchors' paper settings, diagnostics) on test."""
    acc = metric == "acc"
    lines = ["| method | test " + ("accuracy | gap recovered" if acc else "KL | top-1 | greedy identical")
             + f" | {COST_HEAD} |", "| --- | " + ("--- | --- | " if acc else "--- | --- | --- | ") + COST_COLS + " |"]
    for t in rows:
        figs = (f"{t['acc']:.3f}{_spread(t['acc_per_set'])} | {_gap(t)}" if acc
                else f"{_kl(t['kl'])} | {t['top1']:.3f} | {t.get('greedy_same', math.nan):.3f}")
        lines.append(f"| {_label(t)} | {figs} | {_costs(t)} |")
    return lines + [""]


def sweep_table(summary: Sequence[dict], where: dict, metric: str) -> list[str]:
    """Every setting: validation and test metric side by side, with its costs (test)."""
    val = {_label(s): s for s in summary if s["split"] == "validation" and all(s[k] == v for k, v in where.items())}
    test = [s for s in summary if s["split"] == "test" and all(s[k] == v for k, v in where.items())]
    fmt = "{:.3f}".format if metric == "acc" else _kl
    lines = [f"| method | validation {metric} | test {metric} | extra bytes | compute at reuse | one-time compute |",
             "| --- | --- | --- | --- | --- | --- |"]
    for t in test:
        v = val.get(_label(t))
        lines.append(f"| {_label(t)} | {'—' if v is None else fmt(v[metric])} | {fmt(t[metric])} | "
                     f"{t['bytes_frac']:.1%} | {t['compute_frac']:.1%} | {t['build_compute_frac']:.0%} |")
    return lines + [""]


def _fixed(summary: Sequence[dict], where: dict, paper: dict) -> list[dict]:
    keep = []
    for s in summary:
        if s["split"] != "test" or any(s[k] != v for k, v in where.items()):
            continue
        if s["method"] in ("full", "blind", "oracle") or (s["method"] in paper and s["param"] == paper[s["method"]]):
            keep.append(s)
    return keep


def settings_line(res: dict) -> str:
    sw, names = res["sweeps"], {"cacheblend": "CacheBlend r", "epic": "EPIC k", "vlcache": "VLCache r"}
    fmt = lambda name, v: str(v) if name == "epic" else f"{v:.0%}"
    return ("Settings run: " + "; ".join(f"{names[n]} ∈ {{{', '.join(fmt(n, v) for v in sw[n])}}}" for n in names)
            + "; Kamera variants and token-sparse at " + ", ".join(f"{b:.0%}" for b in res["budgets"])
            + " of the reused chunks' KV bytes (a budget; the bytes used are shown).")


def binding_section(res: dict, paper: dict) -> list[str]:
    m, g, t = res["model"], res["generator"], res["training"]
    lines = [
        "## 1. Multi-hop accuracy on the binding model", "",
        f"Model: the shipped binding checkpoint (`tools/bench/binding/data/`, Llama architecture, "
        f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} query / "
        f"{m['num_key_value_heads']} KV heads × {m['head_dim']}, {res['parameters']:,} parameters; trained "
        + "; then ".join(f"{st['steps_done']} steps on the {st['layout']} layout in {st['seconds'] / 60:.1f} min on "
                         f"{st['torch_threads']} CPU thread(s)" for st in t.get("stages", [t]))
        + f"; the checkpoint's README says how to reproduce it). Task: A opens with 0–{g['a_filler_max']} filler "
        f"words, lists {g['members']} entities and closes with {g['lead_max']} − n filler words; B opens with n filler "
        f"words (n uniform in 0–{g['lead_max']}), then one claim per entity, in order, \"o_k it\" (the k-th \"it\" is "
        f"A's k-th entity), then 0–{g['trail_max']} filler words. The claims sit anywhere in B, from its first token "
        "on, so no fixed token budget is placed on them by construction, while every claim stays at one distance "
        "from its entity. The question (\"so E12\") names an entity; accuracy is argmax over the whole vocabulary.",
        f"Items per condition: {res['val_items']} validation, {res['test_sets']} × {res['test_items']} test "
        "(spread: min–max over the test sets). Conditions: **same-list**, A′ lists the same entities in the same "
        "order as the A the patch was fitted after, with other filler words (B means the same after both); "
        "**other-list**, A′ lists other entities (the patch fitted after A is stale: B's claims bind differently). "
        + settings_line(res), ""]
    for cond in dict.fromkeys(s["condition"] for s in res["summary"]):
        where = {"condition": cond}
        full = next(s for s in res["summary"] if s["split"] == "test" and s["condition"] == cond and s["method"] == "full")
        blind = next(s for s in res["summary"] if s["split"] == "test" and s["condition"] == cond and s["method"] == "blind")
        lines += [f"### {cond}", "", f"Test: full context {full['acc']:.3f}, blind reuse {blind['acc']:.3f}.", "",
                  "Settings chosen on validation, read on test:", ""]
        lines += selected_table([s for s in res["selected"] if s["condition"] == cond], "acc")
        lines += ["Fixed settings (paper settings of the anchors; `oracle B's objects` is a diagnostic that recomputes "
                  "exactly B's object tokens in every layer, which no method can know to pick at reuse time):", ""]
        lines += reference_table(_fixed(res["summary"], where, paper), "acc")
        lines += ["Every setting (test costs):", ""] + sweep_table(res["summary"], where, "acc")
    return lines


def smollm2_section(res: dict, paper: dict) -> list[str]:
    lines = ["## 2. Fidelity on SmolLM2-135M-Instruct", "",
             f"Generated cases (`tools.bench.datasets`): validation seeds {res['validation_seeds']}, test seeds "
             f"{res['test_seeds']}, {res['queries']} questions each. Each trace's queries are read after the method's "
             f"KV and compared with a full re-prefill: mean next-token KL, top-1 agreement and (test only; for the "
             f"settings chosen on validation, the anchors' paper settings, full and blind reuse) the share of "
             f"queries whose first {res['greedy_tokens']} greedy tokens are identical. Origin patches are fitted "
             "on the appended chunks [A, B, E1, E2]. recall: [A′, B], A′ = two or three neutral preamble sentences "
             "+ A. reorder: [A, E2, B, E1]; the orbit patch is fitted on the other five orders of {B, E1, E2}. "
             "slide: A evicted, [B, E1, E2]; B is exact there, E1 and E2 keep the patches fitted with A present. "
             + settings_line(res), ""]
    for trace in dict.fromkeys(s["trace"] for s in res["summary"]):
        where = {"trace": trace}
        lines += [f"### {trace}", "", "Settings chosen on validation (lowest KL), read on test:", ""]
        lines += selected_table([s for s in res["selected"] if s["trace"] == trace], "kl")
        lines += ["Fixed settings:", ""] + reference_table(_fixed(res["summary"], where, paper), "kl")
        lines += ["Every setting (test costs):", ""] + sweep_table(res["summary"], where, "kl")
    return lines


def multimodal_section(res: dict) -> list[str]:
    lines = ["## 3. Multimodal plumbing on tiny random Qwen2.5-VL and Qwen3-VL", "",
             f"{res['seeds']} layouts per model: [text 24, image needle (16 tokens + text), text 20, frame needle, "
             "text 16], two 6-token text queries; random weights, so KL only, and no settings are chosen here. "
             "Patches are fitted with another first text chunk (18 other tokens). VLCache-style recomputes only the "
             "image and frame chunks here.", "",
             "| model | method | KL | extra bytes | compute at reuse | one-time compute |", "| --- | --- | --- | --- | --- | --- |"]
    for r in res["summary"]:
        lines.append(f"| {r['model']} | {_label(r)} | {r['kl']:.2e} | {r['bytes_frac']:.1%} | {r['compute_frac']:.1%} | "
                     f"{r['build_compute_frac']:.0%} |")
    return lines + [""]


def _pick(selected: Sequence[dict], where: dict, fam: str, cap: float) -> dict | None:
    for s in selected:
        if s["family"] == fam and abs(s["cap"] - cap) < 1e-9 and all(s[k] == v for k, v in where.items()):
            return s
    return None


def targets_section(binding: dict | None, smol: dict | None) -> list[str]:
    """Targets, each stated in one cost unit."""
    lines = ["## Targets", ""]
    from tools.bench.fidelity import window_default_patch

    window_patch = window_default_patch()
    if binding is not None:
        summ, sel = binding["summary"], binding["selected"]
        for cond in dict.fromkeys(s["condition"] for s in summ):
            test = {_label(s): s for s in summ if s["split"] == "test" and s["condition"] == cond}
            full, blind = test["full"], test["blind"]
            lines.append(f"- Binding, {cond}: full context ≥ 95% on test: **{'met' if full['acc'] >= 0.95 else 'not met'}** "
                         f"({full['acc']:.3f}; blind reuse {blind['acc']:.3f}).")
            k6, s6 = _pick(sel, {"condition": cond}, "kamera", 0.06), _pick(sel, {"condition": cond}, "token-sparse", 0.06)
            if k6 and k6["test"]:
                t = k6["test"]
                ok = not math.isnan(t["gap"]) and t["gap"] >= 0.95
                lines.append(f"  - Bytes: Kamera at ≤ 6% bytes (chosen on validation: {_label(k6)}) recovers ≥ 95% of "
                             f"the gap on test: **{'met' if ok else 'not met'}** ({_gap(t)}, accuracy {t['acc']:.3f}, "
                             f"{t['bytes_frac']:.1%} bytes)"
                             + (f"; token-sparse at the same cap ({_label(s6)}): {_gap(s6['test'])}, accuracy "
                                f"{s6['test']['acc']:.3f}, {s6['test']['bytes_frac']:.1%} bytes." if s6 and s6["test"] else "."))
                if "lost_to_blind" in t:
                    lines.append(f"  - Item by item against blind reuse ({cond}: the patch was fitted after another "
                                 f"antecedent A ≠ A′{', which lists other entities' if cond == 'other-list' else ''}): "
                                 f"{_label(k6)} answers wrong where blind reuse answers right on {t['lost_to_blind']} "
                                 f"of {t['n']} test items"
                                 + (f" (the full re-prefill answers {t['lost_to_blind_full_right']} of them right)"
                                    if "lost_to_blind_full_right" in t else "")
                                 + ", and reads further from the re-prefill (next-token KL) on "
                                 f"{t['worse_kl_than_blind']}.")
                val = next((v for v in summ if v["split"] == "validation" and v["condition"] == cond
                            and _label(v) == _label(t)), {})
                for name, g in t.get("guarded", {}).items():
                    gv = val.get("guarded", {}).get(name)
                    rule = ("the patch only where the key summaries of A′ and A have cosine ≥ "
                            f"{SIMILAR:g}" + (", or at least B's own with A" if name == "origin-akin" else ""))
                    lines.append(f"  - Served behind the stale-patch guard `{name}`"
                                 f" ({'the window default: ' if name == window_patch else ''}{rule}; blind "
                                 f"reuse elsewhere): the patch is kept on {g['kept']} of {t['n']} test items; "
                                 f"accuracy {g['acc']:.3f}, "
                                 f"{'—' if math.isnan(g['gap']) else format(g['gap'], '.2f')} of the gap; wrong "
                                 f"where blind reuse answers right on {g['lost_to_blind']}, further from the "
                                 f"re-prefill than blind reuse on {g['worse_kl_than_blind']}"
                                 + (f" (validation: kept on {gv['kept']} of {val['n']}, "
                                    f"{'—' if math.isnan(gv['gap']) else format(gv['gap'], '.2f')} of the gap)"
                                    if gv and "gap" in gv else "") + ".")
            anchors = [_pick(sel, {"condition": cond}, f, 0.25) for f in ("cacheblend", "epic", "vlcache")]
            anchors = [a for a in anchors if a and a["test"]]
            if anchors:
                lines.append("  - Compute at reuse: anchors at ≤ 25% (chosen on validation): "
                             + "; ".join(f"{_label(a)} {_gap(a['test'])} of the gap at {a['test']['compute_frac']:.0%}"
                                         for a in anchors)
                             + ". Kamera and token-sparse recompute nothing at reuse; their one-time compute is "
                             + (f"{k6['test']['build_compute_frac']:.0%}" if k6 and k6["test"] else "—")
                             + f" (anchors and blind reuse: {blind['build_compute_frac']:.0%}).")
            timed = [x for x in ([k6] if k6 else []) + anchors if x and x["test"]]
            lines.append(f"  - Time per reuse with the one-time work spread over {AMORTISE[0]} / {AMORTISE[-1]} reuses: "
                         + "; ".join(f"{_label(x)} {x['test'][f'ms_at_{AMORTISE[0]}']:.2f} / "
                                     f"{x['test'][f'ms_at_{AMORTISE[-1]}']:.2f} ms" for x in timed)
                         + f"; full re-prefill {full['ms']:.2f} ms.")
    if smol is not None:
        summ, sel = smol["summary"], smol["selected"]
        picks = [_pick(sel, {"trace": t}, "kamera", 0.12) for t in dict.fromkeys(s["trace"] for s in summ)]
        picks = [p for p in picks if p and p["test"]]
        if picks:
            n = sum(p["test"]["n"] for p in picks)
            same = sum(p["test"]["greedy_same"] * p["test"]["n"] for p in picks) / n
            blind = [s for s in summ if s["split"] == "test" and s["method"] == "blind"]
            blind_same = sum(s["greedy_same"] * s["n"] for s in blind) / sum(s["n"] for s in blind)
            lines.append(f"- SmolLM2 greedy continuations identical to re-prefill on ≥ 95% of test queries at ≤ 12% bytes "
                         f"(Kamera setting chosen on validation per trace; all traces together): "
                         f"**{'met' if same >= 0.95 else 'not met'}** ({same:.1%}: "
                         + ", ".join(f"{p['trace']} {_label(p)}" for p in picks) + f"; blind reuse {blind_same:.1%}).")
    return lines + [""]


def write_page(path: Path, sections: list[list[str]], header: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*header, *[l for s in sections for l in s]]) + "\n")


# ---- plots ---------------------------------------------------------------------------------------

AXES = {"bytes_frac": "extra bytes (% of the reused chunks' KV)",
        "compute_frac": "compute at reuse (% of a re-prefill of the reused chunks)",
        f"compute_at_{AMORTISE[-1]}": f"compute per reuse, one-time work over {AMORTISE[-1]} reuses (% of a re-prefill)",
        "acc": "accuracy", "kl": "next-token KL vs full re-prefill"}


def plot_panels(panels: list[tuple[str, list[dict], str, str, bool]], path: Path, title: str) -> None:
    """One figure with a panel per (title, rows, x key, y key, log y): one line per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0 * len(panels), 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    markers = "osD^vPX*<>"
    for n, (ptitle, rows, xkey, ykey, logy) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), n + 1)
        methods = list(dict.fromkeys(r["method"] for r in rows))
        for i, m in enumerate(methods):
            pts = sorted((100 * r[xkey], r[ykey]) for r in rows if r["method"] == m)
            if logy:
                pts = [(x, max(y, 1e-8)) for x, y in pts]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)],
                    linestyle="-" if len(pts) > 1 else "none", label=m)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(AXES[xkey])
        ax.set_ylabel(AXES[ykey])
        ax.set_title(ptitle, fontsize="medium")
        ax.grid(True, alpha=0.4)
        ax.legend(fontsize="x-small")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
