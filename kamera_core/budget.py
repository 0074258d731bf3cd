"""Byte budgets for patches: what one more rank costs, and how ranks are shared across the
layers, K/V tensors and heads of a chunk under one budget (a greedy knapsack over the gains of
`kamera_core.patch.gains`).

Also the argument checks every module of kamera_core shares.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Hashable, Mapping

import torch

Tensor = torch.Tensor

FLOAT_STORAGE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STORAGES = ("fp32", "fp16", "bf16", "int8")


def check_tensor(x: object, what: str) -> Tensor:
    """`x` itself if it is a tensor; a TypeError naming `what` otherwise."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_rank(rank: object, what: str = "rank") -> int:
    """A non-negative int (numpy and 0-d torch ints accepted; bools refused)."""
    if isinstance(rank, bool) or not hasattr(rank, "__index__"):  # ints, numpy and 0-d torch ints
        raise TypeError(f"{what} must be an int, got {type(rank).__name__} {rank!r}")
    if (value := operator.index(rank)) < 0:  # type: ignore[arg-type]
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


def bytes_per_rank(num_tokens: int, feature_size: int, storage: str) -> int:
    """Exact bytes one more rank costs: one column of u `[T]` plus one row of vt `[F]`, and for
    int8 its two float32 scales: (T + F)·itemsize, or (T + F) + 8 for "int8"."""
    t, f = check_rank(num_tokens, "num_tokens"), check_rank(feature_size, "feature_size")
    if storage == "int8":
        return t + f + 2 * 4
    if storage not in FLOAT_STORAGE:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    return (t + f) * FLOAT_STORAGE[storage].itemsize


def allocate_ranks(
    candidates: Mapping[Hashable, tuple[Tensor, float, int]],
    budget_bytes: int,
    max_rank: Mapping[Hashable, int] | None = None,
) -> dict[Hashable, int]:
    """Ranks per candidate maximising Σ (kept σ² / normaliser) within `budget_bytes`, greedily.

    candidates: key (e.g. `(layer, "k")`) → (σ² `[n]` non-increasing, normaliser > 0 that makes
    gains comparable, e.g. the canonical tensor's energy in the same metric, bytes per rank > 0).
    Order: repeatedly give one rank to the candidate whose next component has the largest
    (σ²_next / normaliser) / bytes_per_rank among those whose next rank still fits; ties go to
    the key that comes first in `candidates`. A candidate whose next rank does not fit is dropped
    (the budget only shrinks), components with σ² = 0 are never bought, and `max_rank[key]` caps
    a key. Returns rank per key (0 allowed).
    With equal bytes per rank this is optimal: the objective is a sum of concave (decreasing
    gain) per-candidate terms, so the best n-rank set is the n largest gains. With unequal bytes it
    is the density greedy of a knapsack, within one component's gain of the optimum.
    """
    budget = check_rank(budget_bytes, "budget_bytes")
    keys = list(candidates)
    gain_lists, norms, costs, limits = [], [], [], []
    for key in keys:
        g, norm, cost = candidates[key]
        g = check_tensor(g, f"gains of {key!r}").detach().to("cpu", torch.float64).flatten()
        if bool((g[1:] > g[:-1]).any()) or bool((g < 0).any()):
            raise ValueError(f"gains of {key!r} must be non-negative and non-increasing")
        if not (math.isfinite(norm) and norm > 0):
            raise ValueError(f"normaliser of {key!r} must be positive and finite, got {norm!r}")
        if check_rank(cost, f"bytes per rank of {key!r}") == 0:
            raise ValueError(f"bytes per rank of {key!r} must be positive")
        cap = len(g) if max_rank is None or key not in max_rank else check_rank(max_rank[key], f"max_rank[{key!r}]")
        gain_lists.append(g.tolist())
        norms.append(float(norm))
        costs.append(int(cost))
        limits.append(min(cap, len(g)))
    ranks = [0] * len(keys)
    heap: list[tuple[float, int]] = []  # (−score of the next component, key index): ties → first key

    def push(i: int) -> None:
        r = ranks[i]
        if r < limits[i] and gain_lists[i][r] > 0:
            heapq.heappush(heap, (-gain_lists[i][r] / norms[i] / costs[i], i))

    for i in range(len(keys)):
        push(i)
    while heap:
        _, i = heapq.heappop(heap)
        if costs[i] > budget:
            continue  # dropped for good: the budget only shrinks
        budget -= costs[i]
        ranks[i] += 1
        push(i)
    return dict(zip(keys, ranks))


def budget_ranks(
    num_tokens: int,
    features: list[tuple[int, int]] | tuple[tuple[int, int], ...],
    budget_bytes: int,
    storage: str,
    gains: list[tuple[tuple[Tensor, float], tuple[Tensor, float]]] | None = None,
) -> list[tuple[int, int]]:
    """Per layer `(K rank, V rank)` of a `num_tokens`-token chunk's patch within `budget_bytes`.

    features: per layer the feature sizes of K and V (what one token's row holds).
    gains None: the largest rank that every layer's K and V can take alike (uniform).
    gains: per layer `((σ²_K, energy_K), (σ²_V, energy_V))` (`kamera_core.patch.gains`): ranks
        spread over layers and K/V by `allocate_ranks`, each block's gains normalised by its
        energy (a relative error bought per byte).
    """
    costs = [(bytes_per_rank(num_tokens, fk, storage), bytes_per_rank(num_tokens, fv, storage)) for fk, fv in features]
    budget = check_rank(budget_bytes, "budget_bytes")
    if gains is None:
        rank = budget // max(1, sum(ck + cv for ck, cv in costs))
        return [(rank, rank)] * len(costs)
    if len(gains) != len(costs):
        raise ValueError(f"gains has {len(gains)} layers for {len(costs)} layers of features")
    candidates = {}
    for layer, (((gk, ek), (gv, ev)), (ck, cv)) in enumerate(zip(gains, costs)):
        candidates[(layer, 0)] = (gk, max(ek, 1e-30), ck)
        candidates[(layer, 1)] = (gv, max(ev, 1e-30), cv)
    if budget == 0:
        return [(0, 0)] * len(costs)
    alloc = allocate_ranks(candidates, budget)
    return [(alloc[(layer, 0)], alloc[(layer, 1)]) for layer in range(len(costs))]
