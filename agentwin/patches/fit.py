"""How the window fits a chunk's patch from the KV of a pass it ran anyway (the in-context pass
at append, or a conditioned pass): the deficit against the canonical KV, then by the window's
settings (`PatchSettings`):

- `rank=None`: the exact deficit (full rank, float32);
- `rank="budget"` (the default): at most `patch_bytes` (default 6%) of the chunk's canonical KV
  bytes as the window holds them, every chunk alike; `rank=r`: the bytes of rank r in every
  layer's K and V;
- `fit="alloc"`: plain fits, the bytes spread over layers and K/V by the greedy
  allocator on each block's singular values normalised by its energy
  (`kamera_core.budget.budget_ranks`), so layers whose deficit is concentrated get the ranks;
- `fit="svd"`: the same rank in every layer's K and V, plain truncated SVD (the Frobenius fit);
- `fit="output"`: the allocator on the first-order error each block's deficit
  leaves in its layer's attention output (`kamera_core.fit_metric.output_metric`): K in the metric of
  the queries the pass computed for the chunk's rows (as `fit="query"`) scaled per head by the
  spread of the chunk's values over D, V plainly, so K and V of a layer share one unit; each
  layer's gains normalised by its values' spread (`kamera_core.fit_metric.value_spread`), so the ranks
  go where a layer's output moves most for its size. Text chunks only; others (and MLA models)
  take `fit="alloc"`;
- `fit="residual"`: as "output", each block's error taken where it lands in the residual stream:
  V in the metric of the layer's output projection (`kamera_core.fit_metric.projection_metric`), K in
  the query metric scaled by the values' spread in that metric, and each layer's gains relative to
  Σ ||h||² of the residual stream entering the layer over the chunk's rows, recorded in the same
  pass (`agentwin.models.residual`): every later read of the stream is normalised by its size.
  Text chunks only; others (and MLA models) take `fit="alloc"`; a model whose layers show no
  output projection is refused when the window is built;
- `fit="query"`: the same rank everywhere, K fitted in the metric of the second moment of the
  queries the pass computed for all of the chunk's rows, moved into the chunk-local frame, V
  plainly. Text chunks only (a vision chunk's multi-axis positions are not one rotation back);
  others take the plain fit;
- `storage`: the factors' form, "int8" (per-rank scales, about half the bytes of fp16, so twice
  the rank for the budget), "mixed" (the allocator also decides, component by component, whether
  int8 or 4-bit codes packed two to a byte buy more of the fit per byte, from the error each
  precision adds to that component in its fit's metric: `kamera_core.budget.budget_mixed`; with
  `rank="budget"` and the allocator fits alloc / output* / residual only), "auto" (mixed where
  the allocator sets the ranks, int8 where one rank is set for every layer), "fp16", "bf16" or
  "fp32";
- then the patch guard (`agentwin.patches.guard.guard_chunk`; `guard="auto"`, the default, turns it on
  below a 6% byte budget and for rank=N windows, see `GUARD_BELOW`) or `max_kl`
  (`agentwin.patches.guard.fit_to_kl`: blind reuse, then the window's own fit within `patch_bytes`, √2
  times that and so on up to the chunk's canonical bytes, `byte_ladder`, until the chunk's last rows
  reach the target; with one rank set for every layer, or the one-rank fits svd / query, the
  plain fit at that rank, doubled per rung, `rank_ladder`); the guard study
  (`python -m tools.studies.guard_study`, docs/results/guard_smollm2.json) measures what each
  ladder costs.

The defaults (fit "residual", storage "auto", which is "mixed" under it) are the fit `agentwin
bench eval` chose on its validation split at a 6% byte cap; its pages in docs/results/ give the
figures, and a test holds the defaults to that choice. The ranks come from the same function the
benchmarks fit their Kamera methods with, so the window serves the fit that was measured.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from typing import Any

from agentwin.patches.guard import QueryProbe, fit_to_kl, guard_chunk
from agentwin.patches.host import Host, Probed
from agentwin.models import residual
from agentwin.models.kv import relocate_kv
from kamera_core import budget as kb, fit_metric as fm, mixed, patch as kp
from kamera_core.fit_batch import fit_with_gains_batch, precision_for
from kamera_core.relocate import relocate_keys

RESIDUAL = "residual"
FITS = ("svd", "query", "alloc", *fm.OUTPUT_FITS, RESIDUAL)
QUERY_FITS = ("query", *fm.OUTPUT_FITS, RESIDUAL)  # fits that read the queries of the chunk's pass
OUTPUT_LIKE = (*fm.OUTPUT_FITS, RESIDUAL)  # the allocator on each layer's output error
ALLOCATING = ("alloc", *OUTPUT_LIKE)  # fits whose ranks come from the byte allocator
BUDGET = "budget"
DEFAULT_PATCH_BYTES = 0.06
AUTO = "auto"
# guard="auto" (the default) turns the patch guard on below this byte budget (and for rank=N
# windows, whose share of the bytes depends on the chunk): the guard study found the allocator
# reading worse than blind reuse only below it, and the guard's extra passes cost every step
# (docs/results/guard_smollm2.json and docs/results/STEPS_GUARD.md give the figures).
GUARD_BELOW = DEFAULT_PATCH_BYTES


@dataclass(frozen=True)
class PatchSettings:
    """A window's patch settings, checked (`patch_settings`)."""

    rank: int | str | None  # None: exact; "budget": from patch_bytes; or one rank for every layer
    patch_bytes: float | None
    storage: str
    guard: bool
    max_kl: float | None
    fit: str

    @property
    def method(self) -> str:
        """The fit's name in patch keys: patches of other settings never answer for these."""
        if self.rank is None:
            return "exact"
        target = f"+kl{self.max_kl:g}" if self.max_kl is not None else ""
        budget = f"@{self.patch_bytes:g}" if self.rank == BUDGET else ""
        return f"{self.fit}{'+guard' if self.guard else ''}{target}-{self.storage}{budget}"

    @property
    def key_rank(self) -> int | None:
        return self.rank if isinstance(self.rank, int) else None

    @property
    def probed(self) -> bool:
        """Whether the chunk's pass records queries (and logits) for the fit."""
        return self.rank is not None and (self.guard or self.max_kl is not None or self.fit in QUERY_FITS)

    def probe(self, tokens: int) -> QueryProbe | None:
        """What a chunk's pass of `tokens` records for the fit: the guard and max_kl score the last
        rows, a query-metric fit reads every row's queries (and fit="residual" the residual stream)."""
        if not self.probed:
            return None
        checked = self.guard or self.max_kl is not None
        return QueryProbe.last_rows(tokens, **({} if checked else {"count": 1}), keep_all=self.fit in QUERY_FITS,
                                    keep_residual=self.fit == RESIDUAL)


def patch_settings(km: Any, rank: Any, patch_bytes: Any, storage: str, guard: Any, max_kl: Any,
                   fit: str) -> PatchSettings:
    """Checked settings for the model `km` (ValueError / TypeError saying what to pass). MLA models
    take plain fits with neither guard nor fidelity target; fit="residual" is refused here for a
    model whose layers do not show their output projection."""
    if rank is not None and rank != BUDGET and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"rank must be {BUDGET!r} (ranks from patch_bytes), a positive int or None (exact), "
                         f"got {rank!r}")
    if patch_bytes is not None:
        if rank != BUDGET:
            raise ValueError("patch_bytes sets the ranks itself: pass it with rank='budget' (the default), "
                             f"not with rank={rank!r}")
        if isinstance(patch_bytes, bool) or not isinstance(patch_bytes, (int, float)) or not 0 < patch_bytes <= 1:
            raise ValueError(f"patch_bytes must be a fraction of the canonical KV bytes in (0, 1], got {patch_bytes!r}")
    if not isinstance(guard, bool) and guard != AUTO:
        raise TypeError(f"guard must be True, False or {AUTO!r}, got {guard!r}")
    if max_kl is not None and (isinstance(max_kl, bool) or not isinstance(max_kl, (int, float)) or not max_kl > 0):
        raise ValueError(f"max_kl must be a positive number (nats) or None, got {max_kl!r}")
    if fit not in FITS:
        raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
    mla, exact = km.layout.family == "mla", rank is None
    if storage not in (*kb.STORAGES, AUTO):
        raise ValueError(f"storage must be one of {(*kb.STORAGES, AUTO)}, got {storage!r}")
    if storage == AUTO:  # mixed where the allocator sets the ranks, int8 where one rank is set for all
        storage = kb.MIXED if rank == BUDGET and fit in ALLOCATING else "int8"
    if storage == kb.MIXED and rank is not None and (rank != BUDGET or fit not in ALLOCATING):
        raise ValueError(f"storage='mixed' is chosen per component by the allocator: it needs rank='budget' and fit "
                         f"one of {ALLOCATING}, got rank={rank!r}, fit={fit!r}; pass storage='int8' instead")
    if fit == RESIDUAL and not mla and not exact:
        residual.projection_metrics(km.model, km.layout.num_kv_heads, km.layout.value_dim)
    fraction = float(patch_bytes if patch_bytes is not None else DEFAULT_PATCH_BYTES) if rank == BUDGET else None
    if guard == AUTO:
        guard = fraction is None or fraction < GUARD_BELOW
    return PatchSettings(rank, fraction, "fp32" if exact else storage, guard and not exact and not mla,
                         None if exact or mla or max_kl is None else float(max_kl),
                         ("alloc" if fit == "alloc" or fit in OUTPUT_LIKE else "svd") if mla else fit)


def query_metrics(km: Any, probe: Any, start: int) -> list[tuple[Any, None]]:
    """Per layer `(K metric, None)`: the second moment per KV head of the queries of all the
    chunk's rows in its pass (`QueryProbe.full`), in the chunk-local frame (rotated back by
    `start`, where the chunk's first token sat)."""
    return [(fm.query_second_moment(relocate_keys(probe.full[layer].float(), spec, -start, backend="torch"),
                                    km.layout.num_kv_heads), None)
            for layer, spec in enumerate(km.specs)]


def budget_bytes(fraction: float, held: Any) -> int:
    """`fraction` of a chunk's canonical KV bytes as held (per layer K and V tensors)."""
    return int(fraction * sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in held))


def _bytes(s: PatchSettings, tokens: int, features: list[tuple[int, int]], held: Any) -> int:
    """The patch's bytes: the byte budget, or those of the window's rank in every layer."""
    if s.rank == BUDGET:
        return budget_bytes(s.patch_bytes, held)
    return s.rank * sum(kb.bytes_per_rank(tokens, fk, s.storage) + kb.bytes_per_rank(tokens, fv, s.storage)
                        for fk, fv in features)


def _shape(deltas: list) -> tuple[int, list[tuple[int, int]]]:
    return int(deltas[0][0].shape[0]), [(dk[0].numel(), dv[0].numel()) for dk, dv in deltas]


def layer_ranks(s: PatchSettings, deltas: list, held: Any) -> list[tuple[int, int]]:
    """Per layer (K rank, V rank) with one rank everywhere: the window's rank, or the largest
    whose patch fits its byte budget."""
    if s.rank != BUDGET:
        return [(s.rank, s.rank)] * len(deltas)
    tokens, features = _shape(deltas)
    return kb.budget_ranks(tokens, features, _bytes(s, tokens, features, held), one_rank_storage(s.storage))


def one_rank_storage(storage: str) -> str:
    """The factors' form when one rank is set for every layer: "mixed" is the allocator's
    per-component choice, so such patches take int8 under it."""
    return "int8" if storage == kb.MIXED else storage


def allocator_fit(s: PatchSettings, deltas: list, held: Any, metrics: list | None = None, exponent: float = 1.0,
                  value_metrics: list | None = None, norms: list | None = None) -> Callable[[int], kp.ChunkPatch]:
    """One decomposition per layer's K and V deficit (`kamera_core.fit_batch.fit_with_gains_batch`);
    returns `at(budget_bytes)`, the patch the allocator builds from it within those bytes: the
    ranks spread by `kamera_core.budget.budget_ranks` on the singular values, each block's gains
    normalised by its energy, its factors truncated to its rank and stored as `s.storage`
    (under "mixed", `kamera_core.mixed.mixed_patch` also splits them into int8 and 4-bit ones).
    With `metrics` (per layer the K output metric, fit="output"): K fitted in it, so a layer's K
    and V gains share one unit (its attention output's error), and both are normalised by the
    spread of the layer's canonical values to the power `exponent`
    (`kamera_core.fit_metric.layer_normaliser`: 1 a relative error per layer, 0 an absolute one).
    With `value_metrics` and `norms` as well (fit="residual"): V fitted in its metric, and both
    blocks normalised by the layer's `norms` entry instead. `max_kl`'s byte ladder calls `at`
    once per rung on the one decomposition."""
    tokens, features = _shape(deltas)
    ks = [None] * len(deltas) if metrics is None else metrics
    vs = [None] * len(deltas) if value_metrics is None else value_metrics
    fits = fit_with_gains_batch([d for pair in deltas for d in pair], [m for pair in zip(ks, vs) for m in pair],
                                precision_for(s.storage))
    full = list(zip(fits[0::2], fits[1::2]))
    if metrics is None:
        gains = [((gk, ek), (gv, ev)) for (_, gk, ek), (_, gv, ev) in full]
    else:
        if norms is None:
            norms = [fm.layer_normaliser(hv, exponent) for _, hv in held]
        gains = [((gk, n), (gv, n)) for ((_, gk, _), (_, gv, _)), n in zip(full, norms)]
    name = "alloc" if metrics is None else s.fit
    factors = [(fk, fv) for (fk, _, _), (fv, _, _) in full]

    def at(budget: int) -> kp.ChunkPatch:
        if s.storage == kb.MIXED:
            return mixed.mixed_patch(factors, gains, list(zip(ks, vs)), budget, name)
        ranks = kb.budget_ranks(tokens, features, budget, s.storage, gains)
        return kp.truncated_patch(factors, ranks, name, s.storage)

    return at


def output_metrics(km: Any, probe: Any, start: int, held: Any, value_metrics: list | None = None) -> list:
    """Per layer the K metric of fit="output": the query metric (`query_metrics`) scaled per head
    by the spread of the chunk's canonical values (`kamera_core.fit_metric.output_metric`), taken in
    `value_metrics` where given (fit="residual")."""
    vs = [None] * len(held) if value_metrics is None else value_metrics
    return [fm.output_metric(mk, hv, mv) for (mk, _), (_, hv), mv in zip(query_metrics(km, probe, start), held, vs)]


def residual_fit(km: Any, s: PatchSettings, deltas: list, held: Any, probe: Any,
                 start: int) -> Callable[[int], kp.ChunkPatch]:
    """fit="residual" (`allocator_fit`'s `at`): the allocator on each layer's K and V error where
    it lands in the residual stream (V in its output projection's metric,
    `kamera_core.fit_metric.projection_metric`; K in the query metric scaled by the values' spread in
    it), relative to Σ ||h||² over the chunk's rows entering the layer in the pass
    (`agentwin.models.residual`)."""
    vms = residual.projection_metrics(km.model, km.layout.num_kv_heads, km.layout.value_dim)
    norms = residual.residual_norms(probe.residual, len(deltas))
    return allocator_fit(s, deltas, held, output_metrics(km, probe, start, held, vms), value_metrics=vms, norms=norms)


def allocated(km: Any, s: PatchSettings, deltas: list, held: Any, probed: Probed | None, start: int,
              text: bool) -> Callable[[int], kp.ChunkPatch]:
    """`at(budget_bytes)` of the window's allocator fit (`fit` one of ALLOCATING): the residual or
    output metrics where the pass recorded the chunk's queries (text chunks), else plain "alloc"."""
    if s.fit == RESIDUAL and probed is not None and text:
        return residual_fit(km, s, deltas, held, probed.probe, start)
    if s.fit in fm.OUTPUT_FITS and probed is not None and text:
        return allocator_fit(s, deltas, held, output_metrics(km, probed.probe, start, held), fm.OUTPUT_FITS[s.fit])
    return allocator_fit(s, deltas, held)


LADDER_STEP = math.sqrt(2)  # growth of `byte_ladder`'s budgets from one rung to the next


def byte_ladder(fit: Callable[[], Callable[[int], kp.ChunkPatch]], first: int, full: int,
                step: float = LADDER_STEP) -> Iterator[kp.ChunkPatch]:
    """`max_kl`'s rungs for an allocator fit: its patch within `first` bytes, then `step` times
    as many (√2 by default: rung i within ceil(first · step^i)), and so on up to `full` (the
    chunk's canonical KV bytes), skipping a rung that buys nothing more than the one before.
    `fit()` gives the fit's `at` (`allocated`): its decomposition runs once, on the first rung
    asked for."""
    if not step > 1:
        raise ValueError(f"the ladder's step must be above 1, got {step!r}")
    at, base, last, rung = fit(), max(1, first), -1, 0
    while True:
        budget = min(full, math.ceil(round(base * step ** rung, 6)))  # 100·√2² is 200, not 201
        patch = at(budget)
        if patch.nbytes != last:
            yield patch
        if budget >= full:
            return
        last, rung = patch.nbytes, rung + 1


def rank_ladder(deltas: list, rank: int, storage: str) -> Iterator[kp.ChunkPatch]:
    """`max_kl`'s rungs for the one-rank fits: the plain fit at `rank` in every layer's K and V,
    twice that, and so on up to the deficit's full rank. Each block is decomposed once, on the
    first rung asked for, and truncated per rung."""
    cap = max(min(d.shape[0], d[0].numel()) for pair in deltas for d in pair)
    fits = fit_with_gains_batch([d for pair in deltas for d in pair], None, precision_for(storage))
    full = [(fk, fv) for (fk, _, _), (fv, _, _) in zip(fits[0::2], fits[1::2])]
    r = min(rank, cap)
    while True:
        yield kp.truncated_patch(full, [(r, r)] * len(deltas), "svd", storage)
        if r >= cap:
            return
        r = min(2 * r, cap)


def fit_patch(host: Host, chunk: Any, exact: list, start: int, probed: Probed | None,
              measured: Callable[[list], None]) -> kp.ChunkPatch:
    """The patch of `chunk` from its KV computed after an antecedent (`exact`, at `start`), by the
    window's settings; `probed` is what the pass recorded, or None. `measured` is told the
    deficit first (the orbit policy sums them)."""
    t0 = time.perf_counter()
    km, stats, s = host.km, host.stats, host.settings
    held = host.canonical(chunk)
    local = relocate_kv(exact, km.specs, km.layout, -start)
    deltas = kp.deficit(local, held)
    measured(deltas)
    text = chunk.inputs.kind == "text"
    tokens, features = _shape(deltas)
    if s.rank is None:
        patch = kp.exact_patch(deltas)
    elif s.max_kl is not None and probed is not None and text:
        if s.rank == BUDGET and s.fit in ALLOCATING:  # the window's own fit, its bytes ×√2 per rung
            rungs = byte_ladder(lambda: allocated(km, s, deltas, held, probed, start, text),
                                budget_bytes(s.patch_bytes, held), budget_bytes(1.0, held))
        else:
            first = max(1, layer_ranks(s, deltas, held)[0][0])
            rungs = rank_ladder(deltas, first, one_rank_storage(s.storage))
        patch = fit_to_kl(km, stats, chunk.ids, held, rungs, s.max_kl, start, probed.before, probed.probe, probed.first)
    else:
        if s.fit in ALLOCATING:
            patch = allocated(km, s, deltas, held, probed, start, text)(_bytes(s, tokens, features, held))
        else:
            metrics = query_metrics(km, probed.probe, start) if s.fit == "query" and probed is not None and text else None
            patch = kp.build_patch(deltas, layer_ranks(s, deltas, held), s.fit, metrics=metrics, storage=s.storage)
        if probed is not None and s.guard:
            patch = guard_chunk(km, stats, chunk.inputs.kind, chunk.ids, held, patch, exact, start, probed.before,
                                probed.probe, probed.first)
    stats.patch_bytes += patch.nbytes
    stats.patched_kv_bytes += budget_bytes(1.0, held)
    stats.seconds["fit_patch"] += time.perf_counter() - t0
    return patch
