"""How the window fits a chunk's patch from the KV of a pass it ran anyway (the in-context pass
at append, or a conditioned pass): the deficit against the canonical KV, then by the window's
settings:

- `rank=None`: the exact deficit (full rank, float32);
- `fit="svd"`: the truncated SVD of each layer's K and V deficit at `rank` (the plain
  Frobenius fit);
- `fit="query"`: the same rank with K fitted in the metric of the second moment of the queries
  the pass computed for the chunk's last rows (`QueryProbe`), moved into the chunk-local frame:
  the key error weighted by how the chunk's own later queries read it (`kamera_core.patch.fit`).
  Text chunks only (a vision chunk's multi-axis positions are not one rotation back); others
  take the SVD fit;
- then `guard=True` (`agentwin.guard.guard_chunk`) or `max_kl` (`agentwin.guard.fit_to_kl`).
"""

from __future__ import annotations

import time
from typing import Any

from agentwin.guard import fit_to_kl, guard_chunk
from agentwin.models.kv import relocate_kv
from kamera_core import patch as kp
from kamera_core.relocate import relocate_keys

FITS = ("svd", "query")


def query_metrics(km: Any, probe: Any, start: int) -> list[tuple[Any, None]]:
    """Per layer `(K metric, None)`: the probe rows' query second moment per KV head, in the
    chunk-local frame (rotated back by `start`, where the chunk's first token sat)."""
    return [(kp.query_second_moment(relocate_keys(probe.queries[layer][0].float(), spec, -start, backend="torch"),
                                    km.layout.num_kv_heads), None)
            for layer, spec in enumerate(km.specs)]


def fit_patch(window: Any, chunk: Any, antecedent: tuple, exact: list, start: int, probed: tuple | None) -> kp.ChunkPatch:
    """The patch of `chunk` after `antecedent` from its KV computed there (`exact`, at `start`);
    `probed` is what the pass recorded (`(segments, QueryProbe, first)`, or None)."""
    t0 = time.perf_counter()
    km, stats = window.km, window._stats
    local = relocate_kv(exact, km.specs, km.layout, -start)
    deltas = kp.deficit(local, window._hold(chunk))
    window._policy.measured(window, chunk, antecedent, deltas)
    text = chunk.inputs.kind == "text"
    if window.rank is None:
        patch = kp.exact_patch(deltas)
    elif window.max_kl is not None and probed is not None and text:
        patch = fit_to_kl(km, stats, chunk.ids, window._hold(chunk), deltas, window.rank, window.storage,
                          window.max_kl, start, *probed)
    else:
        metrics = query_metrics(km, probed[1], start) if window.fit == "query" and probed is not None and text else None
        patch = kp.build_patch(deltas, [(window.rank, window.rank)] * len(deltas), window.fit, metrics=metrics,
                               storage=window.storage)
        if probed is not None and window.guard:
            patch = guard_chunk(km, stats, chunk.inputs.kind, chunk.ids, window._hold(chunk), patch, exact, start,
                                *probed)
    stats.patch_bytes += patch.nbytes
    stats.seconds["fit_patch"] += time.perf_counter() - t0
    return patch
