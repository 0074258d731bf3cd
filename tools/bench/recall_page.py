"""The results page of `agentwin bench recall`, written from the figures the command records (the
JSON it writes), never by hand: `render(data)` is the whole page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SIDE_LABELS = {
    "origin": "recall, rank-{rank} origin patch",
    "blind": "recall, blind (no patch)",
    "reprefill": "re-prefill",
    "reprefill_cached_vision": "re-prefill, cached vision embeddings",
}
SIDE_ORDER = ("origin", "blind", "reprefill", "reprefill_cached_vision")


def seconds(x: float) -> str:
    """Seconds as printed on the page."""
    return f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def ratio(x: float) -> str:
    return f"{x:.1f}×" if x >= 10 else f"{x:.2f}×"


def nats(x: float) -> str:
    return f"{x:.1e}"


def by_kind(tokens: dict[str, int]) -> str:
    """Forwarded tokens by kind, e.g. `encode 4421 + in_context 930`; `none` when nothing ran."""
    return " + ".join(f"{k} {v}" for k, v in tokens.items()) or "none"


def label(side: str, rank: int) -> str:
    return SIDE_LABELS[side].format(rank=rank)


def _sides(w: dict[str, Any]) -> list[str]:
    return [s for s in SIDE_ORDER if s in w["sides"]]


def _timing_table(data: dict[str, Any]) -> list[str]:
    lines = ["| workload | side | min (s) | median (s) | re-prefill ÷ side, min / median | "
             "re-prefill with cached vision ÷ side, min / median |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, w in data["workloads"].items():
        for side in _sides(w):
            s = w["sides"][side]
            cells = []
            for base in ("reprefill", "reprefill_cached_vision"):
                r = w["ratios"].get(f"{base}/{side}")
                cells.append(f"{ratio(r['min'])} / {ratio(r['median'])}" if r else "")
            lines.append(f"| {name} | {label(side, data['rank'])} | {seconds(s['min_s'])} | {seconds(s['median_s'])} | "
                         f"{cells[0]} | {cells[1]} |")
    return lines


def _work_table(data: dict[str, Any]) -> list[str]:
    lines = ["| workload | what | model forwards | forwarded tokens by kind | vision-tower runs | "
             "relocated tokens (placements) |",
             "| --- | --- | ---: | --- | ---: | ---: |"]

    def row(name: str, what: str, work: dict[str, Any]) -> str:
        reloc = f"{work['relocated_tokens']} ({work['relocations']})" if "relocated_tokens" in work else "—"
        return (f"| {name} | {what} | {sum(work['forwards'].values())} | {by_kind(work['forwarded_tokens'])} | "
                f"{work['encoder_calls']} | {reloc} |")

    for name, w in data["workloads"].items():
        lines.append(row(name, "appends with origin patches, once per content: the store entries the recall sides "
                               "read (blind reuse needs only the encodes)",
                         w["setup"]["appends"]))
        for side in _sides(w):
            s = w["sides"][side]
            lines.append(row(name, f"{label(side, data['rank'])}: timed call", s["work"]))
            if "untimed_work" in s:
                lines.append(row(name, f"{label(side, data['rank'])}: untimed read before it", s["untimed_work"]))
    return lines


def _fidelity_table(data: dict[str, Any]) -> list[str]:
    lines = ["| workload | side | first token | same as re-prefill | next-token KL vs re-prefill (nats) |",
             "| --- | --- | ---: | --- | ---: |"]
    for name, w in data["workloads"].items():
        for side in _sides(w):
            s = w["sides"][side]
            lines.append(f"| {name} | {label(side, data['rank'])} | {s['first_token']} | "
                         f"{'yes' if s['first_token_same'] else 'no'} | "
                         f"{'(the reference)' if side == 'reprefill' else nats(s['kl_vs_reprefill'])} |")
    return lines


def _target(data: dict[str, Any]) -> list[str]:
    goal, min_tokens = data["target"]["speedup_vs_reprefill"], data["target"]["segment_tokens"]
    lines = [f"Target: recall (rank-{data['rank']} patch) at least {goal:g}× faster than re-prefilling the window, "
             f"for a segment of at least {min_tokens} tokens."]
    for name, w in data["workloads"].items():
        big = w["segment_tokens"] >= min_tokens
        for base, what in (("reprefill", "re-prefill"), ("reprefill_cached_vision", "re-prefill with cached vision")):
            r = w["ratios"].get(f"{base}/origin")
            if r is None:
                continue
            met = [k for k in ("min", "median") if big and r[k] >= goal]
            words = {"min": "minima", "median": "medians"}
            verdict = ("met on minima and medians" if len(met) == 2 else f"met on {words[met[0]]} only" if met else
                       "not met" + ("" if big else f" (segment under {min_tokens} tokens)"))
            lines.append(f"- {name}, against {what}: {ratio(r['min'])} (minima), {ratio(r['median'])} (medians): "
                         f"{verdict}.")
    return lines


def _workloads(data: dict[str, Any]) -> list[str]:
    lines = []
    for name, w in data["workloads"].items():
        extra = ""
        if "frames" in w:
            extra = (f" The segment is {w['frames']} generated frames (gradient, moving square, seeded noise) as one "
                     f"`Frames` chunk; the model has {w['text_layers']} of {w['real_layers']['text']} text layers and "
                     f"{w['vision_layers']} of {w['real_layers']['vision']} vision blocks.")
        lines.append(f"- **{name}**: {w['model']}. Window of {w['window_tokens']} tokens, of which the segment "
                     f"{w['segment_tokens']} ({w['segment_kind']}); query {w['query_tokens']} tokens.{extra} "
                     f"One-time append of the segment: {seconds(w['setup']['segment_append_seconds_one_run'])} s "
                     "(one run: canonical encode + in-context pass + patch fit).")
    return lines


def _accounting(data: dict[str, Any]) -> list[str]:
    lines = []
    for name, w in data["workloads"].items():
        h = w["hooks"]
        lines.append(f"- {name}: {h['forwards']} model forwards of {h['tokens']} tokens in all and {h['vision_runs']} "
                     f"vision-tower run(s), seen by hooks on the model; the appends plus {data['repeats']} × every "
                     "timed call and untimed read above add up to exactly these counts (the command checks it).")
    return lines


def render(data: dict[str, Any]) -> str:
    """The whole page for the figures `data` (the JSON `agentwin bench recall` writes)."""
    m = data["machine"]
    start, end = data["load_average_start"], data["load_average_end"]
    lines = [
        "# Recall to the first token vs re-prefill (CPU)",
        "",
        f"Written by `{data['command']}` from the figures it recorded; rerun the command to update it.",
        "",
        f"Every side ran in one process on the same inputs with {data['threads']} torch thread(s), {data['dtype']}, "
        f"rank-{data['rank']} origin patches; {data['repeats']} repeats of each side, interleaved (one repeat of "
        "every side, then the next), so load on the machine falls on all sides alike. Machine: "
        f"{m['cpus']} CPUs, torch {m['torch']}; load average (1 / 5 / 15 min) {' / '.join(f'{x:.2f}' for x in start)} "
        f"at the start and {' / '.join(f'{x:.2f}' for x in end)} at the end; the run took "
        f"{data['seconds_total'] / 60:.1f} min." + (" Quick mode: small random-init models, a check of the command, "
                                                   "not a measurement." if data["quick"] else ""),
        "",
        "## Time to the first token",
        "",
        *_timing_table(data),
        "",
        "## Work of each side",
        "",
        "Per call, as counted by the window (`WindowStats`) and checked against forward hooks on the model and its "
        "vision tower. `prefill` is a forward of the whole window and the query; relocated tokens were placed by a "
        "shift of KV computed at append, with no forward of theirs at that placement.",
        "",
        *_work_table(data),
        "",
        *_accounting(data),
        "",
        "## Agreement with the re-prefill",
        "",
        *_fidelity_table(data),
        "",
    ]
    cached = [(n, w["sides"]["reprefill_cached_vision"]) for n, w in data["workloads"].items()
              if "reprefill_cached_vision" in w["sides"]]
    for name, s in cached:
        lines += [f"{name}: the re-prefill with cached vision embeddings differs from the plain re-prefill by at most "
                  f"{s['max_abs_logit_diff_vs_reprefill']:.1e} in any logit.", ""]
    lines += [*_target(data), "", "## Workloads", "", *_workloads(data), "", "## What each side does", ""]
    lines += [f"- **{label(side, data['rank'])}**: {data['timed'][side]}" for side in SIDE_ORDER if side in data["timed"]]
    return "\n".join(lines) + "\n"


def write(path: str | Path, data: dict[str, Any]) -> None:
    Path(path).write_text(render(data))
