"""`agentwin bench window`: next-token KL against re-prefill after window operations on SmolLM2.

Four chunks of a generated case are appended ([A, B, E1, E2]); then, from that state:
- recall: B evicted and recalled to its old slot;
- evict: B evicted (the chunks after it lose part of their antecedent);
- reorder: [A, E2, B, E1];
- slide: a fifth chunk appended into a budget that forces A out (survivors move back).
Each is measured with blind reuse (`patch="none"`), rank-16 origin patches, rank-16 orbit patches
(`patch="orbit"`, `fit_orbit` over 6 orders of the four chunks after appending them) and exact
patches (`rank=None`), as mean KL over the case's questions against a re-prefill of
`input_ids(query)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

SCENARIOS = ("append", "recall", "evict", "reorder", "slide")
POLICIES = (("blind", "none", 16), ("origin r16", "origin", 16), ("orbit r16", "orbit", 16),
            ("exact", "origin", None))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=3, help="generated cases (default 3)")
    parser.add_argument("--rank", type=int, default=16, help="rank of the origin patches (default 16)")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")


def _kl(window: Any, questions: list[str]) -> float:
    total = 0.0
    for q in questions:
        # Renormalised in float64: float32 log-probs sum to 1 only to ~1e-7, which alone would
        # make a KL of identical distributions read ±1e-8.
        mine = torch.log_softmax(window.next_token_logprobs(q).double(), -1)
        ref = torch.log_softmax(window.reference_logprobs(q).double(), -1)
        total += float((ref.exp() * (ref - mine)).sum())
    return total / len(questions)


def _scenario(km: Any, case: Any, name: str, policy: str, rank: int | None) -> tuple[float, dict]:
    from agentwin.window import Window

    texts = [case.a, " " + case.b, " " + case.extra_chunks[0], " " + case.extra_chunks[1]]
    sizes = [int(km.tokenize(t).numel()) for t in texts]
    budget = sum(sizes) + (0 if name == "slide" else 4096)
    window = Window(km, budget_tokens=budget, patch=policy, rank=rank)
    a, b, e1, e2 = [window.append(t) for t in texts]
    if policy == "orbit":
        window.fit_orbit(orders=6, seed=0)
    steps: dict[str, Callable[[], None]] = {
        "append": lambda: None,
        "recall": lambda: (window.evict(b), window.recall(b)),
        "evict": lambda: window.evict(b),
        "reorder": lambda: window.reorder([a, e2, b, e1]),
        "slide": lambda: window.append(" Later that week the weather cleared and the town went quiet."),
    }
    steps[name]()
    window.check_integrity()
    kl = _kl(window, list(case.queries))
    s = window.stats()
    return kl, {"conditioned_passes": s.conditioned_passes, "prefill_tokens_avoided": s.prefill_tokens_avoided}


def run(args: argparse.Namespace) -> int:
    from agentwin.models.adapter import KameraModel
    from agentwin.models.zoo import load_smollm2
    from tools.patch_texts import make_case

    if args.seeds < 1 or args.rank < 1:
        print("error: --seeds and --rank must be >= 1", file=sys.stderr)
        return 2
    print("loading SmolLM2-135M-Instruct ...", flush=True)
    model, tokenizer = load_smollm2(torch.float32)
    km = KameraModel(model, tokenizer, name="smollm2")
    policies = [(label.replace("16", str(args.rank)), p, args.rank if r == 16 else r) for label, p, r in POLICIES]
    rows = []
    for seed in range(args.seeds):
        case = make_case(seed)
        for scenario in SCENARIOS:
            for label, policy, rank in policies:
                t0 = time.perf_counter()
                kl, extra = _scenario(km, case, scenario, policy, rank)
                rows.append({"seed": seed, "scenario": scenario, "policy": label, "kl": kl,
                             "seconds": time.perf_counter() - t0, **extra})
        print(f"  seed {seed} done", flush=True)
    table = {sc: {label: statistics.fmean(r["kl"] for r in rows if r["scenario"] == sc and r["policy"] == label)
                  for label, _, _ in policies} for sc in SCENARIOS}
    print(f"\nmean next-token KL vs re-prefill on SmolLM2, {args.seeds} seeds:")
    print(f"{'scenario':<10}" + "".join(f"{label:>14}" for label, _, _ in policies))
    for sc, per in table.items():
        print(f"{sc:<10}" + "".join(f"{per[label]:>14.2e}" for label, _, _ in policies))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"table": table, "rows": rows, "rank": args.rank, "seeds": list(range(args.seeds))}, fh, indent=1)
        print(f"figures written to {args.json}")
    return 0
