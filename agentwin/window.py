"""The reversible window: ordered chunks whose KV is read in place by segment attention.

A chunk's KV in the window is its in-context KV: its prefill after the chunks before it. That KV
depends on the chunk and on everything before it, so the store keeps it under a placement key
that chains both (`agentwin.prefix`): whenever a chunk is read after the same chunks again (a
recall to its old slot, a slide back to an earlier window, another window, process or worker on
the same store) its KV is served from there, exactly, with no forward.

Work is lazy and paid once. `append`, `evict`, `recall`, `reorder` and `slide` only edit the
order. A read (`next_token_logprobs`, `generate`, ...) walks the order: each chunk whose KV for
its placement is held or stored is served in place; the others are computed, after what is
before them, in as few forwards as possible, the read's query in the same forward as the chunks
that wait at the end; tokens computed before after the same prefix (the longest common token
prefix with an earlier chunk or read, `agentwin.prefix.PrefixIndex`) are not computed again. So
the default window (`patch="exact"`) reproduces a re-prefill of its tokens and never forwards
more than prefix caching would on the same session: what a slide or a recall invalidates is
recomputed (and counted as "recompute"), nothing else.

Approximate placements trade fidelity for work (`agentwin.policies`): "survive" keeps a chunk's
KV from its last placement and moves it by RoPE re-rotation when chunks before it change
(StreamingLLM-style survival); "none" (blind reuse), "origin", "origin-akin" and the other origin
variants, "orbit" and "fresh" serve a chunk's canonical KV (encoded alone, chunk-local frame)
placed by a shift plus a low-rank antecedent patch fitted from its pass (`agentwin.window_fit`:
within `patch_bytes`, 6% of the chunk's canonical KV by default; `rank=None`: exact, full-rank
patches). Attention applies the shift to the few query rows instead of the keys
(`agentwin.models.segments`), so placing, moving and recalling write no KV bytes. Where a
placement's exact KV is stored, every policy serves it.

Eviction (`evict="fifo"` or `"lru"`): when an append or a recall would pass `budget_tokens`, the
window evicts unpinned chunks, oldest first (FIFO: order in the window; LRU: the chunk appended,
recalled or `touch`ed least recently) until the new one fits; `slide()` does the same on demand.
An evicted chunk leaves nothing in the window but its key and small metadata: its KV stays in the
store's tiers under the store's budgets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from agentwin.content import Content, Frames, Image, Text, model_inputs  # noqa: F401 (Frames, Image re-exported)
from agentwin.models.adapter import ChunkInput, KameraModel
from agentwin.models.kv import LayerKV, relocate_kv
from agentwin.models.vision import TextChunk
from agentwin.eviction import make_eviction
from agentwin.policies import DEFAULT_POLICY, PATCH_POLICIES, POLICIES, POLICY_TYPES, Approx, Exact
from agentwin.prefix import Piece, PrefixIndex, placement_key, root_key
from agentwin.store import ChunkKey, ChunkStore
from agentwin.window_chunk import (ChunkId, ChunkRecord, Held, Placement, check_invariants, held_bytes, key_summary,
                                   timed)
from agentwin.window_fit import BUDGET, fit_patch, patch_settings
from agentwin.window_io import WindowIO
from agentwin.window_stats import WindowStats
from kamera_core import patch as kp
from kamera_core.metrics import layer_cosine
from kamera_core.segment import Segment

LEASE_TTL_S = 60.0  # a lease on computing a placement: longer than any one read's forwards
LEASE_POLL_S = 0.02
Layers = list[list[Segment]]  # per decoder layer, the segments read so far


class Window:
    """Ordered chunks in context over a `KameraModel`; see the module docstring."""

    def __init__(self, km: KameraModel, budget_tokens: int = 8192, patch: str | Exact = DEFAULT_POLICY,
                 rank: int | str | None = BUDGET, store: ChunkStore | None = None, storage: str = "auto",
                 evict: str = "fifo", guard: bool | str = "auto", max_kl: float | None = None, fit: str = "residual",
                 patch_bytes: float | None = None) -> None:
        """store: where KV lives (in-context KV by placement, canonical KV, patches), shared by
        every window (and process, with a disk root or a Redis tier) that uses it; default a
        private RAM-only store. patch: "exact" (the default) or an approximate policy
        (`agentwin.policies`). evict: "fifo" or "lru", which unpinned chunk the budget drops first.
        The rest sets the patches of the patch policies (`agentwin.window_fit`): rank "budget"
        (each chunk's patch at most `patch_bytes`, default 0.06, of its canonical KV bytes), an int
        (the bytes of that rank in every layer) or None (exact patches); fit (how the bytes are
        spread, "residual" by default), storage (the factors' form, "auto"), guard (keep a patch
        only where it beats blind reuse, `agentwin.guard`) and max_kl (a next-token KL target per
        text chunk instead of a byte budget)."""
        if not isinstance(km, KameraModel):
            raise TypeError(f"km must be a KameraModel, got {type(km).__name__}")
        if isinstance(patch, Exact):  # a configured policy object, e.g. Refresh(near_tokens=64)
            policy, patch = patch, patch.name
        elif patch not in POLICIES:
            raise ValueError(f"patch must be one of {POLICIES} (or a policy object such as "
                             f"agentwin.policies.Refresh(...)), got {patch!r}")
        else:
            policy = POLICY_TYPES[patch]()
        settings = patch_settings(km, rank, patch_bytes, storage, guard, max_kl, fit)
        given = [name for name, value, default in (("rank", rank, BUDGET), ("patch_bytes", patch_bytes, None),
                                                   ("storage", storage, "auto"), ("guard", guard, "auto"),
                                                   ("max_kl", max_kl, None), ("fit", fit, "residual"))
                 if value != default and not (name == "rank" and value is None)]
        if given and patch not in PATCH_POLICIES:
            raise ValueError(f"{', '.join(given)} set(s) the patches of a patch policy, and patch={patch!r} fits none; "
                             f"pass patch='origin-akin' (or another patch policy: {', '.join(PATCH_POLICIES)}) "
                             "to use them")
        eviction = make_eviction(evict)  # ValueError names the choices
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise ValueError(f"budget_tokens must be a positive int, got {budget_tokens!r}")
        if store is not None and not isinstance(store, ChunkStore):
            raise TypeError(f"store must be an agentwin.store.ChunkStore or None, got {type(store).__name__}")
        if store is not None and store.model_fingerprint not in ("", km.fingerprint):
            raise ValueError("the store belongs to another model (fingerprint differs); open one for this model")
        self.store = store if store is not None else ChunkStore(None, model_fingerprint=km.fingerprint)
        self.km, self.policy, self.budget_tokens, self.settings = km, patch, budget_tokens, settings
        self._policy = policy
        self.rank, self.patch_bytes, self.storage = settings.rank, settings.patch_bytes, settings.storage
        self.guard, self.max_kl, self.fit = settings.guard, settings.max_kl, settings.fit
        self.eviction = evict
        self._eviction = eviction  # which unpinned chunks the budget drops first (agentwin.eviction)
        self._depth = 0  # nesting of timed public operations
        self._chunks: dict[ChunkId, ChunkRecord] = {}
        self._order: list[ChunkId] = []
        self._pinned: set[ChunkId] = set()
        self._next_id = 0
        self._stats = WindowStats()
        self._asked: tuple[tuple[int, ...] | None, torch.Tensor | None] = (None, None)  # last query, its summary
        self._io = WindowIO(km, self.store, self._stats, settings)
        self.encoder = self._io.encoder
        self._root = root_key(km.fingerprint, self.store.tenant)
        self._index = PrefixIndex()
        self._changed_at: int | None = None  # during a read: see `_read`
        self._leases: list = []  # during a read: the store leases it holds on placements it computes

    # ---- operations ---------------------------------------------------------------------------

    @timed
    def append(self, content: Content, pin: bool = False) -> ChunkId:
        """Add a chunk (Text or str; Image or Frames on a vision-language model) at the end;
        evicts the oldest unpinned chunks past `budget_tokens`. The exact and survive policies run
        no forward here: the chunk's pass (its prefill after the chunks before it) runs at the next
        read, unless its KV for that placement is stored already. The patch policies run it now,
        and fit the chunk's origin patch from it (a chunk the model cannot take then leaves the
        window as it was)."""
        content = Text(content) if isinstance(content, str) else content
        inputs, key = model_inputs(self.km, self.store.tenant, content)  # raises before anything changes
        ids = self.km.ids(inputs)
        if ids.numel() > self.budget_tokens:
            raise ValueError(f"chunk of {ids.numel()} tokens exceeds budget_tokens={self.budget_tokens}")
        victims = self._slide_plan(int(ids.numel()))  # raises before anything changes
        for victim in victims:
            self.evict(victim)
        chunk = ChunkRecord(ChunkId(self._next_id), key, inputs, ids, self.km.span(inputs), len(self._order))
        self._next_id += 1
        self._chunks[chunk.id] = chunk
        self._order.append(chunk.id)
        if self._policy.eager:
            try:
                self._read(list(self._order), count=False)
            except Exception:
                self._order.pop()
                del self._chunks[chunk.id]
                for victim in reversed(victims):  # back where they were, their KV in the store
                    self._order.insert(min(self._chunks[victim].slot, len(self._order)), victim)
                    self._io.restore_pixels(self._chunks[victim])
                    self._stats.evictions -= 1
                raise
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
        chunk.canonical = chunk.held = chunk.served = None
        chunk.patches.clear()
        self._io.spill_pixels(chunk)
        self._order.pop(index)
        self._pinned.discard(chunk_id)
        self._eviction.left(chunk_id)
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
        self.materialize()  # every chunk's first pass (and its origin patch) before the orders
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

    @timed
    def materialize(self) -> None:
        """Run now the passes the next read would run (every chunk's KV for its placement), so a
        later read pays only for its query."""
        self._read(list(self._order))

    @timed
    def segments(self) -> list[list[Segment]]:
        """Per decoder layer, the segments a read attends to, in window order (`Segment`: each
        chunk's KV where the window or the store holds it, its placement shift and patch), after
        running the passes the window owes. For inspection and benchmarks: nothing is copied."""
        cache, _, _ = self._read(list(self._order))
        return [list(layer.segments) for layer in cache.layers]

    # ---- reading ------------------------------------------------------------------------------

    def chunks(self) -> list[ChunkId]:
        return list(self._order)

    def __len__(self) -> int:
        """Chunks in the window."""
        return len(self._order)

    def __contains__(self, chunk_id: object) -> bool:
        """Whether `chunk_id` is in the window now (an evicted or unknown id is not)."""
        return chunk_id in self._order

    def find(self, content: Content) -> ChunkId | None:
        """The chunk holding this content (the same content key: text, image or frames), in the
        window first, else the most recently evicted one; None when the window never had it."""
        content = Text(content) if isinstance(content, str) else content
        _, key = model_inputs(self.km, self.store.tenant, content)
        found = [c for c in self._order if self._chunks[c].key == key]
        if found:
            return found[0]
        gone = [c for c in sorted(self._chunks, reverse=True) if self._chunks[c].key == key]
        return gone[0] if gone else None

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
        read in place (segment attention); runs the passes the window still owes in the same
        forward as the query."""
        return self.read(query).logprobs

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
        self._query_ids(query)  # checked before anything runs
        if max_new_tokens == 0:
            return []
        return self.read(query, max_new_tokens, logits_processor, stop).token_ids

    @timed
    def read(self, query: str, max_new_tokens: int = 0, logits_processor=None, stop=None,
             continuation: Sequence[int] | None = None) -> "Reading":
        """One read of the window after `query`: the next-token log-probabilities (`[vocab]`
        float32, as `next_token_logprobs`) and up to `max_new_tokens` greedy token ids (as
        `generate_ids`, with its `logits_processor` and `stop`), in one pass over the query.
        continuation: token ids read after the query in that same pass (scoring a given reply,
        teacher forcing); the Reading's `continuation_logprobs` `[len, vocab]` holds the
        log-probabilities of the token after each of them. Not with `max_new_tokens`."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        ids = self._query_ids(query)
        if continuation is not None:
            return self._read_continuation(ids, continuation, max_new_tokens)
        cache, logits, tail = self._read(list(self._order), ids)
        logprobs = torch.log_softmax(logits, -1)
        seen, out = ids, []
        position = self._span(self._order) + int(ids.numel())
        eos = getattr(self.km.model.config, "eos_token_id", None)
        eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
        scores, ended = logits[None], None
        for step in range(max_new_tokens):
            if logits_processor is not None:
                scores = logits_processor(seen[None], scores)
            token = int(scores[0].argmax())
            if token in eos:
                ended = token
                break
            out.append(token)
            if (stop is not None and stop(out)) or step == max_new_tokens - 1:
                break
            chosen = torch.tensor([token])
            t0 = time.perf_counter()
            result = self.km.forward(chosen, position, cache, logits_to_keep=1)
            self._stats.count("decode", 1)
            self._stats.seconds["decode"] += time.perf_counter() - t0
            position += 1
            seen = torch.cat([seen, chosen])
            scores = result.logits[:, -1].float()
        self._keep_tail(tail, seen, cache)
        return Reading(logprobs, out, ended)

    def _read_continuation(self, ids: torch.Tensor, continuation: Sequence[int], max_new_tokens: int) -> "Reading":
        if max_new_tokens:
            raise ValueError("read() scores a continuation or decodes new tokens, not both: pass max_new_tokens=0")
        vocab = int(self.km.model.get_input_embeddings().num_embeddings)
        try:
            extra = [int(t) for t in continuation]
        except (TypeError, ValueError):
            raise TypeError("continuation must be a sequence of token ids (ints)") from None
        if any(t < 0 or t >= vocab for t in extra) or any(isinstance(t, bool) for t in continuation):
            raise ValueError(f"continuation token ids must be ints in [0, {vocab})")
        seen = torch.cat([ids, torch.tensor(extra, dtype=torch.long)])
        cache, logits, tail = self._read(list(self._order), seen, rows=len(extra) + 1)
        logprobs = torch.log_softmax(logits.reshape(len(extra) + 1, -1), -1)
        self._keep_tail(tail, seen, cache)
        return Reading(logprobs[0], [], None, logprobs[1:])

    def key_summary(self, chunk_id: ChunkId) -> torch.Tensor:
        """`[layers, width]` float32: the chunk's keys in its chunk-local frame averaged over its
        tokens, one row per layer (MLA: the latent c_KV): of its canonical KV where the window has
        it (patch policies), else of its in-context KV moved back to position 0. Chunks in or out
        of the window; a chunk never computed is encoded alone for it (counted as "encode").
        `km.key_summary(ids)` gives the same summary of any token ids encoded alone."""
        if chunk_id not in self._chunks:
            raise ValueError(f"unknown chunk id {chunk_id!r}")
        return self._summary(self._chunks[chunk_id])

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
        scores = layer_cosine(q, torch.stack([self._summary(self._chunks[c]) for c in candidates])).tolist()
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

    # ---- internals: order and bookkeeping -----------------------------------------------------

    def _keys(self, order: Sequence[ChunkId]) -> tuple[ChunkKey, ...]:
        return tuple(self._chunks[c].key for c in order)

    def _require_in_window(self, chunk_id: ChunkId) -> None:
        if chunk_id not in self._order:
            raise ValueError(f"chunk {chunk_id!r} is not in the window (in window: {self._order})")

    def _query_ids(self, query: str) -> torch.Tensor:
        if not isinstance(query, str):
            raise TypeError(f"the query must be a str, got {type(query).__name__}")
        try:
            query.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"the query is not valid text ({err.reason} at character {err.start}); "
                             "pass a str that encodes as UTF-8") from None
        ids = self.km.tokenize(query)
        if ids.numel() == 0:
            raise ValueError("the query tokenizes to no tokens")
        return ids

    def _touch(self, chunk_id: ChunkId) -> None:
        self._eviction.used(chunk_id)

    def _slide_plan(self, incoming: int) -> list[ChunkId]:
        """Chunks to evict so that `incoming` more tokens fit (the eviction policy's plan)."""
        sizes = {c: int(self._chunks[c].ids.numel()) for c in self._order}
        return self._eviction.plan(self._order, sizes, self._pinned, incoming, self.budget_tokens)

    def _span(self, order: Sequence[ChunkId]) -> int:
        """Position units taken by `order` (where the next chunk or the query starts)."""
        return sum(self._chunks[c].span for c in order)

    def _placements(self, order: Sequence[ChunkId]) -> list[Placement]:
        """Where each chunk of `order` sits: its prefix's and its own placement keys, start, first."""
        out, prefix, start, first = [], self._root, 0, 0
        for index, cid in enumerate(order):
            chunk = self._chunks[cid]
            key = placement_key(prefix, chunk.key)
            out.append(Placement(prefix, key, start, first, index))
            prefix, start, first = key, start + chunk.span, first + int(chunk.ids.numel())
        return out

    # ---- internals: KV sources ----------------------------------------------------------------

    def _encode(self, inputs: ChunkInput, tokens: int) -> list[LayerKV]:
        """A chunk alone in its chunk-local frame (one forward, counted)."""
        t0 = time.perf_counter()
        kv = self.km.encode(inputs, self._io.features)
        self._stats.count("encode", tokens)
        self._stats.seconds["encode"] += time.perf_counter() - t0
        return kv

    def _hold(self, chunk: ChunkRecord) -> list[LayerKV]:
        """The chunk's canonical KV (patch policies), read from the store when the window does not
        hold it, encoded (counted) when the store does not have it either."""
        if chunk.canonical is None:
            chunk.canonical = self._io.load_canonical(chunk.key, int(chunk.ids.numel()))
            if chunk.canonical is None:
                chunk.canonical = self._io.put_canonical(chunk, self._encode(chunk.inputs, int(chunk.ids.numel())))
        return chunk.canonical

    def _earlier_kv(self, chunk: ChunkRecord) -> tuple[list[LayerKV], int] | None:
        """The KV this chunk was last computed with (any placement) and the position it was
        computed at: held by the window, else its last exact KV from the store; None if neither."""
        if chunk.held is not None:
            return chunk.held.kv, chunk.held.start
        if chunk.last is not None:
            kv = self._io.load_placed(chunk.last[0], int(chunk.ids.numel()))
            if kv is not None:
                return kv, chunk.last[1]
        return None

    def _summary(self, chunk: ChunkRecord) -> torch.Tensor:
        if chunk.summary is None:
            if chunk.canonical is not None:
                chunk.summary = key_summary(chunk.canonical)
            else:
                earlier = self._earlier_kv(chunk)
                if earlier is not None:
                    kv, start = earlier
                    chunk.summary = key_summary(relocate_kv(kv, self.km.specs, self.km.layout, -start))
                else:
                    chunk.summary = key_summary(self._encode(chunk.inputs, int(chunk.ids.numel())))
        return chunk.summary

    def _placed(self, chunk: ChunkRecord, pl: Placement, exact: bool) -> Held | None:
        """KV of `chunk` computed for this very placement: held, or stored (the store keeps exact
        KV only). Approximately computed KV is served only where the chunks before it are
        approximate too (`exact` False)."""
        held = chunk.held
        if held is not None and held.key == pl.key and (held.exact or not exact):
            return held
        if not self._policy.placed:
            return None
        kv = self._io.load_placed(pl.key, int(chunk.ids.numel()))
        if kv is None:
            return None
        self._stats.exact_hits += 1
        self._stats.exact_hit_tokens += int(chunk.ids.numel())
        chunk.held = Held(pl.key, pl.start, kv, True)
        chunk.computed_at = self._stats.evictions
        chunk.last = (pl.key, pl.start)
        return chunk.held

    # ---- internals: reads ---------------------------------------------------------------------

    def _read(self, order: list[ChunkId], tail: torch.Tensor | None = None, count: bool = True, rows: int = 1) -> tuple:
        """Segments for every chunk of `order`, computing the missing ones, then (with `tail`, the
        query's ids) the query in the same cache. Returns (SegmentCache, last-row logits `[vocab]`
        float32 or None; `[rows, vocab]`, the tail's last rows, when rows > 1; a `_Run` of the
        tail's forward or None). count=False: approximate and
        stale placements are not counted (an eager append's pass is not a read)."""
        t0 = time.perf_counter()
        placements = self._placements(order)
        layers: Layers = [[] for _ in self.km.specs]
        exact, waiting = True, []  # waiting: (chunk, placement) to compute, right after `layers`
        self._changed_at = None  # token index of the first chunk not served as computed for its place
        try:
            return self._read_order(order, placements, layers, tail, count, t0, rows)
        finally:
            for lease in self._leases:
                self.store.release(lease)
            self._leases = []

    def _read_order(self, order: list[ChunkId], placements: list[Placement], layers: Layers,
                    tail: torch.Tensor | None, count: bool, t0: float, rows: int = 1) -> tuple:
        exact, waiting = True, []
        for cid, pl in zip(order, placements):
            chunk = self._chunks[cid]
            held = self._placed(chunk, pl, exact)
            if held is None and self._changed_at is None:
                self._changed_at = pl.first
            approx = None if held is not None else self._policy.place(self, chunk, pl, order[:pl.index])
            if held is None and approx is None and exact and self._policy.placed:
                # Another worker on this store may be computing this very placement: wait for it
                # rather than compute it twice (what is owed before it is computed first).
                if self._claim(pl.key):
                    if self._leases[-1].tier != "ram":  # shared: put by another worker just before our lease?
                        held = self._placed(chunk, pl, exact)
                else:
                    if waiting:
                        self._compute(waiting, layers, exact, order)
                        waiting = []
                    held = self._wait_for(chunk, pl)
            if held is None and approx is None:
                waiting.append((chunk, pl))
                continue
            if waiting:
                self._compute(waiting, layers, exact, order)
                waiting = []
            if held is not None:
                self._add(layers, held.kv, pl.first, pl.start - held.start)
                chunk.served = None
                exact = exact and held.exact
            else:
                self._add(layers, approx.kv, pl.first, approx.shift, approx.patch)
                if count:
                    self._stats.approximate += 1
                    self._stats.stale_patches += int(approx.stale)
                if chunk.served != pl.key and (approx.shift or pl.index) and not approx.first:
                    self._stats.relocations += 1
                    self._stats.relocated_tokens += int(chunk.ids.numel())
                chunk.served = pl.key
                exact = exact and approx.exact
        self._stats.seconds["segments"] += time.perf_counter() - t0
        first = sum(int(self._chunks[c].ids.numel()) for c in order)
        if tail is None:
            if waiting:
                self._compute(waiting, layers, exact, order)
            return self.km.cache(layers, first), None, None
        if waiting and self._per_chunk(waiting):
            self._compute(waiting, layers, exact, order)
            waiting = []
        prefix = placements[-1].key if placements else self._root
        if waiting:
            run = self._forward_run(waiting, layers, exact, tail, waiting[0][1].prefix, waiting[0][1].first,
                                    waiting[0][1].start, rows)
        else:
            run = self._forward_run(waiting, layers, exact, tail, prefix, first, self._span(order), rows)
        self._settle(waiting, run, order)
        run.prefix = prefix
        return run.cache, run.logits, run

    def _claim(self, key: ChunkKey) -> bool:
        """Take the store's lease on computing placement `key` (kept until the read ends); False
        while another worker holds it. A RAM-only store always grants."""
        lease = self.store.try_lease(key, LEASE_TTL_S)
        if lease is None:
            return False
        self._leases.append(lease)
        return True

    def _wait_for(self, chunk: ChunkRecord, pl: Placement) -> Held | None:
        """The placement another worker is computing: its KV once the store has it (counted as
        `waited`), or None when its lease lapses or is given back without it (the lease is then
        ours, and the chunk is computed here)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + LEASE_TTL_S
        while True:
            held = self._placed(chunk, pl, True)
            if held is not None:
                self._stats.waited += 1
                self._stats.seconds["wait"] += time.perf_counter() - t0
                return held
            if self._claim(pl.key) or time.monotonic() >= deadline:
                self._stats.seconds["wait"] += time.perf_counter() - t0
                return self._placed(chunk, pl, True)  # stored as the holder released: no compute
            time.sleep(LEASE_POLL_S)

    @staticmethod
    def _add(layers: Layers, kv: Sequence[LayerKV], first: int, shift: int = 0, patch: kp.ChunkPatch | None = None
             ) -> None:
        for i, (layer, (k, v)) in enumerate(zip(layers, kv)):
            layer.append(Segment(k, v, first, shift, None if patch is None else patch.layers[i]))

    def _kind(self, chunk: ChunkRecord) -> str:
        """A pass's kind: a chunk's first ("in_context"), or a later one: "recompute" (the chunks
        before it changed), "conditioned" under a patch policy (a pass for a new antecedent's patch)."""
        if chunk.origin is None:
            return "in_context"
        return "conditioned" if self._policy.patches else "recompute"

    def _per_chunk(self, waiting: list) -> bool:
        """Whether the waiting chunks are computed one forward each: vision chunks, and the passes
        a patch fit reads (queries, logits) of each chunk's own rows."""
        return (self._policy.patches and self.settings.probed) or any(c.inputs.kind != "text" for c, _ in waiting)

    def _compute(self, waiting: list, layers: Layers, exact: bool, order: Sequence[ChunkId]) -> None:
        """Compute the waiting chunks after `layers` and append their segments to `layers`."""
        if self._per_chunk(waiting):
            for chunk, pl in waiting:
                self._compute_one(chunk, pl, layers, exact, order)
            return
        pl = waiting[0][1]
        run = self._forward_run(waiting, layers, exact, None, pl.prefix, pl.first, pl.start)
        self._settle(waiting, run, order)
        for chunk, pl in waiting:
            self._add(layers, chunk.held.kv, pl.first)

    def _compute_one(self, chunk: ChunkRecord, pl: Placement, layers: Layers, exact: bool,
                     order: Sequence[ChunkId]) -> None:
        """One chunk's pass after `layers` (with the probe a patch fit reads), then its segment."""
        t0 = time.perf_counter()
        n = int(chunk.ids.numel())
        probe = self.settings.probe(n) if self._policy.patches else None
        before = [list(layer) for layer in layers]
        kv = self.km.encode_after(layers, pl.first, pl.start, chunk.inputs, self._io.features, probe)
        kind = self._kind(chunk)
        self._stats.count(kind, n)
        self._stats.conditioned_passes += kind == "conditioned"
        self._stats.seconds[kind] += time.perf_counter() - t0
        self._keep(chunk, pl, kv, exact, order, (before, probe, pl.first) if probe is not None else None)
        self._add(layers, chunk.held.kv, pl.first)

    def _forward_run(self, waiting: list, layers: Layers, exact: bool, tail: torch.Tensor | None,
                     prefix: ChunkKey, first: int, start: int, rows: int = 1) -> "_Run":
        """One forward of the waiting text chunks' ids (then the tail's) after `layers`, placed at
        token index `first` and position `start` right after the prefix `prefix`. Rows computed before after the same
        prefix are reused instead (only when every chunk before is exact KV); a read computes its
        last `rows` rows at least, for their logits."""
        t0 = time.perf_counter()
        parts = [c.ids for c, _ in waiting] + ([tail] if tail is not None else [])
        ids = torch.cat(parts)
        chunk_rows = sum(int(c.ids.numel()) for c, _ in waiting)
        pieces = self._index.match(prefix, ids, self._io.load_run) if exact and self._policy.placed else []
        matched = sum(p.num_tokens for p in pieces)
        keep = int(ids.numel()) - (rows if tail is not None else 0)
        while matched > keep:
            last = pieces.pop()
            cut = min(last.num_tokens, matched - keep)
            if last.num_tokens > cut:
                pieces.append(Piece(last.kv, last.num_tokens - cut))
            matched -= cut
        served = [list(layer) for layer in layers]
        at = first
        for piece in pieces:
            self._add(served, [(k[:piece.num_tokens], v[:piece.num_tokens]) for k, v in piece.kv], at)
            at += piece.num_tokens
        cache = self.km.cache(served, first + matched)
        logits = None
        if matched < ids.numel():
            out = self.km.forward(TextChunk(ids[matched:]), start + matched, cache, logits_to_keep=rows)
            if tail is not None:
                logits = out.logits[0, -1].float() if rows == 1 else out.logits[0, -rows:].float()
            kinds: dict[str, int] = {}
            offset = 0
            for chunk, _ in waiting:
                n = int(chunk.ids.numel())
                fresh = offset + n - max(offset, matched)
                if fresh > 0:
                    kinds[self._kind(chunk)] = kinds.get(self._kind(chunk), 0) + fresh
                offset += n
            if tail is not None:  # a read's tail: the query, then any continuation scored after it (rows - 1)
                kinds["query"] = int(ids.numel()) - max(chunk_rows, matched) - (rows - 1)
                if rows > 1:
                    kinds["decode"] = rows - 1
            self._stats.count_pass(kinds)
        self._stats.matched_tokens += matched
        self._stats.seconds["pass"] += time.perf_counter() - t0
        return _Run(cache, logits, pieces, matched, chunk_rows, exact)

    def _settle(self, waiting: list, run: "_Run", order: Sequence[ChunkId]) -> None:
        """Keep each chunk the run computed (held; stored and indexed when exact)."""
        offset = 0
        for chunk, pl in waiting:
            n = int(chunk.ids.numel())
            self._keep(chunk, pl, run.rows(offset, offset + n), run.exact, order, None)
            offset += n

    def _keep(self, chunk: ChunkRecord, pl: Placement, kv: list[LayerKV], exact: bool, order: Sequence[ChunkId],
              probed: tuple | None) -> None:
        """A chunk's KV computed at `pl`: held, and kept in the store (and the prefix index) when
        the chunks before it were exact; then the policy's fit from the pass (patch policies)."""
        antecedent = self._keys(order[:pl.index])
        first_pass = chunk.origin is None
        if exact and self._policy.placed:
            kv = self._io.put_placed(pl.key, kv, chunk.inputs.kind, pl.start)
            if chunk.inputs.kind == "text":
                self._index.add(pl.prefix, chunk.ids, child=pl.key)
            chunk.last = (pl.key, pl.start)
        chunk.held = Held(pl.key, pl.start, kv, exact)
        chunk.computed_at = self._stats.evictions
        self._stats.computed_chunks += 1
        if chunk.canonical is None:
            chunk.summary = None  # from the newest KV when asked
        if first_pass:
            chunk.origin = antecedent
        self._policy.passed(self, chunk, pl, order[:pl.index], kv, probed, first_pass)

    def _keep_tail(self, run: "_Run | None", ids: torch.Tensor, cache: object) -> None:
        """Index the read's tail (query and decoded tokens) after the window's prefix, so a read
        repeating it (or a chunk continuing it) reuses those rows."""
        if run is None or not run.exact or not self._policy.placed:
            return
        self._index.add(run.prefix, ids, kv=run.rows(run.chunk_rows, run.chunk_rows + int(ids.numel())))


@dataclass(frozen=True, slots=True)
class Reading:
    """What one read gave: `logprobs` `[vocab]` float32 of the token after the query, and the
    greedy token ids decoded after it (`token_ids`; an end-of-sequence token ends them and is not
    included: `end_token` is that token, None when decoding stopped otherwise); a read of a given
    continuation has `continuation_logprobs` `[len, vocab]` instead (the token after each)."""

    logprobs: torch.Tensor
    token_ids: list[int]
    end_token: int | None = None
    continuation_logprobs: torch.Tensor | None = None


class _Run:
    """One forward of a run of tokens (waiting chunks, then a read's tail): its cache, the last
    row's logits (reads), and where each row's KV is: the first `matched` rows in `pieces` (computed
    before after the same prefix), the rest in the cache's tail (which decoding extends)."""

    def __init__(self, cache: object, logits: torch.Tensor | None, pieces: list[Piece], matched: int, chunk_rows: int,
                 exact: bool) -> None:
        self.cache, self.logits, self.pieces, self.matched = cache, logits, pieces, matched
        self.chunk_rows, self.exact = chunk_rows, exact
        self.prefix: ChunkKey | None = None  # the window's placement key, where the tail starts (reads)

    def rows(self, a: int, b: int) -> list[LayerKV]:
        """KV rows [a, b) of the run (offsets from its first token), owned contiguous copies."""
        layers = len(self.pieces[0].kv) if self.pieces else len(self.cache.layers)
        ks: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        vs: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        at = 0
        for piece in self.pieces:
            lo, hi = max(a, at), min(b, at + piece.num_tokens)
            if lo < hi:
                for i, (k, v) in enumerate(piece.kv):
                    ks[i].append(k[lo - at:hi - at])
                    vs[i].append(v[lo - at:hi - at])
            at += piece.num_tokens
        lo = max(a, self.matched)
        if lo < b:
            for i, (k, v) in enumerate(self.cache.tail_kv()):
                ks[i].append(k[lo - self.matched:b - self.matched])
                vs[i].append(v[lo - self.matched:b - self.matched])
        return [(torch.cat(k).contiguous(), torch.cat(v).contiguous()) for k, v in zip(ks, vs)]
