"""The metrics patches are fitted in, and their square roots.

A patch of a chunk's K or V deficit is fitted in a feature metric M (`kamera_core.patch.fit`):
the error it leaves is weighed as tr(E·M·Eᵀ), per KV head. Here are the metrics the fits use and
what each stands for:

- `query_second_moment`: the second moment of the queries that read the keys (attention sees a key
  only through q·k);
- `output_metric`: that, scaled by the spread of the chunk's values, so a key error is weighed as
  the error it causes in the attention output, in the unit of a value error;
- `projection_metric`: a value error where it lands in the residual stream, through the layer's
  output projection;
- `value_spread`, `layer_normaliser`: the per-layer scales the allocator divides gains by;
- `attention_mass`: per key token, the mass attention gives it (row weights);
- `metric_sqrt`: W with W·Wᵀ = M + ridge, the factor every weighted fit multiplies by.

Pure functions of tensors, float64.
"""

from __future__ import annotations

import torch

from kamera_core.budget import check_rank, check_tensor

Tensor = torch.Tensor

# Relative ridge added to each metric block: Σ_h + RIDGE·(trace(Σ_h)/D)·I. It makes W invertible
# (so rank min(T, F) reproduces Δ exactly even where queries never point) while changing the
# weighted objective by at most ~1e-6 of its scale.
RIDGE = 1e-6


def query_second_moment(queries: Tensor, num_kv_heads: int) -> Tensor:
    """Σ `[num_kv_heads, D, D]` float64: mean of q·qᵀ over tokens and over the query heads that
    share each KV head.

    queries: `[Tq, Hq, D]` post-RoPE, already in the chunk-local frame (the caller rotates them).
    Query head h reads KV head h // (Hq // num_kv_heads), as transformers' `repeat_kv` expands.
    """
    q = check_tensor(queries, "queries")
    if q.dim() != 3:
        raise ValueError(f"queries must be [Tq, Hq, D], got shape {tuple(q.shape)}")
    hkv = check_rank(num_kv_heads, "num_kv_heads")
    tq, hq, d = q.shape
    if hkv == 0 or hq % hkv or tq == 0:
        raise ValueError(f"num_kv_heads={hkv} must be positive and divide Hq={hq}, and Tq={tq} must be > 0")
    group = hq // hkv
    grouped = q.to(torch.float64).reshape(tq, hkv, group, d)  # (Tq, Hkv, group, D): h = kv·group + g
    return torch.einsum("tkgd,tkge->kde", grouped, grouped) / (tq * group)


def output_metric(query_metric: Tensor, values: Tensor, value_metric: Tensor | None = None) -> Tensor:
    """`[H, D, D]` float64: a K metric in which a key deficit's energy is, to first order, the
    error it causes in the attention output, in the same unit as the value deficit's energy.

    A key error Δk_j shifts the logit of token j by q·Δk_j/√D, which moves p_j by p_j·δs_j (less the
    mean shift) and the output by about p_j·δs_j·(v_j − v̄); a value error moves it by p_j·Δv_j. So
    per head h, E[(q·Δk)²]/D times the spread of the values, E||v − v̄||², is the key error in value
    units: the queries' second moment Σ_h (`query_second_moment`) scaled by spread_h / D.

    With `value_metric` `[H, Dv, Dv]` (per head the metric the value error is measured in, such as
    `projection_metric`'s, where the output lands in the residual stream) the spread is taken in
    it too (`value_spread`), so K stays in the unit of V's weighted energy.

    query_metric: `[H, D, D]` (one block per KV head); values: the chunk's `[T, H, Dv]` canonical
    values (the spread is taken over its tokens).
    """
    m = check_tensor(query_metric, "query_metric").to(torch.float64)
    v = check_tensor(values, "values").to(device=m.device, dtype=torch.float64)
    if m.dim() != 3 or m.shape[1] != m.shape[2]:
        raise ValueError(f"query_metric must be [H, D, D], got shape {tuple(m.shape)}")
    if v.dim() != 3 or v.shape[1] != m.shape[0] or v.shape[0] == 0:
        raise ValueError(f"values must be [T, H={m.shape[0]}, Dv] with T > 0, got shape {tuple(v.shape)}")
    return m * (value_spread(v, value_metric) / m.shape[-1])[:, None, None]


def value_spread(values: Tensor, metric: Tensor | None = None) -> Tensor:
    """`[H]` float64: per head, the mean over tokens of ||v_j − v̄||² for values `[T, H, Dv]`
    (`output_metric`; summed over heads and tokens, a layer's normaliser in fit="output"), or of
    (v_j − v̄)ᵀ·M_h·(v_j − v̄) with `metric` `[H, Dv, Dv]`."""
    v = check_tensor(values, "values").to(torch.float64)
    if v.dim() != 3 or v.shape[0] == 0:
        raise ValueError(f"values must be [T, H, Dv] with T > 0, got shape {tuple(v.shape)}")
    c = v - v.mean(dim=0)
    if metric is None:
        return c.square().sum(dim=-1).mean(dim=0)
    m = check_tensor(metric, "metric").to(device=v.device, dtype=torch.float64)
    if tuple(m.shape) != (v.shape[1], v.shape[2], v.shape[2]):
        raise ValueError(f"metric must be [H={v.shape[1]}, Dv={v.shape[2]}, Dv], got shape {tuple(m.shape)}")
    return torch.einsum("thd,hde,the->h", c, m, c) / v.shape[0]


def projection_metric(weight: Tensor, num_kv_heads: int, head_dim: int) -> Tensor:
    """`[H, Dv, Dv]` float64: per KV head h, W̄_hᵀ·W̄_h with W̄_h = Σ_g W_g over the query heads g that
    read it, where W_g `[hidden, Dv]` is query head g's block of the output projection `weight`
    `[hidden, Hq·Dv]` (heads in order, as the attention output is flattened; query head g reads KV
    head g // (Hq // H), as transformers' `repeat_kv` expands). A value error Δv of a token lands
    in the residual stream as Σ_g W_g·p_g·Δv through the query heads that read it; where they
    attend to the token alike (and always with one query head per KV head) that is p·W̄_h·Δv, so
    Δvᵀ·M_h·Δv is its energy there to first order. fit="residual" weighs V by it."""
    w = check_tensor(weight, "weight").detach().to(torch.float64)
    hkv, dv = check_rank(num_kv_heads, "num_kv_heads"), check_rank(head_dim, "head_dim")
    if w.dim() != 2 or hkv == 0 or dv == 0 or w.shape[1] % (hkv * dv):
        raise ValueError(f"weight must be [hidden, Hq*Dv] with Hq a multiple of num_kv_heads={hkv} and "
                         f"Dv={dv}, got shape {tuple(w.shape)}")
    summed = w.reshape(w.shape[0], hkv, -1, dv).sum(dim=2).transpose(0, 1)  # (H, hidden, Dv): Σ_g W_g
    return summed.transpose(1, 2) @ summed


# The output fits by the exponent of their per-layer normaliser (`layer_normaliser`): "output"
# compares relative errors of each layer's attention output, "output-abs" absolute ones,
# "output-half" sits between.
OUTPUT_FITS = {"output": 1.0, "output-half": 0.5, "output-abs": 0.0}


def layer_normaliser(values: Tensor, exponent: float) -> float:
    """(T·Σ_h spread_h)^exponent for a layer's canonical values `[T, H, Dv]` (`value_spread`): what
    the allocator divides both of a layer's block gains by in an output fit. Exponent 1 makes the
    gains relative to the layer's output scale, 0 leaves them absolute."""
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not 0 <= exponent <= 1:
        raise ValueError(f"exponent must be a number in [0, 1], got {exponent!r}")
    scale = int(values.shape[0]) * float(value_spread(values).sum())
    return 1.0 if exponent == 0 else scale ** exponent


def attention_mass(weights: Tensor) -> Tensor:
    """`[Tk]` float64 mean mass each key token receives from attention probabilities
    `weights [Hq, Tq, Tk]` (mean over heads and query rows)."""
    w = check_tensor(weights, "weights")
    if w.dim() != 3:
        raise ValueError(f"weights must be [Hq, Tq, Tk], got shape {tuple(w.shape)}")
    return w.to(torch.float64).mean(dim=(0, 1))


def metric_sqrt(metric: Tensor, heads: int, dim: int, inverse: bool = True) -> tuple[Tensor, Tensor | None]:
    """(W, W⁻¹), each `[H, D, D]` float64, with W·Wᵀ = Σ_h + ridge: any such W gives the weighted
    norm (||E·W||²_F = tr(E·M·Eᵀ)) and the same singular values of X·W. The Cholesky factor
    (lower) when the ridged blocks are positive definite, else the symmetric root of the
    eigendecomposition (which also checks the metric is positive semi-definite). `inverse=False`
    skips W⁻¹ on the Cholesky path (None there) for callers that only weigh by W."""
    sigma = metric.to(torch.float64)
    sigma = (sigma + sigma.transpose(-1, -2)) / 2  # symmetrise rounding noise
    scale = sigma.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / dim  # trace(Σ_h)/D, (H, 1)
    if bool((scale > 0).any()):
        # A head no query reads (Σ_h = 0) borrows the mean scale so its ridge, and W, stay invertible.
        scale = torch.where(scale > 0, scale, scale[scale > 0].mean())
        eye = torch.eye(dim, dtype=torch.float64, device=sigma.device)
        low, info = torch.linalg.cholesky_ex(sigma + (RIDGE * scale)[..., None] * eye)
        if not bool(info.any()):
            return low, torch.linalg.solve_triangular(low, eye.expand_as(low), upper=False) if inverse else None
    return metric_sqrt_eigh(sigma, dim)


def metric_sqrt_eigh(sigma: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """(W, W⁻¹) with W = blockdiag((Σ_h + ridge)^½), symmetric, from the eigendecomposition."""
    evals, evecs = torch.linalg.eigh(sigma)
    top = evals.abs().amax(dim=-1, keepdim=True)
    if bool((evals < -1e-4 * top).any()):  # lenient: a float32 Σ of rank < D rounds to ±1e-7·top
        raise ValueError("metric must be positive semi-definite (a second moment); it has negative eigenvalues")
    scale = evals.clamp_min(0).sum(dim=-1, keepdim=True) / dim  # trace(Σ_h)/D, (H, 1)
    if not bool((scale > 0).any()):
        raise ValueError("metric is zero in every head; it cannot weight anything")
    scale = torch.where(scale > 0, scale, scale[scale > 0].mean())
    root = (evals.clamp_min(0) + RIDGE * scale).sqrt()
    w = (evecs * root.unsqueeze(-2)) @ evecs.transpose(-1, -2)
    w_inv = (evecs / root.unsqueeze(-2)) @ evecs.transpose(-1, -2)
    return w, w_inv
