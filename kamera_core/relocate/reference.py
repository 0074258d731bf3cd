"""Exact relocation of cached keys by a RoPE position shift: the contract and the torch reference.

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

import torch

from kamera_core.rope import RopeSpec


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


def check_keys(keys: torch.Tensor, spec: RopeSpec, what: str = "keys") -> None:
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(keys).__name__}")
    if not keys.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got {keys.dtype}")
    if keys.dim() < 1 or keys.shape[-1] != spec.head_dim:
        raise ValueError(
            f"{what} last dim must be head_dim={spec.head_dim} (shape [tokens, kv_heads, head_dim]), "
            f"got shape {tuple(keys.shape)}"
        )


def check_patch(keys: torch.Tensor, patch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
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
