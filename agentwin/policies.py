"""Placement policies: what a chunk gets at a placement whose own KV the window does not have.

The window first serves a chunk's in-context KV for its very placement where it holds it (and,
for the exact and survive policies, where the store keeps it by placement key, `agentwin.window`);
only a placement without it comes here. One small object per policy behind
one interface (`place`: approximate KV for the placement, or None to compute it there; `passed`:
told of each pass the window ran), chosen by `Window(patch=...)`:
- `exact` (`Exact`, the default): compute it, after the chunks before it: the window then
  reproduces a re-prefill;
- `survive` (`Survive`): the chunk's KV from its last placement, moved by RoPE re-rotation
  (StreamingLLM-style survival: what it read before stays in it);
- `refresh` (`Refresh`): survival with a repair: the survivors near a change, and those too many
  evictions old, are recomputed (`Refresh(near_tokens, max_age)` sets both);
- `none` (`Blind`): blind reuse, the chunk's canonical KV (encoded alone) only, never a pass;
- `origin` (`Origin`): canonical KV plus the patch fitted at the chunk's first pass, as an
  approximation; `orbit` (`OrbitPolicy`): the fit of the chunk's mean deficit over every
  antecedent measured; `fresh` (`Fresh`): a pass (and a patch fit) for every new antecedent;
- `origin-neighbour` (`OriginNeighbour`): the origin patch only after the same last chunk as at
  its origin, else blind reuse; `origin-present` (`OriginPresent`): the origin patch only while
  every chunk before it at its origin is before it still, else blind reuse; `origin-either`
  (`OriginEither`): the origin patch where either holds; `origin-similar` (`OriginSimilar`): as
  `origin-either`, and also after a new neighbour whose key summary is close to the one it had at
  its origin (cosine of mean canonical keys at least `SIMILAR`, no forward); `origin-akin`
  (`OriginAkin`): as `origin-similar`, and also behind a new neighbour at least as close to the
  old one as the chunk's own summary is. Stale-patch guards; `agentwin bench fidelity` and
  `agentwin bench eval` measure them (docs/results/FIDELITY.md).
The patch policies compute a chunk's first placement (its in-context pass, from which its patch
is fitted) and, with exact patches (`rank=None`), every new placement. A chunk at the front of
the window never takes a patch: its canonical KV is exact there (an origin patch there reads far
worse than none after a slide: the first token stops acting as the attention sink).

The policies read the window's chunk records and call its store access (`_io`), `_hold`
(canonical KV) and `_earlier_kv`; they are part of the window, split out so that each policy is
read in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from agentwin.models.kv import LayerKV, relocate_kv
from agentwin.orbit import Orbit
from agentwin.window_fit import budget_bytes, fit_patch, layer_ranks, one_rank_storage
from kamera_core import patch as kp
from kamera_core.metrics import layer_cosine


class Window(Protocol):
    """What a placement policy reads and calls of the window it serves (`agentwin.window.Window`
    passes itself): the model, the patch settings, the chunk records and their order, the store
    access, the canonical KV of a chunk, the forward counts. Declared here so that this module
    never imports the window's."""

    km: Any
    rank: int | str | None
    storage: str
    _chunks: dict
    _order: list
    _io: Any
    _stats: Any
    _changed_at: int | None

    def _keys(self, order: Sequence) -> tuple: ...
    def _hold(self, chunk: Any) -> list[LayerKV]: ...
    def _earlier_kv(self, chunk: Any) -> tuple[list[LayerKV], int] | None: ...
    def _summary(self, chunk: Any) -> torch.Tensor: ...


DEFAULT_POLICY = "exact"
# The patch policy the patch studies and `agentwin bench fidelity` take when none is named: chosen
# there among the stale-patch guards on validation (docs/results/FIDELITY.md).
DEFAULT_PATCH_POLICY = "origin-akin"


@dataclass(frozen=True, slots=True)
class Approx:
    """KV served at a placement without computing it there: `kv` token-major per layer in the
    frame its keys were rotated for, placed by `shift` positions, plus `patch` (in that frame) or
    None. `exact`: it is the model's own KV there all the same (canonical KV at the front);
    `stale`: a patch fitted after another antecedent than the one the chunk has now."""

    kv: Sequence[LayerKV]
    shift: int
    patch: kp.ChunkPatch | None = None
    exact: bool = False
    stale: bool = False
    first: bool = False  # the chunk's first placement, its KV computed (encoded) for it: not a relocation


class Exact:
    """Compute every placement the window does not hold (the default)."""

    name = "exact"
    patches = False  # whether passes fit patches (and canonical KV is encoded) for later placements
    eager = False  # whether append runs the chunk's first pass at once (else the next read does)
    placed = True  # whether in-context KV is kept and served by placement key (`agentwin.prefix`)

    def place(self, window: Window, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        return None

    def passed(self, window: Window, chunk: Any, pl: Any, antecedent_ids: Sequence, kv: list[LayerKV],
               probed: tuple | None, first_pass: bool) -> None:
        """The window computed `chunk` at `pl` (its first pass when `first_pass`)."""


class Survive(Exact):
    """A chunk computed before keeps that KV when the chunks before it change: it is moved to its
    new start by RoPE re-rotation (exact algebra) with no repair, as StreamingLLM keeps the KV of
    the tokens that stay in its window. What it read from chunks that left stays in it."""

    name = "survive"

    def place(self, window: Window, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        earlier = window._earlier_kv(chunk)
        if earlier is None:
            return None
        kv, start = earlier
        return Approx(kv, pl.start - start)


class Refresh(Survive):
    """Survival with a repair: after a change in front of them (a chunk evicted, recalled or
    moved), the survivors near the change are recomputed and the rest keep their KV re-rotated,
    until they are too old. A survivor is recomputed when it starts within `near_tokens` tokens
    after the first token whose KV changed (the KV a change moves most: the first survivors after
    a slide are off most, later ones less), or when
    `max_age` or more evictions happened since its KV was computed (slides batched: every survivor
    is recomputed once per `max_age` evictions). near_tokens=0 and max_age=None is `Survive`;
    max_age=1 is `Exact`."""

    name = "refresh"

    def __init__(self, near_tokens: int = 128, max_age: int | None = 4) -> None:
        if isinstance(near_tokens, bool) or not isinstance(near_tokens, int) or near_tokens < 0:
            raise ValueError(f"near_tokens must be a non-negative int, got {near_tokens!r}")
        if max_age is not None and (isinstance(max_age, bool) or not isinstance(max_age, int) or max_age < 1):
            raise ValueError(f"max_age must be a positive int or None, got {max_age!r}")
        self.near_tokens, self.max_age = near_tokens, max_age

    def __repr__(self) -> str:
        return f"Refresh(near_tokens={self.near_tokens}, max_age={self.max_age})"

    def place(self, window: Window, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        changed = window._changed_at  # token index of the first chunk this read could not serve as computed
        if changed is None or pl.first - changed < self.near_tokens:
            return None
        age = window._stats.evictions - chunk.computed_at
        if self.max_age is not None and age >= self.max_age:
            return None
        return super().place(window, chunk, pl, antecedent_ids)


class PatchPolicy(Exact):
    """Base of the patch policies: the first placement computed, later ones served as canonical
    KV plus the patch stored for that antecedent, else the origin patch (or, with exact patches,
    a pass)."""

    name = ""
    patches = True
    eager = True  # the origin patch is fitted from the pass after the chunks it was appended behind
    # A chunk away from the placement it holds KV for is served as canonical KV + patch, as these
    # policies are measured (`agentwin bench fidelity`, the patch studies), never from in-context
    # KV kept by placement.
    placed = False

    def place(self, window: Window, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        if not antecedent_ids:  # canonical KV is the chunk's own prefill at the front
            if chunk.origin is None:
                self.originate(window, chunk, ())
            return Approx(window._hold(chunk), pl.start, exact=pl.start == 0)
        antecedent = window._keys(antecedent_ids)
        found = window._io.stored_patch(chunk, antecedent)
        if found is not None:  # fitted here before (by this window or another on the store)
            if chunk.origin is None:
                self.originate(window, chunk, antecedent_ids)
            window._stats.patch_hits += 1
            return Approx(window._hold(chunk), pl.start, found)
        if chunk.origin is None:
            return None  # its first pass: the patch is fitted from it
        window._stats.patch_misses += 1
        if self.computes(window):
            return None
        patch, stale = self.unseen(window, chunk, antecedent_ids)
        return Approx(window._hold(chunk), pl.start, patch, stale=stale)

    def originate(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> None:
        """The chunk's first placement: its origin (the antecedent its origin patch is for) and the
        key summary of its neighbour there."""
        chunk.origin = window._keys(antecedent_ids)
        chunk.neighbour = window._summary(window._chunks[antecedent_ids[-1]]) if antecedent_ids else None
        if not antecedent_ids:
            self.measured(window, chunk, (), None)

    def computes(self, window: Window) -> bool:
        """Whether an antecedent with no stored patch is computed (a pass) instead of approximated."""
        return window.rank is None

    def unseen(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> tuple[kp.ChunkPatch | None, bool]:
        """(patch, stale) for an antecedent with no stored patch: the origin patch, stale."""
        patch = window._io.stored_patch(chunk, chunk.origin) if chunk.origin else None
        return patch, patch is not None

    def passed(self, window: Window, chunk: Any, pl: Any, antecedent_ids: Sequence, kv: list[LayerKV],
               probed: tuple | None, first_pass: bool) -> None:
        """Canonical KV (the pass itself at the front) and the patch for this antecedent."""
        if first_pass:
            chunk.neighbour = window._summary(window._chunks[antecedent_ids[-1]]) if antecedent_ids else None
        if not antecedent_ids and pl.start == 0:
            if chunk.canonical is None:
                chunk.canonical = window._io.load_canonical(chunk.key, int(chunk.ids.numel())) or \
                    window._io.put_canonical(chunk, kv)
            self.measured(window, chunk, (), None)
            return
        if not antecedent_ids:
            return
        antecedent = window._keys(antecedent_ids)
        if window._io.stored_patch(chunk, antecedent) is None:
            window._io.keep_patch(chunk, antecedent, fit_patch(window, chunk, antecedent, kv, pl.start, probed))

    def measured(self, window: Window, chunk: Any, antecedent: tuple, deltas: Sequence | None) -> None:
        """A deficit of `chunk` after `antecedent` was measured (None: the chunk first, zero)."""


class Blind(PatchPolicy):
    """Blind reuse: every placement is the chunk's canonical KV moved there, never a pass."""

    name, patches = "none", False

    def place(self, window: Window, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        first = chunk.origin is None
        if first:
            chunk.origin = window._keys(antecedent_ids)
        return Approx(window._hold(chunk), pl.start, exact=not antecedent_ids and pl.start == 0, first=first)

    def passed(self, *args: Any) -> None:
        pass


class Origin(PatchPolicy):
    name = "origin"


class OriginNeighbour(PatchPolicy):
    """The origin patch only where the chunk right before is the one that was right before it at
    its origin (the antecedents share a last chunk); blind reuse after any other neighbour."""

    name = "origin-neighbour"

    def unseen(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> tuple[kp.ChunkPatch | None, bool]:
        if not chunk.origin or window._keys(antecedent_ids[-1:]) != chunk.origin[-1:]:
            return None, False
        return super().unseen(window, chunk, antecedent_ids)


class OriginPresent(PatchPolicy):
    """The origin patch only where every chunk that was before the chunk at its origin is before
    it now (in any order, with others); blind reuse when one of them has left the window."""

    name = "origin-present"

    def unseen(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> tuple[kp.ChunkPatch | None, bool]:
        if not set(chunk.origin) <= set(window._keys(antecedent_ids)):
            return None, False
        return super().unseen(window, chunk, antecedent_ids)


class OriginEither(PatchPolicy):
    """The origin patch where either test above passes: the same chunk right before it as at its
    origin, or every chunk of its origin antecedent still before it; blind reuse when its
    neighbour changed and part of its origin antecedent has left the window."""

    name = "origin-either"

    def declines(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> bool:
        """Whether the origin patch is withheld (blind reuse) after `antecedent_ids`."""
        keys = window._keys(antecedent_ids)
        return bool(chunk.origin) and keys[-1:] != chunk.origin[-1:] and not set(chunk.origin) <= set(keys)

    def unseen(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> tuple[kp.ChunkPatch | None, bool]:
        if self.declines(window, chunk, antecedent_ids):
            return None, False
        return super().unseen(window, chunk, antecedent_ids)


# The least key-summary cosine between a chunk's neighbour now and its neighbour at its origin for
# `origin-similar` to serve the origin patch. Chosen on the validation traces of `agentwin bench
# fidelity` from 0.9, 0.95, 0.98, 0.995 (docs/results/FIDELITY.md): the lowest value that kept no
# patch worse than blind reuse behind an unrelated new neighbour.
SIMILAR = 0.95


class OriginSimilar(OriginEither):
    """`origin-either`, and the origin patch also after a new neighbour whose key summary
    (`Window.key_summary`: mean canonical keys per layer) is within cosine `threshold` of the
    neighbour's at the chunk's origin: a patch fitted after one page still serves after the next
    page, not after unrelated text. Blind reuse otherwise. No forward: the summaries are kept."""

    name = "origin-similar"

    def __init__(self, threshold: float = SIMILAR) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1 <= threshold <= 1:
            raise ValueError(f"threshold must be a cosine in [-1, 1], got {threshold!r}")
        self.threshold = float(threshold)

    def similarity(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> float:
        """Cosine (`layer_cosine`) of the key summaries of the chunk's neighbour now and at its
        origin; -1 when it had none."""
        if chunk.neighbour is None or not antecedent_ids:
            return -1.0
        now = window._summary(window._chunks[antecedent_ids[-1]])
        return float(layer_cosine(now, chunk.neighbour[None])[0])

    def declines(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> bool:
        return (super().declines(window, chunk, antecedent_ids)
                and self.similarity(window, chunk, antecedent_ids) < self.threshold)


def serves_akin(similarity: float, own: float, threshold: float = SIMILAR) -> bool:
    """`origin-akin`'s test for a stale patch behind a new neighbour: the new neighbour's key
    summary is within cosine `threshold` of the old one's (`similarity`), or at least as close to
    it as the chunk's own summary is (`own`): the new antecedent resembles the old one no less
    than the chunk itself does, a scale each model sets for itself."""
    return similarity >= threshold or similarity >= own


class OriginAkin(OriginSimilar):
    """`origin-similar`, and the origin patch also behind a new neighbour at least as close to
    the old neighbour (key-summary cosine) as the chunk itself is (`serves_akin`). A model's
    cosines between unrelated texts can sit anywhere (high on one model, low on another, where
    a patch can still help behind a dissimilar list). The chunk's own cosine with its old neighbour is the
    yardstick that moves with the model. No forward: the summaries are kept."""

    name = "origin-akin"

    def own_similarity(self, window: Window, chunk: Any) -> float:
        """Cosine of the chunk's own key summary with its neighbour's at its origin; 2 (never
        reached) when it had none."""
        if chunk.neighbour is None:
            return 2.0
        return float(layer_cosine(window._summary(chunk), chunk.neighbour[None])[0])

    def declines(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> bool:
        return (OriginEither.declines(self, window, chunk, antecedent_ids)
                and not serves_akin(self.similarity(window, chunk, antecedent_ids), self.own_similarity(window, chunk),
                                    self.threshold))


class Fresh(PatchPolicy):
    name = "fresh"

    def computes(self, window: Window) -> bool:
        return True


class OrbitPolicy(PatchPolicy):
    name = "orbit"

    def measured(self, window: Window, chunk: Any, antecedent: tuple, deltas: Sequence | None) -> None:
        if chunk.orbit is None:
            chunk.orbit = Orbit.of(window._hold(chunk))
        chunk.orbit.add(antecedent, deltas)

    def unseen(self, window: Window, chunk: Any, antecedent_ids: Sequence) -> tuple[kp.ChunkPatch | None, bool]:
        if chunk.orbit is None:
            return super().unseen(window, chunk, antecedent_ids)
        held = window._hold(chunk)
        patch, fitted = chunk.orbit.fit(lambda mean: layer_ranks(window, mean, held), one_rank_storage(window.storage))
        if fitted:
            window._stats.patch_bytes += patch.nbytes
            window._stats.patched_kv_bytes += budget_bytes(1.0, held)
        return patch, window._keys(antecedent_ids) not in chunk.orbit.seen

    def sample_orders(self, window: Window, orders: int, seed: int) -> int:
        """`Window.fit_orbit`: the deficits of the window's chunks under `orders` random orders
        (one forward of the whole window per order, counted as "orbit"); returns the new orders."""
        g = torch.Generator().manual_seed(seed)
        seen: set[tuple] = set()
        for _ in range(orders * 4):
            if len(seen) == orders:
                break
            order = tuple(window._order[i] for i in torch.randperm(len(window._order), generator=g).tolist())
            if order in seen:
                continue
            seen.add(order)
            kv = window.km.prefill_kv([window._chunks[c].inputs for c in order])
            window._stats.count("orbit", sum(int(window._chunks[c].ids.numel()) for c in order))
            start = token = 0
            for index, cid in enumerate(order):
                chunk = window._chunks[cid]
                n = int(chunk.ids.numel())
                if index:
                    placed = [(k[token:token + n], v[token:token + n]) for k, v in kv]
                    local = relocate_kv(placed, window.km.specs, window.km.layout, -start)
                    self.measured(window, chunk, window._keys(order[:index]), kp.deficit(local, window._hold(chunk)))
                else:
                    self.measured(window, chunk, (), None)
                start += chunk.span
                token += n
        return len(seen)


POLICY_TYPES = {p.name: p for p in (Exact, Survive, Refresh, Blind, Origin, OrbitPolicy, Fresh, OriginNeighbour, OriginPresent,
                                     OriginEither, OriginSimilar, OriginAkin)}
POLICIES = tuple(POLICY_TYPES)
PATCH_POLICIES = tuple(name for name, p in POLICY_TYPES.items() if issubclass(p, PatchPolicy))  # canonical KV + patch
