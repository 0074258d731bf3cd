"""Kamera's side of the evaluation harness (tools/eval_methods.py holds contexts, recompute
anchors and scoring): the conditioned pass of each reused chunk, its deficit decomposed once per
method (plain SVD, K in the query second-moment metric, the byte-budget allocator, orbit
averages over orders), truncation to any byte budget, and the patched KV of a context.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from agentwin.models.conditioned import conditioned_pass
from agentwin.models.kv import LayerKV, extract_kv, relocate_kv
from kamera_core import kv_layout, patch as kp, rope_specs
from tools.eval_methods import (Chunk, Context, Result, _first_position, _forward_chunk, _join, _pos_ids,
                                placed_kv)

KAMERA_METHODS = ("kamera-svd", "kamera-query", "kamera-alloc", "kamera-orbit")


@dataclass
class Conditioning:
    """For one reused chunk: its deficit Δ in the context its patch is fitted on, and the query
    statistics of that conditioned pass (per layer)."""

    deltas: list[tuple[torch.Tensor, torch.Tensor]]
    queries: list[torch.Tensor]
    seconds: float


def conditioning(model: Any, prefix: Sequence[Chunk], chunk: Chunk, canonical: Sequence[LayerKV]) -> Conditioning:
    """Conditioned pass of [prefix, chunk] and the chunk's deficit in its chunk-local frame."""
    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    whole = _join(model, [*prefix, chunk])
    start = sum(len(c) for c in prefix)
    dtype = next(model.parameters()).dtype
    mm = {k: (v.to(dtype) if k == "pixel_values" else v) for k, v in whole.mm.items()}
    t0 = time.perf_counter()
    cp = conditioned_pass(model, whole.ids, start, specs, layout, position_ids=_pos_ids(whole.positions), **mm)
    first = _first_position(whole.positions, start)
    local = relocate_kv(cp.chunk_kv(), specs, layout, -first)
    return Conditioning(kp.deficit(local, canonical), cp.queries, time.perf_counter() - t0)


def conditionings(model: Any, chunks: Sequence[Chunk], canonical: Sequence[Sequence[LayerKV]]) -> list[Conditioning]:
    """`conditioning` of chunks[i] after chunks[:i] for every i ≥ 1, from one conditioned pass over
    all of them: by causality a chunk's KV and queries in [c0 … cn] are those of [c0 … ci]. The
    pass's time is split over the chunks by their token counts."""
    from kamera_core import relocate_keys

    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    whole = _join(model, chunks)
    start = len(chunks[0])
    dtype = next(model.parameters()).dtype
    mm = {k: (v.to(dtype) if k == "pixel_values" else v) for k, v in whole.mm.items()}
    t0 = time.perf_counter()
    cp = conditioned_pass(model, whole.ids, start, specs, layout, position_ids=_pos_ids(whole.positions), **mm)
    seconds = time.perf_counter() - t0
    base = _first_position(whole.positions, start)  # cp.queries are rotated back by this
    out, lo = [], start
    for i in range(1, len(chunks)):
        hi = lo + len(chunks[i])
        first = _first_position(whole.positions, lo)
        local = relocate_kv([(k[lo:hi], v[lo:hi]) for k, v in cp.kv], specs, layout, -first)
        queries = [q if layout.family == "mla" else
                   relocate_keys(q[lo - start:hi - start], spec, base - first, backend="torch")
                   for q, spec in zip(cp.queries, specs)]
        out.append(Conditioning(kp.deficit(local, canonical[i]), queries,
                                seconds * (hi - lo) / (whole.ids.shape[0] - start)))
        lo = hi
    return out


@dataclass
class PatchFits:
    """Full-rank factors of every layer's K and V deficit of one chunk, ordered by gain, with the
    gains and the block energies: any rank or byte budget is then a truncation (one decomposition
    per block serves every budget)."""

    method: str
    full: list[tuple[kp.Factors, kp.Factors]]
    gains: list[tuple[torch.Tensor, torch.Tensor]]
    energy: list[tuple[float, float]]
    features: list[tuple[int, int]]
    tokens: int


def patch_fits(cond: Conditioning | Sequence, method: str, num_kv_heads: int | None = None) -> PatchFits:
    """Decompose a chunk's deficit (a Conditioning, or plain per-layer deltas for orbit patches)
    for `method`: kamera-svd / kamera-alloc / kamera-orbit plain, kamera-query with K in the
    query second-moment metric of the conditioned pass."""
    deltas = cond.deltas if isinstance(cond, Conditioning) else list(cond)
    if method not in KAMERA_METHODS:
        raise ValueError(f"unknown patch method {method!r}; choose one of {KAMERA_METHODS}")
    metrics = [(None, None)] * len(deltas)
    if method == "kamera-query":
        if not isinstance(cond, Conditioning) or num_kv_heads is None:
            raise ValueError("kamera-query needs the conditioned pass's queries and num_kv_heads")
        metrics = [(kp.query_second_moment(q, num_kv_heads), None) for q in cond.queries]
    full, gains, energy = [], [], []
    for (dk, dv), (mk, mv) in zip(deltas, metrics):
        fk, gk, ek = kp.fit_with_gains(dk, mk)
        fv, gv, ev = kp.fit_with_gains(dv, mv)
        full.append((fk, fv))
        gains.append((gk, gv))
        energy.append((ek, ev))
    return PatchFits(method, full, gains, energy, [(d[0].numel(), e[0].numel()) for d, e in deltas],
                     int(deltas[0][0].shape[0]))


def patch_at(fits: PatchFits, budget_bytes: int, storage: str = "fp16") -> kp.ChunkPatch:
    """The patch of `fits` within `budget_bytes`: the largest uniform rank for K and V in every
    layer (kamera-svd, kamera-query), or ranks spread over layers and K/V by the greedy allocator
    on each block's gains normalised by its deficit energy (kamera-alloc, kamera-orbit)."""
    costs = [(kp.bytes_per_rank(fits.tokens, fk, storage), kp.bytes_per_rank(fits.tokens, fv, storage))
             for fk, fv in fits.features]
    if fits.method in ("kamera-alloc", "kamera-orbit"):
        candidates = {}
        for l, ((gk, gv), (ek, ev), (ck, cv)) in enumerate(zip(fits.gains, fits.energy, costs)):
            candidates[(l, 0)] = (gk, max(ek, 1e-30), ck)
            candidates[(l, 1)] = (gv, max(ev, 1e-30), cv)
        alloc = kp.allocate_ranks(candidates, budget_bytes)
        ranks = [(alloc[(l, 0)], alloc[(l, 1)]) for l in range(len(fits.full))]
    else:
        rank = int(budget_bytes // sum(ck + cv for ck, cv in costs))
        ranks = [(rank, rank)] * len(fits.full)

    def one(f: kp.Factors, r: int) -> kp.Factors | None:
        return kp.store(f.truncate(min(r, f.rank)), storage) if r else None

    return kp.ChunkPatch(tuple(kp.LayerPatch(one(fk, rk), one(fv, rv))
                               for (fk, fv), (rk, rv) in zip(fits.full, ranks)), fits.method)


def fit_patch(cond: Conditioning | Sequence, method: str, budget_bytes: int, storage: str = "fp16",
              num_kv_heads: int | None = None) -> kp.ChunkPatch:
    """A patch of at most `budget_bytes` for one chunk's deficit (see `patch_fits`, `patch_at`)."""
    return patch_at(patch_fits(cond, method, num_kv_heads), budget_bytes, storage)


def method_patched(ctx: Context, name: str, setting: str, patches: Sequence[kp.ChunkPatch | None],
                   build_seconds: float = 0.0) -> Result:
    """Canonical KV plus each reused chunk's patch (None: no patch), relocated."""
    t0 = time.perf_counter()
    locals_ = [ctx.canonical[0]] + [ctx.canonical[i] if p is None else kp.apply_patch(ctx.canonical[i], p)
                                    for i, p in enumerate(patches, start=1)]
    kv = placed_kv(ctx, locals_)
    seconds = time.perf_counter() - t0
    return Result(name, setting, kv, extra_bytes=sum(p.nbytes for p in patches if p is not None),
                  seconds=seconds, build_seconds=build_seconds)


def orbit_deltas(model: Any, head: Sequence[Chunk], members: Sequence[Chunk], canonical: Sequence[Sequence[LayerKV]]
                 ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per member, its deficit averaged over every order of `members` read after `head`."""
    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    per: list[list] = [[] for _ in members]
    for order in itertools.permutations(range(len(members))):
        seq = [*head, *[members[i] for i in order]]
        whole = _join(model, seq)
        out = _forward_chunk(model, whole)
        kv = extract_kv(out.cache, layout)
        start = sum(len(c) for c in head)
        for i in order:
            n = len(members[i])
            first = _first_position(whole.positions, start)
            rows = [(k[start:start + n], v[start:start + n]) for k, v in kv]
            per[i].append(kp.deficit(relocate_kv(rows, specs, layout, -first), canonical[i]))
            start += n
    return [kp.orbit_deficit(d) for d in per]
