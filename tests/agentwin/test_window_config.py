"""`WindowConfig`: a window's settings in one checked value, the same as the keywords."""

from __future__ import annotations

import pytest
import torch

from agentwin import KameraModel, Text, Window, WindowConfig
from agentwin.patches.policies import Refresh


@pytest.fixture(scope="module")
def km() -> KameraModel:
    torch.manual_seed(0)
    return KameraModel.from_pretrained("tiny-llama-gqa")


def test_a_config_and_the_same_keywords_build_the_same_window(km):
    texts = ["the harbour master keeps the tide log", " the keeper climbed the tower at dawn", " a third line"]
    config = WindowConfig(budget_tokens=80, evict="lru")
    by_config, by_keywords = Window(km, config), Window(km, budget_tokens=80, evict="lru")
    for win in (by_config, by_keywords):
        for t in texts:
            win.append(Text(t))
    assert by_config.config == by_keywords.config == config
    assert by_config.budget_tokens == 80 and by_config.eviction == "lru"
    assert len(by_config.chunks()) == len(by_keywords.chunks()) < len(texts)  # both slid the same way
    assert torch.equal(by_config.next_token_logprobs(" who?"), by_keywords.next_token_logprobs(" who?"))


def test_a_policy_object_is_a_setting():
    policy = Refresh(near_tokens=64, max_age=2)
    config = WindowConfig(patch=policy)
    assert config.policy() is policy and config.policy_name == "refresh"


@pytest.mark.parametrize("settings, error, says", [
    ({"budget_tokens": 0}, ValueError, "budget_tokens"),
    ({"budget_tokens": True}, ValueError, "budget_tokens"),
    ({"patch": "nope"}, ValueError, "patch must be one of"),
    ({"evict": "random"}, ValueError, "evict must be one of"),
    ({"rank": 4}, ValueError, "patch policy"),  # patch settings without a patch policy
    ({"patch_bytes": 0.1, "patch": "survive"}, ValueError, "patch policy"),
])
def test_bad_settings_are_refused_naming_what_to_pass(settings, error, says):
    with pytest.raises(error, match=says):
        WindowConfig(**settings)


def test_the_window_refuses_settings_twice_or_unknown(km):
    with pytest.raises(TypeError, match="not both"):
        Window(km, WindowConfig(), budget_tokens=10)
    with pytest.raises(TypeError, match="unknown window setting"):
        Window(km, budget=10)
    with pytest.raises(TypeError, match="config must be"):
        Window(km, 10)


def test_the_inspection_surface_shows_what_the_window_holds(km):
    """`inspect`, `canonical_kv`, `query_ids`, `positions`: what benchmarks read, public and read-only."""
    win = Window(km, budget_tokens=4096, patch="origin", rank=4, guard=False)
    a, b = win.append(Text("the harbour master keeps the tide log")), win.append(Text(" the keeper climbed the tower"))
    win.next_token_logprobs(" who?")
    view = win.inspect(b)
    assert view.in_window and view.tokens == win.chunk_tokens(b) and view.start == win.positions([a])
    assert view.kv is not None and len(view.kv) == len(km.specs) and view.kv[0][0].shape[0] == view.tokens
    assert len(view.patches) == 1 and view.canonical is not None  # fitted after (a) at append
    with pytest.raises(TypeError):
        view.patches[()] = None  # read-only
    encodes = win.stats().forwards["encode"]
    assert win.canonical_kv(b) is view.canonical and win.stats().forwards["encode"] == encodes  # held: no forward
    assert win.positions() == win.positions([a, b]) == win.tokens()  # text: one position per token
    assert torch.equal(win.query_ids(" who?"), km.tokenize(" who?"))
    win.evict(a)
    gone = win.inspect(a)
    assert not gone.in_window and gone.kv is None and gone.canonical is None and not gone.patches
    with pytest.raises(ValueError, match="not in the window"):
        win.canonical_kv(a)
    with pytest.raises(ValueError, match="unknown chunk"):
        win.inspect(999)
