"""Can compute close what the bytes do not? Selective recompute of a recalled chunk's tokens, from
blind reuse and on top of the window's own patch, on the hard cases (`tools.bench.hard_cases`),
against the bfloat16 noise floor on the same inputs.

    python -m tools.studies.compute_study [--cases code,table] [--json FILE] [--page FILE] [--threads N]

At 6% of B's fp16 KV bytes the window's patch leaves three hard cases above their floors; this
asks whether spending forwarded tokens instead of (or on top of) bytes closes the gap. For each
case, A then B are appended to a `Window` with its default fit within 6% of B's fp16 KV bytes,
and B's tokens, A's and the questions' are read back from it. Every method builds the KV of
[A, B] (A exact: it is the window's front) and is scored by `metrics.score_many` against the
float32 re-prefill of [A, B, question]: mean next-token KL, top-1 and identical greedy-16
continuations.

- `blind`: B's canonical KV moved into place; `window`: the same plus the window's stored patch.
- `cacheblend` (every token at layer 0, then the tokens whose fresh values deviate most, narrowing
  to the ratio; `baselines.method_cacheblend`) and `epic` (B's first k tokens in every layer), at
  the sweeps of the fair evaluation (`workloads.SWEEPS`): the recompute anchors, from blind reuse.
- `window+cacheblend`, `window+epic`: the same recompute on top of the window's patch.
- `window+stored`: on top of the patch, the ceil(r·T) tokens whose conditioned KV the patch
  leaves furthest from it (squared error relative to the block's energy, summed over layers, K
  and V), chosen when the conditioned pass runs (it runs at append anyway) and kept with the
  patch (2 bytes an index, counted in its bytes), recomputed in every layer at reuse.
- `full`: every token of B recomputed (the engine's check: it reproduces the re-prefill).

Compute is `compute_frac`: token-layers forwarded at reuse over a re-prefill of B's. The floor is
the KL (and greedy-16 agreement) of a bfloat16 re-prefill against the float32 one; it depends on
the CPU's bfloat16 path (recorded, as in `tools.studies.guard_study`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

from tools.bench import baselines as bl
from tools.bench import contexts as cx
from tools.bench import metrics as mt
from tools.bench.fits import method_patched
from tools.bench.hard_cases import CASES, HardCase, parse_case_names
from tools.bench.runs import describe_bf16_path
from tools.bench.workloads import SWEEPS
from kamera_core import patch as kp
from kamera_core.metrics import kl_divergence

BUDGET = 0.06
GREEDY = 16
STORED = SWEEPS["cacheblend"]  # shares of B's tokens the stored selection recomputes
INDEX_BYTES = 2
COMMAND = "python -m tools.studies.compute_study"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated hard cases")
    parser.add_argument("--budget", type=float, default=BUDGET, help="the patch's share of B's fp16 KV bytes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    parser.add_argument("--page", metavar="FILE", help="write the results page here (default: COMPUTE.md beside --json)")


def stored_selection(conditioned: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     served: Sequence[tuple[torch.Tensor, torch.Tensor]], count: int) -> torch.Tensor:
    """The `count` token rows (sorted) whose served KV is furthest from the conditioned KV: per
    token the squared error of each layer's K and V rows relative to that block's conditioned
    energy, summed over the blocks."""
    if not conditioned:
        raise ValueError("no layers to select from")
    tokens = int(conditioned[0][0].shape[0])
    if not 0 <= count <= tokens:
        raise ValueError(f"cannot select {count} of {tokens} tokens")
    score = torch.zeros(tokens)
    for pair, got in zip(conditioned, served):
        for x, y in zip(pair, got):
            x, y = x.float().reshape(tokens, -1), y.float().reshape(tokens, -1)
            score += (x - y).pow(2).sum(1) / x.pow(2).sum().clamp_min(1e-30)
    return torch.topk(score, count).indices.sort().values


def _window_patch(km: Any, case: HardCase, budget: float) -> tuple[Any, Any, list[float]]:
    """(window, B's stored patch, the window's own KL per question) for B appended after A,
    evicted and recalled to its slot, with the default fit within `budget` of B's fp16 KV bytes
    (`patch_bytes` counts the KV as the window holds it, in the model's dtype)."""
    from tools.studies.guard_study import _served

    held_itemsize = next(km.model.parameters()).element_size()
    window, b = _served(km, case, rank="budget", patch_bytes=budget * 2 / held_itemsize)
    kls = [kl_divergence(window.reference_logprobs(q), window.next_token_logprobs(q), log_probs=True)
           for q in case.questions]  # reads the stored patch back
    patch = next(iter(window.inspect(b).patches.values()))
    return window, patch, kls


def case_inputs(window: Any, case: HardCase) -> tuple[list[cx.Chunk], list[torch.Tensor]]:
    """A's and B's chunks and the questions' ids exactly as the window tokenized them."""
    ids = window.input_ids()
    n = window.chunk_tokens(window.chunks()[0])
    chunks = [cx.text_chunk(ids[:n]), cx.text_chunk(ids[n:])]
    return chunks, [window.input_ids(q)[ids.numel():] for q in case.questions]


def methods(ctx: cx.Context, patch: kp.ChunkPatch, log: Callable[[str], None] = print) -> list[bl.Result]:
    """Every method's KV of the context (A exact, then B) with its costs."""
    tokens = ctx.reused_tokens()
    conditioned = bl.conditioned_local(ctx, 1)
    patched_b = kp.apply_patch(ctx.canonical[1], patch)
    locals_ = [ctx.canonical[0], patched_b]
    b_layers = ctx.reused_token_layers()  # the conditioned pass the patch was fitted on
    results = [bl.method_blind(ctx), method_patched(ctx, "window", "", [patch], build_token_layers=b_layers)]
    for ratio in SWEEPS["cacheblend"]:
        results.append(bl.method_cacheblend(ctx, ratio))
        hybrid = bl.method_cacheblend(ctx, ratio, locals_)
        results.append(_on_patch(hybrid, "window+cacheblend", patch, b_layers))
    for k in SWEEPS["epic"]:
        results.append(bl.method_epic(ctx, k))
        hybrid = bl.method_prefix(ctx, "window+epic", f"k={k}", lambda c, t, k=k: k, locals_)
        results.append(_on_patch(hybrid, "window+epic", patch, b_layers))
    lo = ctx.bounds[1][0]
    for ratio in STORED:
        count = min(tokens, math.ceil(ratio * tokens))
        chosen = stored_selection(conditioned, patched_b, count)
        hybrid = bl.method_tokens(ctx, "window+stored", f"{ratio:.0%}", chosen + lo, locals_)
        results.append(_on_patch(hybrid, "window+stored", patch, b_layers, count * INDEX_BYTES))
    results.append(bl.method_tokens(ctx, "full", "", torch.arange(lo, ctx.length)))
    log(f"  {len(results)} methods built")
    return results


def _on_patch(res: bl.Result, name: str, patch: kp.ChunkPatch, b_layers: int, index_bytes: int = 0) -> bl.Result:
    """`res` (a recompute on top of the patched KV) charged the patch's bytes and its conditioned pass."""
    res.method = name
    res.extra_bytes += patch.nbytes + index_bytes
    res.build_token_layers += b_layers
    return res


def measure_case(km: Any, model: Any, bf16: Any, case: HardCase, budget: float = BUDGET,
                 log: Callable[[str], None] = print) -> dict:
    """Every method's score on one hard case, with the floor measured on the same inputs."""
    t0 = time.perf_counter()
    window, patch, window_kls = _window_patch(km, case, budget)
    chunks, queries = case_inputs(window, case)
    ctx = cx.build_context(model, chunks, queries, greedy=GREEDY)
    canonical = window.canonical_kv(window.chunks()[1])
    canon_diff = max(float((x.float() - y.float()).abs().max())
                     for a, b in zip(canonical, ctx.canonical[1]) for x, y in zip(a, b))
    low = cx.build_context(bf16, chunks, queries, greedy=GREEDY)
    floor_kls = [kl_divergence(ref, lg.float()) for ref, lg in zip(ctx.reference, low.reference)]
    floor_same = [float(torch.equal(a[:GREEDY], b[:GREEDY])) for a, b in zip(ctx.reference_ids, low.reference_ids)]
    rows = mt.score_many(ctx, methods(ctx, patch, log), greedy=GREEDY)
    for row in rows:
        row.pop("argmax", None)
    out = {"case": case.name, "a_tokens": ctx.bounds[0][1], "b_tokens": ctx.reused_tokens(),
           "questions": len(queries), "noise_floor": statistics.fmean(floor_kls), "floor_kls": floor_kls,
           "noise_floor_greedy16": statistics.fmean(floor_same),
           "window_served_kl": statistics.fmean(window_kls), "canonical_max_diff": canon_diff,
           "patch_bytes_frac": patch.nbytes / ctx.reused_kv_bytes(), "rows": rows,
           "seconds": time.perf_counter() - t0}
    window_row = next(r for r in rows if r["method"] == "window")
    log(f"{case.name}: B {out['b_tokens']} tokens, floor {out['noise_floor']:.2e}, blind {rows[0]['kl']:.2e}, "
        f"window {window_row['kl']:.2e} (as served {out['window_served_kl']:.2e}), "
        f"{out['seconds']:.0f} s")
    return out


def best_within(rows: Sequence[dict], method: str, compute: float) -> dict | None:
    """The lowest-KL row of `method` whose compute at reuse is at most `compute`."""
    fit = [r for r in rows if r["method"] == method and r["compute_frac"] <= compute + 1e-9]
    return min(fit, key=lambda r: r["kl"]) if fit else None


def at_floor(rows: Sequence[dict], method: str, floor: float) -> dict | None:
    """The least-compute row of `method` whose KL is at most `floor`."""
    fit = [r for r in rows if r["method"] == method and r["kl"] <= floor]
    return min(fit, key=lambda r: r["compute_frac"]) if fit else None


CAPS = (0.05, 0.10, 0.25, 0.45, 0.65)
SUMMARY = ("cacheblend", "epic", "window+cacheblend", "window+epic", "window+stored")


def render(data: dict) -> str:
    """The results page, from the JSON as written."""
    lines = ["# Selective recompute against the bytes: the hard cases\n",
             f"Written by `{data['command']}` ({data['threads']} thread(s), load average "
             f"{data['loadavg_start']} → {data['loadavg_end']}; bf16 path: {describe_bf16_path(data['bf16_path'])}).\n",
             "Each row builds the KV of [A, B] one way and reads every question after it; KL is the mean "
             "next-token KL against the float32 re-prefill, greedy-16 the share of questions whose first 16 "
             "greedy tokens are identical. Bytes: stored beyond canonical KV, as a share of B's fp16 KV. "
             "Compute: token-layers forwarded at reuse, as a share of a re-prefill of B. The window's patch "
             f"is its default fit within {data['budget']:.0%} of the bytes.\n"]
    for case in data["cases"]:
        floor = case["noise_floor"]
        lines.append(f"## {case['case']} (A {case['a_tokens']} tokens, B {case['b_tokens']}, "
                     f"{case['questions']} questions)\n")
        lines.append(f"bf16 noise floor: KL {floor:.2e}, greedy-16 {case['noise_floor_greedy16']:.0%}. "
                     f"The window's KL as it serves B: {case['window_served_kl']:.2e}.\n")
        lines.append("| method | setting | bytes | compute | KL | KL / floor | top-1 | greedy-16 |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in case["rows"]:
            lines.append(f"| {r['method']} | {r['setting']} | {r['bytes_frac']:.1%} | {r['compute_frac']:.1%} | "
                         f"{r['kl']:.2e} | {r['kl'] / floor:.2f} | {r['top1']:.0%} | {r['greedy_same']:.0%} |")
        lines.append("")
    lines.append("## Lowest KL within a compute share at reuse, as a multiple of the floor\n")
    lines.append("The last column is the least compute at reuse with which the method reached the floor "
                 "(KL no higher than the bf16 re-prefill's), or – where no setting did.\n")
    lines.append("| case | method | " + " | ".join(f"≤ {c:.0%}" for c in CAPS) + " | compute at the floor |")
    lines.append("| --- | --- | " + " | ".join("---" for _ in CAPS) + " | --- |")
    for case in data["cases"]:
        floor = case["noise_floor"]
        alone = next(r for r in case["rows"] if r["method"] == "window")
        lines.append(f"| {case['case']} | window (no recompute) | " + " | ".join(f"{alone['kl'] / floor:.2f}" for _ in CAPS)
                     + f" | {'0%' if alone['kl'] <= floor else '–'} |")
        for name in SUMMARY:
            cells = []
            for c in CAPS:
                best = best_within(case["rows"], name, c)
                cells.append("–" if best is None else f"{best['kl'] / floor:.2f}")
            least = at_floor(case["rows"], name, floor)
            lines.append(f"| {case['case']} | {name} | " + " | ".join(cells) + " | "
                         + ("–" if least is None else f"{least['compute_frac']:.0%} ({least['setting']})") + " |")
    return "\n".join(lines) + "\n"


def check_common(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The hard-case studies' shared checks (`--cases`, `--budget`, `--threads`): the case names,
    or `parser.error`."""
    names = parse_case_names(parser, args.cases)
    if not 0 < args.budget < 1:
        parser.error(f"--budget is a share of B's fp16 KV bytes, in (0, 1): got {args.budget}")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    return names


def run_study(args: argparse.Namespace, names: Sequence[str], command: str,
              add: Callable[[argparse.ArgumentParser], None], measure: Callable[..., dict],
              render_page: Callable[[dict], str], page_name: str, **settings: Any) -> int:
    """Load SmolLM2 (the window's model, a plain float32 copy, a bfloat16 one), `measure(km,
    model, bf16, case)` each case in order, and write the figures with the run's settings, load
    average and bf16 path, and the page rendered from them."""
    torch.set_num_threads(args.threads)
    from tools.bench.runs import bf16_path, command_of, load_average, write_results
    from agentwin.models.adapter import KameraModel
    from agentwin.models.zoo import load_smollm2

    start = load_average()
    km = KameraModel.from_pretrained("smollm2")
    model = load_smollm2(torch.float32)[0].eval()  # a plain copy: the window's model reads segments
    bf16 = load_smollm2(torch.bfloat16)[0].eval()
    cases = []
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}", flush=True)
        cases.append(measure(km, model, bf16, CASES[name]))
    data = {"command": command_of(command, args, add), "threads": args.threads, "budget": args.budget, **settings,
            "loadavg_start": start, "loadavg_end": load_average(), "bf16_path": bf16_path(), "cases": cases}
    write_results(data, render_page, args.json, args.page, page_name)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    names = check_common(parser, args)
    return run_study(args, names, COMMAND, add_arguments,
                     lambda km, model, bf16, case: measure_case(km, model, bf16, case, args.budget),
                     render, "COMPUTE.md")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
