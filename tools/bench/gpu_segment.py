"""GPU check of the Triton segment attention (`python -m tools.gpu_segment_check`): error against
the torch reference, and speed against attention over one contiguous cache holding the same tokens.

On a machine with a CUDA GPU this takes a minute or two, mostly Triton compiling its variants (not
yet measured on a GPU); with `--tiny` under TRITON_INTERPRET=1 it is a CPU smoke test of seconds.

What it does, for a Llama-3-8B-like layer by default (32 query heads, 8 KV heads, head_dim 128,
rope_theta 5e5), bfloat16:
- correctness: `segment_attention_triton` against `segment_attention_reference` in float32 and
  bfloat16, with rank-16 patches (float32 and int8 factors), a sliding window and a softcap, for
  decode (Tq = 1) and Tq = 16 over 8k and 32k keys;
- timing, for 4 / 16 / 64 segments × Tq 1 / 16 × 8k / 32k keys: each segment is its own tensor of
  chunk-local keys placed by a shift (the case the kernel exists for); the baseline is one
  contiguous cache of the same tokens, already in place (keys relocated and concatenated outside
  the timed loop), read by torch SDPA (bottom-right causal for Tq > 1) and, where installed,
  flash-attn's `flash_attn_func`. The kernel's time is the whole call (table built on the host,
  one host-to-device copy, kernel, merge); `host_ms` is the wall time of the call's host side.
  `agree_sdpa_max_abs` checks that both read the same attention (shift semantics end to end);
- knobs: block_n × num_warps, and the decode split count, at 32k keys and 16 segments.

`find_device(args)` picks the device, `measure(args, device, name)` returns the summary (checks,
timings, knobs), `format_tables(summary)` the printed tables and `passed(summary)` the verdict.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from tools.bench.runs import device_time_ms


def apply_tiny(args: argparse.Namespace) -> argparse.Namespace:
    """Tiny shapes for `--tiny` (a smoke test; CPU under TRITON_INTERPRET=1)."""
    if args.tiny:
        args.heads, args.kv_heads, args.head_dim = 4, 2, 16
        args.keys, args.segments, args.tq, args.rank = "40,67", "2,5", "1,3", 2
        args.warmup, args.iters, args.repeats = 1, 1, 1
    return args


def ints(text: str) -> list[int]:
    """The integers of a comma-separated list."""
    return [int(x) for x in text.split(",") if x]


def host_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean wall milliseconds of the calls' host side (no synchronisation inside the loop)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - t0) * 1e3 / iters
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed


def make_spec(args: argparse.Namespace):
    from kamera_core.rope import RopeSpec

    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    return RopeSpec(inv_freq=tuple(inv_freq.tolist()), head_dim=args.head_dim, pairing="half")


def _factors(gen: torch.Generator, device: torch.device, tokens: int, rank: int, kv: int, dim: int, int8: bool):
    from kamera_core.patch import Factors

    u = 0.3 * torch.randn(tokens, rank, generator=gen, device=device)  # (T, m)
    vt = 0.3 * torch.randn(rank, kv, dim, generator=gen, device=device)  # (m, Hkv, D)
    if not int8:
        return Factors(u, vt)
    us, vs = u.abs().amax(0) / 127, vt.abs().amax((1, 2)) / 127
    return Factors((u / us).round().to(torch.int8), (vt / vs[:, None, None]).round().to(torch.int8), us, vs)


def make_segments(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, num_keys: int,
                  num_segments: int, rank: int, seed: int):
    """Segments covering token indices [0, num_keys): random lengths, each its own tensors of
    chunk-local keys `[T, Hkv, D]` (shift = first) and values; rank > 0 adds patches (int8 value
    factors on odd segments)."""
    from kamera_core.patch import LayerPatch
    from kamera_core.segment import Segment

    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(num_keys - 1, generator=cpu_gen)[: num_segments - 1] + 1  # distinct, in [1, N)
    bounds = [0, *sorted(cuts.tolist()), num_keys]
    segments = []
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        keys = (3.0 * torch.randn(b - a, args.kv_heads, args.head_dim, generator=gen, device=device)).to(dtype)
        values = torch.randn(b - a, args.kv_heads, args.head_dim, generator=gen, device=device).to(dtype)
        patch = None
        if rank:
            patch = LayerPatch(_factors(gen, device, b - a, rank, args.kv_heads, args.head_dim, False),
                               _factors(gen, device, b - a, rank, args.kv_heads, args.head_dim, n % 2 == 1))
        segments.append(Segment(keys, values, a, a, patch))
    return segments


def make_query(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, num_keys: int, tq: int, seed: int):
    """(query [Tq, Hq, D], query_index [Tq] on the CPU): the last Tq tokens."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    query = (2.0 * torch.randn(tq, args.heads, args.head_dim, generator=gen, device=device)).to(dtype)
    return query, torch.arange(num_keys - tq, num_keys)


def contiguous_cache(segments, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tokens as one cache: keys placed at their positions, `[N, Hkv, D]` and `[N, Hkv, Dv]`."""
    from kamera_core.relocate import relocate_keys

    keys = torch.cat([relocate_keys(s.keys, spec, s.shift, backend="torch") for s in segments])
    return keys, torch.cat([s.values for s in segments])


def max_abs(t: torch.Tensor) -> float:
    return t.double().abs().max().item()


def tolerance(dtype: torch.dtype, max_ref: float) -> float:
    """float32: online softmax and tf32x3 dots vs the reference's einsums, a few 1e-6 relative.
    bfloat16: both sides round a float32 result once; 2 ulps of the largest value."""
    if dtype == torch.float32:
        return 2e-5 * max_ref
    return 2 * torch.finfo(dtype).eps * max_ref


def check_cases(args: argparse.Namespace) -> list[dict]:
    keys = ints(args.keys)
    small, large = keys[0], keys[-1]
    segs = ints(args.segments)
    tqs = ints(args.tq)
    window = max(2, large // 8)
    return [
        dict(dtype="bfloat16", keys=small, segments=segs[len(segs) // 2], tq=tqs[-1], rank=args.rank),
        dict(dtype="bfloat16", keys=large, segments=segs[-1], tq=tqs[0], rank=args.rank, window=window, softcap=50.0),
        dict(dtype="float32", keys=small, segments=segs[0], tq=tqs[-1], rank=args.rank, softcap=30.0),
        dict(dtype="float32", keys=large, segments=segs[len(segs) // 2], tq=tqs[0], rank=0, window=window),
    ]


def run_checks(args: argparse.Namespace, device: torch.device, spec) -> list[dict]:
    from kamera_core.segment import segment_attention_reference
    from kamera_core.segment.triton_launch import segment_attention_triton

    records = []
    for n, case in enumerate(check_cases(args)):
        dtype = getattr(torch, case["dtype"])
        segments = make_segments(args, device, dtype, case["keys"], case["segments"], case["rank"], seed=100 + n)
        query, qi = make_query(args, device, dtype, case["keys"], case["tq"], seed=100 + n)
        kw = {"window": case.get("window"), "softcap": case.get("softcap")}
        scaling = args.head_dim**-0.5
        out = segment_attention_triton(query, qi, segments, spec, scaling, **kw)
        ref = segment_attention_reference(query, qi, segments, spec, scaling, **kw)
        err, top = max_abs(out.double() - ref.double()), max_abs(ref)
        records.append(case | {"max_abs_err": err, "max_abs_ref": top, "ok": bool(err <= tolerance(dtype, top)),
                               "same_shape_dtype": out.shape == ref.shape and out.dtype == ref.dtype})
    return records


def _flash_attn():
    """flash_attn_func where the flash-attn package is installed, else None."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def run_timings(args: argparse.Namespace, device: torch.device, spec) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from kamera_core.segment.triton_launch import segment_attention_triton

    flash = _flash_attn() if device.type == "cuda" else None
    dtype = torch.bfloat16
    scaling = args.head_dim**-0.5

    def timed(fn: Callable[[], object]) -> float:
        return device_time_ms(fn, device, args.warmup, args.iters, args.repeats)

    records = []
    for num_keys in ints(args.keys):
        for num_segments in ints(args.segments):
            seed = num_keys + num_segments
            segments = make_segments(args, device, dtype, num_keys, num_segments, 0, seed=seed)
            patched = make_segments(args, device, dtype, num_keys, num_segments, args.rank, seed=seed)
            k_flat, v_flat = contiguous_cache(segments, spec)  # (N, Hkv, D)
            k_sdpa = k_flat.permute(1, 0, 2).unsqueeze(0).contiguous()  # (1, Hkv, N, D)
            v_sdpa = v_flat.permute(1, 0, 2).unsqueeze(0).contiguous()
            for tq in ints(args.tq):
                query, qi = make_query(args, device, dtype, num_keys, tq, seed=seed)
                q_sdpa = query.permute(1, 0, 2).unsqueeze(0)  # (1, Hq, Tq, D)
                mask, mask_kind = (causal_lower_right(tq, num_keys), "causal_lower_right") if tq > 1 else (None, "none")

                def kernel(segs=segments, q=query, qi=qi):
                    return segment_attention_triton(q, qi, segs, spec, scaling)

                def sdpa(q=q_sdpa):
                    return F.scaled_dot_product_attention(q, k_sdpa, v_sdpa, attn_mask=mask, scale=scaling,
                                                          enable_gqa=True)

                out = kernel()
                try:
                    base = sdpa()
                except RuntimeError as err:  # a torch whose lower-right causal path refuses GQA: a bool mask
                    print(f"SDPA with {mask_kind} failed ({err}); using a boolean mask", file=sys.stderr)
                    qi_dev = qi.to(device)
                    mask = qi_dev[:, None] >= torch.arange(num_keys, device=device)[None, :]  # (Tq, N)
                    mask_kind = "bool"
                    base = sdpa()
                base = base[0].permute(1, 0, 2)  # (Tq, Hq, D)
                record = {
                    "keys": num_keys, "segments": num_segments, "tq": tq, "dtype": "bfloat16", "sdpa_mask": mask_kind,
                    "triton_ms": timed(kernel),
                    "triton_patched_ms": timed(lambda segs=patched, q=query, qi=qi: segment_attention_triton(
                        q, qi, segs, spec, scaling)),
                    "host_ms": host_ms(kernel, device, max(1, args.iters)),
                    "sdpa_ms": timed(sdpa),
                    "agree_sdpa_max_abs": max_abs(out.double() - base.double()),
                    "max_abs_out": max_abs(base),
                }
                if flash is not None:
                    k_fa, v_fa, q_fa = k_flat.unsqueeze(0), v_flat.unsqueeze(0), query.unsqueeze(0)  # (1, T, H, D)
                    record["flash_ms"] = timed(lambda q=q_fa: flash(q, k_fa, v_fa, softmax_scale=scaling, causal=True))
                record["ratio_vs_sdpa"] = record["triton_ms"] / record["sdpa_ms"]
                records.append(record)
    return records


def run_tuning(args: argparse.Namespace, device: torch.device, spec) -> list[dict]:
    """The kernel's knobs at the largest key count and the middle segment count: block_n ×
    num_warps for each Tq, and the split count around its default for decode."""
    from triton.runtime.errors import OutOfResources

    from kamera_core.segment.triton_launch import segment_attention_triton

    num_keys, segs = ints(args.keys)[-1], ints(args.segments)
    num_segments = segs[len(segs) // 2]
    scaling = args.head_dim**-0.5
    segments = make_segments(args, device, torch.bfloat16, num_keys, num_segments, 0, seed=7)
    blocks, warps = ((16, 32), (4,)) if args.tiny else ((32, 64), (4, 8))
    records = []
    for tq in ints(args.tq):
        query, qi = make_query(args, device, torch.bfloat16, num_keys, tq, seed=7)
        knobs = [{"block_n": b, "num_warps": w} for b in blocks for w in warps]
        if tq == 1:
            knobs += [{"num_splits": n} for n in (4, 16, 32, 64, 128)]
        for knob in knobs:
            def call(q=query, qi=qi, knob=knob):
                return segment_attention_triton(q, qi, segments, spec, scaling, **knob)

            record = {"keys": num_keys, "segments": num_segments, "tq": tq} | knob
            try:
                record["triton_ms"] = device_time_ms(call, device, args.warmup, args.iters, args.repeats)
            except OutOfResources as err:  # a block too large for shared memory: reported, not fatal
                record["error"] = str(err)
            records.append(record)
    return records


def format_tables(summary: dict) -> str:
    """The correctness checks, the timings and the knobs as printed tables."""
    lines = []
    lines.append(f"{summary['device']}: Hq {summary['heads']}, Hkv {summary['kv_heads']}, head_dim {summary['head_dim']}")
    lines.append("correctness against segment_attention_reference:")
    for c in summary["checks"]:
        extra = "".join(f" {k}={c[k]}" for k in ("window", "softcap") if c.get(k) is not None)
        shape = f"keys {c['keys']:>6} segs {c['segments']:>3} tq {c['tq']:>3} rank {c['rank']:>2}"
        lines.append(f"  {c['dtype']:<9} {shape}{extra}: "
                     f"max err {c['max_abs_err']:.3g} (max |ref| {c['max_abs_ref']:.3g}) {'ok' if c['ok'] else 'FAIL'}")
    lines.append(f"{'keys':>6}{'segs':>6}{'tq':>4}{'triton ms':>11}{'+patch ms':>11}{'host ms':>9}{'sdpa ms':>9}"
                 f"{'flash ms':>10}{'× sdpa':>8}{'|Δ| vs sdpa':>13}")
    for r in summary["timings"]:
        flash = f"{r['flash_ms']:>10.4f}" if "flash_ms" in r else f"{'-':>10}"
        lines.append(f"{r['keys']:>6}{r['segments']:>6}{r['tq']:>4}{r['triton_ms']:>11.4f}{r['triton_patched_ms']:>11.4f}"
                     f"{r['host_ms']:>9.3f}{r['sdpa_ms']:>9.4f}{flash}{r['ratio_vs_sdpa']:>8.2f}"
                     f"{r['agree_sdpa_max_abs']:>13.3g}")
    lines.append("knobs (default: block_n 64, num_warps 4 / 8 for 64-row blocks, splits to fill the GPU):")
    for r in summary["tuning"]:
        knob = " ".join(f"{k}={r[k]}" for k in ("block_n", "num_warps", "num_splits") if k in r)
        ms = f"{r['triton_ms']:.4f} ms" if "triton_ms" in r else r["error"]
        lines.append(f"  keys {r['keys']} segs {r['segments']} tq {r['tq']} {knob}: {ms}")
    return "\n".join(lines)


def find_device(args: argparse.Namespace) -> tuple[torch.device, str] | None:
    """(device, its name): the first CUDA GPU, or the CPU under TRITON_INTERPRET=1 with --tiny;
    None when neither is available."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        device = torch.device("cuda", 0)
        return device, torch.cuda.get_device_name(device)
    if os.environ.get("TRITON_INTERPRET") == "1" and args.tiny:
        return torch.device("cpu"), "cpu (Triton interpreter)"
    return None


def measure(args: argparse.Namespace, device: torch.device, name: str) -> dict:
    """Correctness checks, timings and knobs on `device`; the JSON summary."""
    import triton

    started = time.perf_counter()
    spec = make_spec(args)
    checks = run_checks(args, device, spec)
    timings = run_timings(args, device, spec)
    tuning = run_tuning(args, device, spec)
    return {
        "device": name, "torch": torch.__version__, "triton": triton.__version__, "tiny": args.tiny,
        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "rank": args.rank,
        "flash_attn": _flash_attn() is not None, "checks": checks, "timings": timings, "tuning": tuning,
        "all_checks_ok": all(c["ok"] and c["same_shape_dtype"] for c in checks),
        "seconds": time.perf_counter() - started,
    }


def passed(summary: dict) -> bool:
    """Every correctness check passed and every kernel timing is finite."""
    return summary["all_checks_ok"] and all(math.isfinite(r["triton_ms"]) for r in summary["timings"])
