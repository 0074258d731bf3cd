"""Mixed-precision patches (storage "mixed"): the error 8- and 4-bit storage adds to each
component of a fit, in that fit's metric, and the patch the allocator
(`kamera_core.budget.budget_mixed`) builds from it. The packing itself is `kamera_core.quant`,
the factors' form `kamera_core.patch.Factors`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kamera_core import quant
from kamera_core.budget import MIXED, budget_mixed, check_tensor
from kamera_core.patch import ChunkPatch, Factors, _metric_sqrt, truncated_patch

Tensor = torch.Tensor


def quantisation_errors(f: Factors, metric: Tensor | None = None) -> dict[int, Tensor]:
    """Per component j of float `f` (as `fit_with_gains` returns it, in the same metric), the
    weighted squared error `||ũ_j ṽ_jᵀ − u_j v_jᵀ||²` that storing it in 8 and in 4 bits adds:
    {8: `[m]`, 4: `[m]`} float64, in the unit of the fit's gains σ². With W·Wᵀ the ridged metric,
    ||a bᵀ − c dᵀ||² = |a|²|bW|² + |c|²|dW|² − 2(a·c)(bW·dW), exact for each component (the
    components' errors add up to the patch's only as far as they are uncorrelated)."""
    return {bits: e[0] for bits, e in _errors_batch([f], [metric]).items()}


def _errors_batch(fs: Sequence[Factors], metrics: Sequence[Tensor | None]) -> dict[int, Tensor]:
    """`quantisation_errors` of factors of one shape at once (`[B, m]` per bit width): the
    quantisation of `kamera_core.quant` (per-component scales) over a batch, each block's metric
    root taken on its own."""
    us, vts = zip(*(f.factors(torch.float64) for f in fs))
    u, m = torch.stack(us), fs[0].rank  # (B, T, m)
    flat = torch.stack(vts).reshape(len(fs), m, -1)  # (B, m, F)
    roots = None
    if metrics[0] is not None:
        mts = [check_tensor(mt, "metric").to(u.device) for mt in metrics]
        mts = [mt if mt.dim() == 3 else mt.unsqueeze(0) for mt in mts]
        roots = torch.stack([_metric_sqrt(mt, mt.shape[0], mt.shape[1], inverse=False)[0] for mt in mts])

    def weigh(x: Tensor) -> Tensor:  # rows of vt in each block's metric root
        if roots is None:
            return x
        heads, dim = roots.shape[1], roots.shape[2]
        return torch.einsum("bmhd,bhde->bmhe", x.reshape(len(fs), m, heads, dim), roots).reshape(x.shape)

    def stored(x: Tensor, bits: int, dim: int) -> Tensor:  # quant.quantise then dequantise, per block
        levels = quant.LEVELS[bits]
        x32 = x.float()
        scale = x32.abs().amax(dim=dim, keepdim=True) / levels
        codes = (x32 / torch.where(scale > 0, scale, 1.0)).round().clamp(-levels, levels)
        return codes.to(torch.float64) * scale.to(torch.float64)

    vw = weigh(flat)
    out = {}
    for bits in (8, 4):
        qu, qv = stored(u, bits, 1), weigh(stored(flat, bits, 2))
        err = ((qu * qu).sum(1) * (qv * qv).sum(2) + (u * u).sum(1) * (vw * vw).sum(2)
               - 2 * (qu * u).sum(1) * (qv * vw).sum(2))
        out[bits] = err.clamp_min(0)
    return out


def mixed_patch(full: Sequence[tuple[Factors, Factors]], gains: Sequence[tuple[tuple[Tensor, float], tuple[Tensor, float]]],
                metrics: Sequence[tuple[Tensor | None, Tensor | None]], budget_bytes: int, method: str) -> ChunkPatch:
    """A "mixed" patch within `budget_bytes` from full-rank factors ordered by gain: the
    allocator (`kamera_core.budget.budget_mixed`) on each block's `(gains, normaliser)` and the
    errors 8- and 4-bit storage add to its components in its fit's `metrics` (K, V per layer)."""
    if not (len(full) == len(gains) == len(metrics)):
        raise ValueError(f"full ({len(full)}), gains ({len(gains)}) and metrics ({len(metrics)}) differ in layers")
    tokens = int(full[0][0].u.shape[0])
    features = [(fk.vt[0].numel(), fv.vt[0].numel()) for fk, fv in full]
    by_slot = []
    for slot in (0, 1):  # one batch per slot when the layers' blocks share a shape and metric kind
        fs, ms = [pair[slot] for pair in full], [m[slot] for m in metrics]
        same = len({(f.u.shape, f.vt.shape, m is None or tuple(m.shape)) for f, m in zip(fs, ms)}) == 1
        batch = _errors_batch(fs, ms) if same else None
        by_slot.append([(batch[8][i], batch[4][i]) if batch else
                        (lambda e: (e[8], e[4]))(quantisation_errors(f, m)) for i, (f, m) in enumerate(zip(fs, ms))])
    errors = list(zip(*by_slot))
    plan = budget_mixed(tokens, features, budget_bytes, list(gains), errors)
    ranks = [(rk, rv) for (rk, _), (rv, _) in plan]
    heads = [(hk, hv) for (_, hk), (_, hv) in plan]
    return truncated_patch(full, ranks, method, MIXED, heads)
