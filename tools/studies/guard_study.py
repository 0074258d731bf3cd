"""Does the patch guard do no harm? Blind reuse, plain SVD patches and guarded patches of the
window itself, on the hard cases (`tools.bench.hard_cases`), at 1.5–25% of B's fp16 KV bytes;
keys fitted in the metric of the chunk's own queries (`fit="query"`), all these with fp16
factors at one rank; the window's default fit within the same bytes (`Window(patch_bytes=...)`:
ranks spread over layers and K/V, the window's default storage, and int8 factors) without the guard, at the window's default
(`guard="auto"`: on below 6%) and always guarded; then the window with the
case's noise floor as its fidelity target (`Window(max_kl=...)`): at its defaults (the default
fit's bytes ×√2 per rung from the default budget) and with one rank everywhere (plain SVD, fp16
factors, from the smallest budget's rank).

    python -m tools.studies.guard_study [--cases code,roles] [--json FILE] [--floor-only]

For each case, A then B are appended to a `Window`; B is evicted and recalled to the same slot,
so it is served from canonical KV plus the stored patch (none for blind reuse), and each
question's next-token KL is taken against the window's own full re-prefill. The rank of each
budget is the largest uniform rank whose K and V factors fit it. The noise floor is the KL of a
bfloat16 re-prefill against the float32 one on the same inputs. It depends on the CPU's bfloat16
path (oneDNN's instruction set: AMX, AVX-512 or AVX2), which the JSON records (`bf16_path`);
`ONEDNN_MAX_CPU_ISA=AVX2 python -m tools.studies.guard_study --floor-only` measures the floors
alone under a capped one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Sequence

import torch

from tools.bench.hard_cases import CASES, HardCase, parse_case_names
from tools.bench.harness import TARGET_KL
from tools.bench.runs import bf16_path
from kamera_core import budget as kb
from kamera_core.metrics import kl_divergence

BUDGETS = (0.015, 0.03, 0.06, 0.12, 0.25)
FP16 = {"fit": "svd", "storage": "fp16"}  # the rank-based rows: the window's fit before the byte-budget default


def _served(km: Any, case: HardCase, **window_args: Any) -> tuple[Any, int]:
    from agentwin.patches.policies import DEFAULT_PATCH_POLICY
    from agentwin.window import Window

    window = Window(km, budget_tokens=1 << 20, **{"patch": DEFAULT_PATCH_POLICY, **window_args})
    window.append(case.a)
    b = window.append(case.b)
    window.evict(b)
    window.recall(b)
    return window, b


def _kl(window: Any, case: HardCase, references: Sequence[torch.Tensor]) -> float:
    return statistics.fmean(kl_divergence(ref, window.next_token_logprobs(q), log_probs=True)
                            for ref, q in zip(references, case.questions))


def rank_for(budget: float, tokens: int, k_features: int, v_features: int, layers: int) -> int:
    """Largest uniform rank whose fp16 K and V factors take at most `budget` of the chunk's fp16 KV."""
    kv_bytes = layers * tokens * (k_features + v_features) * 2
    per_rank = layers * (kb.bytes_per_rank(tokens, k_features, "fp16") + kb.bytes_per_rank(tokens, v_features, "fp16"))
    return max(1, int(budget * kv_bytes // per_rank))


def noise_floor(bf16: Any, window: Any, case: HardCase, references: Sequence[torch.Tensor]) -> float:
    """Mean next-token KL over the case's questions of `bf16` (the model in bfloat16, re-prefilling
    the window's whole input) against the float32 references."""
    floors = []
    for ref, q in zip(references, case.questions):
        ids = window.input_ids(q)[None]
        with torch.no_grad():
            low = bf16(input_ids=ids).logits[0, -1].float()
        floors.append(kl_divergence(ref, torch.log_softmax(low, -1), log_probs=True))
    return statistics.fmean(floors)


def measure_case(km: Any, case: HardCase, budgets: Sequence[float] = BUDGETS, bf16: Any = None, log=print,
                 floor_only: bool = False) -> dict:
    """Blind, svd and guarded KL per budget for one case (and the bf16 noise floor with `bf16`,
    the same model in bfloat16); blind reuse and the floor alone with `floor_only`."""
    window, b = _served(km, case, patch="none")
    references = [window.reference_logprobs(q) for q in case.questions]
    blind = _kl(window, case, references)
    k, v = window.inspect(b).canonical[0]
    tokens, layers = int(k.shape[0]), len(km.specs)
    kv_bytes = layers * tokens * (k[0].numel() + v[0].numel()) * 2
    row: dict[str, Any] = {"case": case.name, "b_tokens": tokens, "blind": blind, "budgets": []}
    if bf16 is not None:
        row["noise_floor"] = noise_floor(bf16, window, case, references)
    log(f"{case.name}: B {tokens} tokens, blind KL {blind:.4f}" +
        (f", bf16 noise floor {row['noise_floor']:.2e}" if bf16 is not None else ""))
    if floor_only:
        return row
    for budget in budgets:
        rank = rank_for(budget, tokens, k[0].numel(), v[0].numel(), layers)
        entry: dict[str, Any] = {"budget": budget, "rank": rank}
        held = sum(x.numel() * x.element_size() for kv in window.inspect(b).canonical for x in kv)
        by_bytes = {"rank": "budget", "patch_bytes": budget * kv_bytes / held}  # the same bytes, as the window counts
        for name, settings in (("svd", {"rank": rank, "guard": False, **FP16}),
                               ("guard", {"rank": rank, "guard": True, **FP16}),
                               ("query", {"rank": rank, "guard": False, **FP16, "fit": "query"}),
                               ("window-noguard", {**by_bytes, "guard": False}),
                               ("window-int8", {**by_bytes, "guard": False, "storage": "int8"}), ("window", by_bytes),
                               ("window+guard", {**by_bytes, "guard": True})):
            window, b = _served(km, case, **settings)
            kl = _kl(window, case, references)  # reads the stored patch back
            patch = next(iter(window.inspect(b).patches.values()))
            stats = window.stats()
            entry[name] = {"kl": kl, "bytes_frac": patch.nbytes / kv_bytes,
                           "fallback": bool(stats.guard_fallbacks), "kept": stats.guard_checked - stats.guard_dropped,
                           "checked": stats.guard_checked}
        g, s, q, wn, w8, w, wg = (entry[n] for n in ("guard", "svd", "query", "window-noguard", "window-int8", "window",
                                                     "window+guard"))
        log(f"  {budget:6.1%} rank {rank:3d}: svd KL {s['kl']:.4f} ({s['bytes_frac']:.2%})  guarded KL {g['kl']:.4f} "
            f"({g['bytes_frac']:.2%}, kept {g['kept']}/{g['checked']}{', blind' if g['fallback'] else ''})  "
            f"query-metric KL {q['kl']:.4f}  window fit unguarded KL {wn['kl']:.4f} ({wn['bytes_frac']:.2%}; int8 "
            f"factors {w8['kl']:.4f}), "
            f"default {w['kl']:.4f} (guard {'on' if w['checked'] else 'off'}), guarded {wg['kl']:.4f}")
        row["budgets"].append(entry)
    # A fidelity target instead of a rank: the case's own noise floor (or TARGET_KL without one),
    # with the window's defaults (its fit's bytes ×√2 per rung from its default budget) and
    # with one rank everywhere (plain SVD, fp16 factors, doubled per rung from the smallest budget's rank).
    target = row.get("noise_floor", TARGET_KL)
    for key, settings in (("max_kl", {}),
                          ("max_kl_rank", {"rank": rank_for(budgets[0], tokens, k[0].numel(), v[0].numel(), layers),
                                           **FP16})):
        window, b = _served(km, case, max_kl=target, **settings)
        kl = _kl(window, case, references)
        patch = next(iter(window.inspect(b).patches.values()))
        stats = window.stats()
        row[key] = {"target": target, "kl": kl, "bytes_frac": patch.nbytes / kv_bytes,
                    "ranks_kept": list(stats.kl_ranks), "probe_forwards": stats.forwards["guard"],
                    "seconds": stats.seconds["guard"]}
        log(f"  {key} {target:.2e}: KL {kl:.4f} ({patch.nbytes / kv_bytes:.2%}, largest rank kept "
            f"{row[key]['ranks_kept']}, {row[key]['probe_forwards']} probe forwards, {row[key]['seconds']:.2f} s)")
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated hard cases")
    parser.add_argument("--no-floor", action="store_true", help="skip the bf16 noise floor")
    parser.add_argument("--floor-only", action="store_true",
                        help="blind reuse and the bf16 noise floor only, no patches")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.floor_only and args.no_floor:
        parser.error("--floor-only measures the floor: drop --no-floor")
    names = parse_case_names(parser, args.cases)
    torch.set_num_threads(1)
    from tools.bench.runs import load_average
    from agentwin.models.adapter import KameraModel
    from agentwin.models.zoo import load_smollm2

    load_start = load_average()
    km = KameraModel.from_pretrained("smollm2")
    bf16 = None if args.no_floor else load_smollm2(torch.bfloat16)[0]
    path = bf16_path()
    print("bf16 path: " + ", ".join(f"{k} {v}" for k, v in path.items()))
    rows = [measure_case(km, CASES[name], bf16=bf16, floor_only=args.floor_only) for name in names]
    for row in rows if not args.floor_only else ():
        for name in ("guard", "window-noguard", "window", "window+guard"):
            worse = [e["budget"] for e in row["budgets"] if e[name]["kl"] > row["blind"]]
            quarter = [e["budget"] for e in row["budgets"] if e["budget"] <= 0.06 and e[name]["kl"] > 0.25 * row["blind"]]
            print(f"{row['case']} {name}: worse than blind at {worse or 'no budget'}; "
                  f"above 25% of blind at <=6% bytes: {quarter or 'none'}")
    if args.json:
        with open(args.json, "w") as fh:
            isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
            json.dump({"command": (f"ONEDNN_MAX_CPU_ISA={isa} " if isa else "") + "python -m tools.studies.guard_study "
                       + " ".join(argv or sys.argv[1:]),
                       "threads": 1, "loadavg_start": load_start, "loadavg_end": load_average(),
                       "bf16_path": path, "cases": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
