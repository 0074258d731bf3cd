"""What a placement policy sees of the window (`Host`), and the values policies, fits and the
window hand each other (named dataclasses, never bare tuples).

The window does not pass itself to its policy: it lends it a `Host`
(`agentwin.window_engine.PolicyHost`), through which the policy reads the chunk records and the
order, calls the store access and counts into the window's stats, and nothing else. Declared
here, so that no module of `agentwin.patches` imports the window's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from agentwin.models.kv import LayerKV
from agentwin.window_stats import WindowStats
from kamera_core import patch as kp


@dataclass(frozen=True, slots=True)
class Approx:
    """KV served at a placement without computing it there: `kv` token-major per layer in the
    frame its keys were rotated for, placed by `shift` positions, plus `patch` (in that frame) or
    None. `exact`: it is the model's own KV there all the same (canonical KV at the front);
    `stale`: a patch fitted after another antecedent than the one the chunk has now; `first`:
    the chunk's first placement, its KV computed (encoded) for it, not a relocation."""

    kv: Sequence[LayerKV]
    shift: int
    patch: kp.ChunkPatch | None = None
    exact: bool = False
    stale: bool = False
    first: bool = False


@dataclass(frozen=True, slots=True)
class Earlier:
    """The KV a chunk was last computed with (at any placement): token-major per layer, its keys
    rotated for position `start`."""

    kv: list[LayerKV]
    start: int


@dataclass(frozen=True, slots=True)
class Fallback:
    """What a patch policy serves after an antecedent it has no patch for: `patch` (None: blind
    reuse, canonical KV alone) and whether that patch was fitted after another antecedent."""

    patch: kp.ChunkPatch | None
    stale: bool


@dataclass(frozen=True, slots=True)
class Probed:
    """What a chunk's pass recorded for its patch fit: the per-layer segments it read before the
    chunk (`before`), the probe the attention filled (`agentwin.patches.guard.QueryProbe`), and
    the chunk's first token index in that pass (`first`)."""

    before: list
    probe: Any
    first: int


class Host(Protocol):
    """What a placement policy reads and calls of the window it serves."""

    km: Any  # the KameraModel
    settings: Any  # the window's PatchSettings (agentwin.patches.fit)
    stats: WindowStats
    io: Any  # the window's store access (agentwin.window_io.WindowIO)
    order: list  # the chunk ids in the window, in order
    changed_at: int | None  # during a read: token index of the first chunk not served as computed

    def chunk(self, chunk_id: Any) -> Any: ...  # its ChunkRecord
    def keys(self, ids: Sequence) -> tuple: ...  # the content keys of these chunks
    def canonical(self, chunk: Any) -> list[LayerKV]: ...  # its canonical KV (read or encoded, counted)
    def earlier(self, chunk: Any) -> Earlier | None: ...
    def summary(self, chunk: Any) -> torch.Tensor: ...  # mean keys per layer, chunk-local frame
