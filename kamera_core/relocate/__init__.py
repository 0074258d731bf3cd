"""Exact relocation of cached keys by a RoPE position shift (the math: `reference`).

- `reference`: the contract (layouts, phases formed in float64) and the torch path;
- `cpu`: a one-pass C kernel for CPU tensors (built on first use; the torch path where it cannot be);
- `triton_launch` / `triton_kernel`: the Triton kernel for CUDA tensors (or under its interpreter).
`kamera_core.backends` picks one per call; every backend gives the reference's values.
"""

from __future__ import annotations

import torch

from kamera_core import backends
from kamera_core.backends import Backend
from kamera_core.relocate.reference import check_keys, check_patch, phases, rotate_reference
from kamera_core.rope import RopeSpec

__all__ = ["Backend", "phases", "relocate_keys", "relocate_mla", "relocate_patch", "rotate_reference"]


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
    check_keys(keys, spec)
    chosen = backends.for_relocate(keys, backend)
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    cos, sin = phases(spec, delta, compute)
    u = vt = None
    if patch is not None:
        u, vt = check_patch(keys, patch)
        vt = rotate_reference(vt, cos, sin, spec.pairing)
    if chosen == "triton":
        from kamera_core.relocate.triton_launch import rotate_triton

        return rotate_triton(keys, cos, sin, spec.pairing, u, vt)
    if chosen == "cpu":
        from kamera_core.relocate.cpu import rotate_cpu

        return rotate_cpu(keys, cos, sin, spec.pairing, u, vt)
    return rotate_reference(keys, cos, sin, spec.pairing, u, vt)


def relocate_mla(
    c_kv: torch.Tensor, k_rope: torch.Tensor, spec: RopeSpec, delta: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA relocation: c_KV `[tokens, kv_lora_rank]` is returned as is (the same tensor, bytes
    untouched); k_rope `[tokens, rope_dim]` is rotated by δ."""
    if not isinstance(c_kv, torch.Tensor):
        raise TypeError(f"c_kv must be a torch.Tensor, got {type(c_kv).__name__}")
    check_keys(k_rope, spec, "k_rope")
    if c_kv.shape[:-1] != k_rope.shape[:-1]:
        raise ValueError(f"c_kv {tuple(c_kv.shape)} and k_rope {tuple(k_rope.shape)} disagree on tokens")
    return c_kv, relocate_keys(k_rope, spec, delta)


def relocate_patch(
    u: torch.Tensor, vt: torch.Tensor, spec: RopeSpec, delta: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A key patch U·Vᵀ moved by δ: only vt `[rank, *rest, head_dim]` rotates; u is returned as is.

    Value patches do not move (values carry no position) and MLA's c_KV patch does not either.
    """
    check_keys(vt, spec, "vt")
    return u, relocate_keys(vt, spec, delta)
