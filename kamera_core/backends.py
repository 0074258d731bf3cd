"""Which implementation runs an operation (`relocate_keys`, `segment_attention`): one dispatcher
for the package.

Every operation has a torch reference and may have a C kernel for CPU tensors and a Triton kernel
for CUDA tensors; `backend="auto"` picks by the tensor's device, any other name forces one. The
environment is read once, when this module is imported: `TRITON_INTERPRET=1` makes "auto" send
CPU tensors to the Triton kernels under Triton's interpreter, which decorates them for the
interpreter only when it is set before they are imported.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["auto", "torch", "cpu", "triton"]
BACKENDS = ("auto", "torch", "cpu", "triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Query rows up to which "auto" picks segment attention's C kernel on CPU tensors (decoding and
# short queries read each key once there); longer passes take torch's flash-attention kernel.
CPU_KERNEL_MAX_ROWS = 16


def check(backend: object) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'torch', 'cpu' or 'triton', got {backend!r}")


def interpreting() -> bool:
    """Whether the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return INTERPRET


def for_relocate(keys: torch.Tensor, backend: Backend) -> str:
    """auto: the Triton kernel for accelerator tensors (or under the Triton interpreter), the
    one-pass C kernel for CPU tensors (it falls back to the torch path where it cannot be built)."""
    check(backend)
    if backend != "auto":
        return backend
    if keys.is_cuda or INTERPRET:
        return "triton"
    return "cpu" if keys.device.type == "cpu" else "torch"


def for_segment(query: torch.Tensor, backend: Backend) -> str:
    """auto: Triton for CUDA tensors; on CPU the C kernel for at most `CPU_KERNEL_MAX_ROWS` query
    rows and torch's flash-attention kernel per segment ("flash") for longer passes; the reference
    elsewhere."""
    check(backend)
    if backend != "auto":
        return backend
    if query.is_cuda:
        return "triton"
    if query.device.type == "cpu":
        return "cpu" if query.shape[0] <= CPU_KERNEL_MAX_ROWS else "flash"
    return "torch"
