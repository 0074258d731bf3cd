"""The results page of `agentwin bench sessions` (docs/results/SESSIONS.md), written from the
benchmark's JSON figures, one section per model."""

from __future__ import annotations

from typing import Any, Sequence

from tools.bench.session_bench import GREEDY_POINTS, KL_OVER_FLOOR, STRATEGIES, TOKENS_TARGET, WALL_TARGET

WHAT = {
    "prefix": "prefix caching: radix tree of every earlier sequence (window, query, reply), token granular",
    "default": "`Window()`: exact; in-context KV by placement, each token computed once per prefix",
    "survive": "survivors keep their KV, moved by RoPE re-rotation (StreamingLLM-style; the head is the sink)",
    "refresh": "survival repaired: survivors near a change, and those too many evictions old, recomputed",
    "blind": "canonical KV of each chunk alone, moved (no patch)",
    "origin": "canonical KV + the patch fitted at the chunk's first pass (6% of its KV bytes)",
    "origin-akin": "origin patches behind akin neighbours only, else blind (the patch policies' default)",
    "orbit": "canonical KV + the mean deficit over the antecedents seen",
    "fresh": "a pass (and a patch) for every new antecedent",
}


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "" if x is None else fmt.format(x)


def _pct(x: Any) -> str:
    return "" if x is None else f"{x:.0%}"


def render_page(results: Sequence[dict[str, Any]]) -> str:
    """The page for one or more models' results."""
    commands = [r["command"] for r in results]
    lines = ["# Chat sessions: work and fidelity of every context strategy", "",
             "Written by " + " and ".join(f"`{c}`" for c in commands) +
             " (each writes its model's JSON and this page from the JSON files of both; do not edit by hand).", ""]
    seeds = {split: sorted({int(e["seed"]) for r in results for e in r["sessions"].values() if e["split"] == split})
             for split in ("validation", "test")}
    lines += _method(*(", ".join(map(str, seeds[split])) for split in ("validation", "test")))
    for result in results:
        lines += _model_section(result)
    return "\n".join(lines) + "\n"


def _method(val: str, test: str) -> list[str]:
    return [
        "## How it was measured", "",
        "Sessions are generated from seeds (`tools.bench.sessions`), chat-formatted with the model's own template "
        "(`agentwin.chat.Chat`): a pinned system head, then parts appended one at a time under a token budget of the head "
        "plus about four parts, the oldest evicted first, some evicted parts recalled, a question after every step. Five "
        "kinds: `notes` (prose facts; recalls to the old slot), `doc` (handbook pages with a markdown table and a settings "
        "snippet; recalls at the end), `web` (site pages as text; recalls at the end), `video` (segment captions; recalls "
        "to the old slot) and `thread` (a crew's minutes whose entries name people by role and pronoun, introduced in an "
        f"earlier entry; recalls to the old slot). Seeds {val} are the validation split, where prefix caching and every "
        "setting of a swept strategy run and one is chosen (the fewest tokens among those meeting the contract, else the "
        f"lowest KL); seeds {test} are the test split (each model's section names its own), where each strategy runs once at its chosen setting; the figures "
        "below are pooled over the test reads.", "",
        "Every strategy replays the same operations in one process on the same model and threads. At every read: the "
        "next-token distribution after the question (KL against the float32 re-prefill of the same tokens, in nats) and "
        "16 greedy tokens (greedy-16: the whole continuation identical). The reference decodes its 16 tokens step by "
        "step; every other run reads the reference's reply in one teacher-forced pass after the question and takes its "
        "own argmax at each position, which is its own greedy decoding up to its first different token (float rounding "
        "of the wider pass aside), so greedy-16 agreement is measured exactly at a sixteenth of the forwards; those reply "
        "tokens are counted as decoding. The noise floor is the same model loaded in "
        "bfloat16 (loaded so: its RoPE frequencies stay float32) re-prefilling the same tokens. Forwarded tokens count "
        "every token any forward computed: chunks (first passes and recomputes), encodes, conditioned passes, queries and "
        "decoding. The lower bound is each distinct chunk token once plus every query and reply token. Wall times (prefix "
        "caching and the default) are the min over back-to-back replays on each session, summed over sessions; all the "
        "strategies of one session run in one process.", "",
        "| strategy | what it does |", "| --- | --- |",
        *[f"| {s} | {WHAT[s]} |" for s in STRATEGIES], "",
    ]


def _model_section(result: dict[str, Any]) -> list[str]:
    s = result["settings"]
    lines = [f"## {result['model']}", "",
             f"Command: `{result['command']}`. Torch threads: {s['threads']} in each of {s.get('jobs', 1)} worker "
             f"process(es) running sessions side by side. Greedy tokens: {s['greedy']}. "
             f"Reads per session: {s['reads']}. Repeats of the timed strategies: {s['repeats']}. "
             f"Load average at start {result['loadavg_start']}, at end {result['loadavg_end']} (2-CPU machine). "
             f"Total {result['elapsed_s']:.0f} s. {result['test_reads']} test reads over "
             f"{len([1 for e in result['sessions'].values() if e['split'] == 'test'])} test sessions (seeds "
             f"{', '.join(map(str, sorted({e['seed'] for e in result['sessions'].values() if e['split'] == 'test'})))})."
             + (" **Quick run: a check of the command, not a measurement.**" if s.get("quick") else ""), ""]
    lines += _contract(result)
    lines += _frontier(result)
    lines += _per_kind(result)
    lines += _selection(result)
    lines += _sessions(result)
    return lines


def _contract(r: dict[str, Any]) -> list[str]:
    c = r["contract"]
    met = lambda ok: "**met**" if ok else "**missed**"  # noqa: E731
    wall = r.get("default_wall_over_prefix")
    lines = ["### Targets", "",
             f"- Faithful by default: KL over the floor {r['default_kl_over_floor']:.3g} (target ≤ {KL_OVER_FLOOR:g}), "
             f"greedy-16 {_pct(r['default_greedy16'])} against the floor's {_pct(r['floor_greedy16'])} "
             f"(target within {GREEDY_POINTS * 100:.0f} points): {met(c['faithful'])}. The default's largest KL on one "
             f"read is {r['default_kl_max']:.2e}; the floor's mean KL is {r['floor_kl_mean']:.2e}.",
             f"- Never more work than prefix caching: the default's worst session forwards "
             f"{r['worst_session_tokens_over_prefix']:.3f} of prefix caching's tokens (target ≤ 1): "
             f"{met(c['never_more_than_prefix'])}.",
             f"- Cheaper than prefix caching on sessions with revisits ({r['revisit_sessions']} test sessions): the default "
             f"forwards {r['default_tokens_over_prefix']:.3f} of its tokens (target ≤ {TOKENS_TARGET:g}) in "
             f"{_f(wall, '{:.3f}') or 'n/a'} of its wall time (target ≤ {WALL_TARGET:g}): {met(c['cheaper_on_revisits'])}; "
             f"the lower bound is {1 / r['default_tokens_over_lower_bound'] * r['default_tokens_over_prefix']:.2f} of prefix "
             "caching's tokens.", ""]
    cheaper = r.get("at_floor_cheaper", {})
    if cheaper:
        best = min(cheaper.items(), key=lambda kv: kv[1]["tokens_over_prefix"])
        lines += [f"At the floor and cheaper than prefix caching on the test sessions: " +
                  ", ".join(f"`{f.get('setting', name)}` ({f['tokens_over_prefix']:.2f} of its tokens, KL "
                            f"{f['kl_over_floor']:.2f}× the floor)" for name, f in sorted(cheaper.items())) +
                  f". The cheapest, `{best[1].get('setting', best[0])}`, is "
                  f"{'the default' if best[0] == 'default' else 'not the default: see the text below the frontier'}.", ""]
    else:
        lines += ["No approximate strategy reached the floor on the test sessions for fewer tokens than prefix caching.", ""]
    return lines


def _frontier(r: dict[str, Any]) -> list[str]:
    lines = ["### Frontier (test sessions pooled)", "",
             "| strategy | setting | tokens / prefix | tokens / lower bound | KL / floor | KL max | greedy-16 | "
             "worst session tokens / prefix | wall / prefix |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, f in r["frontier"].items():
        if not f:
            continue
        lines.append(f"| {name} | {f.get('setting', '')} | {f['tokens_over_prefix']:.3f} | "
                     f"{f['tokens_over_lower_bound']:.2f} | {f['kl_over_floor']:.3g} | {f['kl_max']:.2e} | "
                     f"{_pct(f['greedy16'])} (floor {_pct(f['floor_greedy16'])}) | "
                     f"{f['worst_session_tokens_over_prefix']:.3f} | {_f(f.get('wall_over_prefix'), '{:.3f}')} |")
    return lines + [""]


def _per_kind(r: dict[str, Any]) -> list[str]:
    lines = ["### Per session kind (test)", "",
             "Tokens over prefix caching's / KL over the floor / greedy-16 (floor's greedy-16 in the header).", ""]
    kinds = list(r["frontier_per_kind"])
    floors = {k: next((f["floor_greedy16"] for f in r["frontier_per_kind"][k].values() if f), None) for k in kinds}
    lines.append("| strategy | " + " | ".join(f"{k} (floor {_pct(floors[k])})" for k in kinds) + " |")
    lines.append("| --- |" + " ---: |" * len(kinds))
    for name in r["frontier"]:
        cells = []
        for k in kinds:
            f = r["frontier_per_kind"][k].get(name) or {}
            cells.append(f"{f['tokens_over_prefix']:.2f} / {f['kl_over_floor']:.3g} / {_pct(f['greedy16'])}" if f else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def _selection(r: dict[str, Any]) -> list[str]:
    if not r.get("selection"):
        return []
    lines = ["### Settings chosen on validation", ""]
    for strategy, sel in r["selection"].items():
        lines.append(f"`{strategy}`: chosen `{sel['chosen']}` ({'meets' if sel['met_on_validation'] else 'no setting meets'} "
                     "the contract on validation).")
        lines += ["", "| setting | tokens / prefix | KL / floor | greedy-16 (floor) |", "| --- | ---: | ---: | ---: |"]
        for name, f in sel["validation"].items():
            lines.append(f"| {name} | {f['tokens_over_prefix']:.3f} | {f['kl_over_floor']:.3g} | "
                         f"{_pct(f['greedy16'])} ({_pct(f['floor_greedy16'])}) |")
        lines.append("")
    return lines


def _sessions(r: dict[str, Any]) -> list[str]:
    lines = ["### Sessions", "",
             "| session | split | reads | budget | prefix tokens | default tokens | lower bound | default KL max | "
             "default wall min / median s | prefix wall min / median s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, e in r["sessions"].items():
        st = e["strategies"]
        d, p = st.get("default", {}), st.get("prefix", {})
        lines.append(f"| {name} | {e['split']} | {e['decisions']} | {e['budget_tokens']} | {p.get('forwarded_tokens', '')} | "
                     f"{d.get('forwarded_tokens', '')} | {e['lower_bound_tokens']} | {_f(d.get('kl_max'), '{:.1e}')} | "
                     f"{_f(d.get('wall_s_min'), '{:.1f}')} / {_f(d.get('wall_s'), '{:.1f}')} | "
                     f"{_f(p.get('wall_s_min'), '{:.1f}')} / {_f(p.get('wall_s'), '{:.1f}')} |")
    return lines + [""]
