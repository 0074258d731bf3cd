"""Symmetric per-component quantisation of patch factors, and the 4-bit packing of the "mixed"
storage (int8 for a patch's leading components, int4 for the rest; `kamera_core.patch.Factors`).

A component j of a patch is column j of u `[T, m]` and row j of vt `[m, F]`; each gets its own
float32 scale max|x|/L (L = 127 for 8 bits, 7 for 4 bits) and rounds to nearest in [-L, L]. Four-bit
codes are packed two components to a byte along the component axis (component 2i in the low
nibble, 2i + 1 in the high one, each stored as code + 8), so a `[T, m]` block packs to
`[T, ceil(m / 2)]` uint8 and keeps one row per token.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

LEVELS = {8: 127, 4: 7}
_OFFSET = 8  # a 4-bit code q in [-7, 7] is stored as q + 8 in [1, 15]


def quantise(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor]:
    """(integer codes int8 in [-L, L], float32 scales) of float `x`, one scale per index of `dim`
    (the component axis: 1 for u `[T, m]`, 0 for vt `[m, F]`). An all-zero component gets scale 0
    and codes 0."""
    levels = LEVELS[bits]
    other = [d for d in range(x.dim()) if d != dim % x.dim()]
    scale = x.abs().amax(dim=other, keepdim=True) / levels
    codes = (x / torch.where(scale > 0, scale, 1.0)).round().clamp(-levels, levels).to(torch.int8)
    return codes, scale.reshape(-1).float()


def quantise_mixed(x: Tensor, head: int, dim: int) -> tuple[Tensor, Tensor]:
    """`quantise` of the first `head` components (indices along `dim`) in 8 bits and the rest in
    4, in one pass: the same codes and scales as the two calls, all the components' codes int8."""
    count = x.shape[dim]
    levels = torch.full((count,), float(LEVELS[8]), dtype=torch.float32, device=x.device)
    levels[head:] = LEVELS[4]
    shape = [1] * x.dim()
    shape[dim % x.dim()] = count
    levels = levels.reshape(shape)
    other = [d for d in range(x.dim()) if d != dim % x.dim()]
    scale = x.abs().amax(dim=other, keepdim=True) / levels
    codes = torch.minimum(torch.maximum((x / torch.where(scale > 0, scale, 1.0)).round(), -levels), levels)
    return codes.to(torch.int8), scale.reshape(-1).float()


def dequantise(codes: Tensor, scale: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """`codes · scale` along `dim`, computed in at least float32, returned as `dtype`."""
    compute = torch.promote_types(dtype, torch.float32)
    shape = [1] * codes.dim()
    shape[dim % codes.dim()] = -1
    return (codes.to(compute) * scale.to(compute).reshape(shape)).to(dtype)


def pack4(codes: Tensor, dim: int) -> Tensor:
    """4-bit codes (int8 in [-7, 7]) packed two per uint8 along `dim` (odd counts padded with 0)."""
    if codes.dtype != torch.int8 or bool((codes.abs() > LEVELS[4]).any()):
        raise ValueError("pack4 takes int8 codes in [-7, 7]")
    c = (codes.to(torch.int16) + _OFFSET).movedim(dim, 0)
    if c.shape[0] % 2:
        c = torch.cat([c, torch.full_like(c[:1], _OFFSET)])
    return (c[0::2] | (c[1::2] << 4)).to(torch.uint8).movedim(0, dim).contiguous()


def unpack4(packed: Tensor, count: int, dim: int) -> Tensor:
    """The first `count` int8 codes along `dim` of `pack4`'s output."""
    p = packed.movedim(dim, 0).to(torch.int16)
    both = torch.stack([(p & 15) - _OFFSET, (p >> 4) - _OFFSET], dim=1)  # (n, 2, ...)
    codes = both.reshape(-1, *p.shape[1:])[:count]
    return codes.to(torch.int8).movedim(0, dim).contiguous()


def unpack4_values(packed: Tensor, count: int, dim: int, dtype: torch.dtype) -> Tensor:
    """`unpack4(packed, count, dim)` as floating `dtype` values, without the int8 round trip (the
    hot path of reading mixed factors in attention)."""
    both = torch.stack([packed & 15, packed >> 4], dim=dim % packed.dim() + 1)  # (..., n, 2, ...)
    shape = list(packed.shape)
    shape[dim % packed.dim()] *= 2
    return both.reshape(shape).narrow(dim, 0, count).to(dtype) - _OFFSET


def packed_size(count: int) -> int:
    """Bytes along the packed axis that `count` 4-bit components take."""
    return (count + 1) // 2
