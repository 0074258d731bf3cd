"""RoPE specifications read from a transformers config, one per layer.

A `RopeSpec` says exactly how the keys a model stores in its KV cache were rotated: the inverse
frequencies (the float32 values the model itself uses), how many leading dims of each head rotate,
and how the rotated dims are paired. That is all exact relocation needs: shifting a chunk by δ
positions multiplies every pair (x1, x2) of frequency f by the rotation of angle δ·f.

This module reads configs by attribute only (duck typing); it never imports transformers.

Families covered:
- default, linear, llama3 and yarn frequency scaling (all position independent);
- partial rotary (GPT-NeoX `rotary_pct` / `partial_rotary_factor`): only the first `rotary_dim`
  dims of a head rotate, the rest are copied;
- rotate_half pairs (i, i + rotary_dim/2) versus interleaved pairs (2i, 2i+1) as stored by
  DeepSeek-V2's complex form;
- Qwen2-VL / Qwen2.5-VL M-RoPE sections and Qwen3-VL interleaved M-RoPE: each frequency reads the
  t, h or w position; relocation shifts all three by the same δ, so the phase of frequency f is
  still δ·f and the rotation is the 1-D one;
- per-layer-type θ (`rope_parameters` keyed by `layer_types`, e.g. Gemma-3 local/global);
- MLA's decoupled k_rope (DeepSeek-V2/V3): the spec describes k_rope only.

Refused with `UnsupportedModelError`: dynamic NTK and longrope (frequencies depend on the sequence
length, so a stored key cannot be moved without knowing the length it will be read at), any other
rope type we have not verified, models with no RoPE, and model types whose key layout we have not
checked against their own forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

Pairing = Literal["half", "interleaved"]
Family = Literal["mha", "gqa", "mla"]


class UnsupportedModelError(ValueError):
    """The model's keys cannot be relocated exactly; the message names the model and the reason."""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """How one layer's cached keys were rotated.

    inv_freq: the model's float32 inverse frequencies, held as Python floats (exact), one per
        rotated pair; `rotary_dim == 2 * len(inv_freq)`.
    head_dim: last-dim size of the rotated tensor (MLA: the k_rope width).
    pairing: "half" pairs dim i with i + rotary_dim/2; "interleaved" pairs 2i with 2i+1.
    attention_scaling: the factor the model multiplies cos/sin by (yarn's mscale); it is already in
        the stored keys and relocation, a pure rotation, leaves it there.
    mrope_section / mrope_interleaved: Qwen-VL M-RoPE bookkeeping (which axis feeds which
        frequency); they do not change the relocation rotation, they matter for position spans.
    """

    inv_freq: tuple[float, ...]
    head_dim: int
    pairing: Pairing = "half"
    rope_type: str = "default"
    attention_scaling: float = 1.0
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    layer_type: str | None = None

    def __post_init__(self) -> None:
        if not self.inv_freq:
            raise ValueError("RopeSpec needs at least one inverse frequency")
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} exceeds head_dim {self.head_dim}")
        if self.pairing not in ("half", "interleaved"):
            raise ValueError(f"pairing must be 'half' or 'interleaved', got {self.pairing!r}")

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shapes of one layer's cached KV in the token-major layout kamera_core uses.

    mha / gqa: keys and values `[tokens, num_kv_heads, head_dim]` (values: `value_dim`).
    mla: latent c_KV `[tokens, kv_lora_rank]` (reused byte for byte) and k_rope
        `[tokens, rope_dim]` (the only rotated tensor); `num_kv_heads == 1`.
    """

    family: Family
    num_layers: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    kv_lora_rank: int | None = None
    rope_dim: int | None = None


# Model types whose cached-key layout was checked against the model's own forward (tests).
# Value: the pairing of rotated dims in the cached keys.
_VERIFIED_PAIRING: dict[str, Pairing] = {
    "llama": "half",
    "mistral": "half",
    "qwen2": "half",
    "qwen3": "half",
    "gpt_neox": "half",
    "gemma3_text": "half",
    "qwen2_vl": "half",
    "qwen2_vl_text": "half",
    "qwen2_5_vl": "half",
    "qwen2_5_vl_text": "half",
    "qwen3_vl": "half",
    "qwen3_vl_text": "half",
    "deepseek_v2": "interleaved",  # complex-number form keeps pairs (2i, 2i+1) in the cache
    "deepseek_v3": "half",  # rope_interleave de-interleaves into rotate_half order before caching
}
_MROPE_DEFAULT_SECTION = {"qwen2_vl": (16, 24, 24), "qwen2_5_vl": (16, 24, 24), "qwen3_vl": (24, 20, 20)}
_EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LENGTH_DEPENDENT = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from the sequence length",
    "longrope": "longrope switches frequency tables when the sequence passes a length threshold",
}


def model_name(config: Any) -> str:
    """A readable name for error messages: path or hub name when known, else the model type."""
    name = getattr(config, "_name_or_path", "") or ""
    mtype = getattr(config, "model_type", None) or type(config).__name__
    return f"{name} ({mtype})" if name else str(mtype)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _base_type(mtype: str) -> str:
    return mtype[: -len("_text")] if mtype.endswith("_text") else mtype


def _head_dim(cfg: Any) -> int:
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return int(cfg.hidden_size) // int(cfg.num_attention_heads)


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    # The same float32 expression transformers evaluates, so the values match bit for bit.
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(params: dict, base: float, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(cfg: Any, params: dict, base: float, dim: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original_max = params["original_max_position_embeddings"]
    if factor is None:
        factor = cfg.max_position_embeddings / original_max

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim))
        else:
            attention_factor = mscale_of(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _layer_params(cfg: Any, name: str) -> list[tuple[str | None, dict]]:
    """(layer_type, rope parameters) for every layer."""
    num_layers = int(cfg.num_hidden_layers)
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        theta = getattr(cfg, "rope_theta", None)
        if theta is None:
            raise UnsupportedModelError(
                f"{name}: the config has no RoPE parameters (absolute or ALiBi positions?); "
                "Kamera relocates RoPE keys only"
            )
        params = {"rope_type": "default", "rope_theta": theta}
    layer_types = getattr(cfg, "layer_types", None)
    if isinstance(params, dict) and layer_types and all(t in params for t in set(layer_types)):
        return [(t, params[t]) for t in layer_types]
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise UnsupportedModelError(f"{name}: unrecognised rope_parameters {params!r}")
    return [(None, params)] * num_layers


def rope_specs(config: Any) -> tuple[RopeSpec, ...]:
    """One `RopeSpec` per decoder layer of the model described by a transformers `config`.

    Reads `config.get_text_config()` for multimodal configs. Raises `UnsupportedModelError` (a
    `ValueError`) naming the model and the reason when its keys cannot be relocated exactly.
    """
    name = model_name(config)
    cfg = _text_config(config)
    mtype = getattr(cfg, "model_type", None) or getattr(config, "model_type", None)
    if mtype not in _VERIFIED_PAIRING:
        supported = ", ".join(sorted(t for t in _VERIFIED_PAIRING if not t.endswith("_text")))
        raise UnsupportedModelError(
            f"{name}: model type {mtype!r} is not one whose cached-key layout has been verified for "
            f"exact relocation. Supported: {supported}. Use one of those, or add the type with an "
            "oracle test against its own forward."
        )
    pairing = _VERIFIED_PAIRING[mtype]
    base_type = _base_type(mtype)
    is_mla = getattr(cfg, "kv_lora_rank", None) is not None and getattr(cfg, "qk_rope_head_dim", None)
    head_dim = int(cfg.qk_rope_head_dim) if is_mla else _head_dim(cfg)

    specs = []
    for layer_type, params in _layer_params(cfg, name):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in _LENGTH_DEPENDENT:
            raise UnsupportedModelError(
                f"{name}: rope_type {rope_type!r} cannot be relocated exactly: "
                f"{_LENGTH_DEPENDENT[rope_type]}. Load the model without that scaling, or use a "
                "model whose frequencies do not depend on the sequence length."
            )
        if rope_type not in _EXACT_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{name}: rope_type {rope_type!r} is not supported for exact relocation "
                f"(supported: {', '.join(_EXACT_ROPE_TYPES)})"
            )
        base = float(params["rope_theta"])
        partial = float(params.get("partial_rotary_factor", 1.0) or 1.0)
        rotary_dim = int(head_dim * partial)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise UnsupportedModelError(f"{name}: rotary_dim {rotary_dim} must be positive and even")
        attention_scaling = 1.0
        if rope_type == "default":
            inv_freq = _default_inv_freq(base, rotary_dim)
        elif rope_type == "linear":
            inv_freq = _default_inv_freq(base, rotary_dim) / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(params, base, rotary_dim)
        else:
            inv_freq, attention_scaling = _yarn_inv_freq(cfg, params, base, rotary_dim)
        section = None
        if base_type in _MROPE_DEFAULT_SECTION:
            section = tuple(params.get("mrope_section") or _MROPE_DEFAULT_SECTION[base_type])
        specs.append(
            RopeSpec(
                inv_freq=tuple(float(f) for f in inv_freq.tolist()),
                head_dim=head_dim,
                pairing=pairing,
                rope_type=rope_type,
                attention_scaling=float(attention_scaling),
                mrope_section=section,
                mrope_interleaved=base_type == "qwen3_vl",
                layer_type=layer_type,
            )
        )
    return tuple(specs)


def kv_layout(config: Any) -> KVLayout:
    """The attention family and cached-KV shapes of the model described by `config`."""
    cfg = _text_config(config)
    num_layers = int(cfg.num_hidden_layers)
    kv_lora_rank = getattr(cfg, "kv_lora_rank", None)
    if kv_lora_rank is not None and getattr(cfg, "qk_rope_head_dim", None):
        rope_dim = int(cfg.qk_rope_head_dim)
        return KVLayout("mla", num_layers, 1, rope_dim, int(kv_lora_rank), int(kv_lora_rank), rope_dim)
    num_heads = int(cfg.num_attention_heads)
    num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
    head_dim = _head_dim(cfg)
    family: Family = "mha" if num_kv_heads == num_heads else "gqa"
    return KVLayout(family, num_layers, num_kv_heads, head_dim, head_dim)
