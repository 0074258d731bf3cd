"""Orbit patches, a study the benchmarks run: one patch per chunk for every order of a set.

A chunk's orbit sums its deficits Δ = KV(B|A) − KV(B|∅) over the distinct antecedents A it was
conditioned on (coming first counts once, as a zero deficit); its patch is the low-rank fit of
their mean, refitted when a new antecedent joins. `OrbitPolicy` is a patch policy
(`Window(patch=OrbitPolicy(), rank=...)`); `OrbitPolicy.fit_orders` adds the deficits of random
orders of the window's chunks, one forward of the whole window per order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from agentwin.models.kv import LayerKV, relocate_kv
from agentwin.patches.fit import budget_bytes, layer_ranks, one_rank_storage
from agentwin.patches.host import Fallback, Host
from agentwin.patches.policies import PatchPolicy
from kamera_core import patch as kp


@dataclass(frozen=True, slots=True)
class OrbitFit:
    """An orbit's patch, and whether this call fitted it (else the cached fit)."""

    patch: kp.ChunkPatch
    fitted: bool


@dataclass(slots=True)
class Orbit:
    """Summed deficits `[(ΔK, ΔV)]` per layer (float32, the chunk's token-major shapes) over `seen`
    antecedents."""

    sums: list[LayerKV]
    seen: set[Hashable] = field(default_factory=set)
    patch: kp.ChunkPatch | None = None  # fit of the mean; None when stale

    @classmethod
    def of(cls, canonical: Sequence[LayerKV]) -> Orbit:
        return cls([(torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
                    for k, v in canonical])

    def add(self, antecedent: Hashable, deltas: Sequence[LayerKV] | None) -> None:
        """Count one antecedent's deficit (None: the chunk first, a zero deficit) once."""
        if antecedent in self.seen:
            return
        self.seen.add(antecedent)
        if deltas is not None:
            for (sk, sv), (dk, dv) in zip(self.sums, deltas):
                sk += dk.float()
                sv += dv.float()
        self.patch = None

    def fit(self, ranks: Any, storage: str) -> OrbitFit:
        """The fit of the mean deficit at `ranks`: an int for every layer, or a function of the mean
        deficit giving per layer (K rank, V rank)."""
        if self.patch is not None:
            return OrbitFit(self.patch, False)
        n = len(self.seen)
        mean = [(k / n, v / n) for k, v in self.sums]
        per_layer = [(ranks, ranks)] * len(mean) if isinstance(ranks, int) else ranks(mean)
        self.patch = kp.build_patch(mean, per_layer, "svd", storage=storage)
        return OrbitFit(self.patch, True)


class OrbitPolicy(PatchPolicy):
    """A chunk after an antecedent with no stored patch gets its orbit's patch (stale where that
    antecedent was never measured). Orbits are kept by chunk id across evictions. One object per
    window: it keeps the window's `Host` it was last lent, which `fit_orders` uses."""

    name = "orbit"

    def __init__(self) -> None:
        self.orbits: dict[Any, Orbit] = {}
        self._host: Host | None = None

    def _lent(self, host: Host) -> Host:
        if self._host is not None and self._host is not host:
            raise ValueError("an OrbitPolicy serves one window; give each window its own")
        self._host = host
        return host

    def place(self, host: Host, chunk: Any, pl: Any, antecedent_ids: Sequence) -> Any:
        return super().place(self._lent(host), chunk, pl, antecedent_ids)

    def passed(self, host: Host, *args: Any) -> None:
        super().passed(self._lent(host), *args)

    def measured(self, host: Host, chunk: Any, antecedent: tuple, deltas: Sequence | None) -> None:
        orbit = self.orbits.get(chunk.id)
        if orbit is None:
            orbit = self.orbits[chunk.id] = Orbit.of(host.canonical(chunk))
        orbit.add(antecedent, deltas)

    def unseen(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> Fallback:
        orbit = self.orbits.get(chunk.id)
        if orbit is None:
            return super().unseen(host, chunk, antecedent_ids)
        held = host.canonical(chunk)
        fit = orbit.fit(lambda mean: layer_ranks(host.settings, mean, held), one_rank_storage(host.settings.storage))
        if fit.fitted:
            host.stats.patch_bytes += fit.patch.nbytes
            host.stats.patched_kv_bytes += budget_bytes(1.0, held)
        return Fallback(fit.patch, host.keys(antecedent_ids) not in orbit.seen)

    def fit_orders(self, window: Any, orders: int = 6, seed: int = 0) -> int:
        """Add the deficits of `window`'s chunks under `orders` random orders to their orbits (one
        forward of the whole window per order, counted as "orbit"), so later reorders among them
        are served by the orbit patch. Returns the number of new orders (orders seen before are
        skipped). `window` must be the window this policy serves."""
        if isinstance(orders, bool) or not isinstance(orders, int) or orders < 1:
            raise ValueError(f"orders must be a positive int, got {orders!r}")
        if window.policy != self.name:
            raise ValueError(f"fit_orders needs a window with patch=OrbitPolicy(), this one uses {window.policy!r}")
        window.materialize()  # every chunk's first pass (and its origin patch) before the orders
        t0 = time.perf_counter()
        host = self._host
        if host is None:  # an empty window: nothing placed, nothing to order
            return 0
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
        spent = time.perf_counter() - t0
        host.stats.seconds["fit_orbit"] += spent
        host.stats.wall_s += spent
        return len(seen)
