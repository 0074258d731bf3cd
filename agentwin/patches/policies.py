"""Placement policies: what a chunk gets at a placement whose own KV the window does not hold.

One object per policy (`Window(patch=...)`), behind `place` (approximate KV for the placement,
or None to compute it there) and `passed` (told of each pass the window ran); it sees the window
only through the `Host` it is lent (`agentwin.patches.host`):
- `exact` (the default): compute it after the chunks before it, as a re-prefill;
- `survive`: the chunk's KV from its last placement, moved by RoPE re-rotation (StreamingLLM-style);
  `refresh`: survival, with the survivors near a change or too many evictions old recomputed;
- the patch policies serve canonical KV (the chunk encoded alone) plus a low-rank antecedent
  patch: `none` (blind reuse, no patch), `origin` (the patch fitted at the chunk's first pass),
  `fresh` (a pass and a fit for every new antecedent), and the stale-patch guards
  `origin-similar` and `origin-akin`, which serve the origin patch only while it still describes
  what is before the chunk (`origin_holds`, key-summary cosines) and blind reuse otherwise.
A chunk at the front of the window never takes a patch: its canonical KV is exact there.
"""

from __future__ import annotations

from typing import Any, Sequence

from agentwin.models.kv import LayerKV
from agentwin.patches.fit import fit_patch
from agentwin.patches.host import Approx, Fallback, Host, Probed
from kamera_core.metrics import layer_cosine

DEFAULT_POLICY = "exact"
# The patch policy the benchmarks take when none is named (chosen on `agentwin bench fidelity`'s validation split).
DEFAULT_PATCH_POLICY = "origin-akin"


class Exact:
    """Compute every placement the window does not hold (the default)."""

    name = "exact"
    patches = False  # whether passes fit patches (and canonical KV is encoded) for later placements
    eager = False  # whether append runs the chunk's first pass at once (else the next read does)
    placed = True  # whether in-context KV is kept and served by placement key (`agentwin.prefix`)

    def place(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        return None

    def passed(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence, kv: list[LayerKV],
               probed: Probed | None, first_pass: bool) -> None:
        """The window computed `chunk` at `pl` (its first pass when `first_pass`)."""


class Survive(Exact):
    """A chunk computed before keeps that KV, moved to its new start by RoPE re-rotation with no
    repair (as StreamingLLM keeps its window's KV): what it read from chunks that left stays in it."""

    name = "survive"

    def place(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        earlier = host.earlier(chunk)
        if earlier is None:
            return None
        return Approx(earlier.kv, pl.start - earlier.start)


class Refresh(Survive):
    """Survival with a repair: a survivor is recomputed when it starts within `near_tokens` tokens
    after the first token whose KV changed (the first survivors after a change are off most), or
    when `max_age` or more evictions happened since its KV was computed. near_tokens=0 and
    max_age=None is `Survive`; max_age=1 is `Exact`."""

    name = "refresh"

    def __init__(self, near_tokens: int = 128, max_age: int | None = 4) -> None:
        if isinstance(near_tokens, bool) or not isinstance(near_tokens, int) or near_tokens < 0:
            raise ValueError(f"near_tokens must be a non-negative int, got {near_tokens!r}")
        if max_age is not None and (isinstance(max_age, bool) or not isinstance(max_age, int) or max_age < 1):
            raise ValueError(f"max_age must be a positive int or None, got {max_age!r}")
        self.near_tokens, self.max_age = near_tokens, max_age

    def __repr__(self) -> str:
        return f"Refresh(near_tokens={self.near_tokens}, max_age={self.max_age})"

    def place(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        changed = host.changed_at  # token index of the first chunk this read could not serve as computed
        if changed is None or pl.first - changed < self.near_tokens:
            return None
        age = host.stats.evictions - chunk.computed_at
        if self.max_age is not None and age >= self.max_age:
            return None
        return super().place(host, chunk, pl, antecedent_ids)


class PatchPolicy(Exact):
    """Base of the patch policies: the first placement computed, later ones canonical KV plus the
    patch stored for that antecedent, else the origin patch (with exact patches: a pass)."""

    name = ""
    patches = True
    eager = True  # the origin patch is fitted from the pass after the chunks it was appended behind
    placed = False  # away from its own placement a chunk is canonical KV + patch, never stored in-context KV

    def place(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        if not antecedent_ids:  # canonical KV is the chunk's own prefill at the front
            if chunk.origin is None:
                self.originate(host, chunk, ())
            return Approx(host.canonical(chunk), pl.start, exact=pl.start == 0)
        antecedent = host.keys(antecedent_ids)
        found = host.io.stored_patch(chunk, antecedent)
        if found is not None:  # fitted here before (by this window or another on the store)
            if chunk.origin is None:
                self.originate(host, chunk, antecedent_ids)
            host.stats.patch_hits += 1
            return Approx(host.canonical(chunk), pl.start, found)
        if chunk.origin is None:
            return None  # its first pass: the patch is fitted from it
        host.stats.patch_misses += 1
        if self.computes(host):
            return None
        served = self.unseen(host, chunk, antecedent_ids)
        return Approx(host.canonical(chunk), pl.start, served.patch, stale=served.stale)

    def originate(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> None:
        """The chunk's first placement: its origin (the antecedent its origin patch is for) and the
        key summary of its neighbour there."""
        chunk.origin = host.keys(antecedent_ids)
        chunk.neighbour = host.summary(host.chunk(antecedent_ids[-1])) if antecedent_ids else None
        if not antecedent_ids:
            self.measured(host, chunk, (), None)

    def computes(self, host: Host) -> bool:
        """Whether an antecedent with no stored patch is computed (a pass) instead of approximated."""
        return host.settings.rank is None

    def unseen(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> Fallback:
        """What serves an antecedent with no stored patch: the origin patch, stale."""
        patch = host.io.stored_patch(chunk, chunk.origin) if chunk.origin else None
        return Fallback(patch, patch is not None)

    def passed(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence, kv: list[LayerKV],
               probed: Probed | None, first_pass: bool) -> None:
        """Canonical KV (the pass itself at the front) and the patch for this antecedent."""
        if first_pass:
            chunk.neighbour = host.summary(host.chunk(antecedent_ids[-1])) if antecedent_ids else None
        if not antecedent_ids and pl.start == 0:
            if chunk.canonical is None:
                chunk.canonical = host.io.load_canonical(chunk.key, int(chunk.ids.numel())) or \
                    host.io.put_canonical(chunk, kv)
            self.measured(host, chunk, (), None)
            return
        if not antecedent_ids:
            return
        antecedent = host.keys(antecedent_ids)
        if host.io.stored_patch(chunk, antecedent) is None:
            patch = fit_patch(host, chunk, kv, pl.start, probed,
                              lambda deltas: self.measured(host, chunk, antecedent, deltas))
            host.io.keep_patch(chunk, antecedent, patch)

    def measured(self, host: Host, chunk: Any, antecedent: tuple, deltas: Sequence | None) -> None:
        """A deficit of `chunk` after `antecedent` was measured (None: the chunk first, zero)."""


class Blind(PatchPolicy):
    """Blind reuse: every placement is the chunk's canonical KV moved there, never a pass."""

    name, patches = "none", False

    def place(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        first = chunk.origin is None
        if first:
            chunk.origin = host.keys(antecedent_ids)
        return Approx(host.canonical(chunk), pl.start, exact=not antecedent_ids and pl.start == 0, first=first)

    def passed(self, *args: Any) -> None:
        pass


class Origin(PatchPolicy):
    name = "origin"


def origin_holds(keys: tuple, origin: tuple) -> bool:
    """Whether a chunk's origin patch still describes what is before it (`keys`, in order): the same
    chunk right before it as at its origin, or every chunk of its origin antecedent still before it."""
    return keys[-1:] == origin[-1:] or set(origin) <= set(keys)


# The least key-summary cosine between a chunk's neighbour now and at its origin for `origin-similar` to serve the
# origin patch (chosen on `agentwin bench fidelity`'s validation traces).
SIMILAR = 0.95


class OriginSimilar(PatchPolicy):
    """The origin patch where it still holds (`origin_holds`) or after a new neighbour whose key
    summary (`Window.key_summary`) is within cosine `threshold` of the old neighbour's; blind reuse
    otherwise. No forward: the summaries are kept."""

    name = "origin-similar"

    def __init__(self, threshold: float = SIMILAR) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1 <= threshold <= 1:
            raise ValueError(f"threshold must be a cosine in [-1, 1], got {threshold!r}")
        self.threshold = float(threshold)

    def similarity(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> float:
        """Key-summary cosine of the chunk's neighbour now and at its origin; -1 when it had none."""
        if chunk.neighbour is None or not antecedent_ids:
            return -1.0
        now = host.summary(host.chunk(antecedent_ids[-1]))
        return float(layer_cosine(now, chunk.neighbour[None])[0])

    def declines(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> bool:
        """Whether the origin patch is withheld (blind reuse) after `antecedent_ids`."""
        return (self.moved(host, chunk, antecedent_ids)
                and self.similarity(host, chunk, antecedent_ids) < self.threshold)

    @staticmethod
    def moved(host: Host, chunk: Any, antecedent_ids: Sequence) -> bool:
        """Whether the chunk's origin antecedent no longer holds (`origin_holds`)."""
        return bool(chunk.origin) and not origin_holds(host.keys(antecedent_ids), chunk.origin)

    def unseen(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> Fallback:
        if self.declines(host, chunk, antecedent_ids):
            return Fallback(None, False)
        return super().unseen(host, chunk, antecedent_ids)


def serves_akin(similarity: float, own: float, threshold: float = SIMILAR) -> bool:
    """`origin-akin`'s test behind a new neighbour: its key-summary cosine with the old one
    (`similarity`) is at least `threshold`, or at least the chunk's own cosine with it (`own`)."""
    return similarity >= threshold or similarity >= own


class OriginAkin(OriginSimilar):
    """`origin-similar`, and the origin patch also behind a new neighbour at least as close to the
    old one as the chunk itself is (`serves_akin`): the chunk's own cosine is a yardstick that
    moves with the model, whose cosines between unrelated texts can sit anywhere."""

    name = "origin-akin"

    def own_similarity(self, host: Host, chunk: Any) -> float:
        """Cosine of the chunk's own key summary with its neighbour's at its origin; 2 (never
        reached) when it had none."""
        if chunk.neighbour is None:
            return 2.0
        return float(layer_cosine(host.summary(chunk), chunk.neighbour[None])[0])

    def declines(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> bool:
        return (self.moved(host, chunk, antecedent_ids)
                and not serves_akin(self.similarity(host, chunk, antecedent_ids), self.own_similarity(host, chunk),
                                    self.threshold))


class Fresh(PatchPolicy):
    name = "fresh"

    def computes(self, host: Host) -> bool:
        return True


POLICY_TYPES = {p.name: p for p in (Exact, Survive, Refresh, Blind, Origin, Fresh, OriginSimilar, OriginAkin)}
POLICIES = tuple(POLICY_TYPES)
PATCH_POLICIES = tuple(name for name, p in POLICY_TYPES.items() if issubclass(p, PatchPolicy))  # canonical KV + patch
