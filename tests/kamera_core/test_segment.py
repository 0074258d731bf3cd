"""Segment attention's torch reference against attention over the same KV placed densely (keys
re-rotated to their place with the patch added, concatenated, one masked softmax), and the CPU
flash path against the reference, on odd sizes, GQA, patches, sliding windows and soft-capping."""

from __future__ import annotations

import math

import pytest
import torch

from kamera_core import patch as kp
from kamera_core.relocate import relocate_keys
from kamera_core.rope import RopeSpec
from kamera_core.segment import (Segment, merge_states, patch_option_states, segment_attention,
                                 segment_attention_flash, segment_attention_reference, segment_state)


def _spec(head_dim: int, rotary_dim: int, pairing: str = "half") -> RopeSpec:
    inv = (1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))).tolist()
    return RopeSpec(inv_freq=tuple(inv), head_dim=head_dim, pairing=pairing)


def _segments(g: torch.Generator, lengths, heads: int, dim: int, shifts, ranks, dtype=torch.float32):
    segs, first = [], 0
    for n, shift, rank in zip(lengths, shifts, ranks):
        patch = None
        if rank:
            patch = kp.LayerPatch(kp.Factors(torch.randn(n, rank, generator=g, dtype=dtype),
                                             torch.randn(rank, heads, dim, generator=g, dtype=dtype)),
                                  kp.Factors(torch.randn(n, rank + 1, generator=g, dtype=dtype),
                                             torch.randn(rank + 1, heads, dim, generator=g, dtype=dtype)))
        segs.append(Segment(torch.randn(n, heads, dim, generator=g, dtype=dtype),
                            torch.randn(n, heads, dim, generator=g, dtype=dtype), first, shift, patch))
        first += n
    return segs, first


def _dense(query, query_index, segments, spec, scaling, window=None, softcap=None):
    """Plain attention over every segment placed by copy: R(shift)·(K + U_k V_k) and V + U_v V_v."""
    keys, values, index = [], [], []
    for s in segments:
        k, v = s.keys.double(), s.values.double()
        if s.patch is not None and s.patch.k is not None:
            k = k + s.patch.k.dense(torch.float64)
        if s.patch is not None and s.patch.v is not None:
            v = v + s.patch.v.dense(torch.float64)
        keys.append(relocate_keys(k, spec, s.shift, backend="torch"))
        values.append(v)
        index.append(torch.arange(s.first, s.end))
    k, v, key_index = torch.cat(keys), torch.cat(values), torch.cat(index)
    groups = query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,thd->hqt", query.double(), k) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    diff = query_index[:, None] - key_index[None]
    ok = (diff >= 0) & ((diff < window) if window is not None else True)
    scores = scores.masked_fill(~ok[None], -math.inf)
    return torch.einsum("hqt,thd->qhd", torch.softmax(scores, -1), v)


CASES = [
    # (query rows, lengths, Hq, Hkv, head_dim, rotary_dim, shifts, ranks, window, softcap)
    (1, [1], 2, 2, 16, 16, [0], [0], None, None),
    (3, [7, 19, 3], 6, 2, 16, 8, [5, 100000, 0], [0, 3, 0], None, None),
    (7, [19, 200, 7], 4, 4, 24, 24, [-3, 12, 0], [2, 0, 1], 9, None),
    (1, [200, 19, 1], 6, 3, 16, 16, [1000, 7, 0], [0, 0, 0], 50, None),
    (5, [7, 7, 7], 4, 2, 16, 16, [3, 2, 0], [1, 0, 0], None, 5.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_reference_equals_attention_over_keys_placed_by_copy(case, dtype):
    num_q, lengths, hq, hkv, dim, rot, shifts, ranks, window, softcap = case
    g = torch.Generator().manual_seed(len(lengths) * 7 + num_q)
    segs, end = _segments(g, lengths, hkv, dim, shifts, ranks, dtype)
    # The query rows are the last rows of the last segment (their own keys, causal inside it).
    query = torch.randn(num_q, hq, dim, generator=g, dtype=dtype)
    index = torch.arange(end - num_q, end)
    spec = _spec(dim, rot)
    got = segment_attention_reference(query, index, segs, spec, dim ** -0.5, window, softcap)
    expected = _dense(query, index, segs, spec, dim ** -0.5, window, softcap)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    assert got.dtype == dtype
    assert float((got.double() - expected).abs().max()) <= tol * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("case", [c for c in CASES if c[-1] is None])
def test_flash_path_equals_the_reference(case):
    num_q, lengths, hq, hkv, dim, rot, shifts, ranks, window, _ = case
    g = torch.Generator().manual_seed(3)
    segs, end = _segments(g, lengths, hkv, dim, shifts, ranks)
    query = torch.randn(num_q, hq, dim, generator=g)
    index = torch.arange(end - num_q, end)
    spec = _spec(dim, rot)
    ref = segment_attention_reference(query, index, segs, spec, 0.3, window)
    assert float((segment_attention_flash(query, index, segs, spec, 0.3, window) - ref).abs().max()) <= 2e-5
    # "auto" with many rows on CPU takes the flash path; forced "torch" is the reference itself
    assert torch.equal(segment_attention(query, index, segs, spec, 0.3, window, backend="torch"), ref)


def test_merge_keeps_rows_no_segment_sees():
    spec = _spec(16, 16)
    g = torch.Generator().manual_seed(0)
    segs, _ = _segments(g, [4, 4], 2, 16, [0, 0], [0, 0])
    query = torch.randn(2, 2, 16, generator=g)
    index = torch.tensor([2, 5])  # row 0 sees keys 0..2 of the first segment only
    states = [segment_state(query, index, s, spec, 0.25) for s in segs]
    assert bool(torch.isinf(states[1][1][0]).all()) and float(states[1][0][0].abs().max()) == 0.0
    out, lse = merge_states(states)
    assert bool(torch.isfinite(lse).all())
    assert float((out - _dense(query, index, segs, spec, 0.25).float()).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match="backend"):
        segment_attention(query, index, segs, spec, 0.25, backend="gpu")


@pytest.mark.parametrize("window, softcap", [(None, None), (9, None), (None, 5.0)])
def test_patch_options_equal_attention_with_that_part_of_the_patch_placed_by_copy(window, softcap):
    """`patch_option_states` shares scores between options; each option's state is attention over
    the segment with only that part of its patch (none, keys, values, both) added by copy."""
    g = torch.Generator().manual_seed(11)
    (seg,), end = _segments(g, [19], 2, 16, [7], [3], torch.float64)
    query = torch.randn(5, 4, 16, generator=g, dtype=torch.float64)
    index = torch.arange(end - 5, end)
    spec = _spec(16, 8)
    options = ("none", "k", "v", "kv")
    states = patch_option_states(query, index, seg, spec, 0.3, window, softcap, options)
    parts = {"none": kp.LayerPatch(None, None), "k": kp.LayerPatch(seg.patch.k, None),
             "v": kp.LayerPatch(None, seg.patch.v), "kv": seg.patch}
    outs = []
    for option, (out, lse) in zip(options, states):
        placed = Segment(seg.keys, seg.values, seg.first, seg.shift, parts[option])
        expected = _dense(query, index, [placed], spec, 0.3, window, softcap)
        assert float((out - expected).abs().max()) <= 1e-10 * max(1.0, float(expected.abs().max())), option
        assert torch.equal(lse, segment_state(query, index, placed, spec, 0.3, window, softcap)[1])
        outs.append(out)
    assert all(float((a - b).abs().max()) > 1e-3 for i, a in enumerate(outs) for b in outs[i + 1:])  # all differ
    with pytest.raises(ValueError, match="options must be among"):
        patch_option_states(query, index, seg, spec, 0.3, options=("q",))
