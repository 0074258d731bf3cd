"""`python -m tools.binding`: train the binding model, or measure a checkpoint's held-out accuracy.

The task, the model and the trainer are in `tools.bench.binding`; the shipped checkpoint is in
`tools/bench/binding/data/`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from tools.bench.binding import (CHECKPOINT_DIR, LAYOUTS, TRAIN_DEFAULTS, accuracy_blind, accuracy_full, eval_items,
                                   load, record_eval, train)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.binding", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train the binding model from a fixed seed")
    tr.add_argument("--out", default=str(CHECKPOINT_DIR))
    for key, value in TRAIN_DEFAULTS.items():
        tr.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    tr.add_argument("--threads", type=int, default=1)
    tr.add_argument("--layout", choices=sorted(LAYOUTS), default="variable",
                    help="item layout: variable (the task) or fixed-offset (an easier first stage)")
    tr.add_argument("--init", metavar="DIR", default=None, help="start from this checkpoint (a further training stage)")
    ev = sub.add_parser("eval", help="full-context and blind-reuse accuracy of a checkpoint")
    ev.add_argument("--path", default=str(CHECKPOINT_DIR))
    ev.add_argument("--items", type=int, default=1000)
    ev.add_argument("--layout", choices=sorted(LAYOUTS), default="variable", help="item layout (default: the task's)")
    ev.add_argument("--record", action="store_true", help="write the figures into the checkpoint's binding.json")
    args = parser.parse_args(argv)
    if args.cmd == "train":
        train(args.out, args.seed, args.steps, args.batch_size, args.lr, args.warmup, args.weight_decay,
              args.max_minutes, args.eval_every, log=lambda s: print(s, flush=True), threads=args.threads,
              layout=args.layout, init=args.init)
        return 0
    model, tok = load(args.path)
    items = eval_items(args.items, layout=LAYOUTS[args.layout])
    full, blind = accuracy_full(model, tok, items), accuracy_blind(model, tok, items)
    print(f"full context: {full:.4f}  blind reuse: {blind:.4f} ({args.items} held-out items, layout {args.layout})")
    if args.record:
        record_eval(args.path, args.items, full, blind, layout=args.layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
