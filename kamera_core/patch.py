"""Conditioning patches: low-rank U·Vᵀ approximations of the deficit Δ = KV(B|A) − KV(B|∅).

Everything here is a pure function of tensors, in the chunk-local frame (relocation is separate:
`relocate_keys(k, spec, δ, patch=(u, vt))` applies a key patch fused with the rotation).

Layouts (token-major): MHA/GQA keys and values `[T, H, D]`; MLA c_KV `[T, R]` (the cache's
`.keys` slot) and k_rope `[T, r]` (`.values` slot). A patch of a tensor `[T, *F]` is
`u [T, m]`, `vt [m, *F]`, dense `(u @ vt.reshape(m, -1)).reshape(T, *F)`.

Fitting minimises `|| diag(√w) (Δ − Δ̂) M^½ ||_F` (w: token weights, M: block-diagonal feature
metric, e.g. the per-KV-head second moment of the queries that will read the keys: attention sees
a key only through q·k; the metrics are in `kamera_core.fit_metric`). With X = diag(√w)·Δ and any W with W·Wᵀ = M (the Cholesky factor), the
optimum of rank m is Δ̂ = diag(√w)⁻¹ U_m U_mᵀ X where U_m are the top left singular vectors of X·W (Eckart–Young on
X·W; for a fixed U_m the best right factor is U_mᵀ X, which equals S_m V_mᵀ W⁻¹ when W is
invertible). Computing vt = U_mᵀ X never forms W⁻¹, whose condition number reaches ~1e3–1e4 with
the metric's ridge (`kamera_core.fit_metric.RIDGE`). All fitting runs in float64; factors come back as float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kamera_core import quant
from kamera_core.budget import FLOAT_STORAGE, MIXED, STORAGES, check_rank, check_tensor
from kamera_core.fit_metric import metric_sqrt

Tensor = torch.Tensor

# Token weights are clamped to ROW_FLOOR·max(w): zero or negative weights (tokens nobody attends)
# still get a tiny weight, so u = diag(√w)⁻¹·U stays finite; the row scaling's condition number is
# at most 1/√ROW_FLOOR = 1e3, which bounds the fp32 reconstruction error of floored rows (~1e-4).
ROW_FLOOR = 1e-6


@dataclass(frozen=True, slots=True)
class Factors:
    """U·Vᵀ for one tensor `[T, *F]` of one layer.

    Float form: `u [T, m]` and `vt [m, *F]` of one floating dtype (fp32/fp16/bf16), no scales.
    Int8 form: `u`, `vt` int8 with per-rank float32 scales `u_scale [m]` (column j of u) and
    `vt_scale [m]` (row j of vt); the value is `u[:, j]·u_scale[j]` etc.
    Mixed form (storage "mixed"): the int8 form for the first m8 components (`u [T, m8]`,
    `vt [m8, *F]`) and 4-bit codes for the next m4, packed two components to a byte
    (`u4 [T, ⌈m4/2⌉]`, `vt4 [⌈m4/2⌉, *F]` uint8, `kamera_core.quant`); `u_scale`, `vt_scale` hold
    all m8 + m4 scales, the int8 ones first.
    Components are ordered by decreasing gain when produced by `fit`.
    """

    u: Tensor
    vt: Tensor
    u_scale: Tensor | None = None
    vt_scale: Tensor | None = None
    u4: Tensor | None = None
    vt4: Tensor | None = None

    def __post_init__(self) -> None:
        u, vt = check_tensor(self.u, "Factors.u"), check_tensor(self.vt, "Factors.vt")
        if u.dim() != 2 or vt.dim() < 2 or vt.shape[0] != u.shape[1]:
            raise ValueError(f"Factors.u must be [T, m] and vt [m, *F], got {tuple(u.shape)} and {tuple(vt.shape)}")
        if u.shape[0] == 0 or math.prod(vt.shape[1:]) == 0:
            raise ValueError(f"Factors need tokens and features, got u {tuple(u.shape)}, vt {tuple(vt.shape)}")
        if u.dtype != vt.dtype:
            raise TypeError(f"Factors.u ({u.dtype}) and vt ({vt.dtype}) must share a dtype")
        scales = (self.u_scale, self.vt_scale)
        if (self.u4 is None) != (self.vt4 is None):
            raise ValueError("Factors.u4 and vt4 come together")
        if u.dtype == torch.int8:
            m = u.shape[1] + self._tail_rank_checked()
            for name, s in zip(("u_scale", "vt_scale"), scales):
                if not isinstance(s, Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (m,):
                    got = tuple(s.shape) if isinstance(s, Tensor) else s
                    raise ValueError(f"int8 Factors need float32 {name} of shape [{m}], got {got}")
        elif not u.is_floating_point():
            raise TypeError(f"Factors.u must be floating point or int8, got {u.dtype}")
        elif any(s is not None for s in (*scales, self.u4)):
            raise ValueError("scales are only for int8 Factors (4-bit parts only for mixed ones); float factors carry none")

    def _tail_rank_checked(self) -> int:
        """m4 from the scales' length, after checking the packed tail's shapes against it."""
        if self.u4 is None:
            return 0
        u4, vt4 = check_tensor(self.u4, "Factors.u4"), check_tensor(self.vt4, "Factors.vt4")
        total = self.u_scale.shape[0] if isinstance(self.u_scale, Tensor) and self.u_scale.dim() == 1 else -1
        m4 = total - self.u.shape[1]
        if u4.dtype != torch.uint8 or vt4.dtype != torch.uint8 or m4 < 1:
            raise ValueError(f"Factors.u4 / vt4 must be uint8 with scales for at least one 4-bit component, got "
                             f"{u4.dtype} / {vt4.dtype} and {total} scales for {self.u.shape[1]} int8 components")
        packed = quant.packed_size(m4)
        if tuple(u4.shape) != (self.u.shape[0], packed) or tuple(vt4.shape) != (packed, *self.vt.shape[1:]):
            raise ValueError(f"Factors.u4 must be [{self.u.shape[0]}, {packed}] and vt4 [{packed}, "
                             f"{', '.join(map(str, self.vt.shape[1:]))}] for {m4} 4-bit components, got "
                             f"{tuple(u4.shape)} and {tuple(vt4.shape)}")
        return m4

    @property
    def int4_rank(self) -> int:
        """Components held in 4 bits (the mixed form's tail; 0 otherwise)."""
        return 0 if self.u4 is None else int(self.u_scale.shape[0]) - int(self.u.shape[1])

    @property
    def rank(self) -> int:
        return int(self.u.shape[1]) + self.int4_rank

    @property
    def nbytes(self) -> int:
        """Exact bytes of the stored tensors (u, vt and, for int8, both scales and the 4-bit tail)."""
        parts = [t for t in (self.u, self.vt, self.u_scale, self.vt_scale, self.u4, self.vt4) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)

    def factors(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """Dequantised `(u [T, m], vt [m, *F])` in `dtype` (int8 scaling done in ≥ float32)."""
        if self.u_scale is None:
            return self.u.to(dtype), self.vt.to(dtype)
        if self.u4 is None:
            return quant.dequantise(self.u, self.u_scale, 1, dtype), quant.dequantise(self.vt, self.vt_scale, 0, dtype)
        compute, m4 = torch.promote_types(dtype, torch.float32), self.int4_rank
        u = torch.cat([self.u.to(compute), quant.unpack4_values(self.u4, m4, 1, compute)], dim=1)
        vt = torch.cat([self.vt.to(compute), quant.unpack4_values(self.vt4, m4, 0, compute)], dim=0)
        return quant.dequantise(u, self.u_scale, 1, dtype), quant.dequantise(vt, self.vt_scale, 0, dtype)

    def dense(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The patch `u·vt` as a dense `[T, *F]` tensor of `dtype` (a zero tensor at rank 0)."""
        u, vt = self.factors(dtype)
        flat = u @ vt.reshape(self.rank, math.prod(vt.shape[1:]))  # (T, prod(F)); -1 fails at rank 0
        return flat.reshape(u.shape[0], *vt.shape[1:])

    def truncate(self, rank: int) -> Factors:
        """The first `rank` components (copies, so `nbytes` is what is actually held)."""
        r = check_rank(rank)
        if r > self.rank:
            raise ValueError(f"cannot truncate rank {self.rank} factors to rank {r}")
        head = min(r, int(self.u.shape[1]))
        cut = [None if t is None else t[..., :r].clone() for t in (self.u_scale, self.vt_scale)]
        if r <= head:
            return Factors(self.u[:, :r].clone(), self.vt[:r].clone(), *cut)
        tail = r - head
        u4 = quant.pack4(quant.unpack4(self.u4, self.int4_rank, 1)[:, :tail], 1)
        vt4 = quant.pack4(quant.unpack4(self.vt4, self.int4_rank, 0)[:tail], 0)
        return Factors(self.u.clone(), self.vt.clone(), *cut, u4, vt4)

    def first_rows(self, rows: int) -> Factors:
        """The patch of the first `rows` tokens only (views; what a shorter prefix of the chunk sees)."""
        u4 = None if self.u4 is None else self.u4[:rows]
        return Factors(self.u[:rows], self.vt, self.u_scale, self.vt_scale, u4, self.vt4)


@dataclass(frozen=True, slots=True)
class LayerPatch:
    """Patches of one layer's two cache slots: `k` for `.keys` (MHA/GQA keys, MLA c_KV) and `v`
    for `.values` (MHA/GQA values, MLA k_rope). None means no patch for that slot."""

    k: Factors | None
    v: Factors | None

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in (self.k, self.v) if f is not None)


@dataclass(frozen=True, slots=True)
class ChunkPatch:
    """One chunk's conditioning patch, one `LayerPatch` per decoder layer; `method` records how
    it was fitted (e.g. "svd", "query", "query+value", "alloc")."""

    layers: tuple[LayerPatch, ...]
    method: str

    def __post_init__(self) -> None:
        if not isinstance(self.layers, tuple) or not all(isinstance(p, LayerPatch) for p in self.layers):
            raise TypeError("ChunkPatch.layers must be a tuple of LayerPatch")
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"ChunkPatch.method must be a non-empty string, got {self.method!r}")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.layers)

    def ranks(self) -> list[tuple[int, int]]:
        """(k rank, v rank) per layer; 0 where the slot has no patch."""
        return [tuple(0 if f is None else f.rank for f in (p.k, p.v)) for p in self.layers]  # type: ignore[misc]


def _pairs(kv: Sequence[tuple[Tensor, Tensor]], what: str) -> list[tuple[Tensor, Tensor]]:
    out = []
    for i, pair in enumerate(kv):
        try:
            k, v = pair
        except (TypeError, ValueError):
            raise TypeError(f"{what}[{i}] must be a (k, v) pair of tensors") from None
        out.append((check_tensor(k, f"{what}[{i}].k"), check_tensor(v, f"{what}[{i}].v")))
    return out


def _match(a: list, b: list, what_a: str, what_b: str) -> None:
    """Same layer count and the same k and v shapes, else ValueError naming both."""
    if len(a) != len(b):
        raise ValueError(f"{what_a} has {len(a)} layers, {what_b} has {len(b)}")
    for i, (pa, pb) in enumerate(zip(a, b)):
        for slot, x, y in zip("kv", pa, pb):
            if x.shape != y.shape:
                raise ValueError(f"layer {i} {slot}: {what_a} shape {tuple(x.shape)} != {what_b} {tuple(y.shape)}")


def deficit(
    conditioned: Sequence[tuple[Tensor, Tensor]], canonical: Sequence[tuple[Tensor, Tensor]]
) -> list[tuple[Tensor, Tensor]]:
    """Per-layer `(Δk, Δv)` = conditioned − canonical, float32, same shapes as the inputs.

    Both in the chunk-local frame and the same layout. The subtraction runs in float32, or float64
    when an input is float64 (Δ is small next to K, so it is taken before rounding to float32).
    """
    cond, canon = _pairs(conditioned, "conditioned"), _pairs(canonical, "canonical")
    _match(cond, canon, "conditioned", "canonical")

    def sub(a: Tensor, b: Tensor) -> Tensor:
        compute = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        return (a.to(compute) - b.to(compute)).to(torch.float32)

    return [(sub(ka, kb), sub(va, vb)) for (ka, va), (kb, vb) in zip(cond, canon)]


def orbit_deficit(deltas_per_order: Sequence[Sequence[tuple[Tensor, Tensor]]]) -> list[tuple[Tensor, Tensor]]:
    """Mean over orders of one chunk's per-layer `(Δk, Δv)` (float32; summed in float64).

    An order in which the chunk comes first contributes Δ = 0; the caller passes zeros for it.
    Every order must have the same number of layers and the same shapes.
    """
    orders = [_pairs(d, f"deltas_per_order[{j}]") for j, d in enumerate(deltas_per_order)]
    if not orders:
        raise ValueError("orbit_deficit needs at least one order")
    for j, order in enumerate(orders[1:], start=1):
        _match(order, orders[0], f"order {j}", "order 0")
    n = len(orders)
    return [
        tuple((sum(o[i][s].double() for o in orders) / n).float() for s in range(2))  # type: ignore[misc]
        for i in range(len(orders[0]))
    ]


def _weighted(delta: Tensor, metric: Tensor | None, row_weights: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """(X = diag(√w)·Δ `[T, F]`, X·W `[T, F]`, √w `[T]` or None, W⁻¹ `[H, D, D]` or None), float64."""
    delta = check_tensor(delta, "delta")
    if not delta.is_floating_point() or delta.dim() < 2 or delta.numel() == 0:
        raise ValueError(f"delta must be a non-empty floating tensor [T, *F], got {delta.dtype} {tuple(delta.shape)}")
    t = delta.shape[0]
    x = delta.to(torch.float64).reshape(t, -1)  # (T, F)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("delta has non-finite values")  # the SVD would fail or return NaN factors
    sqrt_w = None
    if row_weights is not None:
        w = check_tensor(row_weights, "row_weights").to(device=x.device, dtype=torch.float64)
        if tuple(w.shape) != (t,):
            raise ValueError(f"row_weights must be [T={t}], got shape {tuple(w.shape)}")
        if not bool(torch.isfinite(w).all()) or not bool((w > 0).any()):
            raise ValueError("row_weights must be finite with at least one positive weight")
        sqrt_w = w.clamp_min(ROW_FLOOR * float(w.max())).sqrt()
        x = x * sqrt_w[:, None]
    if metric is None:
        return x, x, sqrt_w, None
    m = check_tensor(metric, "metric").to(device=x.device)
    if m.dim() == 2:
        m = m.unsqueeze(0)
    if m.dim() != 3 or m.shape[1] != m.shape[2] or m.shape[0] * m.shape[1] != x.shape[1]:
        raise ValueError(f"metric must be [H, D, D] with H·D = {x.shape[1]} features, got shape {tuple(metric.shape)}")
    heads, dim = m.shape[0], m.shape[1]
    if delta.dim() == 3 and tuple(delta.shape[1:]) != (heads, dim):
        raise ValueError(f"metric heads {heads}×{dim} do not match delta {tuple(delta.shape)}")
    if not bool(torch.isfinite(m).all()):
        raise ValueError("metric has non-finite values")
    root, root_inv = metric_sqrt(m, heads, dim)
    xw = torch.einsum("thd,hde->the", x.reshape(t, heads, dim), root).reshape(t, -1)  # (T, H·D)
    return x, xw, sqrt_w, root_inv


def _right_vectors(xw: Tensor) -> tuple[Tensor, Tensor]:
    """(σ² `[F]` decreasing, V `[F, F]` right singular vectors of xw as columns) from the
    eigendecomposition of the F×F Gram matrix: one small symmetric eigenproblem per block, cheaper
    than an SVD of the T×F matrix (F ≪ T), and V comes out orthonormal to float64 precision,
    which is what makes the full-rank reconstruction X·V·Vᵀ exact."""
    evals, evecs = torch.linalg.eigh(xw.T @ xw)  # ascending
    return evals.flip(0).clamp_min(0), evecs.flip(1)


def fit(delta: Tensor, rank: int, metric: Tensor | None = None, row_weights: Tensor | None = None) -> Factors:
    """Best rank-`rank` Factors of `delta [T, *F]` for `|| diag(√w) (Δ − Δ̂) M^½ ||_F`.

    metric: None (M = I) or `[H, D, D]` per-head blocks Σ_h for delta `[T, H, D]` (`[1, R, R]` or
        `[R, R]` for a 2-D delta), ridged by `kamera_core.fit_metric.RIDGE`·trace(Σ_h)/D; must be
        positive semi-definite.
    row_weights: `[T]` token weights w (e.g. `attention_mass`), clamped below at ROW_FLOOR·max(w).
    rank: ≥ 0; clamped to min(T, F), which reproduces Δ (to float32 precision).
    Returns float32 Factors on delta's device, components by decreasing singular value; the
    product is Y's best rank-m projection mapped back (Y = diag(√w)·Δ·W, W = I without a metric).
    The first m components of `fit_with_gains`: with V_m Y's top right singular vectors,
    u = diag(√w)⁻¹·Y·V_m and vt = V_mᵀ·W⁻¹ (from the F×F Gram matrix); a chunk with fewer tokens
    than features (T < F) takes Y's top left singular vectors U_m from the smaller T×T Gram matrix
    instead: u = diag(√w)⁻¹·U_m, vt = U_mᵀ·diag(√w)·Δ; the same product, split differently.
    """
    m = check_rank(rank)
    factors = fit_with_gains(delta, metric, row_weights)[0]  # ordered by gain: truncation is the optimum
    return factors.truncate(min(m, factors.rank))


def identity_factors(delta: Tensor) -> Factors:
    """Full-rank Factors of `delta [T, *F]` with no decomposition: `I_T · Δ` when T ≤ F, else
    `Δ · I_F`. The product reproduces Δ exactly in float32 (each entry is one value times 1), and
    it costs nothing to build, so exact patches never run an eigensolver."""
    x = check_tensor(delta, "delta")
    if x.dim() < 2 or x.shape[0] == 0 or math.prod(x.shape[1:]) == 0:
        raise ValueError(f"delta must be [T, *F] with tokens and features, got {tuple(x.shape)}")
    t, f = x.shape[0], math.prod(x.shape[1:])
    flat = x.reshape(t, f).float()
    eye = torch.eye(min(t, f), dtype=torch.float32, device=x.device)
    u, vt = (eye, flat) if t <= f else (flat, eye)
    return Factors(u.contiguous(), vt.reshape(vt.shape[0], *x.shape[1:]).contiguous())


def exact_patch(deltas: Sequence[tuple[Tensor, Tensor]]) -> ChunkPatch:
    """The exact (full-rank, float32) patch of per-layer `(Δk, Δv)`, from `identity_factors`."""
    layers = _pairs(deltas, "deltas")
    return ChunkPatch(tuple(LayerPatch(identity_factors(dk), identity_factors(dv)) for dk, dv in layers), "exact")


def fit_with_gains(delta: Tensor, metric: Tensor | None = None, row_weights: Tensor | None = None
                   ) -> tuple[Factors, Tensor, float]:
    """(full-rank Factors ordered by gain, gains σ² `[min(T, F)]` float64, total weighted energy)
    from one decomposition: `factors.truncate(m)` is the best rank-m fit, and adding component i
    lowers the weighted squared error by exactly σ_i²."""
    x, xw, sqrt_w, w_inv = _weighted(delta, metric, row_weights)
    t, f = x.shape
    if t < f:
        # Fewer tokens than features: the T×T Gram matrix of Y = X·W is the smaller eigenproblem.
        # With its eigenvectors U (orthonormal, all T of them): u = U, vt = Uᵀ·X, so u·vt = U·Uᵀ·X
        # reproduces X, and the first m columns give the best rank-m fit in the weighted norm.
        evals, um = torch.linalg.eigh(xw @ xw.T)
        s2, um = evals.flip(0).clamp_min(0), um.flip(1)
        u, vt = um, um.T @ x  # (T, T), (T, F)
        r = t
    else:
        s2, v = _right_vectors(xw)
        r = min(t, f)
        v = v[:, :r]  # (F, r)
        u = xw @ v  # (T, r)
        vt = v.T  # (r, F)
        if w_inv is not None:
            heads, dim = w_inv.shape[0], w_inv.shape[1]
            vt = torch.einsum("rhd,hde->rhe", vt.reshape(r, heads, dim), w_inv).reshape(r, -1)  # (r, H·D)
    if sqrt_w is not None:
        u = u / sqrt_w[:, None]
    factors = Factors(u.float().contiguous(), vt.float().reshape(r, *delta.shape[1:]).contiguous())
    return factors, s2[:r], float(xw.square().sum())


def gains(delta: Tensor, metric: Tensor | None = None, row_weights: Tensor | None = None) -> tuple[Tensor, float]:
    """(σ² `[min(T, F)]` float64 decreasing, total weighted energy `||diag(√w) Δ M^½||²_F`).

    Same weighting as `fit`: adding component i lowers the weighted squared error by exactly σ_i²,
    so the error at rank m is `total − σ²[:m].sum()`.
    """
    _, xw, _, _ = _weighted(delta, metric, row_weights)
    s2 = torch.linalg.eigvalsh(xw @ xw.T if xw.shape[0] < xw.shape[1] else xw.T @ xw).flip(0).clamp_min(0)
    return s2[: min(xw.shape)], float(xw.square().sum())


def quantize(f: Factors, storage: str, int8_rank: int | None = None) -> Factors:
    """Factors in a storage form: "fp32" | "fp16" | "bf16" (cast), "int8" (per-rank symmetric:
    column j of u scaled by max|u[:, j]|/127, row j of vt by max|vt[j]|/127, round to nearest;
    scales float32) or "mixed" (the first `int8_rank` components so, the rest in 4 bits with
    scales max/7, packed; `int8_rank` None: all in int8). Int input is dequantised first.
    fp16 overflow raises ValueError."""
    if not isinstance(f, Factors):
        raise TypeError(f"quantize expects Factors, got {type(f).__name__}")
    if storage in FLOAT_STORAGE:
        u, vt = f.factors(FLOAT_STORAGE[storage])
        if not (bool(torch.isfinite(u).all()) and bool(torch.isfinite(vt).all())):
            raise ValueError(f"factors overflow {storage}; use 'bf16' or 'int8'")
        return Factors(u, vt)
    if storage not in ("int8", MIXED):
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    head = f.rank if storage == "int8" or int8_rank is None else min(check_rank(int8_rank, "int8_rank"), f.rank)
    u, vt = f.factors(torch.float32)
    if head == f.rank:
        (qu, u_scale), (qvt, vt_scale) = quant.quantise(u, 8, 1), quant.quantise(vt, 8, 0)
        return Factors(qu, qvt, u_scale, vt_scale)
    (qu, u_scale), (qvt, vt_scale) = quant.quantise_mixed(u, head, 1), quant.quantise_mixed(vt, head, 0)
    return Factors(qu[:, :head].contiguous(), qvt[:head].contiguous(), u_scale, vt_scale,
                   quant.pack4(qu[:, head:], 1), quant.pack4(qvt[head:], 0))


def build_patch(
    deltas: Sequence[tuple[Tensor, Tensor]],
    ranks: Sequence[tuple[int, int]],
    method: str,
    metrics: Sequence[tuple[Tensor | None, Tensor | None]] | None = None,
    row_weights: Sequence[tuple[Tensor | None, Tensor | None]] | None = None,
    storage: str = "fp16",
) -> ChunkPatch:
    """Fits every layer's k and v deficit at the given `(k rank, v rank)` (0 → no patch) with
    that layer's optional `(k metric, v metric)` and `(k row weights, v row weights)`, and stores
    the factors as `storage`. All sequences are per layer and must have the same length."""
    layers = _pairs(deltas, "deltas")
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    if storage == MIXED:
        raise ValueError("mixed storage is chosen per component by the allocator (truncated_patch with "
                         "int8_ranks); build_patch takes 'int8' or a float storage")
    for name, seq in (("ranks", ranks), ("metrics", metrics), ("row_weights", row_weights)):
        if seq is not None and len(seq) != len(layers):
            raise ValueError(f"{name} has {len(seq)} entries for {len(layers)} layers")

    def one(i: int, s: int) -> Factors | None:
        r = check_rank(ranks[i][s], f"ranks[{i}][{s}]")
        metric = None if metrics is None else metrics[i][s]
        weights = None if row_weights is None else row_weights[i][s]
        return quantize(fit(layers[i][s], r, metric, weights), storage) if r else None

    return ChunkPatch(tuple(LayerPatch(one(i, 0), one(i, 1)) for i in range(len(layers))), method)


def apply_patch(kv: Sequence[tuple[Tensor, Tensor]], patch: ChunkPatch) -> list[tuple[Tensor, Tensor]]:
    """Canonical KV plus the dense patch, per layer, in the chunk-local frame, in kv's dtypes.

    Computed in float32 (float64 for float64 KV) and rounded once. Slots without a patch are
    returned as the same tensors. Relocating afterwards, or `relocate_keys(k, spec, δ,
    patch=f.factors())` for the fused form, places the result.
    """
    layers = _pairs(kv, "kv")
    if not isinstance(patch, ChunkPatch):
        raise TypeError(f"patch must be a ChunkPatch, got {type(patch).__name__}")
    if len(layers) != len(patch.layers):
        raise ValueError(f"kv has {len(layers)} layers, patch {len(patch.layers)}")

    def add(x: Tensor, f: Factors | None, where: str) -> Tensor:
        if f is None:
            return x
        if f.u.shape[0] != x.shape[0] or f.vt.shape[1:] != x.shape[1:]:
            raise ValueError(f"{where}: patch [{f.u.shape[0]}, *{tuple(f.vt.shape[1:])}] does not fit {tuple(x.shape)}")
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        return (x.to(compute) + f.dense(compute).to(x.device)).to(x.dtype)

    return [
        (add(k, lp.k, f"layer {i} k"), add(v, lp.v, f"layer {i} v"))
        for i, ((k, v), lp) in enumerate(zip(layers, patch.layers))
    ]


def truncated_patch(full: Sequence[tuple[Factors, Factors]], ranks: Sequence[tuple[int, int]], method: str,
                    storage: str = "fp16", int8_ranks: Sequence[tuple[int, int]] | None = None) -> ChunkPatch:
    """A patch from full-rank factors ordered by gain (`fit_with_gains`): each layer's K and V
    cut to its `(k rank, v rank)` (0: none) and stored as `storage`; for "mixed", `int8_ranks`
    gives per layer how many of those components stay in int8 (`kamera_core.budget.budget_mixed`)."""
    if len(full) != len(ranks):
        raise ValueError(f"ranks has {len(ranks)} entries for {len(full)} layers")
    if storage == MIXED and (int8_ranks is None or len(int8_ranks) != len(ranks)):
        raise ValueError("mixed storage needs int8_ranks, one (k, v) pair per layer")
    heads = int8_ranks if storage == MIXED else [(None, None)] * len(ranks)

    def cut(f: Factors, r: int, head: int | None) -> Factors | None:
        if not r:
            return None
        r = min(r, f.rank)
        if storage in ("int8", MIXED) and f.u_scale is None:  # quantize writes new tensors: no copy first
            return quantize(Factors(f.u[:, :r], f.vt[:r]), storage, head)
        return quantize(f.truncate(r), storage, head)

    return ChunkPatch(tuple(LayerPatch(cut(fk, rk, hk), cut(fv, rv, hv))
                            for (fk, fv), (rk, rv), (hk, hv) in zip(full, ranks, heads)), method)
