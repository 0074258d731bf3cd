"""`kamera_core.patch.fit_with_gains` over many blocks at once: a chunk's patch fits one block per
layer and K/V, all of one shape, so the weighting, the Gram matrices and their eigendecompositions
run as one batched call per shape instead of one small call per block (the per-call overhead was
most of a fit's cost outside the eigensolver). Each block's result is the one `fit_with_gains`
gives it, up to float64 rounding; `metric_roots` is the batched metric root both share. Also the
ladders of patches a KL target climbs (`byte_ladder`, `rank_ladder`).

`precision=torch.float32` runs the weighting, the Gram matrices, their eigendecompositions and the
factors' products in float32 (the metric roots stay float64 until they are applied), about twice
as fast on a CPU. It is for patches that are stored rounded anyway: float32's relative rounding
(about 1e-7 of the block's largest gain, squared in the Gram matrix) is far below what int8,
4-bit or 16-bit factors add, while float64 keeps full-rank and float32-stored fits exact.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from kamera_core.budget import check_tensor
from kamera_core.fit_metric import RIDGE, metric_sqrt
from kamera_core.patch import ChunkPatch, Factors, fit_with_gains, truncated_patch

Tensor = torch.Tensor


_ROOTS: OrderedDict[int, tuple[weakref.ref, int, Tensor, Tensor | None]] = OrderedDict()  # id → (tensor, version, W, W⁻¹)
_ROOTS_BYTES = 32 << 20  # the most the kept roots may hold
_LOCK = threading.Lock()


def metric_roots(metrics: Sequence[Tensor], inverse: bool = False) -> tuple[Tensor, Tensor | None]:
    """`(W [B, H, D, D], W⁻¹ or None)` float64 of metrics of one shape (`[H, D, D]` or `[D, D]`):
    `kamera_core.fit_metric.metric_sqrt` of each, its Cholesky route batched; a block the batched
    factorisation cannot take (a head no query reads, a metric that is not positive definite once
    ridged) takes `metric_sqrt`'s own route alone, so every root is the one it would give.

    Recent roots are kept (up to 32 MiB) for the very same tensors, unmodified (identity through a
    weak reference, and torch's version counter): a chunk's fit and its mixed allocation weigh by
    the same metrics, and a model's value metrics are the same for every chunk."""
    mts = [check_tensor(mt, "metric") for mt in metrics]
    got: list = [None] * len(mts)
    with _LOCK:  # windows in several threads share the cache
        for i, mt in enumerate(mts):
            held = _ROOTS.get(id(mt))
            if held is not None and held[0]() is mt and held[1] == mt._version and (held[3] is not None or not inverse):
                got[i] = held
                _ROOTS.move_to_end(id(mt))
    missing = [i for i, g in enumerate(got) if g is None]
    if missing:
        low, inv = _metric_roots([mts[i] for i in missing], inverse)
        with _LOCK:
            for j, i in enumerate(missing):
                got[i] = (weakref.ref(mts[i]), mts[i]._version, low[j], None if inv is None else inv[j])
                _ROOTS[id(mts[i])] = got[i]
            _trim()
    low = torch.stack([g[2] for g in got])
    return low, torch.stack([g[3] for g in got]) if inverse else None


def _trim() -> None:
    """Drop the least recently used roots beyond `_ROOTS_BYTES` (and any whose tensor is gone)."""
    for key in [k for k, held in _ROOTS.items() if held[0]() is None]:
        del _ROOTS[key]
    size = sum(h[2].numel() * 8 * (1 if h[3] is None else 2) for h in _ROOTS.values())
    while _ROOTS and size > _ROOTS_BYTES:
        _, held = _ROOTS.popitem(last=False)
        size -= held[2].numel() * 8 * (1 if held[3] is None else 2)


def _metric_roots(mts: list[Tensor], inverse: bool) -> tuple[Tensor, Tensor | None]:
    sigma = torch.stack([mt if mt.dim() == 3 else mt.unsqueeze(0) for mt in mts]).to(torch.float64)
    if not bool(torch.isfinite(sigma).all()):
        raise ValueError("metric has non-finite values")
    sigma = (sigma + sigma.transpose(-1, -2)) / 2  # symmetrise rounding noise
    dim = sigma.shape[-1]
    scale = sigma.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / dim  # (B, H, 1)
    eye = torch.eye(dim, dtype=torch.float64, device=sigma.device)
    low, info = torch.linalg.cholesky_ex(sigma + (RIDGE * scale.clamp_min(0))[..., None] * eye)
    odd = (info != 0).any(-1) | (scale <= 0).flatten(1).any(-1)  # (B,)
    inv = torch.linalg.solve_triangular(low, eye.expand_as(low), upper=False) if inverse else None
    for b in odd.nonzero().flatten().tolist():
        low[b], alone = metric_sqrt(sigma[b], sigma.shape[1], dim, inverse=inverse)
        if inv is not None:
            inv[b] = alone
    return low, inv


PRECISIONS = (torch.float64, torch.float32)


def precision_for(storage: str) -> torch.dtype:
    """The decomposition's float type for factors stored as `storage`: float32 where they are
    rounded far more coarsely anyway (int8, mixed, fp16, bf16), float64 for float32 factors."""
    return torch.float64 if storage == "fp32" else torch.float32


def fit_with_gains_batch(deltas: Sequence[Tensor], metrics: Sequence[Tensor | None] | None = None,
                         precision: torch.dtype = torch.float64) -> list[tuple[Factors, Tensor, float]]:
    """`[fit_with_gains(d, m) for d, m in zip(deltas, metrics)]`, batched over the blocks that
    share a shape and a metric shape (one block alone, or one of another shape, takes
    `fit_with_gains` itself). `precision`: float64 (that result up to rounding) or float32 (the
    same decomposition in float32, every block batched; see the module's note); gains come back
    float64 either way."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be torch.float64 or torch.float32, got {precision!r}")
    ms = [None] * len(deltas) if metrics is None else list(metrics)
    if len(ms) != len(deltas):
        raise ValueError(f"{len(ms)} metrics for {len(deltas)} deltas")
    groups: dict[tuple, list[int]] = {}
    for i, (d, m) in enumerate(zip(deltas, ms)):
        d = check_tensor(d, "delta")
        key = (tuple(d.shape), d.dtype, d.device, None if m is None else tuple(check_tensor(m, "metric").shape))
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(deltas)
    for (shape, dtype, _, mshape), idx in groups.items():
        if ((len(idx) == 1 and precision == torch.float64) or len(shape) < 2 or 0 in shape or not dtype.is_floating_point
                or (mshape is not None and not _fits(shape, mshape))):
            for i in idx:  # fit_with_gains' own checks and messages
                out[i] = fit_with_gains(deltas[i], ms[i])
            continue
        for i, res in zip(idx, _batch([deltas[i] for i in idx], None if mshape is None else [ms[i] for i in idx],
                                      precision)):
            out[i] = res
    return out


def _fits(shape: tuple, mshape: tuple) -> bool:
    """Whether a metric of `mshape` weighs a delta of `shape` (else `fit_with_gains` says why not)."""
    heads, dim = (1, mshape[0]) if len(mshape) == 2 else mshape[:2] if len(mshape) == 3 else (0, 0)
    features = 1
    for s in shape[1:]:
        features *= s
    return (len(mshape) in (2, 3) and mshape[-1] == mshape[-2] and heads * dim == features
            and (len(shape) != 3 or tuple(shape[1:]) == (heads, dim)))


def _batch(deltas: list[Tensor], metrics: list[Tensor] | None, precision: torch.dtype = torch.float64
           ) -> list[tuple[Factors, Tensor, float]]:
    """`fit_with_gains` of same-shaped deltas (and metrics), every step batched, in `precision`."""
    first = deltas[0]
    b, t = len(deltas), first.shape[0]
    x = torch.stack(deltas).to(precision).reshape(b, t, -1)  # (B, T, F)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("delta has non-finite values")  # as fit_with_gains says it
    f = x.shape[2]
    root = inv = None
    xw = x
    if metrics is not None:
        root, inv = metric_roots(metrics, inverse=t >= f)
        heads, dim = root.shape[1], root.shape[2]
        root = root.to(x.device, precision)
        xw = torch.einsum("bthd,bhde->bthe", x.reshape(b, t, heads, dim), root).reshape(b, t, f)
    if t < f:  # the T×T Gram matrix, as fit_with_gains: u = U, vt = Uᵀ·X
        evals, um = torch.linalg.eigh(xw @ xw.transpose(1, 2))
        s2, u = evals.flip(-1).clamp_min(0), um.flip(-1)
        vt = u.transpose(1, 2) @ x  # (B, T, F)
        r = t
    else:  # the F×F one: u = X·W·V, vt = Vᵀ·W⁻¹
        evals, v = torch.linalg.eigh(xw.transpose(1, 2) @ xw)
        s2, v = evals.flip(-1).clamp_min(0), v.flip(-1)
        r = min(t, f)
        v = v[:, :, :r]
        u, vt = xw @ v, v.transpose(1, 2)  # (B, T, r), (B, r, F)
        if inv is not None:
            heads, dim = inv.shape[1], inv.shape[2]
            vt = torch.einsum("brhd,bhde->brhe", vt.reshape(b, r, heads, dim), inv.to(x.device, precision)).reshape(b, r, f)
    energy = xw.square().sum((1, 2)).tolist()
    uf, vtf = u.float(), vt.float().reshape(b, r, *first.shape[1:])
    gains = s2[:, :r].to(torch.float64)
    return [(Factors(uf[i].contiguous(), vtf[i].contiguous()), gains[i], energy[i]) for i in range(b)]


LADDER_STEP = math.sqrt(2)  # growth of `byte_ladder`'s budgets from one rung to the next


def byte_ladder(fit: Callable[[], Callable[[int], ChunkPatch]], first: int, full: int,
                step: float = LADDER_STEP) -> Iterator[ChunkPatch]:
    """Yields `max_kl`'s rungs for an allocator fit: its patch within ceil(first · step^i) bytes up to `full`,
    skipping a rung no bigger than the one before; `fit()` runs on the first rung asked for. ValueError unless
    step > 1."""
    if not step > 1:
        raise ValueError(f"the ladder's step must be above 1, got {step!r}")
    at, base, last, rung = fit(), max(1, first), -1, 0
    while True:
        budget = min(full, math.ceil(round(base * step ** rung, 6)))  # 100·√2² is 200, not 201
        patch = at(budget)
        if patch.nbytes != last:
            yield patch
        if budget >= full:
            return
        last, rung = patch.nbytes, rung + 1


def rank_ladder(deltas: list, rank: int, storage: str) -> Iterator[ChunkPatch]:
    """Yields `max_kl`'s rungs for the one-rank fits: the plain fit at `rank` in every layer's K and V, doubled per
    rung up to the deficit's full rank; each block is decomposed once, on the first rung asked for."""
    cap = max(min(d.shape[0], d[0].numel()) for pair in deltas for d in pair)
    fits = fit_with_gains_batch([d for pair in deltas for d in pair], None, precision_for(storage))
    full = [(fk, fv) for (fk, _, _), (fv, _, _) in zip(fits[0::2], fits[1::2])]
    r = min(rank, cap)
    while True:
        yield truncated_patch(full, [(r, r)] * len(deltas), "svd", storage)
        if r >= cap:
            return
        r = min(2 * r, cap)
