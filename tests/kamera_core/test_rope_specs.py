"""RoPE specs from configs: scaling families match the model's own frequencies bit for bit and
relocate exactly; what cannot be relocated exactly is refused with the model and the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import BloomConfig, GPT2Config, LlamaConfig, Phi3Config

from agentwin.models.zoo import TINY, tiny_config
from kamera_core import (
    RopeSpec,
    UnsupportedModelError,
    kv_layout,
    relocate_keys,
    relocate_patch,
    rope_specs,
)
from tests.kamera_core.test_relocate_oracle import check_fp32, _chunk
from tests.support import cast_model, rotary_modules, tiny

SCALED = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 10000.0},
}


def _scaled(kind: str):
    if kind == "deepseek-v3-yarn":
        cfg = tiny_config("tiny-deepseek-v3")
        cfg.rope_parameters = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                               "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                               "rope_theta": 10000.0}
        return "tiny-deepseek-v3", cfg
    return "tiny-llama-gqa", LlamaConfig(**{**tiny_config("tiny-llama-gqa").to_dict(), "rope_parameters": SCALED[kind]})


@pytest.mark.parametrize("name", sorted(TINY))
def test_inv_freq_equals_model_buffer_bit_for_bit(name):
    model = tiny(name)
    buffers = [getattr(m, "inv_freq", None) for m in rotary_modules(model)]
    specs = rope_specs(model.config)
    if buffers[0] is None:  # per-layer-type modules keep one buffer per type
        rot = rotary_modules(model)[0]
        for spec in specs:
            assert torch.equal(torch.tensor(spec.inv_freq, dtype=torch.float32), getattr(rot, f"{spec.layer_type}_inv_freq"))
        assert len({s.inv_freq for s in specs}) == 2, "local and global layers must differ"
    else:
        for spec in specs:
            assert torch.equal(torch.tensor(spec.inv_freq, dtype=torch.float32), buffers[0])


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn", "deepseek-v3-yarn"])
def test_scaled_rope_relocates_exactly(kind, figures):
    name, cfg = _scaled(kind)
    model = tiny(name, config=cfg)
    spec = rope_specs(model.config)[0]
    assert spec.rope_type == cfg.rope_parameters["rope_type"]
    assert torch.equal(torch.tensor(spec.inv_freq, dtype=torch.float32), rotary_modules(model)[0].inv_freq)
    if kind.endswith("yarn"):
        assert spec.attention_scaling == pytest.approx(rotary_modules(model)[0].attention_scaling)
    check_fp32(f"{name}+{kind}"[:18], model, cast_model(model, torch.float64), _chunk(model, "text"), figures, "text")


def test_dynamic_ntk_refused_with_model_and_reason():
    cfg = LlamaConfig(**{**tiny_config("tiny-llama").to_dict(),
                         "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}})
    cfg._name_or_path = "acme/llama-dynamic"
    with pytest.raises(UnsupportedModelError, match=r"acme/llama-dynamic.*dynamic.*sequence length"):
        rope_specs(cfg)


def test_longrope_refused():
    cfg = LlamaConfig(**tiny_config("tiny-llama").to_dict())
    cfg.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                           "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        rope_specs(cfg)


def test_unknown_rope_type_refused():
    cfg = LlamaConfig(**tiny_config("tiny-llama").to_dict())
    cfg.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="proportional"):
        rope_specs(cfg)


@pytest.mark.parametrize("config,needle", [
    (GPT2Config(n_layer=2), "gpt2"),  # learned absolute positions
    (BloomConfig(n_layer=2), "bloom"),  # ALiBi
    (Phi3Config(num_hidden_layers=2), "phi3"),  # layout not verified here
])
def test_unverified_or_ropeless_model_refused(config, needle):
    with pytest.raises(UnsupportedModelError, match=needle) as info:
        rope_specs(config)
    assert "Supported" in str(info.value)


def test_unsupported_error_is_a_value_error():
    assert issubclass(UnsupportedModelError, ValueError)


def test_kv_layouts():
    assert kv_layout(tiny_config("tiny-llama")).family == "mha"
    assert kv_layout(tiny_config("tiny-llama-gqa")).family == "gqa"
    mla = kv_layout(tiny_config("tiny-deepseek-v3"))
    assert (mla.family, mla.kv_lora_rank, mla.rope_dim, mla.num_kv_heads) == ("mla", 32, 16, 1)
    specs = rope_specs(tiny_config("tiny-gpt-neox"))
    assert (specs[0].rotary_dim, specs[0].head_dim) == (8, 32)
    assert rope_specs(tiny_config("tiny-qwen3-vl"))[0].mrope_interleaved
    assert rope_specs(tiny_config("tiny-qwen2-vl"))[0].mrope_section == (2, 3, 3)
    assert rope_specs(tiny_config("tiny-deepseek-v2"))[0].pairing == "interleaved"


SPEC = RopeSpec(inv_freq=(1.0, 0.1, 0.01, 0.001), head_dim=8)


def test_bad_inputs_raise_clear_errors():
    keys = torch.randn(5, 2, 8)
    with pytest.raises(TypeError, match="integer"):
        relocate_keys(keys, SPEC, 1.5)
    with pytest.raises(ValueError, match="head_dim=8"):
        relocate_keys(torch.randn(5, 2, 6), SPEC, 3)
    with pytest.raises(TypeError, match="floating"):
        relocate_keys(torch.ones(5, 2, 8, dtype=torch.int64), SPEC, 3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        relocate_keys([[0.0] * 8], SPEC, 3)
    with pytest.raises(ValueError, match="patch u"):
        relocate_keys(keys, SPEC, 3, patch=(torch.randn(4, 2), torch.randn(2, 2, 8)))
    with pytest.raises(ValueError, match="patch vt"):
        relocate_keys(keys, SPEC, 3, patch=(torch.randn(5, 2), torch.randn(3, 2, 8)))
    with pytest.raises(ValueError, match="backend"):
        relocate_keys(keys, SPEC, 3, backend="cuda")
    with pytest.raises(ValueError, match="rotary_dim"):
        RopeSpec(inv_freq=(1.0,) * 5, head_dim=8)


def test_relocation_composes_and_inverts():
    keys = torch.randn(7, 3, 8, dtype=torch.float64)
    there = relocate_keys(keys, SPEC, 40000)
    back = relocate_keys(there, SPEC, -40000)
    assert torch.allclose(back, keys, atol=1e-12)
    assert torch.allclose(relocate_keys(relocate_keys(keys, SPEC, 123), SPEC, 877), relocate_keys(keys, SPEC, 1000), atol=1e-12)
    assert torch.equal(relocate_keys(keys, SPEC, 0), keys)


def test_patch_moves_with_its_chunk():
    """R(δ)(K + U·Vᵀ) computed directly equals moving K with the patch, and equals K moved plus
    the patch with only Vᵀ rotated."""
    keys = torch.randn(9, 2, 8, dtype=torch.float64)
    u, vt = torch.randn(9, 3, dtype=torch.float64), torch.randn(3, 2, 8, dtype=torch.float64)
    direct = relocate_keys(keys + (u @ vt.reshape(3, -1)).reshape(9, 2, 8), SPEC, 5000)
    fused = relocate_keys(keys, SPEC, 5000, patch=(u, vt))
    u2, vt2 = relocate_patch(u, vt, SPEC, 5000)
    split = relocate_keys(keys, SPEC, 5000) + (u2 @ vt2.reshape(3, -1)).reshape(9, 2, 8)
    assert u2 is u
    assert torch.allclose(direct, fused, atol=1e-12) and torch.allclose(direct, split, atol=1e-12)
