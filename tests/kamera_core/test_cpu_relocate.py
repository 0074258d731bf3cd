"""The fast CPU relocation (C kernel) against `rotate_reference`.

The kernel makes the reference's roundings in the reference's order (float32 products, one
difference or sum, the patch added, one rounding to the keys' dtype), so on finite inputs the
results must be identical, not merely close. NaN payloads may differ; NaN positions may not.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from kamera_core.relocate import cpu as cpu_relocate
from kamera_core.relocate.cpu import rotate_cpu, rotate_cpu_inplace, rotate_cpu_into
from kamera_core.relocate import phases, rotate_reference
from kamera_core.rope import RopeSpec

# name: (middle dims, head_dim, rotary_dim, pairing)
LAYOUTS = {
    "gqa": ((2,), 64, 64, "half"),
    "mla_interleaved": ((), 64, 64, "interleaved"),  # k_rope [tokens, rope_dim]
    "neox_partial": ((3,), 64, 16, "half"),  # dims 16.. copied
    "odd_interleaved": ((3,), 48, 40, "interleaved"),  # 20 pairs, 8 copied dims
    "long_head": ((1,), 160, 160, "half"),  # 80 pairs: one full block of 64 and a tail
}
TOKENS = (1, 7, 19, 200)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RANKS = (0, 3)  # 0: no patch


def _phases(rotary_dim: int, head_dim: int, pairing: str, delta: int, compute: torch.dtype):
    """cos, sin `[rotary_dim // 2]` of a θ=1e4 spec shifted by `delta`."""
    inv_freq = tuple(10000.0 ** (-i / (rotary_dim // 2)) for i in range(rotary_dim // 2))
    spec = RopeSpec(inv_freq=inv_freq, head_dim=head_dim, pairing=pairing)
    return phases(spec, delta, compute)


def _inputs(layout: str, tokens: int, dtype: torch.dtype, rank: int, seed: int = 0):
    """keys `[tokens, *mid, head_dim]`, cos, sin, u `[tokens, rank]`, vt `[rank, *mid, head_dim]`."""
    mid, head_dim, rotary_dim, pairing = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    keys = (3 * torch.randn(tokens, *mid, head_dim, generator=gen)).to(dtype)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = _phases(rotary_dim, head_dim, pairing, 4097, compute)
    u = vt = None
    if rank:
        u = torch.randn(tokens, rank, generator=gen).to(dtype)
        vt = (0.1 * torch.randn(rank, *mid, head_dim, generator=gen)).to(dtype)
    return keys, cos, sin, pairing, u, vt


def _same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal shape, dtype and values; NaN matches NaN."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False
    return bool(((actual == expected) | (actual.isnan() & expected.isnan())).all())


def test_kernel_is_available():
    status = cpu_relocate.kernel_status()
    assert status["available"], status["reason"]
    assert {"bfloat16/float32", "float16/float32", "float32/float32"} <= set(status["dtypes"])


@pytest.mark.parametrize(
    "layout,tokens,dtype,rank",
    list(itertools.product(LAYOUTS, TOKENS, DTYPES, RANKS)),
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_matches_reference(layout, tokens, dtype, rank):
    keys, cos, sin, pairing, u, vt = _inputs(layout, tokens, dtype, rank)
    before = keys.clone()
    expected = rotate_reference(keys, cos, sin, pairing, u, vt)

    assert torch.equal(rotate_cpu(keys, cos, sin, pairing, u, vt), expected)
    assert torch.equal(keys, before), "rotate_cpu must not mutate its input"
    out = torch.full_like(keys, float("nan"))
    assert torch.equal(rotate_cpu_into(keys, cos, sin, pairing, out, u, vt), expected)
    work = keys.clone()
    assert rotate_cpu_inplace(work, cos, sin, pairing, u, vt) is work
    assert torch.equal(work, expected)


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_float64_keys(pairing):
    keys = torch.randn(33, 2, 64, dtype=torch.float64)
    cos, sin = _phases(64, 64, pairing, -123, torch.float64)
    u, vt = torch.randn(33, 2, dtype=torch.float64), torch.randn(2, 2, 64, dtype=torch.float64)
    assert torch.equal(rotate_cpu(keys, cos, sin, pairing, u, vt), rotate_reference(keys, cos, sin, pairing, u, vt))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_large_parallel_and_streamed(dtype, pairing):
    """Big enough for the OpenMP split and (out of place) the non-temporal row stores."""
    keys = torch.randn(2048, 4, 128).to(dtype)  # >= 1 MiB for every dtype here
    cos, sin = _phases(128, 128, pairing, 100_000, torch.float32)
    expected = rotate_reference(keys, cos, sin, pairing)
    assert keys.numel() * keys.element_size() >= cpu_relocate.STREAM_MIN_BYTES
    assert torch.equal(rotate_cpu(keys, cos, sin, pairing), expected)
    work = keys.clone()
    assert torch.equal(rotate_cpu_inplace(work, cos, sin, pairing), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(dtype):
    finfo = torch.finfo(dtype)
    specials = torch.tensor(
        [float("inf"), -float("inf"), float("nan"), 0.0, -0.0, finfo.max, -finfo.max, finfo.tiny, finfo.tiny / 8]
    )
    keys = torch.randn(64, 2, 64)
    flat = keys.view(-1)
    gen = torch.Generator().manual_seed(1)
    where = torch.randint(0, flat.numel(), (1500,), generator=gen)
    flat[where] = specials[torch.randint(0, len(specials), (1500,), generator=gen)]
    keys = keys.to(dtype)
    for pairing in ("half", "interleaved"):
        cos, sin = _phases(64, 64, pairing, 7, torch.float32)
        expected = rotate_reference(keys, cos, sin, pairing)
        assert _same(rotate_cpu(keys, cos, sin, pairing), expected)
        assert _same(rotate_cpu_inplace(keys.clone(), cos, sin, pairing), expected)


def test_non_contiguous_keys():
    base = torch.randn(2, 40, 64).to(torch.bfloat16)
    keys = base.transpose(0, 1)  # [40, 2, 64], not contiguous
    cos, sin = _phases(64, 64, "half", 99, torch.float32)
    assert torch.equal(rotate_cpu(keys, cos, sin, "half"), rotate_reference(keys, cos, sin, "half"))


def test_unsupported_dtype_pair_falls_back_to_reference():
    keys = torch.randn(9, 2, 64).to(torch.bfloat16)
    cos, sin = _phases(64, 64, "half", 5, torch.float64)  # bf16 keys, float64 compute: no kernel
    assert torch.equal(rotate_cpu(keys, cos, sin, "half"), rotate_reference(keys, cos, sin, "half"))


def test_bad_arguments():
    keys = torch.randn(4, 2, 64)
    cos, sin = _phases(64, 64, "half", 1, torch.float32)
    with pytest.raises(ValueError, match="pairing"):
        rotate_cpu(keys, cos, sin, "rotate")
    with pytest.raises(ValueError, match="rotary_dim"):
        rotate_cpu(keys[..., :32], cos, sin, "half")
    with pytest.raises(ValueError, match="both u and vt"):
        rotate_cpu(keys, cos, sin, "half", u=torch.randn(4, 1))
    with pytest.raises(ValueError, match="patch u"):
        rotate_cpu(keys, cos, sin, "half", u=torch.randn(3, 2), vt=torch.randn(2, 2, 64))
    with pytest.raises(ValueError, match="patch vt"):
        rotate_cpu(keys, cos, sin, "half", u=torch.randn(4, 2), vt=torch.randn(2, 1, 64))
    with pytest.raises(ValueError, match="out must match"):
        rotate_cpu_into(keys, cos, sin, "half", torch.empty(4, 2, 32))
    storage = torch.randn(5, 2, 64)
    with pytest.raises(ValueError, match="overlaps"):
        rotate_cpu_into(storage[:4], cos, sin, "half", storage[1:])


def _fresh_state(monkeypatch):
    monkeypatch.setattr(cpu_relocate, "_KERNEL", cpu_relocate._KERNEL.fresh())


def test_disabled_kernel_uses_reference(monkeypatch):
    _fresh_state(monkeypatch)
    monkeypatch.setenv("KAMERA_CPU_KERNEL", "0")
    keys, cos, sin, pairing, u, vt = _inputs("gqa", 19, torch.bfloat16, 3)
    assert torch.equal(rotate_cpu(keys, cos, sin, pairing, u, vt), rotate_reference(keys, cos, sin, pairing, u, vt))
    status = cpu_relocate.kernel_status()
    assert not status["available"] and "KAMERA_CPU_KERNEL" in status["reason"]


def test_build_failure_warns_once_and_falls_back(monkeypatch, tmp_path):
    _fresh_state(monkeypatch)
    monkeypatch.setenv("KAMERA_CACHE_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    keys, cos, sin, pairing, _, _ = _inputs("neox_partial", 7, torch.float16, 0)
    with pytest.warns(RuntimeWarning, match="could not build the C kernel"):
        result = rotate_cpu(keys, cos, sin, pairing)
    assert torch.equal(result, rotate_reference(keys, cos, sin, pairing))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must not warn again
        rotate_cpu(keys, cos, sin, pairing)
    assert not cpu_relocate.kernel_status()["available"]
