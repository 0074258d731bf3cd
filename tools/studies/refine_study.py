"""Would a patch fitted to what the model reads, not to its KV, close the hard cases' gaps? The
window's own patch refined end to end by gradient on next-token KL, at the same bytes, on the hard
cases (`tools.bench.hard_cases`), against the bfloat16 noise floor on the same inputs.

    python -m tools.studies.refine_study [--cases code,table] [--steps 40] [--json FILE] [--page FILE] [--threads N]

The window fits each layer's K and V deficit in closed form, one block at a time. Here its 6%
patch (the same factors, ranks and storage, so the same bytes) is refined by Adam on a
next-token KL through the whole model, with the quantisation in the loop (straight-through: the
forward reads the factors as they will be stored). Probes of two kinds, each refinement scored on the
questions against the float32 re-prefill:

- `rows`: what the window has at append, B's own rows. Context [A, patched B up to a cut], the
  next `--probe` rows of B fed fresh, their logits set against the conditioned pass's, at
  `--cuts` cuts spread over B. It costs a backward pass per probe and step, so it could only run
  in the background; it is here to ask whether it would pay.
- `questions-1`, `questions-2`: an oracle no window has. One half of the case's questions each
  (their own tokens after the patched [A, B], against the re-prefill of [A, B, question]); scored
  on all, the other half read apart, and each question once by the refinement that did not see
  it: does fitting to some questions carry over to others?

Writes the figures and a results page (`REFINE.md` beside `--json`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tools.bench import contexts as cx
from tools.bench import metrics as mt
from tools.studies.compute_study import _window_patch, case_inputs, check_common, run_study
from tools.bench.fits import method_patched
from tools.bench.hard_cases import CASES, HardCase
from tools.bench.runs import describe_bf16_path
from agentwin.models.kv import relocate_kv
from kamera_core import patch as kp
from kamera_core.budget import FLOAT_STORAGE
from kamera_core.metrics import kl_divergence

BUDGET = 0.06
GREEDY = 16
STEPS = 40
LR = 2e-3
PROBE = 32
CUTS = 4
COMMAND = "python -m tools.studies.refine_study"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated hard cases")
    parser.add_argument("--budget", type=float, default=BUDGET, help="the patch's share of B's fp16 KV bytes")
    parser.add_argument("--steps", type=int, default=STEPS, help="Adam steps of each refinement")
    parser.add_argument("--lr", type=float, default=LR, help="Adam's learning rate")
    parser.add_argument("--probe", type=int, default=PROBE, help="rows of B fed fresh at each cut")
    parser.add_argument("--cuts", type=int, default=CUTS, help="cuts over B for the rows' probes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    parser.add_argument("--page", metavar="FILE", help="write the results page here (default: REFINE.md beside --json)")


def storage_of(f: kp.Factors) -> tuple[str, int | None]:
    """(storage, int8 rank) that `kp.quantize` takes to hold factors as `f` is held."""
    if f.u.dtype == torch.int8:
        return ("int8", None) if f.u4 is None else ("mixed", int(f.u.shape[1]))
    for name, dtype in FLOAT_STORAGE.items():
        if f.u.dtype == dtype:
            return name, None
    raise ValueError(f"no storage holds {f.u.dtype} factors")


@dataclass
class Probe:
    """Rows fed fresh after the context [A, patched B up to `cut`] (B's row count: all of B),
    with the log-probabilities the model's own forward gives them after the exact context."""

    ids: torch.Tensor
    positions: torch.Tensor
    cut: int
    target: torch.Tensor


def full_logprobs(model: Any, chunk: cx.Chunk) -> torch.Tensor:
    """Every row's next-token log-probabilities from the model's single forward of `chunk`."""
    with torch.no_grad():
        out = model(input_ids=chunk.ids[None], position_ids=cx.position_ids(chunk.positions))
    return torch.log_softmax(out.logits[0].float(), -1)


def row_probes(ctx: cx.Context, rows: int, cuts: int) -> list[Probe]:
    """`cuts` probes of B's own rows: at cut c, rows c..c+rows of B after [A, patched B[:c]],
    against the conditioned pass (the forward of [A, B] the window runs at append anyway)."""
    lo, hi = ctx.bounds[1]
    n = hi - lo
    if not 0 < rows < n:
        raise ValueError(f"a probe of {rows} rows does not fit in B's {n} tokens")
    if cuts < 1:
        raise ValueError("at least one cut")
    whole = cx.join_chunks(ctx.model, ctx.chunks)
    target = full_logprobs(ctx.model, whole)
    last = n - rows
    at = sorted({round(last - i * last / cuts) for i in range(cuts)} - {0}) or [last]
    return [Probe(whole.ids[lo + c: lo + c + rows], whole.positions[..., lo + c: lo + c + rows], c,
                  target[lo + c: lo + c + rows]) for c in at]


def question_probes(ctx: cx.Context, indices: Sequence[int]) -> list[Probe]:
    """The questions' own tokens after [A, patched B], against the re-prefill of [A, B, question]."""
    n = ctx.bounds[1][1] - ctx.bounds[1][0]
    out = []
    for i in indices:
        q = ctx.queries[i]
        whole = cx.join_chunks(ctx.model, [*ctx.chunks, cx.text_chunk(q)])
        out.append(Probe(q, ctx.query_pos[i], n, full_logprobs(ctx.model, whole)[-q.shape[0]:]))
    return out


class Refiner:
    """The patch's factors as trainable float tensors; the forward reads them quantised to the
    patch's own storage (straight-through), so what is refined is what would be stored."""

    def __init__(self, patch: kp.ChunkPatch):
        self.method = patch.method
        self.slots: list[list[tuple[torch.Tensor, torch.Tensor, str, int | None] | None]] = []
        for lp in patch.layers:
            row = []
            for f in (lp.k, lp.v):
                if f is None:
                    row.append(None)
                    continue
                u, vt = (t.clone().requires_grad_(True) for t in f.factors(torch.float32))
                row.append((u, vt, *storage_of(f)))
            self.slots.append(row)

    def parameters(self) -> list[torch.Tensor]:
        return [t for row in self.slots for s in row if s is not None for t in s[:2]]

    @staticmethod
    def _stored(s: tuple) -> kp.Factors:
        u, vt, storage, int8_rank = s
        return kp.quantize(kp.Factors(u.detach(), vt.detach()), storage, int8_rank)

    def local(self, canonical: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Canonical KV plus the stored-form patch, differentiable in the float factors."""
        out = []
        for pair, row in zip(canonical, self.slots):
            xs = []
            for x, s in zip(pair, row):
                if s is None:
                    xs.append(x)
                    continue
                u, vt = s[0], s[1]
                qu, qvt = self._stored(s).factors(torch.float32)
                u, vt = u + (qu - u).detach(), vt + (qvt - vt).detach()
                xs.append(x + (u @ vt.reshape(vt.shape[0], -1)).reshape(x.shape).to(x.dtype))
            out.append(tuple(xs))
        return out

    def patch(self) -> kp.ChunkPatch:
        return kp.ChunkPatch(tuple(kp.LayerPatch(*(None if s is None else self._stored(s) for s in row))
                                   for row in self.slots), self.method)


def probe_loss(ctx: cx.Context, local: Sequence[tuple[torch.Tensor, torch.Tensor]], probes: Sequence[Probe]) -> torch.Tensor:
    """Mean over probes and their rows of KL(model's forward after the exact context ‖ after A and
    the patched B)."""
    lo = ctx.bounds[1][0]
    a = [(k[:lo], v[:lo]) for k, v in ctx.full_kv]
    b = relocate_kv(local, ctx.specs, ctx.layout, ctx.shifts[1])
    total = torch.zeros(())
    for p in probes:
        kv = [(torch.cat([ka, kb[:p.cut]]), torch.cat([va, vb[:p.cut]])) for (ka, va), (kb, vb) in zip(a, b)]
        cache = cx.batched_cache([kv], ctx.model.config, ctx.layout)
        logits = ctx.model(input_ids=p.ids[None], position_ids=cx.position_ids(p.positions), cache=cache).logits[0]
        got = torch.log_softmax(logits.float(), -1)
        total = total + (p.target.exp() * (p.target - got)).sum(-1).mean()
    return total / len(probes)


def refine(ctx: cx.Context, patch: kp.ChunkPatch, probes: Sequence[Probe], steps: int, lr: float,
           log: Callable[[str], None] = print) -> tuple[kp.ChunkPatch, list[float]]:
    """The patch refined by `steps` Adam steps on `probe_loss`, in its own storage (same bytes),
    and the loss before each step and after the last (the stored form's)."""
    if steps < 0:
        raise ValueError(f"steps must be ≥ 0, got {steps}")
    weights = list(ctx.model.parameters())
    trainable = [p.requires_grad for p in weights]
    r = Refiner(patch)
    opt = torch.optim.Adam(r.parameters(), lr=lr)
    curve = []
    try:
        for p in weights:  # only the factors learn; the model is handed back as it came
            p.requires_grad_(False)
        for step in range(steps):
            opt.zero_grad()
            loss = probe_loss(ctx, r.local(ctx.canonical[1]), probes)
            loss.backward()
            opt.step()
            curve.append(float(loss.detach()))
            if steps >= 4 and (step + 1) % (steps // 4) == 0:
                log(f"    step {step + 1}/{steps}: probe KL {curve[-1]:.2e}")
    finally:
        for p, flag in zip(weights, trainable):
            p.requires_grad_(flag)
    out = r.patch()
    if out.nbytes != patch.nbytes:
        raise AssertionError(f"refined patch holds {out.nbytes} bytes, the window's {patch.nbytes}")
    with torch.no_grad():
        curve.append(float(probe_loss(ctx, kp.apply_patch(ctx.canonical[1], out), probes)))
    return out, curve


def held_out(rows: Sequence[dict], halves: Sequence[Sequence[int]], questions: int) -> list[float | None]:
    """Marks each `refined-questions-k` row with the questions it was trained on (`halves[k-1]`)
    and its mean KL over the others (`held_out_kl`; None where it saw them all); returns, per
    question, its KL under the question refinement that did not see it (None if every one did)."""
    seen = {}
    for row in rows:
        name = row["method"].removeprefix("refined-")
        if name.startswith("questions-"):
            seen[row["method"]] = trained = list(halves[int(name.split("-")[1]) - 1])
            held = [i for i in range(questions) if i not in trained]
            row["trained_on"] = trained
            row["held_out_kl"] = statistics.fmean(row["kls"][i] for i in held) if held else None
    return [next((r["kls"][i] for r in rows if r["method"] in seen and i not in seen[r["method"]]), None)
            for i in range(questions)]


def measure_case(km: Any, model: Any, bf16: Any, case: HardCase, args: argparse.Namespace,
                 log: Callable[[str], None] = print) -> dict:
    """The window's patch, refined on B's rows and on each half of the questions, scored on the questions."""
    t0 = time.perf_counter()
    window, patch, _ = _window_patch(km, case, args.budget)
    chunks, queries = case_inputs(window, case)
    ctx = cx.build_context(model, chunks, queries, greedy=GREEDY)
    low = cx.build_context(bf16, chunks, queries, greedy=GREEDY)
    floor_kls = [kl_divergence(ref, lg.float()) for ref, lg in zip(ctx.reference, low.reference)]
    first = list(range((len(queries) + 1) // 2))
    halves = [first, [i for i in range(len(queries)) if i not in first]] if len(queries) > 1 else [first]
    sets = {"rows": row_probes(ctx, min(args.probe, ctx.reused_tokens() - 1), args.cuts)}
    for k, half in enumerate(halves, 1):
        sets[f"questions-{k}"] = question_probes(ctx, half)
    results, curves = [method_patched(ctx, "window", "", [patch])], {}
    for name, probes in sets.items():
        with torch.no_grad():
            before = float(probe_loss(ctx, kp.apply_patch(ctx.canonical[1], patch), probes))
        log(f"  refining on {name} ({len(probes)} probe(s), {args.steps} steps)")
        t1 = time.perf_counter()
        refined, curve = refine(ctx, patch, probes, args.steps, args.lr, log)
        curves[name] = {"loss": curve, "before": before, "seconds": time.perf_counter() - t1}
        results.append(method_patched(ctx, f"refined-{name}", "", [refined]))
    rows = mt.score_many(ctx, results, greedy=GREEDY)
    for row in rows:
        row.pop("argmax", None)
    unseen = held_out(rows, halves, len(queries))
    out = {"case": case.name, "b_tokens": ctx.reused_tokens(), "questions": len(queries),
           "noise_floor": statistics.fmean(floor_kls), "floor_kls": floor_kls,
           "held_out_kl": statistics.fmean(unseen) if unseen and None not in unseen else None,
           "patch_bytes_frac": patch.nbytes / ctx.reused_kv_bytes(), "rows": rows, "probes": curves,
           "seconds": time.perf_counter() - t0}
    log(f"{case.name}: floor {out['noise_floor']:.2e}; " + ", ".join(f"{r['method']} {r['kl']:.2e}" for r in rows)
        + f" ({out['seconds']:.0f} s)")
    return out


def render(data: dict) -> str:
    """The results page, from the JSON as written."""
    lines = ["# Refining the patch end to end: the hard cases\n",
             f"Written by `{data['command']}` ({data['threads']} thread(s), load average "
             f"{data['loadavg_start']} → {data['loadavg_end']}; bf16 path: {describe_bf16_path(data['bf16_path'])}).\n",
             f"The window's default patch within {data['budget']:.0%} of B's fp16 KV bytes, refined by "
             f"{data['steps']} Adam steps (learning rate {data['lr']:g}) on next-token KL through the whole model, "
             "in its own storage (same ranks, same bytes; the forward reads the stored form). `refined-rows`: "
             f"probes of B's own rows ({data['probe']} rows at {data['cuts']} cuts) against the conditioned "
             "pass, what the window has at append. `refined-questions-1` and `-2`: an oracle, one half of "
             "the questions each (the first half, then the rest). Every row is scored on all the questions "
             "against the float32 re-prefill; a question refinement's `held-out KL` reads only the other "
             "half. `probe KL` is the refinement's own loss before and after (stored form).\n"]
    lines.append("| case | method | probe KL before → after | KL | KL / floor | held-out KL | top-1 | greedy-16 "
                 "| seconds |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in data["cases"]:
        floor = case["noise_floor"]
        for r in case["rows"]:
            probe = case["probes"].get(r["method"].removeprefix("refined-"))
            probe_cell = f"{probe['before']:.2e} → {probe['loss'][-1]:.2e}" if probe else ""
            held = r.get("held_out_kl")
            lines.append(f"| {case['case']} | {r['method']} | {probe_cell} | {r['kl']:.2e} | {r['kl'] / floor:.2f} | "
                         + ("–" if held is None else f"{held:.2e}") + f" | {r['top1']:.0%} | {r['greedy_same']:.0%} | "
                         + (f"{probe['seconds']:.0f}" if probe else "") + " |")
    lines.append("")
    lines.append("## Every question, as a multiple of its case's floor\n")
    lines.append("`questions held out`: each question read after the question refinement that did not see it. "
                 "The floor is the bf16 re-prefill's mean KL against float32 over all the case's questions.\n")
    lines.append("| case | floor | window | refined-rows | questions held out |")
    lines.append("| --- | --- | --- | --- | --- |")
    for case in data["cases"]:
        floor = case["noise_floor"]
        kl = {r["method"]: r["kl"] for r in case["rows"]}
        held = case["held_out_kl"]
        lines.append(f"| {case['case']} | {floor:.2e} | {kl['window'] / floor:.2f} | {kl['refined-rows'] / floor:.2f} | "
                     + ("–" if held is None else f"{held / floor:.2f}") + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    names = check_common(parser, args)
    for name in ("steps", "probe", "cuts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    return run_study(args, names, COMMAND, add_arguments,
                     lambda km, model, bf16, case: measure_case(km, model, bf16, case, args),
                     render, "REFINE.md", steps=args.steps, lr=args.lr, probe=args.probe, cuts=args.cuts)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
