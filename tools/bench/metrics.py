"""Scoring a method's KV against the full re-prefill: next-token KL, top-1 agreement, identical
greedy continuations, and each method's cost as a share of the reused chunks."""

from __future__ import annotations

from typing import Sequence

import torch

from tools.bench.baselines import Result
from tools.bench.contexts import Context, read_after
from agentwin.models.kv import LayerKV
from kamera_core.metrics import kl_divergence


def read_queries(ctx: Context, kvs: Sequence[Sequence[LayerKV]], greedy: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`read_after` of each of the context's queries, for every cache of `kvs` at once."""
    return [read_after(ctx.model, ctx.layout, kvs, q, qpos, greedy) for q, qpos in zip(ctx.queries, ctx.query_pos)]


def score_many(ctx: Context, results: Sequence[Result], greedy: int = 0, batch: int = 12) -> list[dict]:
    """`score` of every result, reading the queries for up to `batch` results at a time."""
    rows: list[dict] = []
    for lo in range(0, len(results), batch):
        group = results[lo: lo + batch]
        read = read_queries(ctx, [r.kv for r in group], greedy)
        for b, result in enumerate(group):
            rows.append(_score_row(ctx, result, [(lg[b], ids[b]) for lg, ids in read], greedy))
    return rows


def score(ctx: Context, result: Result, greedy: int = 0) -> dict:
    """Mean next-token KL, top-1 agreement and (with `greedy`) identical greedy continuations
    against the full re-prefill, over the context's queries."""
    return score_many(ctx, [result], greedy)[0]


def _score_row(ctx: Context, result: Result, read: Sequence[tuple[torch.Tensor, torch.Tensor]], greedy: int) -> dict:
    kls, top1, same, prefix, argmax = [], [], [], [], []
    for (logits, mine), ref, ref_ids in zip(read, ctx.reference, ctx.reference_ids):
        kls.append(kl_divergence(ref, logits))
        argmax.append(int(logits.argmax()))
        top1.append(float(argmax[-1] == int(ref.argmax())))
        if greedy:
            same.append(float(torch.equal(mine, ref_ids[:greedy])))
            agree = (mine == ref_ids[:greedy]).long()
            prefix.append(float(agree.cumprod(0).sum()) / greedy)
    row = {"method": result.method, "setting": result.setting, "kl": sum(kls) / len(kls),
           "top1": sum(top1) / len(top1), "extra_bytes": result.extra_bytes,
           "bytes_frac": result.extra_bytes / max(1, ctx.reused_kv_bytes()),
           "token_layers": result.token_layers,
           "compute_frac": result.token_layers / max(1, ctx.reused_token_layers()),
           "build_compute_frac": result.build_token_layers / max(1, ctx.reused_token_layers()),
           "seconds": result.seconds, "build_seconds": result.build_seconds, "kls": kls, "argmax": argmax}
    if greedy:
        row["greedy_same"] = sum(same) / len(same)
        row["greedy_prefix"] = sum(prefix) / len(prefix)
    return row

