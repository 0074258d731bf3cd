"""Selective-recompute baselines and the engine they share.

Methods (each returns a `Result`: the context's KV and what it cost):
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
Kamera's patches are built in `tools.bench.fits`.

Recomputing a set S of tokens runs the model's own decoder layers on S's hidden states only, with
S's positions, over a transformers cache that holds the reused KV of the whole context; a 4-D mask
lets each token of S see the reused rows before it that are not in S and the fresh rows of S up to
itself; the fresh rows are then spliced back. Recomputing every token reproduces the full prefill
(checked against the model's forward in the tests).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tools.bench.contexts import Captured, Context, decoder_of
from agentwin.models.kv import LayerKV, build_cache, relocate_kv
from kamera_core import kv_layout

RECOMPUTE_METHODS = ("cacheblend", "epic", "vlcache")


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
    """One method's KV for a context and what it cost. Compute is counted in token-layers (one
    token through one decoder layer): `token_layers` at every reuse, `build_token_layers` once
    per chunk (canonical encode, and for patches the conditioned pass), like the seconds."""

    method: str
    setting: str
    kv: list[LayerKV]
    extra_bytes: int = 0
    token_layers: int = 0      # tokens recomputed at reuse, summed over layers
    seconds: float = 0.0       # measured time of the method's own work at reuse time
    build_seconds: float = 0.0  # one-time work: canonical encode, conditioned pass, fit
    build_token_layers: int = 0  # one-time forwards: canonical encode, conditioned pass


def with_canonical_build(ctx: Context, res: Result) -> Result:
    """Charge `res` the canonical encode of every reused chunk (what any reuse of canonical KV
    needs once per content): its token-layers and measured seconds."""
    res.build_token_layers += ctx.reused_token_layers()
    res.build_seconds += sum(ctx.canonical_s[1:])
    return res


def method_blind(ctx: Context) -> Result:
    t0 = time.perf_counter()
    kv = placed_kv(ctx, ctx.canonical)
    return with_canonical_build(ctx, Result("blind", "", kv, seconds=time.perf_counter() - t0))


def method_full(ctx: Context) -> Result:
    """The re-prefill of the reused chunks after the first chunk's KV, timed on the same recompute
    engine as the anchors (recomputing every reused token reproduces the prefill); its KV is the
    context's full-prefill KV."""
    base = placed_kv(ctx, ctx.canonical)
    t0 = time.perf_counter()
    _, counts = recompute(ctx.model, ctx.cap, base, torch.arange(ctx.bounds[1][0], ctx.length))
    return Result("full", "", [(k.clone(), v.clone()) for k, v in ctx.full_kv],
                  token_layers=sum(counts), seconds=time.perf_counter() - t0)


def _chunk_indices(ctx: Context, pick) -> torch.Tensor:
    idx = []
    for i in range(1, len(ctx.chunks)):
        lo, hi = ctx.bounds[i]
        n = pick(ctx.chunks[i], hi - lo)
        idx.append(torch.arange(lo, lo + min(n, hi - lo)))
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)


def method_prefix(ctx: Context, name: str, setting: str, pick, locals_: Sequence[Sequence[LayerKV]] | None = None
                  ) -> Result:
    """Recompute the first `pick(chunk, T)` tokens of each reused chunk in every layer, from
    blind reuse (or from `locals_`: per chunk its KV in the chunk-local frame, e.g. patched)."""
    t0 = time.perf_counter()
    base = placed_kv(ctx, ctx.canonical if locals_ is None else locals_)
    kv, counts = recompute(ctx.model, ctx.cap, base, _chunk_indices(ctx, pick))
    return with_canonical_build(ctx, Result(name, setting, kv, token_layers=sum(counts),
                                            seconds=time.perf_counter() - t0))


def method_tokens(ctx: Context, name: str, setting: str, tokens: torch.Tensor,
                  locals_: Sequence[Sequence[LayerKV]] | None = None) -> Result:
    """Recompute the given context indices in every layer, from blind reuse or `locals_` (a
    diagnostic oracle when the caller knows which tokens matter and nothing says so at reuse
    time; tokens chosen when the chunk's conditioned pass ran and stored with its patch)."""
    t0 = time.perf_counter()
    base = placed_kv(ctx, ctx.canonical if locals_ is None else locals_)
    kv, counts = recompute(ctx.model, ctx.cap, base, tokens.sort().values)
    return with_canonical_build(ctx, Result(name, setting, kv, token_layers=sum(counts),
                                            seconds=time.perf_counter() - t0))


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


def method_cacheblend(ctx: Context, ratio: float, locals_: Sequence[Sequence[LayerKV]] | None = None) -> Result:
    """CacheBlend-style gradual filtering: layer 0 over every reused token; at each later layer,
    among the tokens still selected, the top `cacheblend_ratios(...)[layer]` of each reused chunk
    by deviation of that layer's fresh values from the reused ones, so the selection narrows
    layer by layer to `ratio` at the last layer. From blind reuse, or from `locals_` (per chunk
    its KV in the chunk-local frame, e.g. patched)."""
    t0 = time.perf_counter()  # placement, selection and recompute: all paid at reuse
    base = placed_kv(ctx, ctx.canonical if locals_ is None else locals_)
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

    kv, counts = recompute(ctx.model, ctx.cap, base, all_idx, narrow)
    return with_canonical_build(ctx, Result("cacheblend", f"{ratio:.0%}", kv, token_layers=sum(counts),
                                            seconds=time.perf_counter() - t0))

