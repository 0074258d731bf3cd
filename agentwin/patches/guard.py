"""The patch guard as the window runs it: the probe a chunk's pass records, the per-layer decision
(`kamera_core.guard.guard_patch`), then the whole patch kept only where it lowers the probe rows' next-token KL
too; and `fit_to_kl`, the patch for a next-token KL target (`max_kl`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from kamera_core import patch as kp
from kamera_core.guard import MARGIN, guard_patch, head_patch
from kamera_core.metrics import kl_divergence
from kamera_core.segment import Segment

# Probe rows: the chunk's last rows, which attend to all of it; fewer let patches that read worse than blind through.
PROBE_ROWS = 32


@dataclass
class QueryProbe:
    """Filled (mutated) by the attention during one pass (`agentwin.models.segments`): per layer the post-RoPE
    queries `[n, Hq, D]` of the pass's rows `rows` (`[n]` int64), the attention scale, sliding window and soft-cap."""

    rows: torch.Tensor
    queries: dict[int, tuple[torch.Tensor, float, int | None, float | None]] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # `[n, vocab]` float32 next-token logits of the rows (set by the pass)
    keep_all: bool = False  # also keep every row's queries in `full` (the query-metric fit)
    full: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer `[Tq, Hq, D]`
    keep_residual: bool = False  # also record the residual stream's size (fit="residual")
    residual: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer ||h||² of every row `[Tq]`

    @classmethod
    def last_rows(cls, tokens: int, count: int = PROBE_ROWS, keep_all: bool = False,
                  keep_residual: bool = False) -> "QueryProbe":
        """A probe of the last min(count, tokens // 2) rows, at least one; earlier rows are for `tail_kl` to serve."""
        n = max(1, min(count, tokens // 2))
        return cls(torch.arange(tokens - n, tokens), keep_all=keep_all, keep_residual=keep_residual)

    def record(self, layer: int, query: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> None:
        """Keep copies of `query` (the layer's `[1, Hq, Tq, D]` as the attention receives it) at `rows`."""
        self.queries[layer] = (query[0, :, self.rows].transpose(0, 1).detach().clone(), scale, window, softcap)
        if self.keep_all:
            self.full[layer] = query[0].transpose(0, 1).detach().clone()


def tail_kl(km: Any, ids: torch.Tensor, canonical: Sequence[tuple[torch.Tensor, torch.Tensor]],
            patches: Sequence[kp.ChunkPatch | None], antecedent: Sequence[Sequence[Segment]], probe: QueryProbe,
            first: int, start: int) -> list[float] | None:
    """Per candidate of `patches` (None: blind), the probe rows' mean next-token KL of the pass's logits against
    those rows read after [antecedent, the chunk's earlier rows as canonical KV + that patch], in one batched
    forward. Text chunks only. None when the pass kept no logits or no row precedes the probe rows."""
    tokens, n = int(ids.numel()), int(probe.rows.numel())
    head = tokens - n
    if probe.logits is None or head <= 0:
        return None
    variants = [[[*antecedent[i], Segment(k[:head], v[:head], first, start,
                                          None if patch is None else head_patch(patch.layers[i], head))]
                 for i, (k, v) in enumerate(canonical)] for patch in patches]
    logits = km.forward_variants(ids[head:], start + head, variants, first + head, logits_to_keep=n)
    return [kl_divergence(probe.logits, row[-n:]) for row in logits]


def guard_chunk(km: Any, stats: Any, kind: str, ids: torch.Tensor, canonical: Sequence[tuple[torch.Tensor, torch.Tensor]],
                patch: kp.ChunkPatch, exact: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int,
                segments: Sequence[Sequence[Segment]], probe: QueryProbe, first: int) -> kp.ChunkPatch:
    """The guarded patch: `guard_patch`, then for text chunks `tail_kl`, dropping the patch whole unless it beats
    blind by `MARGIN`. Counts the forward as "guard" and what was dropped in `stats` (the window's `WindowStats`)."""
    guarded, report = guard_patch(patch, canonical, exact, segments, probe.rows, probe.queries, km.specs, first, start)
    stats.guarded(report)
    if kind != "text" or probe.logits is None or guarded.nbytes == 0 or probe.rows[0] == 0:
        return guarded  # nothing to check end to end
    t0 = time.perf_counter()
    stats.count("guard", 2 * int(probe.rows.numel()))  # one forward, batch of two: blind and guarded
    scores = tail_kl(km, ids, canonical, (None, guarded), segments, probe, first, start)
    stats.seconds["guard"] += time.perf_counter() - t0
    if scores[1] < (1 - MARGIN) * scores[0]:
        return guarded
    stats.guard_fallbacks += 1
    stats.guard_dropped_bytes += guarded.nbytes
    stats.guard_dropped += sum((lp.k is not None) + (lp.v is not None) for lp in guarded.layers)
    return kp.ChunkPatch(tuple(kp.LayerPatch(None, None) for _ in guarded.layers), guarded.method)


def fit_to_kl(km: Any, stats: Any, ids: torch.Tensor, canonical: Sequence[tuple[torch.Tensor, torch.Tensor]],
              rungs: Iterable[kp.ChunkPatch], max_kl: float, start: int, segments: Sequence[Sequence[Segment]],
              probe: QueryProbe, first: int) -> kp.ChunkPatch:
    """A text chunk's patch for a next-token KL target (`max_kl`, nats) on its probe rows: blind reuse, then each of
    `rungs` (read lazily) until one meets it; the lowest-KL option measured is returned, blind (no bytes) included.
    Counts each forward as "guard" in `stats` and appends to `stats.kl_ranks` (0: blind) and `stats.kl_bytes`."""
    t0 = time.perf_counter()
    best = kp.ChunkPatch(tuple(kp.LayerPatch(None, None) for _ in canonical), "none")
    stats.count("guard", int(probe.rows.numel()))
    best_kl = tail_kl(km, ids, canonical, (None,), segments, probe, first, start)
    best_kl = None if best_kl is None else best_kl[0]
    if best_kl is not None and best_kl > max_kl:
        for patch in rungs:
            stats.count("guard", int(probe.rows.numel()))
            kl = tail_kl(km, ids, canonical, (patch,), segments, probe, first, start)[0]
            if kl < best_kl:
                best, best_kl = patch, kl
            if kl <= max_kl:
                break
    stats.kl_ranks.append(max((f.rank for lp in best.layers for f in (lp.k, lp.v) if f is not None), default=0))
    stats.kl_bytes.append(best.nbytes)
    stats.seconds["guard"] += time.perf_counter() - t0
    return best
