"""The reversible window: ordered chunks whose KV is read in place by segment attention.

Operations (`append`, `evict`, `recall`, `reorder`, `slide`) edit the order only; a read serves
each chunk's KV for its placement where it is held or stored (by placement key,
`agentwin.prefix`) and computes the rest after what precedes it, in as few forwards as it can
(`agentwin.window_engine`). The default (`patch="exact"`) reproduces a re-prefill and never
forwards more than prefix caching; the other placement policies (`agentwin.patches.policies`)
trade fidelity for work. Past `budget_tokens`, unpinned chunks are evicted by the window's
eviction policy (`agentwin.eviction`); an evicted chunk's KV stays in the store. docs/DESIGN.md,
"The KV engine", gives the whole picture.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from agentwin.content import Content, Frames, Image, Text, model_inputs  # noqa: F401 (Frames, Image re-exported)
from agentwin.eviction import make_eviction
from agentwin.models.adapter import KameraModel
from agentwin.models.kv import LayerKV
from agentwin.patches.fit import patch_settings
from agentwin.prefix import PrefixIndex, root_key
from agentwin.store import ChunkKey, ChunkStore
from agentwin.window_chunk import ChunkId, ChunkRecord, ChunkView, Reading, check_invariants, held_bytes, timed
from agentwin.window_config import WindowConfig
from agentwin.window_engine import PolicyHost, WindowEngine
from agentwin.window_io import WindowIO
from agentwin.window_stats import WindowStats
from kamera_core import patch as kp  # noqa: F401 (tests reach the fit through it)
from kamera_core.metrics import layer_cosine
from kamera_core.segment import Segment


class Window(WindowEngine):
    """Ordered chunks in context over a `KameraModel`; see the module docstring."""

    def __init__(self, km: KameraModel, config: WindowConfig | None = None, store: ChunkStore | None = None,
                 **settings: object) -> None:
        """config: a `WindowConfig`, or its settings as keywords (`Window(km, budget_tokens=2048)`),
        not both. store: where KV lives, shared by every window (and process, with a disk root or a
        Redis tier) that uses it; default a private RAM-only store."""
        if not isinstance(km, KameraModel):
            raise TypeError(f"km must be a KameraModel, got {type(km).__name__}")
        if config is not None and not isinstance(config, WindowConfig):
            raise TypeError(f"config must be an agentwin.WindowConfig, got {type(config).__name__}")
        if config is not None and settings:
            raise TypeError(f"pass the window's settings in config or as keywords, not both ({', '.join(settings)})")
        unknown = sorted(set(settings) - set(WindowConfig.names()))
        if unknown:
            raise TypeError(f"unknown window setting(s) {', '.join(unknown)}; the settings are "
                            f"{', '.join(WindowConfig.names())}")
        c = config if config is not None else WindowConfig(**settings)  # ValueError says what to pass
        patches = patch_settings(km, c.rank, c.patch_bytes, c.storage, c.guard, c.max_kl, c.fit)
        if store is not None and not isinstance(store, ChunkStore):
            raise TypeError(f"store must be an agentwin.store.ChunkStore or None, got {type(store).__name__}")
        if store is not None and store.model_fingerprint not in ("", km.fingerprint):
            raise ValueError("the store belongs to another model (fingerprint differs); open one for this model")
        self.store = store if store is not None else ChunkStore(None, model_fingerprint=km.fingerprint)
        self.km, self.config, self.settings = km, c, patches
        # Read-only views of the settings (the checked patch settings, "auto" resolved).
        self.policy, self.budget_tokens, self.eviction = c.policy_name, c.budget_tokens, c.evict
        self.rank, self.patch_bytes, self.storage = patches.rank, patches.patch_bytes, patches.storage
        self.guard, self.max_kl, self.fit = patches.guard, patches.max_kl, patches.fit
        self._policy = c.policy()
        self._host = PolicyHost(self)  # what the policy sees of this window
        self._eviction = make_eviction(c.evict)  # which unpinned chunks the budget drops first (agentwin.eviction)
        self._depth = 0  # nesting of timed public operations
        self._chunks: dict[ChunkId, ChunkRecord] = {}
        self._order: list[ChunkId] = []
        self._pinned: set[ChunkId] = set()
        self._next_id = 0
        self._stats = WindowStats()
        self._asked: tuple[tuple[int, ...] | None, torch.Tensor | None] = (None, None)  # last query, its summary
        self._io = WindowIO(km, self.store, self._stats, patches)
        self.encoder = self._io.encoder
        self._root = root_key(km.fingerprint, self.store.tenant)
        self._index = PrefixIndex()
        self._changed_at: int | None = None  # during a read: see `_read`
        self._leases: list = []  # during a read: the store leases it holds on placements it computes

    # ---- operations ---------------------------------------------------------------------------

    @timed
    def append(self, content: Content, pin: bool = False) -> ChunkId:
        """Add a chunk (Text or str; Image or Frames on a vision-language model) at the end, evicting
        by the window's policy past `budget_tokens`. Its pass runs at the next read (the patch
        policies run it now, to fit its origin patch; a failure leaves the window as it was)."""
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
        """Take a chunk out of the window; its KV and patches stay in the store's tiers for a recall."""
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
    def recall(self, chunk_id: ChunkId, at: int | None = None, keep: Sequence[ChunkId] = ()) -> list[ChunkId]:
        """Bring an evicted chunk back at its old slot (clamped to the window's end) or at index `at`,
        evicting by the window's policy first (never the chunks in `keep`); returns those evicted."""
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
        victims = self._slide_plan(int(self._chunks[chunk_id].ids.numel()), keep)  # raises before any change
        self._io.restore_pixels(self._chunks[chunk_id])  # raises before any change
        for victim in victims:
            self.evict(victim)
        self._order.insert(min(index, len(self._order)), chunk_id)
        self._touch(chunk_id)
        self._stats.recalls += 1
        return victims

    @timed
    def slide(self, free_tokens: int = 0, keep: Sequence[ChunkId] = ()) -> list[ChunkId]:
        """Evict by the window's policy (`agentwin.eviction`; pinned chunks and those in `keep`
        stay) until `free_tokens` more tokens fit within the budget; returns the evicted chunks.
        ValueError, nothing evicted, when they cannot fit."""
        if isinstance(free_tokens, bool) or not isinstance(free_tokens, int) or free_tokens < 0:
            raise ValueError(f"free_tokens must be a non-negative int, got {free_tokens!r}")
        victims = self._slide_plan(free_tokens, keep)
        for victim in victims:
            self.evict(victim)
        return victims

    def relevant_to(self, query: str | None) -> None:
        """With evict="relevant": the budget drops the chunks least like `query` first (`nearest`);
        None: oldest first again."""
        if self.eviction != "relevant":
            raise ValueError(f"relevant_to needs evict='relevant', this window evicts {self.eviction!r}")
        if query is not None:
            self.query_ids(query)  # refused now, not at the next eviction
        self._eviction.target(None if query is None else
                              lambda order: dict(self.nearest(query, k=len(order), among=order)))

    def touch(self, chunk_id: ChunkId) -> None:
        """Mark a chunk as used now (LRU eviction keeps recently used chunks longest)."""
        self._require_in_window(chunk_id)
        self._touch(chunk_id)

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
        """Run now the passes the next read would run, so a later read pays only for its query."""
        self._read(list(self._order))

    @timed
    def segments(self) -> list[list[Segment]]:
        """Per decoder layer, the `Segment`s a read attends to (KV, shift, patch), in window order,
        after running the passes the window owes. Nothing is copied."""
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
            parts.append(self.query_ids(query))
        if not parts:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat(parts)

    def reference_inputs(self, query: str | None = None) -> dict[str, torch.Tensor]:
        """Keyword arguments of a plain transformers re-prefill of the window (and query):
        `model(**reference_inputs(q))`, vision inputs included."""
        parts = [self._chunks[c].inputs for c in self._order]
        if query is not None:
            parts.append(self.query_ids(query))
        return self.km.reference_inputs(parts)

    @timed
    def next_token_logprobs(self, query: str) -> torch.Tensor:
        """`[vocab]` float32 log-probabilities of the token after `query`, read after the window's KV."""
        return self.read(query).logprobs

    def reference_logprobs(self, query: str) -> torch.Tensor:
        """The same from the model's own forward of `reference_inputs(query)`."""
        parts = [self._chunks[c].inputs for c in self._order] + [self.query_ids(query)]
        return torch.log_softmax(self.km.reference_forward(parts).logits[0, -1].float(), -1)

    @timed
    def generate(self, query: str, max_new_tokens: int = 32) -> str:
        """Greedy continuation of `query` read after the window's KV."""
        return self.km.tokenizer.decode(self.generate_ids(query, max_new_tokens))

    @timed
    def generate_ids(self, query: str, max_new_tokens: int = 32, logits_processor=None, stop=None) -> list[int]:
        """Greedy token ids after `query`. logits_processor: `fn(ids [1, n], scores [1, vocab]) ->
        scores` applied before each choice (e.g. a grammar mask); stop: `fn(chosen_ids) -> bool`,
        true ends decoding. An end-of-sequence token ends it and is not returned."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        self.query_ids(query)  # checked before anything runs
        if max_new_tokens == 0:
            return []
        return self.read(query, max_new_tokens, logits_processor, stop).token_ids

    @timed
    def read(self, query: str, max_new_tokens: int = 0, logits_processor=None, stop=None,
             continuation: Sequence[int] | None = None) -> Reading:
        """One read after `query`: its next-token log-probabilities and up to `max_new_tokens` greedy
        ids (as `generate_ids`). continuation: token ids scored after the query in the same pass
        (teacher forcing; `Reading.continuation_logprobs`), not with `max_new_tokens`."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        ids = self.query_ids(query)
        if continuation is not None:
            return self._read_continuation(ids, continuation, max_new_tokens)
        cache, logits, tail = self._read(list(self._order), ids)
        logprobs = torch.log_softmax(logits, -1)
        seen, out = ids, []
        position = self.positions(self._order) + int(ids.numel())
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

    def _read_continuation(self, ids: torch.Tensor, continuation: Sequence[int], max_new_tokens: int) -> Reading:
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
        """`[layers, width]` float32: the chunk's keys (MLA: c_KV) in its chunk-local frame, averaged
        over its tokens; in the window or evicted (a chunk never computed is encoded alone for it)."""
        if chunk_id not in self._chunks:
            raise ValueError(f"unknown chunk id {chunk_id!r}")
        return self._summary(self._chunks[chunk_id])

    def nearest(self, query: str, k: int = 1, among: Sequence[ChunkId] | None = None) -> list[tuple[ChunkId, float]]:
        """The `k` chunks (in the window or evicted; only `among` when given) whose key summaries are
        closest to the query's (`layer_cosine`), best first; the query's encode counts as "retrieval"."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        candidates = sorted(self._chunks) if among is None else list(dict.fromkeys(among))
        for cid in candidates:
            if cid not in self._chunks:
                raise ValueError(f"unknown chunk id {cid!r}")
        if not candidates:
            return []
        ids = self.query_ids(query)
        asked = tuple(ids.tolist())
        if self._asked[0] != asked:  # a query asked again (an agent's task) is encoded once
            self._asked = (asked, self.km.key_summary(ids))
            self._stats.count("retrieval", int(ids.numel()))
        q = self._asked[1]
        scores = layer_cosine(q, torch.stack([self._summary(self._chunks[c]) for c in candidates])).tolist()
        ranked = sorted(zip(candidates, scores), key=lambda cs: (-cs[1], cs[0]))
        return [(ChunkId(c), float(score)) for c, score in ranked[:k]]

    def query_ids(self, query: str) -> torch.Tensor:
        """The token ids a read of `query` forwards after the chunks (TypeError / ValueError for a
        query that is not text or tokenizes to nothing)."""
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

    def positions(self, chunk_ids: Sequence[ChunkId] | None = None) -> int:
        """Position units the chunks take (default: the window's): where what follows them starts."""
        order = self._order if chunk_ids is None else chunk_ids
        for cid in order:
            if cid not in self._chunks:
                raise ValueError(f"unknown chunk id {cid!r}")
        return sum(self._chunks[c].span for c in order)

    def inspect(self, chunk_id: ChunkId) -> ChunkView:
        """What the window holds for a chunk now (a read-only `ChunkView`); nothing is computed."""
        if chunk_id not in self._chunks:
            raise ValueError(f"unknown chunk id {chunk_id!r}")
        return ChunkView.of(self._chunks[chunk_id], chunk_id in self._order)

    def canonical_kv(self, chunk_id: ChunkId) -> list[LayerKV]:
        """The chunk's canonical KV (its prefill alone, chunk-local frame): held, stored, or encoded
        now. The chunk must be in the window."""
        self._require_in_window(chunk_id)
        return self._hold(self._chunks[chunk_id])

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

    def _touch(self, chunk_id: ChunkId) -> None:
        self._eviction.used(chunk_id)

    def _slide_plan(self, incoming: int, keep: Sequence[ChunkId] = ()) -> list[ChunkId]:
        """Chunks to evict so that `incoming` more tokens fit (the eviction policy's plan), never
        a pinned one or one in `keep`."""
        sizes = {c: int(self._chunks[c].ids.numel()) for c in self._order}
        return self._eviction.plan(self._order, sizes, self._pinned | set(keep), incoming, self.budget_tokens)
