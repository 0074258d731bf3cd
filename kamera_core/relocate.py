"""Exact relocation of cached keys by a RoPE position shift.

A key cached at position p is R(p)·k. Moving it to p + δ multiplies it by R(δ): one rotation per
frequency pair, the same for every token. So a chunk's keys move between its chunk-local frame
(as if it started at 0) and any start position with no forward pass, and a low-rank patch U·Vᵀ
stored in the chunk-local frame moves by rotating its small factor Vᵀ alone.

Precision: the phases δ·f are formed in float64 from δ itself (rotary_dim/2 numbers per shift) and
never by subtracting two angle tables; the rotation is applied in float32 (float64 for float64
keys) and the result is cast back to the input dtype.

Layouts (token-major, as everywhere in kamera_core):
- MHA / GQA keys: `[tokens, num_kv_heads, head_dim]` (any leading dims work; the last is rotated);
- MLA: latent c_KV `[tokens, kv_lora_rank]` is returned untouched (same tensor, same bytes) and
  k_rope `[tokens, rope_dim]` is rotated;
- patch factors: U `[tokens, rank]`, Vᵀ `[rank, *key_shape[1:]]`.
"""

from __future__ import annotations

import operator
import os
from typing import Literal

import torch

from kamera_core.rope import RopeSpec

Backend = Literal["auto", "torch", "cpu", "triton"]


def _as_shift(delta: object) -> int:
    try:
        return operator.index(delta)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"position shift must be an integer, got {type(delta).__name__} {delta!r}; "
            "positions are whole token slots"
        ) from None


def phases(spec: RopeSpec, delta: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(δ·f) and sin(δ·f) for each inverse frequency f of `spec`, each `[rotary_dim // 2]`.

    The angles are computed in float64 (δ exactly, f as the model's float32 value) and only the
    final cos/sin are rounded to `dtype`.
    """
    shift = _as_shift(delta)
    angles = torch.tensor(spec.inv_freq, dtype=torch.float64) * float(shift)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_reference(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pairing: str,
    u: torch.Tensor | None = None,
    vt: torch.Tensor | None = None,
) -> torch.Tensor:
    """`R·keys (+ U·Vᵀ)`: the plain torch path of the fused relocate, and the kernel's reference.

    keys: `[tokens, *rest, head_dim]`; cos, sin: `[rotary_dim // 2]` in the compute dtype;
    u: `[tokens, rank]`, vt: `[rank, *rest, head_dim]`, already in the target frame.
    Returns a new tensor of keys' dtype and shape; does not mutate its inputs.
    """
    compute = cos.dtype
    x = keys.to(compute)
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if pairing == "half":
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
    else:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    cos, sin = cos.to(x.device), sin.to(x.device)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if pairing == "half":
        rotated = torch.cat([o1, o2], dim=-1)
    else:
        rotated = torch.stack([o1, o2], dim=-1).flatten(-2)  # (..., half, 2) -> (..., rotary_dim)
    if rotary_dim < x.shape[-1]:
        rotated = torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    if u is not None:
        num_tokens, rank = u.shape
        delta_kv = u.to(compute) @ vt.to(compute).reshape(rank, -1)  # (T, rest*D)
        rotated = rotated + delta_kv.reshape(rotated.shape)
    return rotated.to(keys.dtype)


def _check_keys(keys: torch.Tensor, spec: RopeSpec, what: str = "keys") -> None:
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(keys).__name__}")
    if not keys.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got {keys.dtype}")
    if keys.dim() < 1 or keys.shape[-1] != spec.head_dim:
        raise ValueError(
            f"{what} last dim must be head_dim={spec.head_dim} (shape [tokens, kv_heads, head_dim]), "
            f"got shape {tuple(keys.shape)}"
        )


def _check_patch(keys: torch.Tensor, patch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        u, vt = patch
    except (TypeError, ValueError):
        raise TypeError("patch must be a pair (u, vt) of tensors") from None
    if u.dim() != 2 or u.shape[0] != keys.shape[0]:
        raise ValueError(f"patch u must be [tokens={keys.shape[0]}, rank], got {tuple(u.shape)}")
    if tuple(vt.shape) != (u.shape[1], *keys.shape[1:]):
        raise ValueError(
            f"patch vt must be [rank={u.shape[1]}, *{tuple(keys.shape[1:])}], got {tuple(vt.shape)}"
        )
    return u, vt


def _pick_backend(keys: torch.Tensor, backend: Backend) -> str:
    """auto: the Triton kernel for accelerator tensors (or under the Triton interpreter), the
    one-pass CPU kernel otherwise (it falls back to the torch path where it cannot be built)."""
    if backend not in ("auto", "torch", "cpu", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch', 'cpu' or 'triton', got {backend!r}")
    if backend != "auto":
        return backend
    if keys.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "cpu" if keys.device.type == "cpu" else "torch"


def relocate_keys(
    keys: torch.Tensor,
    spec: RopeSpec,
    delta: int,
    patch: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Keys cached at positions p… returned as if cached at p + δ, optionally with a patch added.

    keys: `[tokens, *rest, head_dim]`, any float dtype. patch: `(u [tokens, rank],
    vt [rank, *rest, head_dim])` expressed in the same frame as `keys`; the result is
    `R(δ)·(keys + u·vt) = R(δ)·keys + u·(R(δ)·vt)`. Returns a new tensor of keys' dtype.
    backend: "auto" (Triton on CUDA, the one-pass C kernel on CPU), "torch" (the plain
    reference), "cpu" or "triton" to force one; every backend gives the reference's values.
    """
    _check_keys(keys, spec)
    chosen = _pick_backend(keys, backend)
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    cos, sin = phases(spec, delta, compute)
    u = vt = None
    if patch is not None:
        u, vt = _check_patch(keys, patch)
        vt = rotate_reference(vt, cos, sin, spec.pairing)
    if chosen == "triton":
        from kamera_core.triton_relocate import rotate_triton

        return rotate_triton(keys, cos, sin, spec.pairing, u, vt)
    if chosen == "cpu":
        from kamera_core.cpu_relocate import rotate_cpu

        return rotate_cpu(keys, cos, sin, spec.pairing, u, vt)
    return rotate_reference(keys, cos, sin, spec.pairing, u, vt)


def relocate_mla(
    c_kv: torch.Tensor, k_rope: torch.Tensor, spec: RopeSpec, delta: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA relocation: c_KV `[tokens, kv_lora_rank]` is returned as is (the same tensor, bytes
    untouched); k_rope `[tokens, rope_dim]` is rotated by δ."""
    if not isinstance(c_kv, torch.Tensor):
        raise TypeError(f"c_kv must be a torch.Tensor, got {type(c_kv).__name__}")
    _check_keys(k_rope, spec, "k_rope")
    if c_kv.shape[:-1] != k_rope.shape[:-1]:
        raise ValueError(f"c_kv {tuple(c_kv.shape)} and k_rope {tuple(k_rope.shape)} disagree on tokens")
    return c_kv, relocate_keys(k_rope, spec, delta)


def relocate_patch(
    u: torch.Tensor, vt: torch.Tensor, spec: RopeSpec, delta: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A key patch U·Vᵀ moved by δ: only vt `[rank, *rest, head_dim]` rotates; u is returned as is.

    Value patches do not move (values carry no position) and MLA's c_KV patch does not either.
    """
    _check_keys(vt, spec, "vt")
    return u, relocate_keys(vt, spec, delta)
