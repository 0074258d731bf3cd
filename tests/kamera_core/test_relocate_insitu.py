"""In situ: for [A, B, query], B's KV conditioned on A but computed at another start, relocated to
where it sits and handed to the model as its cache, gives the full forward's next-token logits."""

from __future__ import annotations

import pytest
import torch
from agentwin.models.kv import build_cache, relocate_kv
from kamera_core import kv_layout, rope_specs
from tests.support import (
    TEXT_MODELS,
    VL_MODELS,
    Chunk,
    concat,
    float64_rope,
    forward,
    image_chunk,
    layer_kv,
    make_chunk,
    text_chunk,
    tiny,
)

LOGIT_TOL = 1e-4
OTHER_START = 4321  # where the conditioned pass ran; B is moved back from there


def _split(chunk: Chunk, lo: int, hi: int) -> Chunk:
    """Tokens [lo, hi) of a sequence, keeping the full sequence's positions."""
    return Chunk(chunk.input_ids[lo:hi], chunk.positions[..., lo:hi], {})


def _relocated_cache(model, kv_ab, delta: int, config):
    """A transformers cache holding [A, B] KV moved by `delta` (keys/k_rope rotated only)."""
    layout = kv_layout(config)
    return build_cache(relocate_kv(kv_ab, rope_specs(config), layout, delta), config, layout)


def check_insitu(model, a: Chunk, b: Chunk, query_ids: torch.Tensor) -> float:
    query = make_chunk(model, query_ids)
    full = concat(model, a, b, query)
    n_ab = len(a) + len(b)
    reference = forward(model, full, 0).logits[0, -1]
    # The conditioned pass of [A, B] at another start: B's KV carries A's information. Its angles
    # are formed in float64: the model's own float32 angles at start 4321 are off by ~3e-4 rad,
    # which alone moves SmolLM2's logits by ~1e-4 (measured) before any relocation happens.
    ab = concat(model, a, b)
    with float64_rope(model):
        kv_ab = layer_kv(forward(model, ab, OTHER_START).cache, model)
    cache = _relocated_cache(model, kv_ab, -OTHER_START, model.config)
    q = _split(full, n_ab, len(full))
    q_positions = q.positions[None] if q.positions.dim() == 1 else q.positions[:, None]
    logits = forward(model, q, 0, cache=cache, positions=q_positions).logits[0, -1]
    err = float((logits - reference).abs().max())
    assert err <= LOGIT_TOL, f"next-token logits differ by {err:.3e} > {LOGIT_TOL}"
    # B's conditioned KV must differ from B alone, or this test would not exercise conditioning.
    # Compare the position-free tensor: values (MHA/GQA) or the latent c_KV (MLA).
    which = 0 if kv_layout(model.config).family == "mla" else 1
    alone = layer_kv(forward(model, b, 0).cache, model)[-1][which]
    conditioned = layer_kv(cache, model)[-1][which][len(a) : n_ab]
    assert float((conditioned - alone).abs().max()) > 1e-3
    return err


@pytest.mark.parametrize("name", TEXT_MODELS + VL_MODELS)
def test_insitu_next_token_logits_match_full_forward(name):
    model = tiny(name)
    a = make_chunk(model, text_chunk(11, seed=11))
    if name in VL_MODELS:
        ids, mm = image_chunk(model, seed=12)
        b = make_chunk(model, ids, mm)
    else:
        b = make_chunk(model, text_chunk(17, seed=12))
    check_insitu(model, a, b, text_chunk(5, seed=13))


@pytest.mark.slow
def test_smollm2_insitu_next_token_logits_match_full_forward(smollm2):
    model, tokenizer = smollm2
    ids = lambda text: torch.tensor(tokenizer(text).input_ids)  # noqa: E731
    a = make_chunk(model, ids("Mira Okafor runs the bakery on Quay Street. Her brother Tobias fixes bicycles."))
    b = make_chunk(model, ids(" She says he once rebuilt a tandem in a single afternoon, and he still rides it."))
    check_insitu(model, a, b, ids(" Who rebuilt the tandem? Answer:"))


def test_insitu_detects_a_wrong_shift():
    """The same cache moved one position too far no longer reproduces the full forward."""
    model = tiny("tiny-llama-gqa")
    a = make_chunk(model, text_chunk(11, seed=11))
    b = make_chunk(model, text_chunk(17, seed=12))
    full = concat(model, a, b, make_chunk(model, text_chunk(5, seed=13)))
    reference = forward(model, full, 0).logits[0, -1]
    with float64_rope(model):
        kv_ab = layer_kv(forward(model, concat(model, a, b), OTHER_START).cache, model)
    cache = _relocated_cache(model, kv_ab, -OTHER_START + 1, model.config)
    q = _split(full, len(a) + len(b), len(full))
    logits = forward(model, q, 0, cache=cache, positions=q.positions[None]).logits[0, -1]
    assert float((logits - reference).abs().max()) > LOGIT_TOL  # the in-situ check would fail
