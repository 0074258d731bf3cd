"""Mixed-precision patches (storage "mixed"): the error 8- and 4-bit storage adds to each
component of a fit, in that fit's metric, and the patch the allocator
(`kamera_core.budget.budget_mixed`) builds from it. The packing itself is `kamera_core.quant`,
the factors' form `kamera_core.patch.Factors`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kamera_core import quant
from kamera_core.budget import MIXED, budget_mixed, check_rank
from kamera_core.fit_batch import metric_roots
from kamera_core.patch import ChunkPatch, Factors, truncated_patch

Tensor = torch.Tensor


def quantisation_errors(f: Factors, metric: Tensor | None = None) -> dict[int, Tensor]:
    """Per component j of float `f` (as `fit_with_gains` returns it, in the same metric), the
    weighted squared error `||ũ_j ṽ_jᵀ − u_j v_jᵀ||²` that storing it in 8 and in 4 bits adds:
    {8: `[m]`, 4: `[m]`} float64, in the unit of the fit's gains σ². With W·Wᵀ the ridged metric,
    ||a bᵀ − c dᵀ||² = |a|²|bW|² + |c|²|dW|² − 2(a·c)(bW·dW), exact for each component (the
    components' errors add up to the patch's only as far as they are uncorrelated)."""
    return {bits: e[0] for bits, e in _errors_batch([f], [metric]).items()}


def _roots(metrics: Sequence[Tensor | None]) -> Tensor | None:
    """Each block's metric root W (`[B, H, D, D]` float64, `kamera_core.fit_batch.metric_roots`),
    or None for unweighted blocks."""
    return None if metrics[0] is None else metric_roots(metrics)[0]


def _errors_batch(fs: Sequence[Factors], metrics: Sequence[Tensor | None], first: int = 0,
                  stop: int | None = None, roots: Tensor | None = None) -> dict[int, Tensor]:
    """`quantisation_errors` of components `first:stop` of factors of one shape at once (`[B, m]`
    per bit width): the quantisation of `kamera_core.quant` (per-component scales, so each
    component's error is its own) over a batch, each block's metric root (`_roots`, or `roots`
    when given) taken on its own."""
    us, vts = zip(*((u[:, first:stop], vt[first:stop]) for u, vt in
                    ((f.u, f.vt) if f.u_scale is None else f.factors() for f in fs)))
    u, m = torch.stack(us).float(), us[0].shape[1]  # (B, T, m)
    flat = torch.stack(vts).float().reshape(len(fs), m, -1)  # (B, m, F)
    if roots is None:
        roots = _roots(metrics)
    if roots is not None:
        roots = roots.to(u.device, torch.float32)

    def weigh(x: Tensor) -> Tensor:  # rows of vt in each block's metric root
        if roots is None:
            return x
        heads, dim = roots.shape[1], roots.shape[2]
        return (x.reshape(len(fs), m, heads, dim).transpose(1, 2) @ roots).transpose(1, 2).reshape(x.shape)

    def stored(x: Tensor, bits: int, dim: int) -> Tensor:  # quant.quantise then dequantise, per block
        levels = quant.LEVELS[bits]
        scale = x.abs().amax(dim=dim, keepdim=True) / levels
        return (x / torch.where(scale > 0, scale, 1.0)).round().clamp(-levels, levels) * scale

    # The error of a component, with du, dv what storing u and (weighted) v moves them by:
    # ||(u + du)(vW + dv)ᵀ − u(vW)ᵀ||² = |u|²|dv|² + |du|²|vW + dv|² + 2(u·du)(dv·(vW + dv)),
    # every term of the size of the error itself, so float32 keeps its precision.
    vw = weigh(flat)
    uu = (u * u).sum(1)
    out = {}
    for bits in (8, 4):
        du, dv = stored(u, bits, 1) - u, weigh(stored(flat, bits, 2) - flat)
        qv = vw + dv
        err = uu * (dv * dv).sum(2) + (du * du).sum(1) * (qv * qv).sum(2) + 2 * (u * du).sum(1) * (dv * qv).sum(2)
        out[bits] = err.double().clamp_min(0)
    return out


FIRST_COMPONENTS = 16  # errors computed up front per block; more only for blocks that use them all


def mixed_patch(full: Sequence[tuple[Factors, Factors]], gains: Sequence[tuple[tuple[Tensor, float], tuple[Tensor, float]]],
                metrics: Sequence[tuple[Tensor | None, Tensor | None]], budget_bytes: int, method: str) -> ChunkPatch:
    """A "mixed" patch within `budget_bytes` from full-rank factors ordered by gain: the
    allocator (`kamera_core.budget.budget_mixed`) on each block's `(gains, normaliser)` and the
    errors 8- and 4-bit storage add to its components in its fit's `metrics` (K, V per layer).

    The errors are computed lazily: for each block's first components (twice the 4-bit ones the
    budget buys a block on average, at least `FIRST_COMPONENTS`), then, for a block the
    allocator filled to what it was shown, for twice as many, until no block is full. The
    allocator only looks at a block's component r once it holds r of them, so the plan is the one
    the errors of every component would give, at a fraction of their cost."""
    if not (len(full) == len(gains) == len(metrics)):
        raise ValueError(f"full ({len(full)}), gains ({len(gains)}) and metrics ({len(metrics)}) differ in layers")
    tokens = int(full[0][0].u.shape[0])
    features = [(fk.vt[0].numel(), fv.vt[0].numel()) for fk, fv in full]
    budget = check_rank(budget_bytes, "budget_bytes")
    lengths = [[len(g) for g, _ in pair] for pair in gains]
    for layer, (pair, ns) in enumerate(zip(full, lengths)):
        if any(f.rank < n for f, n in zip(pair, ns)):
            raise ValueError(f"layer {layer}: factors of ranks {[f.rank for f in pair]} for {ns} gains")
    groups: list[tuple[int, list[int], Tensor | None]] = []  # (slot, layers of one shape, their roots)
    for slot in (0, 1):
        by_shape: dict[tuple, list[int]] = {}
        for layer, pair in enumerate(full):
            m = metrics[layer][slot]
            by_shape.setdefault((pair[slot].u.shape, pair[slot].vt.shape, m is None or tuple(m.shape)), []).append(layer)
        groups += [(slot, layers, _roots([metrics[i][slot] for i in layers])) for layers in by_shape.values()]
    errors = [[(torch.zeros(0, dtype=torch.float64),) * 2] * 2 for _ in full]
    # First look: twice the 4-bit components the budget buys a block on average, at least FIRST_COMPONENTS.
    per_component = sum((tokens + f) / 2 + 8 for pair in features for f in pair)
    first = max(FIRST_COMPONENTS, math.ceil(2 * budget / per_component))
    want = [[min(first, n) for n in ns] for ns in lengths]
    while True:
        for slot, layers, roots in groups:  # extend each block's errors to what it wants, batched
            for have, need in sorted({(len(errors[i][slot][0]), want[i][slot]) for i in layers}):
                if need <= have:
                    continue
                part = [i for i in layers if (len(errors[i][slot][0]), want[i][slot]) == (have, need)]
                rows = [layers.index(i) for i in part]
                batch = _errors_batch([full[i][slot] for i in part], [None] * len(part), have, need,
                                      None if roots is None else roots[rows])
                for b, i in enumerate(part):
                    e8, e4 = errors[i][slot]
                    errors[i][slot] = (torch.cat([e8, batch[8][b]]), torch.cat([e4, batch[4][b]]))
        shown = [tuple((g[: want[layer][s]], norm) for s, (g, norm) in enumerate(pair)) for layer, pair in enumerate(gains)]
        plan = budget_mixed(tokens, features, budget, shown, [tuple(e) for e in errors])
        grow = False
        for layer, pair in enumerate(plan):
            for slot, (rank, _) in enumerate(pair):
                if rank == want[layer][slot] < lengths[layer][slot]:  # full: it might take more
                    want[layer][slot] = min(2 * rank, lengths[layer][slot])
                    grow = True
        if not grow:
            break
    ranks = [(rk, rv) for (rk, _), (rv, _) in plan]
    heads = [(hk, hv) for (_, hk), (_, hv) in plan]
    return truncated_patch(full, ranks, method, MIXED, heads)
