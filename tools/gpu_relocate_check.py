"""GPU check of the Triton relocate: speed against a plain device copy, and error against torch.

    python -m tools.gpu_relocate_check --json out.json     # a CUDA GPU, repository root

What it measures: `tools.bench.gpu_relocate`. Without CUDA it prints why and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NO_GPU_EXIT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per layer (>= 4096 for the check)")
    parser.add_argument("--rope-theta", type=float, default=1e6, help="Qwen2.5-VL-7B's rope_theta")
    parser.add_argument("--delta", type=int, default=12345, help="position shift")
    parser.add_argument("--rank", type=int, default=16, help="patch rank for the patched timing (0 skips it)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50, help="launches per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    import torch

    from tools.bench import gpu_relocate

    if not torch.cuda.is_available():
        print("gpu_relocate_check needs a CUDA GPU (torch.cuda.is_available() is False); "
              "on CPU the interpreter tests in tests/kamera_core/test_triton_relocate.py cover correctness",
              file=sys.stderr)
        return NO_GPU_EXIT
    record = gpu_relocate.measure(args, torch.device("cuda", 0))
    print(gpu_relocate.format_table(record))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
