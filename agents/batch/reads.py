"""What a task's window read: the chunks computed at their placement, and the order of chunks at each read.

A chunk's in-context KV depends on the chunks before it, so what a window computes is a
*placement*: a chunk after a given sequence of chunks (`agentwin.prefix`). The default window
(`patch="exact"`) computes a placement at the first read that needs it and keeps it in the store
under its placement key; a window on the same store that reads the same chunks in the same order
is served that KV (`WindowStats.exact_hits`), and one that finds another worker computing it
waits for its entry (`WindowStats.waited`, counted among the exact hits).

The window counts model forwards by kind, and one forward computes every chunk a read finds
waiting (a chat head and the first page together), so chunks are counted here instead:
`ReadLedger` wraps a task's decider and notes, at each decision (where the window is read), the
chunks the window holds, in order. An exact window holds each chunk's KV for the placement it had
at the last read until the chunk is evicted, so a read needs the placements it did not hold at
the last one: each is served from the store (an exact hit) or computed.

`ReadingScript` replays a task's scripted decisions after reading the window as a decision by the
model does (its next-token distribution after the prompt, with no decoding): an exact window runs
no forward until it is read, so without the read a scripted task would compute nothing.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Sequence

from agents.model import ScriptedDecider

ReadOrder = list[str]  # the content digests of the chunks one read held, in window order


class ReadingScript:
    """Scripted replies (`agents.model.ScriptedDecider`), each after one read of the window after
    the prompt; see the module docstring."""

    def __init__(self, replies: Iterable[str | dict]) -> None:
        self._script = ScriptedDecider(list(replies))

    def decide(self, window: Any, prompt: str) -> str:
        window.read(prompt)
        return self._script.decide(window, prompt)


class ReadLedger:
    """A decider that passes every call on to `decider` and notes what each read of the window held.

    counts: whether chunks are counted (an exact window: under the other policies a chunk is
    served approximately, or computed when appended, and `chunks_computed` is None). digests:
    whether `read_orders` is kept (text models: a chunk's digest is taken from its token ids,
    which for an image or frames are placeholders). A decision read the window when the window
    forwarded a query meanwhile; a read outside the decider (nothing this batch runs does that)
    makes the count unknown (None)."""

    def __init__(self, decider: Any, counts: bool, digests: bool) -> None:
        self._decider = decider
        self._counting = counts
        self._held: set[tuple[int, ...]] = set()  # placements held since the last read, as chunk-id prefixes
        self._needed = 0
        self._marks = (0, 0, 0, 0)  # the window's read counters when the last decision ended
        self.read_orders: list[ReadOrder] | None = [] if digests else None

    def __getattr__(self, name: str) -> Any:  # use_actions, avoid, observe, last: the decider's own
        return getattr(self._decider, name)

    def decide(self, window: Any, prompt: str) -> str:
        before = window.stats()
        if _marks(before) != self._marks:
            self._counting = False  # the window was read between two decisions
        order = list(window.chunks())
        digests = content_digests(window, order) if self.read_orders is not None else None
        queries, hits = before.forwards.get("query", 0), before.exact_hits
        reply = self._decider.decide(window, prompt)
        after = window.stats()
        if after.forwards.get("query", 0) > queries:
            self._read(order, after.exact_hits - hits, digests)
        self._marks = _marks(after)
        return reply

    def chunks_computed(self, stats: Any) -> int | None:
        """Chunks whose in-context KV the window computed at their placement, from the window's
        stats at the task's end: the placements its reads needed less those served from the store
        (`exact_hits`); None where this ledger does not count (see the class docstring)."""
        if not self._counting or _marks(stats) != self._marks:
            return None
        return self._needed - stats.exact_hits

    def _read(self, order: Sequence[int], exact_hits: int, digests: ReadOrder | None) -> None:
        placements = {tuple(order[:i + 1]) for i in range(len(order))}
        needed = len(placements - self._held)
        if self._counting and exact_hits > needed:
            raise RuntimeError(f"a read served {exact_hits} placements from the store but lacked only {needed}; "
                               "this indicates a bug")
        self._needed += needed
        self._held = placements
        if digests is not None:
            self.read_orders.append(digests)


def _marks(stats: Any) -> tuple[int, int, int, int]:
    """What changes when the window is read: forwards with a query or chunk rows, and exact hits."""
    forwards = stats.forwards
    return (forwards.get("query", 0), forwards.get("in_context", 0), forwards.get("recompute", 0), stats.exact_hits)


def content_digests(window: Any, order: Sequence[int]) -> ReadOrder:
    """A 16-hex-digit digest of each chunk's token ids (and its length), in `order`."""
    ids = window.input_ids()  # [T] int64: the chunks' ids, in window order
    out, at = [], 0
    for cid in order:
        n = window.chunk_tokens(cid)
        chunk = ids[at:at + n].numpy().astype("<i8").tobytes()
        out.append(hashlib.blake2b(n.to_bytes(8, "little") + chunk, digest_size=8).hexdigest())
        at += n
    return out


def placements_of(read_orders: Iterable[Sequence[str]]) -> set[tuple[str, ...]]:
    """The placements some read held: each chunk with the chunks before it, as a tuple of digests."""
    return {tuple(order[:i + 1]) for order in read_orders for i in range(len(order))}


def distinct_reads(records: Iterable[dict[str, Any]]) -> tuple[int, int] | None:
    """(distinct chunks, distinct placements) that the records' reads held (records of tasks that
    did not run have no `read_orders` and are skipped); None when a record's is None (a
    vision-language model, whose chunks this batch does not name)."""
    orders: list[Sequence[str]] = []
    for r in records:
        if "read_orders" not in r:
            continue
        if r["read_orders"] is None:
            return None
        orders += r["read_orders"]
    return len({d for order in orders for d in order}), len(placements_of(orders))
