"""One harness for every reuse method: the same model, the same chunks, the same queries.

A `Context` is a sequence of chunks as the model finally reads them (the first chunk is always
exact: it sits at the front, where its canonical KV is what a prefill gives). Each method builds
the KV of the whole context from what a content-keyed cache holds (every chunk's canonical KV,
encoded alone at position 0) plus its own extra work, and the queries are read after that KV with
the model's own forward. The reference is a full re-prefill of [context, query].

Methods (`run_method`):
- `full`: the context's KV from one full prefill (the ceiling; what every method is compared to).
- `blind`: every chunk's canonical KV moved to its place by exact RoPE re-rotation, nothing else.
- `cacheblend`: CacheBlend-style selective recompute with gradual filtering (arXiv 2405.16444).
  From blind KV, layer 0 is recomputed for every token of the reused chunks; at each later layer
  the tokens still selected are ranked by the deviation of that layer's fresh values from their
  reused values (values carry no rotation, so no key re-rotation is needed to compare), and the
  top share of each chunk is kept: 2·ratio at layer 1, narrowing linearly to `ratio` at the last
  layer (`cacheblend_ratios`). Recomputed rows replace the reused ones; every other token keeps
  its reused KV.
- `epic`: EPIC-style LegoLink (arXiv 2410.15332): the first `k` tokens of each reused chunk are
  recomputed in every layer; the rest keep the reused KV.
- `vlcache`: VLCache-style (arXiv 2512.12977): the first ceil(r·T) tokens of each reused image or
  frame chunk (on text-only workloads: of each reused chunk) are recomputed in every layer.
- `kamera-svd`, `kamera-query`, `kamera-alloc` (tools/eval_kamera.py): canonical KV plus an origin patch per reused
  chunk, fitted on its deficit in the context it was conditioned in (plain SVD, K in the query
  second-moment metric, or ranks spread by the byte-budget allocator), then relocated.
- `kamera-orbit`: the patch fitted on the deficit averaged over every order of the reordered set.

Recomputing a set S of tokens runs the model's own decoder layers on S's hidden states only, with
S's positions, over a transformers cache that holds the reused KV of the whole context; a 4-D mask
lets each token of S see the reused rows before it that are not in S and the fresh rows of S up to
itself; the fresh rows are then spliced back. Recomputing every token reproduces the full prefill
(checked against the model's forward in the tests).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from agentwin.models.kv import LayerKV, build_cache, extract_kv, relocate_kv
from kamera_core import kv_layout, rope_specs

RECOMPUTE_METHODS = ("cacheblend", "epic", "vlcache")


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


def _rotary_and_text(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(positions for the rotary module, text positions for the layers) as the decoders split them."""
    if pos.dim() == 3 and pos.shape[0] == 4:
        return pos[1:], pos[0]
    if pos.dim() == 3:
        return pos, None
    return pos, pos


def _select(pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return pos[..., idx]


def _recompute_mask(cur: torch.Tensor, total: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[1, 1, |S|, total + |S|]`: row i (context index cur[i]) sees reused rows
    j ≤ cur[i] not in S and fresh rows of S whose index ≤ cur[i]."""
    j = torch.arange(total)
    in_s = torch.zeros(total, dtype=torch.bool)
    in_s[cur] = True
    old = (j[None, :] <= cur[:, None]) & ~in_s[None, :]
    new = cur[None, :] <= cur[:, None]
    allowed = torch.cat([old, new], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def recompute(model: Any, cap: Captured, kv: Sequence[LayerKV], first: torch.Tensor,
              narrow: Any = None) -> tuple[list[LayerKV], list[int]]:
    """KV of the context with the tokens `first` (sorted context indices) recomputed.

    kv: per layer the reused KV of the whole context `[T, Hkv, D]`, at its positions.
    narrow: optional `narrow(layer, cur, h) -> keep` called before each layer ≥ 1 with the
        current index set and its hidden states `[1, |cur|, H]`; `keep` (bool `[|cur|]`) selects
        the tokens recomputed from that layer on.
    Returns (new KV per layer, tokens recomputed per layer).
    """
    dec = decoder_of(model)
    layout = kv_layout(model.config)
    if layout.family == "mla":
        raise ValueError("selective recompute covers GQA/MHA decoders here, not MLA")
    total = int(kv[0][0].shape[0])
    cur = torch.as_tensor(first, dtype=torch.long).sort().values
    out = [(k.clone(), v.clone()) for k, v in kv]
    counts: list[int] = []
    if cur.numel() == 0:
        return out, [0] * len(kv)
    cache = build_cache(kv, model.config, layout)
    h = cap.embeds[cur][None]
    vis_index = None
    if cap.visual_mask is not None:
        vis_index = torch.cumsum(cap.visual_mask.long(), 0) - 1  # row of each visual token in deepstack
    with torch.no_grad():
        for l, layer in enumerate(dec.layers):
            if narrow is not None and l > 0:
                keep = narrow(l, cur, h)
                cur, h = cur[keep], h[:, keep]
            counts.append(int(cur.numel()))
            if cur.numel() == 0:
                continue
            rot, text = _rotary_and_text(cap.positions)
            rot, text = _select(rot, cur), None if text is None else _select(text, cur)
            pe = dec.rotary_emb(h, rot)
            mask = _recompute_mask(cur, total, h.dtype)
            h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=text, cache=cache, use_cache=True)
            if isinstance(h, tuple):
                h = h[0]
            fresh_k = cache.layers[l].keys[0, :, total:].transpose(0, 1)
            fresh_v = cache.layers[l].values[0, :, total:].transpose(0, 1)
            out[l][0][cur] = fresh_k.to(out[l][0].dtype)
            out[l][1][cur] = fresh_v.to(out[l][1].dtype)
            if cap.deepstack is not None and l < len(cap.deepstack):
                vis = cap.visual_mask[cur]
                if bool(vis.any()):
                    h = h.clone()
                    h[0, vis] = h[0, vis] + cap.deepstack[l][vis_index[cur[vis]]].to(h.dtype)
    return out, counts


# ---- contexts ------------------------------------------------------------------------------

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


def _mrope(model: Any) -> bool:
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


def _join(model: Any, chunks: Sequence[Chunk]) -> Chunk:
    ids = torch.cat([c.ids for c in chunks])
    if not _mrope(model):
        return text_chunk(ids)
    pix = [c.mm["pixel_values"] for c in chunks if "pixel_values" in c.mm]
    grids = [c.mm["image_grid_thw"] for c in chunks if "image_grid_thw" in c.mm]
    mm = {"pixel_values": torch.cat(pix), "image_grid_thw": torch.cat(grids)} if pix else {}
    pos, mm = mm_positions(model, ids, mm)
    return Chunk(ids, pos, mm)


def _pos_ids(pos: torch.Tensor) -> torch.Tensor:
    return pos[None] if pos.dim() == 1 else pos[:, None]


def _forward_chunk(model: Any, chunk: Chunk, cache: Any = None, start_pos: torch.Tensor | None = None) -> Any:
    pos = _pos_ids(chunk.positions if start_pos is None else start_pos)
    dtype = next(model.parameters()).dtype
    mm = {k: (v.to(dtype) if k == "pixel_values" else v) for k, v in chunk.mm.items()}
    if cache is not None:
        mm = {}
    with torch.no_grad():
        return model(input_ids=chunk.ids[None], position_ids=pos, cache=cache, use_cache=True, **mm)


def encode_alone(model: Any, chunk: Chunk) -> list[LayerKV]:
    """The chunk's canonical KV: encoded alone from position 0 (owned copies)."""
    layout = kv_layout(model.config)
    return [(k.clone(), v.clone()) for k, v in extract_kv(_forward_chunk(model, chunk).cache, layout)]


def _first_position(pos: torch.Tensor, index: int) -> int:
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

    @property
    def length(self) -> int:
        return self.bounds[-1][1]

    def reused_tokens(self) -> int:
        return sum(e - s for s, e in self.bounds[1:])

    def reused_kv_bytes(self, itemsize: int = 2) -> int:
        return sum((k.numel() + v.numel()) * itemsize for c in self.canonical[1:] for k, v in c)


def build_context(model: Any, chunks: Sequence[Chunk], queries: Sequence[torch.Tensor], greedy: int = 0) -> Context:
    """Measure everything a method comparison needs for `chunks` read in this order."""
    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    whole = _join(model, chunks)
    bounds, s = [], 0
    for c in chunks:
        bounds.append((s, s + len(c)))
        s += len(c)
    shifts = [_first_position(whole.positions, lo) for lo, _ in bounds]
    t0 = time.perf_counter()
    out, cap = capture_forward(model, whole.ids, _pos_ids(whole.positions), **{
        k: (v.to(next(model.parameters()).dtype) if k == "pixel_values" else v) for k, v in whole.mm.items()})
    prefill_s = time.perf_counter() - t0
    full_kv = [(k.clone(), v.clone()) for k, v in extract_kv(out.cache, layout)]
    canonical = [encode_alone(model, c) for c in chunks]
    reference, query_pos, reference_ids = [], [], []
    for q in queries:
        # The re-prefill: the query read after the context's full-prefill KV, at the positions a
        # single forward of [context, query] gives it.
        qpos = _join(model, [*chunks, text_chunk(q)]).positions[..., s:]
        logits, ids = read_after(model, layout, [full_kv], q, qpos, greedy)
        reference.append(logits[0])
        query_pos.append(qpos)
        reference_ids.append(ids[0])
    return Context(model, list(chunks), list(queries), bounds, shifts, cap, full_kv, canonical, reference,
                   query_pos, reference_ids, prefill_s, specs, layout)


def read_after(model: Any, layout: Any, kvs: Sequence[Sequence[LayerKV]], q: torch.Tensor, qpos: torch.Tensor,
               steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query `q` read after each of `kvs` (all of one length), in one batched forward per step:
    (its last logits `[B, V]`, then `steps` greedy tokens `[B, steps]`; 1-D or M-RoPE text
    positions continue by one per token). Decoding one token re-reads every weight, so batching
    the caches reads them once per step for all; rows are independent (no padding), so each row
    is that cache's own reading."""
    n = len(kvs)
    cache = batched_cache(kvs, model.config, layout)
    ids, pos = q[None].expand(n, -1), _pos_ids(qpos)
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


def kl_div(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats, float64."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


# ---- building each method's KV -------------------------------------------------------------------

def placed_kv(ctx: Context, locals_: Sequence[Sequence[LayerKV]]) -> list[LayerKV]:
    """The context's KV with chunk 0 exact (its full-prefill rows) and chunk i ≥ 1 taken from
    `locals_[i]` (chunk-local frame) moved by its shift."""
    lo0, hi0 = ctx.bounds[0]
    parts = [[(k[lo0:hi0], v[lo0:hi0]) for k, v in ctx.full_kv]]
    for i in range(1, len(ctx.chunks)):
        parts.append(relocate_kv(locals_[i], ctx.specs, ctx.layout, ctx.shifts[i]))
    return [(torch.cat([p[l][0] for p in parts]), torch.cat([p[l][1] for p in parts])) for l in range(len(ctx.full_kv))]


def conditioned_local(ctx: Context, i: int) -> list[LayerKV]:
    """Chunk i's full-prefill KV moved to its chunk-local frame."""
    lo, hi = ctx.bounds[i]
    rows = [(k[lo:hi], v[lo:hi]) for k, v in ctx.full_kv]
    return relocate_kv(rows, ctx.specs, ctx.layout, -ctx.shifts[i])


@dataclass
class Result:
    """One method's KV for a context and what it cost."""

    method: str
    setting: str
    kv: list[LayerKV]
    extra_bytes: int = 0
    token_layers: int = 0      # tokens recomputed, summed over layers
    seconds: float = 0.0       # measured time of the method's own work at reuse time
    build_seconds: float = 0.0  # one-time work (patch fitting) not paid at reuse time


def method_blind(ctx: Context) -> Result:
    t0 = time.perf_counter()
    kv = placed_kv(ctx, ctx.canonical)
    return Result("blind", "", kv, seconds=time.perf_counter() - t0)


def method_full(ctx: Context) -> Result:
    return Result("full", "", [(k.clone(), v.clone()) for k, v in ctx.full_kv],
                  token_layers=ctx.reused_tokens() * len(ctx.full_kv), seconds=ctx.prefill_s)


def _chunk_indices(ctx: Context, pick) -> torch.Tensor:
    idx = []
    for i in range(1, len(ctx.chunks)):
        lo, hi = ctx.bounds[i]
        n = pick(ctx.chunks[i], hi - lo)
        idx.append(torch.arange(lo, lo + min(n, hi - lo)))
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)


def method_prefix(ctx: Context, name: str, setting: str, pick) -> Result:
    """Recompute the first `pick(chunk, T)` tokens of each reused chunk in every layer."""
    base = placed_kv(ctx, ctx.canonical)
    t0 = time.perf_counter()
    kv, counts = recompute(ctx.model, ctx.cap, base, _chunk_indices(ctx, pick))
    return Result(name, setting, kv, token_layers=sum(counts), seconds=time.perf_counter() - t0)


def method_tokens(ctx: Context, name: str, setting: str, tokens: torch.Tensor) -> Result:
    """Recompute the given context indices in every layer (a diagnostic oracle when the caller
    knows which tokens matter; no method can know that at reuse time)."""
    base = placed_kv(ctx, ctx.canonical)
    t0 = time.perf_counter()
    kv, counts = recompute(ctx.model, ctx.cap, base, tokens.sort().values)
    return Result(name, setting, kv, token_layers=sum(counts), seconds=time.perf_counter() - t0)


def method_epic(ctx: Context, k: int) -> Result:
    return method_prefix(ctx, "epic", f"k={k}", lambda c, t: k)


def method_vlcache(ctx: Context, ratio: float) -> Result:
    """First ceil(r·T) tokens of every reused image/frame chunk; of every reused chunk when the
    context holds no image or frame chunk (text workloads)."""
    visual = any(c.kind != "text" for c in ctx.chunks[1:])
    pick = (lambda c, t: math.ceil(ratio * t) if (c.kind != "text" or not visual) else 0)
    return method_prefix(ctx, "vlcache", f"r={ratio:.0%}", pick)


def cacheblend_ratios(ratio: float, layers: int) -> list[float]:
    """Share of each reused chunk's tokens recomputed at each layer: every token at layer 0, then
    min(1, 2·ratio) at layer 1, narrowing linearly to `ratio` at the last layer."""
    first = min(1.0, 2 * ratio)
    if layers < 3:
        return [1.0] + [ratio] * (layers - 1)
    return [1.0] + [ratio + (first - ratio) * (layers - 1 - l) / (layers - 2) for l in range(1, layers)]


def method_cacheblend(ctx: Context, ratio: float) -> Result:
    """CacheBlend-style gradual filtering: layer 0 over every reused token; at each later layer,
    among the tokens still selected, the top `cacheblend_ratios(...)[layer]` of each reused chunk
    by deviation of that layer's fresh values from the reused ones, so the selection narrows
    layer by layer to `ratio` at the last layer."""
    base = placed_kv(ctx, ctx.canonical)
    dec = decoder_of(ctx.model)
    all_idx = _chunk_indices(ctx, lambda c, t: t)
    chunk_of = torch.zeros(ctx.length, dtype=torch.long)
    for i, (lo, hi) in enumerate(ctx.bounds):
        chunk_of[lo:hi] = i
    ratios = cacheblend_ratios(ratio, len(dec.layers))

    def narrow(layer: int, cur: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        block = dec.layers[layer]
        v_new = block.self_attn.v_proj(block.input_layernorm(h))[0]  # (|cur|, Hkv·D)
        v_old = base[layer][1][cur].reshape(cur.numel(), -1).to(v_new.dtype)
        dev = (v_new - v_old).float().pow(2).sum(-1)
        keep = torch.zeros(cur.numel(), dtype=torch.bool)
        for i in range(1, len(ctx.chunks)):
            lo, hi = ctx.bounds[i]
            rows = (chunk_of[cur] == i).nonzero().flatten()
            count = min(rows.numel(), max(1, round(ratios[layer] * (hi - lo))))
            keep[rows[torch.topk(dev[rows], count).indices]] = True
        return keep

    t0 = time.perf_counter()
    kv, counts = recompute(ctx.model, ctx.cap, base, all_idx, narrow)
    return Result("cacheblend", f"{ratio:.0%}", kv, token_layers=sum(counts), seconds=time.perf_counter() - t0)


# ---- scoring ------------------------------------------------------------------------------------

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


def read_queries(ctx: Context, kvs: Sequence[Sequence[LayerKV]], greedy: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`read_after` of each of the context's queries, for every cache of `kvs` at once."""
    return [read_after(ctx.model, ctx.layout, kvs, q, qpos, greedy) for q, qpos in zip(ctx.queries, ctx.query_pos)]


def score_many(ctx: Context, results: Sequence[Result], greedy: int = 0, batch: int = 12) -> list[dict]:
    """`score` of every result, reading the queries for up to `batch` results at a time."""
    rows: list[dict] = []
    for lo in range(0, len(results), batch):
        group = results[lo: lo + batch]
        read = read_queries(ctx, [r.kv for r in group], greedy)
        for b, result in enumerate(group):
            rows.append(_score_row(ctx, result, [(lg[b], ids[b]) for lg, ids in read], greedy))
    return rows


def score(ctx: Context, result: Result, greedy: int = 0) -> dict:
    """Mean next-token KL, top-1 agreement and (with `greedy`) identical greedy continuations
    against the full re-prefill, over the context's queries."""
    return score_many(ctx, [result], greedy)[0]


def _score_row(ctx: Context, result: Result, read: Sequence[tuple[torch.Tensor, torch.Tensor]], greedy: int) -> dict:
    kls, top1, same, prefix, argmax = [], [], [], [], []
    for (logits, mine), ref, ref_ids in zip(read, ctx.reference, ctx.reference_ids):
        kls.append(kl_div(ref, logits))
        argmax.append(int(logits.argmax()))
        top1.append(float(argmax[-1] == int(ref.argmax())))
        if greedy:
            same.append(float(torch.equal(mine, ref_ids[:greedy])))
            agree = (mine == ref_ids[:greedy]).long()
            prefix.append(float(agree.cumprod(0).sum()) / greedy)
    row = {"method": result.method, "setting": result.setting, "kl": sum(kls) / len(kls),
           "top1": sum(top1) / len(top1), "extra_bytes": result.extra_bytes,
           "bytes_frac": result.extra_bytes / max(1, ctx.reused_kv_bytes()),
           "token_layers": result.token_layers,
           "compute_frac": result.token_layers / max(1, ctx.reused_tokens() * len(ctx.full_kv)),
           "seconds": result.seconds, "build_seconds": result.build_seconds, "kls": kls, "argmax": argmax}
    if greedy:
        row["greedy_same"] = sum(same) / len(same)
        row["greedy_prefix"] = sum(prefix) / len(prefix)
    return row


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
    if not _mrope(model):
        return text_chunk(ids)
    pos, mm = mm_positions(model, ids, {})
    return Chunk(ids, pos, mm)
