"""What the window keeps per chunk (`ChunkRecord`), where a chunk sits (`Placement`), the KV it holds
there (`Held`), chunk ids, and the timer of its public operations."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NewType, Sequence

import torch

from agentwin.models.adapter import ChunkInput
from agentwin.models.kv import LayerKV
from agentwin.store import ChunkKey
from agentwin.window_stats import kv_nbytes
from kamera_core import patch as kp

ChunkId = NewType("ChunkId", int)


def timed(method):
    """Time a public operation into `stats.seconds[name]` and, at the outermost call only (an
    append's evictions are part of the append), into `stats.wall_s`."""
    name = method.__name__

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        t0, self._depth = time.perf_counter(), self._depth + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self._depth -= 1
            spent = time.perf_counter() - t0
            self._stats.seconds[name] += spent
            if self._depth == 0:
                self._stats.wall_s += spent
    return timed


def key_summary(kv: Sequence[LayerKV]) -> torch.Tensor:
    return torch.stack([k.float().mean(0).reshape(-1) for k, _ in kv])


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a chunk sits in the window's order: `prefix` is the placement key of everything before
    it (`agentwin.prefix`), `key` its own (the prefix that ends with it), `start` its first position
    (position units), `first` its first token index, `index` its place in the order."""

    prefix: ChunkKey
    key: ChunkKey
    start: int
    first: int
    index: int


@dataclass(slots=True)
class Held:
    """KV the window holds for a chunk: computed at placement `key` (its keys rotated for position
    `start`), token-major per layer. `exact`: computed after the model's own KV of every chunk
    before it (so it is the store's entry under `key`), not after KV served approximately."""

    key: ChunkKey
    start: int
    kv: list[LayerKV]
    exact: bool


@dataclass(slots=True)
class ChunkRecord:
    id: ChunkId
    key: ChunkKey
    inputs: ChunkInput  # a TextChunk or a VisionChunk
    ids: torch.Tensor  # (T,)
    span: int  # position units
    slot: int  # index in the window when last present (recall's default place)
    origin: tuple[ChunkKey, ...] | None = None  # antecedent keys at its first pass (None: never computed)
    summary: torch.Tensor | None = None  # [layers, width] mean keys in the chunk-local frame, for retrieval
    neighbour: torch.Tensor | None = None  # the summary of the chunk right before it at its origin
    last: tuple[ChunkKey, int] | None = None  # placement key and start of its last exact KV (in the store)
    computed_at: int = 0  # the window's eviction count when its KV was last computed
    # Held only while the chunk is in the window (dropped at evict):
    held: Held | None = None  # its KV at the placement it was last computed or served for
    canonical: list[LayerKV] | None = None  # patch policies: the store's tensors, chunk-local frame
    patches: dict[tuple[ChunkKey, ...], kp.ChunkPatch] = field(default_factory=dict)
    served: ChunkKey | None = None  # placement last served approximately (for counting relocations)
    pixels_key: ChunkKey | None = None  # evicted vision chunk: its pixels are in the store under this key


@dataclass(frozen=True)
class ChunkView:
    """A read-only look at one chunk (`Window.inspect`): its content `key` and tokens, whether it
    is in the window, and the KV the window holds for it now: in-context `kv` computed with its
    first position at `start` (None when it holds none), and for the patch policies its
    `canonical` KV (chunk-local frame) and `patches` by antecedent (content keys of the chunks
    before it). The tensors are the window's own: read them, do not write them."""

    id: ChunkId
    key: ChunkKey
    ids: torch.Tensor
    in_window: bool
    kv: list[LayerKV] | None
    start: int | None
    canonical: list[LayerKV] | None
    patches: Mapping[tuple[ChunkKey, ...], kp.ChunkPatch]

    @classmethod
    def of(cls, c: ChunkRecord, in_window: bool) -> ChunkView:
        return cls(c.id, c.key, c.ids, in_window, c.held.kv if c.held else None, c.held.start if c.held else None,
                   c.canonical, MappingProxyType(dict(c.patches)))

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())


def check_invariants(order: Sequence[ChunkId], chunks: dict, pinned: set, layers: int) -> None:
    """RuntimeError when the window's bookkeeping is broken (indicates a bug): a chunk twice in the
    order, an unknown or unpinned-but-pinned chunk, an evicted chunk still holding KV, or KV whose
    layers or tokens do not match its chunk."""
    if len(set(order)) != len(order):
        raise RuntimeError("a chunk appears twice in the window; this indicates a bug")
    if not set(order) <= set(chunks):
        raise RuntimeError("the window holds an unknown chunk; this indicates a bug")
    if not pinned <= set(order):
        raise RuntimeError("a pinned chunk is not in the window; this indicates a bug")
    for c in chunks.values():
        held = [kv for kv in (c.canonical, c.held.kv if c.held else None) if kv is not None]
        if c.id not in order and (held or c.patches):
            raise RuntimeError(f"evicted chunk {c.id} still holds KV; this indicates a bug")
        for kv in held:
            if len(kv) != layers or kv[0][0].shape[0] != c.ids.numel():
                raise RuntimeError(f"chunk {c.id} KV does not match its tokens; this indicates a bug")


def held_bytes(chunks: Sequence[ChunkRecord]) -> int:
    """KV and patch bytes these chunks reference: canonical KV, in-context KV, patches."""
    return sum(kv_nbytes(c.canonical) + (kv_nbytes(c.held.kv) if c.held else 0)
               + sum(p.nbytes for p in c.patches.values()) for c in chunks)


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
