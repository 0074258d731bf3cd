"""`agentwin bench recall`: time from recalling an evicted chunk to the first token, against re-prefill.

Two workloads, each a window with other chunks around one large segment:
- text: the real SmolLM2-135M-Instruct; [register, narrative, SEGMENT (>= 4096 tokens by default),
  two continuation chunks], texts from `tools.patch_texts`;
- video: a model with Qwen2.5-VL-3B's real text and vision dimensions (random init, fewer layers:
  `--text-layers`, `--vision-layers`); [intro text, SEGMENT = Frames of 64 generated frames,
  two text chunks].

What is timed, per workload (float32, CPU, `--threads` torch threads, segment attention for reused
KV and SDPA for fresh tokens, as the library runs):
- recall (patched, `patch="origin"`, rank 16): `win.recall(seg)` then `win.next_token_logprobs(query)`
  and the argmax (the first greedy token). Each repeat uses a fresh Window over one shared
  ChunkStore, so the canonical KV and the origin patch come from the store (no encode, no
  conditioned pass: checked), the segment is evicted before the window is first read (that read,
  untimed, places the other chunks where they sit without the segment), and the timed call then
  really places it again: segment attention reads the segment's canonical KV and patch where the
  store holds them, at its slot, and the chunks after it back at theirs (no KV is copied), and the
  query runs through the model. The window's stats are checked after each timed
  call (relocations of the segment and every chunk after it, no forward pass spent on them, and
  the patch served for origin).
- blind recall: the same with `patch="none"` (no patch applied).
- re-prefill: `model(**win.reference_inputs(query), logits_to_keep=1)` with the cache kept, the
  model's own forward over the whole window and the query (the vision tower included for frames),
  plus the argmax. Pixels are already processed (resizing is not timed).
Median of `--repeats` runs each; `speedup_vs_reprefill` = re-prefill / patched recall,
`patch_overhead_vs_blind` = patched recall / blind recall. The one-time cost of appending the
segment (encode alone + the conditioned pass that fits its origin patch) is reported beside them,
with the next-token KL of each reuse against the re-prefill and whether the first tokens agree.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

TARGET_SPEEDUP = 50.0
TARGET_SEGMENT_TOKENS = 4096
POLICIES = (("origin", "origin"), ("blind", "none"))
# Qwen2.5-VL-3B-Instruct's published dimensions (text: 36 layers; vision tower: 32 blocks).
QWEN25VL_3B_TEXT = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                        vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                                   "mrope_section": [16, 24, 24]})
QWEN25VL_3B_VISION = dict(hidden_size=1280, out_hidden_size=2048, intermediate_size=3420, num_heads=16, patch_size=14,
                          temporal_patch_size=2, spatial_merge_size=2, window_size=112, in_channels=3, hidden_act="silu")
QWEN25VL_3B_LAYERS = (36, 32)
QWEN25VL_TOKENS = dict(vision_start_token_id=151652, vision_end_token_id=151653, image_token_id=151655,
                       video_token_id=151656, bos_token_id=151643, eos_token_id=151645)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    parser.add_argument("--quick", action="store_true",
                        help="small random-init models and sizes (a check of the command, not a measurement)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path; medians are reported (default 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared machine more threads contend)")
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


@dataclass
class Workload:
    """A window's contents with the segment to evict and recall, and the query read after it."""

    name: str
    km: Any
    model: str  # description for the table and JSON
    contents: list[Any]
    segment: int  # index into contents
    query: str


# ---- models and contents ------------------------------------------------------------------------


def _text_workload(quick: bool, segment_tokens: int, log: Callable[[str], None]) -> Workload:
    from agentwin.models.adapter import KameraModel
    from tools.patch_texts import make_case

    if quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        # SmolLM2-135M's width, 4 layers, a byte vocabulary: random init, for the quick check only.
        config = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=32768,
                             rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        km = KameraModel(model, None, name="smollm2-width-4-layers-random")
        description = "Llama-style, SmolLM2-135M width (576 hidden, 9 heads, 3 KV heads), 4 layers, random init, byte tokens, float32"
    else:
        log("loading SmolLM2-135M-Instruct ...")
        km = KameraModel.from_pretrained("smollm2", dtype=torch.float32)
        layers = km.model.config.num_hidden_layers
        description = f"SmolLM2-135M-Instruct (real weights, {layers} layers), float32, segment attention (SDPA for fresh tokens)"
    case = make_case(0)
    segment, seed = "", 1
    while km.tokenize(segment).numel() < segment_tokens:
        segment += " " + make_case(seed).b
        seed += 1
    contents = [case.a, " " + case.b, segment, " " + case.extra_chunks[0], " " + case.extra_chunks[1]]
    if quick:  # byte tokens: keep the quick window small
        contents = [c[:segment_tokens] if i == 2 else c[:240] for i, c in enumerate(contents)]
    return Workload("text", km, description, contents, 2, " " + case.queries[0])


def qwen25vl_3b_config(text_layers: int, vision_layers: int, quick: bool = False) -> Any:
    """A transformers Qwen2_5_VLConfig with Qwen2.5-VL-3B's dimensions and the given layer counts
    (quick: much narrower, for the command's check only). The last vision block attends fully, the
    others in windows, as in the real tower (full attention every 8th block)."""
    from transformers import Qwen2_5_VLConfig

    text = {**QWEN25VL_3B_TEXT, "num_hidden_layers": text_layers}
    vision = {**QWEN25VL_3B_VISION, "depth": vision_layers,
              "fullatt_block_indexes": [i for i in range(vision_layers) if i % 8 == 7] or [vision_layers - 1]}
    if quick:
        text.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    rope_parameters={**QWEN25VL_3B_TEXT["rope_parameters"], "mrope_section": [8, 12, 12]})
        vision.update(hidden_size=128, out_hidden_size=256, intermediate_size=256, num_heads=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **QWEN25VL_TOKENS)


def make_frames(count: int, width: int, height: int, seed: int = 0) -> list[Any]:
    """`count` [H, W, 3] uint8 frames: a colour gradient, a bright square that moves, seeded noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for i in range(count):
        frame = np.stack([(x * 255 // max(width - 1, 1) + 3 * i) % 256, (y * 255 // max(height - 1, 1)),
                          np.full_like(x, (7 * i) % 256)], -1).astype(np.int16)
        side = max(height // 4, 1)
        left, top = (i * 5) % max(width - side, 1), (i * 3) % max(height - side, 1)
        frame[top:top + side, left:left + side] = 250
        frame += rng.integers(-12, 13, frame.shape, dtype=np.int16)
        frames.append(np.clip(frame, 0, 255).astype(np.uint8))
    return frames


def _video_workload(quick: bool, text_layers: int, vision_layers: int, n_frames: int, frame_tokens: int,
                    log: Callable[[str], None]) -> Workload:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from agentwin.models.adapter import KameraModel
    from agentwin.window import Frames

    log(f"building a Qwen2.5-VL-3B-sized model ({text_layers} text layers, {vision_layers} vision layers"
        f"{', narrow quick variant' if quick else ''}), random init ...")
    config = qwen25vl_3b_config(text_layers, vision_layers, quick)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    km = KameraModel(model, None, name="qwen2.5-vl-3b-dims-random")
    if quick:
        description = (f"Qwen2.5-VL layout, narrow (text hidden 256, vision hidden 128), {text_layers} text + "
                       f"{vision_layers} vision layers, random init, byte tokens, float32")
    else:
        description = (f"Qwen2.5-VL-3B dimensions (text hidden 2048, MLP 11008, 16 heads, 2 KV heads, vocab 151936, "
                       f"M-RoPE [16, 24, 24]; vision hidden 1280, MLP 3420, 16 heads, patch 14, merge 2), "
                       f"{text_layers} of {QWEN25VL_3B_LAYERS[0]} text layers and {vision_layers} of "
                       f"{QWEN25VL_3B_LAYERS[1]} vision blocks, random init, byte tokens, float32, segment attention (SDPA for fresh tokens)")
    # A frame of 2:1 aspect whose patch grid gives `frame_tokens` merged tokens per temporal patch.
    factor = config.vision_config.patch_size * config.vision_config.spatial_merge_size
    rows = max(1, int(round((frame_tokens / 2) ** 0.5)))
    cols = max(1, frame_tokens // rows)
    frames = make_frames(n_frames, cols * factor, rows * factor)
    tokens = rows * cols
    segment = Frames(frames, fps=2.0, min_tokens=tokens, max_tokens=tokens)
    contents = ["Camera 3, loading bay, morning shift. The clip below shows the conveyor from above.",
                segment, " After the clip the operator stopped the belt and logged the count.",
                " The next delivery was due at noon."]
    return Workload("video", km, description, contents, 1, " What moved?")


# ---- timing -------------------------------------------------------------------------------------


def _snapshot(win: Any) -> dict[str, int]:
    s = win.stats()
    return {k: int(getattr(s, k)) for k in ("relocations", "prefill_tokens_avoided", "conditioned_passes",
                                             "patch_hits", "canonical_hits", "encoder_calls")}


def _kl(ref: torch.Tensor, mine: torch.Tensor) -> float:
    ref, mine = torch.log_softmax(ref.double(), -1), torch.log_softmax(mine.double(), -1)
    return float((ref.exp() * (ref - mine)).sum())


def _reprefill(win: Any, query: str) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    kw = win.reference_inputs(query)
    with torch.no_grad():
        logits = win.km.model(**kw, use_cache=True, logits_to_keep=1).logits[0, -1].float()
    int(logits.argmax())
    return time.perf_counter() - t0, logits


def _timed_recall(wl: Workload, store: Any, policy: str, rank: int, budget: int, segment_tokens: int) -> tuple[float, torch.Tensor]:
    """One fresh window over `store`, the segment evicted before its first read, then the timed
    recall + first token; the window's counters are checked to prove what the call did."""
    from agentwin.window import Window

    win = Window(wl.km, budget_tokens=budget, patch=policy, rank=rank, store=store)
    ids = [win.append(c) for c in wl.contents]
    setup = _snapshot(win)
    if setup["conditioned_passes"] or setup["canonical_hits"] != len(wl.contents):
        raise RuntimeError(f"{wl.name}/{policy}: the store did not serve every chunk's KV and patch "
                           f"({setup}); the timing would include encoding")
    seg = ids[wl.segment]
    win.evict(seg)
    win.next_token_logprobs(wl.query)  # the window as read without the segment (untimed)
    before = _snapshot(win)
    t0 = time.perf_counter()
    win.recall(seg)
    logprobs = win.next_token_logprobs(wl.query)
    int(logprobs.argmax())
    seconds = time.perf_counter() - t0
    after = _snapshot(win)
    moved = len(wl.contents) - wl.segment  # the segment and every chunk after it
    delta = {k: after[k] - before[k] for k in after}
    if delta["relocations"] != moved or delta["conditioned_passes"] or delta["encoder_calls"] \
            or delta["prefill_tokens_avoided"] < segment_tokens or (policy != "none" and delta["patch_hits"] < 1):
        raise RuntimeError(f"{wl.name}/{policy}: the timed recall did not re-place the segment as expected "
                           f"(counter changes {delta}, expected {moved} relocations, >= {segment_tokens} tokens "
                           "avoided, no forward pass, a patch hit when patched)")
    del win
    return seconds, logprobs


def measure(wl: Workload, repeats: int, rank: int, log: Callable[[str], None]) -> dict[str, Any]:
    """All timings of one workload; see the module docstring."""
    from agentwin.store import ChunkStore
    from agentwin.window import Window

    store = ChunkStore(None, ram_bytes=16 << 30, model_fingerprint=wl.km.fingerprint)
    builder = Window(wl.km, budget_tokens=1 << 30, patch="origin", rank=rank, store=store)
    append_seconds = []
    for content in wl.contents:
        t0 = time.perf_counter()
        builder.append(content)
        append_seconds.append(time.perf_counter() - t0)
    window_tokens = builder.tokens()
    seg_id = builder.chunks()[wl.segment]
    builder.evict(seg_id)
    segment_tokens = window_tokens - builder.tokens()
    builder.recall(seg_id)
    query_tokens = int(builder.input_ids(wl.query).numel()) - window_tokens
    budget = window_tokens + 1024
    log(f"  {wl.name}: window {window_tokens} tokens, segment {segment_tokens}, query {query_tokens}; "
        f"segment appended in {append_seconds[wl.segment]:.1f} s (encode + conditioned pass)")

    reprefill, ref_logits = [], None
    for r in range(repeats):
        seconds, ref_logits = _reprefill(builder, wl.query)
        reprefill.append(seconds)
        log(f"    re-prefill {r + 1}/{repeats}: {seconds:.3f} s")
    del builder
    gc.collect()
    recall: dict[str, list[float]] = {}
    kl: dict[str, float] = {}
    same: dict[str, bool] = {}
    for label, policy in POLICIES:
        recall[label] = []
        for r in range(repeats):
            seconds, logprobs = _timed_recall(wl, store, policy, rank, budget, segment_tokens)
            gc.collect()
            recall[label].append(seconds)
            log(f"    recall {label} {r + 1}/{repeats}: {seconds:.3f} s")
        kl[label] = _kl(ref_logits, logprobs)
        same[label] = int(logprobs.argmax()) == int(ref_logits.argmax())
    med = {label: statistics.median(v) for label, v in recall.items()}
    med_reprefill = statistics.median(reprefill)
    return {
        "model": wl.model,
        "segment_tokens": segment_tokens,
        "window_tokens": window_tokens,
        "query_tokens": query_tokens,
        "segment_kind": "frames" if wl.name == "video" else "text",
        "speedup_vs_reprefill": med_reprefill / med["origin"],
        "speedup_blind_vs_reprefill": med_reprefill / med["blind"],
        "patch_overhead_vs_blind": med["origin"] / med["blind"],
        "recall_seconds_median": med["origin"],
        "blind_recall_seconds_median": med["blind"],
        "reprefill_seconds_median": med_reprefill,
        "recall_seconds": recall["origin"],
        "blind_recall_seconds": recall["blind"],
        "reprefill_seconds": reprefill,
        "segment_append_seconds": append_seconds[wl.segment],
        "append_seconds": append_seconds,
        "kl_vs_reprefill": kl,
        "first_token_same": same,
        "meets_target": med_reprefill / med["origin"] >= TARGET_SPEEDUP and segment_tokens >= TARGET_SEGMENT_TOKENS,
    }


def _table(results: dict[str, dict[str, Any]]) -> str:
    head = (f"{'workload':<8}{'segment':>9}{'window':>8}{'recall r16':>12}{'blind':>10}{'re-prefill':>12}"
            f"{'speedup':>9}{'patch/blind':>12}{'KL r16':>10}{'KL blind':>10}")
    lines = [head]
    for name, r in results.items():
        lines.append(f"{name:<8}{r['segment_tokens']:>9}{r['window_tokens']:>8}{r['recall_seconds_median']:>11.3f}s"
                     f"{r['blind_recall_seconds_median']:>9.3f}s{r['reprefill_seconds_median']:>11.2f}s"
                     f"{r['speedup_vs_reprefill']:>8.1f}x{r['patch_overhead_vs_blind']:>12.2f}"
                     f"{r['kl_vs_reprefill']['origin']:>10.2e}{r['kl_vs_reprefill']['blind']:>10.2e}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    checks = [(args.repeats, "--repeats"), (args.threads, "--threads"), (args.rank, "--rank"),
              (args.text_layers, "--text-layers"), (args.vision_layers, "--vision-layers"),
              (args.frame_tokens, "--frame-tokens")]
    for value, flag in checks:
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.frames < 2:
        print(f"error: --frames must be >= 2 (one temporal patch), got {args.frames}", file=sys.stderr)
        return 2
    if args.segment_tokens < 16:
        print(f"error: --segment-tokens must be >= 16, got {args.segment_tokens}", file=sys.stderr)
        return 2
    if not workloads or set(workloads) - {"text", "video"}:
        print(f"error: --workloads takes text and/or video, got {args.workloads!r}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.quick:
        segment_tokens, n_frames, frame_tokens, text_layers, vision_layers = 768, 16, 128, 2, 2
    else:
        segment_tokens, n_frames, frame_tokens = args.segment_tokens, args.frames, args.frame_tokens
        text_layers, vision_layers = args.text_layers, args.vision_layers

    def log(message: str) -> None:
        print(message, flush=True)

    load_before = os.getloadavg()
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for name in workloads:
        if name == "text":
            wl = _text_workload(args.quick, segment_tokens, log)
        else:
            wl = _video_workload(args.quick, text_layers, vision_layers, n_frames, frame_tokens, log)
        results[name] = measure(wl, args.repeats, args.rank, log)
        if name == "video":
            results[name].update(frames=n_frames, text_layers=text_layers, vision_layers=vision_layers,
                                 real_layers={"text": QWEN25VL_3B_LAYERS[0], "vision": QWEN25VL_3B_LAYERS[1]})
        del wl
        gc.collect()
    print(f"\nrecall to first token vs re-prefill (median of {args.repeats}; {args.threads} torch thread(s), "
          f"rank-{args.rank} origin patches):")
    print(_table(results))
    for name, r in results.items():
        print(f"  {name}: {r['model']}")
        print(f"    first token as re-prefill: r16 {r['first_token_same']['origin']}, blind {r['first_token_same']['blind']}; "
              f"one-time segment append {r['segment_append_seconds']:.1f} s")
    load_after = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load_before[0]:.1f} at start and {load_after[0]:.1f} "
          "at the end (shared; times are noisy, medians reported)")
    if args.json:
        out = {
            "workloads": results,
            "target": {"speedup_vs_reprefill": TARGET_SPEEDUP, "segment_tokens": TARGET_SEGMENT_TOKENS},
            "timed": {"recall": "win.recall(seg) + win.next_token_logprobs(query) + argmax, fresh window per repeat "
                                "(segment never placed before; canonical KV and patch from the store)",
                      "blind": "the same with patch='none'",
                      "reprefill": "model(**win.reference_inputs(query), use_cache=True, logits_to_keep=1) + argmax"},
            "rank": args.rank, "repeats": args.repeats, "threads": args.threads, "quick": args.quick,
            "dtype": "float32", "attention": "segment (sdpa for fresh tokens)",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                        "torch": torch.__version__, "load_average_start": load_before[0],
                        "load_average_end": load_after[0]},
            "seconds_total": time.perf_counter() - started,
        }
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"figures written to {args.json}")
    return 0
