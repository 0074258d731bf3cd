"""The reversible window: ordered chunks whose KV is reused by relocation plus antecedent patches.

Each chunk is encoded once alone (canonical KV, chunk-local frame). Its KV in the window is
`R(start) · (canonical + patch)`, where the patch restores what its antecedent (the chunks before
it) told it. Patches are keyed by the antecedent's chunk keys, so returning to a state seen before
(a recall to the old slot) finds its patch again.

Patch policies:
- "none": blind reuse, no patch.
- "origin": the patch fitted when the chunk was appended; for an antecedent never seen, that
  origin patch is reused as an approximation (with `rank=None` a fresh exact patch is computed).
- "orbit": each chunk keeps the mean of its deficits over the distinct antecedents it was
  conditioned on (at append, and under sampled orders of the window by `fit_orbit`; coming first
  counts once, as a zero deficit); an antecedent without its own patch gets the low-rank fit of
  that mean, which serves all orders of the same chunks instead of the one it was appended after.
- "fresh": every new antecedent gets its own patch from a conditioned pass (costs that pass).
`rank=None` means exact (full-rank, float32) patches: the window then reproduces a re-prefill.

Eviction (`evict="fifo"` or `"lru"`): when an append or a recall would pass `budget_tokens`, the
window evicts unpinned chunks, oldest first (FIFO: order in the window; LRU: the chunk appended,
recalled or `touch`ed least recently) until the new one fits; `slide()` does the same on demand.

Materialisation is incremental: a chunk whose antecedent and start are unchanged keeps its placed
KV; one whose start moved is re-rotated; only a new antecedent costs a conditioned pass.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NewType, Sequence, Union

import torch

from agentwin.models.adapter import ChunkInput, KameraModel
from agentwin.models.kv import LayerKV, build_cache_parts, concat_kv, relocate_kv
from agentwin.models.vision import VisionChunk
from agentwin.store import (ChunkKey, ChunkStore, EncoderCache, kv_to_tensors, patch_key, patch_to_tensors, tensors_to_kv,
                            tensors_to_patch)
from kamera_core import patch as kp

ChunkId = NewType("ChunkId", int)
POLICIES = ("none", "origin", "orbit", "fresh")
EVICTION = ("fifo", "lru")


@dataclass(frozen=True, slots=True)
class Text:
    """A text chunk."""

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Text needs a str, got {type(self.text).__name__}")
        if not self.text:
            raise ValueError("Text needs at least one character")


def _summary(kv: Sequence[LayerKV]) -> torch.Tensor:
    return torch.stack([k.float().mean(0).reshape(-1) for k, _ in kv])


@dataclass(frozen=True)
class Image:
    """An image chunk (vision-language models): a PIL image, a path, encoded bytes or an
    `[H, W, 3]` uint8 array, resized the qwen-vl-utils way to `min_tokens..max_tokens` tokens."""

    source: Any
    min_tokens: int = 4
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        _check_tokens(self.min_tokens, self.max_tokens)


@dataclass(frozen=True)
class Frames:
    """A run of video frames as one chunk (vision-language models), sampled by the caller (see
    `agents.video`); `timestamps` in seconds (default i / fps); token budgets are per frame."""

    frames: Sequence[Any]
    timestamps: Sequence[float] | None = None
    fps: float = 2.0
    min_tokens: int = 128
    max_tokens: int = 768

    def __post_init__(self) -> None:
        _check_tokens(self.min_tokens, self.max_tokens)


def _check_tokens(lo: object, hi: object) -> None:
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"token budgets need 1 <= min_tokens <= max_tokens (ints), got {lo!r}, {hi!r}")


Content = Union[Text, Image, Frames, str]


@dataclass(slots=True)
class _Chunk:
    id: ChunkId
    key: ChunkKey
    inputs: ChunkInput  # text ids (T,) or a VisionChunk
    ids: torch.Tensor  # (T,)
    canonical: list[LayerKV]  # chunk-local frame
    origin: tuple[ChunkKey, ...]  # antecedent keys when appended
    slot: int  # index in the window when last present (recall's default place)
    patches: dict[tuple[ChunkKey, ...], kp.ChunkPatch] = field(default_factory=dict)
    orbit: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # summed deficits ("orbit" policy)
    orbit_seen: set[tuple[ChunkKey, ...]] = field(default_factory=set)
    orbit_patch: kp.ChunkPatch | None = None  # fit of the mean; None when stale
    placed: tuple[tuple[ChunkKey, ...], int, list[LayerKV]] | None = None  # (antecedent, start, KV)


@dataclass
class WindowStats:
    """Counters and times of one window; `prefill_tokens_avoided` counts tokens whose KV came from
    relocation + patch instead of a forward pass."""

    patch_hits: int = 0
    patch_misses: int = 0
    canonical_hits: int = 0  # chunks whose canonical KV came from the store (no encode)
    encode_tokens_avoided: int = 0
    conditioned_passes: int = 0
    relocations: int = 0
    prefill_tokens_avoided: int = 0
    evictions: int = 0
    recalls: int = 0
    encoder_calls: int = 0  # vision-tower runs
    encoder_hits: int = 0  # vision-tower outputs served by the encoder cache
    patch_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    store: object = None  # StoreStats at the last stats() call


class Window:
    """Ordered chunks in context over a `KameraModel`; see the module docstring."""

    def __init__(self, km: KameraModel, budget_tokens: int = 8192, patch: str = "origin",
                 rank: int | None = 16, store: ChunkStore | None = None, storage: str = "fp16",
                 evict: str = "fifo") -> None:
        """store: where canonical KV and patches live, shared by every window (and process, with a
        disk root) that uses it; default a private RAM-only store. Same content under the same
        model is encoded once. evict: "fifo" or "lru", which unpinned chunk the budget drops first."""
        if not isinstance(km, KameraModel):
            raise TypeError(f"km must be a KameraModel, got {type(km).__name__}")
        if patch not in POLICIES:
            raise ValueError(f"patch must be one of {POLICIES}, got {patch!r}")
        if rank is not None and (not isinstance(rank, int) or rank < 1):
            raise ValueError(f"rank must be a positive int or None (exact), got {rank!r}")
        if evict not in EVICTION:
            raise ValueError(f"evict must be one of {EVICTION}, got {evict!r}")
        if not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise ValueError(f"budget_tokens must be a positive int, got {budget_tokens!r}")
        if store is not None and not isinstance(store, ChunkStore):
            raise TypeError(f"store must be an agentwin.store.ChunkStore or None, got {type(store).__name__}")
        if store is not None and store.model_fingerprint not in ("", km.fingerprint):
            raise ValueError("the store belongs to another model (fingerprint differs); open one for this model")
        self.store = store if store is not None else ChunkStore(None, model_fingerprint=km.fingerprint)
        self.km, self.policy, self.rank, self.budget_tokens = km, patch, rank, budget_tokens
        self.storage = "fp32" if rank is None else storage
        self.eviction = evict
        self._used: dict[ChunkId, int] = {}  # chunk -> tick of its last append / recall / touch
        self._tick = 0
        self._chunks: dict[ChunkId, _Chunk] = {}
        self._order: list[ChunkId] = []
        self._pinned: set[ChunkId] = set()
        self._next_id = 0
        self._stats = WindowStats()
        self.encoder = EncoderCache(self.store)

    # ---- operations ---------------------------------------------------------------------------

    def append(self, content: Content, pin: bool = False) -> ChunkId:
        """Add a chunk (Text or str; Image or Frames on a vision-language model) at the end;
        evicts the oldest unpinned chunks past `budget_tokens`."""
        t0 = time.perf_counter()
        content = Text(content) if isinstance(content, str) else content
        inputs, key = self._prepare(content)  # raises before anything changes
        ids = self.km.ids(inputs)
        if ids.numel() > self.budget_tokens:
            raise ValueError(f"chunk of {ids.numel()} tokens exceeds budget_tokens={self.budget_tokens}")
        victims = self._slide_plan(int(ids.numel()))  # raises before anything changes
        canonical = self._canonical(key, inputs)
        for victim in victims:
            self.evict(victim)
        antecedent = self._keys(self._order)
        chunk = _Chunk(ChunkId(self._next_id), key, inputs, ids, canonical, antecedent, len(self._order))
        if self.policy != "none" and self._stored_patch(chunk, antecedent) is None:
            self._keep_patch(chunk, antecedent, self._conditioned_patch(chunk, self._order))
        self._next_id += 1
        self._chunks[chunk.id] = chunk
        self._order.append(chunk.id)
        self._touch(chunk.id)
        if pin:
            self._pinned.add(chunk.id)
        self._stats.seconds["append"] += time.perf_counter() - t0
        return chunk.id

    def evict(self, chunk_id: ChunkId) -> None:
        """Take a chunk out of the window; its canonical KV and patches stay for a recall."""
        self._require_in_window(chunk_id)
        index = self._order.index(chunk_id)
        self._chunks[chunk_id].slot = index
        self._order.pop(index)
        self._pinned.discard(chunk_id)
        self._used.pop(chunk_id, None)
        self._stats.evictions += 1

    def recall(self, chunk_id: ChunkId, at: int | None = None) -> list[ChunkId]:
        """Bring an evicted chunk back, at its old slot by default (clamped to the window's end),
        or at index `at`. Evicts by the window's policy first when the budget needs room (the
        slot then counts among the chunks that remain); returns the chunks it evicted."""
        if chunk_id not in self._chunks:
            raise ValueError(f"unknown chunk id {chunk_id!r}")
        if chunk_id in self._order:
            raise ValueError(f"chunk {chunk_id} is already in the window")
        if at is None:
            index = self._chunks[chunk_id].slot  # clamped to the window's end below
        elif isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= len(self._order):
            raise ValueError(f"at must be an int in [0, {len(self._order)}], got {at!r}")
        else:
            index = at
        victims = self._slide_plan(int(self._chunks[chunk_id].ids.numel()))  # raises before any change
        for victim in victims:
            self.evict(victim)
        self._order.insert(min(index, len(self._order)), chunk_id)
        self._touch(chunk_id)
        self._stats.recalls += 1
        return victims

    def slide(self, free_tokens: int = 0) -> list[ChunkId]:
        """Evict by the window's policy (FIFO or LRU, pinned chunks kept) until `free_tokens` more
        tokens fit within the budget; returns the evicted chunks."""
        if isinstance(free_tokens, bool) or not isinstance(free_tokens, int) or free_tokens < 0:
            raise ValueError(f"free_tokens must be a non-negative int, got {free_tokens!r}")
        victims = self._slide_plan(free_tokens)
        for victim in victims:
            self.evict(victim)
        return victims

    def touch(self, chunk_id: ChunkId) -> None:
        """Mark a chunk as used now (LRU eviction keeps recently used chunks longest)."""
        self._require_in_window(chunk_id)
        self._touch(chunk_id)

    def fit_orbit(self, orders: int = 6, seed: int = 0) -> int:
        """Add the deficits of the window's chunks under `orders` random orders of them (one
        forward of the whole window per order) to each chunk's orbit ("orbit" policy), so that
        later reorders among these chunks are served by the orbit patch. Returns the number of
        new orders used (orders already seen are skipped)."""
        if self.policy != "orbit":
            raise ValueError(f"fit_orbit needs patch='orbit', this window uses {self.policy!r}")
        if isinstance(orders, bool) or not isinstance(orders, int) or orders < 1:
            raise ValueError(f"orders must be a positive int, got {orders!r}")
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(seed)
        seen: set[tuple[ChunkId, ...]] = set()
        for _ in range(orders * 4):
            if len(seen) == orders:
                break
            order = tuple(self._order[i] for i in torch.randperm(len(self._order), generator=g).tolist())
            if order in seen:
                continue
            seen.add(order)
            kv = self.km.prefill_kv([self._chunks[c].inputs for c in order])
            start = token = 0
            for index, cid in enumerate(order):
                chunk = self._chunks[cid]
                n = int(chunk.ids.numel())
                if index:
                    placed = [(k[token:token + n], v[token:token + n]) for k, v in kv]
                    local = relocate_kv(placed, self.km.specs, self.km.layout, -start)
                    self._add_orbit(chunk, self._keys(order[:index]), kp.deficit(local, chunk.canonical))
                else:
                    self._add_orbit(chunk, (), None)
                start += self.km.span(chunk.inputs)
                token += n
        self._stats.seconds["fit_orbit"] += time.perf_counter() - t0
        return len(seen)

    def reorder(self, order: Sequence[ChunkId]) -> None:
        """Set the window's order; `order` must be a permutation of the chunks in the window."""
        if sorted(order) != sorted(self._order) or len(set(order)) != len(order):
            raise ValueError(f"reorder needs a permutation of the window's chunks {self._order}, got {list(order)}")
        self._order = list(order)

    def pin(self, chunk_id: ChunkId) -> None:
        """Never evicted by the budget policy while pinned."""
        self._require_in_window(chunk_id)
        self._pinned.add(chunk_id)
        self._touch(chunk_id)

    # ---- reading ------------------------------------------------------------------------------

    def chunks(self) -> list[ChunkId]:
        return list(self._order)

    def tokens(self) -> int:
        return sum(int(self._chunks[c].ids.numel()) for c in self._order)

    def input_ids(self, query: str | None = None) -> torch.Tensor:
        """The exact token sequence a reference re-prefill reads: the window's chunks, then the query."""
        parts = [self._chunks[c].ids for c in self._order]
        if query is not None:
            parts.append(self._query_ids(query))
        if not parts:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat(parts)

    def reference_inputs(self, query: str | None = None) -> dict[str, torch.Tensor]:
        """Keyword arguments of a plain transformers re-prefill of the window (and query):
        `input_ids` (= `input_ids(query)[None]`), plus pixels, grids and token types for image and
        frame chunks; the model computes the positions itself. `model(**reference_inputs(q))`."""
        parts = [self._chunks[c].inputs for c in self._order]
        if query is not None:
            parts.append(self._query_ids(query))
        return self.km.reference_inputs(parts)

    def next_token_logprobs(self, query: str) -> torch.Tensor:
        """`[vocab]` float32 log-probabilities of the token after `query`, from the reused cache."""
        t0 = time.perf_counter()
        ids = self._query_ids(query)
        parts, length = self._materialize_parts()
        cache = build_cache_parts(parts, self.km.model.config, self.km.layout) if parts else None
        logits = self.km.query_logits(cache, length, ids)
        self._stats.seconds["next_token_logprobs"] += time.perf_counter() - t0
        return torch.log_softmax(logits, -1)

    def reference_logprobs(self, query: str) -> torch.Tensor:
        """The same from a full re-prefill of `reference_inputs(query)` (the model's own forward,
        vision tower included)."""
        parts = [self._chunks[c].inputs for c in self._order] + [self._query_ids(query)]
        return torch.log_softmax(self.km.reference_forward(parts).logits[0, -1].float(), -1)

    def generate(self, query: str, max_new_tokens: int = 32) -> str:
        """Greedy continuation of `query` read after the reused cache."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        parts, length = self._materialize_parts()
        cache = build_cache_parts(parts, self.km.model.config, self.km.layout) if parts else None
        ids, position, out = self._query_ids(query), length, []
        eos = getattr(self.km.model.config, "eos_token_id", None)
        for _ in range(max_new_tokens):
            result = self.km.forward(ids, position, cache)
            cache = result.cache  # the forward appended to it (or created it for an empty window)
            position += int(ids.numel())
            token = int(result.logits[0, -1].argmax())
            if token == eos:
                break
            out.append(token)
            ids = torch.tensor([token])
        return self.km.tokenizer.decode(out)

    def key_summary(self, chunk_id: ChunkId) -> torch.Tensor:
        """`[layers, width]` float32: the chunk's canonical keys averaged over its tokens, one row
        per layer (MLA: the latent c_KV). Chunks in or out of the window (evicted ones too), for
        retrieval of earlier chunks by similarity to a question (`km.key_summary(ids)` gives the same
        summary of any token ids)."""
        if chunk_id not in self._chunks:
            raise ValueError(f"unknown chunk id {chunk_id!r}")
        return _summary(self._chunks[chunk_id].canonical)

    def stats(self) -> WindowStats:
        """This window's counters and times; `store` is a snapshot of the store's tiers and hits."""
        self._stats.store = self.store.stats()
        return self._stats

    def check_integrity(self) -> None:
        """RuntimeError when an invariant is broken (indicates a bug)."""
        if len(set(self._order)) != len(self._order):
            raise RuntimeError("a chunk appears twice in the window; this indicates a bug")
        if not set(self._order) <= set(self._chunks):
            raise RuntimeError("the window holds an unknown chunk; this indicates a bug")
        if not self._pinned <= set(self._order):
            raise RuntimeError("a pinned chunk is not in the window; this indicates a bug")
        for c in self._chunks.values():
            if len(c.canonical) != len(self.km.specs) or c.canonical[0][0].shape[0] != c.ids.numel():
                raise RuntimeError(f"chunk {c.id} canonical KV does not match its tokens; this indicates a bug")
        if self.tokens() > self.budget_tokens and len(self._order) > len(self._pinned):
            raise RuntimeError("the window exceeds its token budget; this indicates a bug")

    # ---- internals ----------------------------------------------------------------------------

    def _keys(self, order: Sequence[ChunkId]) -> tuple[ChunkKey, ...]:
        return tuple(self._chunks[c].key for c in order)

    def _require_in_window(self, chunk_id: ChunkId) -> None:
        if chunk_id not in self._order:
            raise ValueError(f"chunk {chunk_id!r} is not in the window (in window: {self._order})")

    def _query_ids(self, query: str) -> torch.Tensor:
        ids = self.km.tokenize(query)
        if ids.numel() == 0:
            raise ValueError("the query tokenizes to no tokens")
        return ids

    def _touch(self, chunk_id: ChunkId) -> None:
        self._tick += 1
        self._used[chunk_id] = self._tick

    def _slide_plan(self, incoming: int) -> list[ChunkId]:
        """Chunks to evict, unpinned, first in window order (FIFO) or least recently used first
        (LRU), so that `incoming` more tokens fit the budget. ValueError, with nothing changed,
        when the pinned chunks leave too little room."""
        excess = self.tokens() + incoming - self.budget_tokens
        victims = []
        candidates = self._order if self.eviction == "fifo" else sorted(self._order, key=lambda c: self._used.get(c, 0))
        for cid in candidates:
            if excess <= 0:
                break
            if cid not in self._pinned:
                victims.append(cid)
                excess -= int(self._chunks[cid].ids.numel())
        if excess > 0:
            raise ValueError(f"no room for {incoming} more tokens within budget_tokens={self.budget_tokens}: "
                             "the pinned chunks take the rest; unpin one or raise the budget")
        return victims

    def _conditioned_patch(self, chunk: _Chunk, antecedent: Sequence[ChunkId]) -> kp.ChunkPatch:
        """The patch of `chunk` after `antecedent`, from one conditioned pass on the materialised prefix."""
        t0 = time.perf_counter()
        prefix, span = self._materialize(antecedent)
        after = self.km.encode_after(prefix, span, chunk.inputs, self._features)
        conditioned = relocate_kv(after, self.km.specs, self.km.layout, -span)
        deltas = kp.deficit(conditioned, chunk.canonical)
        if self.policy == "orbit":
            self._add_orbit(chunk, self._keys(antecedent), deltas)
        if self.rank is None:
            patch = kp.exact_patch(deltas)
        else:
            patch = kp.build_patch(deltas, [(self.rank, self.rank)] * len(deltas), "svd", storage=self.storage)
        self._stats.conditioned_passes += 1
        self._stats.patch_bytes += patch.nbytes
        self._stats.seconds["conditioned_pass"] += time.perf_counter() - t0
        return patch

    def _patch_for(self, chunk: _Chunk, antecedent_ids: Sequence[ChunkId]) -> kp.ChunkPatch | None:
        antecedent = self._keys(antecedent_ids)
        if self.policy == "none" or not antecedent:
            # A chunk at the front has no antecedent: its canonical KV is exact there. An origin
            # patch would make its first token stop acting as the attention sink (measured on
            # SmolLM2 after a slide: KL 3.15 with the origin patch against 0.13 without).
            return None
        found = self._stored_patch(chunk, antecedent)
        if found is not None:
            self._stats.patch_hits += 1
            return found
        self._stats.patch_misses += 1
        if self.policy == "fresh" or self.rank is None:
            return self._keep_patch(chunk, antecedent, self._conditioned_patch(chunk, antecedent_ids))
        if self.policy == "orbit" and chunk.orbit is not None:
            return self._orbit_patch(chunk)
        return self._stored_patch(chunk, chunk.origin)

    def _add_orbit(self, chunk: _Chunk, antecedent: tuple[ChunkKey, ...], deltas: list | None) -> None:
        """Count one antecedent's deficit (None: the chunk first, a zero deficit) in the orbit."""
        if antecedent in chunk.orbit_seen:
            return
        chunk.orbit_seen.add(antecedent)
        if chunk.orbit is None:
            chunk.orbit = [(torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
                           for k, v in chunk.canonical]
        if deltas is not None:
            for (sk, sv), (dk, dv) in zip(chunk.orbit, deltas):
                sk += dk.float()
                sv += dv.float()
        chunk.orbit_patch = None

    def _orbit_patch(self, chunk: _Chunk) -> kp.ChunkPatch:
        """The low-rank fit of the chunk's mean deficit over the antecedents in its orbit."""
        if chunk.orbit_patch is None:
            n = len(chunk.orbit_seen)
            mean = [(k / n, v / n) for k, v in chunk.orbit]
            rank = self.rank or max(t.shape[0] for t in chunk.canonical[0])
            chunk.orbit_patch = kp.build_patch(mean, [(rank, rank)] * len(mean), "svd", storage=self.storage)
            self._stats.patch_bytes += chunk.orbit_patch.nbytes
        return chunk.orbit_patch

    def _prepare(self, content: Any) -> tuple[ChunkInput, ChunkKey]:
        """Model inputs and content key of a chunk; the key covers what fixes its canonical KV
        (token ids; for images and frames the processed pixels, grid and settings)."""
        fp, tenant = self.km.fingerprint, self.store.tenant
        if isinstance(content, Text):
            ids = self.km.tokenize(content.text)
            if ids.numel() == 0:
                raise ValueError("the text tokenizes to no tokens")
            return ids, ChunkKey.of(fp, "text", ids.tolist(), tenant=tenant)
        if isinstance(content, Image):
            vc = self.km.image(content.source, content.min_tokens, content.max_tokens)
        elif isinstance(content, Frames):
            vc = self.km.frames(content.frames, content.timestamps, content.fps, content.min_tokens, content.max_tokens)
        else:
            raise TypeError(f"append takes Text, Image, Frames or str, got {type(content).__name__}")
        return vc, ChunkKey.of(fp, vc.kind, bytes.fromhex(vc.digest), tenant=tenant)

    def _features(self, vc: VisionChunk) -> dict:
        """Vision-tower outputs of `vc` through the encoder cache: the tower runs once per image."""
        computed = self.encoder.computed
        out = self.encoder.get_or_compute(self.encoder.key(bytes.fromhex(vc.digest)), lambda: self.km.features(vc),
                                          {"modality": vc.kind, "tokens": int(vc.ids.numel())})
        if self.encoder.computed > computed:
            self._stats.encoder_calls += 1
        else:
            self._stats.encoder_hits += 1
        return out

    def _canonical(self, key: ChunkKey, inputs: ChunkInput) -> list[LayerKV]:
        """Canonical KV from the store, or encoded alone once and stored."""
        ids = self.km.ids(inputs)
        hit = self.store.get(key)
        if hit is not None:
            self._stats.canonical_hits += 1
            self._stats.encode_tokens_avoided += int(ids.numel())
            return tensors_to_kv(hit[0])
        kv = self.km.encode(inputs, self._features)
        modality = inputs.kind if isinstance(inputs, VisionChunk) else "text"
        self.store.put(key, kv_to_tensors(kv), {"modality": modality, "tokens": int(ids.numel())})
        return kv

    def _patch_key(self, chunk: _Chunk, antecedent: tuple[ChunkKey, ...]) -> ChunkKey:
        return patch_key(chunk.key, antecedent, self.rank, "exact" if self.rank is None else f"svd-{self.storage}")

    def _stored_patch(self, chunk: _Chunk, antecedent: tuple[ChunkKey, ...]) -> kp.ChunkPatch | None:
        """The patch of `chunk` for `antecedent`: this window's copy, else the store's."""
        if antecedent in chunk.patches:
            return chunk.patches[antecedent]
        hit = self.store.get(self._patch_key(chunk, antecedent))
        if hit is None:
            return None
        chunk.patches[antecedent] = tensors_to_patch(*hit)
        return chunk.patches[antecedent]

    def _keep_patch(self, chunk: _Chunk, antecedent: tuple[ChunkKey, ...], patch: kp.ChunkPatch) -> kp.ChunkPatch:
        chunk.patches[antecedent] = patch
        self.store.put(self._patch_key(chunk, antecedent), *patch_to_tensors(patch))
        return patch

    def _materialize(self, order: Sequence[ChunkId] | None = None) -> tuple[list[LayerKV], int]:
        """Placed KV of `order` (default: the window) and its span in position units (where the
        next chunk or the query starts; the token count for text)."""
        parts, span = self._materialize_parts(order)
        return (concat_kv(*parts) if parts else []), span

    def _materialize_parts(self, order: Sequence[ChunkId] | None = None) -> tuple[list[list[LayerKV]], int]:
        """Each chunk's placed KV (not concatenated) of `order`, and their span."""
        t0 = time.perf_counter()
        order = self._order if order is None else list(order)
        parts, start = [], 0
        for index, cid in enumerate(order):
            chunk = self._chunks[cid]
            antecedent = self._keys(order[:index])
            if chunk.placed is not None and chunk.placed[0] == antecedent and chunk.placed[1] == start:
                kv = chunk.placed[2]
            else:
                passes = self._stats.conditioned_passes
                patch = self._patch_for(chunk, order[:index])
                local = chunk.canonical if patch is None else kp.apply_patch(chunk.canonical, patch)
                kv = relocate_kv(local, self.km.specs, self.km.layout, start)
                chunk.placed = (antecedent, start, kv)
                self._stats.relocations += 1
                if self._stats.conditioned_passes == passes:  # no forward pass was spent on it
                    self._stats.prefill_tokens_avoided += int(chunk.ids.numel())
            parts.append(kv)
            start += self.km.span(chunk.inputs)
        self._stats.seconds["materialize"] += time.perf_counter() - t0
        return parts, start
