"""A chunk's patch from the KV of a pass the window ran anyway (in-context or conditioned): its deficit against the
canonical KV, fitted by the window's checked `PatchSettings`. Fits: svd, query, alloc, output*, residual (default);
storage: int8, mixed, auto (default), fp16, bf16, fp32; then the optional guard or `max_kl` (`agentwin.patches.guard`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from agentwin.patches.guard import QueryProbe, fit_to_kl, guard_chunk
from agentwin.patches.host import Host, Probed
from agentwin.models import residual
from agentwin.models.kv import relocate_kv
from kamera_core import budget as kb, fit_metric as fm, mixed, patch as kp
from kamera_core.fit_batch import byte_ladder, fit_with_gains_batch, precision_for, rank_ladder
from kamera_core.relocate import relocate_keys

RESIDUAL = "residual"
FITS = ("svd", "query", "alloc", *fm.OUTPUT_FITS, RESIDUAL)
QUERY_FITS = ("query", *fm.OUTPUT_FITS, RESIDUAL)  # fits that read the queries of the chunk's pass
OUTPUT_LIKE = (*fm.OUTPUT_FITS, RESIDUAL)  # the allocator on each layer's output error
ALLOCATING = ("alloc", *OUTPUT_LIKE)  # fits whose ranks come from the byte allocator
BUDGET = "budget"
DEFAULT_PATCH_BYTES = 0.06
AUTO = "auto"
# guard="auto" turns the guard on below this byte budget (and for rank=N windows, whose share of the bytes depends
# on the chunk): only below it can the allocator's patch read worse than blind reuse, and the guard costs passes.
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
        """What a chunk's pass of `tokens` tokens records for the fit, or None: the last rows (guard, max_kl), every
        row's queries (query-metric fits), the residual stream (fit="residual")."""
        if not self.probed:
            return None
        checked = self.guard or self.max_kl is not None
        return QueryProbe.last_rows(tokens, **({} if checked else {"count": 1}), keep_all=self.fit in QUERY_FITS,
                                    keep_residual=self.fit == RESIDUAL)


def patch_settings(km: Any, rank: Any, patch_bytes: Any, storage: str, guard: Any, max_kl: Any,
                   fit: str) -> PatchSettings:
    """Checked settings for the model `km`; ValueError / TypeError say what to pass. MLA models get plain fits, no
    guard, no max_kl; fit="residual" is refused for a model whose layers do not show their output projection."""
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
    """Per layer `(K metric, None)`: the per-KV-head second moment of the pass's queries of all the chunk's rows
    (`probe.full`, `[Tq, Hq, D]`), rotated back by `start` into the chunk-local frame."""
    return [(fm.query_second_moment(relocate_keys(probe.full[layer].float(), spec, -start, backend="torch"),
                                    km.layout.num_kv_heads), None)
            for layer, spec in enumerate(km.specs)]


def budget_bytes(fraction: float, held: Any) -> int:
    """`fraction` of the bytes of `held`, a chunk's canonical KV (per layer K and V tensors)."""
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
    """Per layer (K rank, V rank), one rank everywhere: the window's, or the largest within its byte budget."""
    if s.rank != BUDGET:
        return [(s.rank, s.rank)] * len(deltas)
    tokens, features = _shape(deltas)
    return kb.budget_ranks(tokens, features, _bytes(s, tokens, features, held), one_rank_storage(s.storage))


def one_rank_storage(storage: str) -> str:
    """The factors' form when one rank is set for every layer: int8 under "mixed" (an allocator-only choice)."""
    return "int8" if storage == kb.MIXED else storage


def allocator_fit(s: PatchSettings, deltas: list, held: Any, metrics: list | None = None, exponent: float = 1.0,
                  value_metrics: list | None = None, norms: list | None = None) -> Callable[[int], kp.ChunkPatch]:
    """Decomposes each layer's K and V deficit once and returns `at(budget_bytes)`, the allocator's patch within
    those bytes, stored as `s.storage`; `at` may be called repeatedly. Gains are energy-normalised by default; with
    `metrics` (per layer the K output metric) K is fitted in it and both blocks normalised by the layer's value
    spread to the power `exponent`; with `value_metrics` and `norms` too, V in its metric and both by `norms`."""
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
    """Per layer the K metric of fit="output": the query metric scaled per head by the spread of the chunk's
    canonical values, taken in `value_metrics` where given (fit="residual")."""
    vs = [None] * len(held) if value_metrics is None else value_metrics
    return [fm.output_metric(mk, hv, mv) for (mk, _), (_, hv), mv in zip(query_metrics(km, probe, start), held, vs)]


def residual_fit(km: Any, s: PatchSettings, deltas: list, held: Any, probe: Any,
                 start: int) -> Callable[[int], kp.ChunkPatch]:
    """fit="residual"'s `at(budget_bytes)`: the allocator on each layer's K and V error where it lands in the
    residual stream, relative to Σ ||h||² of the stream entering the layer over the chunk's rows in the pass."""
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


def fit_patch(host: Host, chunk: Any, exact: list, start: int, probed: Probed | None,
              measured: Callable[[list], None]) -> kp.ChunkPatch:
    """The patch of `chunk` from its KV computed after an antecedent (`exact`, at `start`), by `host.settings`;
    `probed`: what the pass recorded, or None; `measured` gets the deficit first. Counts bytes and time in
    `host.stats`."""
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
