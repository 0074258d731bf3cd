"""`Host`, the view of the window a placement policy is lent (`agentwin.window_engine.PolicyHost`), and the values
policies, fits and the window exchange. Declared here so that no module of `agentwin.patches` imports the window's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from agentwin.models.kv import LayerKV
from agentwin.window_stats import WindowStats
from kamera_core import patch as kp


@dataclass(frozen=True, slots=True)
class Approx:
    """KV served at a placement without computing it there: `kv` token-major per layer in the frame its keys were
    rotated for, placed by `shift` positions, plus `patch` (in that frame) or None. `exact`: the model's own KV there
    all the same; `stale`: a patch fitted after another antecedent; `first`: encoded for this, its first placement."""

    kv: Sequence[LayerKV]
    shift: int
    patch: kp.ChunkPatch | None = None
    exact: bool = False
    stale: bool = False
    first: bool = False


@dataclass(frozen=True, slots=True)
class Earlier:
    """The KV a chunk was last computed with: token-major per layer, its keys rotated for position `start`."""

    kv: list[LayerKV]
    start: int


@dataclass(frozen=True, slots=True)
class Fallback:
    """What a patch policy serves after an antecedent it has no patch for: `patch` (None: blind reuse) and whether
    it was fitted after another antecedent."""

    patch: kp.ChunkPatch | None
    stale: bool


@dataclass(frozen=True, slots=True)
class Probed:
    """What a chunk's pass recorded for its fit: per layer the segments read before the chunk, the filled
    `QueryProbe` and the chunk's first token index."""

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
