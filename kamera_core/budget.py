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
MIXED = "mixed"  # int8 for a block's leading components, 4 bits for the rest (`budget_mixed`)
STORAGES = ("fp32", "fp16", "bf16", "int8", MIXED)


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
    if storage == MIXED:
        raise ValueError("mixed storage has no single cost per rank (see mixed_bytes); its ranks come from budget_mixed")
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


def mixed_bytes(num_tokens: int, feature_size: int, rank: int, int8_rank: int) -> int:
    """Exact bytes of a "mixed" block of `rank` components, the first `int8_rank` in int8: those
    cost (T + F) + 8 each; the 4-bit ones (T + F) per packed pair (an odd one takes a whole pair)
    plus 8 each for their scales."""
    t, f, r, h = (check_rank(x, n) for x, n in ((num_tokens, "num_tokens"), (feature_size, "feature_size"),
                                                 (rank, "rank"), (int8_rank, "int8_rank")))
    if h > r:
        raise ValueError(f"int8_rank {h} exceeds rank {r}")
    return h * (t + f + 8) + (r - h + 1) // 2 * (t + f) + 8 * (r - h)


def budget_mixed(
    num_tokens: int,
    features: list[tuple[int, int]] | tuple[tuple[int, int], ...],
    budget_bytes: int,
    gains: list[tuple[tuple[Tensor, float], tuple[Tensor, float]]],
    errors: list[tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]],
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per layer `((K rank, K int8 rank), (V rank, V int8 rank))` of a "mixed" patch within
    `budget_bytes`: which components to keep, and which of them in int8 rather than 4 bits.

    gains: as `budget_ranks` (σ² per component, normaliser). errors: per layer and K/V the error
    each component adds when stored in 8 and in 4 bits, `(e8 [n], e4 [n])` in σ²'s unit
    (`kamera_core.mixed.quantisation_errors`). A greedy over two kinds of step, by gain per byte:
    keep the next component in 4 bits (gain σ² − e4, about (T + F)/2 + 8 bytes), or move the next
    4-bit component of a block into int8 (gain e4 − e8, about (T + F)/2 more). The int8 components
    are always a block's leading ones. Each step is charged its exact bytes (`mixed_bytes`); a
    step that no longer fits ends that kind of step for its block.
    """
    if len(gains) != len(features) or len(errors) != len(features):
        raise ValueError(f"gains ({len(gains)}) and errors ({len(errors)}) need one entry per layer ({len(features)})")
    t = check_rank(num_tokens, "num_tokens")
    left = check_rank(budget_bytes, "budget_bytes")
    blocks = []  # (feature size, gains, e8, e4, normaliser)
    for layer, (feats, pair, errs) in enumerate(zip(features, gains, errors)):
        for slot in (0, 1):
            g, norm = pair[slot]
            e8, e4 = (check_tensor(e, f"errors of layer {layer}").detach().to("cpu", torch.float64).flatten()
                      for e in errs[slot])
            g = check_tensor(g, f"gains of layer {layer}").detach().to("cpu", torch.float64).flatten()
            if len(e8) < len(g) or len(e4) < len(g):
                raise ValueError(f"layer {layer}: errors cover {min(len(e8), len(e4))} of {len(g)} components")
            if not (math.isfinite(norm) and norm >= 0):
                raise ValueError(f"normaliser of layer {layer} must be non-negative and finite, got {norm!r}")
            # A zero normaliser (a block with no deficit) is floored as `budget_ranks` floors it.
            blocks.append((check_rank(feats[slot], "feature size"), g.tolist(), e8.tolist(), e4.tolist(),
                           max(float(norm), 1e-30)))
    n = len(blocks)

    def size(f: int, r: int, h: int) -> int:  # mixed_bytes without its argument checks (the hot loop)
        return h * (t + f + 8) + (r - h + 1) // 2 * (t + f) + 8 * (r - h)

    rank, head = [0] * n, [0] * n
    open_step = [[True] * n, [True] * n]  # per kind (0 buy, 1 upgrade): whether the block still takes it
    version = [[0] * n, [0] * n]  # per kind: entries of older versions are stale
    heap: list[tuple[float, int, int, int]] = []  # (−gain per byte, block, kind, version)

    def push(i: int, kind: int) -> None:  # a buy's priority depends on the rank only, an upgrade's on the head
        f, g, e8, e4, norm = blocks[i]
        r, h = rank[i], head[i]
        version[kind][i] += 1
        if not open_step[kind][i]:
            return
        if kind == 0 and r < len(g) and g[r] - e4[r] > 0:
            heapq.heappush(heap, (-(g[r] - e4[r]) / norm / ((t + f) / 2 + 8), i, 0, version[0][i]))
        elif kind == 1 and h < r and e4[h] - e8[h] > 0:
            heapq.heappush(heap, (-(e4[h] - e8[h]) / norm / ((t + f) / 2), i, 1, version[1][i]))

    for i in range(n):
        push(i, 0)
    while heap:
        _, i, kind, ver = heapq.heappop(heap)
        if ver != version[kind][i]:
            continue
        f, r, h = blocks[i][0], rank[i], head[i]
        after = (r + 1, h) if kind == 0 else (r, h + 1)
        cost = size(f, *after) - size(f, r, h)
        if cost > left:
            open_step[kind][i] = False
            version[kind][i] += 1
            continue
        left -= cost
        rank[i], head[i] = after
        push(i, kind)
        if kind == 0 and h == r:  # its first 4-bit component: an upgrade is possible now
            push(i, 1)
    pairs = list(zip(rank, head))
    return [(pairs[2 * layer], pairs[2 * layer + 1]) for layer in range(len(features))]
