"""The Triton relocate kernel against its torch reference.

Correctness runs on CPU through the Triton interpreter. `triton.jit` picks interpreted or compiled
when the kernel module is imported, so those checks run in one child process started with
TRITON_INTERPRET=1 (this file run as a script); pytest's own process never imports
the Triton kernel modules, whatever other tests do before or after. A second child, without the
interpreter, compiles the kernel for sm_90 — that needs no GPU and catches code the interpreter
accepts but the compiler does not. The `gpu` test runs the compiled kernel where CUDA exists.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from kamera_core import backends

if __package__:  # imported by pytest; run as a script, the child needs no test helpers
    from tests.kernel_children import check_case, run_cases

REPO = Path(__file__).resolve().parents[2]

# name: (middle dims, head_dim, rotary_dim, pairing)
LAYOUTS = {
    "mha": ((4,), 64, 64, "half"),
    "gqa": ((2,), 64, 64, "half"),
    "mla_half": ((), 64, 64, "half"),  # k_rope [tokens, rope_dim]: no middle dim
    "mla_interleaved": ((), 64, 64, "interleaved"),  # DeepSeek-V2's complex-form pairs
    "neox_partial": ((4,), 64, 16, "half"),  # GPT-NeoX rotary_pct 0.25: dims 16.. copied
    "odd_head": ((2,), 48, 48, "half"),  # no power of two anywhere: every mask matters
    "odd_interleaved": ((3,), 48, 40, "interleaved"),  # 20 pairs, 8 copied dims, 3 heads
}
TOKENS = (1, 7, 19, 200)
DTYPES = ("float32", "bfloat16", "float16")
RANKS = (0, 1, 16)  # 0: no patch

# name: (layout, dtype, delta, rank, backend of the kernel side)
PUBLIC_CASES = {
    "mha_bf16_shift4096_rank4": ("mha", "bfloat16", 4096, 4, "triton"),
    "gqa_fp32_back123_rank1": ("gqa", "float32", -123, 1, "triton"),
    "mla_interleaved_fp16_shift77": ("mla_interleaved", "float16", 77, 0, "triton"),
    "neox_fp32_shift100000_rank16": ("neox_partial", "float32", 100_000, 16, "triton"),
    "odd_bf16_shift5": ("odd_head", "bfloat16", 5, 0, "triton"),
    "mha_fp64_shift31_rank2": ("mha", "float64", 31, 2, "triton"),
    # backend="auto" picks the kernel for CPU tensors when TRITON_INTERPRET=1.
    "mla_half_fp32_auto_rank3": ("mla_half", "float32", 999, 3, "auto"),
}


def kernel_case_ids() -> list[str]:
    return [
        f"{layout}-T{tokens}-{dtype}-r{rank}"
        for layout, tokens, dtype, rank in itertools.product(LAYOUTS, TOKENS, DTYPES, RANKS)
    ]


def _parse_case(case_id: str) -> tuple[str, int, str, int]:
    layout, tokens, dtype, rank = case_id.split("-")
    return layout, int(tokens[1:]), dtype, int(rank[1:])


def _inv_freq(rotary_dim: int, base: float = 10000.0) -> tuple[float, ...]:
    freqs = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    return tuple(freqs.tolist())


def _make_inputs(
    layout: str, tokens: int, dtype: torch.dtype, rank: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """keys `[tokens, *mid, head_dim]` (|k| up to ~15, like real keys) and patch factors or None."""
    mid, head_dim, _, _ = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    keys = (3.0 * torch.randn(tokens, *mid, head_dim, generator=gen)).to(dtype)
    if rank == 0:
        return keys, None, None
    u = (0.5 * torch.randn(tokens, rank, generator=gen)).to(dtype)  # (T, rank)
    vt = (0.5 * torch.randn(rank, *mid, head_dim, generator=gen)).to(dtype)  # (rank, *mid, D)
    return keys, u, vt


def _max_abs(t: torch.Tensor) -> float:
    return t.double().abs().max().item() if t.numel() else 0.0


def _result(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max |out − ref| and max |ref| as floats (JSON-able), and whether shape and dtype agree."""
    same = out.shape == ref.shape and out.dtype == ref.dtype
    diff = _max_abs(out.double() - ref.double()) if same else float("inf")
    return {"max_diff": diff, "max_ref": _max_abs(ref), "same_shape_dtype": same}


def _run_kernel_case(case_id: str) -> dict:
    from kamera_core.relocate import phases, rotate_reference
    from kamera_core.rope import RopeSpec
    from kamera_core.relocate.triton_launch import rotate_triton

    layout, tokens, dtype_name, rank = _parse_case(case_id)
    _, head_dim, rotary_dim, pairing = LAYOUTS[layout]
    spec = RopeSpec(inv_freq=_inv_freq(rotary_dim), head_dim=head_dim, pairing=pairing)
    cos, sin = phases(spec, 1234)
    keys, u, vt = _make_inputs(layout, tokens, getattr(torch, dtype_name), rank, seed=tokens * 31 + rank)
    out = rotate_triton(keys, cos, sin, pairing, u, vt)
    return _result(out, rotate_reference(keys, cos, sin, pairing, u, vt))


def _run_public_case(name: str) -> dict:
    from kamera_core.relocate import relocate_keys
    from kamera_core.rope import RopeSpec

    layout, dtype_name, delta, rank, backend = PUBLIC_CASES[name]
    _, head_dim, rotary_dim, pairing = LAYOUTS[layout]
    spec = RopeSpec(inv_freq=_inv_freq(rotary_dim, base=1e6), head_dim=head_dim, pairing=pairing)
    keys, u, vt = _make_inputs(layout, 37, getattr(torch, dtype_name), rank, seed=7)
    patch = None if u is None else (u, vt)
    out = relocate_keys(keys, spec, delta, patch=patch, backend=backend)
    return _result(out, relocate_keys(keys, spec, delta, patch=patch, backend="torch"))


def _extra_cases() -> dict[str, object]:
    """Inputs the launcher must normalise: non-contiguous keys, two middle dims, no tokens.

    Each value is a thunk returning `_result(kernel, reference)`.
    """
    from kamera_core.relocate import phases, rotate_reference
    from kamera_core.rope import RopeSpec
    from kamera_core.relocate.triton_launch import rotate_triton

    spec = RopeSpec(inv_freq=_inv_freq(32), head_dim=48, pairing="interleaved")
    cos, sin = phases(spec, -50)
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(48, 9, 3, generator=gen).permute(1, 2, 0)  # (9, 3, 48), not contiguous
    deep = torch.randn(5, 2, 3, 48, generator=gen)  # (T, 2, 3, D): two middle dims
    u, vt = torch.randn(5, 2, generator=gen), torch.randn(2, 2, 3, 48, generator=gen)

    def compare(k: torch.Tensor, u: torch.Tensor | None = None, vt: torch.Tensor | None = None) -> dict:
        out = rotate_triton(k, cos, sin, "interleaved", u, vt)
        return _result(out, rotate_reference(k, cos, sin, "interleaved", u, vt))

    return {
        "extra-noncontiguous": lambda: compare(keys),
        "extra-two-middle-dims": lambda: compare(deep, u, vt),
        "extra-zero-tokens": lambda: compare(keys[:0]),
    }


def _interpreter_main() -> None:
    """Child process (TRITON_INTERPRET=1): one JSON line per case on stdout."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    runs = [(cid, lambda c=cid: _run_kernel_case(c)) for cid in kernel_case_ids()]
    runs += [(f"public-{name}", lambda n=name: _run_public_case(n)) for name in PUBLIC_CASES]
    runs += list(_extra_cases().items())
    for case_id, run in runs:
        try:
            result = run()
        except Exception as err:  # reported per case, so one failure does not hide the others
            result = {"error": repr(err)}
        print(json.dumps({"id": case_id, **result}), flush=True)


def _compile_main() -> None:
    """Child process (no interpreter): compile the kernel variants for sm_90, no GPU needed.

    Also checks that a CPU launch after the kernel was compiled-decorated is refused clearly.
    """
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kamera_core.relocate.triton_kernel import relocate_kernel

    variants = [
        # (key dtype, head_dim, half, interleaved, has_patch, compute)
        ("bf16", 128, 64, False, False, tl.float32),
        ("bf16", 128, 64, True, True, tl.float32),
        ("fp16", 64, 8, False, True, tl.float32),
        ("fp32", 48, 24, True, False, tl.float32),
        ("fp64", 48, 16, True, True, tl.float64),
    ]
    names = relocate_kernel.arg_names
    for key_ty, head_dim, half, interleaved, has_patch, compute in variants:
        block_half = 1 << (half - 1).bit_length()
        consts = {
            "HEAD_DIM": head_dim,
            "HALF": half,
            "INTERLEAVED": interleaved,
            "HAS_PATCH": has_patch,
            "HAS_PASS": head_dim > 2 * half,
            "COMPUTE": compute,
            "BLOCK_ROWS": 32,
            "BLOCK_HALF": block_half,
            "BLOCK_PASS": max(1, 1 << max(0, head_dim - 2 * half - 1).bit_length()),
        }
        phase_ty = "fp64" if compute == tl.float64 else "fp32"
        signature = {n: f"*{key_ty}" for n in ("keys_ptr", "out_ptr", "u_ptr", "vt_ptr")}
        signature |= {"cos_ptr": f"*{phase_ty}", "sin_ptr": f"*{phase_ty}"}
        signature |= {"num_rows": "i32", "rest": "i32", "rank": "i32"}
        signature |= {n: "constexpr" for n in consts}
        constexprs = {(names.index(n),): v for n, v in consts.items()}
        src = ASTSource(fn=relocate_kernel, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        case_id = f"compile-{key_ty}-{head_dim}-{half}-{interleaved}-{has_patch}"
        print(json.dumps({"id": case_id, "cubin_bytes": len(compiled.asm["cubin"])}))

    from kamera_core.relocate.triton_launch import rotate_triton

    os.environ["TRITON_INTERPRET"] = "1"  # too late: kamera_core read the environment when imported above
    try:
        rotate_triton(torch.zeros(2, 8), torch.ones(4), torch.zeros(4), "half")
        message = ""
    except ValueError as err:
        message = str(err)
    print(json.dumps({"id": "late-interpret", "message": message}))


def _run_child(mode: str, interpret: bool) -> dict[str, dict]:
    return run_cases(__file__, mode, interpret)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    return _run_child("--interpreter-cases", interpret=True)


@pytest.fixture(scope="module")
def compile_results() -> dict[str, dict]:
    return _run_child("--compile-cases", interpret=False)


def _tolerance(dtype_name: str, max_ref: float) -> float:
    # float32: products and the rank sum may round in another order (FMA, matmul blocking), a few
    # ulps of the largest value. Half types: both sides round one float32 result once, so at most
    # one ulp apart (the interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest).
    if dtype_name == "float64":
        return 1e-12 * max_ref
    if dtype_name == "float32":
        return 1e-6 * max_ref
    return 2 * torch.finfo(getattr(torch, dtype_name)).eps * max_ref


def _check(results: dict[str, dict], case_id: str, dtype_name: str) -> None:
    result = results.get(case_id, {})
    check_case(results, case_id, _tolerance(dtype_name, result.get("max_ref", 0.0)))


@pytest.mark.parametrize("case_id", kernel_case_ids())
def test_kernel_matches_reference(interpreter_results: dict, case_id: str) -> None:
    _check(interpreter_results, case_id, _parse_case(case_id)[2])


@pytest.mark.parametrize("name", list(PUBLIC_CASES))
def test_relocate_keys_triton_matches_torch(interpreter_results: dict, name: str) -> None:
    _check(interpreter_results, f"public-{name}", PUBLIC_CASES[name][1])


@pytest.mark.parametrize("case_id", ["extra-noncontiguous", "extra-two-middle-dims", "extra-zero-tokens"])
def test_launcher_normalises_inputs(interpreter_results: dict, case_id: str) -> None:
    _check(interpreter_results, case_id, "float32")


def test_kernel_compiles_for_sm90_without_gpu(compile_results: dict) -> None:
    assert "__crash__" not in compile_results, compile_results["__crash__"]["error"]
    compiled = {k: v for k, v in compile_results.items() if k.startswith("compile-")}
    assert len(compiled) == 5 and all(v["cubin_bytes"] > 0 for v in compiled.values()), compiled


def test_cpu_launch_after_compiled_import_is_refused(compile_results: dict) -> None:
    assert "__crash__" not in compile_results, compile_results["__crash__"]["error"]
    assert "before kamera_core is imported" in compile_results["late-interpret"]["message"]


# Validation happens before Triton is imported, so these run in pytest's own process.


def _phases(half: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(half), torch.zeros(half)


def test_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kamera_core.relocate.triton_launch import rotate_triton

    monkeypatch.setattr(backends, "INTERPRET", False)  # as if TRITON_INTERPRET were unset at import
    with pytest.raises(ValueError, match="backend='torch'"):
        rotate_triton(torch.zeros(3, 2, 64), *_phases(), "half")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"pairing": "rotate_half"}, ValueError, "rotate_half"),
        ({"keys": torch.zeros(3, 2, 64, dtype=torch.int32)}, TypeError, "int32"),
        ({"keys": torch.zeros(3, 2, 40)}, ValueError, "exceeds head_dim 40"),
        ({"cos": torch.ones(16)}, ValueError, "cos and sin must agree"),
        ({"cos": torch.ones(32, dtype=torch.bfloat16)}, TypeError, "bfloat16"),
        ({"u": torch.zeros(3, 2)}, ValueError, "both patch factors"),
        ({"u": torch.zeros(4, 2), "vt": torch.zeros(2, 2, 64)}, ValueError, "tokens=3"),
        ({"u": torch.zeros(3, 2), "vt": torch.zeros(2, 4, 64)}, ValueError, r"vt must be \[rank=2"),
        ({"u": torch.zeros(3, 0), "vt": torch.zeros(0, 2, 64)}, ValueError, "rank must be >= 1"),
        ({"keys": torch.zeros(3, 2, 64, device="meta")}, ValueError, "meta"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, error: type, match: str) -> None:
    from kamera_core.relocate.triton_launch import rotate_triton

    cos, sin = _phases()
    args = {"keys": torch.zeros(3, 2, 64), "cos": cos, "sin": sin, "pairing": "half"} | kwargs
    with pytest.raises(error, match=match):
        rotate_triton(**args)


def test_missing_triton_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from kamera_core.relocate.triton_launch import rotate_triton

    monkeypatch.setattr(backends, "INTERPRET", True)  # as if TRITON_INTERPRET=1 at import
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    with pytest.raises(ImportError, match="backend='torch'"):
        rotate_triton(torch.zeros(3, 2, 64), *_phases(), "half")


@pytest.mark.gpu
def test_kernel_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; the interpreter tests cover correctness on CPU")
    from kamera_core.relocate import phases, rotate_reference
    from kamera_core.rope import RopeSpec
    from kamera_core.relocate.triton_launch import rotate_triton

    cases = [
        ("mha", "bfloat16", 0),
        ("mla_interleaved", "float16", 16),
        ("odd_head", "float32", 1),
        ("neox_partial", "bfloat16", 4),
    ]
    for layout, dtype_name, rank in cases:
        _, head_dim, rotary_dim, pairing = LAYOUTS[layout]
        cos, sin = phases(RopeSpec(inv_freq=_inv_freq(rotary_dim), head_dim=head_dim, pairing=pairing), 4321)
        keys, u, vt = _make_inputs(layout, 1000, getattr(torch, dtype_name), rank, seed=11)
        keys, u, vt = (None if t is None else t.cuda() for t in (keys, u, vt))
        out = rotate_triton(keys, cos, sin, pairing, u, vt)
        result = _result(out, rotate_reference(keys, cos, sin, pairing, u, vt))
        assert result["same_shape_dtype"], (layout, dtype_name, rank)
        limit = _tolerance(dtype_name, result["max_ref"])
        assert result["max_diff"] <= limit, (layout, dtype_name, rank, result)


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-cases"]:
        _interpreter_main()
    elif sys.argv[1:] == ["--compile-cases"]:
        _compile_main()
    else:
        sys.exit(f"usage: {sys.argv[0]} --interpreter-cases | --compile-cases")
