"""Fidelity metrics between two next-token distributions, and the similarity retrieval ranks by
(pure tensor functions)."""

from __future__ import annotations

import torch


def kl_divergence(reference: torch.Tensor, other: torch.Tensor, log_probs: bool = False) -> float:
    """KL(reference || other) of next-token distributions, in nats, computed in float64.

    Both are logits `[..., vocab]` (or log-probabilities when `log_probs`); leading dimensions
    are averaged over.
    """
    if reference.shape != other.shape:
        raise ValueError(f"distributions differ in shape: {tuple(reference.shape)} vs {tuple(other.shape)}")
    p, q = reference.double(), other.double()
    if not log_probs:
        p, q = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def top1_agrees(reference: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether the most likely next token is the same (ties broken by lowest id on both sides)."""
    return bool(int(reference.argmax(-1).reshape(-1)[0]) == int(other.argmax(-1).reshape(-1)[0]))


def layer_cosine(query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Similarity of each candidate summary `[N, layers, width]` to the query's `[layers, width]`:
    cosine per layer, averaged over layers (so no layer wins by the scale of its keys). `[N]`."""
    if query.dim() != 2 or candidates.dim() != 3 or candidates.shape[1:] != query.shape:
        raise ValueError(f"summaries must be [layers, width] from one model: query {tuple(query.shape)}, "
                         f"candidates {tuple(candidates.shape)}")
    q = torch.nn.functional.normalize(query.float(), dim=-1)
    return (torch.nn.functional.normalize(candidates.float(), dim=-1) * q).sum(-1).mean(-1)
