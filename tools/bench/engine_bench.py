"""The window's KV engine on the real SmolLM2-135M-Instruct (`agentwin bench engine`): recall to the
first token, decoding over many segments, and the memory of a long loop under fixed budgets.

1. recall: a window of about `--window-tokens` (8192) tokens holding one segment of at least
   `--segment-tokens` (4096) among other chunks (patch "origin", rank 16). The segment is evicted
   (the window lets go of its KV; canonical KV and patch stay in the store's RAM tier) and the
   window read once (untimed). Then, on that same window, three ways to get the query's first
   token are timed:
   - segment: `win.recall(seg)` then `win.next_token_logprobs(query)` and the argmax: segment
     attention reads every chunk's KV where it lies (the store's tensors, or a chunk's in-context
     KV back at its place);
   - materialised: the same KV placed by copy, as the window did before this engine: the recalled
     segment's canonical KV plus its patch re-rotated to its slot (the other chunks' placed copies
     are prepared untimed), every chunk's KV concatenated into one transformers `DynamicCache`, then
     the query through SDPA;
   - re-prefill: the model's own forward over the window and the query (SDPA), no cache.
   `recall_bytes_written`: bytes of KV that the recall and the query's attention read from memory
   that did not hold that KV before the recall (0 when everything is read in place; the
   materialised path writes the whole window's KV). `recall_over_query_forward`: (recall + query)
   over the query alone on the unchanged window afterwards.
2. decode: windows of `--decode-tokens` (8192) tokens cut into 4, 16 and 64 chunks (blind reuse,
   so every chunk is canonical KV read at a shift: the costliest segment kind); ms per generated
   token through segment attention against SDPA over one materialised `DynamicCache` of the same
   tokens (the cache built untimed), after the same query.
3. rss: in a fresh process, text chunks of about `--rss-chunk-tokens` tokens appended one after
   another to a window of `--rss-budget-tokens` over a store of `--rss-store-mb` MB of RAM (no
   disk); the process's peak RSS after 10, 50 and 200 evicted chunks. `rss_growth_10_to_200` is
   the ratio of the last to the first.

Every side runs in this process with `--threads` torch threads; each timing is the minimum and
median of `--repeats` (>= 5) runs; the load average is recorded before and after.

`check(args)` refuses bad options, `measure(args)` runs the parts and returns the figures,
`summary(result)` picks the headline ones.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import torch

from kamera_core.metrics import kl_divergence

CHECKPOINTS = (10, 50, 200)
PARTS = ("recall", "decode", "rss")
HEADLINE = ("recall_bytes_written", "recall_over_query_forward", "decode_ratio_vs_sdpa_16seg", "rss_growth_10_to_200")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


# ---- helpers -----------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> dict[str, float]:
    """min and median seconds of `fn` over `repeats` runs (`before` runs untimed ahead of each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"min_s": min(times), "median_s": statistics.median(times), "runs": len(times)}


def _texts(km: Any, tokens: int, pieces: int, seed: int = 0) -> list[str]:
    """`pieces` distinct texts of about `tokens // pieces` tokens each (narratives of
    `tools.bench.datasets`, cut at token boundaries)."""
    from tools.bench.datasets import make_case

    per = max(1, tokens // pieces)
    stream: list[int] = []
    s = seed
    while len(stream) < per * pieces + 64:
        case = make_case(s)
        stream += km.tokenize(" " + case.a + " " + case.b).tolist()
        s += 1
    return [km.tokenizer.decode(stream[i * per:(i + 1) * per]) for i in range(pieces)]


def _placed_copy(km: Any, segments_per_layer: Sequence[Sequence[Any]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every segment's KV placed by copy (canonical + patch, re-rotated): what the window kept
    before segment attention. `[layer][chunk] -> (k [T, H, D], v [T, H, D])`."""
    from kamera_core import relocate_keys

    out = []
    for spec, layer in zip(km.specs, segments_per_layer):
        parts = []
        for seg in layer:
            k, v = seg.keys, seg.values
            if seg.patch is not None:
                if seg.patch.k is not None:
                    k = k + seg.patch.k.dense(k.dtype)
                if seg.patch.v is not None:
                    v = v + seg.patch.v.dense(v.dtype)
            parts.append((relocate_keys(k, spec, seg.shift) if seg.shift else k, v))
        out.append(parts)
    return out


def _dynamic_cache(km: Any, placed: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> Any:
    """One transformers DynamicCache of the placed parts (per layer, per segment), concatenated
    (the materialised path)."""
    from agentwin.models.kv import build_cache_parts

    by_segment = [[layer[index] for layer in placed] for index in range(len(placed[0]))]
    return build_cache_parts(by_segment, km.model.config, km.layout)


def _plain_forward(km: Any, ids: torch.Tensor, start: int, cache: Any) -> Any:
    """The model's forward of `ids` at `start` after a transformers cache (SDPA attention)."""
    with torch.no_grad():
        return km.model(input_ids=ids[None], position_ids=torch.arange(start, start + len(ids))[None], cache=cache,
                        use_cache=True, logits_to_keep=1)


def _kv_ptrs(segments_per_layer: Sequence[Sequence[Any]]) -> dict[int, int]:
    """data_ptr -> bytes of every segment's keys and values."""
    out = {}
    for layer in segments_per_layer:
        for seg in layer:
            for t in (seg.keys, seg.values):
                out[t.data_ptr()] = t.numel() * t.element_size()
    return out


def _held_ptrs(win: Any, chunk_ids: Sequence[Any]) -> set[int]:
    """Storage of all KV the window and its store's RAM tier hold now for `chunk_ids` (every
    chunk appended)."""
    from agentwin.store import tensors_to_kv

    ptrs = set()
    for chunk in map(win.inspect, chunk_ids):
        hit = win.store.get(chunk.key) if win.store.contains(chunk.key) else None
        kvs = [tensors_to_kv(hit[0])] if hit is not None else []
        kvs += [kv for kv in (chunk.canonical, chunk.kv) if kv is not None]
        for kv in kvs:
            for k, v in kv:
                ptrs.update((k.data_ptr(), v.data_ptr()))
    return ptrs


# ---- parts -------------------------------------------------------------------------------------


def recall_part(km: Any, args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    from agentwin.window import Window

    seg_tokens, window_tokens = args.segment_tokens, args.window_tokens
    others = _texts(km, max(window_tokens - seg_tokens, 64), 4, seed=100)
    segment = "".join(_texts(km, seg_tokens, 1, seed=200))
    contents = others[:2] + [segment] + others[2:]
    query = " Question: who was named in the last paragraph? Answer:"
    win = Window(km, budget_tokens=window_tokens + 512, patch="origin", rank=16, guard=False)  # as measured
    log(f"recall: appending {len(contents)} chunks ...")
    t0 = time.perf_counter()
    ids = [win.append(c) for c in contents]
    append_s = time.perf_counter() - t0
    seg = ids[2]
    q = win.query_ids(query)

    def evicted_state() -> None:
        if seg in win.chunks():
            win.evict(seg)
        win.next_token_logprobs(query)  # the window without the segment, read once

    first_tokens = {}

    def segment_recall() -> None:
        win.recall(seg)
        first_tokens["segment"] = int(win.next_token_logprobs(query).argmax())

    segment = _timed(segment_recall, args.repeats, evicted_state)
    # Bytes written: the KV attention reads now, against what was held before the recall.
    evicted_state()
    held = _held_ptrs(win, ids)
    win.recall(seg)
    logprobs = win.next_token_logprobs(query)
    read = _kv_ptrs(win.segments())
    written = sum(b for p, b in read.items() if p not in held)
    stats = win.stats()
    query_alone = _timed(lambda: win.next_token_logprobs(query), args.repeats)
    reference = win.reference_logprobs(query)
    window_tokens_now = win.tokens()
    # Materialised: the window's placed copies are prepared untimed, except the recalled segment.
    segments = win.segments()
    order = win.chunks()
    at = order.index(seg)
    placed = _placed_copy(km, segments)
    start = win.positions(order)

    def materialised() -> None:
        fresh = _placed_copy(km, [[layer[at]] for layer in segments])
        parts = [[*p[:at], f[0], *p[at + 1:]] for p, f in zip(placed, fresh)]
        cache = _dynamic_cache(km, parts)
        first_tokens["materialised"] = int(_plain_forward(km, q, start, cache).logits[0, -1].argmax())

    mat = _timed(materialised, args.repeats)
    mat_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for p in placed for k, v in p)
    inputs = win.reference_inputs(query)

    def reprefill() -> None:
        with torch.no_grad():
            first_tokens["reprefill"] = int(km.model(**inputs, logits_to_keep=1).logits[0, -1].argmax())

    full = _timed(reprefill, args.repeats)
    return {
        "window_tokens": window_tokens_now, "segment_tokens": win.chunk_tokens(seg),
        "chunks": len(order), "append_all_s": append_s,
        "segment": segment, "materialised": mat, "reprefill": full, "query_alone": query_alone,
        "recall_bytes_written": written, "materialised_bytes_written": mat_bytes,
        "recall_over_query_forward": segment["median_s"] / query_alone["median_s"],
        "recall_over_query_forward_min": segment["min_s"] / query_alone["min_s"],
        "speedup_vs_materialised": mat["median_s"] / segment["median_s"],
        "speedup_vs_reprefill": full["median_s"] / segment["median_s"],
        "first_tokens": first_tokens, "kl_vs_reprefill": kl_divergence(reference, logprobs, log_probs=True),
        "forwards_at_recall": {k: int(v) for k, v in stats.forwards.items()},
    }


def decode_part(km: Any, args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    from agentwin.window import Window

    out = {}
    query = " Question: what happened next? Answer:"
    for count in [int(x) for x in args.segments.split(",")]:
        log(f"decode: {count} chunks of about {args.decode_tokens // count} tokens ...")
        win = Window(km, budget_tokens=args.decode_tokens + 1024, patch="none")
        for text in _texts(km, args.decode_tokens, count, seed=300 + count):
            win.append(text)
        q = win.query_ids(query)
        start = win.positions(win.chunks())
        segments = win.segments()
        dense_parts = _placed_copy(km, segments)
        step_times: dict[str, list[float]] = {"segment": [], "sdpa": []}
        agree = True
        for _ in range(args.repeats):
            for side in ("segment", "sdpa"):
                cache = km.cache(segments, win.tokens()) if side == "segment" else _dynamic_cache(km, dense_parts)

                def step(ids: torch.Tensor, pos: int) -> Any:
                    if side == "segment":
                        return km.forward(ids, pos, cache, logits_to_keep=1)
                    return _plain_forward(km, ids, pos, cache)

                token = int(step(q, start).logits[0, -1].argmax())
                pos, tokens = start + len(q), [token]
                for _ in range(args.decode_steps):
                    t0 = time.perf_counter()
                    token = int(step(torch.tensor([token]), pos).logits[0, -1].argmax())
                    step_times[side].append(time.perf_counter() - t0)
                    pos += 1
                    tokens.append(token)
                if side == "segment":
                    seg_tokens = tokens
                else:
                    agree = agree and tokens == seg_tokens
        row = {side: {"min_ms": 1e3 * min(t), "median_ms": 1e3 * statistics.median(t), "steps": len(t)}
               for side, t in step_times.items()}
        row["ratio_vs_sdpa"] = row["segment"]["median_ms"] / row["sdpa"]["median_ms"]
        row["ratio_vs_sdpa_min"] = row["segment"]["min_ms"] / row["sdpa"]["min_ms"]
        row["window_tokens"] = win.tokens()
        row["same_greedy_tokens"] = agree
        out[str(count)] = row
    return out


def _rss_kb() -> tuple[int, int]:
    """(current, peak) resident set size of this process in kB, from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def rss_child(threads: int, quick: bool, rss_chunk_tokens: int, rss_budget_tokens: int, rss_store_mb: int) -> dict:
    """The long-loop memory run (in its own process, so its peak RSS is its own)."""
    from agentwin.models.adapter import KameraModel
    from agentwin.store import ChunkStore
    from agentwin.window import Window

    torch.set_num_threads(threads)
    km = KameraModel.from_pretrained("smollm2")
    checkpoints = (2, 5, 20) if quick else CHECKPOINTS
    store = ChunkStore(None, ram_bytes=rss_store_mb << 20, model_fingerprint=km.fingerprint)
    win = Window(km, budget_tokens=rss_budget_tokens, patch="origin", rank=16, store=store, guard=False)
    texts = iter(_texts(km, rss_chunk_tokens * (checkpoints[-1] + 40), checkpoints[-1] + 40, seed=500))
    rows, pending, appended = [], list(checkpoints), 0
    while pending:
        win.append(next(texts))
        appended += 1
        evicted = win.stats().evictions
        if evicted // 25 != (evicted - 1) // 25 and evicted:
            log(f"rss: {evicted} chunks evicted")
        if evicted < pending[0]:
            continue
        gc.collect()
        current, peak = _rss_kb()
        s = win.stats()
        rows.append({"checkpoint": pending[0], "evicted": evicted, "rss_mb": current / 1024, "peak_rss_mb": peak / 1024,
                     "window_held_mb": s.held_bytes / 2 ** 20, "store_ram_mb": s.store.ram_bytes / 2 ** 20,
                     "window_tokens": win.tokens(), "appended": appended})
        while pending and evicted >= pending[0]:
            pending.pop(0)
    return {"checkpoints": rows, "budget_tokens": rss_budget_tokens, "store_ram_mb": rss_store_mb,
            "chunk_tokens": rss_chunk_tokens,
            "rss_growth_10_to_200": rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"]}


_CHILD = ("import json, sys; from tools.bench.engine_bench import rss_child; "
          "print(json.dumps(rss_child(**json.loads(sys.argv[1]))))")


def rss_part(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    log("rss: long loop in a fresh process ...")
    params = {"threads": args.threads, "quick": bool(args.quick), "rss_chunk_tokens": args.rss_chunk_tokens,
              "rss_budget_tokens": args.rss_budget_tokens, "rss_store_mb": args.rss_store_mb}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(params)], stdout=subprocess.PIPE, text=True,
                          check=False, cwd=ROOT)  # progress goes to stderr
    if proc.returncode != 0:
        raise RuntimeError(f"the rss run failed (exit {proc.returncode}); its messages are above")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the command's steps -----------------------------------------------------------------------


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None."""
    if args.repeats < 5 and not args.quick:
        return "--repeats must be at least 5 (min and median of >= 5 runs)"
    unknown = _parts(args) - set(PARTS)
    if unknown:
        return f"unknown parts {sorted(unknown)}; choose from recall, decode, rss"
    return None


def _parts(args: argparse.Namespace) -> set[str]:
    return {p.strip() for p in args.parts.split(",") if p.strip()}


def apply_quick(args: argparse.Namespace) -> None:
    """Small sizes for `--quick` (a check of the command on the real model, not a measurement)."""
    if args.quick:
        args.window_tokens, args.segment_tokens, args.decode_tokens = 1024, 512, 1024
        args.segments, args.decode_steps = "4,16", 3
        args.rss_budget_tokens, args.rss_chunk_tokens = 256, 48
        args.repeats = max(2, min(args.repeats, 3))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every part `args.parts` names on SmolLM2 (sizes of `--quick` applied); the figures."""
    from agentwin.models.adapter import KameraModel
    from kamera_core.segment import CPU_KERNEL_MAX_ROWS

    apply_quick(args)
    parts = _parts(args)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    log("loading SmolLM2-135M-Instruct ...")
    km = KameraModel.from_pretrained("smollm2")
    result: dict[str, Any] = {
        "command": "agentwin bench engine " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "engine"] else []),
        "model": "SmolLM2-135M-Instruct (real weights), float32", "threads": args.threads,
        "repeats": args.repeats, "quick": args.quick, "cpu_kernel_max_rows": CPU_KERNEL_MAX_ROWS,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "loadavg_before": load_before,
    }
    if "recall" in parts:
        result["recall"] = recall_part(km, args, log)
        result["recall_bytes_written"] = result["recall"]["recall_bytes_written"]
        result["recall_over_query_forward"] = result["recall"]["recall_over_query_forward"]
    if "decode" in parts:
        result["decode"] = decode_part(km, args, log)
        if "16" in result["decode"]:
            result["decode_ratio_vs_sdpa_16seg"] = result["decode"]["16"]["ratio_vs_sdpa"]
    if "rss" in parts:
        result["rss"] = rss_part(args, log)
        result["rss_growth_10_to_200"] = result["rss"]["rss_growth_10_to_200"]
    result["loadavg_after"] = os.getloadavg()
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures the command prints."""
    return {k: result[k] for k in HEADLINE if k in result}
