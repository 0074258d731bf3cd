"""Contexts for comparing reuse methods: chunks in reading order, every chunk's canonical KV,
the full-prefill KV and the reference reading of each query.

A `Context` is a sequence of chunks as the model finally reads them (the first chunk is always
exact: it sits at the front, where its canonical KV is what a prefill gives). A method builds the
KV of the whole context from what a content-keyed cache holds (every chunk's canonical KV,
encoded alone at position 0) plus its own extra work (`tools.bench.baselines`,
`tools.bench.fits`), and the queries are read after that KV with the model's own forward
(`tools.bench.metrics`). The reference is a full re-prefill of [context, query].
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from agentwin.models.kv import LayerKV, extract_kv
from kamera_core import kv_layout, rope_specs


def decoder_of(model: Any) -> Any:
    """The decoder stack (embed_tokens, rotary_emb, layers, norm) of a causal LM or a Qwen-VL model."""
    inner = model.model
    return getattr(inner, "language_model", inner)


@dataclass
class Captured:
    """The decoder's inputs of one forward: embeddings `[T, H]`, positions as the decoder took
    them (`[1, T]`, `[3, 1, T]` or `[4, 1, T]`), and Qwen3-VL deepstack inputs when present."""

    embeds: torch.Tensor
    positions: torch.Tensor
    visual_mask: torch.Tensor | None = None  # [T] bool
    deepstack: list[torch.Tensor] | None = None  # per layer [n_visual, H]


def capture_forward(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, **mm: Any) -> tuple[Any, Captured]:
    """The model's forward of `input_ids [T]` (with multimodal inputs `mm`) and its decoder inputs."""
    dec = decoder_of(model)
    seen: dict[str, Any] = {}

    def hook(_module, args, kwargs):
        seen.update(kwargs)
        if args:
            seen["input_ids"] = args[0]

    handle = dec.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids[None], position_ids=position_ids, use_cache=True, **mm)
    finally:
        handle.remove()
    embeds = seen.get("inputs_embeds")
    if embeds is None:
        with torch.no_grad():
            embeds = dec.embed_tokens(seen["input_ids"])
    pos = seen.get("position_ids")
    if pos is None:
        pos = position_ids
    vis = seen.get("visual_pos_masks")
    ds = seen.get("deepstack_visual_embeds")
    return out, Captured(embeds[0].detach(), pos.detach(), None if vis is None else vis[0].detach(),
                         None if ds is None else [d.detach() for d in ds])


# ---- chunks and contexts ------------------------------------------------------------------------------

@dataclass
class Chunk:
    """A chunk: ids `[T]`, local positions (`[T]` or `[3, T]` from 0), multimodal inputs, kind."""

    ids: torch.Tensor
    positions: torch.Tensor
    mm: dict = field(default_factory=dict)
    kind: str = "text"  # "text" | "image" | "frame"

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def text_chunk(ids: torch.Tensor) -> Chunk:
    return Chunk(ids, torch.arange(int(ids.shape[0])))


def is_mrope(model: Any) -> bool:
    return hasattr(model, "model") and hasattr(model.model, "get_rope_index")


def mm_positions(model: Any, ids: torch.Tensor, mm: dict) -> tuple[torch.Tensor, dict]:
    """`[3, T]` M-RoPE positions of `ids` from 0 by the model's own rule, and mm with the token types."""
    mm = dict(mm)
    types = (ids == model.config.image_token_id).to(torch.int32)[None]
    mm["mm_token_type_ids"] = types
    if "image_grid_thw" in mm:
        pos, _ = model.model.get_rope_index(input_ids=ids[None], mm_token_type_ids=types,
                                            image_grid_thw=mm["image_grid_thw"])
        return pos[:, 0], mm
    return torch.arange(int(ids.shape[0])).expand(3, -1).clone(), mm


def join_chunks(model: Any, chunks: Sequence[Chunk]) -> Chunk:
    ids = torch.cat([c.ids for c in chunks])
    if not is_mrope(model):
        return text_chunk(ids)
    pix = [c.mm["pixel_values"] for c in chunks if "pixel_values" in c.mm]
    grids = [c.mm["image_grid_thw"] for c in chunks if "image_grid_thw" in c.mm]
    mm = {"pixel_values": torch.cat(pix), "image_grid_thw": torch.cat(grids)} if pix else {}
    pos, mm = mm_positions(model, ids, mm)
    return Chunk(ids, pos, mm)


def position_ids(pos: torch.Tensor) -> torch.Tensor:
    return pos[None] if pos.dim() == 1 else pos[:, None]


def forward_chunk(model: Any, chunk: Chunk, cache: Any = None, start_pos: torch.Tensor | None = None) -> Any:
    pos = position_ids(chunk.positions if start_pos is None else start_pos)
    dtype = next(model.parameters()).dtype
    mm = {k: (v.to(dtype) if k == "pixel_values" else v) for k, v in chunk.mm.items()}
    if cache is not None:
        mm = {}
    with torch.no_grad():
        return model(input_ids=chunk.ids[None], position_ids=pos, cache=cache, use_cache=True, **mm)


def encode_alone(model: Any, chunk: Chunk) -> list[LayerKV]:
    """The chunk's canonical KV: encoded alone from position 0 (owned copies)."""
    layout = kv_layout(model.config)
    return [(k.clone(), v.clone()) for k, v in extract_kv(forward_chunk(model, chunk).cache, layout)]


def first_position(pos: torch.Tensor, index: int) -> int:
    return int(pos.reshape(-1, pos.shape[-1])[0, index])


@dataclass
class Context:
    """Chunks in reading order with everything measured once: the reference forward of each
    query, the full-prefill KV of the context, each chunk's canonical KV and its shift."""

    model: Any
    chunks: list[Chunk]
    queries: list[torch.Tensor]
    bounds: list[tuple[int, int]]          # token range of each chunk in the context
    shifts: list[int]                      # position shift of each chunk (first position)
    cap: Captured                          # decoder inputs of [context] (the first query's forward)
    full_kv: list[LayerKV]                 # full-prefill KV of the context
    canonical: list[list[LayerKV]]         # per chunk, encoded alone, chunk-local frame
    reference: list[torch.Tensor]          # per query, its last logits after the full-prefill KV
    query_pos: list[torch.Tensor]          # per query, its position ids as the full forward used
    reference_ids: list[torch.Tensor]      # per query, greedy continuation of the full forward
    prefill_s: float                       # time of one prefill of the context (no query)
    specs: list = field(default_factory=list)
    layout: Any = None
    canonical_s: list = field(default_factory=list)  # per chunk, time of its canonical encode

    @property
    def length(self) -> int:
        return self.bounds[-1][1]

    def reused_tokens(self) -> int:
        return sum(e - s for s, e in self.bounds[1:])

    def reused_token_layers(self) -> int:
        """Tokens × layers of a re-prefill of the reused chunks: the unit of every compute figure."""
        return self.reused_tokens() * len(self.full_kv)

    def reused_kv_bytes(self, itemsize: int = 2) -> int:
        return sum((k.numel() + v.numel()) * itemsize for c in self.canonical[1:] for k, v in c)


def build_context(model: Any, chunks: Sequence[Chunk], queries: Sequence[torch.Tensor], greedy: int = 0) -> Context:
    """Measure everything a method comparison needs for `chunks` read in this order."""
    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    whole = join_chunks(model, chunks)
    bounds, s = [], 0
    for c in chunks:
        bounds.append((s, s + len(c)))
        s += len(c)
    shifts = [first_position(whole.positions, lo) for lo, _ in bounds]
    t0 = time.perf_counter()
    out, cap = capture_forward(model, whole.ids, position_ids(whole.positions), **{
        k: (v.to(next(model.parameters()).dtype) if k == "pixel_values" else v) for k, v in whole.mm.items()})
    prefill_s = time.perf_counter() - t0
    full_kv = [(k.clone(), v.clone()) for k, v in extract_kv(out.cache, layout)]
    canonical, canonical_s = [], []
    for c in chunks:
        t0 = time.perf_counter()
        canonical.append(encode_alone(model, c))
        canonical_s.append(time.perf_counter() - t0)
    reference, query_pos, reference_ids = [], [], []
    for q in queries:
        # The re-prefill: the query read after the context's full-prefill KV, at the positions a
        # single forward of [context, query] gives it.
        qpos = join_chunks(model, [*chunks, text_chunk(q)]).positions[..., s:]
        logits, ids = read_after(model, layout, [full_kv], q, qpos, greedy)
        reference.append(logits[0])
        query_pos.append(qpos)
        reference_ids.append(ids[0])
    return Context(model, list(chunks), list(queries), bounds, shifts, cap, full_kv, canonical, reference,
                   query_pos, reference_ids, prefill_s, specs, layout, canonical_s)


def read_after(model: Any, layout: Any, kvs: Sequence[Sequence[LayerKV]], q: torch.Tensor, qpos: torch.Tensor,
               steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query `q` read after each of `kvs` (all of one length), in one batched forward per step:
    (its last logits `[B, V]`, then `steps` greedy tokens `[B, steps]`; 1-D or M-RoPE text
    positions continue by one per token). Decoding one token re-reads every weight, so batching
    the caches reads them once per step for all; rows are independent (no padding), so each row
    is that cache's own reading."""
    n = len(kvs)
    cache = batched_cache(kvs, model.config, layout)
    ids, pos = q[None].expand(n, -1), position_ids(qpos)
    first, out = None, []
    with torch.no_grad():
        for _ in range(max(1, steps)):
            p = pos.expand(*pos.shape[:-2], n, pos.shape[-1]) if pos.dim() == 3 else pos.expand(n, -1)
            last = model(input_ids=ids, position_ids=p, cache=cache, use_cache=True,
                         logits_to_keep=1).logits[:, -1].float()
            first = last if first is None else first
            if not steps:
                break
            nxt = last.argmax(-1)
            out.append(nxt)
            ids, pos = nxt[:, None], pos[..., -1:] + 1
    return first, torch.stack(out, 1) if out else torch.zeros(n, 0, dtype=torch.long)


def query_logits(model: Any, layout: Any, kv: Sequence[LayerKV], q: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """Last logits of query `q` read after a cache holding `kv`, at positions `qpos`."""
    return read_after(model, layout, [kv], q, qpos, 0)[0][0]


def batched_cache(kvs: Sequence[Sequence[LayerKV]], config: Any, layout: Any) -> Any:
    """A transformers `DynamicCache` of batch len(kvs): row b holds kvs[b] (all of one length)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for index in range(len(kvs[0])):
        ks, vs = [kv[index][0] for kv in kvs], [kv[index][1] for kv in kvs]
        if layout.family == "mla":
            ks, vs = [k[:, None] for k in ks], [v[:, None] for v in vs]
        cache.update(torch.stack([k.transpose(0, 1) for k in ks]), torch.stack([v.transpose(0, 1) for v in vs]), index)
    return cache


def image_chunk(model: Any, seed: int, grid_hw: tuple[int, int] = (8, 8), text_around: int = 3,
                kind: str = "image") -> Chunk:
    """[text, <vision_start>, image tokens, <vision_end>, text] with seeded random pixels, for the
    tiny Qwen-VL models (a video frame is carried as one image; `kind` labels it)."""
    cfg = model.config
    vcfg = cfg.vision_config
    merge = vcfg.spatial_merge_size
    h, w = grid_hw
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([
        torch.randint(3, 240, (text_around,), generator=g),
        torch.tensor([cfg.vision_start_token_id]),
        torch.full((h * w // (merge * merge),), cfg.image_token_id),
        torch.tensor([cfg.vision_end_token_id]),
        torch.randint(3, 240, (text_around,), generator=g),
    ])
    patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2
    mm = {"pixel_values": torch.randn(h * w, patch_dim, generator=g), "image_grid_thw": torch.tensor([[1, h, w]])}
    pos, mm = mm_positions(model, ids, mm)
    return Chunk(ids, pos, mm, kind)


def random_text_chunk(model: Any, seed: int, length: int) -> Chunk:
    """Seeded random text tokens (ids 3..239) with the model's positions from 0."""
    ids = torch.randint(3, 240, (length,), generator=torch.Generator().manual_seed(seed))
    if not is_mrope(model):
        return text_chunk(ids)
    pos, mm = mm_positions(model, ids, {})
    return Chunk(ids, pos, mm)

