"""Image and frame chunks in the Window on tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL models.

The oracle is the transformers model's own forward of `Window.reference_inputs(query)`: token ids,
pixels and grids, with the M-RoPE positions computed by the model itself. Random weights carry no
meaning, so only exactness, bookkeeping and encoder reuse are checked here."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from agentwin import Frames, Image, KameraModel, Text, Window
from agentwin.models.vision import VisionInputError
from tests.support import assert_close, forward_growth, window_step

QUERY = " what changed?"
TEXTS = ["look at the screen:", " then the next page", " a caption under it", " the menu opened"]


@functools.lru_cache(maxsize=None)
def _km(name: str) -> KameraModel:
    return KameraModel.from_pretrained(name)


def _image(seed: int, size: tuple[int, int] = (90, 120)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)


def _frames(seed: int, n: int = 5) -> list[np.ndarray]:
    return [_image(100 * seed + i, (60, 80)) for i in range(n)]


def _oracle(km: KameraModel, win: Window, query: str) -> torch.Tensor:
    """A plain transformers forward of what the window says a re-prefill reads."""
    with torch.no_grad():
        logits = km.model(**win.reference_inputs(query)).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)


def _exact(win: Window, km: KameraModel) -> None:
    """The window's read equals the oracle to float32 rounding through the language model's
    forward: eps · max|log p| · √(hidden_size · num_layers) (`tests.support.forward_growth`)."""
    assert_close(win.next_token_logprobs(QUERY), _oracle(km, win, QUERY), what="next-token log-probabilities",
                 growth=forward_growth(km.model.config))


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_images_and_frames_exact_after_evict_and_recall(name):
    km = _km(name)
    win = Window(km, budget_tokens=4096, patch="origin", rank=None)
    win.append(Text(TEXTS[0]))
    image = win.append(Image(_image(1), max_tokens=16))
    win.append(Text(TEXTS[1]))
    clip = win.append(Frames(_frames(2), fps=2.0, min_tokens=4, max_tokens=8))
    win.append(Text(TEXTS[2]))
    _exact(win, km)
    assert win.stats().encoder_calls == 2  # the tower ran once per image / clip
    win.evict(image)
    _exact(win, km)
    win.evict(clip)
    win.recall(image)
    win.recall(clip)
    _exact(win, km)
    assert win.stats().encoder_calls == 2  # recalls and conditioned passes reused the tower's outputs
    assert win.stats().encoder_hits >= 1
    win.check_integrity()


def test_image_chunk_spans_position_units_not_tokens():
    """An image block of grid (1, h, w) takes h*w/4 + 2 tokens but advances the next chunk by
    max(h, w)/2 + 2 positions; the query after it must start there (checked by exactness)."""
    km = _km("tiny-qwen2.5-vl")
    chunk = km.image(_image(3, (112, 224)), max_tokens=64)
    t, h, w = chunk.grid_thw[0].tolist()
    assert chunk.ids.numel() == t * h * w // 4 + 2
    assert chunk.span == max(h, w) // 2 + 2 < chunk.ids.numel()
    win = Window(km, budget_tokens=4096, patch="none")
    win.append(Image(_image(3, (112, 224)), max_tokens=64))
    _exact(win, km)  # a window holding just the image: no patch involved


images = st.integers(0, 3)
ops = st.lists(st.tuples(st.sampled_from(["text", "image", "frames", "evict", "recall", "reorder"]), st.integers(0, 7)),
               min_size=1, max_size=8)


def _content(op: str, arg: int):
    if op == "text":
        return Text(TEXTS[arg % len(TEXTS)])
    if op == "image":
        return Image(_image(arg % 3), max_tokens=12)
    return Frames(_frames(arg % 2, n=4), fps=2.0, min_tokens=4, max_tokens=6)


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=ops)
def test_qwen_vl_exact_after_any_sequence(name, sequence):
    km = _km(name)
    win = Window(km, budget_tokens=4096, patch="origin", rank=None)
    evicted = []
    for op, arg in sequence:
        window_step(win, op, arg, evicted, lambda op, arg: win.append(_content(op, arg)))
        win.check_integrity()
        _exact(win, km)


def test_same_image_again_is_a_store_hit_without_the_vision_tower():
    km = _km("tiny-qwen3-vl")
    win = Window(km, budget_tokens=4096, patch="none")
    win.append(Image(_image(5), max_tokens=16))
    win.append(Text(TEXTS[0]))
    win.materialize()
    calls = win.stats().encoder_calls
    win.append(Image(_image(5), max_tokens=16))
    win.materialize()
    stats = win.stats()
    assert stats.canonical_hits == 1 and stats.encoder_calls == calls == 1
    other = Window(km, budget_tokens=4096, patch="none", store=win.store)  # another window, same store
    other.append(Image(_image(5), max_tokens=16))
    other.materialize()
    assert other.stats().canonical_hits == 1 and other.stats().encoder_calls == 0
    _exact(other, km)


def test_text_only_model_refuses_images_and_keeps_its_state():
    km = _km("tiny-llama-gqa")
    win = Window(km, budget_tokens=4096, patch="none")
    win.append(Text(TEXTS[0]))
    with pytest.raises(ValueError, match="text-only model"):
        win.append(Image(_image(0)))
    assert len(win.chunks()) == 1


def test_bad_images_are_refused_clearly_and_nothing_is_lost(tmp_path):
    from PIL import Image as PILImage

    km = _km("tiny-qwen2-vl")
    win = Window(km, budget_tokens=4096, patch="none")
    win.append(Text(TEXTS[0]))
    before = (win.chunks(), win.store.stats().ram_bytes)
    huge = tmp_path / "huge.png"
    PILImage.new("1", (20000, 20000)).save(huge)  # 400 Mpx, a small file
    with pytest.raises(VisionInputError, match="too large to decode safely"):
        win.append(Image(str(huge)))
    truncated = io.BytesIO()
    PILImage.fromarray(_image(1)).save(truncated, format="PNG")
    with pytest.raises(VisionInputError, match="not a readable image|truncated"):
        win.append(Image(truncated.getvalue()[:200]))
    with pytest.raises(VisionInputError, match="does not exist"):
        win.append(Image(str(tmp_path / "missing.png")))
    with pytest.raises(VisionInputError, match="uint8"):
        win.append(Image(np.zeros((4, 4), dtype=np.float32)))
    with pytest.raises(VisionInputError, match="timestamps"):
        win.append(Frames(_frames(1, 3), timestamps=[0.0, 1.0]))
    with pytest.raises(ValueError, match="min_tokens"):
        Image(_image(0), min_tokens=10, max_tokens=2)
    assert (win.chunks(), win.store.stats().ram_bytes) == before
    win.check_integrity()


def test_evicted_frames_leave_their_pixels_in_the_store_and_come_back_exact():
    """A long-video loop: evicted frame chunks keep no pixels in the window (they are in the
    store, under its budget); a recall reads them back and the window is exact again."""
    km = _km("tiny-qwen2.5-vl")
    win = Window(km, budget_tokens=45, patch="origin", rank=None)  # three 14-token frame chunks
    ids = [win.append(Frames(_frames(seed, n=4), fps=2.0, min_tokens=4, max_tokens=6)) for seed in range(8)]
    evicted = [c for c in ids if c not in win.chunks()]
    assert len(evicted) >= 4
    assert all(win._chunks[c].inputs.pixels.numel() == 0 for c in evicted)
    assert all(win._chunks[c].inputs.pixels.numel() > 0 for c in win.chunks())
    win.recall(evicted[0], at=0)
    assert win._chunks[evicted[0]].inputs.pixels.numel() > 0
    _exact(win, km)
    # The store's budget dropped another chunk's pixels meanwhile: its recall is refused, nothing changes.
    lost = evicted[1]
    assert win.store.delete(win._chunks[lost].pixels_key)
    state = (win.chunks(), win.tokens())
    with pytest.raises(ValueError, match="pixels were dropped"):
        win.recall(lost)
    assert (win.chunks(), win.tokens()) == state
