"""Recall of an evicted segment to the first token, against re-prefilling the window, in one process.

A workload is a window's contents with one large segment among other chunks and a query read
after them. Per repeat (sides interleaved, so the machine's load falls on every side alike):
- re-prefill: `model(**reference_inputs)` over the whole window and the query, the model's own
  forward (vision tower included for frames), and the argmax;
- re-prefill, cached vision (vision workloads): the same forward with the vision tower's outputs
  fed back through transformers' `mm_encoder_outputs` instead of pixels, from the window's own
  `EncoderCache` (a serving engine's multimodal cache does this): the whole LLM prefill runs again,
  the vision tower does not;
- recall (`patch="origin"`, and blind `patch="none"`): a fresh `Window` over the shared store whose
  chunks all come from the store (no forward), the segment evicted and the window read once
  without it (untimed); timed: `win.recall(seg)`, `win.next_token_logprobs(query)` and the argmax.

Every forward is counted twice, by the window's `WindowStats` and by hooks on the model and its
vision tower (`tools.bench.runs.ForwardCounter`); the two must agree, and the work recorded for
the workload (one-time appends, each repeat's timed and untimed forwards) must add up to all the
hooks saw. `agentwin bench recall` drives `measure`; `tools.bench.recall_page`
writes the results page from the figures.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tools.bench.runs import ForwardCounter, kinds, timing
from kamera_core.metrics import kl_divergence

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


@dataclass
class Workload:
    """A window's contents with the segment to evict and recall, and the query read after it."""

    name: str
    km: Any
    model: str  # description for the page and JSON
    contents: list[Any]
    segment: int  # index into contents
    query: str


# ---- models and contents ------------------------------------------------------------------------


def text_workload(quick: bool, segment_tokens: int, log: Callable[[str], None]) -> Workload:
    """[register, narrative, SEGMENT (>= segment_tokens), two continuation chunks] on the real
    SmolLM2-135M-Instruct (quick: a random-init model of its width with 4 layers)."""
    from tools.bench.datasets import make_case
    from agentwin.models.adapter import KameraModel

    if quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=32768,
                             rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        km = KameraModel(model, None, name="smollm2-width-4-layers-random")
        description = ("Llama-style, SmolLM2-135M width (576 hidden, 9 heads, 3 KV heads), 4 layers, random init, "
                       "byte tokens, float32")
    else:
        log("loading SmolLM2-135M-Instruct ...")
        km = KameraModel.from_pretrained("smollm2", dtype=torch.float32)
        description = (f"SmolLM2-135M-Instruct (real weights, {km.model.config.num_hidden_layers} layers), float32, "
                       "segment attention for reused KV (SDPA for fresh tokens)")
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


def frames_segment(km: Any, n_frames: int, frame_tokens: int) -> Any:
    """A `Frames` chunk of `n_frames` generated frames of 2:1 aspect whose patch grid gives
    `frame_tokens` merged tokens per temporal patch on `km`'s vision tower."""
    from agentwin.content import Frames

    vision = km.model.config.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    rows = max(1, int(round((frame_tokens / 2) ** 0.5)))
    cols = max(1, frame_tokens // rows)
    frames = make_frames(n_frames, cols * factor, rows * factor)
    return Frames(frames, fps=2.0, min_tokens=rows * cols, max_tokens=rows * cols)


def video_contents(segment: Any) -> list[Any]:
    """[intro text, SEGMENT, two text chunks]: the segment is index 1."""
    return ["Camera 3, loading bay, morning shift. The clip below shows the conveyor from above.",
            segment, " After the clip the operator stopped the belt and logged the count.",
            " The next delivery was due at noon."]


def video_workload(quick: bool, text_layers: int, vision_layers: int, n_frames: int, frame_tokens: int,
                   log: Callable[[str], None]) -> Workload:
    """A model with Qwen2.5-VL-3B's dimensions (random init, `text_layers` / `vision_layers`) and a
    window whose segment is `n_frames` generated frames."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from agentwin.models.adapter import KameraModel

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
                       f"{QWEN25VL_3B_LAYERS[1]} vision blocks, random init, byte tokens, float32, segment attention "
                       "for reused KV (SDPA for fresh tokens)")
    contents = video_contents(frames_segment(km, n_frames, frame_tokens))
    return Workload("video", km, description, contents, 1, " What moved?")


# ---- the sides ----------------------------------------------------------------------------------


def window_parts(km: Any, contents: Sequence[Any], query: str, tenant: str = "") -> list[Any]:
    """Model inputs of every chunk of `contents` (token ids, or `VisionChunk`s) and of the query:
    what a plain re-prefill of that window reads."""
    from agentwin.content import Text, model_inputs

    parts = [model_inputs(km, tenant, Text(c) if isinstance(c, str) else c)[0] for c in contents]
    return parts + [km.tokenize(query)]


def cached_vision_inputs(km: Any, parts: Sequence[Any], features: Callable[[Any], dict]) -> dict[str, Any]:
    """Keyword arguments of a re-prefill of `parts` whose vision chunks come as the vision tower's
    outputs (`features(chunk)`, the window's encoder-cache entries) through `mm_encoder_outputs`
    instead of pixels; token ids, token types and grids as `km.reference_inputs(parts)` (the model
    still computes its M-RoPE positions from them). Outputs of chunks of one kind are joined in
    order, as the model joins the tower's outputs itself."""
    from agentwin.models.vision import VisionChunk, encoder_outputs

    kw = km.reference_inputs(parts)
    kw.pop("pixel_values", None)
    kw.pop("pixel_values_videos", None)
    joined: dict[str, Any] = {}
    for kind in ("image", "video"):
        chunks = [p for p in parts if isinstance(p, VisionChunk) and p.kind == kind]
        if not chunks:
            continue
        outputs = [features(c) for c in chunks]
        tensors = {name: torch.cat([o[name] for o in outputs]) for name in outputs[0]}
        joined.update(encoder_outputs(km.model, chunks[0], tensors))
    if joined:
        kw["mm_encoder_outputs"] = joined
    return kw


def reprefill_logits(km: Any, kw: dict[str, Any]) -> torch.Tensor:
    """Last-position logits `[vocab]` float32 of the model's own forward over `kw` (cache kept, as a
    re-prefill that goes on to decode would)."""
    kw = dict(kw)
    if "mm_encoder_outputs" in kw:  # the model fills the dict it is given: hand it a copy
        kw["mm_encoder_outputs"] = dict(kw["mm_encoder_outputs"])
    with torch.no_grad():
        return km.model(**kw, use_cache=True, logits_to_keep=1).logits[0, -1].float()


def encoder_cache_features(win: Any) -> Callable[[Any], dict]:
    """`features(chunk)` served from `win`'s encoder cache only (RuntimeError when the tower's
    outputs for a chunk are not cached there: the cached-vision baseline never runs the tower)."""

    def features(chunk: Any) -> dict:
        def missing() -> dict:
            raise RuntimeError("the vision tower's outputs for this chunk are not in the window's encoder cache")
        return win.encoder.get_or_compute(win.encoder.key(bytes.fromhex(chunk.digest)), missing)

    return features


def _delta(before: Any, after: Any) -> dict[str, Any]:
    """The window's work between two `stats()` snapshots (dicts from `_stats_dict`)."""
    out = {k: after[k] - before[k] for k in ("relocations", "relocated_tokens", "conditioned_passes", "patch_hits",
                                            "canonical_hits", "store_hit_tokens", "encoder_calls")}
    out["forwards"] = kinds({k: after["forwards"].get(k, 0) - before["forwards"].get(k, 0) for k in after["forwards"]})
    out["forwarded_tokens"] = kinds({k: after["forward_tokens"].get(k, 0) - before["forward_tokens"].get(k, 0)
                                     for k in after["forward_tokens"]})
    return out


_NOTHING: dict[str, Any] = {"relocations": 0, "relocated_tokens": 0, "conditioned_passes": 0, "patch_hits": 0,
                            "canonical_hits": 0, "store_hit_tokens": 0, "encoder_calls": 0, "forwards": {},
                            "forward_tokens": {}}


def _stats_dict(win: Any) -> dict[str, Any]:
    s = win.stats()
    d = {k: int(getattr(s, k)) for k in ("relocations", "relocated_tokens", "conditioned_passes", "patch_hits",
                                         "canonical_hits", "store_hit_tokens", "encoder_calls")}
    d["forwards"], d["forward_tokens"] = dict(s.forwards), dict(s.forward_tokens)
    return d


def _hook_matches(name: str, work: dict[str, Any], seen: dict[str, int]) -> None:
    """The window's counted forwards, tokens and vision-tower runs equal what the hooks saw."""
    mine = (sum(work["forwards"].values()), sum(work["forwarded_tokens"].values()), work["encoder_calls"])
    if mine != (seen["forwards"], seen["tokens"], seen["vision_runs"]):
        raise RuntimeError(f"{name}: the window counted (forwards, tokens, vision-tower runs) = {mine}, the model's "
                           f"hooks saw {seen}")


def _recall_once(wl: Workload, store: Any, policy: str, rank: int, budget: int, segment_tokens: int,
                 query_tokens: int, counter: ForwardCounter) -> tuple[float, torch.Tensor, dict, dict]:
    """A fresh window over `store`, the segment evicted before the first (untimed) read, then the
    timed recall + first token. Returns seconds, log-probs, the untimed and the timed work."""
    from agentwin.window import Window

    seen0 = counter.snapshot()
    win = Window(wl.km, budget_tokens=budget, patch=policy, rank=rank, store=store, guard=False)  # the builder's patches
    ids = [win.append(c) for c in wl.contents]
    s0 = _stats_dict(win)
    if s0["forwards"] or s0["canonical_hits"] != len(wl.contents) or counter.since(seen0)["forwards"]:
        raise RuntimeError(f"{wl.name}/{policy}: the store did not serve every chunk's KV and patch ({s0}); "
                           "the timing would include encoding")
    seg = ids[wl.segment]
    win.evict(seg)
    win.next_token_logprobs(wl.query)  # the window as read without the segment (untimed)
    s1, seen1 = _stats_dict(win), counter.snapshot()
    untimed = _delta(s0, s1)
    _hook_matches(f"{wl.name}/{policy} untimed read", untimed, counter.since(seen0))
    t0 = time.perf_counter()
    win.recall(seg)
    logprobs = win.next_token_logprobs(wl.query)
    int(logprobs.argmax())
    seconds = time.perf_counter() - t0
    timed = _delta(s1, _stats_dict(win))
    _hook_matches(f"{wl.name}/{policy} timed recall", timed, counter.since(seen1))
    moved = len(wl.contents) - wl.segment  # the segment and every chunk after it
    if timed["relocations"] != moved or timed["relocated_tokens"] < segment_tokens or timed["encoder_calls"] \
            or timed["forwarded_tokens"] != {"query": query_tokens} or (policy != "none" and timed["patch_hits"] < 1):
        raise RuntimeError(f"{wl.name}/{policy}: the timed recall did not re-place the segment as expected ({timed}; "
                           f"expected {moved} relocations of >= {segment_tokens} tokens, only the query's "
                           f"{query_tokens} tokens forwarded, no vision-tower run, a patch hit when patched)")
    del win
    return seconds, logprobs, untimed, timed


def _timed_reprefill(km: Any, kw: dict[str, Any], counter: ForwardCounter) -> tuple[float, torch.Tensor, dict]:
    seen = counter.snapshot()
    t0 = time.perf_counter()
    logits = reprefill_logits(km, kw)
    int(logits.argmax())
    seconds = time.perf_counter() - t0
    d = counter.since(seen)
    return seconds, logits, {"forwards": {"prefill": d["forwards"]}, "forwarded_tokens": {"prefill": d["tokens"]},
                             "encoder_calls": d["vision_runs"]}


def _same_each_time(name: str, works: list[dict]) -> dict:
    if any(w != works[0] for w in works):
        raise RuntimeError(f"{name}: the work differed between repeats: {works}")
    return works[0]


def measure(wl: Workload, repeats: int, rank: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every side of one workload; see the module docstring. Raises RuntimeError when a side did
    other work than described (the counters are checked against the model's hooks)."""
    from agentwin.models.vision import VisionChunk
    from agentwin.store import ChunkStore
    from agentwin.window import Window

    km = wl.km
    store = ChunkStore(None, ram_bytes=16 << 30, model_fingerprint=km.fingerprint)
    with ForwardCounter(km.model) as counter:
        # Patch guard off, as on the results page: recall is measured, the guard is an append's work.
        builder = Window(km, budget_tokens=1 << 30, patch="origin", rank=rank, store=store, guard=False)
        append_seconds = []
        for content in wl.contents:
            t0 = time.perf_counter()
            builder.append(content)
            append_seconds.append(time.perf_counter() - t0)
        setup = _delta(_NOTHING, _stats_dict(builder))
        _hook_matches(f"{wl.name} appends", setup, counter.snapshot())
        window_tokens = builder.tokens()
        seg_id = builder.chunks()[wl.segment]
        builder.evict(seg_id)
        segment_tokens = window_tokens - builder.tokens()
        builder.recall(seg_id)
        parts = window_parts(km, wl.contents, wl.query, store.tenant)
        plain_kw = km.reference_inputs(parts)
        if not torch.equal(plain_kw["input_ids"], builder.reference_inputs(wl.query)["input_ids"]):
            raise RuntimeError(f"{wl.name}: the re-prefill's inputs are not the window's")
        query_tokens = int(plain_kw["input_ids"].shape[1]) - window_tokens
        vision = any(isinstance(p, VisionChunk) for p in parts)
        cached_kw = cached_vision_inputs(km, parts, encoder_cache_features(builder)) if vision else None
        del builder
        gc.collect()
        log(f"  {wl.name}: window {window_tokens} tokens, segment {segment_tokens}, query {query_tokens}; "
            f"segment appended in {append_seconds[wl.segment]:.1f} s (encode + in-context pass)")
        budget = window_tokens + 1024
        sides = ["reprefill"] + (["reprefill_cached_vision"] if vision else []) + [label for label, _ in POLICIES]
        times: dict[str, list[float]] = {s: [] for s in sides}
        works: dict[str, list[dict]] = {s: [] for s in sides}
        untimed: dict[str, list[dict]] = {label: [] for label, _ in POLICIES}
        logits: dict[str, torch.Tensor] = {}
        for r in range(repeats):
            for side in sides:
                if side.startswith("reprefill"):
                    seconds, out, work = _timed_reprefill(km, plain_kw if side == "reprefill" else cached_kw, counter)
                else:
                    policy = dict(POLICIES)[side]
                    seconds, out, pre, work = _recall_once(wl, store, policy, rank, budget, segment_tokens,
                                                           query_tokens, counter)
                    untimed[side].append(pre)
                gc.collect()
                times[side].append(seconds)
                works[side].append(work)
                logits[side] = out
                log(f"    {side} {r + 1}/{repeats}: {seconds:.3f} s")
        total_seen = counter.snapshot()
    ref = logits["reprefill"]
    result: dict[str, Any] = {
        "name": wl.name, "model": wl.model, "segment_kind": "frames" if vision else "text",
        "segment_tokens": segment_tokens, "window_tokens": window_tokens, "query_tokens": query_tokens,
        "sides": {}, "setup": {"appends": setup, "append_seconds_one_run": append_seconds,
                               "segment_append_seconds_one_run": append_seconds[wl.segment]},
        "hooks": total_seen,
    }
    for side in sides:
        entry = {**timing(times[side]), "work": _same_each_time(f"{wl.name}/{side}", works[side]),
                 "first_token": int(logits[side].argmax()),
                 "first_token_same": int(logits[side].argmax()) == int(ref.argmax()),
                 "kl_vs_reprefill": kl_divergence(ref.reshape(-1), logits[side].reshape(-1))}
        if side in untimed:
            entry["untimed_work"] = _same_each_time(f"{wl.name}/{side} untimed", untimed[side])
        if side == "reprefill_cached_vision":
            entry["max_abs_logit_diff_vs_reprefill"] = float((logits[side] - ref).abs().max())
        result["sides"][side] = entry
    accounted = _accounted(result, repeats)
    if accounted != (total_seen["forwards"], total_seen["tokens"], total_seen["vision_runs"]):
        raise RuntimeError(f"{wl.name}: the recorded work {accounted} does not add up to the hooks' {total_seen}")
    result["ratios"] = ratios(result["sides"])
    return result


def _accounted(result: dict[str, Any], repeats: int) -> tuple[int, int, int]:
    """(forwards, tokens, vision-tower runs) of everything the workload recorded: the appends, and
    per repeat every side's timed work and the recall sides' untimed read."""
    works = [result["setup"]["appends"]]
    for entry in result["sides"].values():
        works += [entry["work"]] * repeats + ([entry["untimed_work"]] * repeats if "untimed_work" in entry else [])
    return (sum(sum(w["forwards"].values()) for w in works), sum(sum(w["forwarded_tokens"].values()) for w in works),
            sum(w["encoder_calls"] for w in works))


def ratios(sides: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each baseline's time over each recall side's, of the minima and of the medians."""
    out = {}
    for base in ("reprefill", "reprefill_cached_vision"):
        if base not in sides:
            continue
        for label, _ in POLICIES:
            out[f"{base}/{label}"] = {"min": sides[base]["min_s"] / sides[label]["min_s"],
                                      "median": sides[base]["median_s"] / sides[label]["median_s"]}
    out["origin/blind"] = {"min": sides["origin"]["min_s"] / sides["blind"]["min_s"],
                           "median": sides["origin"]["median_s"] / sides["blind"]["median_s"]}
    return out
