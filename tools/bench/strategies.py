"""Context strategies that an agent trace (`tools.bench.trace`) is replayed through.

Each strategy gets the same operations in the same order: append a chunk (its text), evict it,
recall it at an index of the window, and decide: read the window plus a query and return the
next-token distribution and the greedy continuation. Chunks and queries are tokenized alone, as
`agentwin.Window` does (`km.tokenize`), so every strategy reads the token sequence
`Window.input_ids(query)` gives. Every token a strategy passes through the
model is counted, by kind ("prefill", "encode", "in_context", "conditioned", "query", "decode",
"orbit"), so their work can be compared on one trace.

- `Reprefill`: the whole window and the query through the model's own forward at every decision
  (transformers' SDPA, its own cache for decoding). In float32 it is the reference; with a
  bfloat16 copy of the model it gives the noise floor of a lower precision.
- `PrefixCache` (`tools.bench.prefix_cache`): automatic prefix caching, a radix tree of every
  decision's sequence at token granularity.
- `Streaming`: StreamingLLM-style KV kept across steps: an appended chunk is prefilled after the
  KV held now; when chunks leave, the survivors are re-rotated to their new positions by exact RoPE
  re-rotation (`agentwin.models.kv.relocate_kv`) with no other repair; the first `sinks` tokens of
  the stream stay at the front as attention sinks after their chunk leaves; a recalled chunk comes
  back as its canonical KV (encoded alone once per content, counted) re-rotated to its place.
- `AgentwinStrategy`: `agentwin.Window` with a patch policy and rank; its counts are the window's
  `stats().forward_tokens` plus the query and decoding forwards of each decision.

Text chunks only: a text chunk's span in positions is its token count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from agentwin.models.adapter import KameraModel
from agentwin.models.kv import LayerKV, relocate_kv
from kamera_core.segment import Segment


@dataclass
class Reading:
    """What a strategy read at one decision: `logprobs` `[vocab]` float32 of the token after the
    query, and the greedy continuation (its first token is the argmax of `logprobs`), stopped
    after an end-of-sequence token or at the requested length."""

    logprobs: torch.Tensor
    tokens: list[int]


def eos_ids(model: Any) -> set[int]:
    eos = getattr(model.config, "eos_token_id", None)
    if eos is None and hasattr(model.config, "get_text_config"):
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())


def forced_tokens(first_logits: torch.Tensor, later_logits: torch.Tensor | None, forced: Sequence[int],
                  eos: set[int]) -> list[int]:
    """The greedy tokens read off one teacher-forced pass: `first_logits` predicts the token after
    the query, `later_logits[i]` the token after `forced[i]` (the pass fed `forced[:-1]`). The
    result is the greedy decode of the same model and cache up to and including its first token
    that departs from `forced` (float rounding of the wider pass aside), so it equals `forced`
    exactly when step-by-step greedy decoding would reproduce `forced`."""
    rows = [first_logits] + ([] if later_logits is None else list(later_logits))
    out: list[int] = []
    for index, row in enumerate(rows[:len(forced)]):
        out.append(int(row.argmax()))
        if out[-1] != int(forced[index]) or out[-1] in eos:
            break
    return out


def greedy_tokens(first_logits: torch.Tensor, greedy: int, eos: set[int], step: Callable[[int], torch.Tensor]) -> list[int]:
    """Greedy continuation: the argmax of `first_logits`, then `step(token)` -> next logits until
    `greedy` tokens or an end-of-sequence token."""
    tokens = [int(first_logits.argmax())]
    while len(tokens) < greedy and tokens[-1] not in eos:
        tokens.append(int(step(tokens[-1]).argmax()))
    return tokens


class Strategy:
    """The operations every strategy takes; subclasses implement `_append`, `_evict`, `_recall`
    and `decide`. `order` is the window (chunk ids in order), `ids` every chunk's token ids."""

    name = "strategy"

    def __init__(self, km: KameraModel) -> None:
        if not isinstance(km, KameraModel):
            raise TypeError(f"km must be a KameraModel, got {type(km).__name__}")
        self.km = km
        self.order: list[int] = []
        self.ids: dict[int, torch.Tensor] = {}
        self.texts: dict[int, str] = {}
        self.forwards: Counter = Counter()
        self.forward_tokens: Counter = Counter()
        self.eos = eos_ids(km.model)
        self._forced: list[int] | None = None

    # ---- operations -----------------------------------------------------------------------

    def append(self, cid: int, text: str) -> None:
        if cid in self.ids:
            raise ValueError(f"chunk {cid} was appended before; a revisit is a recall")
        ids = self.km.tokenize(text)
        if ids.numel() == 0:
            raise ValueError(f"chunk {cid}: the text tokenizes to no tokens")
        self.ids[cid], self.texts[cid] = ids, text
        self._append(cid, ids)
        self.order.append(cid)

    def evict(self, cid: int) -> None:
        if cid not in self.order:
            raise ValueError(f"chunk {cid} is not in the window {self.order}")
        index = self.order.index(cid)
        self._evict(cid, index)
        self.order.pop(index)

    def recall(self, cid: int, at: int) -> None:
        if cid not in self.ids or cid in self.order:
            raise ValueError(f"chunk {cid} is not an evicted chunk")
        if not 0 <= at <= len(self.order):
            raise ValueError(f"recall index {at} outside [0, {len(self.order)}]")
        self._recall(cid, at)
        self.order.insert(at, cid)

    def decide(self, query: str, greedy: int, forced: Sequence[int] | None = None) -> Reading:
        """The window read after `query`: next-token log-probabilities and `greedy` greedy tokens.
        forced: another run's greedy reply, fed in one pass after the query (teacher forcing)
        instead of decoding step by step; the tokens are then those of `forced_tokens` (the
        same forwarded tokens, fewer forwards)."""
        ids = self.km.tokenize(query)
        if ids.numel() == 0:
            raise ValueError("the query tokenizes to no tokens")
        self._forced = None if forced is None else [int(t) for t in forced][:max(1, greedy)]
        try:
            with torch.no_grad():
                return self._decide(ids, greedy)
        finally:
            self._forced = None

    def _decide(self, query: torch.Tensor, greedy: int) -> Reading:
        raise NotImplementedError

    def window_ids(self) -> torch.Tensor:
        return torch.cat([self.ids[c] for c in self.order]) if self.order else torch.zeros(0, dtype=torch.long)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(forwards by kind, tokens forwarded by kind)."""
        return dict(self.forwards), dict(self.forward_tokens)

    def vision_tower_runs(self) -> int:
        return 0

    def info(self) -> dict[str, Any]:
        """Strategy-specific figures for the results (reused tokens and the like)."""
        return {}

    # ---- hooks ------------------------------------------------------------------------------

    def _append(self, cid: int, ids: torch.Tensor) -> None:
        pass

    def _evict(self, cid: int, index: int) -> None:
        pass

    def _recall(self, cid: int, at: int) -> None:
        pass

    def _count(self, kind: str, tokens: int) -> None:
        self.forwards[kind] += 1
        self.forward_tokens[kind] += int(tokens)

    def _segment_decide(self, segments: Sequence[Sequence[Segment]], first: int, query: torch.Tensor, greedy: int,
                        kind: str = "query") -> tuple[Reading, Any, list[int]]:
        """The query read after `segments` (a contiguous prefix of `first` tokens, positions =
        token indices), then greedy decoding in the same cache (or the forced reply in the same
        pass). Returns the reading, the cache (its tail holds the query's and the fed tokens' KV)
        and the reply tokens fed through the model."""
        cache = self.km.cache(segments, first)
        if self._forced:
            fed = self._forced[:-1]
            ids = torch.cat([query, torch.tensor(fed, dtype=torch.long)])
            logits = self.km.forward(ids, first, cache, logits_to_keep=len(fed) + 1).logits[0].float()
            self._count(kind, query.numel())
            if fed:
                self.forward_tokens["decode"] += len(fed)
            return (Reading(torch.log_softmax(logits[0], -1), forced_tokens(logits[0], logits[1:], self._forced, self.eos)),
                    cache, fed)
        logits = self.km.forward(query, first, cache, logits_to_keep=1).logits[0, -1].float()
        self._count(kind, query.numel())
        position = first + int(query.numel())
        fed: list[int] = []

        def step(token: int) -> torch.Tensor:
            nonlocal position
            out = self.km.forward(torch.tensor([token]), position, cache, logits_to_keep=1).logits[0, -1]
            self._count("decode", 1)
            fed.append(token)
            position += 1
            return out

        return Reading(torch.log_softmax(logits, -1), greedy_tokens(logits, greedy, self.eos, step)), cache, fed


class Reprefill(Strategy):
    """The window and the query through `model`'s own forward at every decision (`model`:
    default the wrapped model itself, float32; a bfloat16 copy for the noise floor)."""

    name = "reprefill"

    def __init__(self, km: KameraModel, model: Any = None, name: str | None = None) -> None:
        super().__init__(km)
        self.model = km.model if model is None else model
        if name is not None:
            self.name = name

    def _decide(self, query: torch.Tensor, greedy: int) -> Reading:
        ids = torch.cat([self.window_ids(), query])
        if self._forced:
            fed = self._forced[:-1]
            out = self.model(input_ids=torch.cat([ids, torch.tensor(fed, dtype=torch.long)])[None],
                             logits_to_keep=len(fed) + 1)
            self._count("prefill", ids.numel())
            if fed:
                self.forward_tokens["decode"] += len(fed)
            logits = out.logits[0].float()
            return Reading(torch.log_softmax(logits[0], -1), forced_tokens(logits[0], logits[1:], self._forced, self.eos))
        out = self.model(input_ids=ids[None], use_cache=True, logits_to_keep=1)
        self._count("prefill", ids.numel())
        cache = out.cache
        logits = out.logits[0, -1].float()

        def step(token: int) -> torch.Tensor:
            result = self.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1)
            self._count("decode", 1)
            return result.logits[0, -1].float()

        return Reading(torch.log_softmax(logits, -1), greedy_tokens(logits, greedy, self.eos, step))


@dataclass
class _Block:
    cid: int | None  # None: the attention-sink tokens
    kv: list[LayerKV]
    start: int  # the position its keys are rotated for


class Streaming(Strategy):
    """StreamingLLM-style KV (see the module docstring)."""

    name = "streaming"

    def __init__(self, km: KameraModel, sinks: int = 4) -> None:
        super().__init__(km)
        self.sinks = int(sinks)
        self.blocks: list[_Block] = []
        self.first_chunk: int | None = None
        self.canonical: dict[bytes, list[LayerKV]] = {}
        self.rotated_tokens = 0

    def _tokens(self) -> int:
        return sum(int(b.kv[0][0].shape[0]) for b in self.blocks)

    def _segments(self) -> tuple[list[list[Segment]], int]:
        layers: list[list[Segment]] = [[] for _ in self.km.specs]
        first = 0
        for block in self.blocks:
            for layer, (k, v) in zip(layers, block.kv):
                layer.append(Segment(k, v, first, 0))
            first += int(block.kv[0][0].shape[0])
        return layers, first

    def _place(self) -> None:
        """Re-rotate every block whose place changed to its new start (exact RoPE re-rotation)."""
        start = 0
        for block in self.blocks:
            if block.start != start:
                block.kv = relocate_kv(block.kv, self.km.specs, self.km.layout, start - block.start)
                self.rotated_tokens += int(block.kv[0][0].shape[0])
                block.start = start
            start += int(block.kv[0][0].shape[0])

    def _block_index(self, at: int) -> int:
        """Block index of window index `at` (the sink block, when held, comes first)."""
        return at + (1 if self.blocks and self.blocks[0].cid is None else 0)

    def _append(self, cid: int, ids: torch.Tensor) -> None:
        if self.first_chunk is None:
            self.first_chunk = cid
        segments, first = self._segments()
        cache = self.km.cache(segments, first)
        self.km.forward(ids, first, cache)
        self._count("in_context", ids.numel())
        self.blocks.append(_Block(cid, [(k.clone(), v.clone()) for k, v in cache.tail_kv()], first))

    def _evict(self, cid: int, index: int) -> None:
        at = self._block_index(index)
        block = self.blocks.pop(at)
        if cid == self.first_chunk and at == 0 and self.sinks > 0:
            sink = [(k[:self.sinks].clone(), v[:self.sinks].clone()) for k, v in block.kv]
            self.blocks.insert(0, _Block(None, sink, block.start))
        self._place()

    def _recall(self, cid: int, at: int) -> None:
        ids = self.ids[cid]
        key = ids.numpy().tobytes()
        if key not in self.canonical:
            self.canonical[key] = self.km.encode(ids)
            self._count("encode", ids.numel())
        index = self._block_index(at)
        if cid == self.first_chunk and index == 1 and self.blocks[0].cid is None:
            self.blocks.pop(0)  # the chunk the sinks came from is back at the front
            index = 0
        self.blocks.insert(index, _Block(cid, self.canonical[key], 0))
        self._place()

    def _decide(self, query: torch.Tensor, greedy: int) -> Reading:
        segments, first = self._segments()
        reading, _, _ = self._segment_decide(segments, first, query, greedy)
        return reading

    def info(self) -> dict[str, Any]:
        return {"sinks": self.sinks, "rerotated_tokens": self.rotated_tokens}


class WindowStrategy(Strategy):
    """An `agentwin.Window(km, budget_tokens, **window_args)` over a private RAM store, read as a
    user reads it (`Window.read`: the passes it owes and the query in its own forwards, then
    greedy decoding); every forward is counted by the window. The trace's evictions are issued
    explicitly before each append or recall, so the window's own budget never has to evict
    (checked after every operation)."""

    def __init__(self, km: KameraModel, name: str, budget_tokens: int, **window_args: Any) -> None:
        super().__init__(km)
        from agentwin.window import Window

        self.name = name
        self.window = Window(km, budget_tokens=budget_tokens, **window_args)
        self._id: dict[int, Any] = {}

    def _check(self) -> None:
        if self.window.chunks() != [self._id[c] for c in self.order]:
            raise RuntimeError(f"{self.name}: the window's order {self.window.chunks()} differs from the trace's "
                               f"{self.order}; the trace's budget and the window's disagree")

    def append(self, cid: int, text: str) -> None:
        super().append(cid, text)
        self._check()

    def recall(self, cid: int, at: int) -> None:
        super().recall(cid, at)
        self._check()

    def _append(self, cid: int, ids: torch.Tensor) -> None:
        from agentwin.content import Text

        self._id[cid] = self.window.append(Text(self.texts[cid]), pin=not self.order)  # the first chunk: the head

    def _evict(self, cid: int, index: int) -> None:
        self.window.evict(self._id[cid])

    def _recall(self, cid: int, at: int) -> None:
        self.window.recall(self._id[cid], at=at)

    def decide(self, query: str, greedy: int, forced: Sequence[int] | None = None) -> Reading:
        with torch.no_grad():
            if forced:
                forced = [int(t) for t in forced][:max(1, greedy)]
                read = self.window.read(query, continuation=forced[:-1])
                later = read.continuation_logprobs if len(forced) > 1 else None
                return Reading(read.logprobs, forced_tokens(read.logprobs, later, forced, self.eos))
            read = self.window.read(query, max_new_tokens=greedy)
        tokens = list(read.token_ids)
        if read.end_token is not None:  # the others' readings end with the end-of-sequence token
            tokens.append(read.end_token)
        return Reading(read.logprobs, tokens)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        stats = self.window.stats()
        return ({k: v for k, v in stats.forwards.items() if v}, {k: v for k, v in stats.forward_tokens.items() if v})

    def vision_tower_runs(self) -> int:
        return int(self.window.stats().encoder_calls)

    def info(self) -> dict[str, Any]:
        s = self.window.stats()
        return {"patch": self.window.policy, "passes": s.passes, "exact_hits": s.exact_hits,
                "exact_hit_tokens": s.exact_hit_tokens, "matched_tokens": s.matched_tokens,
                "approximate": s.approximate, "relocations": s.relocations, "patch_bytes": s.patch_bytes,
                "patched_kv_bytes": s.patched_kv_bytes, "evictions": s.evictions, "recalls": s.recalls}


class AgentwinStrategy(Strategy):
    """`agentwin.Window(km, budget_tokens, patch, rank, guard, **window_args)` over a private RAM store (the patch
    guard off unless `guard` says otherwise: True, or "auto" for the window's default). The trace's
    evictions are issued explicitly before each append or recall, so the window's own budget
    never has to evict (checked after every operation)."""

    def __init__(self, km: KameraModel, name: str, patch: str = "origin", rank: int | str | None = 16,
                 budget_tokens: int = 8192, guard: bool | str = False, similar: float | None = None,
                 **window_args: Any) -> None:
        super().__init__(km)
        from agentwin.patches.policies import OriginAkin, OriginSimilar
        from agentwin.window import Window
        from tools.bench.stale_guards import policy_named

        self.name = name
        if similar is not None and patch not in (OriginSimilar.name, OriginAkin.name):
            raise ValueError(f"similar= is a threshold of patch={OriginSimilar.name!r} or {OriginAkin.name!r}, "
                             f"not of {patch!r}")
        # a configured policy object where a threshold or a study's guard is asked for, as Window(patch=...) takes
        policy = policy_named(patch, *([] if similar is None else [similar]))
        self.window = Window(km, budget_tokens=budget_tokens, patch=policy, rank=rank, guard=guard, **window_args)
        self._id: dict[int, Any] = {}
        self.stale: list[int] = []  # per decision: placements served with a stale patch

    def _check(self, expected: list[int]) -> None:
        if self.window.chunks() != [self._id[c] for c in expected]:
            raise RuntimeError(f"{self.name}: the window's order {self.window.chunks()} differs from the trace's "
                               f"{expected}; the trace's budget and the window's disagree")

    def append(self, cid: int, text: str) -> None:
        super().append(cid, text)
        self._check(self.order)

    def recall(self, cid: int, at: int) -> None:
        super().recall(cid, at)
        self._check(self.order)

    def _append(self, cid: int, ids: torch.Tensor) -> None:
        from agentwin.content import Text

        self._id[cid] = self.window.append(Text(self.texts[cid]))

    def _evict(self, cid: int, index: int) -> None:
        self.window.evict(self._id[cid])

    def _recall(self, cid: int, at: int) -> None:
        self.window.recall(self._id[cid], at=at)

    def _decide(self, query: torch.Tensor, greedy: int) -> Reading:
        # As `Window.generate` reads the window: the chunks' segments (a patch or conditioned
        # pass where the placement needs one, counted by the window), then the query and the
        # decoded tokens as the cache's dense tail (counted here).
        stale = self.window.stats().stale_patches
        segments = self.window.segments()
        self.stale.append(self.window.stats().stale_patches - stale)
        reading, _, _ = self._segment_decide(segments, self.window.tokens(), query, greedy)
        return reading

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        stats = self.window.stats()
        forwards, tokens = Counter(stats.forwards), Counter(stats.forward_tokens)
        forwards.update(self.forwards)
        tokens.update(self.forward_tokens)
        return ({k: v for k, v in forwards.items() if v}, {k: v for k, v in tokens.items() if v})

    def vision_tower_runs(self) -> int:
        return int(self.window.stats().encoder_calls)

    def info(self) -> dict[str, Any]:
        stats = self.window.stats()
        return {"patch": self.window.policy, "rank": self.window.rank, "conditioned_passes": stats.conditioned_passes,
                "patch_hits": stats.patch_hits, "patch_misses": stats.patch_misses,
                "canonical_hits": stats.canonical_hits, "relocations": stats.relocations,
                "guard": self.window.guard, "patch_bytes": stats.patch_bytes, "patched_kv_bytes": stats.patched_kv_bytes,
                "max_kl": self.window.max_kl, "kl_bytes": list(stats.kl_bytes), "stale_per_decision": list(self.stale)}
