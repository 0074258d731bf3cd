"""Placement policies: what a chunk gets at a placement whose own KV the window does not have.

The window first serves a chunk's in-context KV for its very placement where it holds it (and,
for the exact and survive policies, where the store keeps it by placement key); only a placement
without it comes here. One small object per policy behind one interface (`place`: approximate KV
for the placement, or None to compute it there; `passed`: told of each pass the window ran),
chosen by `Window(patch=...)`:
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
- `origin-similar` (`OriginSimilar`): the origin patch where the chunk's neighbour is the one it
  had at its origin, or every chunk before it there is before it still (`origin_holds`), or its
  new neighbour's key summary is close to the old one's (cosine at least `SIMILAR`, no forward);
  else blind reuse; `origin-akin` (`OriginAkin`): as `origin-similar`, and also behind a new
  neighbour at least as close to the old one as the chunk's own summary is.
The patch policies compute a chunk's first placement (its in-context pass, from which its patch
is fitted) and, with exact patches (`rank=None`), every new placement. A chunk at the front of
the window never takes a patch: its canonical KV is exact there (an origin patch there reads far
worse than none after a slide: the first token stops acting as the attention sink).

A policy talks to the window through the `Host` it is lent (`agentwin.patches.host`): the chunk
records and order, the store access, the canonical KV of a chunk, the counters.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from agentwin.models.kv import LayerKV, relocate_kv
from agentwin.patches.fit import budget_bytes, fit_patch, layer_ranks, one_rank_storage
from agentwin.patches.host import Approx, Fallback, Host, Probed
from agentwin.patches.orbit import Orbit
from kamera_core import patch as kp
from kamera_core.metrics import layer_cosine

DEFAULT_POLICY = "exact"
# The patch policy the patch studies and `agentwin bench fidelity` take when none is named: chosen
# there among the stale-patch guards on validation (docs/results/FIDELITY.md).
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
    """A chunk computed before keeps that KV when the chunks before it change: it is moved to its
    new start by RoPE re-rotation (exact algebra) with no repair, as StreamingLLM keeps the KV of
    the tokens that stay in its window. What it read from chunks that left stays in it."""

    name = "survive"

    def place(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        earlier = host.earlier(chunk)
        if earlier is None:
            return None
        return Approx(earlier.kv, pl.start - earlier.start)


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

    def place(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Approx | None:
        changed = host.changed_at  # token index of the first chunk this read could not serve as computed
        if changed is None or pl.first - changed < self.near_tokens:
            return None
        age = host.stats.evictions - chunk.computed_at
        if self.max_age is not None and age >= self.max_age:
            return None
        return super().place(host, chunk, pl, antecedent_ids)


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
    """Whether a chunk's origin patch still describes what is before it (`keys`, content keys in
    order): the same chunk right before it as at its origin, or every chunk of its origin
    antecedent still before it (in any order, with others)."""
    return keys[-1:] == origin[-1:] or set(origin) <= set(keys)


# The least key-summary cosine between a chunk's neighbour now and its neighbour at its origin for
# `origin-similar` to serve the origin patch. Chosen on the validation traces of `agentwin bench
# fidelity` from 0.9, 0.95, 0.98, 0.995 (docs/results/FIDELITY.md): the lowest value that kept no
# patch worse than blind reuse behind an unrelated new neighbour.
SIMILAR = 0.95


class OriginSimilar(PatchPolicy):
    """The origin patch where it still holds (`origin_holds`), and also after a new neighbour whose
    key summary (`Window.key_summary`: mean canonical keys per layer) is within cosine `threshold`
    of the neighbour's at the chunk's origin: a patch fitted after one page still serves after the
    next page, not after unrelated text. Blind reuse otherwise. No forward: the summaries are kept."""

    name = "origin-similar"

    def __init__(self, threshold: float = SIMILAR) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1 <= threshold <= 1:
            raise ValueError(f"threshold must be a cosine in [-1, 1], got {threshold!r}")
        self.threshold = float(threshold)

    def similarity(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> float:
        """Cosine (`layer_cosine`) of the key summaries of the chunk's neighbour now and at its
        origin; -1 when it had none."""
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


class OrbitPolicy(PatchPolicy):
    name = "orbit"

    def measured(self, host: Host, chunk: Any, antecedent: tuple, deltas: Sequence | None) -> None:
        if chunk.orbit is None:
            chunk.orbit = Orbit.of(host.canonical(chunk))
        chunk.orbit.add(antecedent, deltas)

    def unseen(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> Fallback:
        if chunk.orbit is None:
            return super().unseen(host, chunk, antecedent_ids)
        held = host.canonical(chunk)
        fit = chunk.orbit.fit(lambda mean: layer_ranks(host.settings, mean, held),
                              one_rank_storage(host.settings.storage))
        if fit.fitted:
            host.stats.patch_bytes += fit.patch.nbytes
            host.stats.patched_kv_bytes += budget_bytes(1.0, held)
        return Fallback(fit.patch, host.keys(antecedent_ids) not in chunk.orbit.seen)

    def sample_orders(self, host: Host, orders: int, seed: int) -> int:
        """`Window.fit_orbit`: the deficits of the window's chunks under `orders` random orders
        (one forward of the whole window per order, counted as "orbit"); returns the new orders."""
        g = torch.Generator().manual_seed(seed)
        seen: set[tuple] = set()
        for _ in range(orders * 4):
            if len(seen) == orders:
                break
            order = tuple(host.order[i] for i in torch.randperm(len(host.order), generator=g).tolist())
            if order in seen:
                continue
            seen.add(order)
            kv = host.km.prefill_kv([host.chunk(c).inputs for c in order])
            host.stats.count("orbit", sum(int(host.chunk(c).ids.numel()) for c in order))
            start = token = 0
            for index, cid in enumerate(order):
                chunk = host.chunk(cid)
                n = int(chunk.ids.numel())
                if index:
                    placed = [(k[token:token + n], v[token:token + n]) for k, v in kv]
                    local = relocate_kv(placed, host.km.specs, host.km.layout, -start)
                    self.measured(host, chunk, host.keys(order[:index]), kp.deficit(local, host.canonical(chunk)))
                else:
                    self.measured(host, chunk, (), None)
                start += chunk.span
                token += n
        return len(seen)


POLICY_TYPES = {p.name: p for p in (Exact, Survive, Refresh, Blind, Origin, OrbitPolicy, Fresh, OriginSimilar, OriginAkin)}
POLICIES = tuple(POLICY_TYPES)
PATCH_POLICIES = tuple(name for name, p in POLICY_TYPES.items() if issubclass(p, PatchPolicy))  # canonical KV + patch
