"""Exact reuse by prefix: placement keys (P_0 = root(model fingerprint, tenant), P_{i+1} = H(P_i, content key of
chunk i), naming chunk i's in-context KV after exactly chunks 0..i-1) and `PrefixIndex`, the token runs computed after
each placement key, for reuse at token granularity within one process."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from agentwin.store import ChunkKey

LayerKV = tuple[torch.Tensor, torch.Tensor]

_ROOT = b"agentwin.PrefixRoot/1"
_PLACEMENT = b"agentwin.Placement/1"


def _digest(domain: bytes, fields: Sequence[bytes]) -> ChunkKey:
    h = hashlib.sha256(struct.pack("<Q", len(domain)) + domain)
    for f in fields:
        h.update(struct.pack("<Q", len(f)) + f)
    return ChunkKey(h.hexdigest())


def root_key(model_fingerprint: str, tenant: str = "") -> ChunkKey:
    """The placement key of the empty prefix on one model for one tenant."""
    if not isinstance(model_fingerprint, str) or not isinstance(tenant, str):
        raise TypeError("model_fingerprint and tenant must be str")
    return _digest(_ROOT, [model_fingerprint.encode(), tenant.encode("utf-8", "surrogatepass")])


def placement_key(prefix: ChunkKey, chunk: ChunkKey) -> ChunkKey:
    """The key of `chunk`'s in-context KV right after the prefix `prefix`, and the name of the prefix ending with it."""
    return _digest(_PLACEMENT, [prefix.digest.encode(), chunk.digest.encode()])


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D id tensors."""
    n = min(int(a.numel()), int(b.numel()))
    if n == 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


@dataclass(slots=True)
class Run:
    """Token ids computed right after a prefix; their KV is in the store under `child` (a whole chunk; also the prefix
    it ends) or in `kv` (a read's tail, held here)."""

    ids: torch.Tensor  # [T] int64
    child: ChunkKey | None = None
    kv: list[LayerKV] | None = None  # per layer [T, kv_heads, dim] (MLA: [T, R], [T, r])

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())


@dataclass(frozen=True, slots=True)
class Piece:
    """The first `num_tokens` rows of `kv` (computed right after the prefix the match reached)."""

    kv: list[LayerKV]
    num_tokens: int


class PrefixIndex:
    """Runs computed after each prefix, at most `max_runs` runs and `max_tail_tokens` held tail tokens, LRU first out;
    ValueError on bad bounds."""

    def __init__(self, max_runs: int = 4096, max_tail_tokens: int = 16384) -> None:
        if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
            raise ValueError(f"max_runs must be a positive int, got {max_runs!r}")
        if isinstance(max_tail_tokens, bool) or not isinstance(max_tail_tokens, int) or max_tail_tokens < 0:
            raise ValueError(f"max_tail_tokens must be a non-negative int, got {max_tail_tokens!r}")
        self.max_runs, self.max_tail_tokens = max_runs, max_tail_tokens
        self._runs: OrderedDict[tuple[str, bytes], tuple[ChunkKey, Run]] = OrderedDict()
        self._by_prefix: dict[str, dict[bytes, Run]] = {}
        self.tail_tokens = 0

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, prefix: ChunkKey, ids: torch.Tensor, child: ChunkKey | None = None,
            kv: Sequence[LayerKV] | None = None) -> None:
        """Record that `ids` were computed right after `prefix`: a chunk stored under `child`, or a tail whose KV is
        `kv` (copied; a tail over `max_tail_tokens` is skipped). ValueError unless exactly one is given."""
        if (child is None) == (kv is None):
            raise ValueError("a run is either a stored chunk (child) or a held tail (kv), not both or neither")
        if ids.numel() == 0:
            return
        tag = ids.numpy().tobytes()
        if kv is not None:
            if ids.numel() > self.max_tail_tokens:
                return
            kv = [(k.contiguous().clone(), v.contiguous().clone()) for k, v in kv]
        self._drop((prefix.digest, tag))
        run = Run(ids.clone(), child, kv)
        self._runs[(prefix.digest, tag)] = (prefix, run)
        self._by_prefix.setdefault(prefix.digest, {})[tag] = run
        if kv is not None:
            self.tail_tokens += run.num_tokens
        self._shrink()

    def match(self, prefix: ChunkKey, ids: torch.Tensor, load: Callable[[ChunkKey], list[LayerKV] | None]
              ) -> list[Piece]:
        """The KV of the longest prefix of `ids` computed before right after `prefix`, as pieces in order (empty: no
        match). `load` reads a stored chunk's KV (None: dropped by the store; the run is forgotten)."""
        pieces: list[Piece] = []
        at, node = 0, prefix
        while at < ids.numel():
            runs = self._by_prefix.get(node.digest)
            if not runs:
                break
            rest = ids[at:]
            best, best_n = None, 0
            for run in runs.values():
                n = common_prefix(run.ids, rest)
                # on a tie prefer a whole stored chunk: the match can go on after it
                if n > best_n or (n == best_n and n and best is not None and best.child is None and run.child is not None):
                    best, best_n = run, n
            if best is None:
                break
            kv = best.kv if best.kv is not None else load(best.child)
            if kv is None:
                self._drop((node.digest, best.ids.numpy().tobytes()))
                continue
            self._runs.move_to_end((node.digest, best.ids.numpy().tobytes()))
            pieces.append(Piece(kv, best_n))
            at += best_n
            if best_n < best.num_tokens or best.child is None:
                break
            node = best.child
        return pieces

    def _drop(self, slot: tuple[str, bytes]) -> None:
        found = self._runs.pop(slot, None)
        if found is None:
            return
        runs = self._by_prefix.get(slot[0], {})
        run = runs.pop(slot[1], None)
        if not runs:
            self._by_prefix.pop(slot[0], None)
        if run is not None and run.kv is not None:
            self.tail_tokens -= run.num_tokens

    def _shrink(self) -> None:
        while len(self._runs) > self.max_runs or self.tail_tokens > self.max_tail_tokens:
            slot = next(iter(self._runs))
            if len(self._runs) <= self.max_runs:  # over the tail budget: drop the oldest tail
                slot = next((s for s, (_, r) in self._runs.items() if r.kv is not None), slot)
            self._drop(slot)
