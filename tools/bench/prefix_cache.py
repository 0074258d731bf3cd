"""Automatic prefix caching as a replay strategy, in the manner of vLLM's prefix cache and
SGLang's radix cache: the KV of every decision's sequence (window + query) is kept in a radix tree
at token granularity (as SGLang; vLLM matches whole blocks, which can only reuse less), bounded by
`capacity_tokens` with least-recently-used leaves dropped first. A decision reuses the KV of the
longest common token prefix with any sequence in the tree and computes the rest (at least its last
token, for the logits).
"""

from __future__ import annotations

from typing import Any

import torch

from agentwin.models.adapter import KameraModel
from agentwin.models.kv import LayerKV
from kamera_core.segment import Segment
from tools.bench.strategies import Reading, Strategy


class _Node:
    __slots__ = ("tokens", "kv", "children", "used", "parent")

    def __init__(self, tokens: torch.Tensor, kv: list[LayerKV] | None, parent: "_Node | None") -> None:
        self.tokens, self.kv, self.parent = tokens, kv, parent
        self.children: dict[int, _Node] = {}
        self.used = 0


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


class RadixTree:
    """Token sequences and their KV (token-major per layer), shared prefixes stored once; at most
    `capacity_tokens` tokens, least recently used leaves dropped first."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be positive, got {capacity_tokens}")
        self.capacity = capacity_tokens
        self.root = _Node(torch.zeros(0, dtype=torch.long), None, None)
        self.tokens = 0
        self._tick = 0

    def match(self, seq: torch.Tensor) -> list[tuple[_Node, int]]:
        """The path of the longest prefix of `seq` held: (node, tokens of it used), in order."""
        self._tick += 1
        path, node, at = [], self.root, 0
        while at < seq.numel():
            child = node.children.get(int(seq[at]))
            if child is None:
                break
            n = _common(child.tokens, seq[at:])
            child.used = self._tick
            path.append((child, n))
            at += n
            if n < child.tokens.numel():
                break
            node = child
        return path

    def insert(self, seq: torch.Tensor, path: list[tuple[_Node, int]], kv: list[LayerKV]) -> None:
        """Add `seq`, whose first `sum(n for _, n in path)` tokens are held along `path` (from
        `match`) and whose remaining tokens' KV is `kv`."""
        held = sum(n for _, n in path)
        if held == seq.numel():
            return
        parent = self.root
        if path:
            node, n = path[-1]
            if n < node.tokens.numel():
                self._split(node, n)
            parent = node
        leaf = _Node(seq[held:].clone(), kv, parent)
        leaf.used = self._tick
        parent.children[int(seq[held])] = leaf
        self.tokens += leaf.tokens.numel()
        self._shrink()

    def _split(self, node: _Node, n: int) -> None:
        """Cut `node` after its first `n` tokens; the rest becomes its only child."""
        rest = _Node(node.tokens[n:], [(k[n:], v[n:]) for k, v in node.kv], node)
        rest.children, rest.used = node.children, node.used
        for child in rest.children.values():
            child.parent = rest
        node.tokens, node.kv = node.tokens[:n], [(k[:n], v[:n]) for k, v in node.kv]
        node.children = {int(rest.tokens[0]): rest}

    def _shrink(self) -> None:
        while self.tokens > self.capacity:
            leaves, stack = [], [self.root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if not node.children and node is not self.root:
                    leaves.append(node)
            if not leaves:
                return
            victim = min(leaves, key=lambda x: x.used)
            del victim.parent.children[int(victim.tokens[0])]
            self.tokens -= victim.tokens.numel()


class PrefixCache(Strategy):
    """Automatic prefix caching (see the module docstring). replies: the decoded reply's tokens
    join the tree with the query's (as a serving engine caches a request's output), so a later
    sequence that repeats a reply reuses it too."""

    name = "prefix"

    def __init__(self, km: KameraModel, capacity_tokens: int = 16384, replies: bool = False) -> None:
        super().__init__(km)
        self.tree = RadixTree(capacity_tokens)
        self.reused_tokens = 0
        self.replies = bool(replies)

    def _decide(self, query: torch.Tensor, greedy: int) -> Reading:
        seq = torch.cat([self.window_ids(), query])
        path = self.tree.match(seq)
        held = sum(n for _, n in path)
        used = min(held, seq.numel() - 1)  # the last token is always computed (its logits)
        segments: list[list[Segment]] = [[] for _ in self.km.specs]
        first = 0
        for node, n in path:
            n = min(n, used - first)
            if n <= 0:
                break
            for layer, (k, v) in zip(segments, node.kv):
                layer.append(Segment(k[:n], v[:n], first, 0))
            first += n
        self.reused_tokens += used
        reading, cache, fed = self._segment_decide(segments, used, seq[used:], greedy, kind="prefill")
        skip = held - used  # the last token was held already: its new KV is not stored again
        if self.replies:  # the reply tokens that went through the model (the last chosen one did not)
            seq = torch.cat([seq, torch.tensor(fed, dtype=torch.long)])
        computed = int(seq.numel()) - used
        self.tree.insert(seq, path, [(k[skip:computed].clone(), v[skip:computed].clone()) for k, v in cache.tail_kv()])
        return reading

    def info(self) -> dict[str, Any]:
        return {"reused_prefix_tokens": self.reused_tokens, "tree_tokens": self.tree.tokens,
                "capacity_tokens": self.tree.capacity}
