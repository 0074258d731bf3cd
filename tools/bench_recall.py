"""`agentwin bench recall`: time from recalling an evicted segment to the first token, against re-prefill.

Two workloads, each a window with other chunks around one large segment:
- text: the real SmolLM2-135M-Instruct; [register, narrative, SEGMENT (>= 4096 tokens by default),
  two continuation chunks], texts from `tools.bench.datasets`;
- video: a model with Qwen2.5-VL-3B's real text and vision dimensions (random init, fewer layers:
  `--text-layers`, `--vision-layers`); [intro text, SEGMENT = Frames of 64 generated frames,
  two text chunks].

Sides, all in this process with the same `--threads` and inputs, `--repeats` runs each,
interleaved, min and median reported: recall with a rank-`--rank` origin patch, blind recall,
re-prefill of the window and query, and (video) re-prefill with the vision tower's outputs fed
from the window's encoder cache. Every forward of every side is counted and checked against
hooks on the model (`tools.bench.recall` has the details). `--json FILE` writes the figures
and the results page (`--page`, default RECALL.md next to FILE) from them.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

import torch

TARGET_SPEEDUP = 50.0
TARGET_SEGMENT_TOKENS = 4096
TIMED = {
    "origin": "a fresh `Window` over the shared `ChunkStore` (every chunk's canonical KV and origin patch come from "
              "the store: no forward), the segment evicted and the window read once without it (untimed); timed: "
              "`win.recall(seg)`, `win.next_token_logprobs(query)` and the argmax. Segment attention reads the "
              "segment's canonical KV and patch where the store holds them, at its slot, and the chunks after it "
              "back at theirs; no KV is copied; the query runs through the model.",
    "blind": "the same with `patch=\"none\"` (no patch applied).",
    "reprefill": "`model(**reference_inputs, use_cache=True, logits_to_keep=1)` and the argmax: the model's own "
                 "forward over the whole window and the query, the vision tower included for frames (pixels "
                 "already processed: resizing is not timed on any side).",
    "reprefill_cached_vision": "the same forward with the vision tower's outputs for the frames passed through "
                               "transformers' `mm_encoder_outputs` instead of pixels, taken from the window's "
                               "`EncoderCache` (as a serving engine's multimodal cache keeps them): the whole LLM "
                               "prefill again, no vision-tower run.",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE and the results page beside it")
    parser.add_argument("--page", metavar="FILE", help="the results page (default: RECALL.md next to the --json file)")
    parser.add_argument("--quick", action="store_true",
                        help="small random-init models and sizes (a check of the command, not a measurement)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; min and median (default 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads on every side (default 1: on a shared machine more threads contend)")
    parser.add_argument("--rank", type=int, default=16, help="rank of the origin patches (default 16)")
    parser.add_argument("--segment-tokens", type=int, default=TARGET_SEGMENT_TOKENS,
                        help="minimum tokens of the text segment (default 4096)")
    parser.add_argument("--frames", type=int, default=64, help="frames in the video segment (default 64)")
    parser.add_argument("--frame-tokens", type=int, default=128,
                        help="tokens per frame pair (a temporal patch) of the video segment (default 128)")
    parser.add_argument("--text-layers", type=int, default=4, help="text layers of the Qwen2.5-VL-3B-sized model (default 4)")
    parser.add_argument("--vision-layers", type=int, default=4,
                        help="vision-tower blocks of the Qwen2.5-VL-3B-sized model (default 4)")
    parser.add_argument("--workloads", default="text,video", help="comma-separated: text, video (default both)")


def _refused(args: argparse.Namespace, workloads: list[str]) -> str | None:
    for value, flag in [(args.repeats, "--repeats"), (args.threads, "--threads"), (args.rank, "--rank"),
                        (args.text_layers, "--text-layers"), (args.vision_layers, "--vision-layers"),
                        (args.frame_tokens, "--frame-tokens")]:
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.frames < 2:
        return f"--frames must be >= 2 (one temporal patch), got {args.frames}"
    if args.segment_tokens < 16:
        return f"--segment-tokens must be >= 16, got {args.segment_tokens}"
    if not workloads or set(workloads) - {"text", "video"}:
        return f"--workloads takes text and/or video, got {args.workloads!r}"
    return None


def run(args: argparse.Namespace) -> int:
    from tools.bench import recall, recall_page, runs

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    problem = _refused(args, workloads)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.quick:
        segment_tokens, n_frames, frame_tokens, text_layers, vision_layers = 768, 16, 128, 2, 2
    else:
        segment_tokens, n_frames, frame_tokens = args.segment_tokens, args.frames, args.frame_tokens
        text_layers, vision_layers = args.text_layers, args.vision_layers

    def log(message: str) -> None:
        print(message, flush=True)

    load_start = runs.load_average()
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for name in workloads:
        if name == "text":
            wl = recall.text_workload(args.quick, segment_tokens, log)
        else:
            wl = recall.video_workload(args.quick, text_layers, vision_layers, n_frames, frame_tokens, log)
        results[name] = recall.measure(wl, args.repeats, args.rank, log)
        if name == "video":
            results[name].update(frames=n_frames, text_layers=text_layers, vision_layers=vision_layers,
                                 real_layers={"text": recall.QWEN25VL_3B_LAYERS[0], "vision": recall.QWEN25VL_3B_LAYERS[1]})
        del wl
        gc.collect()
    data = {
        "command": runs.command_of("agentwin bench recall", args, add_arguments),
        "workloads": results,
        "target": {"speedup_vs_reprefill": TARGET_SPEEDUP, "segment_tokens": TARGET_SEGMENT_TOKENS},
        "timed": TIMED,
        "rank": args.rank, "repeats": args.repeats, "threads": args.threads, "quick": args.quick,
        "dtype": "float32", "machine": runs.machine(),
        "load_average_start": load_start, "load_average_end": runs.load_average(),
        "seconds_total": time.perf_counter() - started,
    }
    runs.write_results(data, recall_page.render, args.json, args.page, "RECALL.md")
    return 0
