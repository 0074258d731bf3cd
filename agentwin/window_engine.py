"""The window's compute engine (`WindowEngine`, the base of `agentwin.window.Window`): an order of chunks turned into
the per-layer segments a read attends to, what is missing computed at the read in as few forwards as it can, under the
store's lease; and `PolicyHost`, the view of the window a placement policy is lent."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from agentwin.models.adapter import ChunkInput
from agentwin.models.kv import LayerKV, relocate_kv
from agentwin.models.vision import TextChunk
from agentwin.patches.host import Earlier, Probed
from agentwin.prefix import Piece, placement_key
from agentwin.store import ChunkKey
from agentwin.window_chunk import ChunkId, ChunkRecord, Held, Placement, key_summary
from kamera_core import patch as kp
from kamera_core.segment import Segment

LEASE_TTL_S = 60.0  # a lease on computing a placement: longer than any one read's forwards
LEASE_POLL_S = 0.02
Layers = list[list[Segment]]  # per decoder layer, the segments read so far


class WindowEngine:
    """The reads and computes of `Window` (see the module docstring); no public API of its own."""

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
        """The chunk's canonical KV: held, else from the store, else encoded (counted); sets `chunk.canonical`."""
        if chunk.canonical is None:
            chunk.canonical = self._io.load_canonical(chunk.key, int(chunk.ids.numel()))
            if chunk.canonical is None:
                chunk.canonical = self._io.put_canonical(chunk, self._encode(chunk.inputs, int(chunk.ids.numel())))
        return chunk.canonical

    def _earlier_kv(self, chunk: ChunkRecord) -> Earlier | None:
        """The KV this chunk was last computed with and its position: held, else its last exact KV in the store;
        None if neither."""
        if chunk.held is not None:
            return Earlier(chunk.held.kv, chunk.held.start)
        if chunk.last is not None:
            kv = self._io.load_placed(chunk.last[0], int(chunk.ids.numel()))
            if kv is not None:
                return Earlier(kv, chunk.last[1])
        return None

    def _summary(self, chunk: ChunkRecord) -> torch.Tensor:
        if chunk.summary is None:
            if chunk.canonical is not None:
                chunk.summary = key_summary(chunk.canonical)
            else:
                earlier = self._earlier_kv(chunk)
                if earlier is not None:
                    chunk.summary = key_summary(relocate_kv(earlier.kv, self.km.specs, self.km.layout, -earlier.start))
                else:
                    chunk.summary = key_summary(self._encode(chunk.inputs, int(chunk.ids.numel())))
        return chunk.summary

    def _placed(self, chunk: ChunkRecord, pl: Placement, exact: bool) -> Held | None:
        """KV of `chunk` computed for this very placement, held or stored (a store hit is counted and held), or None.
        Held approximate KV is served only when `exact` is False."""
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
        """Segments for every chunk of `order`, computing the missing ones, then the query `tail` (ids) in the same
        cache. Returns (SegmentCache, logits: None, `[vocab]` float32 or with rows > 1 `[rows, vocab]`, the tail's
        `_Run` or None). count=False: approximate and stale placements are not counted (an eager append's pass)."""
        t0 = time.perf_counter()
        placements = self._placements(order)
        layers: Layers = [[] for _ in self.km.specs]
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
            approx = None if held is not None else self._policy.place(self._host, chunk, pl, order[:pl.index])
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
            run = self._forward_run(waiting, layers, exact, tail, prefix, first, self.positions(order), rows)
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
        """The placement another worker is computing, once stored (counted as `waited`); None when its lease lapses
        or is given back without it (the lease is then ours, and the chunk is computed here)."""
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
        """Whether the waiting chunks are computed one forward each: vision chunks, and passes a patch fit reads."""
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
        self._stats.seconds[kind] += time.perf_counter() - t0
        self._keep(chunk, pl, kv, exact, order, Probed(before, probe, pl.first) if probe is not None else None)
        self._add(layers, chunk.held.kv, pl.first)

    def _forward_run(self, waiting: list, layers: Layers, exact: bool, tail: torch.Tensor | None,
                     prefix: ChunkKey, first: int, start: int, rows: int = 1) -> "_Run":
        """One forward of the waiting text chunks' ids, then the tail's, after `layers` at token index `first` and
        position `start`, after the prefix `prefix`; with `exact`, rows computed before after that prefix are reused,
        except a read's last `rows` rows, whose logits it returns. Counts the forward by kind."""
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
              probed: Probed | None) -> None:
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
        self._policy.passed(self._host, chunk, pl, order[:pl.index], kv, probed, first_pass)

    def _keep_tail(self, run: "_Run | None", ids: torch.Tensor, cache: object) -> None:
        """Index the read's tail (query and decoded tokens) after the window's prefix, so a read
        repeating it (or a chunk continuing it) reuses those rows."""
        if run is None or not run.exact or not self._policy.placed:
            return
        self._index.add(run.prefix, ids, kv=run.rows(run.chunk_rows, run.chunk_rows + int(ids.numel())))


class PolicyHost:
    """The window as its placement policy sees it (`agentwin.patches.host.Host`); the policy never gets the window."""

    __slots__ = ("_window",)

    def __init__(self, window: WindowEngine) -> None:
        self._window = window

    km = property(lambda self: self._window.km)
    settings = property(lambda self: self._window.settings)
    stats = property(lambda self: self._window._stats)
    io = property(lambda self: self._window._io)
    order = property(lambda self: self._window._order)
    changed_at = property(lambda self: self._window._changed_at)

    def chunk(self, chunk_id: ChunkId) -> ChunkRecord:
        return self._window._chunks[chunk_id]

    def keys(self, ids: Sequence[ChunkId]) -> tuple[ChunkKey, ...]:
        return self._window._keys(ids)

    def canonical(self, chunk: ChunkRecord) -> list[LayerKV]:
        return self._window._hold(chunk)

    def earlier(self, chunk: ChunkRecord) -> Earlier | None:
        return self._window._earlier_kv(chunk)

    def summary(self, chunk: ChunkRecord) -> torch.Tensor:
        return self._window._summary(chunk)


class _Run:
    """One forward of waiting chunks, then a read's tail: its cache, logits (reads), and each row's KV: the first
    `matched` rows in `pieces` (reused), the rest in the cache's tail (which decoding extends)."""

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
