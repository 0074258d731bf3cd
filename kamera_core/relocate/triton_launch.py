"""Launcher of the fused Triton relocate `out = R(δ)·K + U·Vᵀ`.

`rotate_triton` has exactly the meaning, argument shapes and result of
`kamera_core.relocate.rotate_reference`; the kernel itself is `kamera_core.relocate.triton_kernel`.

Triton is optional (`pip install triton`, or the `kernels` extra): it is imported only when a
launch is asked for. CUDA tensors run the compiled kernel. CPU tensors can only run under the
Triton interpreter, which `triton.jit` picks when the kernel module is first imported, so
TRITON_INTERPRET=1 must be in the environment before that import; otherwise use backend="torch".
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kamera_core import backends

_KEY_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_COMPUTE_DTYPES = (torch.float32, torch.float64)
_PAIRINGS = ("half", "interleaved")
# Elements of one rotated half-tile per program: 32 rows of a 128-wide head (Qwen, Llama) — enough
# bytes in flight per program for a memory-bound kernel, small enough to keep registers low.
_TILE_ELEMENTS = 2048
_MAX_BLOCK_ROWS = 64


def _load_kernel() -> tuple[Any, Any]:
    """(relocate_kernel, triton.language), or an ImportError telling how to get Triton."""
    try:
        import triton.language as tl

        from kamera_core.relocate.triton_kernel import relocate_kernel
    except ImportError as err:
        if err.name is None or not err.name.startswith("triton"):
            raise
        raise ImportError(
            "the Triton relocate kernel needs the `triton` package: install it "
            "(pip install triton, or the project's `kernels` extra) or use backend='torch'"
        ) from err
    return relocate_kernel, tl


def _check_interpreted(kernel: Any) -> None:
    """CPU launches need the kernel to have been decorated under TRITON_INTERPRET=1."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise ValueError(
            "keys are on the CPU and TRITON_INTERPRET=1 is set, but kamera_core.relocate.triton_kernel was "
            "imported before it was set, so the kernel is compiled for a GPU; set TRITON_INTERPRET=1 "
            "before the first import (e.g. in the environment of the process), or use backend='torch'"
        )


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_keys(keys: object) -> torch.Tensor:
    keys = _tensor("keys", keys)
    if keys.dtype not in _KEY_DTYPES:
        raise TypeError(f"keys dtype must be one of float16, bfloat16, float32, float64; got {keys.dtype}")
    if keys.dim() < 1:
        raise ValueError("keys must be [tokens, *rest, head_dim], got a 0-d tensor")
    return keys


def _check_device(keys: torch.Tensor) -> None:
    """CUDA tensors, or CPU tensors when the Triton interpreter is on."""
    if keys.is_cuda:
        return
    if keys.device.type != "cpu":
        raise ValueError(
            "the Triton relocate runs on CUDA tensors (or CPU ones under the interpreter); "
            f"keys are on {keys.device}"
        )
    if not backends.interpreting():
        raise ValueError(
            "keys are on the CPU: the Triton kernel runs there only under the Triton interpreter "
            "(TRITON_INTERPRET=1 in the environment before kamera_core is imported: it is read once, then); use backend='torch' on CPU"
        )


def _check_phase(name: str, value: object) -> torch.Tensor:
    t = _tensor(name, value)
    if t.dim() != 1 or t.shape[0] < 1:
        raise ValueError(
            f"{name} must be [rotary_dim // 2] with at least one value, got shape {tuple(t.shape)}"
        )
    if t.dtype not in _COMPUTE_DTYPES:
        raise TypeError(f"{name} must be float32 or float64 (the compute dtype), got {t.dtype}")
    return t


def _check_phases(keys: torch.Tensor, cos: object, sin: object) -> int:
    """Validates cos, sin `[rotary_dim // 2]` against keys `[..., head_dim]`; returns rotary_dim // 2."""
    cos, sin = _check_phase("cos", cos), _check_phase("sin", sin)
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(
            f"cos and sin must agree, got cos {tuple(cos.shape)} {cos.dtype} and "
            f"sin {tuple(sin.shape)} {sin.dtype}"
        )
    half = cos.shape[0]
    if 2 * half > keys.shape[-1]:
        raise ValueError(f"rotary_dim {2 * half} (2 * len(cos)) exceeds head_dim {keys.shape[-1]}")
    return half


def _check_factor(name: str, value: object, keys: torch.Tensor) -> torch.Tensor:
    t = _tensor(name, value)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != keys.device:
        raise ValueError(f"{name} is on {t.device} but keys are on {keys.device}")
    return t


def _check_factors(keys: torch.Tensor, u: object, vt: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validates the patch u `[tokens, rank >= 1]`, vt `[rank, *rest, head_dim]`; None when both are None."""
    if u is None and vt is None:
        return None
    if u is None or vt is None:
        raise ValueError("u and vt come together: pass both patch factors or neither")
    u, vt = _check_factor("u", u, keys), _check_factor("vt", vt, keys)
    if keys.dim() < 2:
        raise ValueError(f"a patch needs keys [tokens, *rest, head_dim], got shape {tuple(keys.shape)}")
    if u.dim() != 2 or u.shape[0] != keys.shape[0]:
        raise ValueError(f"u must be [tokens={keys.shape[0]}, rank], got {tuple(u.shape)}")
    rank = u.shape[1]
    if rank < 1:
        raise ValueError(f"patch rank must be >= 1, got u {tuple(u.shape)}; pass u=vt=None for no patch")
    if tuple(vt.shape) != (rank, *keys.shape[1:]):
        raise ValueError(f"vt must be [rank={rank}, *{tuple(keys.shape[1:])}], got {tuple(vt.shape)}")
    return u, vt


def _check_pairing(pairing: object) -> bool:
    """True for interleaved pairs (2i, 2i+1), False for rotate-half pairs (i, i + rotary_dim/2)."""
    if pairing not in _PAIRINGS:
        raise ValueError(f"pairing must be 'half' or 'interleaved', got {pairing!r}")
    return pairing == "interleaved"


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _block_sizes(head_dim: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_HALF, BLOCK_PASS): powers of two covering rows, pairs and pass-through dims."""
    block_half = _next_pow2(half)
    block_pass = _next_pow2(max(1, head_dim - 2 * half))
    block_rows = min(_MAX_BLOCK_ROWS, max(1, _TILE_ELEMENTS // block_half))
    return block_rows, block_half, block_pass


def rotate_triton(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pairing: str,
    u: torch.Tensor | None = None,
    vt: torch.Tensor | None = None,
) -> torch.Tensor:
    """`R·keys (+ U·Vᵀ)` with the fused Triton kernel; same contract as `rotate_reference`.

    keys: `[tokens, *rest, head_dim]` (any number of middle dims, none included), float16,
    bfloat16, float32 or float64, on CUDA (or CPU under TRITON_INTERPRET=1);
    cos, sin: `[rotary_dim // 2]`, float32 or float64, the compute dtype (moved to keys' device);
    pairing: "half" or "interleaved"; u: `[tokens, rank]`, vt: `[rank, *rest, head_dim]`, already
    in the target frame, on keys' device. Dims past rotary_dim are copied (plus the patch).
    Returns a new contiguous tensor of keys' dtype and shape; inputs are not mutated.
    """
    keys = _check_keys(keys)
    half = _check_phases(keys, cos, sin)
    interleaved = _check_pairing(pairing)
    patch = _check_factors(keys, u, vt)
    _check_device(keys)
    kernel, tl = _load_kernel()
    if not keys.is_cuda:
        _check_interpreted(kernel)

    head_dim = keys.shape[-1]
    out = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
    num_rows = keys.numel() // head_dim  # head_dim >= rotary_dim >= 2
    if num_rows == 0:
        return out
    keys_c = keys.contiguous()  # (rows, head_dim) in memory: rows = tokens * rest
    cos_c = cos.to(keys.device).contiguous()  # (half,)
    sin_c = sin.to(keys.device).contiguous()
    if patch is None:
        rest, rank = 1, 0
        u_c = vt_c = keys_c  # never read: HAS_PATCH is off
    else:
        rest = num_rows // keys.shape[0]  # product of the middle dims
        rank = patch[0].shape[1]
        u_c = patch[0].contiguous()  # (tokens, rank)
        vt_c = patch[1].contiguous()  # (rank, rest, head_dim) in memory
    block_rows, block_half, block_pass = _block_sizes(head_dim, half)
    compute = tl.float64 if cos_c.dtype == torch.float64 else tl.float32
    grid = (-(-num_rows // block_rows),)  # ceil(rows / BLOCK_ROWS) programs
    # Launch on keys' GPU, not the current one; interpreter launches need no device guard.
    with torch.cuda.device(keys.device) if keys.is_cuda else contextlib.nullcontext():
        kernel[grid](
            keys_c,
            out,
            cos_c,
            sin_c,
            u_c,
            vt_c,
            num_rows,
            rest,
            rank,
            HEAD_DIM=head_dim,
            HALF=half,
            INTERLEAVED=interleaved,
            HAS_PATCH=patch is not None,
            HAS_PASS=head_dim > 2 * half,
            COMPUTE=compute,
            BLOCK_ROWS=block_rows,
            BLOCK_HALF=block_half,
            BLOCK_PASS=block_pass,
        )
    return out
