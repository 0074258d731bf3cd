"""The patch guard: keep a low-rank patch component only where it measurably helps.

A low-rank patch Δ̂ of a chunk's deficit can make the chunk read worse than blind reuse (no
patch): the best rank-m fit of Δ in the Frobenius norm is not the best correction of what
attention computes from it. The guard checks each layer's key patch and value patch against the
error that matters, the attention output, and drops (rank 0) what does not lower it.

During the chunk's pass after its antecedent (`QueryProbe`), the attention records the chunk's
own post-RoPE queries for a few probe rows (the last `PROBE_ROWS` rows, at most half the chunk:
they read the whole chunk, as the questions after it will) and the pass keeps their next-token
logits. Two checks follow, both against blind reuse:

1. per layer (`guard_patch`): the attention output of the probe rows over [the antecedent's KV
   as the window served it in that pass, the chunk's KV] with the chunk's KV = exact (the pass's
   own, the reference), blind (canonical, relocated), and canonical with the key patch, the value
   patch, or both. The option with the least squared error against the exact output is kept; a
   patched option must beat blind by the relative `margin`, and a component is kept only if
   dropping it would raise the error by more than `margin` too. Each layer's choice therefore
   has an attention-output error on the probe rows at most blind's.
2. end to end (`tail_kl`, run by the window for text chunks): the probe rows are forwarded
   after [antecedent, the chunk's earlier rows served blind] and after the same with the guarded
   patch, both in one batched forward (one pass over the weights); their next-token KL against
   the pass's logits decides whether the patch is kept at all. A per-layer gain does not always
   survive the layers above it (a low-rank patch can lower every layer's probe error and still
   raise the next-token KL over blind reuse); this check is what catches it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from kamera_core import patch as kp
from kamera_core.metrics import kl_divergence
from kamera_core.rope import RopeSpec
from kamera_core.segment import Segment, merge_states, patch_option_states, segment_state

# Probe rows: the chunk's last rows (they attend to all of it); half as many let a patch that read
# worse than blind reuse through on the guard study's hard cases.
PROBE_ROWS = 32
# A patched option must lower the probe error by this fraction of the error it is compared with
# (per layer), and a whole patch its probe rows' next-token KL by this fraction of blind's.
MARGIN = 0.05

OPTIONS = ("none", "k", "v", "kv")


@dataclass
class QueryProbe:
    """Filled by the attention during one pass (`agentwin.models.segments`): per layer, the
    post-RoPE queries `[n, Hq, D]` of the pass's rows `rows`, the attention scale, the layer's
    sliding window and logit soft-cap."""

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
        """The last min(count, tokens // 2) rows (at least one): rows before them stay for
        `tail_kl` to serve from canonical KV."""
        n = max(1, min(count, tokens // 2))
        return cls(torch.arange(tokens - n, tokens), keep_all=keep_all, keep_residual=keep_residual)

    def record(self, layer: int, query: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> None:
        """query: the layer's `[1, Hq, Tq, D]` as the attention receives it."""
        self.queries[layer] = (query[0, :, self.rows].transpose(0, 1).detach().clone(), scale, window, softcap)
        if self.keep_all:
            self.full[layer] = query[0].transpose(0, 1).detach().clone()


@dataclass(frozen=True)
class GuardLayer:
    """One layer's decision: the option kept and the probe errors of all four (squared)."""

    choice: str
    errors: dict[str, float]


@dataclass(frozen=True)
class GuardReport:
    layers: tuple[GuardLayer, ...]
    bytes_before: int
    bytes_after: int

    def choices(self) -> list[str]:
        return [layer.choice for layer in self.layers]

    def kept_error_ratio(self) -> float:
        """Summed probe error of the kept options over blind's (≤ 1 by construction)."""
        blind = sum(layer.errors["none"] for layer in self.layers)
        kept = sum(layer.errors[layer.choice] for layer in self.layers)
        return kept / blind if blind > 0 else 0.0


def _choose(errors: dict[str, float], margin: float) -> str:
    """The least-error option that beats blind by `margin`, then drop any component whose removal
    costs no more than `margin` of the error."""
    best = min(OPTIONS, key=lambda o: errors[o])
    if best == "none" or not errors[best] < (1 - margin) * errors["none"]:
        return "none"
    if best == "kv":
        single = min(("k", "v"), key=lambda o: errors[o])
        if errors[single] * (1 - margin) <= errors["kv"] and errors[single] < (1 - margin) * errors["none"]:
            return single
    return best


def guard_patch(patch: kp.ChunkPatch, canonical: Sequence[tuple[torch.Tensor, torch.Tensor]],
                exact: Sequence[tuple[torch.Tensor, torch.Tensor]], antecedent: Sequence[Sequence[Segment]],
                probe: QueryProbe, specs: Sequence[RopeSpec], first: int, start: int,
                margin: float = MARGIN) -> tuple[kp.ChunkPatch, GuardReport]:
    """`patch` with each layer's k / v factors kept or dropped by the probe error (module doc).

    canonical: the chunk's canonical KV (chunk-local frame); exact: its KV from the pass (at
    `start`); antecedent: per layer the segments the pass read before the chunk; first: the
    chunk's first token index. Layers the probe did not record keep their patch as it is."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    rows = probe.rows.to(torch.long)
    query_index = first + rows
    kept, report = [], []
    for layer, (lp, (ck, cv), (xk, xv), spec) in enumerate(zip(patch.layers, canonical, exact, specs)):
        recorded = probe.queries.get(layer)
        if recorded is None or (lp.k is None and lp.v is None):
            kept.append(lp)
            continue
        q, scale, window, softcap = recorded
        # The antecedent's part of the attention is the same for every option: computed once and
        # merged with each option's chunk part by log-sum-exp.
        states = [segment_state(q, query_index, seg, spec, scale, window, softcap) for seg in antecedent[layer]]
        before = merge_states(states) if states else None

        def merged(state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return (state if before is None else merge_states([before, state]))[0].double()

        reference = merged(segment_state(q, query_index, Segment(xk, xv, first, 0), spec, scale, window, softcap))
        # Every option's chunk part from one set of scores per key-patch setting.
        states = patch_option_states(q, query_index, Segment(ck, cv, first, start, lp), spec, scale, window, softcap,
                                     OPTIONS)
        errors = {}
        for name, state in zip(OPTIONS, states):
            if name != "none" and ((name in ("k", "kv") and lp.k is None) or (name in ("v", "kv") and lp.v is None)):
                errors[name] = float("inf")  # that component is not there to keep
                continue
            errors[name] = float((merged(state) - reference).square().sum())
        choice = _choose(errors, margin)
        kept.append(kp.LayerPatch(lp.k if "k" in choice else None, lp.v if "v" in choice else None))
        report.append(GuardLayer(choice, errors))
    guarded = kp.ChunkPatch(tuple(kept), f"{patch.method}+guard")
    return guarded, GuardReport(tuple(report), patch.nbytes, guarded.nbytes)


def _head(lp: kp.LayerPatch | None, rows: int) -> kp.LayerPatch | None:
    """A layer patch restricted to the chunk's first `rows` tokens."""
    if lp is None:
        return None

    def cut(f: kp.Factors | None) -> kp.Factors | None:
        return None if f is None else f.first_rows(rows)

    return kp.LayerPatch(cut(lp.k), cut(lp.v))


def tail_kl(km: Any, ids: torch.Tensor, canonical: Sequence[tuple[torch.Tensor, torch.Tensor]],
            patches: Sequence[kp.ChunkPatch | None], antecedent: Sequence[Sequence[Segment]], probe: QueryProbe,
            first: int, start: int) -> list[float] | None:
    """Per candidate in `patches` (None: blind), the mean next-token KL over the probe rows (the
    chunk's last rows) of the pass's logits against those rows read after [antecedent, the
    chunk's earlier rows served as canonical KV + that patch]: what the patch does to the chunk's
    own later reading, end to end. One batched forward of the probe rows for all candidates
    (`KameraModel.forward_variants`: the weights are read once). Text chunks (1-D positions).
    None when the pass kept no logits or no row comes before the probe rows."""
    tokens, n = int(ids.numel()), int(probe.rows.numel())
    head = tokens - n
    if probe.logits is None or head <= 0:
        return None
    variants = [[[*antecedent[i], Segment(k[:head], v[:head], first, start,
                                          None if patch is None else _head(patch.layers[i], head))]
                 for i, (k, v) in enumerate(canonical)] for patch in patches]
    logits = km.forward_variants(ids[head:], start + head, variants, first + head, logits_to_keep=n)
    return [kl_divergence(probe.logits, row[-n:]) for row in logits]


def guard_chunk(km: Any, stats: Any, kind: str, ids: torch.Tensor, canonical: Sequence[tuple[torch.Tensor, torch.Tensor]],
                patch: kp.ChunkPatch, exact: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int,
                segments: Sequence[Sequence[Segment]], probe: QueryProbe, first: int) -> kp.ChunkPatch:
    """The window's guard of one fitted patch: per layer on the probe rows' attention outputs
    (`guard_patch`), then, for text chunks, as a whole on their next-token logits (`tail_kl`): a
    patch that does not beat blind reuse there by `MARGIN` is dropped whole. `stats` (the
    window's `WindowStats`) counts the probe forward (batch of two) as "guard" and what was dropped."""
    guarded, report = guard_patch(patch, canonical, exact, segments, probe, km.specs, first, start)
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
    """The patch of a text chunk for a fidelity target instead of a rank (`Window(max_kl=...)`).

    Measured on the probe rows end to end (`tail_kl`: their next-token KL against the chunk's own
    pass): blind reuse first; then each patch of `rungs` in turn (`agentwin.patches.fit`: the
    window's allocator fit within its byte budget, √2 times that, and so on; or, for the one-rank
    fits, the plain fit at the window's rank, twice that, and so on), stopping at the first whose
    KL is at most `max_kl`. `rungs` is read lazily, so a chunk blind reuse already serves costs no
    fit. The lowest-KL option measured is kept, blind reuse (no bytes) included, so the patch
    never reads worse than blind on those rows and spends bytes only where blind reuse misses the
    target. Each measurement is one forward of the probe rows, counted as "guard" in `stats`, as
    is the ladder's time; `stats.kl_ranks` records the largest block rank kept (0: blind) and
    `stats.kl_bytes` the patch's bytes."""
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
