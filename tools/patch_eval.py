"""Measuring conditioning patches on a real model: next-token KL against a full re-prefill.

One `Case` is [A, B] plus questions. Its conditioned pass gives B's KV given A (moved to B's
chunk-local frame) and the query statistics; B encoded alone gives the canonical KV. Any candidate
KV for B (blind, patched, partly recomputed) is placed after A's exact KV by relocation, each
question runs on that cache, and its next-token distribution is compared with the full forward
of [A, B, question].
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from agentwin.models.conditioned import ConditionedPass, conditioned_pass
from agentwin.models.kv import LayerKV, build_cache, concat_kv, extract_kv, relocate_kv
from kamera_core import KVLayout, RopeSpec, kv_layout, rope_specs
from kamera_core import patch as kp


def kl_div(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of next-token distributions in nats (float64)."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def forward(model: Any, ids: torch.Tensor, start: int, cache: Any = None) -> Any:
    """The model's forward of `ids` `[T]` at positions start.. (1-D RoPE models)."""
    positions = torch.arange(start, start + ids.shape[0])[None]
    with torch.no_grad():
        return model(input_ids=ids[None], position_ids=positions, cache=cache, use_cache=True)


@dataclass
class Prepared:
    """Everything measured once per (model, A, B, questions)."""

    model: Any
    specs: list[RopeSpec]
    layout: KVLayout
    a_len: int
    b_len: int
    questions: list[torch.Tensor]
    a_kv: list[LayerKV]            # A's exact KV at 0.. (from the conditioned pass)
    canonical: list[LayerKV]       # B alone, chunk-local frame
    conditioned: list[LayerKV]     # B given A, moved to the chunk-local frame
    cond: ConditionedPass
    reference: list[torch.Tensor]  # full-forward last logits per question
    alone_s: float                 # time of B's forward alone
    reprefill_s: float             # time of B's forward after A's cache (what reuse avoids)

    def deltas(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return kp.deficit(self.conditioned, self.canonical)

    def kv_bytes(self, itemsize: int = 2) -> int:
        """Bytes of B's KV (keys and values, every layer) at `itemsize` bytes per element."""
        return sum((k.numel() + v.numel()) * itemsize for k, v in self.canonical)

    def _question_logits(self, b_local: Sequence[LayerKV]):
        """(reference, reused) last logits per question with `b_local` placed after A."""
        placed = concat_kv(self.a_kv, relocate_kv(b_local, self.specs, self.layout, self.a_len))
        for q, ref in zip(self.questions, self.reference):
            cache = build_cache(placed, self.model.config, self.layout)
            yield ref, forward(self.model, q, self.a_len + self.b_len, cache).logits[0, -1]

    def kl(self, b_local: Sequence[LayerKV]) -> float:
        """Mean next-token KL over the questions with `b_local` (chunk-local frame) placed after A."""
        kls = [kl_div(ref, logits) for ref, logits in self._question_logits(b_local)]
        return sum(kls) / len(kls)

    def max_logit_diff(self, b_local: Sequence[LayerKV]) -> float:
        return max(float((logits - ref).abs().max()) for ref, logits in self._question_logits(b_local))


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def prepare(model: Any, a_ids: torch.Tensor, b_ids: torch.Tensor, questions: Sequence[torch.Tensor]) -> Prepared:
    """Run the conditioned pass of [A, B], B alone, and the full forwards of [A, B, question]."""
    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    a_len, b_len = int(a_ids.shape[0]), int(b_ids.shape[0])
    ab = torch.cat([a_ids, b_ids])
    cond = conditioned_pass(model, ab, a_len, specs, layout)
    a_kv = [(k[:a_len], v[:a_len]) for k, v in cond.kv]
    conditioned = relocate_kv(cond.chunk_kv(), specs, layout, -a_len)
    forward(model, b_ids, 0)  # warm-up so the timings below compare like with like
    alone_out, alone_s = _timed(lambda: forward(model, b_ids, 0))
    canonical = [(k.clone(), v.clone()) for k, v in extract_kv(alone_out.cache, layout)]
    a_cache = build_cache(a_kv, model.config, layout)
    _, reprefill_s = _timed(lambda: forward(model, b_ids, a_len, a_cache))
    reference = [forward(model, torch.cat([ab, q]), 0).logits[0, -1] for q in questions]
    return Prepared(model, specs, layout, a_len, b_len, list(questions), a_kv, canonical, conditioned,
                    cond, reference, alone_s, reprefill_s)


# ---- candidate KVs for B ------------------------------------------------------------------

def patched(p: Prepared, patch: kp.ChunkPatch) -> list[LayerKV]:
    return kp.apply_patch(p.canonical, patch)


def token_recompute(p: Prepared, frac: float) -> list[LayerKV]:
    """Oracle token selection: per layer the top `frac` of B's tokens by ‖Δ‖ (K and V together)
    take their exact conditioned KV; the rest stay canonical."""
    out = []
    for (ck, cv), (xk, xv), (dk, dv) in zip(p.canonical, p.conditioned, p.deltas()):
        norms = dk.reshape(dk.shape[0], -1).pow(2).sum(1) + dv.reshape(dv.shape[0], -1).pow(2).sum(1)
        count = int(round(frac * norms.shape[0]))
        idx = torch.topk(norms, count).indices
        k, v = ck.clone(), cv.clone()
        k[idx], v[idx] = xk[idx], xv[idx]
        out.append((k, v))
    return out


def metrics_for(p: Prepared, method: str) -> tuple[list, list]:
    """Per layer (k metric, v metric) and (k row weights, v row weights) for a fitting method.

    svd: none. query: K in the query second-moment metric. query+value: also V rows weighted by
    the attention mass B's tokens receive. MLA has no query metric here (plain SVD).
    """
    num_layers = len(p.canonical)
    metrics = [(None, None)] * num_layers
    weights = [(None, None)] * num_layers
    if method in ("query", "query+value", "alloc") and p.layout.family != "mla":
        metrics = [(kp.query_second_moment(q, p.layout.num_kv_heads), None) for q in p.cond.queries]
    if method in ("query+value",):
        weights = [(None, m) for m in p.cond.mass]
    return metrics, weights


def fit_uniform(p: Prepared, method: str, rank: int, storage: str = "fp16") -> kp.ChunkPatch:
    """Rank `rank` for K and V in every layer."""
    metrics, weights = metrics_for(p, method)
    ranks = [(rank, rank)] * len(p.canonical)
    return kp.build_patch(p.deltas(), ranks, method, metrics, weights, storage)


def fit_allocated(p: Prepared, budget_bytes: int, storage: str = "fp16", method: str = "alloc") -> kp.ChunkPatch:
    """Ranks per layer and per K/V chosen greedily under `budget_bytes` on the measured gains.

    Blocks are fitted by plain SVD; each block's gains (σ² of its deficit) are normalised by that
    block's own deficit energy, so the greedy maximises the summed fraction of each block's deficit
    captured per byte. Measured on SmolLM2 at 6% of B's KV bytes (seeds 0, 2, 4; KL): this 0.0020,
    0.0033, 0.0027; the same with K in the query metric and V mass-weighted 0.0018, 0.0078, 0.0029;
    normalising by the canonical tensor's energy instead 0.0025, 0.0055, 0.0043; uniform rank-7
    SVD 0.0020, 0.0030, 0.0040.
    """
    return allocate_patch(p.deltas(), budget_bytes, storage, method)


def allocate_patch(deltas: Sequence[tuple[torch.Tensor, torch.Tensor]], budget_bytes: int,
                   storage: str = "fp16", method: str = "alloc") -> kp.ChunkPatch:
    """`fit_allocated`'s rule on explicit per-layer deficits (also used for orbit patches)."""
    candidates, full = {}, {}
    for layer, (dk, dv) in enumerate(deltas):
        for slot, d in (("k", dk), ("v", dv)):
            factors, g, energy = kp.fit_with_gains(d)  # one decomposition serves both
            full[(layer, slot)] = factors
            candidates[(layer, slot)] = (g, max(energy, 1e-30), kp.bytes_per_rank(d.shape[0], d[0].numel(), storage))
    alloc = kp.allocate_ranks(candidates, budget_bytes)

    def stored(key):
        rank = alloc.get(key, 0)
        return kp.store(full[key].truncate(rank), storage) if rank else None

    return kp.ChunkPatch(tuple(kp.LayerPatch(stored((l, "k")), stored((l, "v"))) for l in range(len(deltas))), method)
