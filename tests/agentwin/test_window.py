"""The Window over tiny models and the real SmolLM2: exactness with exact patches under random
operation sequences (checked against the transformers model's own forward of `input_ids`),
incremental materialisation, budgets, and input validation that leaves state unchanged."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from agentwin.patches.guard import PROBE_ROWS
from agentwin.models.adapter import KameraModel
from agentwin.window import ChunkId, Text, Window
from tests.support import assert_close, forward_growth, tolerance, window_step

TEXTS = ["the harbour master keeps the tide log", "she wrote the storm surge in it",
         "the keeper climbed the tower at dawn", "he replaced the cracked diaphragm",
         "the ferry left two hours late", "nobody asked why"]
QUERY = "who climbed the tower?"


@functools.lru_cache(maxsize=None)
def _km(name: str) -> KameraModel:
    return KameraModel.from_pretrained(name)


def _same_logprobs(km: KameraModel, mine: torch.Tensor, reference: torch.Tensor) -> None:
    """`mine` equals `reference` to float32 rounding through the model's forward: eps · max|log p| ·
    √(hidden_size · num_layers) (`tests.support.forward_growth`)."""
    assert_close(mine, reference, what="next-token log-probabilities", growth=forward_growth(km.model.config))


def _model_logprobs(km: KameraModel, ids: torch.Tensor) -> torch.Tensor:
    """The oracle: a plain transformers forward of the given ids."""
    with torch.no_grad():
        logits = km.model(input_ids=ids[None]).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)


ops = st.lists(st.tuples(st.sampled_from(["append", "evict", "recall", "reorder", "query"]), st.integers(0, 5)),
               min_size=1, max_size=9)


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-gpt-neox"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=ops)
# every chunk evicted, then one recalled to its old slot 1 of an empty window (clamped to 0)
@example(sequence=[("append", 0), ("append", 0), ("evict", 1), ("evict", 0), ("recall", 0)])
def test_exact_patches_match_reprefill_after_any_sequence(name, sequence):
    km = _km(name)
    win = Window(km, budget_tokens=4096, patch="origin", rank=None)
    evicted: list = []
    for op, arg in sequence:
        window_step(win, op, arg, evicted, lambda op, arg: op == "append" and win.append(Text(TEXTS[arg % len(TEXTS)])))
        win.check_integrity()
        mine = win.next_token_logprobs(QUERY)
        _same_logprobs(km, mine, win.reference_logprobs(QUERY))
        _same_logprobs(km, mine, _model_logprobs(km, win.input_ids(QUERY)))


def test_recall_to_old_slot_reuses_its_patch_without_a_pass():
    km = _km("tiny-llama-gqa")
    win = Window(km, patch="origin", rank=None)
    ids = [win.append(t) for t in TEXTS[:3]]
    win.next_token_logprobs(QUERY)
    win.evict(ids[1])
    win.next_token_logprobs(QUERY)  # the third chunk now needs a patch for a new antecedent
    passes = win.stats().conditioned_passes
    # one pass computed the third chunk after its new antecedent, counted whether it ran alone or batched
    assert passes == 1 and win.stats().forward_tokens["conditioned"] == win.chunk_tokens(ids[2])
    win.recall(ids[1])
    assert win.chunks() == ids
    mine = win.next_token_logprobs(QUERY)
    assert win.stats().conditioned_passes == passes  # every antecedent was seen before
    _same_logprobs(km, mine, win.reference_logprobs(QUERY))


def test_low_rank_origin_patch_beats_blind_reuse():
    km = _km("tiny-llama-gqa")
    errs = {}
    for policy in ("none", "origin"):
        win = Window(km, patch=policy, rank=4)
        for t in TEXTS[:4]:
            win.append(t)
        reference = win.reference_logprobs(QUERY)
        errs[policy] = float((win.next_token_logprobs(QUERY) - reference).abs().max())
    assert errs["origin"] < errs["none"]
    # blind reuse reads outside what rounding explains (the exact reads' tolerance)
    assert errs["none"] > tolerance(torch.float32, float(reference.abs().max()), forward_growth(km.model.config))


def test_append_serves_its_in_context_pass_and_encodes_each_content_once():
    """A patch policy's append runs the chunk's prefill after the window (read in place) and
    serves that exact KV: even rank-2 patches then leave the window exact, and no chunk is
    relocated. The first chunk's canonical encode is its prefill; later chunks cost one encode and
    one in-context pass (and, with the patch guard on, as it is for rank=N windows, one forward of
    the chunk's last rows as a batch of two: blind and patched)."""
    km = _km("tiny-llama-gqa")
    win = Window(km, patch="origin", rank=2, guard=False)
    for t in TEXTS[:3]:
        win.append(t)
    mine = win.next_token_logprobs(QUERY)
    s = win.stats()
    assert dict(s.forwards) == {"encode": 3, "in_context": 2, "query": 1}
    guarded = Window(km, patch="origin", rank=2)
    assert guarded.guard
    ids = [guarded.append(t) for t in TEXTS[:3]]
    g = guarded.stats()
    assert dict(g.forwards) == {"encode": 3, "in_context": 2, "guard": 2}
    probe_rows = [min(PROBE_ROWS, guarded.chunk_tokens(c) // 2) for c in ids[1:]]  # each later chunk's last rows
    assert g.forward_tokens["guard"] == 2 * sum(probe_rows)  # blind and patched rows both computed
    assert s.relocations == 0 and s.relocated_tokens == 0 and s.conditioned_passes == 0
    _same_logprobs(km, mine, _model_logprobs(km, win.input_ids(QUERY)))
    # The same content again in a second window over the same store: canonical KV and the patch
    # for this very antecedent are stored, so the patch policy runs only the query.
    again = Window(km, patch="origin", rank=2, guard=False, store=win.store)  # win's settings
    for t in TEXTS[:3]:
        again.append(t)
    again.next_token_logprobs(QUERY)
    s2 = again.stats()
    assert dict(s2.forwards) == {"query": 1} and s2.canonical_hits == 3
    assert s2.relocated_tokens == sum(len(km.tokenize(t)) for t in TEXTS[1:3])
    # The exact window keeps in-context KV by placement: a second exact window over the same
    # store and order runs only the query, and reads what the first read.
    first = Window(km)
    for t in TEXTS[:3]:
        first.append(t)
    expected = first.next_token_logprobs(QUERY)
    second = Window(km, store=first.store)
    for t in TEXTS[:3]:
        second.append(t)
    got = second.next_token_logprobs(QUERY)
    s3 = second.stats()
    assert dict(s3.forwards) == {"query": 1} and s3.exact_hits == 3 and s3.relocated_tokens == 0
    _same_logprobs(km, got, expected)


def test_exact_window_forwards_each_token_once_and_only_what_a_change_invalidates():
    """The default window: appending runs nothing; no canonical encode and no patch, one forward
    per read for the chunks waiting for their pass and the query together; a slide recomputes the chunks after the one that
    left (counted as recompute), a recall to the old slot recomputes nothing, and every read equals
    the transformers model's own forward of the same tokens."""
    km = _km("tiny-llama-gqa")
    win = Window(km)
    assert win.policy == "exact"
    ids = [win.append(t) for t in TEXTS[:3]]
    assert win.stats().passes == 0
    mine = win.next_token_logprobs(QUERY)
    s = win.stats()
    n = [len(km.tokenize(t)) for t in TEXTS]
    q = len(km.tokenize(QUERY))
    assert s.passes == 1 and dict(s.forward_tokens) == {"in_context": sum(n[:3]), "query": q}
    _same_logprobs(km, mine, _model_logprobs(km, win.input_ids(QUERY)))
    win.evict(ids[0])
    mine = win.next_token_logprobs(QUERY)
    s = win.stats()
    assert s.passes == 2 and s.forward_tokens["recompute"] == n[1] + n[2]
    _same_logprobs(km, mine, _model_logprobs(km, win.input_ids(QUERY)))
    win.recall(ids[0])
    mine = win.next_token_logprobs(QUERY)
    s = win.stats()
    assert s.passes == 3 and s.forward_tokens["recompute"] == n[1] + n[2] and s.exact_hits == 3
    assert s.forward_tokens["query"] == 3 * q - (q - 1)  # the same read again: its last row only
    _same_logprobs(km, mine, _model_logprobs(km, win.input_ids(QUERY)))
    assert s.forwards.get("encode", 0) == 0 and s.patch_bytes == 0


def test_budget_slides_fifo_and_respects_pins():
    km = _km("tiny-llama-gqa")
    sizes = [len(km.tokenize(t)) for t in TEXTS[:3]]
    win = Window(km, budget_tokens=sizes[0] + max(sizes[1], sizes[2]) + 1, patch="none")
    first = win.append(TEXTS[0], pin=True)
    second = win.append(TEXTS[1])
    third = win.append(TEXTS[2])
    assert win.chunks() == [first, third] and second not in win.chunks()
    assert win.stats().evictions == 1
    win.check_integrity()
    with pytest.raises(ValueError, match="pinned"):
        win.pin(third)
        win.append(TEXTS[3])
    assert win.chunks() == [first, third]


def test_input_ids_are_the_window_then_the_query():
    km = _km("tiny-llama-gqa")
    win = Window(km, patch="none")
    a, b = win.append(TEXTS[0]), win.append(TEXTS[1])
    win.reorder([b, a])
    expected = torch.cat([km.tokenize(TEXTS[1]), km.tokenize(TEXTS[0]), km.tokenize(QUERY)])
    assert torch.equal(win.input_ids(QUERY), expected)
    assert torch.equal(win.input_ids(), expected[: -len(km.tokenize(QUERY))])


def test_bad_input_raises_and_leaves_the_window_as_it_was():
    km = _km("tiny-llama-gqa")
    win = Window(km, patch="origin", rank=None)
    a = win.append(TEXTS[0])
    state = (win.chunks(), win.tokens())
    with pytest.raises(TypeError):
        win.append(123)
    with pytest.raises(ValueError):
        win.append("")
    with pytest.raises(ValueError):
        win.evict(99)
    with pytest.raises(ValueError):
        win.recall(a)  # already in the window
    with pytest.raises(ValueError):
        win.reorder([a, a])
    with pytest.raises(ValueError):
        Window(km, patch="sometimes")
    with pytest.raises(ValueError):
        Window(km, rank=0)
    with pytest.raises(TypeError):
        Window("not a model")
    assert (win.chunks(), win.tokens()) == state
    win.check_integrity()


def test_unsupported_vision_language_family_refused_with_reason():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(text_config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                      "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                                      "vocab_size": 300},
                         vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                        "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                                        "patch_size": 14},
                         image_token_id=299)
    with pytest.raises(ValueError, match="vision-language family 'llava' is not supported"):
        KameraModel(LlavaForConditionalGeneration(config))


@pytest.mark.slow
def test_smollm2_window_exact_and_generates(smollm2):
    model, tokenizer = smollm2
    km = KameraModel(model, tokenizer, name="smollm2")
    win = Window(km, patch="origin", rank=None)
    ids = [win.append(t) for t in ("Anja Roth is the harbour master.", " Tobias keeps the lighthouse.",
                                   " The storm broke the fog horn.")]
    win.evict(ids[1])
    win.recall(ids[1])
    query = " Who keeps the lighthouse?"
    mine = win.next_token_logprobs(query)
    _same_logprobs(km, mine, _model_logprobs(km, win.input_ids(query)))
    text = win.generate(query, max_new_tokens=6)
    with torch.no_grad():
        plain = model.generate(win.input_ids(query)[None], max_new_tokens=6, do_sample=False)
    new = plain[0, len(win.input_ids(query)):].tolist()
    eos = model.config.eos_token_id
    new = new[: new.index(eos)] if eos in new else new
    assert text == tokenizer.decode(new)


def test_store_shares_canonical_kv_and_patches_across_windows(tmp_path):
    from agentwin.store import ChunkStore

    km = _km("tiny-llama-gqa")
    store = ChunkStore(tmp_path, model_fingerprint=km.fingerprint)
    first = Window(km, patch="origin", rank=None, store=store)
    for t in TEXTS[:3]:
        first.append(t)
    expected = first.next_token_logprobs(QUERY)
    # Another window (here: another store object on the same root, as another process would
    # open it) sees the same content: no encode, no conditioned pass, the same distribution.
    second = Window(km, patch="origin", rank=None, store=ChunkStore(tmp_path, model_fingerprint=km.fingerprint))
    for t in TEXTS[:3]:
        second.append(t)
    got = second.next_token_logprobs(QUERY)
    s = second.stats()
    assert s.canonical_hits == 3 and s.conditioned_passes == 0 and s.store_hit_tokens > 0
    assert s.store.hits >= 3 and s.store.disk_bytes > 0
    # The first window serves its in-context passes, the second canonical KV + exact patches:
    # the same distribution up to float32 rounding.
    _same_logprobs(km, got, expected)
    _same_logprobs(km, got, second.reference_logprobs(QUERY))


def test_store_of_another_model_is_refused(tmp_path):
    from agentwin.store import ChunkStore

    km = _km("tiny-llama-gqa")
    with pytest.raises(ValueError, match="another model"):
        Window(km, store=ChunkStore(tmp_path, model_fingerprint="0" * 32))
    with pytest.raises(TypeError):
        Window(km, store={})


def test_chunk_moved_to_the_front_uses_its_exact_canonical_kv():
    km = _km("tiny-llama-gqa")
    win = Window(km, patch="origin", rank=2)
    first, second = win.append(TEXTS[0]), win.append(TEXTS[1])
    win.evict(first)  # `second` now has no antecedent: its canonical KV is exactly right
    _same_logprobs(km, win.next_token_logprobs(QUERY), win.reference_logprobs(QUERY))


def test_key_summary_ranks_the_chunk_with_shared_content_first():
    """Retrieval signal: a question's key summary is closest to the chunk it was cut from."""
    km = KameraModel.from_pretrained("tiny-llama-gqa")
    win = Window(km, budget_tokens=4096, patch="none")
    texts = ["alpha beta gamma delta " * 6, "zzzz yyyy xxxx wwww " * 6, "0123456789 " * 12]
    ids = [win.append(Text(t)) for t in texts]
    win.evict(ids[1])
    summaries = torch.stack([win.key_summary(c) for c in ids])
    assert summaries.shape == (3, len(km.specs), summaries.shape[-1])
    probe = km.key_summary(km.tokenize("zzzz yyyy xxxx wwww zzzz"))
    score = torch.nn.functional.cosine_similarity(summaries, probe[None], dim=-1).mean(-1)
    assert int(score.argmax()) == 1, score
    with pytest.raises(ValueError, match="unknown chunk"):
        win.key_summary(ChunkId(99))


def _budget_for(km: KameraModel, texts: list[str], extra: int = 1) -> int:
    return sum(len(km.tokenize(t)) for t in texts) + extra


def test_lru_evicts_the_least_recently_used_chunk_fifo_the_oldest():
    km = _km("tiny-llama-gqa")
    order = {}
    for policy in ("fifo", "lru"):
        win = Window(km, budget_tokens=_budget_for(km, TEXTS[:3], extra=0), patch="none", evict=policy)
        a, b, c = (win.append(t) for t in TEXTS[:3])
        win.touch(a)
        win.append("x")  # one token over the budget: one chunk must go
        order[policy] = [x for x in (a, b, c) if x not in win.chunks()]
        win.check_integrity()
    assert order == {"fifo": [0], "lru": [1]}
    with pytest.raises(ValueError, match="evict must be one of"):
        Window(km, evict="random")


def test_recall_over_budget_slides_by_policy_and_keeps_pins():
    km = _km("tiny-llama-gqa")
    sizes = [len(km.tokenize(t)) for t in TEXTS[:3]]
    win = Window(km, budget_tokens=sum(sizes) + 1, patch="origin", rank=None)
    a, b, c = (win.append(t) for t in TEXTS[:3])
    win.evict(b)
    win.pin(a)
    d = win.append(TEXTS[3][: sizes[1]])  # fills the room b left
    evicted = win.recall(b)  # needs b's tokens back: c goes (a is pinned), not a
    assert evicted and a not in evicted and b in win.chunks()
    win.check_integrity()
    _same_logprobs(km, win.next_token_logprobs(QUERY), win.reference_logprobs(QUERY))
    # pinned chunks leaving no room: refused, nothing changed
    win.pin(b)
    for cid in win.chunks():
        win.pin(cid)
    gone = [x for x in (a, b, c, d) if x not in win.chunks()]
    state = win.chunks()
    with pytest.raises(ValueError, match="pinned"):
        win.recall(gone[0])
    assert win.chunks() == state
    assert win.slide(0) == []
    with pytest.raises(ValueError, match="free_tokens"):
        win.slide(-1)






@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=ops)
def test_smollm2_exact_patches_match_reprefill_after_any_sequence(smollm2, sequence):
    """The real model under random append / evict / recall sequences with exact patches: the
    window's next-token log-probabilities equal a plain transformers forward of input_ids."""
    model, tokenizer = smollm2
    km = _smollm2_km(model, tokenizer)
    win = Window(km, budget_tokens=4096, patch="origin", rank=None)
    evicted: list = []
    for op, arg in sequence:
        window_step(win, op, arg, evicted,
                    lambda op, arg: op == "append" and win.append(Text(" " + TEXTS[arg % len(TEXTS)] + ".")))
        win.check_integrity()
        mine = win.next_token_logprobs(" " + QUERY)
        _same_logprobs(km, mine, _model_logprobs(km, win.input_ids(" " + QUERY)))


@functools.lru_cache(maxsize=1)
def _smollm2_km(model, tokenizer) -> KameraModel:
    return KameraModel(model, tokenizer, name="smollm2")


def test_nearest_finds_a_chunk_by_its_own_text_in_or_out_of_the_window_and_counts_the_query():
    km = _km("tiny-llama-gqa")
    win = Window(km, patch="origin", rank=2)
    ids = [win.append(t) for t in TEXTS[:4]]
    win.evict(ids[1])
    for cid, text in zip(ids, TEXTS):
        best = win.nearest(text, k=2)
        # its own summary: cosine 1 up to float32 rounding of the normalised dot product (√width terms)
        width = win.key_summary(cid).shape[-1]
        assert best[0][0] == cid and best[0][1] == pytest.approx(1.0, abs=tolerance(torch.float32, 1.0, math.sqrt(width)))
        assert best[1][1] < best[0][1]
    some = win.nearest(TEXTS[0], k=9, among=[ids[3], ids[2]])
    assert sorted(c for c, _ in some) == [ids[2], ids[3]] and some[0][1] >= some[1][1]
    s = win.stats()
    assert s.forward_tokens["retrieval"] == sum(len(km.tokenize(t)) for t in TEXTS[:4]) + len(km.tokenize(TEXTS[0]))
    with pytest.raises(ValueError, match="k must be"):
        win.nearest(TEXTS[0], k=0)
    with pytest.raises(ValueError, match="unknown chunk"):
        win.nearest(TEXTS[0], among=[99])


def test_generate_stops_at_any_of_a_list_of_end_tokens():
    """Models whose config lists several end-of-sequence ids (a list) stop at any of them."""
    km = _km("tiny-llama-gqa")
    win = Window(km, patch="origin", rank=2)
    win.append(TEXTS[0])
    first = win.generate_ids(QUERY, 1)[0]
    saved = km.model.config.eos_token_id
    km.model.config.eos_token_id = [km.model.config.vocab_size + 5, first]
    try:
        before = win.stats().forward_tokens["decode"]
        assert win.generate(QUERY, max_new_tokens=6) == ""
        assert win.stats().forward_tokens["decode"] == before  # stopped after the query's forward
    finally:
        km.model.config.eos_token_id = saved


