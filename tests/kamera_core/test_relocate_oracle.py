"""Relocation against the model's own forward: chunk B encoded alone at start 0 and moved to start p
must equal the model's float64 forward of B at p (M-RoPE: t, h and w all shifted by p)."""

from __future__ import annotations

import functools

import pytest
import torch

from kamera_core import kv_layout, relocate_keys, relocate_mla, rope_specs
from tests.support import (
    REL_TOL,
    TEXT_MODELS,
    VL_MODELS,
    cast_model,
    float64_rope,
    forward,
    image_chunk,
    layer_kv,
    make_chunk,
    max_err,
    rotated,
    text_chunk,
    tiny,
)

STARTS = [1, 1000, 32768, 100000]
CASES = [(m, "text") for m in TEXT_MODELS + VL_MODELS] + [(m, "image") for m in VL_MODELS]


@functools.lru_cache(maxsize=None)
def _models(name: str):
    """(fp32, float64, bf16) copies of one seeded tiny model."""
    m32 = tiny(name)
    return m32, cast_model(m32, torch.float64), cast_model(m32, torch.bfloat16)


def _chunk(model, kind: str):
    if kind == "image":
        ids, mm = image_chunk(model, seed=7)
        return make_chunk(model, ids, mm)
    return make_chunk(model, text_chunk(19, seed=3))


def _relocate(kv, spec, delta: int, mla: bool) -> torch.Tensor:
    if mla:
        c_kv, k_rope = relocate_mla(kv[0], kv[1], spec, delta)
        assert c_kv is kv[0], "MLA relocation must hand back the latent c_KV untouched"
        return k_rope
    return relocate_keys(kv[0], spec, delta)


def _oracle(m64, chunk, start: int):
    with float64_rope(m64):
        return layer_kv(forward(m64, chunk, start).cache, m64)


def check_fp32(name: str, m32, m64, chunk, figures, kind: str) -> None:
    specs = rope_specs(m32.config)
    mla = kv_layout(m32.config).family == "mla"
    canon = layer_kv(forward(m32, chunk, 0).cache, m32)
    for p in STARTS:
        ref = _oracle(m64, chunk, p)
        own = layer_kv(forward(m32, chunk, p).cache, m32)
        worst_ours = worst_model = 0.0
        for layer, spec in enumerate(specs):
            expected = rotated(ref[layer], mla)
            scale = float(expected.abs().max())
            moved = _relocate(canon[layer], spec, p, mla)
            assert moved.dtype == torch.float32
            err, mean = max_err(moved, expected)
            assert err <= REL_TOL[torch.float32] * scale, (
                f"{name} {kind} layer {layer} start {p}: max err {err:.3e} (mean {mean:.3e}) "
                f"> 1e-5 x max|k| = {1e-5 * scale:.3e}"
            )
            # What needs no rotation is position invariant: values, and MLA's latent c_KV.
            other = ref[layer][1] if not mla else ref[layer][0]
            mine = canon[layer][1] if not mla else canon[layer][0]
            assert max_err(mine, other)[0] <= 1e-5 * float(other.abs().max()), f"{name} layer {layer}"
            worst_ours = max(worst_ours, err / scale)
            worst_model = max(worst_model, max_err(rotated(own[layer], mla), expected)[0] / scale)
        figures.append(dict(model=name, chunk=kind, dtype="fp32", start=p, relocated=worst_ours, model_forward=worst_model))
        if p == 100000:
            # The model's fp32 forward forms angles in float32; relocation forms them from δ in float64.
            assert worst_model > 10 * worst_ours, (name, worst_model, worst_ours)


def _rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def check_bf16(name: str, m16, m64, chunk, figures, kind: str) -> None:
    """bf16 caches: relocation adds exactly one output rounding to the stored bf16 keys, and its
    error against the float64 oracle stays within the model's own bf16 forward error at p plus
    that one rounding (RMS over all layers; the max figures are reported beside it).

    The stored canonical keys come from the model's own bf16 forward at start 0, so they carry the
    same bf16 error the model has at any start; what relocation itself may add is bounded here.
    """
    specs = rope_specs(m16.config)
    mla = kv_layout(m16.config).family == "mla"
    canon = layer_kv(forward(m16, chunk, 0).cache, m16)
    for p in STARTS:
        ref = _oracle(m64, chunk, p)
        own = layer_kv(forward(m16, chunk, p).cache, m16)
        ours, model, rounding = [], [], []
        for layer, spec in enumerate(specs):
            expected = rotated(ref[layer], mla)
            moved = _relocate(canon[layer], spec, p, mla)
            assert moved.dtype == torch.bfloat16
            # The rotation of the stored bf16 keys done in float64, to isolate the output rounding.
            exact = relocate_keys(rotated(canon[layer], mla).double(), spec, p)
            # One bf16 rounding of the result, plus float32 arithmetic on inputs of size max|k|
            # (which matters only for results near zero, where terms cancel).
            fp32_arith = 4 * torch.finfo(torch.float32).eps * float(exact.abs().max())
            bound = torch.finfo(torch.bfloat16).eps * exact.abs() + fp32_arith
            assert bool(((moved.double() - exact).abs() <= bound).all()), f"{name} layer {layer} start {p}"
            ours.append((moved.double() - expected).flatten())
            model.append((rotated(own[layer], mla).double() - expected).flatten())
            rounding.append((moved.double() - exact).flatten())
        ours_all, model_all, round_all = torch.cat(ours), torch.cat(model), torch.cat(rounding)
        scale = max(float(rotated(r, mla).abs().max()) for r in ref)
        figures.append(dict(model=name, chunk=kind, dtype="bf16", start=p,
                            relocated=float(ours_all.abs().max()) / scale,
                            model_forward=float(model_all.abs().max()) / scale))
        bound = _rms(model_all) + _rms(round_all)
        assert _rms(ours_all) <= bound, (
            f"{name} {kind} start {p}: bf16 relocation RMS err {_rms(ours_all):.3e} exceeds the model's "
            f"own bf16 forward RMS err {_rms(model_all):.3e} + one output rounding {_rms(round_all):.3e}"
        )


@pytest.mark.parametrize("name,kind", CASES)
def test_fp32_relocation_matches_float64_forward(name, kind, figures):
    m32, m64, _ = _models(name)
    check_fp32(name, m32, m64, _chunk(m32, kind), figures, kind)


@pytest.mark.parametrize("name,kind", CASES)
def test_bf16_relocation_no_worse_than_model_bf16_forward(name, kind, figures):
    m32, m64, m16 = _models(name)
    check_bf16(name, m16, m64, _chunk(m32, kind), figures, kind)


@pytest.mark.parametrize("name", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_mla_latent_bytes_identical(name):
    m32, _, m16 = _models(name)
    for model in (m32, m16):
        chunk = _chunk(model, "text")
        canon = layer_kv(forward(model, chunk, 0).cache, model)
        for layer, spec in enumerate(rope_specs(model.config)):
            before = canon[layer][0].clone()
            c_kv, k_rope = relocate_mla(canon[layer][0], canon[layer][1], spec, 32768)
            assert c_kv.data_ptr() == canon[layer][0].data_ptr()
            assert torch.equal(c_kv.view(torch.uint8) if c_kv.dtype != torch.bfloat16 else c_kv.view(torch.int16),
                               before.view(torch.uint8) if before.dtype != torch.bfloat16 else before.view(torch.int16))
            assert not torch.equal(k_rope, canon[layer][1])


def _smol_chunk(tokenizer):
    text = ("The harbour town of Velmora keeps its lighthouse keeper's log in a locked cabinet; "
            "the keeper, Anja Roth, writes the tide heights there every evening at six.")
    return torch.tensor(tokenizer(text).input_ids)


@pytest.mark.slow
def test_smollm2_relocation_matches_float64_forward(smollm2, figures):
    model, tokenizer = smollm2
    chunk = make_chunk(model, _smol_chunk(tokenizer))
    m64 = cast_model(model, torch.float64)
    check_fp32("smollm2", model, m64, chunk, figures, "text")
    check_bf16("smollm2", cast_model(model, torch.bfloat16), m64, chunk, figures, "text")


def test_oracle_rope_agrees_with_model_rope_at_small_positions():
    """The float64 oracle swaps only the angle precision: at small positions, where float32 angles
    are accurate, it must agree with the unmodified model forward."""
    for name in TEXT_MODELS + VL_MODELS:
        m32, m64, _ = _models(name)
        chunk = _chunk(m32, "image" if name in VL_MODELS else "text")
        mla = kv_layout(m32.config).family == "mla"
        plain = layer_kv(forward(m64, chunk, 5).cache, m64)
        exact = _oracle(m64, chunk, 5)
        for a, b in zip(plain, exact):
            x, y = rotated(a, mla), rotated(b, mla)
            assert max_err(x, y)[0] <= 1e-6 * float(y.abs().max()), name
