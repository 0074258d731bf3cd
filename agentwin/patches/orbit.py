"""Orbit patches: one patch per chunk that serves every order of a set of chunks.

A chunk's orbit sums its deficits Δ = KV(B|A) − KV(B|∅) over the distinct antecedents A it was
conditioned on (coming first counts once, as a zero deficit); the patch is the low-rank fit of
their mean, refitted only when a new antecedent joins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from agentwin.models.kv import LayerKV
from kamera_core import patch as kp


@dataclass(frozen=True, slots=True)
class OrbitFit:
    """An orbit's patch, and whether it was fitted by this call (else the cached fit)."""

    patch: kp.ChunkPatch
    fitted: bool


@dataclass(slots=True)
class Orbit:
    """Summed deficits `[(ΔK, ΔV)]` per layer (float32, the chunk's shapes) over `seen` antecedents."""

    sums: list[LayerKV]
    seen: set[Hashable] = field(default_factory=set)
    patch: kp.ChunkPatch | None = None  # fit of the mean; None when stale

    @classmethod
    def of(cls, canonical: Sequence[LayerKV]) -> Orbit:
        """An empty orbit for a chunk whose canonical KV is `canonical`."""
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
        """The fit of the mean deficit at `ranks` (an int for every layer, or a function of the
        mean deficit giving per layer (K rank, V rank))."""
        if self.patch is not None:
            return OrbitFit(self.patch, False)
        n = len(self.seen)
        mean = [(k / n, v / n) for k, v in self.sums]
        layer_ranks = [(ranks, ranks)] * len(mean) if isinstance(ranks, int) else ranks(mean)
        self.patch = kp.build_patch(mean, layer_ranks, "svd", storage=storage)
        return OrbitFit(self.patch, True)
