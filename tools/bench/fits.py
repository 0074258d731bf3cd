"""Kamera's side of the evaluation (`tools.bench.contexts` holds contexts,
`tools.bench.baselines` the recompute anchors, `tools.bench.metrics` scoring): the conditioned pass of each reused chunk, its deficit decomposed once per
method (plain SVD, K in the query second-moment metric, the byte-budget allocator, orbit
averages over orders), truncation to any byte budget, and the patched KV of a context.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tools.bench.baselines import Result, placed_kv, with_canonical_build
from tools.bench.contexts import Chunk, Context, first_position, forward_chunk, join_chunks, position_ids
from tools.bench.conditioned import conditioned_pass
from agentwin.models.kv import LayerKV, extract_kv, relocate_kv
from kamera_core import budget as kb, fit_metric as fm, kv_layout, mixed, patch as kp, rope_specs

OUTPUT_METHODS = {f"kamera-{fit}": exponent for fit, exponent in fm.OUTPUT_FITS.items()}
RESIDUAL_METHOD = "kamera-residual"
KAMERA_METHODS = ("kamera-svd", "kamera-query", "kamera-alloc", *OUTPUT_METHODS, RESIDUAL_METHOD, "kamera-orbit")
ALLOC_METHODS = ("kamera-alloc", "kamera-orbit", *OUTPUT_METHODS, RESIDUAL_METHOD)  # the allocator's budgets


@dataclass
class Conditioning:
    """For one reused chunk: its deficit Δ in the context its patch is fitted on, and the query
    statistics of that conditioned pass (per layer)."""

    deltas: list[tuple[torch.Tensor, torch.Tensor]]
    queries: list[torch.Tensor]
    seconds: float
    residual: list[torch.Tensor] | None = None  # per layer ||h||² entering it at each of the chunk's rows


def conditioning(model: Any, prefix: Sequence[Chunk], chunk: Chunk, canonical: Sequence[LayerKV]) -> Conditioning:
    """Conditioned pass of [prefix, chunk] and the chunk's deficit in its chunk-local frame."""
    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    whole = join_chunks(model, [*prefix, chunk])
    start = sum(len(c) for c in prefix)
    dtype = next(model.parameters()).dtype
    mm = {k: (v.to(dtype) if k == "pixel_values" else v) for k, v in whole.mm.items()}
    t0 = time.perf_counter()
    cp = conditioned_pass(model, whole.ids, start, specs, layout, position_ids=position_ids(whole.positions), **mm)
    first = first_position(whole.positions, start)
    local = relocate_kv(cp.chunk_kv(), specs, layout, -first)
    return Conditioning(kp.deficit(local, canonical), cp.queries, time.perf_counter() - t0, cp.residual)


def conditionings(model: Any, chunks: Sequence[Chunk], canonical: Sequence[Sequence[LayerKV]]) -> list[Conditioning]:
    """`conditioning` of chunks[i] after chunks[:i] for every i ≥ 1, from one conditioned pass over
    all of them: by causality a chunk's KV and queries in [c0 … cn] are those of [c0 … ci]. The
    pass's time is split over the chunks by their token counts."""
    from kamera_core import relocate_keys

    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    whole = join_chunks(model, chunks)
    start = len(chunks[0])
    dtype = next(model.parameters()).dtype
    mm = {k: (v.to(dtype) if k == "pixel_values" else v) for k, v in whole.mm.items()}
    t0 = time.perf_counter()
    cp = conditioned_pass(model, whole.ids, start, specs, layout, position_ids=position_ids(whole.positions), **mm)
    seconds = time.perf_counter() - t0
    base = first_position(whole.positions, start)  # cp.queries are rotated back by this
    out, lo = [], start
    for i in range(1, len(chunks)):
        hi = lo + len(chunks[i])
        first = first_position(whole.positions, lo)
        local = relocate_kv([(k[lo:hi], v[lo:hi]) for k, v in cp.kv], specs, layout, -first)
        queries = [q if layout.family == "mla" else
                   relocate_keys(q[lo - start:hi - start], spec, base - first, backend="torch")
                   for q, spec in zip(cp.queries, specs)]
        out.append(Conditioning(kp.deficit(local, canonical[i]), queries,
                                seconds * (hi - lo) / (whole.ids.shape[0] - start),
                                [r[lo - start:hi - start] for r in cp.residual]))
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
    metrics: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None  # each block's fit metric


def patch_fits(cond: Conditioning | Sequence, method: str, num_kv_heads: int | None = None,
               values: Sequence[torch.Tensor] | None = None,
               value_metrics: Sequence[torch.Tensor] | None = None) -> PatchFits:
    """Decompose a chunk's deficit (a Conditioning, or plain per-layer deltas for orbit patches)
    for `method`: kamera-svd / kamera-alloc / kamera-orbit plain, kamera-query with K in the
    query second-moment metric of the conditioned pass, kamera-output with K in that metric scaled
    per head by the spread of the chunk's canonical `values` (per layer; `fm.output_metric`) and
    both of a layer's blocks normalised by that layer's values' spread (the allocator then
    compares relative errors of each layer's attention output, as the window's fit="output");
    kamera-output-half and kamera-output-abs by its square root and by 1 (absolute errors;
    `fm.layer_normaliser`, the window's fit="output-half" and "output-abs"); kamera-residual
    with V in the output projection's `value_metrics` (per layer, `fm.projection_metric`), the
    spread taken in it, and both blocks normalised by Σ ||h||² of the residual stream entering the
    layer over the chunk's rows (the window's fit="residual", `agentwin.models.residual`)."""
    deltas = cond.deltas if isinstance(cond, Conditioning) else list(cond)
    if method not in KAMERA_METHODS:
        raise ValueError(f"unknown patch method {method!r}; choose one of {KAMERA_METHODS}")
    output = method in OUTPUT_METHODS or method == RESIDUAL_METHOD
    metrics = [(None, None)] * len(deltas)
    if method == "kamera-query" or output:
        if not isinstance(cond, Conditioning) or num_kv_heads is None:
            raise ValueError(f"{method} needs the conditioned pass's queries and num_kv_heads")
        metrics = [(fm.query_second_moment(q, num_kv_heads), None) for q in cond.queries]
    if output and (values is None or len(values) != len(deltas)):
        raise ValueError(f"{method} needs the chunk's canonical values, one tensor per layer")
    if method == RESIDUAL_METHOD:
        if value_metrics is None or len(value_metrics) != len(deltas) or cond.residual is None:
            raise ValueError(f"{method} needs the output projections' metrics, one per layer, and the "
                             f"conditioned pass's residual stream")
        metrics = [(fm.output_metric(mk, v, mv), mv) for (mk, _), v, mv in zip(metrics, values, value_metrics)]
    elif output:
        metrics = [(fm.output_metric(mk, v), None) for (mk, _), v in zip(metrics, values)]
    full, gains, energy = [], [], []
    for layer, ((dk, dv), (mk, mv)) in enumerate(zip(deltas, metrics)):
        fk, gk, ek = kp.fit_with_gains(dk, mk)
        fv, gv, ev = kp.fit_with_gains(dv, mv)
        if method in OUTPUT_METHODS:  # one normaliser per layer: its values' spread
            ek = ev = fm.layer_normaliser(values[layer], OUTPUT_METHODS[method])
        elif method == RESIDUAL_METHOD:  # or the residual stream's size there
            ek = ev = float(cond.residual[layer].sum())
        full.append((fk, fv))
        gains.append((gk, gv))
        energy.append((ek, ev))
    return PatchFits(method, full, gains, energy, [(d[0].numel(), e[0].numel()) for d, e in deltas],
                     int(deltas[0][0].shape[0]), metrics)


def patch_at(fits: PatchFits, budget_bytes: int, storage: str = "fp16") -> kp.ChunkPatch:
    """The patch of `fits` within `budget_bytes`: the largest uniform rank for K and V in every
    layer (kamera-svd, kamera-query), or ranks spread over layers and K/V by the greedy allocator
    on each block's gains normalised by its deficit energy (kamera-alloc, kamera-orbit) or by
    its layer's values' spread (kamera-output). Storage "mixed" (allocator methods only): the
    allocator also chooses which components stay int8 (`kamera_core.mixed.mixed_patch`)."""
    alloc = fits.method in ALLOC_METHODS
    gains = [((gk, ek), (gv, ev)) for (gk, gv), (ek, ev) in zip(fits.gains, fits.energy)] if alloc else None
    if storage == kb.MIXED:
        if not alloc:
            raise ValueError(f"mixed storage needs an allocator method ({ALLOC_METHODS}), got {fits.method}")
        return mixed.mixed_patch(fits.full, gains, fits.metrics, budget_bytes, fits.method)
    ranks = kb.budget_ranks(fits.tokens, fits.features, budget_bytes, storage, gains)
    return kp.truncated_patch(fits.full, ranks, fits.method, storage)


def fit_patch(cond: Conditioning | Sequence, method: str, budget_bytes: int, storage: str = "fp16",
              num_kv_heads: int | None = None, values: Sequence[torch.Tensor] | None = None,
              value_metrics: Sequence[torch.Tensor] | None = None) -> kp.ChunkPatch:
    """A patch of at most `budget_bytes` for one chunk's deficit (see `patch_fits`, `patch_at`)."""
    return patch_at(patch_fits(cond, method, num_kv_heads, values, value_metrics), budget_bytes, storage)


@dataclass
class SparseRows:
    """The token-sparse baseline's stored correction for one chunk: the exact deficit rows of the
    (layer, token) pairs with the largest deficit norm, fp16, with an int32 index each."""

    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer (token index, ΔK rows, ΔV rows)

    @property
    def nbytes(self) -> int:
        return sum(i.numel() * 4 + dk.numel() * 2 + dv.numel() * 2 for i, dk, dv in self.rows)

    def apply(self, kv: Sequence[LayerKV]) -> list[LayerKV]:
        out = []
        for (k, v), (idx, dk, dv) in zip(kv, self.rows):
            k, v = k.clone(), v.clone()
            k[idx] = (k[idx].float() + dk.float()).to(k.dtype)
            v[idx] = (v[idx].float() + dv.float()).to(v.dtype)
            out.append((k, v))
        return out


def sparse_rows(deltas: Sequence[tuple[torch.Tensor, torch.Tensor]], budget_bytes: int) -> SparseRows:
    """Byte-matched token-sparse correction: rank every (layer, token) by ‖ΔK_row‖² + ‖ΔV_row‖²
    and keep the exact deficit of the top rows while they fit in `budget_bytes`."""
    norms, sizes = [], []
    for dk, dv in deltas:
        t = dk.shape[0]
        norms.append(dk.reshape(t, -1).float().pow(2).sum(1) + dv.reshape(t, -1).float().pow(2).sum(1))
        sizes.append(4 + 2 * (dk[0].numel() + dv[0].numel()))
    flat = torch.cat(norms)
    layer_of = torch.cat([torch.full((n.numel(),), l) for l, n in enumerate(norms)])
    token_of = torch.cat([torch.arange(n.numel()) for n in norms])
    order = torch.argsort(flat, descending=True, stable=True)
    chosen: list[list[int]] = [[] for _ in deltas]
    used = 0
    for j in order.tolist():
        l = int(layer_of[j])
        if used + sizes[l] > budget_bytes:
            break
        used += sizes[l]
        chosen[l].append(int(token_of[j]))
    rows = []
    for (dk, dv), picked in zip(deltas, chosen):
        idx = torch.tensor(sorted(picked), dtype=torch.long)
        rows.append((idx, dk[idx].to(torch.float16), dv[idx].to(torch.float16)))
    return SparseRows(rows)


def method_patched(ctx: Context, name: str, setting: str, patches: Sequence[kp.ChunkPatch | SparseRows | None],
                   build_seconds: float = 0.0, build_token_layers: int = 0) -> Result:
    """Canonical KV plus each reused chunk's correction (a low-rank patch or sparse rows; None:
    none), relocated. The one-time cost given (conditioned passes and fits) is charged together
    with the reused chunks' canonical encode."""
    t0 = time.perf_counter()
    locals_ = [ctx.canonical[0]]
    for i, p in enumerate(patches, start=1):
        if p is None:
            locals_.append(ctx.canonical[i])
        elif isinstance(p, SparseRows):
            locals_.append(p.apply(ctx.canonical[i]))
        else:
            locals_.append(kp.apply_patch(ctx.canonical[i], p))
    kv = placed_kv(ctx, locals_)
    seconds = time.perf_counter() - t0
    res = Result(name, setting, kv, extra_bytes=sum(p.nbytes for p in patches if p is not None),
                 seconds=seconds, build_seconds=build_seconds, build_token_layers=build_token_layers)
    return with_canonical_build(ctx, res)


def orbit_deltas(model: Any, head: Sequence[Chunk], members: Sequence[Chunk], canonical: Sequence[Sequence[LayerKV]],
                 leave_out: Sequence[int] | None = None) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per member, its deficit averaged over every order of `members` read after `head`, except
    the order `leave_out` (a permutation of member indices; the order the patch will be scored
    on, so the orbit patch never sees it)."""
    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    per: list[list] = [[] for _ in members]
    for order in orbit_orders(len(members), leave_out):
        seq = [*head, *[members[i] for i in order]]
        whole = join_chunks(model, seq)
        out = forward_chunk(model, whole)
        kv = extract_kv(out.cache, layout)
        start = sum(len(c) for c in head)
        for i in order:
            n = len(members[i])
            first = first_position(whole.positions, start)
            rows = [(k[start:start + n], v[start:start + n]) for k, v in kv]
            per[i].append(kp.deficit(relocate_kv(rows, specs, layout, -first), canonical[i]))
            start += n
    return [kp.orbit_deficit(d) for d in per]


def orbit_orders(count: int, leave_out: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Every order of `count` members except `leave_out`."""
    skip = None if leave_out is None else tuple(leave_out)
    return [o for o in itertools.permutations(range(count)) if o != skip]
