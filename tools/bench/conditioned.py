"""The conditioned pass: one forward over [antecedent, chunk] that yields the chunk's conditioned
KV together with the statistics patch fitting needs (the chunk's own queries and the attention
mass its tokens receive).

The statistics are captured through transformers' attention interface: a registered attention
function records each layer's post-RoPE queries and attention probabilities for the chunk's rows,
then hands the computation to transformers' own SDPA implementation. No model code is copied, and
the pass's KV is exactly what the model would cache.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from agentwin.models.kv import LayerKV, extract_kv
from agentwin.models.residual import recording
from kamera_core import KVLayout, RopeSpec, relocate_keys

CAPTURE = "kamera_capture"


@dataclass
class _Recorder:
    """Per layer: queries `[T_chunk, Hq, D]` and attention mass on the chunk's keys `[T_chunk]`."""

    chunk_start: int
    chunk_end: int
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    mass: dict[int, torch.Tensor] = field(default_factory=dict)


_ACTIVE: list[_Recorder] = []


def _capture_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention that records what patch fitting needs, then runs transformers' SDPA path.

    query: `[B, Hq, T, D]` post-RoPE; key/value: `[B, Hkv, S, D]`; attention_mask: additive
    `[B, 1, T, S]` (the eager mask), or None.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _ACTIVE and getattr(module, "layer_idx", None) is not None:  # decoder layers only
        rec = _ACTIVE[-1]
        lo, hi = rec.chunk_start, rec.chunk_end
        layer = module.layer_idx
        rec.queries[layer] = query[0, :, lo:hi].transpose(0, 1).detach().clone()  # (T_chunk, Hq, D)
        groups = query.shape[1] // key.shape[1]
        keys = key[0].repeat_interleave(groups, dim=0)  # (Hq, S, D)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = query[0, :, lo:hi].double() @ keys.double().transpose(-1, -2) * scale  # (Hq, T_chunk, S)
        if attention_mask is not None:
            scores = scores + attention_mask[0, :, lo:hi, : scores.shape[-1]].double()
        probs = torch.softmax(scores, dim=-1)
        rec.mass[layer] = probs[:, :, lo:hi].mean(dim=(0, 1))  # (T_chunk,) mass on the chunk's keys
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(CAPTURE, _capture_attention)
    AttentionMaskInterface.register(CAPTURE, eager_mask)


def _set_decoder_attention(model: Any, name: str) -> None:
    """Select attention `name` for the decoder only (a vision tower keeps its own), through
    transformers' public `set_attn_implementation`."""
    if getattr(model.config, "vision_config", None) is not None:
        model.set_attn_implementation({"text_config": name})
    else:
        model.set_attn_implementation(name)


@contextlib.contextmanager
def capturing(model: Any, chunk_start: int, chunk_end: int) -> Iterator[_Recorder]:
    """Within the block, the model's attention records statistics for tokens [chunk_start, chunk_end)."""
    _register()
    saved = model.config.get_text_config()._attn_implementation
    rec = _Recorder(chunk_start, chunk_end)
    _ACTIVE.append(rec)
    try:
        _set_decoder_attention(model, CAPTURE)
        yield rec
    finally:
        _ACTIVE.pop()
        _set_decoder_attention(model, saved)


@dataclass(frozen=True, slots=True)
class ConditionedPass:
    """What one forward over [antecedent, chunk] gives.

    kv: every layer's KV of the whole sequence, token-major (as `extract_kv`), at the pass's positions.
    chunk_start / chunk_end: the chunk's token range in that sequence.
    queries: per layer the chunk's post-RoPE queries moved into the chunk-local frame,
        `[T_chunk, Hq, D]` float32 (empty for MLA, whose queries are not in the key space).
    mass: per layer the mean attention probability each chunk token receives from the chunk's
        own queries, `[T_chunk]` float64.
    logits: the pass's last-position logits `[vocab]`.
    residual: per layer ||h||² of the residual stream entering it at each chunk row, `[T_chunk]`
        float64 (`agentwin.models.residual`).
    """

    kv: list[LayerKV]
    chunk_start: int
    chunk_end: int
    queries: list[torch.Tensor]
    mass: list[torch.Tensor]
    logits: torch.Tensor
    residual: list[torch.Tensor]

    def chunk_kv(self) -> list[LayerKV]:
        """The chunk's KV rows `[T_chunk, ...]`, still at the pass's positions."""
        return [(k[self.chunk_start : self.chunk_end], v[self.chunk_start : self.chunk_end]) for k, v in self.kv]


def conditioned_pass(model: Any, input_ids: torch.Tensor, chunk_start: int, specs: list[RopeSpec],
                     layout: KVLayout, position_ids: torch.Tensor | None = None, **model_inputs: Any) -> ConditionedPass:
    """Run the model once over `input_ids` `[T]` (antecedent then chunk, the chunk from
    `chunk_start` to the end) and collect the chunk's conditioned KV and query statistics.

    position_ids: `[1, T]` (or `[3, 1, T]` for M-RoPE); default 0..T-1. The chunk's queries are
    rotated back by the chunk's first position so they live in the same frame as its canonical KV.
    """
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D [tokens], got shape {tuple(input_ids.shape)}")
    total = int(input_ids.shape[0])
    if not 0 <= chunk_start < total:
        raise ValueError(f"chunk_start {chunk_start} must lie in [0, {total})")
    if position_ids is None:
        position_ids = torch.arange(total)[None]
    with capturing(model, chunk_start, total) as rec, recording(model, slice(chunk_start, None)) as found, \
            torch.no_grad():
        out = model(input_ids=input_ids[None], position_ids=position_ids, use_cache=True, **model_inputs)
    first = int(position_ids.reshape(-1, total)[0, chunk_start])
    queries = []
    for layer, spec in enumerate(specs):
        q = rec.queries[layer]
        if layout.family == "mla":
            queries.append(torch.empty(0))
        else:
            queries.append(relocate_keys(q.float(), spec, -first, backend="torch"))
    return ConditionedPass(
        kv=[(k.clone(), v.clone()) for k, v in extract_kv(out.cache, layout)],
        chunk_start=chunk_start,
        chunk_end=total,
        queries=queries,
        mass=[rec.mass[layer] for layer in range(len(specs))],
        logits=out.logits[0, -1],
        residual=[found[layer] for layer in range(len(specs))],
    )
