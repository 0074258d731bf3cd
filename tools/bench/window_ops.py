"""Window operations against re-prefill: next-token KL and the work each patch policy forwards.

Four chunks of a generated case are appended ([A, B, E1, E2]); then, from that state, one
operation runs:
- append: none (the window as appended);
- recall: B evicted and recalled to its old slot;
- evict: B evicted (the chunks after it lose part of their antecedent);
- reorder: [A, E2, B, E1];
- slide: a fifth chunk appended into a budget that forces A out (the survivors move back).
Each is run with blind reuse (`patch="none"`), rank-r origin patches, rank-r orbit patches
(`patch="orbit"`, `OrbitPolicy.fit_orders` over 6 orders after the appends) and exact patches (`rank=None`),
each on a fresh window with its own store. The figure is the mean over the case's questions of the
KL of a re-prefill of `input_ids(question)` against the window's next-token distribution.

Work: the window's forwards by kind (`WindowStats.forward_tokens`), split into the build (appends
and `OrbitPolicy.fit_orders`) and what came after it (the operation and the questions' reads, conditioned
passes included), the relocated tokens, and the reference re-prefills' tokens. A forward hook on
the model sees every forward; its count must equal the window's plus the re-prefills'.
`render` writes the results page from the figures.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from tools.bench.runs import ForwardCounter, kinds

SCENARIOS = ("append", "recall", "evict", "reorder", "slide")
SCENARIO_LABELS = {"append": "append (no operation)", "recall": "evict B, recall B to its slot", "evict": "evict B",
                   "reorder": "reorder to [A, E2, B, E1]", "slide": "slide: a fifth chunk pushes A out"}
POLICIES = (("blind", "none", 16), ("origin r16", "origin", 16), ("orbit r16", "orbit", 16), ("exact", "origin", None))
FIFTH = " Later that week the weather cleared and the town went quiet."
KIND_ORDER = ("encode", "in_context", "conditioned", "orbit", "query", "decode")


def policies(rank: int) -> list[tuple[str, str, int | None]]:
    """(label, patch policy, rank) of each column, rank-16 labels renamed to `rank`."""
    return [(label.replace("16", str(rank)), p, rank if r == 16 else r) for label, p, r in POLICIES]


def texts(case: Any) -> list[str]:
    return [case.a, " " + case.b, " " + case.extra_chunks[0], " " + case.extra_chunks[1]]


def _kl(window: Any, questions: list[str]) -> tuple[list[float], int]:
    """Per question KL(re-prefill || window), and the tokens the re-prefills forwarded."""
    out, reference_tokens = [], 0
    for q in questions:
        # Renormalised in float64: float32 log-probs sum to 1 only to ~1e-7, which alone would
        # make a KL of identical distributions read ±1e-8.
        mine = torch.log_softmax(window.next_token_logprobs(q).double(), -1)
        ref = torch.log_softmax(window.reference_logprobs(q).double(), -1)
        reference_tokens += int(window.input_ids(q).numel())
        out.append(float((ref.exp() * (ref - mine)).sum()))
    return out, reference_tokens


def _work(stats: Any) -> dict[str, Any]:
    return {"forwarded_tokens": dict(stats.forward_tokens), "forwards": dict(stats.forwards),
            "relocated_tokens": int(stats.relocated_tokens), "relocations": int(stats.relocations),
            "conditioned_passes": int(stats.conditioned_passes), "patch_hits": int(stats.patch_hits),
            "encoder_calls": int(stats.encoder_calls)}


def _minus(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before[k] for k in after if not isinstance(after[k], dict)}
    for k in ("forwarded_tokens", "forwards"):
        out[k] = kinds({kind: after[k].get(kind, 0) - before[k].get(kind, 0) for kind in after[k]})
    return out


def scenario(km: Any, case: Any, name: str, policy: str, rank: int | None, quick: bool = False) -> dict[str, Any]:
    """One operation under one policy on a fresh window; KL per question and the work, checked
    against a forward hook on the model. quick: chunks cut to 200 characters, two questions."""
    from agentwin.window import Window
    from tools.bench.stale_guards import policy_named

    chunks = [t[:200] for t in texts(case)] if quick else texts(case)
    questions = list(case.queries[:2] if quick else case.queries)
    sizes = [int(km.tokenize(t).numel()) for t in chunks]
    budget = sum(sizes) + (0 if name == "slide" else 4096)
    with ForwardCounter(km.model) as counter:
        placement = policy_named(policy)  # the orbit policy is the benchmarks' own (tools.bench.orbit)
        window = Window(km, budget_tokens=budget, patch=placement, rank=rank, guard=False)  # as on the results page
        a, b, e1, e2 = [window.append(t) for t in chunks]
        if policy == "orbit":
            placement.fit_orders(window, orders=6, seed=0)
        build = _work(window.stats())
        steps: dict[str, Callable[[], Any]] = {
            "append": lambda: None,
            "recall": lambda: (window.evict(b), window.recall(b)),
            "evict": lambda: window.evict(b),
            "reorder": lambda: window.reorder([a, e2, b, e1]),
            "slide": lambda: window.append(FIFTH[:60] if quick else FIFTH),
        }
        steps[name]()
        window.check_integrity()
        kl, reference_tokens = _kl(window, questions)
        stats = window.stats()
        seen = counter.snapshot()
    total = _work(stats)
    if (seen["tokens"], seen["forwards"]) != (stats.forwarded_tokens + reference_tokens,
                                              stats.passes + len(questions)):
        raise RuntimeError(f"{name}/{policy}: the window counted {stats.forwarded_tokens} forwarded tokens in "
                           f"{stats.passes} forwards plus {reference_tokens} in {len(questions)} "
                           f"re-prefills; the model's hook saw {seen}")
    return {"kl": statistics.fmean(kl), "kl_per_question": kl, "window_tokens": int(window.tokens()),
            "chunks_in_window": len(window.chunks()), "build": _minus(build, _work_empty()),
            "after_build": _minus(total, build), "total": _minus(total, _work_empty()),
            "reference_tokens": reference_tokens, "reference_forwards": len(questions), "hook": seen}


def _work_empty() -> dict[str, Any]:
    return {"forwarded_tokens": {}, "forwards": {}, "relocated_tokens": 0, "relocations": 0, "conditioned_passes": 0,
            "patch_hits": 0, "encoder_calls": 0}


def run_all(km: Any, seeds: int, rank: int, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """Every scenario × policy for cases 0..seeds-1; rows plus the means the page shows."""
    from tools.bench.datasets import make_case

    cols = policies(rank)
    rows = []
    for seed in range(seeds):
        case = make_case(seed)
        for name in SCENARIOS:
            for label, policy, r in cols:
                rows.append({"seed": seed, "scenario": name, "policy": label,
                             **scenario(km, case, name, policy, r, quick)})
        log(f"  seed {seed} done")
    return {"rows": rows, **summarise(rows, [c[0] for c in cols])}


def _mean(values: list[float]) -> float:
    return statistics.fmean(values)


def summarise(rows: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Mean KL per scenario × policy (over cases; each case's KL is the mean over its questions),
    and the mean work per case of each scenario × policy."""
    table, work = {}, {}
    for sc in SCENARIOS:
        table[sc], work[sc] = {}, {}
        for label in labels:
            chosen = [r for r in rows if r["scenario"] == sc and r["policy"] == label]
            table[sc][label] = _mean([r["kl"] for r in chosen])
            by_kind = {k: _mean([r["total"]["forwarded_tokens"].get(k, 0) for r in chosen]) for k in KIND_ORDER}
            work[sc][label] = {
                "forwarded_tokens": {k: v for k, v in by_kind.items() if v},
                "forwarded_tokens_all": _mean([sum(r["total"]["forwarded_tokens"].values()) for r in chosen]),
                "forwarded_tokens_after_build": _mean([sum(r["after_build"]["forwarded_tokens"].values())
                                                       for r in chosen]),
                "conditioned_passes": _mean([r["total"]["conditioned_passes"] for r in chosen]),
                "relocated_tokens": _mean([r["total"]["relocated_tokens"] for r in chosen]),
                "reference_tokens": _mean([r["reference_tokens"] for r in chosen]),
            }
    return {"table": table, "work": work}


# ---- the page -----------------------------------------------------------------------------------


def _n(x: float) -> str:
    """A count (a mean over cases: one decimal unless whole)."""
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _notes(data: dict[str, Any]) -> list[str]:
    """One line per policy, computed from the tables."""
    table, work = data["table"], data["work"]
    labels = list(table[SCENARIOS[0]])
    blind = labels[0]
    lines = []
    for label in labels:
        kls = [table[sc][label] for sc in SCENARIOS]
        fwd = [work[sc][label]["forwarded_tokens_all"] for sc in SCENARIOS]
        base = [work[sc][blind]["forwarded_tokens_all"] for sc in SCENARIOS]
        cond = [work[sc][label]["conditioned_passes"] for sc in SCENARIOS]
        worst = SCENARIOS[max(range(len(kls)), key=lambda i: kls[i])]
        line = (f"- **{label}**: mean KL from {min(kls):.1e} to {max(kls):.1e} (highest after {worst}); forwarded "
                f"{_n(min(fwd))} to {_n(max(fwd))} tokens per case, {min(f / b for f, b in zip(fwd, base)):.2f}× to "
                f"{max(f / b for f, b in zip(fwd, base)):.2f}× blind reuse's, in {_n(min(cond))} to {_n(max(cond))} "
                "conditioned passes.")
        if label != blind:
            better = [sc for sc in SCENARIOS if table[sc][label] < table[sc][blind]]
            line += f" KL below blind reuse's after {len(better)} of {len(SCENARIOS)} operations."
        lines.append(line)
    if len(labels) > 2 and labels[1].startswith("origin") and labels[2].startswith("orbit"):
        lower = [sc for sc in SCENARIOS if table[sc][labels[2]] < table[sc][labels[1]]]
        higher = [sc for sc in SCENARIOS if table[sc][labels[2]] > table[sc][labels[1]]]
        lines.append(f"- {labels[2]} against {labels[1]}: lower KL after: {', '.join(lower) or 'none'}; higher KL "
                     f"after: {', '.join(higher) or 'none'}.")
    return lines


def render(data: dict[str, Any]) -> str:
    """The whole results page of `agentwin bench window` for its figures (the JSON it writes)."""
    table, work = data["table"], data["work"]
    labels = list(table[SCENARIOS[0]])
    start, end = data["load_average_start"], data["load_average_end"]
    seeds = data["seeds"]
    rows0 = [r for r in data["rows"] if r["seed"] == seeds[0] and r["scenario"] == "append"]
    lines = [
        f"# Window operations on {data['model']}",
        "",
        f"Written by `{data['command']}` from the figures it recorded; rerun the command to update it.",
        "",
        f"Cases (seeds) {', '.join(map(str, seeds))} of `tools.bench.datasets.make_case`: four chunks [A, B, E1, E2] "
        f"are appended (case {seeds[0]}: {rows0[0]['window_tokens']} tokens), then one operation runs. The figure is the "
        "next-token KL (nats) of a re-prefill of `input_ids(question)` against the window, averaged over the case's "
        f"questions and then over the cases. Every operation × policy runs on a fresh window. "
        f"{data['threads']} torch thread(s), float32; machine: {data['machine']['cpus']} CPUs, load average "
        f"(1 / 5 / 15 min) {' / '.join(f'{x:.2f}' for x in start)} at the start and "
        f"{' / '.join(f'{x:.2f}' for x in end)} at the end; the run took {data['seconds_total'] / 60:.1f} min."
        + (" Quick mode: chunks cut short, two questions: a check of the command." if data["quick"] else ""),
        "",
        "## Next-token KL against re-prefill",
        "",
        "| after | " + " | ".join(labels) + " |",
        "| --- | " + " | ".join("---:" for _ in labels) + " |",
    ]
    for sc in SCENARIOS:
        lines.append(f"| {SCENARIO_LABELS[sc]} | " + " | ".join(f"{table[sc][label]:.2e}" for label in labels) + " |")
    kinds_seen = [k for k in KIND_ORDER if any(k in work[sc][label]["forwarded_tokens"]
                                               for sc in SCENARIOS for label in labels)]
    lines += [
        "",
        "## Forwarded tokens by kind",
        "",
        "Tokens the window's forwards computed, by kind (`WindowStats.forward_tokens`), mean per case: the build "
        "(appends, `OrbitPolicy.fit_orders`) and everything after it (the operation and each question's read, conditioned passes "
        "included). Relocated tokens were placed by a shift of KV computed earlier, with no forward of theirs at "
        "that placement. The last column is what the reference re-prefills forwarded for the same questions. A "
        "forward hook on the model saw exactly the window's forwards plus the re-prefills' in every run.",
        "",
        "| after | policy | " + " | ".join(kinds_seen) + " | all | after the build | conditioned passes | "
        "relocated tokens | re-prefill tokens |",
        "| --- | --- | " + " | ".join("---:" for _ in kinds_seen) + " | ---: | ---: | ---: | ---: | ---: |",
    ]
    for sc in SCENARIOS:
        for label in labels:
            w = work[sc][label]
            lines.append(f"| {sc} | {label} | " + " | ".join(_n(w["forwarded_tokens"].get(k, 0)) for k in kinds_seen)
                         + f" | {_n(w['forwarded_tokens_all'])} | {_n(w['forwarded_tokens_after_build'])} | "
                         f"{_n(w['conditioned_passes'])} | {_n(w['relocated_tokens'])} | {_n(w['reference_tokens'])} |")
    lines += ["", "## Per policy", "", *_notes(data), "",
              "Policies: `none` (blind reuse: canonical KV at a shift, no patch); `origin` (the patch fitted at "
              "append from the chunk's in-context pass, reused for any later antecedent); `orbit` (the mean deficit "
              "over every antecedent seen, `OrbitPolicy.fit_orders(window, orders=6)` adding whole-window orders); exact (`rank=None`: a "
              "conditioned pass for each new antecedent, the full deficit stored)."]
    return "\n".join(lines) + "\n"
