"""The Triton segment attention kernel against `segment_attention_reference`.

Correctness runs on CPU through the Triton interpreter. `triton.jit` picks interpreted or compiled
when the kernel module is imported, so those checks run in one child process started with
TRITON_INTERPRET=1 (this file run as a script); pytest's own process never imports
the Triton kernel modules. A second child, without the interpreter, compiles kernel variants for sm_90
(no GPU needed): that catches code the interpreter accepts but the compiler does not, and checks
that key rows load as 16-byte vectors. The `gpu` test runs the compiled kernel where CUDA exists.

Shapes are tiny and odd (the interpreter is slow): head_dim 16, segments of 1, 7 and 19 keys,
block_n 16 so a 19-key segment spans two blocks, and split counts that cut segments apart.
"""

from __future__ import annotations

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
HEAD_DIM = 16

# name: case. heads (Hq, Hkv); tq query rows ending at token index `last`; segs: (length, first,
# shift, patch rank) in the order given to the kernel; rope: "half" / "interleaved" / "partial"
# (half pairing, rotary_dim 8 of 16); splits/block_n: kernel knobs; half_dot: the two-part
# half-precision dots of the GPU path (float16 only: the interpreter has no bfloat16 dot).
CASES: dict[str, dict] = {
    "gqa-tq3-fp32-three-segs-patched": dict(
        heads=(4, 2), tq=3, last=26, segs=[(7, 0, 0, 0), (19, 7, 123_456, 2), (1, 26, -5, 0)], dtype="float32"),
    "gqa-tq3-fp32-split3-merge": dict(
        heads=(4, 2), tq=3, last=26, segs=[(7, 0, 0, 2), (19, 7, 4096, 2), (1, 26, 26, 0)], dtype="float32",
        splits=3),
    "mha-tq1-bf16-decode-future-seg": dict(  # a segment after the query row: clamped away, never read
        heads=(3, 3), tq=1, last=30, segs=[(19, 12, 1_000_000, 2), (7, 5, 0, 0), (7, 31, 77, 2)],
        dtype="bfloat16", splits=2),
    "gqa-tq3-bf16-window-cuts-seg": dict(  # window 10 at rows 24..26: keys 15.. of a [7, 26) segment
        heads=(4, 2), tq=3, last=26, segs=[(7, 0, 0, 0), (19, 7, 500, 2), (1, 26, 3, 0)], dtype="bfloat16",
        window=10),
    "gqa-tq1-fp32-softcap-window": dict(
        heads=(4, 2), tq=1, last=25, segs=[(19, 0, 9_999, 2), (7, 19, -40, 0)], dtype="float32",
        softcap=2.0, window=12, splits=2),
    "mha-tq3-bf16-softcap": dict(
        heads=(2, 2), tq=3, last=25, segs=[(1, 0, 0, 0), (19, 1, 250_000, 0), (7, 20, 20, 2)], dtype="bfloat16",
        softcap=1.5),
    "gqa-tq3-fp16-half-dot": dict(
        heads=(4, 2), tq=3, last=26, segs=[(19, 0, 31, 2), (7, 19, 0, 0), (1, 26, 1, 0)], dtype="float16",
        half_dot=True, window=20, splits=2),
    "gqa-tq3-fp32-interleaved": dict(
        heads=(4, 1), tq=3, last=26, segs=[(7, 19, 7, 2), (19, 0, -1234, 0), (1, 26, 0, 0)], dtype="float32",
        rope="interleaved"),
    "gqa-tq1-bf16-partial-rotary": dict(
        heads=(4, 2), tq=1, last=26, segs=[(19, 0, 65_536, 2), (7, 19, 19, 0)], dtype="bfloat16", rope="partial"),
}


def _spec(rope: str):
    from kamera_core.rope import RopeSpec

    rotary = HEAD_DIM // 2 if rope == "partial" else HEAD_DIM
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    return RopeSpec(inv_freq=tuple(inv_freq.tolist()), head_dim=HEAD_DIM,
                    pairing="interleaved" if rope == "interleaved" else "half")


def _factors(gen: torch.Generator, tokens: int, rank: int, num_kv: int, int8: bool):
    from kamera_core.patch import Factors

    u = 0.5 * torch.randn(tokens, rank, generator=gen)  # (T, m)
    vt = 0.5 * torch.randn(rank, num_kv, HEAD_DIM, generator=gen)  # (m, Hkv, D)
    if not int8:
        return Factors(u, vt)
    us, vs = u.abs().amax(0) / 127, vt.abs().amax((1, 2)) / 127  # (m,), (m,)
    return Factors((u / us).round().to(torch.int8), (vt / vs[:, None, None]).round().to(torch.int8), us, vs)


def make_inputs(case: dict, seed: int = 0):
    """(query [Tq, Hq, D], query_index [Tq], segments, spec, scaling) for a case."""
    from kamera_core.patch import LayerPatch
    from kamera_core.segment import Segment

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case["dtype"])
    num_heads, num_kv = case["heads"]
    segments = []
    for n, (length, first, shift, rank) in enumerate(case["segs"]):
        keys = (3.0 * torch.randn(length, num_kv, HEAD_DIM, generator=gen)).to(dtype)  # |k| up to ~10
        values = torch.randn(length, num_kv, HEAD_DIM, generator=gen).to(dtype)
        patch = None
        if rank:  # key patch in float32, value patch int8 with scales on odd segments
            key_patch = _factors(gen, length, rank, num_kv, False)
            patch = LayerPatch(key_patch, _factors(gen, length, rank, num_kv, n % 2 == 1))
        segments.append(Segment(keys, values, first, shift, patch))
    query = (2.0 * torch.randn(case["tq"], num_heads, HEAD_DIM, generator=gen)).to(dtype)
    query_index = torch.arange(case["last"] - case["tq"] + 1, case["last"] + 1)
    return query, query_index, segments, _spec(case.get("rope", "half")), HEAD_DIM**-0.5


def _max_abs(t: torch.Tensor) -> float:
    return t.double().abs().max().item() if t.numel() else 0.0


def _result(out: torch.Tensor, ref: torch.Tensor) -> dict:
    same = out.shape == ref.shape and out.dtype == ref.dtype
    diff = _max_abs(out.double() - ref.double()) if same else float("inf")
    return {"max_diff": diff, "max_ref": _max_abs(ref), "same_shape_dtype": same}


def _run_case(name: str) -> dict:
    from kamera_core.segment import segment_attention_reference
    from kamera_core.segment.triton_launch import segment_attention_triton

    case = CASES[name]
    query, query_index, segments, spec, scaling = make_inputs(case)
    kw = {"window": case.get("window"), "softcap": case.get("softcap")}
    out = segment_attention_triton(query, query_index, segments, spec, scaling, **kw,
                                   num_splits=case.get("splits", 1), block_n=16, _half_dot=case.get("half_dot"))
    return _result(out, segment_attention_reference(query, query_index, segments, spec, scaling, **kw))


def _extra_cases() -> dict:
    """Segments as strided views of one cache (no copy), a feature-strided segment (copied), and
    `segment_attention(backend="triton")`. Each value is a thunk returning `_result`."""
    from kamera_core.segment import Segment, segment_attention, segment_attention_reference
    from kamera_core.segment.triton_launch import segment_attention_triton

    gen = torch.Generator().manual_seed(5)
    spec = _spec("half")
    cache = torch.randn(30, 3, 2, HEAD_DIM, generator=gen)  # (T, layers, Hkv, D): token stride 96
    vcache = torch.randn(30, 3, 2, HEAD_DIM, generator=gen)
    strided = torch.randn(7, 2, HEAD_DIM * 2, generator=gen)[..., ::2]  # last dim stride 2
    segments = [Segment(cache[:19, 1], vcache[:19, 1], 0, 0), Segment(strided, cache[19:26, 2], 19, 4000)]
    query = torch.randn(3, 4, HEAD_DIM, generator=gen)
    qi = torch.tensor([23, 24, 25])

    def views() -> dict:
        out = segment_attention_triton(query, qi, segments, spec, 0.3, block_n=16, num_splits=2)
        return _result(out, segment_attention_reference(query, qi, segments, spec, 0.3))

    def dispatch() -> dict:
        out = segment_attention(query, qi, segments, spec, 0.3, window=5, backend="triton")
        return _result(out, segment_attention_reference(query, qi, segments, spec, 0.3, window=5))

    return {"extra-strided-views": views, "extra-dispatch": dispatch}


def _interpreter_main() -> None:
    """Child process (TRITON_INTERPRET=1): one JSON line per case on stdout."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    runs = [(name, lambda n=name: _run_case(n)) for name in CASES] + list(_extra_cases().items())
    for case_id, run in runs:
        try:
            result = run()
        except Exception as err:  # reported per case, so one failure does not hide the others
            result = {"error": repr(err)}
        print(json.dumps({"id": case_id, **result}), flush=True)


# (kv dtype, head_dim, groups, block_m, half_dot, patch, single, interleaved)
COMPILE_VARIANTS = [
    ("bf16", 128, 4, 16, True, False, False, False),  # decode, split-K, GQA 4
    ("bf16", 128, 4, 64, True, True, True, False),  # Tq 16, patched, one split
    ("fp32", 64, 1, 16, False, True, False, True),  # float32 KV: tf32x3 dots, interleaved
]


def _compile_main() -> None:
    """Child process (no interpreter): compile kernel variants for sm_90, no GPU needed.

    Also reports whether key/value tiles load as 16-byte vectors (cp.async of 16 bytes or
    ld.global.v4) and that a CPU launch after the kernel was compiled-decorated is refused."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kamera_core.segment.triton_kernel import segment_attention_kernel, segment_merge_kernel

    names = segment_attention_kernel.arg_names
    types = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    for kv, head_dim, groups, block_m, half_dot, patch, single, interleaved in COMPILE_VARIANTS:
        consts = {
            "HEAD_DIM": head_dim, "V_DIM": head_dim, "GROUPS": groups, "HALF": head_dim // 2,
            "INTERLEAVED": interleaved, "KV_DTYPE": types[kv], "HALF_DOT": half_dot, "F32_DOT": "tf32x3",
            "ALIGN": 4 if kv == "fp32" else 8, "HAS_WINDOW": True, "HAS_SOFTCAP": True, "HAS_PATCH_K": patch,
            "HAS_PATCH_V": patch, "SINGLE": single, "BLOCK_M": block_m, "BLOCK_N": 64,
            "BLOCK_D": head_dim, "BLOCK_DV": head_dim, "BLOCK_R": 16,
        }
        signature = {"q_ptr": f"*{kv}", "out_ptr": f"*{kv}", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        signature |= {n: "*i64" for n in ("qi_ptr", "table_ptr", "splits_ptr")}
        signature |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "num_q": "i32", "num_heads": "i32", "num_kv": "i32",
                      "scaling": "fp32", "softcap": "fp32", "window": "i32"}
        signature |= {n: "constexpr" for n in consts}
        src = ASTSource(fn=segment_attention_kernel, signature=signature,
                        constexprs={(names.index(n),): v for n, v in consts.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        ptx = compiled.asm["ptx"]
        vector_loads = ptx.count("cp.async.cg.shared.global") + ptx.count("ld.global.v4")  # cg: 16 bytes only
        case_id = f"compile-{kv}-{head_dim}-m{block_m}-patch{patch}-single{single}"
        print(json.dumps({"id": case_id, "cubin_bytes": len(compiled.asm["cubin"]), "vector_loads": vector_loads}))

    merge_names = segment_merge_kernel.arg_names
    consts = {"V_DIM": 128, "BLOCK_ROWS": 16, "BLOCK_DV": 128}
    signature = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16", "num_rows": "i32",
                 "num_splits": "i32"} | {n: "constexpr" for n in consts}
    src = ASTSource(fn=segment_merge_kernel, signature=signature,
                    constexprs={(merge_names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print(json.dumps({"id": "merge-compiled", "cubin_bytes": len(compiled.asm["cubin"])}))

    from kamera_core.segment.triton_launch import segment_attention_triton

    os.environ["TRITON_INTERPRET"] = "1"  # too late: kamera_core read the environment when imported above
    query, query_index, segments, spec, scaling = make_inputs(CASES["gqa-tq1-bf16-partial-rotary"])
    try:
        segment_attention_triton(query, query_index, segments, spec, scaling)
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
    # float32: the kernel's online softmax sums in another order than the reference's logsumexp,
    # a few ulps of the largest value. Half types: both round a float32 result once, at most one
    # ulp apart (the interpreter truncates float32 -> bfloat16 where torch rounds to nearest).
    if dtype_name == "float32":
        return 1e-5 * max_ref
    return 2 * torch.finfo(getattr(torch, dtype_name)).eps * max_ref


def _check(results: dict[str, dict], case_id: str, dtype_name: str) -> None:
    result = results.get(case_id, {})
    check_case(results, case_id, _tolerance(dtype_name, result.get("max_ref", 0.0)))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreter_results: dict, name: str) -> None:
    _check(interpreter_results, name, CASES[name]["dtype"])


@pytest.mark.parametrize("case_id", ["extra-strided-views", "extra-dispatch"])
def test_launcher_reads_views_and_dispatch(interpreter_results: dict, case_id: str) -> None:
    _check(interpreter_results, case_id, "float32")


def test_kernel_compiles_for_sm90_without_gpu(compile_results: dict) -> None:
    assert "__crash__" not in compile_results, compile_results["__crash__"]["error"]
    compiled = {k: v for k, v in compile_results.items() if k.startswith("compile-")}
    assert len(compiled) == len(COMPILE_VARIANTS), compiled
    assert all(v["cubin_bytes"] > 0 for v in compiled.values()), compiled
    assert compile_results["merge-compiled"]["cubin_bytes"] > 0
    # Keys and values must stream as 16-byte vectors: the alignment hints reached the loads.
    assert all(v["vector_loads"] > 0 for v in compiled.values()), compiled


def test_cpu_launch_after_compiled_import_is_refused(compile_results: dict) -> None:
    assert "__crash__" not in compile_results, compile_results["__crash__"]["error"]
    assert "before kamera_core is imported" in compile_results["late-interpret"]["message"]


def test_plan_pieces_covers_every_key_once() -> None:
    from kamera_core.segment.triton_launch import plan_pieces

    lengths = [7, 19, 1, 40]
    for splits in (1, 2, 3, 5, 100):
        pieces, split_ptr = plan_pieces(lengths, splits, 16)
        assert split_ptr[0] == 0 and split_ptr[-1] == len(pieces) and len(split_ptr) - 1 <= splits
        covered = [(n, t) for n, b, e in pieces for t in range(b, e)]
        assert sorted(covered) == [(n, t) for n, length in enumerate(lengths) for t in range(length)]
        sizes = [sum(e - b for _, b, e in pieces[split_ptr[s]: split_ptr[s + 1]]) for s in range(len(split_ptr) - 1)]
        assert all(size > 0 for size in sizes) and all(size % 16 == 0 for size in sizes[:-1]), sizes


# Validation happens before Triton is imported, so these run in pytest's own process.


def _inputs(**changes):
    query, query_index, segments, spec, scaling = make_inputs(CASES["gqa-tq3-fp32-three-segs-patched"])
    args = {"query": query, "query_index": query_index, "segments": segments, "spec": spec, "scaling": scaling}
    return args | changes


def test_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kamera_core.segment.triton_launch import segment_attention_triton

    monkeypatch.setattr(backends, "INTERPRET", False)  # as if TRITON_INTERPRET were unset at import
    with pytest.raises(ValueError, match="backend='torch'"):
        segment_attention_triton(**_inputs())


def test_bad_arguments_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from kamera_core.segment import Segment
    from kamera_core.segment.triton_launch import segment_attention_triton

    monkeypatch.setattr(backends, "INTERPRET", False)  # as if TRITON_INTERPRET were unset at import
    args = _inputs()
    query, segments = args["query"], args["segments"]
    with pytest.raises(TypeError, match="float64"):
        doubled = [Segment(s.keys.double(), s.values.double(), s.first, s.shift) for s in segments]
        segment_attention_triton(**_inputs(query=query.double(), segments=doubled))
    with pytest.raises(ValueError, match="softcap"):
        segment_attention_triton(**args, softcap=-1.0)
    with pytest.raises(ValueError, match="block_n"):
        segment_attention_triton(**args, block_n=24)
    with pytest.raises(ValueError, match="num_splits"):
        segment_attention_triton(**args, num_splits=0)
    mixed = [segments[0], Segment(segments[1].keys[:, :1], segments[1].values[:, :1], 7, 0)]
    with pytest.raises(ValueError, match="one layout"):
        segment_attention_triton(**_inputs(segments=mixed))
    with pytest.raises(ValueError, match="sees no key"):  # rows 24..26 with window 1 see only key 26
        segment_attention_triton(**_inputs(segments=segments[:2]), window=1)


def test_missing_triton_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from kamera_core.segment.triton_launch import segment_attention_triton

    monkeypatch.setattr(backends, "INTERPRET", True)  # as if TRITON_INTERPRET=1 at import
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    with pytest.raises(ImportError, match="backend='torch'"):
        segment_attention_triton(**_inputs())


def _segment_to_cuda(seg):
    from kamera_core.patch import Factors, LayerPatch
    from kamera_core.segment import Segment

    def move(f):
        if f is None:
            return None
        return Factors(*(None if t is None else t.cuda() for t in (f.u, f.vt, f.u_scale, f.vt_scale)))

    patch = None if seg.patch is None else LayerPatch(move(seg.patch.k), move(seg.patch.v))
    return Segment(seg.keys.cuda(), seg.values.cuda(), seg.first, seg.shift, patch)


@pytest.mark.gpu
def test_kernel_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; the interpreter tests cover correctness on CPU")
    from kamera_core.segment import segment_attention_reference
    from kamera_core.segment.triton_launch import segment_attention_triton

    for name in ("gqa-tq3-fp32-three-segs-patched", "mha-tq1-bf16-decode-future-seg", "gqa-tq3-bf16-window-cuts-seg",
                 "gqa-tq1-fp32-softcap-window", "gqa-tq3-fp16-half-dot"):
        case = CASES[name]
        query, query_index, segments, spec, scaling = make_inputs(case)
        query = query.cuda()
        segments = [_segment_to_cuda(s) for s in segments]
        kw = {"window": case.get("window"), "softcap": case.get("softcap")}
        for splits in (None, 1, 3):
            out = segment_attention_triton(query, query_index, segments, spec, scaling, **kw, num_splits=splits)
            result = _result(out, segment_attention_reference(query, query_index, segments, spec, scaling, **kw))
            assert result["same_shape_dtype"], name
            assert result["max_diff"] <= _tolerance(case["dtype"], result["max_ref"]), (name, splits, result)


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-cases"]:
        _interpreter_main()
    elif sys.argv[1:] == ["--compile-cases"]:
        _compile_main()
    else:
        sys.exit(f"usage: {sys.argv[0]} --interpreter-cases | --compile-cases")
