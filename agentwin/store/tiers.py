"""In-memory tiers (host RAM, an optional accelerator): an LRU of `Entry` under a byte budget (tensor bytes).
Pins belong to the RAM tier: a pinned entry is never a victim."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# The tensor dtypes an entry may hold (every tier: disk, remote and RAM check the same list).
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}

Tensor = torch.Tensor


class CorruptEntryWarning(RuntimeWarning):
    """A disk or remote entry failed verification (or named another owner): deleted and read as a miss, so the caller
    recomputes it. Issued once per tier and entry in a process."""


def tensors_nbytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass(frozen=True, slots=True)
class Entry:
    """One cached entry: `tensors` (contiguous, on the tier's device), `meta_json` (canonical JSON of the meta
    dict) and `nbytes`, the tensors' total bytes."""

    tensors: dict[str, Tensor]
    meta_json: str
    nbytes: int


class MemoryTier:
    """LRU (least recently used first) of `Entry` by digest, never above `budget` bytes."""

    def __init__(self, name: str, budget: int, device: torch.device) -> None:
        self.name, self.budget, self.device = name, budget, device
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.pinned: set[str] = set()
        self.bytes = 0

    def __contains__(self, digest: str) -> bool:
        return digest in self.entries

    def get(self, digest: str, touch: bool = True) -> Entry | None:
        e = self.entries.get(digest)
        if e is not None and touch:
            self.entries.move_to_end(digest)
        return e

    def victims(self, nbytes: int, replacing: str | None = None) -> list[str] | None:
        """Unpinned digests, least recently used first, whose removal makes room for `nbytes` more (besides
        `replacing`'s own entry); None when pins or the budget make that impossible. Changes nothing."""
        held = self.bytes - (self.entries[replacing].nbytes if replacing in self.entries else 0)
        excess = held + nbytes - self.budget
        out: list[str] = []
        for d, e in self.entries.items():
            if excess <= 0:
                break
            if d == replacing or d in self.pinned:
                continue
            out.append(d)
            excess -= e.nbytes
        return out if excess <= 0 else None

    def pinned_bytes(self, excluding: str | None = None) -> int:
        return sum(self.entries[d].nbytes for d in self.pinned if d != excluding)

    def insert(self, digest: str, entry: Entry) -> None:
        """Adds (or replaces) `digest` as most recently used; the caller made room first."""
        self.remove(digest, unpin=False)
        if self.bytes + entry.nbytes > self.budget:
            raise RuntimeError(f"{self.name} tier insert over budget ({self.bytes} + {entry.nbytes} > "
                               f"{self.budget}); this indicates a bug")
        self.entries[digest] = entry
        self.bytes += entry.nbytes

    def remove(self, digest: str, unpin: bool = True) -> Entry | None:
        e = self.entries.pop(digest, None)
        if e is not None:
            self.bytes -= e.nbytes
        if unpin:
            self.pinned.discard(digest)
        return e

    def check(self) -> None:
        """RuntimeError when an invariant is broken (budget, byte count, pins, placement)."""
        total = 0
        for d, e in self.entries.items():
            actual = tensors_nbytes(e.tensors)
            if actual != e.nbytes:
                raise RuntimeError(f"{self.name} entry {d[:16]} records {e.nbytes} bytes but holds {actual}; "
                                   "this indicates a bug")
            for name, t in e.tensors.items():
                if t.device != self.device or not t.is_contiguous():
                    raise RuntimeError(f"{self.name} entry {d[:16]} tensor {name!r} is on {t.device} "
                                       f"(contiguous={t.is_contiguous()}); this indicates a bug")
            total += e.nbytes
        if total != self.bytes or self.bytes > self.budget:
            raise RuntimeError(f"{self.name} tier holds {total} bytes, counts {self.bytes}, budget {self.budget}; "
                               "this indicates a bug")
        if not self.pinned <= set(self.entries):
            raise RuntimeError(f"{self.name} tier pins entries it does not hold; this indicates a bug")


def prepare_tensors(tensors: object) -> dict[str, Tensor]:
    """Contiguous CPU copies of `tensors` (NaN/inf allowed: it is data), validated."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of str names to torch.Tensor, got {type(tensors).__name__}")
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor names must be non-empty strings other than '__metadata__', got {name!r}")
        if not isinstance(t, Tensor):
            raise TypeError(f"tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided or t.is_quantized:
            raise TypeError(f"tensors[{name!r}] must be a dense tensor, got layout {t.layout}")
        if t.dtype not in DTYPES.values():
            raise TypeError(f"tensors[{name!r}] has dtype {t.dtype}; supported: {sorted(DTYPES)}")
        t = t.detach()
        out[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)  # contiguous copy
    return out
