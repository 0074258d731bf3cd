"""The results page of `agentwin bench eval`: the targets, one section per workload, and the
plots, from the workloads' summaries (tools/bench_eval.py runs them)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence


def _label(r: dict) -> str:
    return r["method"] + (f" {r['setting']}" if r["setting"] else "")


def _spread(values: Sequence[float]) -> str:
    vals = [v for v in values if not math.isnan(v)]
    if len(vals) < 2:
        return ""
    return f" ({min(vals):.2f}–{max(vals):.2f})"


def _matched(summary: list[dict], method: str, max_bytes: float) -> dict | None:
    """The best-gap (or best accuracy) setting of `method` whose mean extra bytes ≤ max_bytes."""
    opts = [r for r in summary if r["method"] == method and r["bytes_frac"] <= max_bytes + 1e-12]
    return max(opts, key=lambda r: r["acc"]) if opts else None


def binding_section(res: dict) -> list[str]:
    s = res["summary"]
    by = {(_label(r)): r for r in s}
    full, blind = by["full"], by["blind"]
    lines = [
        "## 1. Multi-hop accuracy on the binding model",
        "",
        f"Model: the shipped binding checkpoint (`agentwin/models/data/binding/`, Llama architecture, "
        f"{res['model']['num_hidden_layers']} layers, hidden {res['model']['hidden_size']}, "
        f"{res['model']['num_attention_heads']} query / {res['model']['num_key_value_heads']} KV heads × "
        f"{res['model']['head_dim']}, {res['parameters']:,} parameters; trained {res['training']['steps_done']} steps "
        f"in {res['training']['seconds'] / 60:.1f} min on {res['training']['torch_threads']} CPU thread(s)). "
        f"Task: A lists {res['generator']['members']} entities; B opens with {res['generator']['prefix_words']} filler "
        "words, then one claim per entity, in order, \"o_k it\" (o_k is its; the k-th \"it\" is A's k-th entity); "
        "the question (\"so E12\") names an entity. "
        f"{res['seeds']} held-out sets × {res['items_per_seed']} items "
        f"= {full['items']} items per method; accuracy is argmax over the whole vocabulary.",
        "",
        f"Full context {full['acc']:.3f}, blind reuse {blind['acc']:.3f}. Gap recovered = "
        "(acc(method) − acc(blind)) / (acc(full) − acc(blind)), mean over seeds (min–max).",
        "",
        "| method | accuracy | gap recovered | extra bytes | extra compute (token-layers) | time at reuse (ms) | one-time build (ms) | KL vs full |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in s:
        gap = "—" if r["method"] in ("full", "blind") or math.isnan(r["gap"]) else f"{r['gap']:.2f}{_spread(r['gap_per_seed'])}"
        lines.append(f"| {_label(r)} | {r['acc']:.3f}{_spread(r['acc_per_seed'])} | {gap} | {r['bytes_frac']:.1%} | "
                     f"{r['compute_frac']:.1%} | {r['ms']:.2f} | {r['build_ms']:.1f} | {r['kl']:.4f} |")
    lines += ["", "Time at reuse: the method's own work when the chunk is reused (recompute forward, or "
              "patch application and relocation); `full` is one prefill of [A, B]. One-time build: "
              "the conditioned pass and the fit, paid once per (chunk, antecedent).", "",
              "`oracle B's objects` is a diagnostic, not a method: it recomputes exactly B's object tokens in "
              "every layer, which no method can know to pick at reuse time. It shows where the binding "
              "lives: in a few tokens deep inside B. EPIC and VLCache recompute B's first tokens only. "
              "CacheBlend ranks tokens by how far their values moved, and the tokens that move most are "
              "B's first ones, where B encoded alone put its attention sink, so its budget goes there "
              "as well. A Kamera patch carries the deficit of every token, wherever it sits.", ""]
    return lines


def smollm2_section(res: dict) -> list[str]:
    lines = ["## 2. Fidelity on SmolLM2-135M-Instruct", "",
             f"{res['seeds']} generated case(s) (tools/patch_texts.py), "
             f"{res['summary'][0]['cases'] // max(1, res['seeds'])} questions each; each trace's queries are read after "
             f"the method's KV and compared with a full re-prefill: mean next-token KL, top-1 agreement, "
             f"and the share of queries whose first {res['greedy_tokens']} greedy tokens are identical. "
             "recall: [A, B] with B from canonical storage (patch conditioned on A). reorder: "
             "[A, B, E1, E2] read as [A, E2, B, E1]; origin patches are the ones fitted when the chunks "
             "were appended (stale after the reorder), the orbit patch is fitted on the deficit averaged "
             "over all 6 orders of {B, E1, E2}. slide: A evicted, [B, E1, E2] read from the front; B is "
             "exact there, E1 and E2 keep the patches fitted with A present.", ""]
    for trace in dict.fromkeys(r["trace"] for r in res["summary"]):
        sel = [r for r in res["summary"] if r["trace"] == trace]
        if not sel:
            continue
        lines += [f"### {trace}", "", "| method | KL | top-1 | greedy identical | extra bytes | extra compute | time (ms) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in sel:
            lines.append(f"| {_label(r)} | {r['kl']:.4f} | {r['top1']:.3f} | {r.get('greedy_same', math.nan):.3f} | "
                         f"{r['bytes_frac']:.1%} | {r['compute_frac']:.1%} | {r['ms']:.1f} |")
        lines.append("")
    return lines


def multimodal_section(res: dict) -> list[str]:
    lines = ["## 3. Multimodal plumbing on tiny random Qwen2.5-VL and Qwen3-VL", "",
             f"{res['seeds']} layouts per model: [text 24, image needle (16 tokens + text), text 20, frame "
             "needle, text 16], two 6-token text queries; random weights, so KL only. VLCache-style "
             "recomputes only the image and frame chunks here.", "",
             "| model | method | KL | extra bytes | extra compute |", "| --- | --- | --- | --- | --- |"]
    for r in res["summary"]:
        lines.append(f"| {r['model']} | {_label(r)} | {r['kl']:.2e} | {r['bytes_frac']:.1%} | {r['compute_frac']:.1%} |")
    return lines + [""]


def targets_section(binding: dict | None, smol: dict | None) -> list[str]:
    lines = ["## Targets", ""]
    if binding is not None:
        s = binding["summary"]
        by = {_label(r): r for r in s}
        full, blind = by["full"], by["blind"]
        lines.append(f"- Binding model ≥ 95% with full context: **{'met' if full['acc'] >= 0.95 else 'not met'}** "
                     f"({full['acc']:.3f} on {full['items']} held-out items). Blind reuse: {blind['acc']:.3f} "
                     f"({'visibly lower' if full['acc'] - blind['acc'] >= 0.05 else 'not visibly lower'}).")
        if full["acc"] - blind["acc"] < 0.05:
            lines.append("  With so small a gap between full context and blind reuse, the gap-recovered figures "
                         "below are noise: the binding comparison does not discriminate between methods here.")
        kamera6 = [r for r in s if r["method"].startswith("kamera") and r["bytes_frac"] <= 0.06 + 1e-12]
        anchors = [r for r in s if r["method"] in ("cacheblend", "epic", "vlcache")]
        if full["acc"] <= blind["acc"]:
            lines.append("- Kamera's best at ≤ 6% patch bytes recovers ≥ 95% of the gap, and beats CacheBlend-15%, "
                         "EPIC and VLCache-5% at equal or lower cost: **not measurable** here (no gap: full context "
                         f"{full['acc']:.3f}, blind reuse {blind['acc']:.3f}). Accuracies: "
                         + ", ".join(f"{_label(r)} {r['acc']:.3f}" for r in anchors)
                         + (f"; Kamera at ≤ 6% bytes {min(r['acc'] for r in kamera6):.3f}–{max(r['acc'] for r in kamera6):.3f}"
                            if kamera6 else "") + ".")
        elif kamera6:
            best6 = max(kamera6, key=lambda r: r["gap"])
            best_any = max((r for r in s if r["method"].startswith("kamera")), key=lambda r: r["gap"])
            ok = best6["gap"] >= 0.95
            lines.append(f"- Kamera's best at ≤ 6% patch bytes recovers ≥ 95% of the gap: **{'met' if ok else 'not met'}** "
                         f"({_label(best6)}: {best6['gap']:.2f} of the gap, accuracy {best6['acc']:.3f}, "
                         f"{best6['bytes_frac']:.1%} bytes)."
                         + ("" if ok else
                            f" Best at any budget measured: {_label(best_any)} {best_any['gap']:.2f} at {best_any['bytes_frac']:.1%} bytes."))
            beaten = [a for a in anchors if best6["acc"] > a["acc"]]
            lines.append(f"- …and beats CacheBlend-15%, EPIC and VLCache-5% at equal or lower cost: "
                         f"**{'met' if len(beaten) == len(anchors) else 'not met'}** (it uses no recompute; "
                         + ", ".join(f"{_label(a)} {a['acc']:.3f} at {a['compute_frac']:.0%} compute" for a in anchors) + ").")
    if smol is not None:
        sel = [r for r in smol["summary"] if r["method"].startswith("kamera") and r["bytes_frac"] <= 0.12 + 1e-12]
        per_method = {}
        for r in sel:
            per_method.setdefault(_label(r), []).append(r)
        best = None
        for label, rs in per_method.items():
            if len({r["trace"] for r in rs}) == len({r["trace"] for r in smol["summary"]}):
                same = sum(r["greedy_same"] * r["cases"] for r in rs) / sum(r["cases"] for r in rs)
                if best is None or same > best[1]:
                    best = (label, same, max(r["bytes_frac"] for r in rs))
        if best is not None:
            blind = [r for r in smol["summary"] if r["method"] == "blind"]
            blind_same = sum(r["greedy_same"] * r["cases"] for r in blind) / sum(r["cases"] for r in blind)
            lines.append(f"- SmolLM2 greedy continuations identical to re-prefill on ≥ 95% of cases at ≤ 12% bytes "
                         f"(all traces together): **{'met' if best[1] >= 0.95 else 'not met'}** ({best[0]}: "
                         f"{best[1]:.1%}, at most {best[2]:.1%} bytes; blind reuse {blind_same:.1%}).")
    return lines + [""]


def write_page(path: Path, sections: list[list[str]], header: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*header, *[l for s in sections for l in s]]) + "\n")


# ---- plots ---------------------------------------------------------------------------------------

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
        ax.set_xlabel({"bytes_frac": "extra bytes (% of the reused chunks' KV)",
                       "compute_frac": "extra compute (% of a re-prefill of the reused chunks)"}[xkey])
        ax.set_ylabel({"acc": "accuracy", "kl": "next-token KL vs full re-prefill"}[ykey])
        ax.set_title(ptitle, fontsize="medium")
        ax.grid(True, alpha=0.4)
        ax.legend(fontsize="x-small")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
