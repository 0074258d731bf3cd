"""Test support: the float64 oracle, chunk inputs per model family, KV extraction, assert_close.

The oracle is the transformers model's own forward run in float64. Its rotary modules compute
angles in float32 even in a float64 model (`position_ids.float() * inv_freq`), which at position
100000 is off by ~6e-3 rad, so `float64_rope` swaps each rotary module's forward for the same
computation done in float64 (same inv_freq buffer, same attention scaling, the module's own
M-RoPE recomposition). Everything else is the model's code. `test_oracle_rope_agrees_*` checks the
swap against the unmodified forward at small positions, where float32 angles are accurate.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import dataclass
from types import MethodType
from typing import Any, Iterator

import torch

from agents.local_site import send_html  # noqa: F401 (the tests' HTML handlers use it)
from agentwin.models.kv import extract_kv
from agentwin.models.zoo import TINY, build_tiny
from kamera_core import kv_layout

# Max abs error allowed, relative to max|reference|, per dtype of the relocated tensor.
REL_TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def tolerance(dtype: torch.dtype, magnitude: float, growth: float = 1.0) -> float:
    """The largest difference rounding alone explains between two computations of one quantity in
    `dtype`: eps(dtype) · magnitude · growth, eps being `torch.finfo(dtype).eps`.

    Why not a constant: another CPU's kernels (AVX-512, AVX2, plain) block and order float32
    reductions differently, so two computations that agree to rounding differ by amounts that
    move from machine to machine; a bound read off one machine's run fails on the next, a bound
    from the dtype's spacing holds on each.

    magnitude: the size of the values compared or of the intermediates they are rounded from,
        which can be the larger (a log-probability is rounded at |log p|, not at the gap between
        two of them; a relocated key at |k|).
    growth: how many roundings may add up, stated at the call site: √n for a sum or dot product
        of n terms rounded independently, n where they can all lean one way, the number of layers
        a forward's error passes through, the position where a rotation angle is rounded
        (position · inv_freq carries eps · position rad).

    A KL divergence between two distributions whose log-probabilities agree within δ is second
    order in δ (KL ≈ ½·Σ p·δ² ≤ ½·δ²) when it is computed from normalised distributions (the
    log-softmax of the logits taken in float64, as `kamera_core.metrics.kl_divergence` does with
    logits): its tolerance is ½·tolerance(...)² of the log-probabilities. Summed from
    log-probabilities each rounded by itself (float32 log-probabilities, or a float32 loss), the
    rounding breaks the normalisation and leaves a first-order term of either sign, up to
    eps · max|log p| per rounding: that is its tolerance then, and the KL may read negative.
    """
    return torch.finfo(dtype).eps * float(magnitude) * float(growth)


def forward_growth(config: Any) -> float:
    """`tolerance`'s growth for the logits or log-probabilities of two float32 forwards of one model
    over the same tokens that round differently (other kernels, the KV split into cached parts,
    read back from a store, relocated): √(hidden_size · num_layers). Each layer's projections
    reduce over hidden_size terms, whose independent roundings add as a random walk (√hidden_size
    of the terms' scale), and each layer adds its error to the stream the next one reads
    (√num_layers); the log-softmax's own rounding is eps · |log p|, the magnitude to pass."""
    text = getattr(config, "text_config", None) or config
    return math.sqrt(text.hidden_size * text.num_hidden_layers)


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, mean abs error) computed in float64."""
    diff = (actual.double() - expected.double()).abs()
    return float(diff.max()), float(diff.mean())


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float | None = None, what: str = "",
                 growth: float = 1.0) -> None:
    """Fails with the max and mean error when any element differs by more than `atol`; by default
    `tolerance` of the coarser dtype of the two, max|expected| and `growth`."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if atol is None:
        coarser = max(actual.dtype, expected.dtype, key=lambda d: torch.finfo(d).eps)
        atol = tolerance(coarser, float(expected.abs().max()), growth)
    worst, mean = max_err(actual, expected)
    assert worst <= atol, f"{what}: max abs err {worst:.3e} (mean {mean:.3e}) > tol {atol:.3e}"


def rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's rotary modules (vision towers' own 2-D ropes are left alone)."""
    return [m for name, m in model.named_modules() if name.split(".")[-1] == "rotary_emb"]


def _float64_forward(self, x, position_ids, layer_type=None):
    if layer_type is not None:
        inv_freq = getattr(self, f"{layer_type}_inv_freq")
        scaling = getattr(self, f"{layer_type}_attention_scaling")
    else:
        inv_freq, scaling = self.inv_freq, self.attention_scaling
    if hasattr(self, "mrope_section"):
        position_ids = position_ids.expand(3, -1, -1)  # (3, B, T)
    freqs = position_ids[..., None].double() * inv_freq.to(device=x.device, dtype=torch.float64)
    if type(self).__name__ == "DeepseekV2RotaryEmbedding":
        return torch.polar(torch.ones_like(freqs), freqs) * scaling
    if hasattr(self, "recomposition_frequencies"):
        cos = self.recomposition_frequencies(freqs.cos() * scaling)
        sin = self.recomposition_frequencies(freqs.sin() * scaling)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


@contextlib.contextmanager
def float64_rope(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's rotary modules compute their angles in float64."""
    mods = rotary_modules(model)
    if not mods:
        raise RuntimeError("no rotary_emb module found; the oracle cannot be built (a test bug)")
    saved = [m.forward for m in mods]
    try:
        for m in mods:
            m.forward = MethodType(_float64_forward, m)
        yield
    finally:
        for m, f in zip(mods, saved):
            m.forward = f


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` in `dtype` whose rotary inv_freq buffers keep their float32 values, as a
    `from_pretrained(dtype=...)` load would (a plain `.to(bfloat16)` rounds them)."""
    out = copy.deepcopy(model)
    keep = {name: buf.clone() for name, buf in model.named_buffers() if "inv_freq" in name}
    out = out.to(dtype)
    for name, buf in out.named_buffers():
        if name in keep:
            buf.data = keep[name].clone() if dtype != torch.float64 else keep[name].to(torch.float64)
    return out.eval()


@dataclass
class Chunk:
    """A chunk's model inputs and its base positions (chunk-local frame, start 0).

    positions: `[T]` for 1-D RoPE models, `[3, T]` for M-RoPE (t, h, w).
    """

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor
    mm: dict  # pixel_values / image_grid_thw / mm_token_type_ids, or {}

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def is_mrope(model: Any) -> bool:
    return hasattr(model, "model") and hasattr(model.model, "get_rope_index")


def text_chunk(num_tokens: int, seed: int, vocab_hi: int = 240) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_hi, (num_tokens,), generator=g)


def image_chunk(model: Any, seed: int, grid_hw: tuple[int, int] = (6, 8), text_around: int = 3) -> tuple[torch.Tensor, dict]:
    """Token ids and vision inputs of [text, <vision_start>, image tokens, <vision_end>, text]."""
    cfg = model.config
    vcfg = cfg.vision_config
    merge = vcfg.spatial_merge_size
    h, w = grid_hw
    num_image_tokens = h * w // (merge * merge)
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([
        torch.randint(3, 240, (text_around,), generator=g),
        torch.tensor([cfg.vision_start_token_id]),
        torch.full((num_image_tokens,), cfg.image_token_id),
        torch.tensor([cfg.vision_end_token_id]),
        torch.randint(3, 240, (text_around,), generator=g),
    ])
    patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2
    pixel_values = torch.randn(h * w, patch_dim, generator=g)  # (t*h*w, C*T*P*P)
    mm = {"pixel_values": pixel_values, "image_grid_thw": torch.tensor([[1, h, w]])}
    return ids, mm


def make_chunk(model: Any, ids: torch.Tensor, mm: dict | None = None) -> Chunk:
    """Base positions of `ids` (start 0) by the model's own rules."""
    mm = dict(mm or {})
    if not is_mrope(model):
        return Chunk(ids, torch.arange(len(ids)), mm)
    mm_types = (ids == model.config.image_token_id).to(torch.int32)
    mm["mm_token_type_ids"] = mm_types[None]
    if "image_grid_thw" in mm:
        pos, _ = model.model.get_rope_index(
            input_ids=ids[None], mm_token_type_ids=mm_types[None], image_grid_thw=mm["image_grid_thw"]
        )
        positions = pos[:, 0]  # (3, T)
    else:
        positions = torch.arange(len(ids)).expand(3, -1)
    return Chunk(ids, positions, mm)


def concat(model: Any, *chunks: Chunk) -> Chunk:
    """[c1, c2, ...] as one sequence, positions recomputed by the model's rules."""
    ids = torch.cat([c.input_ids for c in chunks])
    pix = [c.mm["pixel_values"] for c in chunks if "pixel_values" in c.mm]
    grids = [c.mm["image_grid_thw"] for c in chunks if "image_grid_thw" in c.mm]
    mm = {"pixel_values": torch.cat(pix), "image_grid_thw": torch.cat(grids)} if pix else {}
    return make_chunk(model, ids, mm)


def position_ids(chunk: Chunk, start: int) -> torch.Tensor:
    """Positions of the chunk placed at `start`; M-RoPE shifts t, h and w alike. `[1, T]` or `[3, 1, T]`."""
    pos = chunk.positions + start
    return pos[None] if pos.dim() == 1 else pos[:, None]


def forward(model: Any, chunk: Chunk, start: int, cache: Any = None, positions: torch.Tensor | None = None):
    """The model's own forward of `chunk` at `start` (or explicit `positions`)."""
    pos = position_ids(chunk, start) if positions is None else positions
    dtype = next(model.parameters()).dtype
    mm = {k: (v.to(dtype) if k == "pixel_values" else v) for k, v in chunk.mm.items()}
    if cache is not None:
        mm.pop("pixel_values", None)
        mm.pop("image_grid_thw", None)
        mm.pop("mm_token_type_ids", None)
    with torch.no_grad():
        return model(input_ids=chunk.input_ids[None], position_ids=pos, cache=cache, use_cache=True, **mm)


def layer_kv(cache: Any, model: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) token-major from a transformers cache of batch 1.

    MHA/GQA: `[T, kv_heads, head_dim]` each. MLA: (c_KV `[T, kv_lora_rank]`, k_rope `[T, rope_dim]`).
    """
    return extract_kv(cache, kv_layout(model.config))


def rotated(kv: tuple[torch.Tensor, torch.Tensor], mla: bool) -> torch.Tensor:
    """The RoPE-carrying tensor of a layer: keys (MHA/GQA) or k_rope (MLA)."""
    return kv[1] if mla else kv[0]


TEXT_MODELS = ["tiny-llama", "tiny-llama-gqa", "tiny-gpt-neox", "tiny-gemma3", "tiny-deepseek-v2", "tiny-deepseek-v3"]
VL_MODELS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]
assert set(TEXT_MODELS + VL_MODELS) == set(TINY)


def tiny(name: str, config: Any = None) -> Any:
    return build_tiny(name, seed=0, config=config)


def window_step(win: Any, op: str, arg: int, evicted: list, append: Any) -> None:
    """One step of a random operation sequence: "evict" drops a chunk of the window (remembered in
    `evicted`), "recall" brings one of those back to its slot, "reorder" rotates the window by
    `arg` places, any other op calls append(op, arg). Evict, recall and reorder with nothing to act
    on do nothing."""
    if op == "reorder":
        order = win.chunks()
        if order:
            shift = arg % len(order)
            win.reorder(order[shift:] + order[:shift])
    elif op == "evict":
        if win.chunks():
            victim = win.chunks()[arg % len(win.chunks())]
            win.evict(victim)
            evicted.append(victim)
    elif op == "recall":
        if evicted:
            win.recall(evicted.pop(arg % len(evicted)))
    else:
        append(op, arg)


def write_lines(path: Any, lines: list) -> Any:
    """A JSON-lines file at `path`: strings written as they are, anything else as JSON."""
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path
