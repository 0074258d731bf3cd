"""`agentwin bench fidelity`'s library: the stale-patch counter of the window, ranks from byte
budgets against the bytes the window's patches take, stale cases found in a replay of a hand-built
trace, and the results' fields on a tiny model."""

from __future__ import annotations

import pytest
import torch

from tools.bench import fidelity as fid
from tools.bench.fidelity_page import render_page
from tools.bench.stale_guards import policy_named
from tools.bench.strategies import AgentwinStrategy
from agentwin.patches.policies import SIMILAR, OriginSimilar
from tools.bench.trace import Trace
from agentwin.models.adapter import KameraModel
from agentwin.window import Text, Window

TEXTS = {0: "the harbour master keeps the tide log and the storm book",
         1: " she wrote the storm surge in it, twice, at dawn and at dusk",
         2: " the keeper climbed the tower at dawn to replace the cracked lens"}
QUERY = " who climbed the tower? "


@pytest.fixture(scope="module")
def km() -> KameraModel:
    torch.manual_seed(0)
    return KameraModel.from_pretrained("tiny-llama-gqa")


def _window(km: KameraModel, patch: str, rank: int | None = 4, **window_args) -> tuple[Window, list]:
    win = Window(km, budget_tokens=4096, patch=policy_named(patch), rank=rank, **window_args)
    return win, [win.append(Text(TEXTS[c])) for c in (0, 1, 2)]


def _configured(km: KameraModel, patch: str, threshold: float) -> tuple[Window, list]:
    win = Window(km, budget_tokens=4096, patch=policy_named(patch, threshold), rank=4)
    return win, [win.append(Text(TEXTS[c])) for c in (0, 1, 2)]


def test_stale_patches_counts_origin_patches_after_another_antecedent(km):
    win, (a, _b, _c) = _window(km, "origin")
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 0  # every chunk where it was appended: exact in-context KV
    win.evict(a)  # b at the front (no patch), c after (b) where it was fitted after (a, b)
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 1
    win.next_token_logprobs(QUERY)  # counted at every read of the window
    assert win.stats().stale_patches == 2
    win.recall(a, at=0)  # back where it was: c and b at their origins again
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 2


@pytest.mark.parametrize("patch, rank", [("none", 4), ("origin", None), ("fresh", 4)])
def test_stale_patches_stay_zero_without_stale_patches(km, patch, rank):
    win, (a, _b, _c) = _window(km, patch, rank)
    win.evict(a)
    win.next_token_logprobs(QUERY)
    win.recall(a, at=2)
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 0


def test_origin_neighbour_serves_the_origin_patch_only_after_the_same_last_chunk(km):
    win, (a, b, _c) = _window(km, "origin-neighbour")
    win.evict(b)  # c after (a), fitted after (a, b): another last chunk, blind
    reads = [win.next_token_logprobs(QUERY)]
    assert win.stats().stale_patches == 0
    win.recall(b, at=0)  # [b, a, c]: c after (b, a), last chunk a again not b
    win.evict(a)  # [b, c]: c after (b): the same last chunk as at its origin, the origin patch
    reads.append(win.next_token_logprobs(QUERY))
    assert win.stats().stale_patches == 1
    blind, (_a2, b2, _c2) = _window(km, "none")
    blind.evict(b2)
    assert torch.allclose(reads[0], blind.next_token_logprobs(QUERY), atol=1e-5)  # blind there, as promised
    origin, (_a3, b3, _c3) = _window(km, "origin")
    origin.evict(b3)
    assert not torch.allclose(reads[0], origin.next_token_logprobs(QUERY), atol=1e-5)


def test_origin_present_serves_the_origin_patch_only_while_its_antecedent_is_present(km):
    win, (a, _b, _c) = _window(km, "origin-present")
    win.evict(a)  # c after (b), fitted after (a, b): a has left, blind
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 0
    win.recall(a, at=1)  # [b, a, c]: a and b before c again, in another order: the origin patch
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 1


def test_origin_either_drops_the_patch_only_when_both_tests_fail(km):
    win, (a, b, _c) = _window(km, "origin-either")
    win.evict(a)  # [b, c]: c after (b), fitted after (a, b): same last chunk, a gone: the patch
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 1
    win.recall(a, at=2)  # [b, c, a]: nothing changed before c
    win.evict(b)  # [c, a]: c first, no patch at the front
    win.recall(b, at=0)  # [b, c, a]: c after (b) again, already counted placements aside
    win.reorder([win.chunks()[i] for i in (0, 2, 1)])  # [b, a, c]: last chunk a, both present: the patch
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 2
    win.evict(b)  # [a, c]: last chunk a (not b), b gone: blind
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 2


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over layers of the cosine of two [layers, width] summaries (computed here, not by the window)."""
    return float(sum(torch.dot(x, y) / (x.norm() * y.norm()) for x, y in zip(a.double(), b.double())) / a.shape[0])


@pytest.mark.parametrize("threshold, served", [(-1.0, True), (1.0, False), (None, None)])
def test_origin_similar_serves_the_patch_behind_a_new_neighbour_by_key_summary_cosine(km, threshold, served):
    win, (a, b, c), summary, cosine = _new_neighbour_window(km, "origin-similar", threshold)
    if served is None:  # the default threshold: whichever side of it this pair falls
        served = cosine >= SIMILAR
    _check_new_neighbour(km, win, b, served)


def _new_neighbour_window(km, patch: str, threshold: float | None):
    """The window [a, b, c] under `patch` (at `threshold` where given), the key summaries of the
    three texts computed here, and the cosine of c's neighbour after b's eviction (a) with its
    neighbour at its origin (b)."""
    win, (a, b, c) = _window(km, patch) if threshold is None else _configured(km, patch, threshold)
    summary = {x: km.key_summary(km.tokenize(TEXTS[i])) for i, x in enumerate((a, b, c))}
    return win, (a, b, c), summary, _cosine(summary[a], summary[b])


def _check_new_neighbour(km, win, b, served: bool) -> None:
    """Evict b from [a, b, c] (c after a, fitted after (a, b): a new neighbour); c must read as
    with its origin patch where `served`, else as blind reuse: nothing else."""
    win.evict(b)
    read = win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == int(served)
    origin, (_a, b2, _c) = _window(km, "origin")
    origin.evict(b2)
    blind, (_a, b3, _c) = _window(km, "none")
    blind.evict(b3)
    assert torch.allclose(read, (origin if served else blind).next_token_logprobs(QUERY), atol=1e-5)


def test_origin_similar_keeps_the_origin_patch_where_origin_either_does(km):
    win, (a, _b, _c) = _window(km, "origin-similar")
    win._policy = OriginSimilar(1.0)  # no new neighbour is close enough
    win.evict(a)  # [b, c]: c behind b as at its origin
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 1
    win.recall(a, at=1)  # [b, a, c]: a new neighbour, but its whole origin antecedent is before it
    win.next_token_logprobs(QUERY)
    assert win.stats().stale_patches == 2


def test_origin_similar_rejects_a_threshold_that_is_not_a_cosine(km):
    for bad in (1.5, -2, "0.9", True):
        with pytest.raises(ValueError, match="threshold must be a cosine"):
            OriginSimilar(bad)
    with pytest.raises(ValueError, match="similar= is a threshold of patch='origin-similar'"):
        AgentwinStrategy(km, "x", "origin", similar=0.9)
    with pytest.raises(ValueError, match="after '@' must be a number"):
        fid.guard_strategy(km, "origin-similar@high", 4096)


def test_ranks_from_budgets_match_the_bytes_the_window_spends(km):
    shapes = fid.kv_shapes(km)
    win, (_a, b, _c) = _window(km, "origin", rank=3, guard=False, **fid.RANK_FIT)
    canonical = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in km.encode(km.tokenize(TEXTS[1])))
    patch = win._io.stored_patch(win._chunks[b], win._chunks[b].origin)
    assert patch.nbytes == pytest.approx(fid.patch_fraction(shapes, int(km.tokenize(TEXTS[1]).numel()), 3) * canonical)
    tokens = [int(km.tokenize(t).numel()) for t in TEXTS.values()]
    for fraction in (0.015, 0.06, 0.12):
        rank = fid.rank_for_budget(shapes, tokens, fraction)
        assert all(fid.patch_fraction(shapes, t, rank) <= fraction for t in tokens)
        assert any(fid.patch_fraction(shapes, t, rank + 1) > fraction for t in tokens)
    assert fid.rank_for_budget(shapes, tokens, 1e-6) == 0


def _stale_trace() -> Trace:
    d = {"op": "decide", "query": QUERY}
    ops = [{"op": "append", "chunk": c} for c in (0, 1, 2)] + [d, {"op": "evict", "chunk": 0}, d,
                                                              {"op": "recall", "chunk": 0, "at": 0}, d]
    return Trace("doc", 4096, dict(TEXTS), ops)


def test_stale_cases_of_a_replay(km):
    trace = _stale_trace()
    assert fid.patched_chunks(trace) == [1, 2]
    entry = fid.run_trace(km, None, trace, fid.kv_shapes(km), [0.06], ["origin"], ["origin-neighbour"], 4, floor=False)
    name = entry["default"]
    assert [c["decision"] for c in entry["stale"]] == [1]  # only after the eviction of chunk 0
    case = entry["stale"][0]
    assert case["kl"] == entry["per_decision"][name][1]["kl"]
    assert case["kl_blind"] == entry["per_decision"]["blind"][1]["kl"]
    assert case["kl"] != case["kl_blind"]
    # c after (b): b was its last chunk at its origin too, so the guard serves the same patch.
    assert case["kl_guards"]["origin-neighbour"] == pytest.approx(case["kl"], abs=1e-9)


def test_stale_summary_counts_cases_worse_than_blind():
    cases = [{"kl": 0.2, "kl_blind": 0.1, "kl_guards": {"g": 0.1}}, {"kl": 0.05, "kl_blind": 0.1, "kl_guards": {"g": 0.1}},
             {"kl": 0.1, "kl_blind": 0.1, "kl_guards": {"g": 0.3}}]
    s = fid.stale_summary(cases)
    assert (s["stale_cases"], s["worse_than_blind"]) == (3, 1)
    assert s["mean_ratio"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    assert fid.stale_summary(cases, "g")["worse_than_blind"] == 1
    assert fid.stale_summary([])["stale_cases"] == 0


def test_results_fields_and_page_on_a_tiny_model(km):
    traces = [_stale_trace(), fid.hard_case_trace("code", questions=1)]
    result = fid.run_fidelity(km, traces, greedy=4)
    for key in ("greedy16_at_6pct", "noise_floor_greedy16"):
        assert 0.0 <= result[key] <= 1.0
    for key in ("kl_at_6pct", "noise_floor_kl"):
        assert result[key] >= -1e-6
    assert result["stale_cases_by_trace"] == {"doc": 1, "hard-code": 3}  # hard-code: the three states after the first
    assert result["stale_cases"] == 4  # every trace's, agent and hard-case
    window = result["window_policy"]
    assert window == fid.window_policy() == "origin-akin@0.95"
    cases = [c for e in result["traces"].values() for c in e["stale"]]
    assert result["stale_worse_than_blind"] == sum(c["kl_guards"][window] > c["kl_blind"] for c in cases)
    assert result["stale_unguarded"]["worse_than_blind"] == sum(c["kl"] > c["kl_blind"] for c in cases)
    rows = result["traces"]["doc"]["per_decision"][f"{window}-b0.06"]
    assert result["kl_at_6pct"] == pytest.approx(sum(r["kl"] for r in rows) / len(rows))  # the default's, not origin's
    assert result["stale_guard"]["validation"] == ["doc", "hard-code"] and result["stale_guard"]["chosen"]
    # The fidelity target runs on the agent trace only, at the fixed target; its patches' bytes are
    # the window's own count, over the canonical KV of the chunks they were fitted for.
    target = result["max_kl"]
    assert target["target"] == fid.TARGET_KL and set(target["traces"]) == {"doc"}
    run = result["traces"]["doc"]["strategies"]["max_kl"]
    assert run["info"]["max_kl"] == fid.TARGET_KL and len(run["info"]["kl_bytes"]) > 0
    assert run["info"]["patch_bytes"] == sum(run["info"]["kl_bytes"]) and run["info"]["patched_kv_bytes"] > 0
    assert target["max_kl"]["share"] == run["info"]["patch_bytes"] / run["info"]["patched_kv_bytes"]
    assert target["max_kl"]["guard_tokens"] == run["forward_tokens"].get("guard", 0) > 0
    default = result["traces"]["doc"]["strategies"][f"{window}-b0.06"]["info"]
    assert 0 < target["default"]["share"] == default["patch_bytes"] / default["patched_kv_bytes"] <= 0.06
    assert target["max_kl"]["kl_mean"] == pytest.approx(run["kl_mean"])
    result.update({"command": "agentwin bench fidelity --quick", "model": "tiny", "threads": 1, "cpus": 2,
                   "loadavg_start": [0.0] * 3, "loadavg_end": [0.0] * 3, "wall_s_total": 1.0,
                   "settings": {"quick": True, "greedy": 4, "budgets": list(fid.BUDGETS),
                                "fits": list(fid.DEFAULT_FITS), "guards": list(fid.STALE_GUARDS),
                                "traces": [t.name for t in traces]}})
    page = render_page(result)
    assert page.splitlines()[2].startswith("Written by `agentwin bench fidelity --quick`")
    assert f"Stale cases on all traces (agent and hard-case): 4; the window further from the re-prefill than blind " \
           f"reuse in {result['stale_worse_than_blind']} of them" in page
    assert "The window's default policy in this run: `origin-akin` (`origin-akin@0.95`)" in page
    assert "## A fidelity target instead of a budget" in page and f"| pooled | `max_kl={fid.TARGET_KL:g}` |" in page
    # The hard-case traces run every by-bytes fit but the always-guarded one, at the headline budget.
    assert set(result["traces"]["hard-code"]["grid"]) == {"origin", "origin-residual-int8", "origin-alloc", "origin-output"}
    assert result["window_fit"] == "residual" and '`fit="residual"`' in page
    assert result["window_storage"] == "auto" and '`storage="auto"`' in page
    assert "bfloat16 path" not in page  # results written before the path was recorded
    from tools.bench.runs import bf16_path

    result["bf16_path"] = {**bf16_path(), "onednn_max_cpu_isa": "AVX2"}
    assert "here oneDNN on with instruction-set cap AVX2" in render_page(result) or not result["bf16_path"]["mkldnn"]
    result["traces"]["doc"]["chunk_tokens"] = []  # a short trace where no chunk takes a patch
    assert "| doc | no chunk takes a patch |" in render_page(result)


@pytest.mark.parametrize("threshold, own_is_one", [(1.0, False), (None, False), (1.0, True)])
def test_origin_akin_serves_the_patch_behind_a_neighbour_as_close_as_the_chunk_itself(km, threshold, own_is_one):
    win, (a, b, c), summary, cosine = _new_neighbour_window(km, "origin-akin", threshold)
    own = _cosine(summary[c], summary[b])  # c itself against its neighbour at its origin
    if own_is_one:  # c's own summary set to its old neighbour's: no new neighbour is as close
        win._chunks[c].summary = win._chunks[c].neighbour.clone()
        own = 1.0
    served = cosine >= (SIMILAR if threshold is None else threshold) or cosine >= own
    # here a is closer to b than c is (0.84 against 0.78 on this model): served by the akin test
    # alone at threshold 1.0, declined once c's own cosine is 1
    assert served == (not own_is_one)
    _check_new_neighbour(km, win, b, served)


def test_serves_akin_is_the_threshold_or_the_chunks_own_cosine():
    from agentwin.patches.policies import serves_akin

    assert serves_akin(0.95, 0.99, 0.95) and serves_akin(0.5, 0.4, 0.95) and serves_akin(0.4, 0.4, 0.95)
    assert not serves_akin(0.9, 0.98, 0.95) and not serves_akin(-0.2, 0.1, 0.95)
