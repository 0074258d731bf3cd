"""Eviction policies, which unpinned chunks the window's budget drops first: `Fifo`, `Lru` and `Relevant` (least
relevant to a target, `Window.relevant_to`), behind `Fifo`'s interface; `make_eviction` builds one by name."""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence


class Fifo:
    """Oldest in window order first."""

    name = "fifo"

    def used(self, chunk: Hashable) -> None:
        """A chunk was appended, recalled or touched (FIFO ignores it)."""

    def left(self, chunk: Hashable) -> None:
        """A chunk left the window."""

    def ranked(self, order: Sequence[Hashable]) -> list[Hashable]:
        """The window's chunks, first to go first."""
        return list(order)

    def plan(self, order: Sequence[Hashable], sizes: Mapping[Hashable, int], pinned: set, incoming: int,
             budget: int) -> list[Hashable]:
        """Chunks to evict, not in `pinned`, in `ranked` order, until `incoming` more tokens fit within `budget`
        (sizes in tokens). ValueError, nothing changed, when the pinned chunks leave too little room."""
        excess = sum(sizes[c] for c in order) + incoming - budget
        victims = []
        for chunk in self.ranked([c for c in order if c not in pinned]):
            if excess <= 0:
                break
            victims.append(chunk)
            excess -= sizes[chunk]
        if excess > 0:
            raise ValueError(f"no room for {incoming} more tokens within budget_tokens={budget}: "
                             "the pinned (or kept) chunks take the rest; unpin one or raise the budget")
        return victims


class Lru(Fifo):
    """Least recently used first (appended, recalled or touched)."""

    name = "lru"

    def __init__(self) -> None:
        self._tick = 0
        self._used: dict[Hashable, int] = {}  # chunk -> tick of its last use

    def used(self, chunk: Hashable) -> None:
        self._tick += 1
        self._used[chunk] = self._tick

    def left(self, chunk: Hashable) -> None:
        self._used.pop(chunk, None)

    def ranked(self, order: Sequence[Hashable]) -> list[Hashable]:
        return sorted(order, key=lambda c: self._used.get(c, 0))


class Relevant(Fifo):
    """Least relevant first by `score(order)` (higher is kept longer), ties in window order; FIFO until `target`."""

    name = "relevant"

    def __init__(self) -> None:
        self.score: Callable[[Sequence[Hashable]], Mapping[Hashable, float]] | None = None

    def target(self, score: Callable[[Sequence[Hashable]], Mapping[Hashable, float]] | None) -> None:
        """Rank by `score` from now on (None: FIFO again)."""
        self.score = score

    def ranked(self, order: Sequence[Hashable]) -> list[Hashable]:
        if self.score is None or not order:
            return list(order)
        scores = self.score(order)
        return [c for _, c in sorted(enumerate(order), key=lambda ic: (scores[ic[1]], ic[0]))]


EVICTIONS = {"fifo": Fifo, "lru": Lru, "relevant": Relevant}


def make_eviction(name: str) -> Fifo:
    """The eviction policy `name` ("fifo", "lru" or "relevant"); ValueError names the choices."""
    if name not in EVICTIONS:
        raise ValueError(f"evict must be one of {tuple(EVICTIONS)}, got {name!r}")
    return EVICTIONS[name]()
