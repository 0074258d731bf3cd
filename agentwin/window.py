"""The reversible window: ordered chunks whose KV is read in place by segment attention.

Each chunk is encoded once alone (canonical KV, chunk-local frame, held by the store). Its KV in
the window is `R(start) · (canonical + patch)`, where the patch restores what its antecedent (the
chunks before it) told it; attention applies R(start) to the few query rows instead of the keys
(`agentwin.models.segments`), so placing, moving and recalling a chunk writes no KV bytes. Patches
are keyed by the antecedent's chunk keys, so returning to a state seen before (a recall to the old
slot) finds its patch again.

Append runs the chunk's in-context pass (its ordinary prefill, after the window read in place)
and serves that exact KV while the chunk keeps its place and antecedent; the patch for later
placements is fitted from that same pass. The canonical encode runs once per content (for the
first chunk of a window it is the in-context pass itself). A chunk whose canonical KV and patch
for this very antecedent are already stored is appended with no forward at all.

Patch policies (`agentwin.policies`): "none" (blind), "origin" (the patch fitted at append, also
for antecedents never seen; "origin-neighbour" / "origin-present" / "origin-either" limit that),
"origin-similar" (the origin patch while its antecedent is still before it, behind the same
neighbour, or behind a neighbour whose key summary is close to that one's; blind reuse otherwise,
where a stale patch was measured worse than none), "origin-akin" (the default: as
"origin-similar", and also behind a neighbour at least as close to that one as the chunk itself
is, a yardstick that moves with the model), "orbit", "fresh" (a conditioned
pass per new antecedent). Patches are fitted within a byte budget, 6% of the chunk's
canonical KV by default (`patch_bytes`), spread over layers, mixed int8 / 4-bit factors (`agentwin.window_fit`
has the fits and why they are the defaults); `rank=None`: exact (full-rank, float32) patches, the
window then reproduces a re-prefill. The patch guard keeps a low-rank patch only where it beats
blind reuse on the chunk's last rows (`guard="auto"`, the default: on below a 6% byte budget and
for rank=N windows); `max_kl=x` fits each text chunk's patch for a KL target on those rows
instead (`agentwin.guard`).

Eviction (`evict="fifo"` or `"lru"`): when an append or a recall would pass `budget_tokens`, the
window evicts unpinned chunks, oldest first (FIFO: order in the window; LRU: the chunk appended,
recalled or `touch`ed least recently) until the new one fits; `slide()` does the same on demand.
An evicted chunk leaves nothing in the window but its key and small metadata: its KV and patches
stay in the store's tiers under the store's budgets, and a recall reads them back (or encodes the
chunk again, counted, if the store dropped it).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from agentwin.content import Content, Frames, Image, Text, model_inputs  # noqa: F401 (Frames, Image re-exported)
from agentwin.models.adapter import ChunkInput, KameraModel
from agentwin.models.kv import LayerKV
from agentwin.policies import POLICIES, POLICY_TYPES, eviction_plan
from agentwin.store import ChunkKey, ChunkStore
from agentwin.window_chunk import ChunkId, ChunkRecord, check_invariants, held_bytes, key_summary, timed
from agentwin.window_fit import BUDGET, fit_patch, patch_settings
from agentwin.window_io import WindowIO
from agentwin.window_stats import WindowStats
from kamera_core import patch as kp
from kamera_core.metrics import layer_cosine
from kamera_core.segment import Segment

EVICTION = ("fifo", "lru")


class Window:
    """Ordered chunks in context over a `KameraModel`; see the module docstring."""

    def __init__(self, km: KameraModel, budget_tokens: int = 8192, patch: str = "origin-akin",
                 rank: int | str | None = BUDGET, store: ChunkStore | None = None, storage: str = "auto",
                 evict: str = "fifo", guard: bool | str = "auto", max_kl: float | None = None, fit: str = "residual",
                 patch_bytes: float | None = None) -> None:
        """store: where canonical KV and patches live, shared by every window (and process, with a
        disk root) that uses it; default a private RAM-only store. Same content under the same model
        is encoded once. evict: "fifo" or "lru", which unpinned chunk the budget drops first.
        Patches (`agentwin.window_fit`): rank "budget" (each chunk's patch at most `patch_bytes`,
        default 0.06, of its canonical KV bytes), an int (the bytes of that rank in every layer) or
        None (exact); fit "residual" (the default: ranks spread over layers and K/V by the error
        each block leaves where its layer's attention output lands in the residual stream,
        through the layer's output projection, relative to the stream's size there in the chunk's
        pass; keys in the metric of the chunk's own queries), "output" (the same in the attention
        output itself, relative to the layer's), "output-half" / "output-abs" (each layer's
        error by the root of its scale / absolute), "alloc" (spread by each block's relative error), "svd"
        or "query" (one rank everywhere); storage "int8", "mixed" (int8 for each block's leading
        components, 4 bits packed two to a byte for the rest, split by the allocator; byte-budget
        allocator fits only), "auto" (mixed where the allocator sets the ranks, else int8), "fp16",
        "bf16" or "fp32". guard: keep a patch only where it beats blind reuse (`agentwin.guard`; not for
        exact patches or MLA): True, False or "auto" (on below a 6% byte budget, where the fit
        alone was measured worse than blind reuse, and for rank=N windows; off at the default
        budget, where it changed nothing measured and costs a document step 20-70% more,
        `agentwin bench steps --guard`; `agentwin.window_fit.GUARD_BELOW`). max_kl: next-token KL (nats) a text chunk's patch must reach on its last rows:
        blind reuse, then the window's fit within `patch_bytes`, √2 times that and so on until one
        does (the lowest-KL option tried is kept; `agentwin.guard.fit_to_kl`)."""
        if not isinstance(km, KameraModel):
            raise TypeError(f"km must be a KameraModel, got {type(km).__name__}")
        if patch not in POLICIES:
            raise ValueError(f"patch must be one of {POLICIES}, got {patch!r}")
        settings = patch_settings(km, rank, patch_bytes, storage, guard, max_kl, fit)
        if evict not in EVICTION:
            raise ValueError(f"evict must be one of {EVICTION}, got {evict!r}")
        if not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise ValueError(f"budget_tokens must be a positive int, got {budget_tokens!r}")
        if store is not None and not isinstance(store, ChunkStore):
            raise TypeError(f"store must be an agentwin.store.ChunkStore or None, got {type(store).__name__}")
        if store is not None and store.model_fingerprint not in ("", km.fingerprint):
            raise ValueError("the store belongs to another model (fingerprint differs); open one for this model")
        self.store = store if store is not None else ChunkStore(None, model_fingerprint=km.fingerprint)
        self.km, self.policy, self.budget_tokens, self.settings = km, patch, budget_tokens, settings
        self._policy = POLICY_TYPES[patch]()
        self.rank, self.patch_bytes, self.storage = settings.rank, settings.patch_bytes, settings.storage
        self.guard, self.max_kl, self.fit = settings.guard, settings.max_kl, settings.fit
        self.eviction = evict
        self._used: dict[ChunkId, int] = {}  # chunk -> tick of its last append / recall / touch
        self._tick = 0
        self._depth = 0  # nesting of timed public operations
        self._chunks: dict[ChunkId, ChunkRecord] = {}
        self._order: list[ChunkId] = []
        self._pinned: set[ChunkId] = set()
        self._next_id = 0
        self._stats = WindowStats()
        self._asked: tuple[tuple[int, ...] | None, torch.Tensor | None] = (None, None)  # last query, its summary
        self._io = WindowIO(km, self.store, self._stats, settings)
        self.encoder = self._io.encoder

    # ---- operations ---------------------------------------------------------------------------

    @timed
    def append(self, content: Content, pin: bool = False) -> ChunkId:
        """Add a chunk (Text or str; Image or Frames on a vision-language model) at the end;
        evicts the oldest unpinned chunks past `budget_tokens`. Runs the chunk's in-context pass
        (and its canonical encode, once per content) unless the store already holds both its
        canonical KV and its patch for this antecedent."""
        content = Text(content) if isinstance(content, str) else content
        inputs, key = model_inputs(self.km, self.store.tenant, content)  # raises before anything changes
        ids = self.km.ids(inputs)
        if ids.numel() > self.budget_tokens:
            raise ValueError(f"chunk of {ids.numel()} tokens exceeds budget_tokens={self.budget_tokens}")
        victims = self._slide_plan(int(ids.numel()))  # raises before anything changes
        forwards = self._stats.num_forwards
        stored = self._io.load_canonical(key, int(ids.numel()))
        # Encoded before anything changes: a chunk the model cannot take leaves the window as it was.
        fresh = self._encode(inputs, int(ids.numel())) if stored is None else None
        for victim in victims:
            self.evict(victim)
        antecedent = self._keys(self._order)
        chunk = ChunkRecord(ChunkId(self._next_id), key, inputs, ids, self.km.span(inputs), antecedent, len(self._order))
        start, first = self._span(self._order), self.tokens()
        if stored is not None and (not antecedent or not self._policy.patches
                                   or self._io.stored_patch(chunk, antecedent) is not None):
            chunk.canonical = stored  # everything needed is stored: no forward
        elif not self._policy.patches or not antecedent:
            # Blind reuse, or nothing before it: the chunk alone is all there is to compute.
            chunk.canonical = self._io.put_canonical(chunk, fresh)
        else:
            exact, probed = self._pass(chunk, self._order, start, first, "in_context")
            chunk.exact = (antecedent, start, exact)
            chunk.canonical = stored if stored is not None else self._io.put_canonical(chunk, fresh)
            self._io.keep_patch(chunk, antecedent, self._fit_patch(chunk, antecedent, exact, start, probed))
        if self._stats.num_forwards != forwards:
            chunk.served = (antecedent, start)  # computed here: not a reuse
        chunk.summary = key_summary(chunk.canonical)
        chunk.neighbour = self._chunks[self._order[-1]].summary if self._order else None
        self._next_id += 1
        self._chunks[chunk.id] = chunk
        self._order.append(chunk.id)
        self._touch(chunk.id)
        if pin:
            self._pinned.add(chunk.id)
        return chunk.id

    @timed
    def evict(self, chunk_id: ChunkId) -> None:
        """Take a chunk out of the window. The window lets go of its KV and patches; they stay in
        the store's tiers (under the store's budgets) for a recall."""
        self._require_in_window(chunk_id)
        index = self._order.index(chunk_id)
        chunk = self._chunks[chunk_id]
        chunk.slot = index
        chunk.canonical = chunk.exact = chunk.served = None
        chunk.patches.clear()
        self._io.spill_pixels(chunk)
        self._order.pop(index)
        self._pinned.discard(chunk_id)
        self._used.pop(chunk_id, None)
        self._stats.evictions += 1

    @timed
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
        self._io.restore_pixels(self._chunks[chunk_id])  # raises before any change
        for victim in victims:
            self.evict(victim)
        self._order.insert(min(index, len(self._order)), chunk_id)
        self._touch(chunk_id)
        self._stats.recalls += 1
        return victims

    @timed
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

    @timed
    def fit_orbit(self, orders: int = 6, seed: int = 0) -> int:
        """Add the window's chunks' deficits under `orders` random orders (a forward of the window
        each) to each chunk's orbit ("orbit" policy), so later reorders among them are served by
        the orbit patch. Returns the number of new orders used (orders seen before are skipped)."""
        if self.policy != "orbit":
            raise ValueError(f"fit_orbit needs patch='orbit', this window uses {self.policy!r}")
        if isinstance(orders, bool) or not isinstance(orders, int) or orders < 1:
            raise ValueError(f"orders must be a positive int, got {orders!r}")
        return self._policy.sample_orders(self, orders, seed)

    @timed
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

    def chunk_tokens(self, chunk_id: ChunkId) -> int:
        """Tokens of a chunk, in the window or evicted."""
        if chunk_id not in self._chunks:
            raise ValueError(f"unknown chunk id {chunk_id!r}")
        return int(self._chunks[chunk_id].ids.numel())

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

    @timed
    def next_token_logprobs(self, query: str) -> torch.Tensor:
        """`[vocab]` float32 log-probabilities of the token after `query`, from the window's KV
        read in place (segment attention)."""
        ids = self._query_ids(query)
        cache = self._cache(self._order)
        logits = self.km.query_logits(cache, self._span(self._order), ids)
        self._stats.count("query", int(ids.numel()))
        return torch.log_softmax(logits, -1)

    def reference_logprobs(self, query: str) -> torch.Tensor:
        """The same from a full re-prefill of `reference_inputs(query)` (the model's own forward,
        vision tower included)."""
        parts = [self._chunks[c].inputs for c in self._order] + [self._query_ids(query)]
        return torch.log_softmax(self.km.reference_forward(parts).logits[0, -1].float(), -1)

    @timed
    def generate(self, query: str, max_new_tokens: int = 32) -> str:
        """Greedy continuation of `query` read after the window's KV (in place); each decoded
        token's KV joins the cache's tail, nothing else is copied."""
        return self.km.tokenizer.decode(self.generate_ids(query, max_new_tokens))

    @timed
    def generate_ids(self, query: str, max_new_tokens: int = 32, logits_processor=None, stop=None) -> list[int]:
        """Greedy token ids after `query`, read after the window's KV like `generate`.

        logits_processor: `fn(ids, scores) -> scores` with transformers' signature (ids `[1, n]`:
        the query's tokens and those chosen so far; scores `[1, vocab]` float32), applied before
        each choice (e.g. a grammar mask). stop: `fn(chosen_ids) -> bool`, asked after each chosen
        token; true ends decoding before that token's forward. An end-of-sequence token ends it too
        and is not returned."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        ids = self._query_ids(query)
        seen = ids
        cache = self._cache(self._order)
        position, out, kind = self._span(self._order), [], "query"
        eos = getattr(self.km.model.config, "eos_token_id", None)
        eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
        for _ in range(max_new_tokens):
            result = self.km.forward(ids, position, cache, logits_to_keep=1)
            self._stats.count(kind, int(ids.numel()))
            kind = "decode"
            position += int(ids.numel())
            scores = result.logits[:, -1].float()
            if logits_processor is not None:
                scores = logits_processor(seen[None], scores)
            token = int(scores[0].argmax())
            if token in eos:
                break
            out.append(token)
            if stop is not None and stop(out):
                break
            ids = torch.tensor([token])
            seen = torch.cat([seen, ids])
        return out

    def key_summary(self, chunk_id: ChunkId) -> torch.Tensor:
        """`[layers, width]` float32: the chunk's canonical keys averaged over its tokens, one row
        per layer (MLA: the latent c_KV). Chunks in or out of the window (evicted ones too), for
        retrieval of earlier chunks by similarity to a question (`km.key_summary(ids)` gives the same
        summary of any token ids)."""
        if chunk_id not in self._chunks:
            raise ValueError(f"unknown chunk id {chunk_id!r}")
        return self._chunks[chunk_id].summary

    def nearest(self, query: str, k: int = 1, among: Sequence[ChunkId] | None = None) -> list[tuple[ChunkId, float]]:
        """The `k` chunks (in the window or evicted; only `among` when given) whose key summaries
        are closest to the query's: cosine per layer, averaged over layers; best first, ties by
        chunk id. Encoding the query alone is one forward, counted as "retrieval" (not again when
        the same query is asked next)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        candidates = sorted(self._chunks) if among is None else list(dict.fromkeys(among))
        for cid in candidates:
            if cid not in self._chunks:
                raise ValueError(f"unknown chunk id {cid!r}")
        if not candidates:
            return []
        ids = self._query_ids(query)
        asked = tuple(ids.tolist())
        if self._asked[0] != asked:  # a query asked again (an agent's task) is encoded once
            self._asked = (asked, self.km.key_summary(ids))
            self._stats.count("retrieval", int(ids.numel()))
        q = self._asked[1]
        scores = layer_cosine(q, torch.stack([self._chunks[c].summary for c in candidates])).tolist()
        ranked = sorted(zip(candidates, scores), key=lambda cs: (-cs[1], cs[0]))
        return [(ChunkId(c), float(score)) for c, score in ranked[:k]]

    def stats(self) -> WindowStats:
        """This window's counters and times; `store` is a snapshot of the store's tiers and hits."""
        self._stats.store = self.store.stats()
        self._stats.held_bytes = held_bytes([self._chunks[c] for c in self._order])
        return self._stats

    def check_integrity(self) -> None:
        """RuntimeError when an invariant is broken (indicates a bug)."""
        check_invariants(self._order, self._chunks, self._pinned, len(self.km.specs))
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
        """Chunks to evict so that `incoming` more tokens fit (`agentwin.policies.eviction_plan`)."""
        sizes = {c: int(self._chunks[c].ids.numel()) for c in self._order}
        return eviction_plan(self._order, sizes, self._pinned, self._used, self.eviction,
                             self.tokens() + incoming - self.budget_tokens, incoming, self.budget_tokens)

    def _span(self, order: Sequence[ChunkId]) -> int:
        """Position units taken by `order` (where the next chunk or the query starts)."""
        return sum(self._chunks[c].span for c in order)

    def _encode(self, inputs: ChunkInput, tokens: int) -> list[LayerKV]:
        """A chunk alone in its chunk-local frame (one forward, counted)."""
        t0 = time.perf_counter()
        kv = self.km.encode(inputs, self._io.features)
        self._stats.count("encode", tokens)
        self._stats.seconds["encode"] += time.perf_counter() - t0
        return kv

    def _pass(self, chunk: ChunkRecord, antecedent: Sequence[ChunkId], start: int, first: int, kind: str
              ) -> tuple[list[LayerKV], tuple | None]:
        """KV of `chunk` at `start` (token index `first`) read after `antecedent` in place: one
        forward of the chunk's tokens (its prefill there), counted as `kind`. With the guard on,
        also `(segments read, QueryProbe, first)` for `_fit_patch`, else None."""
        t0 = time.perf_counter()
        segments = self._segments(antecedent)
        probe = self.settings.probe(int(chunk.ids.numel()))  # None unless the fit or guard reads the pass
        kv = self.km.encode_after(segments, first, start, chunk.inputs, self._io.features, probe)
        self._stats.count(kind, int(chunk.ids.numel()))
        self._stats.seconds[kind] += time.perf_counter() - t0
        return kv, (None if probe is None else (segments, probe, first))

    def _fit_patch(self, chunk: ChunkRecord, antecedent: tuple[ChunkKey, ...], exact: list[LayerKV],
                   start: int, probed: tuple | None = None) -> kp.ChunkPatch:
        """The patch of `chunk` after `antecedent` from its KV computed there (`agentwin.window_fit`)."""
        return fit_patch(self, chunk, antecedent, exact, start, probed)

    def _conditioned_patch(self, chunk: ChunkRecord, antecedent_ids: Sequence[ChunkId]) -> kp.ChunkPatch:
        """The patch of `chunk` after `antecedent_ids` from one conditioned pass, kept in the store;
        the pass's exact KV is kept and served while the chunk stays at that place."""
        antecedent = self._keys(antecedent_ids)
        start = self._span(antecedent_ids)
        first = sum(int(self._chunks[c].ids.numel()) for c in antecedent_ids)
        exact, probed = self._pass(chunk, antecedent_ids, start, first, "conditioned")
        self._stats.conditioned_passes += 1
        chunk.exact = (antecedent, start, exact)
        return self._io.keep_patch(chunk, antecedent, self._fit_patch(chunk, antecedent, exact, start, probed))

    def _patch_for(self, chunk: ChunkRecord, antecedent_ids: Sequence[ChunkId]) -> kp.ChunkPatch | None:
        """The stored patch for this antecedent, else the policy's (`agentwin.policies`); none at
        the front of the window, where canonical KV is exact."""
        antecedent = self._keys(antecedent_ids)
        if not self._policy.patches or not antecedent:
            return None
        found = self._io.stored_patch(chunk, antecedent)
        if found is not None:
            self._stats.patch_hits += 1
            return found
        self._stats.patch_misses += 1
        return self._policy.unseen(self, chunk, antecedent_ids)

    def _hold(self, chunk: ChunkRecord) -> list[LayerKV]:
        """The chunk's canonical KV, read from the store when the window does not hold it (after
        a recall), encoded again (counted) when the store no longer has it."""
        if chunk.canonical is None:
            chunk.canonical = self._io.load_canonical(chunk.key, int(chunk.ids.numel()))
            if chunk.canonical is None:
                chunk.canonical = self._io.put_canonical(chunk, self._encode(chunk.inputs, int(chunk.ids.numel())))
        return chunk.canonical

    def _segments(self, order: Sequence[ChunkId]) -> list[list[Segment]]:
        """Per layer, the segments of `order` as placed one after another from position 0: a
        chunk's exact in-context KV where it still has the place and antecedent it was computed
        for, else its canonical KV with the placement shift and its patch for that antecedent.
        Nothing is copied."""
        t0 = time.perf_counter()
        layers: list[list[Segment]] = [[] for _ in self.km.specs]
        start = first = 0
        for index, cid in enumerate(order):
            chunk = self._chunks[cid]
            antecedent = self._keys(order[:index])
            patch, forwards = None, self._stats.num_forwards
            if chunk.exact is None or chunk.exact[:2] != (antecedent, start):
                patch = self._patch_for(chunk, order[:index])  # may run a conditioned pass (sets exact)
            if chunk.exact is not None and chunk.exact[:2] == (antecedent, start):
                for layer, (k, v) in zip(layers, chunk.exact[2]):
                    layer.append(Segment(k, v, first, 0))
            else:
                canonical = self._hold(chunk)
                for i, (layer, (k, v)) in enumerate(zip(layers, canonical)):
                    layer.append(Segment(k, v, first, start, None if patch is None else patch.layers[i]))
                # Canonical KV is the chunk computed first at position 0: serving it there is no move.
                moved = bool(antecedent) or start != 0
                if moved and chunk.served != (antecedent, start) and self._stats.num_forwards == forwards:
                    self._stats.relocations += 1
                    self._stats.relocated_tokens += int(chunk.ids.numel())
            chunk.served = (antecedent, start)
            start += chunk.span
            first += int(chunk.ids.numel())
        self._stats.seconds["segments"] += time.perf_counter() - t0
        return layers

    def _cache(self, order: Sequence[ChunkId]) -> object:
        """A `SegmentCache` over `order`, its tail starting after the chunks' tokens."""
        return self.km.cache(self._segments(order), sum(int(self._chunks[c].ids.numel()) for c in order))
