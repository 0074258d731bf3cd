"""GPU check of the Triton segment attention: error against the torch reference, and speed against
attention over one contiguous cache holding the same tokens.

    python -m tools.gpu_segment_check --json segment_check.json     # a CUDA GPU, repository root
    TRITON_INTERPRET=1 python -m tools.gpu_segment_check --tiny     # CPU smoke test, seconds

What it measures: `tools.bench.gpu_segment`. Prints a table and a JSON summary (also written to
--json). Exit code: 0 when every correctness check passes, 1 when one fails, 2 when neither CUDA
nor the interpreter is available.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NO_DEVICE_EXIT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the summary here as JSON")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test (CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rope-theta", type=float, default=5e5)
    parser.add_argument("--keys", type=str, default="8192,32768", help="comma-separated key counts")
    parser.add_argument("--segments", type=str, default="4,16,64", help="comma-separated segment counts")
    parser.add_argument("--tq", type=str, default="1,16", help="comma-separated query row counts")
    parser.add_argument("--rank", type=int, default=16, help="patch rank (correctness and the patched timing)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from tools.bench import gpu_segment

    found = gpu_segment.find_device(gpu_segment.apply_tiny(args))
    if found is None:
        print("gpu_segment_check needs a CUDA GPU, or TRITON_INTERPRET=1 with --tiny for the CPU smoke test; "
              "tests/kamera_core/test_triton_segment.py covers correctness on CPU", file=sys.stderr)
        return NO_DEVICE_EXIT
    summary = gpu_segment.measure(args, *found)
    print(gpu_segment.format_tables(summary))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
        print(f"wrote {args.json}")
    return 0 if gpu_segment.passed(summary) else 1


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
