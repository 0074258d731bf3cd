"""The KV engine: segment attention inside transformers (`agentwin.models.segments`) and the
Window built on it. Exactness is checked against the transformers model's own forward with its
eager attention (a twin model built from the same seed), never against our code: sliding-window
layers (Gemma-3, chunks longer than the window), every tiny family, bf16, bad segment tables, and
eviction that lets go of memory."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from agentwin.models.adapter import KameraModel
from agentwin.models.segments import SegmentCache
from agentwin.models.zoo import TINY, build_tiny
from agentwin.store import ChunkStore
from agentwin.window import Text, Window
from kamera_core import patch as kp
from kamera_core.segment import Segment, segment_attention_reference
from tests.support import assert_close, cast_model, forward_growth, tolerance, window_step

QUERY = "which keeper?"


@functools.lru_cache(maxsize=None)
def _pair(name: str) -> tuple[KameraModel, torch.nn.Module]:
    """The wrapped model (segment attention) and its eager twin (same seed, same weights)."""
    return KameraModel.from_pretrained(name), build_tiny(name)


def _same(km: KameraModel, mine: torch.Tensor, reference: torch.Tensor, what: str = "next-token log-probabilities") -> None:
    """`mine` equals `reference` (log-probabilities or logits) to float32 rounding through the
    model's forward: eps · max|reference| · √(hidden_size · num_layers) (`tests.support.forward_growth`)."""
    assert_close(mine, reference, what=what, growth=forward_growth(km.model.config))


def _eager_logprobs(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(**inputs).logits[0, -1].float(), -1)


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_plain_forward_under_segment_attention_is_the_models_own(name):
    """The wrapped model's plain forward (what `reference_logprobs` runs) equals the eager twin:
    the oracle the window tests use is transformers' own computation."""
    km, twin = _pair(name)
    ids = torch.randint(3, 240, (150,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = km.model(input_ids=ids[None]).logits, twin(input_ids=ids[None]).logits
    assert km.model.config.get_text_config()._attn_implementation == "kamera"
    _same(km, ours, theirs, "logits")


def _long_text(seed: int, words: int) -> str:
    g = torch.Generator().manual_seed(seed)
    vocab = ["tide", "lamp", "keeper", "storm", "harbour", "log", "ferry", "dawn", "tower", "horn"]
    return " ".join(vocab[int(i)] for i in torch.randint(0, len(vocab), (words,), generator=g))


# Gemma-3 tiny: 64-token sliding window on layer 0 (own RoPE base), global layer 1 (linear scaling).
GEMMA_TEXTS = [_long_text(s, w) for s, w in ((0, 20), (1, 40), (2, 8), (3, 25))]  # ~100-250 tokens each

gemma_ops = st.lists(st.tuples(st.sampled_from(["append", "evict", "recall", "reorder", "query"]), st.integers(0, 3)),
                     min_size=1, max_size=8)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=gemma_ops)
@example(sequence=[("append", 1), ("append", 0), ("append", 3), ("evict", 0), ("recall", 0)])
def test_gemma3_sliding_window_exact_after_any_sequence(sequence):
    """Chunks several times longer than the 64-token local window: the window stays exact with
    exact patches, against the eager model's own sliding-window forward."""
    km, twin = _pair("tiny-gemma3")
    assert km.model.config.sliding_window == 64
    win = Window(km, budget_tokens=4096, patch="origin", rank=None)
    evicted: list = []
    for op, arg in sequence:
        window_step(win, op, arg, evicted, lambda op, arg: op == "append" and win.append(GEMMA_TEXTS[arg]))
        win.check_integrity()
        if win.chunks():
            assert max(len(km.tokenize(GEMMA_TEXTS[0])), win.tokens()) > 64
        mine = win.next_token_logprobs(QUERY)
        expected = _eager_logprobs(twin, win.reference_inputs(QUERY))
        _same(km, mine, expected)


def test_gemma3_generate_matches_the_eager_models_greedy_decoding():
    km, twin = _pair("tiny-gemma3")
    win = Window(km, patch="origin", rank=4)
    for t in GEMMA_TEXTS[:3]:
        win.append(t)
    ids = win.input_ids(QUERY)
    text = win.generate(QUERY, max_new_tokens=12)
    with torch.no_grad():
        out = twin.generate(ids[None], max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert text == km.tokenizer.decode(out[0, len(ids):].tolist())


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v2", "tiny-gemma3"])
def test_exact_after_evict_recall_reorder_on_more_families(name):
    km, twin = _pair(name)
    win = Window(km, budget_tokens=4096, patch="origin", rank=None)
    ids = [win.append(t) for t in GEMMA_TEXTS[:3]]
    win.evict(ids[0])
    win.recall(ids[0], at=2)
    win.reorder([ids[2], ids[0], ids[1]])
    _same(km, win.next_token_logprobs(QUERY), _eager_logprobs(twin, win.reference_inputs(QUERY)))


def test_bf16_window_is_within_the_models_own_bf16_error():
    """bf16: the window's error against the float32 forward is no larger than the bf16 model's own
    forward's error against it (a margin of 2x for rounding in a different order), plus what
    float32 rounding alone explains."""
    km32, _ = _pair("tiny-llama-gqa")
    km16 = KameraModel(cast_model(build_tiny("tiny-llama-gqa"), torch.bfloat16), name="tiny-llama-gqa-bf16")
    texts = GEMMA_TEXTS[:3]
    win = Window(km16, patch="origin", rank=None)
    ids = [win.append(t) for t in texts]
    win.evict(ids[0])
    win.recall(ids[0])
    inputs = win.reference_inputs(QUERY)
    exact = _eager_logprobs(_pair("tiny-llama-gqa")[1], inputs)
    own = float((_eager_logprobs(km16.model, inputs) - exact).abs().max())
    ours = float((win.next_token_logprobs(QUERY) - exact).abs().max())
    assert km32 is not km16 and own > 0
    # the float32 floor of the comparison (`tests.support.forward_growth`) in place of a fixed 1e-3
    assert ours <= 2 * own + tolerance(torch.float32, float(exact.abs().max()), forward_growth(km32.model.config)), (ours, own)


def test_bad_segment_tables_are_refused_clearly():
    km, _ = _pair("tiny-llama-gqa")
    spec = km.specs[0]
    q = torch.randn(2, 4, 16)
    k, v = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    index = torch.tensor([20, 21])
    with pytest.raises(ValueError, match="overlap"):
        segment_attention_reference(q, index, [Segment(k, v, 0), Segment(k, v, 5)], spec, 0.25)
    bad = kp.LayerPatch(kp.Factors(torch.randn(9, 2), torch.randn(2, 2, 16)), None)
    with pytest.raises(ValueError, match="patch"):
        segment_attention_reference(q, index, [Segment(k, v, 0, 3, bad)], spec, 0.25)
    with pytest.raises(ValueError, match="another model"):
        segment_attention_reference(q, index, [Segment(torch.randn(10, 2, 8), torch.randn(10, 2, 8), 0)], spec, 0.25)
    with pytest.raises(ValueError, match="sees no key"):  # every key past the window of the query rows
        segment_attention_reference(q, index, [Segment(k, v, 0)], spec, 0.25, window=4)
    with pytest.raises(ValueError, match="another model"):
        SegmentCache([[]], 0, km.specs, km.layout)  # one layer of segments for a two-layer model


def test_a_cache_from_another_model_is_refused_and_the_store_keeps_its_entries():
    km, _ = _pair("tiny-llama-gqa")
    other, _ = _pair("tiny-gpt-neox")
    win = Window(km, patch="origin", rank=None)
    win.append(GEMMA_TEXTS[0])
    before = win.store.stats().ram_entries
    foreign = other.cache()
    with pytest.raises((TypeError, ValueError)):
        km.query_logits(foreign, win.tokens(), km.tokenize(QUERY))
    with pytest.raises(TypeError, match="SegmentCache"):
        km.forward(km.tokenize(QUERY), 0, cache=object())
    assert win.store.stats().ram_entries == before
    _same(km, win.next_token_logprobs(QUERY), win.reference_logprobs(QUERY))


def test_eviction_lets_go_of_kv_and_the_store_budget_bounds_what_stays():
    """The window holds KV only for chunks in it; evicted chunks live in the store alone, whose
    RAM budget bounds them; a recall reads them back (or re-encodes, counted) and stays exact."""
    km, twin = _pair("tiny-llama-gqa")
    entry = None
    store = ChunkStore(None, ram_bytes=1 << 30, model_fingerprint=km.fingerprint)
    texts = [_long_text(10 + i, 30) for i in range(12)]
    budget = max(len(km.tokenize(t)) for t in texts) * 2
    win = Window(km, budget_tokens=budget, patch="origin", rank=None, store=store)
    ids = [win.append(t) for t in texts[:2]]
    win.materialize()
    entry = win.stats().held_bytes
    assert entry > 0
    for t in texts[2:]:
        ids.append(win.append(t))
        win.materialize()
        win.check_integrity()
        assert win.stats().held_bytes <= 2 * entry  # only what is in the window
    assert len(win.chunks()) <= 2 and win.stats().evictions >= 10
    # A store with a small RAM budget and no disk: old entries are dropped, and a recall of a
    # dropped chunk encodes it again (counted) and is still exact.
    small = ChunkStore(None, ram_bytes=3 * entry, model_fingerprint=km.fingerprint)
    win2 = Window(km, budget_tokens=budget, patch="origin", rank=None, store=small)
    ids2 = []
    for t in texts:
        ids2.append(win2.append(t))
        win2.materialize()
    assert small.stats().ram_bytes <= 3 * entry and small.stats().evictions > 0
    encodes = win2.stats().forwards["encode"]
    win2.recall(ids2[0], at=0)
    _same(km, win2.next_token_logprobs(QUERY), _eager_logprobs(twin, win2.reference_inputs(QUERY)))
    assert win2.stats().forwards["encode"] == encodes + 1


def test_recall_writes_no_kv_bytes():
    """A recall to a slot whose patch is stored reads canonical KV where the store holds it: the
    segments the query attends are the store's own tensors (no copy). The exact window's recall to
    the slot a chunk was computed at reads its in-context KV where the store keeps it (under its
    placement key), also with no copy."""
    from agentwin.prefix import placement_key, root_key

    km, _ = _pair("tiny-llama-gqa")
    win = Window(km, patch="origin", rank=None)
    ids = [win.append(t) for t in GEMMA_TEXTS[:3]]
    win.evict(ids[1])
    win.next_token_logprobs(QUERY)
    win.evict(ids[2])
    win.recall(ids[1])
    segments = win.segments()
    stored = win.store.get(win._chunks[ids[1]].key)[0]
    seg = next(s for s in segments[0] if s.shift != 0)
    assert seg.keys.data_ptr() == stored["k.0"].data_ptr() and seg.values.data_ptr() == stored["v.0"].data_ptr()
    exact = Window(km)
    ids = [exact.append(t) for t in GEMMA_TEXTS[:3]]
    exact.materialize()
    exact.evict(ids[1])
    exact.next_token_logprobs(QUERY)
    exact.evict(ids[2])
    exact.recall(ids[1])
    keys = [exact._chunks[c].key for c in ids[:2]]
    placed = exact.store.get(placement_key(placement_key(root_key(km.fingerprint), keys[0]), keys[1]))[0]
    seg = exact.segments()[0][1]
    assert seg.shift == 0 and exact.stats().exact_hits == 1
    assert seg.keys.data_ptr() == placed["k.0"].data_ptr() and seg.values.data_ptr() == placed["v.0"].data_ptr()


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-gemma3"])
def test_batched_variants_read_each_rows_own_segments(name):
    """`KameraModel.forward_variants` (the patch guard's one forward for blind and patched): batch
    row 0 reads the head's own KV and equals the eager twin's forward over head + tail; row 1 reads
    the head with a patch added and equals a forward of batch 1 over that cache."""
    km, twin = _pair(name)
    ids = torch.randint(3, 240, (120,), generator=torch.Generator().manual_seed(4))
    head, tail = ids[:100], ids[100:]
    kv = km.encode(head)
    g = torch.Generator().manual_seed(5)
    patched = [kp.LayerPatch(kp.Factors(torch.randn(100, 2, generator=g), torch.randn(2, *k.shape[1:], generator=g)),
                             None) for k, _ in kv]
    exact = [[Segment(k, v, 0, 0)] for k, v in kv]
    bent = [[Segment(k, v, 0, 0, p)] for (k, v), p in zip(kv, patched)]
    logits = km.forward_variants(tail, 100, [exact, bent], 100, logits_to_keep=20)
    assert logits.shape[:2] == (2, 20)
    with torch.no_grad():
        theirs = twin(input_ids=ids[None]).logits[0, -20:].float()
        alone = km.forward(tail, 100, km.cache(bent, 100), logits_to_keep=20).logits[0].float()
    _same(km, logits[0], theirs, "logits")
    _same(km, logits[1], alone, "logits")
    assert float((logits[1] - logits[0]).abs().max()) > 1e-2  # the rows did read different KV
    with pytest.raises(ValueError, match="text tokens|at least one"):
        km.forward_variants(tail, 100, [], 100)
