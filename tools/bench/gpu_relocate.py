"""GPU check of the Triton relocate (`python -m tools.gpu_relocate_check`): speed against a plain
device copy, and error against torch.

Builds bfloat16 keys shaped like Qwen2.5-VL-7B's cache (28 layers × 4 KV heads × head_dim 128,
4096 tokens per layer by default) as one `[layers · tokens, kv_heads, head_dim]` tensor, so a
launch relocates the whole cache. A relocate reads and writes every byte once, like a copy, so the
device-to-device copy of the same bytes (`copy_` into a preallocated tensor) is its floor;
`ratio_vs_copy` = relocate time / copy time (1.0 means as fast as a copy).

`measure(args, device)` returns the record, `format_table(record)` the printed lines.
"""

from __future__ import annotations

import argparse

import torch

from tools.bench.runs import device_time_ms


def gbytes_per_s(num_bytes: int, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9


def max_abs(t: torch.Tensor) -> float:
    return t.double().abs().max().item()


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Times copy, torch path and kernel on `device` (a CUDA device); returns the JSON record."""
    from kamera_core.relocate import phases, rotate_reference
    from kamera_core.rope import RopeSpec
    from kamera_core.relocate.triton_launch import rotate_triton

    rows = args.layers * args.tokens
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    spec = RopeSpec(inv_freq=tuple(inv_freq.tolist()), head_dim=args.head_dim, pairing="half")
    # cos/sin on the GPU up front, so the timed launches do no host-to-device copy.
    cos, sin = (t.to(device) for t in phases(spec, args.delta))
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(rows, args.kv_heads, args.head_dim, device=device, generator=gen)  # (L·T, H, D)
    keys = keys.mul_(3).to(torch.bfloat16)  # |k| up to ~15, like real keys
    moved = 2 * keys.numel() * keys.element_size()  # read once, write once
    # The copy writes into a preallocated tensor; the relocate allocates its output per call as its
    # callers do (from the caching allocator, so no cudaMalloc in the timed loop).
    dst = torch.empty_like(keys)

    copy_ms = device_time_ms(lambda: dst.copy_(keys), device, args.warmup, args.iters, args.repeats)
    kernel_ms = device_time_ms(lambda: rotate_triton(keys, cos, sin, "half"), device, args.warmup, args.iters, args.repeats)
    # The torch path is several times slower; fewer launches keep the run short.
    torch_iters = max(1, args.iters // 10)
    torch_ms = device_time_ms(lambda: rotate_reference(keys, cos, sin, "half"), device, 2, torch_iters, args.repeats)

    out = rotate_triton(keys, cos, sin, "half")
    ref = rotate_reference(keys, cos, sin, "half")
    err = max_abs(out.double() - ref.double())
    # One bf16 ulp of the largest value: both sides round a float32 result once, so the
    # difference should be 0 or one ulp (FMA contraction on the GPU vs separate products in torch).
    ulp = torch.finfo(torch.bfloat16).eps * max_abs(ref)
    mismatched = (out != ref).double().mean().item()

    record = {
        "device": torch.cuda.get_device_name(device),
        "tokens": args.tokens,
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": "bfloat16",
        "bytes_moved": moved,
        "copy_ms": copy_ms,
        "kernel_ms": kernel_ms,
        "torch_ms": torch_ms,
        "gbytes_per_s": gbytes_per_s(moved, kernel_ms),
        "copy_gbytes_per_s": gbytes_per_s(moved, copy_ms),
        "torch_gbytes_per_s": gbytes_per_s(moved, torch_ms),
        "ratio_vs_copy": kernel_ms / copy_ms,
        "max_abs_err": err,
        "max_abs_ref": max_abs(ref),
        "err_in_ulps_of_max": err / ulp,
        "fraction_elements_differing": mismatched,
    }
    if args.rank > 0:
        u = torch.randn(rows, args.rank, device=device, generator=gen).mul_(0.1)  # (L·T, rank)
        vt = torch.randn(args.rank, args.kv_heads, args.head_dim, device=device, generator=gen)  # (r, H, D)
        u, vt = u.to(torch.bfloat16), vt.to(torch.bfloat16)

        def patched() -> torch.Tensor:
            return rotate_triton(keys, cos, sin, "half", u, vt)

        patched_ms = device_time_ms(patched, device, args.warmup, args.iters, args.repeats)
        patched_err = max_abs(patched().double() - rotate_reference(keys, cos, sin, "half", u, vt).double())
        record |= {
            "patch_rank": args.rank,
            "patched_ms": patched_ms,
            "patched_ratio_vs_copy": patched_ms / copy_ms,
            "patched_max_abs_err": patched_err,
        }
    return record


def format_table(record: dict) -> str:
    """The timings and the error as printed lines."""
    lines = []
    moved = record["bytes_moved"]
    shape = f"[{record['layers']}×{record['tokens']}, {record['kv_heads']}, {record['head_dim']}]"
    lines.append(f"{record['device']}: bf16 keys {shape}, {moved / 1e9:.3f} GB read+written per call")
    lines.append(f"{'path':<22}{'ms':>10}{'GB/s':>10}{'× copy':>9}")
    rows = [
        ("copy_ (floor)", record["copy_ms"]),
        ("triton relocate", record["kernel_ms"]),
        ("torch reference", record["torch_ms"]),
    ]
    if "patched_ms" in record:
        rows.append((f"triton + rank-{record['patch_rank']} patch", record["patched_ms"]))
    for name, ms in rows:
        lines.append(f"{name:<22}{ms:>10.4f}{gbytes_per_s(moved, ms):>10.1f}{ms / record['copy_ms']:>9.2f}")
    lines.append(f"max |triton − torch| = {record['max_abs_err']:.3g} "
                 f"({record['err_in_ulps_of_max']:.2f} bf16 ulps of max |k| = {record['max_abs_ref']:.3g}; "
                 f"{100 * record['fraction_elements_differing']:.4f}% of elements differ)")
    if "patched_max_abs_err" in record:
        lines.append(f"with patch: max |triton − torch| = {record['patched_max_abs_err']:.3g}")
    return "\n".join(lines)
