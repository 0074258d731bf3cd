"""The default (exact) window pays for each token once: a hook on the transformers model sees every
forward, and every read is checked against the model's own forward of the same tokens.

- appending runs nothing; a read runs one forward for the chunks waiting for their pass and the
  query together;
- a slide recomputes the chunks after the one that left, a recall to the old slot nothing;
- rows computed before after the same prefix are reused at token granularity (a repeated query,
  a chunk that starts like an earlier one);
- in-context KV kept by placement is exact reuse in a new process on the same store, and two
  processes reading the same chunks at once compute each placement once (the store's lease);
- vision chunks run the vision tower once; sliding-window layers stay exact across slides."""

from __future__ import annotations

import functools
import multiprocessing as mp

import pytest
import torch

from agentwin import KameraModel, Text, Window
from agentwin.store import ChunkStore
from tests.support import assert_close, forward_growth

TEXTS = ["the harbour master keeps the tide log", "she wrote the storm surge in it",
         "the keeper climbed the tower at dawn", "he replaced the cracked diaphragm",
         "the ferry left two hours late", "nobody asked why"]
QUERY = "who climbed the tower?"


@functools.lru_cache(maxsize=None)
def _km(name: str) -> KameraModel:
    return KameraModel.from_pretrained(name)


class Hook:
    """(ids, first position) of every forward of the transformers model."""

    def __init__(self, km: KameraModel) -> None:
        self.calls: list[tuple[list[int], int]] = []
        self._handle = km.model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        positions = kwargs.get("position_ids")
        self.calls.append((ids[0].tolist(), 0 if positions is None else int(positions.reshape(-1)[0])))

    def tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.calls)

    def __enter__(self) -> "Hook":
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def _oracle(km: KameraModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(km.model(input_ids=ids[None]).logits[0, -1].float(), -1)


def _same(km: KameraModel, mine: torch.Tensor, reference: torch.Tensor) -> None:
    """`mine` equals `reference` to float32 rounding through the model's forward: eps · max|log p| ·
    √(hidden_size · num_layers) (`tests.support.forward_growth`)."""
    assert_close(mine, reference, what="next-token log-probabilities", growth=forward_growth(km.model.config))


def _exact(win: Window, query: str = QUERY) -> None:
    """The window's read equals the model's own forward of the same tokens."""
    _same(win.km, win.next_token_logprobs(query), _oracle(win.km, win.input_ids(query)))


def test_a_read_runs_one_forward_for_the_waiting_chunks_and_its_query():
    km = _km("tiny-llama-gqa")
    win = Window(km)
    n = [len(km.tokenize(t)) for t in TEXTS]
    q = len(km.tokenize(QUERY))
    with Hook(km) as hook:
        for t in TEXTS[:3]:
            win.append(t)
        assert hook.calls == []  # appending computes nothing
        mine = win.next_token_logprobs(QUERY)
        assert len(hook.calls) == 1 and hook.tokens() == sum(n[:3]) + q  # one forward: chunks, then the query
        assert hook.calls[0][0] == win.input_ids(QUERY).tolist() and hook.calls[0][1] == 0
        win.append(TEXTS[3])
        win.next_token_logprobs(QUERY)  # the new chunk and the query, after the three held
        assert len(hook.calls) == 2 and len(hook.calls[1][0]) == n[3] + q and hook.calls[1][1] == sum(n[:3])
        other = "is anything late?"  # shares no first token with QUERY (a shared prefix would be reused)
        win.next_token_logprobs(other)  # nothing owed: the query alone
        assert len(hook.calls[2][0]) == len(km.tokenize(other))
    _same(km, mine, _oracle(km, torch.cat([km.tokenize(t) for t in TEXTS[:3]] + [km.tokenize(QUERY)])))
    _exact(win)
    assert win.stats().forwards.get("encode", 0) == 0 and win.stats().patch_bytes == 0


def test_a_slide_recomputes_the_survivors_and_a_recall_to_the_old_slot_nothing():
    km = _km("tiny-llama-gqa")
    n = [len(km.tokenize(t)) for t in TEXTS]
    win = Window(km, budget_tokens=n[0] + n[2] + max(n[1], n[3]))  # room for one more once TEXTS[1] leaves
    head = win.append(TEXTS[0], pin=True)
    ids = [head, win.append(TEXTS[1]), win.append(TEXTS[2])]
    win.next_token_logprobs(QUERY)
    with Hook(km) as hook:
        win.append(TEXTS[3])  # over budget: the oldest unpinned chunk (TEXTS[1]) leaves
        assert win.chunks() == [head, ids[2], 3] and hook.calls == []
        _exact(win)
        # TEXTS[2] recomputed after the head (position n[0]), TEXTS[3] computed, then the query;
        # the reference re-prefill is not hooked here: it runs the model too, so count before it.
    first = hook.calls[0]
    assert first[1] == n[0] and len(first[0]) == n[2] + n[3] + len(km.tokenize(QUERY))
    s = win.stats()
    assert s.forward_tokens["recompute"] == n[2] and s.forward_tokens["in_context"] == n[0] + n[1] + n[2] + n[3]
    win.evict(3)
    win.recall(ids[1], at=1)  # back to [head, TEXTS[1], TEXTS[2]]: every placement seen before
    with Hook(km) as hook:
        win.next_token_logprobs(QUERY)
    assert len(hook.calls) == 1 and len(hook.calls[0][0]) == 1  # the same read again: its last row only
    _exact(win)


def test_rows_computed_after_the_same_prefix_are_reused_token_by_token():
    km = _km("tiny-llama-gqa")
    win = Window(km)
    a = win.append(TEXTS[0])
    b = win.append("the harbour master sleeps")
    win.next_token_logprobs(QUERY)
    win.evict(b)
    # A new chunk after the same prefix that starts like the evicted one: only the rest is computed.
    shared = len(km.tokenize("the harbour master "))
    with Hook(km) as hook:
        win.append("the harbour master counts the boats")
        win.next_token_logprobs(QUERY)
    new = len(km.tokenize("the harbour master counts the boats"))
    assert len(hook.calls) == 1 and len(hook.calls[0][0]) == new - shared + len(km.tokenize(QUERY))
    assert win.stats().matched_tokens >= shared
    _exact(win)
    assert win.chunks()[0] == a


def test_generate_decodes_as_the_model_does_and_a_repeated_read_reuses_its_reply():
    km = _km("tiny-llama-gqa")
    win = Window(km)
    for t in TEXTS[:3]:
        win.append(t)
    out = win.generate_ids(QUERY, 6)
    ids = win.input_ids(QUERY)
    with torch.no_grad():
        ref = km.model.generate(ids[None], max_new_tokens=6, do_sample=False, attention_mask=torch.ones(1, len(ids),
                                                                                                         dtype=torch.long))
    assert out == ref[0, len(ids):].tolist()[:len(out)]
    with Hook(km) as hook:
        read = win.read(QUERY, max_new_tokens=6)
    assert read.token_ids == out
    # prefix caching with replies: the query's rows are reused (its last row computed for the
    # logits), and each decode step computes its one token
    assert len(hook.calls[0][0]) == 1 and all(len(c[0]) == 1 for c in hook.calls)


def _process_read(root: str, texts: list[str], query: str, queue, barrier=None) -> None:
    km = KameraModel.from_pretrained("tiny-llama-gqa")
    win = Window(km, store=ChunkStore(root, model_fingerprint=km.fingerprint))
    for t in texts:
        win.append(t)
    if barrier is not None:
        barrier.wait(60)  # both read at once
    logprobs = win.next_token_logprobs(query)
    s = win.stats()
    queue.put((dict(s.forward_tokens), s.exact_hits, s.waited, logprobs.tolist()))


def test_a_new_process_on_the_same_store_reads_every_placement_exactly_with_no_chunk_forward(tmp_path):
    km = _km("tiny-llama-gqa")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    first = ctx.Process(target=_process_read, args=(str(tmp_path), TEXTS[:4], QUERY, queue))
    first.start()
    tokens, hits, _, theirs = queue.get(timeout=120)
    first.join(60)
    assert tokens["in_context"] == sum(len(km.tokenize(t)) for t in TEXTS[:4]) and hits == 0
    win = Window(km, store=ChunkStore(tmp_path, model_fingerprint=km.fingerprint))
    for t in TEXTS[:4]:
        win.append(t)
    mine = win.next_token_logprobs(QUERY)
    s = win.stats()
    assert dict(s.forward_tokens) == {"query": len(km.tokenize(QUERY))} and s.exact_hits == 4
    _same(km, mine, torch.tensor(theirs))
    _same(km, mine, _oracle(km, win.input_ids(QUERY)))


@pytest.mark.slow
def test_two_processes_reading_the_same_chunks_at_once_compute_each_placement_once(tmp_path):
    km = _km("tiny-llama-gqa")
    texts = [" ".join([t] * 30) for t in TEXTS[:4]]
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_process_read, args=(str(tmp_path), texts, QUERY, queue, barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
    computed = sum(r[0].get("in_context", 0) for r in results)
    served = sum(r[1] for r in results)
    assert computed == sum(len(km.tokenize(t)) for t in texts)  # each placement once across both
    assert served == len(texts)  # the other process read each from the store
    assert sum(r[2] for r in results) >= 1  # ... after waiting for the one computing it
    ref = _oracle(km, torch.cat([km.tokenize(t) for t in texts] + [km.tokenize(QUERY)]))
    for r in results:
        _same(km, torch.tensor(r[3]), ref)


def test_vision_chunks_run_the_tower_once_and_stay_exact():
    import numpy as np

    from agentwin import Image

    km = _km("tiny-qwen2.5-vl")
    g = np.random.default_rng(0)
    pictures = [g.integers(0, 256, (56, 84, 3), dtype=np.uint8) for _ in range(2)]
    win = Window(km, budget_tokens=4096)
    ids = [win.append(Text("A shelf.")), win.append(Image(pictures[0])), win.append(Text(" then")),
           win.append(Image(pictures[1])), win.append(Text(" end."))]
    _same(km, win.next_token_logprobs(" What changed?"), win.reference_logprobs(" What changed?"))
    assert win.stats().encoder_calls == 2
    win.evict(ids[1])
    win.recall(ids[1])
    win.reorder([ids[3], ids[0], ids[1], ids[2], ids[4]])
    _same(km, win.next_token_logprobs(" What changed?"), win.reference_logprobs(" What changed?"))
    assert win.stats().encoder_calls == 2  # moved and recalled: no tower run


def test_sliding_window_layers_stay_exact_across_slides():
    km = _km("tiny-gemma3")  # a 64-token sliding window on layer 0
    texts = [" ".join([t] * 3) for t in TEXTS]
    budget = sum(len(km.tokenize(t)) for t in texts[:3])
    win = Window(km, budget_tokens=budget)
    for t in texts:
        win.append(t)
        _exact(win)
    assert win.stats().evictions >= 2 and win.tokens() > 64
