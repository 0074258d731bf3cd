"""The CPU segment attention kernel (`kamera_core.segment.cpu`) against `segment_attention_reference`.

The kernel sums in a different order and pre-scales the query, so results agree to float32
rounding, not bit for bit: float32 within 1e-5 of the output scale, bfloat16/float16 within 2e-2
(one or two output roundings). Where the kernel must not be used (disabled, float64, a failed
build) the result must be the reference's exactly. Shapes are small and odd: segments of 1, 7, 19
and 200 keys (several blocks of 32, and parts split across threads), head dims 16, 20 (not a
multiple of 8) and 64, GQA and MHA.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from kamera_core.segment import cpu as cpu_segment
from kamera_core.segment.cpu import kernel_status, segment_attention_cpu
from kamera_core.patch import Factors, LayerPatch, fit, quantize
from kamera_core.relocate import phases
from kamera_core.rope import RopeSpec
from kamera_core.segment import Segment, segment_attention, segment_attention_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _spec(head_dim: int, rotary_dim: int | None = None, pairing: str = "half") -> RopeSpec:
    half = (rotary_dim or head_dim) // 2
    return RopeSpec(inv_freq=tuple(10000.0 ** (-i / half) for i in range(half)), head_dim=head_dim, pairing=pairing)


def _factors(tokens: int, kv: int, dim: int, rank: int, gen: torch.Generator, storage: str = "fp32") -> Factors:
    f = Factors(0.3 * torch.randn(tokens, rank, generator=gen), 0.3 * torch.randn(rank, kv, dim, generator=gen))
    return f if storage == "fp32" else quantize(f, storage)


def _case(lengths, *, tq=3, hq=6, hkv=2, d=64, dv=None, dtype=torch.float32, shifts=None, rank=0,
          storage="fp32", gap=0, seed=0, layout="token"):
    """(query [tq, hq, d], query_index [tq], segments) with segments laid end to end (plus `gap`
    unused token indices between them) and the query rows right after the last key.

    layout: "token" (contiguous [T, Hkv, D]), "slice" (a token slice of a larger buffer), "hf"
    ([Hkv, T, D] storage permuted: token stride D) or "strided" (last dim not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    dv = dv or d
    segments, first = [], 0
    for n, length in enumerate(lengths):
        if layout == "hf":
            keys = (2 * torch.randn(hkv, length, d, generator=gen)).to(dtype).permute(1, 0, 2)
            values = torch.randn(hkv, length, dv, generator=gen).to(dtype).permute(1, 0, 2)
        elif layout == "slice":
            keys = (2 * torch.randn(length + 5, hkv, d, generator=gen)).to(dtype)[3:3 + length]
            values = torch.randn(length + 5, hkv, dv, generator=gen).to(dtype)[2:2 + length]
        elif layout == "strided":
            keys = (2 * torch.randn(length, hkv, 2 * d, generator=gen)).to(dtype)[..., ::2]
            values = torch.randn(length, hkv, 2 * dv, generator=gen).to(dtype)[..., 1::2]
        else:
            keys = (2 * torch.randn(length, hkv, d, generator=gen)).to(dtype)
            values = torch.randn(length, hkv, dv, generator=gen).to(dtype)
        shift = shifts[n] if shifts is not None else 1000 + 17 * n
        patch = None
        if rank:
            patch = LayerPatch(_factors(length, hkv, d, rank, gen, storage), _factors(length, hkv, dv, rank, gen, storage))
        segments.append(Segment(keys, values, first, shift, patch))
        first += length + gap
    query = (2 * torch.randn(tq, hq, d, generator=gen)).to(dtype)
    query_index = torch.arange(first - gap, first - gap + tq)
    return query, query_index, segments


def _check(query, query_index, segments, spec, scaling=0.125, window=None, softcap=None, tol=None):
    expected = segment_attention_reference(query, query_index, segments, spec, scaling, window, softcap)
    actual = segment_attention_cpu(query, query_index, segments, spec, scaling, window, softcap)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = float(expected.float().abs().max())
    tol = TOL[query.dtype] if tol is None else tol
    err = float((actual.float() - expected.float()).abs().max())
    assert err <= tol * max(scale, 1e-3), f"max error {err:.3g} vs output scale {scale:.3g}"
    return actual, expected


@pytest.fixture(autouse=True)
def _kernel_state():
    """Every test starts from the process' kernel (built once) with SIMD on."""
    yield
    cpu_segment._USE_SIMD = True


def test_kernel_is_available():
    status = kernel_status()
    assert status["available"], status["reason"]
    assert set(status["dtypes"]) == {"float32", "bfloat16", "float16"}


@pytest.mark.parametrize(
    "tq,lengths,dtype",
    list(itertools.product((1, 3, 7), ((1,), (7,), (19, 200), (200, 1, 7, 19, 5)), DTYPES)),
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_odd_sizes_gqa(tq, lengths, dtype):
    query, qi, segments = _case(lengths, tq=tq, dtype=dtype, seed=tq + len(lengths))
    _check(query, qi, segments, _spec(64))


def test_sixteen_query_rows():
    """The largest query the CPU path is chosen for (`segment.CPU_KERNEL_MAX_ROWS`)."""
    query, qi, segments = _case((200, 19, 40), tq=16, hq=8, hkv=2, rank=16, seed=16)
    _check(query, qi, segments, _spec(64))
    _check(query, torch.arange(259 - 16, 259), segments, _spec(64), window=50)


@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 16), (4, 4, 16), (4, 4, 64), (6, 3, 20), (8, 1, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_heads_and_dims(hq, hkv, d, dtype):
    query, qi, segments = _case((7, 19, 33), tq=3, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=d)
    _check(query, qi, segments, _spec(d))


def test_value_dim_differs_from_key_dim():
    query, qi, segments = _case((19, 40), tq=3, d=64, dv=24, rank=3)
    _check(query, qi, segments, _spec(64))


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("rotary", [16, 64, 40])
def test_partial_rotary_and_pairing(pairing, rotary):
    query, qi, segments = _case((7, 200), tq=3, d=64, shifts=[100000, -3], seed=rotary)
    _check(query, qi, segments, _spec(64, rotary, pairing))


def test_shifts_zero_negative_large_and_repeated():
    shifts = [0, 100000, -100000, 100000, 7, 0]
    query, qi, segments = _case((7, 19, 1, 200, 3, 5), tq=7, shifts=shifts)
    _check(query, qi, segments, _spec(64))


def test_phase_tables_are_relocations_phases():
    """The kernel's cos/sin rows are `relocate.phases(spec, -shift)` bit for bit (cached or not)."""
    spec = _spec(64, 40)
    shifts = [1, -5, 100000, 7, -100000, 2**40]
    for _ in range(2):  # computed, then from the cache
        cos, sin = cpu_segment._phase_tables(spec, shifts)
        cos = torch.frombuffer(bytearray(cos), dtype=torch.float32).reshape(len(shifts), -1)
        sin = torch.frombuffer(bytearray(sin), dtype=torch.float32).reshape(len(shifts), -1)
        for n, shift in enumerate(shifts):
            c, s = phases(spec, -shift, torch.float32)
            assert torch.equal(cos[n], c) and torch.equal(sin[n], s)


def test_query_rotation_is_the_relocation():
    """With one key per segment, the score is (R(-shift) q)·k: a wrong rotation sign or pairing
    moves the softmax far more than the tolerance."""
    spec = _spec(16, 16, "interleaved")
    query, qi, segments = _case((1, 1, 1), tq=1, hq=2, hkv=1, d=16, shifts=[5, 100000, -77], seed=3)
    _check(query, qi, segments, spec, scaling=1.0)


@pytest.mark.parametrize("storage", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("rank", [0, 3, 9, 16])  # 16: whole vectors only; 9: vectors and a tail
def test_patches(rank, storage):
    query, qi, segments = _case((7, 19, 200), tq=3, rank=rank, storage=storage, seed=rank)
    _check(query, qi, segments, _spec(64))


def test_patch_on_one_slot_and_rank_zero_factors():
    gen = torch.Generator().manual_seed(5)
    query, qi, segments = _case((19, 7, 40), tq=3, seed=5)
    a, b, c = segments
    k_only = LayerPatch(_factors(19, 2, 64, 4, gen), None)
    v_only = LayerPatch(None, _factors(7, 2, 64, 2, gen, "int8"))
    empty = LayerPatch(_factors(40, 2, 64, 0, gen), _factors(40, 2, 64, 0, gen))
    segments = [Segment(a.keys, a.values, a.first, a.shift, k_only), Segment(b.keys, b.values, b.first, b.shift, v_only),
                Segment(c.keys, c.values, c.first, c.shift, empty)]
    _check(query, qi, segments, _spec(64))


def test_fitted_patch_in_bf16():
    gen = torch.Generator().manual_seed(11)
    query, qi, segments = _case((19, 200), tq=3, dtype=torch.bfloat16, seed=11)
    patched = []
    for seg in segments:
        t = seg.num_tokens
        dk, dv = 0.2 * torch.randn(t, 2, 64, generator=gen), 0.2 * torch.randn(t, 2, 64, generator=gen)
        patch = LayerPatch(quantize(fit(dk, 5), "int8"), fit(dv, 3))
        patched.append(Segment(seg.keys, seg.values, seg.first, seg.shift, patch))
    _check(query, qi, patched, _spec(64))


@pytest.mark.parametrize("window", [1, 5, 30, 210, 10_000])
@pytest.mark.parametrize("tq", [1, 7])
def test_sliding_window(window, tq):
    """Segments [0, 200) [200, 207) [207, 226) with the rows at the last keys (their own): small
    windows cut the last segment partly and the earlier ones entirely; rows see different key sets."""
    query, _, segments = _case((200, 7, 19), tq=tq, seed=window)
    _check(query, torch.arange(226 - tq, 226), segments, _spec(64), window=window)


def test_window_and_gaps_and_causality_inside_segments():
    """Query rows inside a segment's span (its own keys): keys after a row stay masked."""
    query, qi, segments = _case((19, 200, 7), tq=7, gap=3, seed=2)
    qi = torch.tensor([5, 6, 30, 31, 100, 226, 240])  # rows inside segments and in a gap
    _check(query, qi, segments, _spec(64))
    _check(query, qi, segments, _spec(64), window=12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap(dtype):
    query, qi, segments = _case((7, 200, 19), tq=3, dtype=dtype, rank=3, seed=4)
    _check(query, qi, segments, _spec(64), scaling=0.5, softcap=5.0)
    _check(query, qi, segments, _spec(64), scaling=0.5, softcap=50.0, window=20)


@pytest.mark.parametrize("layout", ["slice", "hf", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_views(layout, dtype):
    query, qi, segments = _case((7, 200, 19), tq=3, dtype=dtype, layout=layout, rank=2)
    _check(query, qi, segments, _spec(64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scalar_path(dtype):
    """The portable path (machines without AVX2) on the same inputs."""
    cpu_segment._USE_SIMD = False
    query, qi, segments = _case((1, 7, 200), tq=3, hq=6, hkv=3, d=20, dtype=dtype, rank=3, storage="int8")
    _check(query, qi, segments, _spec(20, 16, "interleaved"), window=150, softcap=20.0)


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_conversion_is_exact(dtype, simd):
    """One key: the output is the value row itself, so every 16-bit pattern (subnormals, zeros,
    infinities, NaN) must come back unchanged through the kernel's conversion."""
    cpu_segment._USE_SIMD = simd
    values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)[None, None, :]
    keys = torch.ones(1, 1, 8, dtype=dtype)
    query = torch.ones(1, 1, 8, dtype=dtype)
    out = segment_attention_cpu(query, torch.tensor([0]), [Segment(keys, values, 0, 0)], _spec(8), 1.0)
    same = (out == values) | (out.isnan() & values.isnan())
    assert bool(same.all()), values[~same][:8]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads):
    """Parts split segments at different places; merged results stay within rounding."""
    query, qi, segments = _case((200, 19, 200, 7), tq=3, rank=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(query, qi, segments, _spec(64))
    finally:
        torch.set_num_threads(before)


def test_row_that_sees_no_key_raises_like_the_reference():
    query, qi, segments = _case((7, 19), tq=2)
    early = torch.tensor([-3, -2])  # before every key
    with pytest.raises(ValueError, match="sees no key"):
        segment_attention_reference(query, early, segments, _spec(64), 0.125)
    with pytest.raises(ValueError, match="sees no key"):
        segment_attention_cpu(query, early, segments, _spec(64), 0.125)
    far = qi + 1000  # window 5 leaves every key behind
    with pytest.raises(ValueError, match="sees no key"):
        segment_attention_cpu(query, far, segments, _spec(64), 0.125, window=5)
    # One row sees keys, the other none: still an error.
    mixed = torch.tensor([-1, int(qi[0])])
    with pytest.raises(ValueError, match="sees no key"):
        segment_attention_cpu(query, mixed, segments, _spec(64), 0.125)


def test_invalid_tables_raise_check_segments_errors():
    query, qi, segments = _case((7, 19), tq=2)
    a, b = segments
    overlapping = [a, Segment(b.keys, b.values, a.first + 3, b.shift)]
    with pytest.raises(ValueError, match="overlap"):
        segment_attention_cpu(query, qi, overlapping, _spec(64), 0.125)
    with pytest.raises(TypeError, match="dtype"):
        segment_attention_cpu(query.to(torch.bfloat16), qi, segments, _spec(64), 0.125)
    with pytest.raises(ValueError, match="window"):
        segment_attention_cpu(query, qi, segments, _spec(64), 0.125, window=0)


def test_float64_uses_the_reference():
    query, qi, segments = _case((7, 19), tq=3, dtype=torch.float64, rank=2)
    out = segment_attention_cpu(query, qi, segments, _spec(64), 0.125)
    assert torch.equal(out, segment_attention_reference(query, qi, segments, _spec(64), 0.125))


def test_dispatch_backend_cpu():
    query, qi, segments = _case((19, 7), tq=2)
    expected = segment_attention_reference(query, qi, segments, _spec(64), 0.125)
    assert torch.allclose(segment_attention(query, qi, segments, _spec(64), 0.125, backend="cpu"), expected, atol=1e-5)


def _fresh_state(monkeypatch):
    monkeypatch.setattr(cpu_segment, "_KERNEL", cpu_segment._KERNEL.fresh())


def test_disabled_kernel_uses_reference(monkeypatch):
    _fresh_state(monkeypatch)
    monkeypatch.setenv("KAMERA_CPU_KERNEL", "0")
    query, qi, segments = _case((7, 19), tq=3, dtype=torch.bfloat16, rank=3)
    out = segment_attention_cpu(query, qi, segments, _spec(64), 0.125, window=9, softcap=3.0)
    assert torch.equal(out, segment_attention_reference(query, qi, segments, _spec(64), 0.125, window=9, softcap=3.0))
    status = kernel_status()
    assert not status["available"] and "KAMERA_CPU_KERNEL" in status["reason"]


def test_build_failure_warns_once_and_falls_back(monkeypatch, tmp_path):
    _fresh_state(monkeypatch)
    monkeypatch.setenv("KAMERA_CACHE_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    query, qi, segments = _case((7,), tq=1, dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="could not build the C kernel"):
        out = segment_attention_cpu(query, qi, segments, _spec(64), 0.125)
    assert torch.equal(out, segment_attention_reference(query, qi, segments, _spec(64), 0.125))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must not warn again
        segment_attention_cpu(query, qi, segments, _spec(64), 0.125)
    assert not kernel_status()["available"]
