"""CPU relocation throughput as a ratio to a plain copy of the same bytes (`agentwin bench relocate`).

One run times, interleaved so that machine noise hits all of them alike:
- `clone`: `k.clone()` of every layer's keys (out of place, allocates the result);
- `relocate`: `rotate_cpu(k, cos, sin, pairing)` (out of place, allocates the result);
- `copy_into`: `o.copy_(k)` into an existing buffer;
- `relocate_into`: `rotate_cpu_into(k, ..., out=o)` into an existing buffer;
- `relocate_inplace`: `rotate_cpu_inplace(w, ...)` overwriting the keys where they are.

`ratio_vs_copy` compares like with like: out-of-place relocate vs clone (both pay for fresh
memory, which on some machines costs more than the copy itself). The pairs that write into
existing memory are reported beside it: `into.ratio_vs_copy_into` (relocate_into / copy_into)
and `inplace.ratio_vs_copy_into` (relocate_inplace / copy_into). Throughput counts bytes read + bytes written
(2 × keys bytes) for every operation. Shapes default to Qwen2.5-VL-7B's KV (28 layers, 4 KV
heads, head_dim 128, bf16, θ = 1e6) for a 4096-token chunk.

`measure(args)` returns the results (what --json writes), `format_table(results)` the printed
summary and `failure(results, min_ratio)` what makes the command exit 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from types import SimpleNamespace
from typing import Callable

import torch

from kamera_core.relocate import cpu as cpu_relocate
from kamera_core.relocate import phases, rotate_reference
from kamera_core.rope import RopeSpec, rope_specs

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
TIMING_METHOD = (
    "time.perf_counter around one pass over all layers; warmup passes first (after the kernel "
    "is built); ops interleaved each repeat in a rotating order; median over repeats"
)


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def even_positive_int(text: str) -> int:
    """argparse type: an even integer > 0 (a head dim)."""
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(
            f"must be even (RoPE rotates pairs of dims), got {value}"
        )
    return value


def dtype_name(text: str) -> str:
    """argparse type: a name in DTYPES, lower-cased."""
    if text.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose one of bf16, fp16, fp32"
        )
    return text.lower()


def _qwen_like_spec(head_dim: int, layers: int, pairing: str) -> RopeSpec:
    """Layer 0's RopeSpec of a Qwen2-style config (θ = 1e6) read by `rope_specs`."""
    config = SimpleNamespace(
        model_type="qwen2", rope_theta=1_000_000.0, num_hidden_layers=layers,
        hidden_size=head_dim * 28, num_attention_heads=28, head_dim=head_dim,
    )
    spec = rope_specs(config)[0]
    if pairing == "half":
        return spec
    return RopeSpec(inv_freq=spec.inv_freq, head_dim=head_dim, pairing="interleaved")


def _make_keys(args: argparse.Namespace, dtype: torch.dtype) -> list[torch.Tensor]:
    """One `[tokens, kv_heads, head_dim]` key tensor per layer, seeded random values."""
    gen = torch.Generator().manual_seed(0)
    shape = (args.tokens, args.kv_heads, args.head_dim)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(args.layers)]


def _ulp(ref: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of `ref` (its own dtype), as float32."""
    finfo = torch.finfo(ref.dtype)
    mag = ref.float().abs().clamp_min(finfo.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * finfo.eps


def check_numerics(keys: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> dict:
    """Fast path vs `rotate_reference` on every layer: max abs error and max error in ulps."""
    max_abs = 0.0
    max_ulps = 0.0
    for k in keys:
        ref = rotate_reference(k, cos, sin, pairing)
        fast = cpu_relocate.rotate_cpu(k, cos, sin, pairing)
        diff = (fast.float() - ref.float()).abs()
        max_abs = max(max_abs, diff.max().item())
        max_ulps = max(max_ulps, (diff / _ulp(ref)).max().item())
    return {"max_abs_err_vs_reference": max_abs, "max_ulp_err_vs_reference": max_ulps, "ok": max_ulps <= 1.0}


def _time_once(op: Callable[[], object]) -> float:
    start = time.perf_counter()
    result = op()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def time_interleaved(ops: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per op and repeat. Each repeat runs every op once, starting one op later each time."""
    names = list(ops)
    for _ in range(warmup):
        for name in names:
            _time_once(ops[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_time_once(ops[name]))
    return times


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _ops(keys: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> dict[str, Callable[[], object]]:
    """The timed operations, each one pass over all layers."""
    buffers = [torch.empty_like(k) for k in keys]
    work = [k.clone() for k in keys]  # rotated in place again and again (a rotation keeps norms)
    return {
        "clone": lambda: [k.clone() for k in keys],
        "relocate": lambda: [cpu_relocate.rotate_cpu(k, cos, sin, pairing) for k in keys],
        "copy_into": lambda: [o.copy_(k) for o, k in zip(buffers, keys)],
        "relocate_into": lambda: [cpu_relocate.rotate_cpu_into(k, cos, sin, pairing, o) for o, k in zip(buffers, keys)],
        "relocate_inplace": lambda: [cpu_relocate.rotate_cpu_inplace(w, cos, sin, pairing) for w in work],
    }


def _time_reference(keys: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> float:
    """One pass of the plain `rotate_reference` over all layers (context for the speedup)."""
    return _time_once(lambda: [rotate_reference(k, cos, sin, pairing) for k in keys])


def _first_call_seconds(keys: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> dict:
    """Seconds of the kernel build/load (first use in this process) and of the first call."""
    start = time.perf_counter()
    status = cpu_relocate.kernel_status()  # builds or loads the C kernel
    load_s = time.perf_counter() - start
    first = _time_once(lambda: cpu_relocate.rotate_cpu(keys[0], cos, sin, pairing))
    return {"kernel_build_or_load": load_s, "first_call": first, "status": status}


def _path(status: dict, dtype: torch.dtype) -> str:
    """Which implementation the timed relocation ran."""
    supported = f"{dtype}/float32".replace("torch.", "")
    if status["available"] and supported in status["dtypes"]:
        return "C kernel (ctypes, OpenMP), one read + one write pass"
    return f"rotate_reference fallback ({status['reason'] or 'dtype not supported by the C kernel'})"


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark described by `args`; returns the results dict (also what --json writes)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    spec = _qwen_like_spec(args.head_dim, args.layers, args.pairing)
    cos, sin = phases(spec, args.delta)  # [head_dim // 2] float32
    keys = _make_keys(args, dtype)
    bytes_per_layer = keys[0].numel() * keys[0].element_size()
    total_bytes = bytes_per_layer * args.layers
    moved = 2 * total_bytes  # read + write

    first = _first_call_seconds(keys, cos, sin, args.pairing)
    numerics = check_numerics(keys, cos, sin, args.pairing)
    times = time_interleaved(_ops(keys, cos, sin, args.pairing), args.repeats, args.warmup)
    reference_s = _time_reference(keys, cos, sin, args.pairing)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    paired = [c / r for c, r in zip(times["clone"], times["relocate"])]
    paired_into = [c / r for c, r in zip(times["copy_into"], times["relocate_into"])]
    paired_inplace = [c / r for c, r in zip(times["copy_into"], times["relocate_inplace"])]
    return {
        "ratio_vs_copy": med["clone"] / med["relocate"],
        "ratio_kind": "out-of-place rotate_cpu vs clone of the same keys (both allocate their result)",
        "ratio_vs_copy_paired_median": statistics.median(paired),
        "tokens": args.tokens,
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": str(dtype).replace("torch.", ""),
        "pairing": args.pairing,
        "delta": args.delta,
        "bytes_per_layer": bytes_per_layer,
        "total_bytes": total_bytes,
        "bytes_counted_per_pass": moved,
        "gbytes_per_s": _gbps(moved, med["relocate"]),
        "copy_gbytes_per_s": _gbps(moved, med["clone"]),
        "into": {
            "ratio_vs_copy_into": med["copy_into"] / med["relocate_into"],
            "ratio_kind": "rotate_cpu_into an existing buffer vs copy_ into an existing buffer",
            "ratio_paired_median": statistics.median(paired_into),
            "gbytes_per_s": _gbps(moved, med["relocate_into"]),
            "copy_into_gbytes_per_s": _gbps(moved, med["copy_into"]),
        },
        "inplace": {
            "ratio_vs_copy_into": med["copy_into"] / med["relocate_inplace"],
            "ratio_kind": "rotate_cpu_inplace vs copy_ into an existing buffer",
            "ratio_paired_median": statistics.median(paired_inplace),
            "gbytes_per_s": _gbps(moved, med["relocate_inplace"]),
            "copy_into_gbytes_per_s": _gbps(moved, med["copy_into"]),
        },
        "reference_gbytes_per_s": _gbps(moved, reference_s),
        "speedup_vs_reference": reference_s / med["relocate"],
        **{k: v for k, v in numerics.items() if k != "ok"},
        "numerics_ok": numerics["ok"],
        "threads": torch.get_num_threads(),
        "path": _path(first["status"], dtype),
        "kernel": first["status"],
        "compile_s": first["status"]["build_s"],
        "compile_cached": first["status"]["cached"],
        "first_call_s": first["first_call"],
        "timing": {"method": TIMING_METHOD, "repeats": args.repeats, "warmup": args.warmup,
                   "reference_repeats": 1},
        "clone_over_copy_into": med["clone"] / med["copy_into"],
        "median_s": med,
        "times_s": times,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(),
    }


def format_table(r: dict) -> str:
    """The human-readable summary printed by the command."""
    mib = r["total_bytes"] / 2**20
    lines = [
        f"relocate {r['tokens']} tokens × {r['layers']} layers × {r['kv_heads']} kv heads × {r['head_dim']} "
        f"({r['dtype']}, {r['pairing']}): {mib:.1f} MiB of keys; {r['threads']} threads",
        f"{'op':<20} {'median ms':>10} {'GB/s':>8}",
    ]
    rates = {
        "clone": r["copy_gbytes_per_s"], "relocate": r["gbytes_per_s"],
        "copy_into": r["inplace"]["copy_into_gbytes_per_s"], "relocate_into": r["into"]["gbytes_per_s"],
        "relocate_inplace": r["inplace"]["gbytes_per_s"],
    }
    for name, rate in rates.items():
        lines.append(f"{name:<20} {1e3 * r['median_s'][name]:>10.2f} {rate:>8.2f}")
    lines.append(f"{'rotate_reference':<20} {'':>10} {r['reference_gbytes_per_s']:>8.2f}")
    lines += [
        f"ratio_vs_copy (relocate / clone)          {r['ratio_vs_copy']:.3f} "
        f"(paired median {r['ratio_vs_copy_paired_median']:.3f})",
        f"into buffer (relocate_into / copy_into)   {r['into']['ratio_vs_copy_into']:.3f}",
        f"in place (relocate_inplace / copy_into)   {r['inplace']['ratio_vs_copy_into']:.3f}",
        f"speedup vs rotate_reference               {r['speedup_vs_reference']:.1f}x",
        f"max abs err vs reference {r['max_abs_err_vs_reference']:.3g} "
        f"({r['max_ulp_err_vs_reference']:.2g} ulp); path: {r['path']}",
        f"kernel {'loaded from cache' if r['compile_cached'] else 'built'} in {r['compile_s'] or 0:.2f} s, "
        f"first call {1e3 * r['first_call_s']:.1f} ms; clone / copy_into time {r['clone_over_copy_into']:.2f} "
        "(>1: fresh memory costs page faults, for clone and relocate alike)",
    ]
    return "\n".join(lines)


def failure(results: dict, min_ratio: float | None) -> str | None:
    """Why the run fails (numerics beyond one ulp, or ratio_vs_copy under `min_ratio`), or None."""
    if not results["numerics_ok"]:
        return (f"fast CPU relocation disagrees with rotate_reference beyond one {results['dtype']} ulp "
                f"(max {results['max_ulp_err_vs_reference']:.3g} ulp)")
    if min_ratio is not None and results["ratio_vs_copy"] < min_ratio:
        return f"ratio_vs_copy {results['ratio_vs_copy']:.3f} < --min-ratio {min_ratio}"
    return None
