"""The patch guard's decision, per layer: keep a low-rank patch's K / V factors only where they lower
the attention-output error of probe rows (a chunk's last rows, whose post-RoPE queries a pass
recorded) below blind reuse's. Pure functions on tensors; the window runs it from its passes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from kamera_core import patch as kp
from kamera_core.rope import RopeSpec
from kamera_core.segment import Segment, merge_states, patch_option_states, segment_state

# A patched option must lower the probe error by this fraction of the error it is compared with
# (per layer), and a whole patch its probe rows' next-token KL by this fraction of blind's.
MARGIN = 0.05

OPTIONS = ("none", "k", "v", "kv")


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


def choose(errors: dict[str, float], margin: float) -> str:
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
                rows: torch.Tensor, queries: Mapping[int, tuple], specs: Sequence[RopeSpec], first: int, start: int,
                margin: float = MARGIN) -> tuple[kp.ChunkPatch, GuardReport]:
    """`patch` with each layer's k / v factors kept or dropped by the probe rows' attention-output error, and the
    report; ValueError unless 0 <= margin < 1. canonical: chunk-local `[T, H, D]` per layer; exact: the pass's KV at
    `start`; antecedent: per layer the segments read before the chunk; rows: the probe rows (`[n]`, chunk-relative);
    queries: per layer (post-RoPE queries `[n, Hq, D]`, scale, sliding window, soft-cap); first: the chunk's first
    token index. Layers without recorded queries keep their patch."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    query_index = first + rows.to(torch.long)
    kept, report = [], []
    for layer, (lp, (ck, cv), (xk, xv), spec) in enumerate(zip(patch.layers, canonical, exact, specs)):
        recorded = queries.get(layer)
        if recorded is None or (lp.k is None and lp.v is None):
            kept.append(lp)
            continue
        q, scale, window, softcap = recorded
        # The antecedent's part is the same for every option: computed once, merged with each by log-sum-exp.
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
        choice = choose(errors, margin)
        kept.append(kp.LayerPatch(lp.k if "k" in choice else None, lp.v if "v" in choice else None))
        report.append(GuardLayer(choice, errors))
    guarded = kp.ChunkPatch(tuple(kept), f"{patch.method}+guard")
    return guarded, GuardReport(tuple(report), patch.nbytes, guarded.nbytes)


def head_patch(lp: kp.LayerPatch | None, rows: int) -> kp.LayerPatch | None:
    """A layer patch restricted to the chunk's first `rows` tokens."""
    if lp is None:
        return None

    def cut(f: kp.Factors | None) -> kp.Factors | None:
        return None if f is None else f.first_rows(rows)

    return kp.LayerPatch(cut(lp.k), cut(lp.v))
