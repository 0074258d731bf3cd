"""The agent-trace benchmark: strategies on a tiny model against the model's own forward, token
counts against a forward hook on the model, the radix tree, the streaming sinks, the recording
window against `agentwin.Window`, traces' checks; then `agentwin bench trace --quick` on the real
SmolLM2 (slow)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tools.bench import trace as trace_mod
from tools.bench.prefix_cache import PrefixCache, RadixTree
from tools.bench.strategies import AgentwinStrategy, Reprefill, Streaming
from tools.bench.trace import Trace, parsed_action, replay, score, summarize
from tools.bench.trace_bench import STRATEGIES, factories, verdict
from tools.bench.traces import RecordingWindow
from agentwin.models.adapter import KameraModel

TEXTS = {0: "the harbour master keeps the tide log", 1: " she wrote the storm surge in it",
         2: " the keeper climbed the tower at dawn", 3: " he replaced the cracked diaphragm",
         4: " the ferry left two hours late"}
QUERY = " who climbed the tower? "


def _ops() -> list[dict]:
    return [{"op": "append", "chunk": 0}, {"op": "decide", "query": QUERY},
            {"op": "append", "chunk": 1}, {"op": "append", "chunk": 2}, {"op": "decide", "query": QUERY},
            {"op": "evict", "chunk": 0}, {"op": "append", "chunk": 3}, {"op": "decide", "query": QUERY + "now"},
            {"op": "evict", "chunk": 1}, {"op": "recall", "chunk": 0, "at": 2}, {"op": "decide", "query": QUERY},
            {"op": "append", "chunk": 4}, {"op": "recall", "chunk": 1, "at": 0}, {"op": "decide", "query": QUERY}]


@pytest.fixture(scope="module")
def km() -> KameraModel:
    torch.manual_seed(0)
    return KameraModel.from_pretrained("tiny-llama-gqa")


class _Counter:
    """Tokens passed through a model, counted by a forward pre-hook on it."""

    def __init__(self, *models) -> None:
        self.tokens = 0
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in models]

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += int(ids.numel())

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _counted(run, counter) -> None:
    assert sum(run.forward_tokens.values()) == counter.tokens, (run.strategy, run.forward_tokens, counter.tokens)


def test_strategies_against_the_reference_and_the_hook(km):
    trace = Trace("tiny", 4096, dict(TEXTS), _ops())
    make = factories(km, trace, prefix_capacity=4096, sinks=2)
    counter = _Counter(km.model)
    reference = replay(trace, make["reprefill"]())
    _counted(reference, counter)
    counter.close()
    results = {}
    for name in STRATEGIES:
        counter = _Counter(km.model)
        run = replay(trace, make[name]())
        counter.close()
        _counted(run, counter)
        results[name] = (run, summarize(score(trace, reference, run, km.tokenizer, 16)))
    assert results["reprefill"][1]["kl_mean"] == 0.0 and results["reprefill"][1]["greedy16"] == 1.0
    for exact in ("prefix", "agentwin-exact"):
        assert results[exact][1]["max_abs_logprob"] <= 1e-4, exact
        assert results[exact][1]["greedy16"] == 1.0, exact
    # Blind re-rotation after evictions and recalls is not exact.
    assert results["streaming"][1]["max_abs_logprob"] > 1e-4
    tokens = {n: sum(r.forward_tokens.values()) for n, (r, _) in results.items()}
    assert tokens["prefix"] < tokens["reprefill"]
    # Every decision decodes the same number of tokens, so decode counts agree where greedy does.
    assert results["agentwin-exact"][0].forward_tokens["decode"] == reference.forward_tokens["decode"]
    assert results["agentwin-exact"][0].forward_tokens.get("conditioned", 0) > 0


def test_reprefill_is_the_model_forward(km):
    strategy = Reprefill(km)
    for cid in (0, 1):
        strategy.append(cid, TEXTS[cid])
    reading = strategy.decide(QUERY, 4)
    ids = torch.cat([km.tokenize(TEXTS[0]), km.tokenize(TEXTS[1]), km.tokenize(QUERY)])
    with torch.no_grad():
        own = torch.log_softmax(km.model(input_ids=ids[None]).logits[0, -1].float(), -1)
    assert float((reading.logprobs - own).abs().max()) <= 1e-5
    assert reading.tokens[0] == int(own.argmax()) and len(reading.tokens) <= 4


def test_prefix_cache_reuses_only_the_common_prefix(km):
    strategy = PrefixCache(km, capacity_tokens=4096)
    for cid in (0, 1):
        strategy.append(cid, TEXTS[cid])
    window = int(strategy.window_ids().numel())
    q = int(km.tokenize(QUERY).numel())
    strategy.decide(QUERY, 1)
    assert strategy.forward_tokens["prefill"] == window + q
    strategy.decide(QUERY, 1)  # the same sequence: only its last token is computed again
    assert strategy.forward_tokens["prefill"] == window + q + 1
    strategy.evict(0)  # the front changed: nothing in common
    strategy.decide(QUERY, 1)
    assert strategy.forward_tokens["prefill"] == window + q + 1 + int(km.tokenize(TEXTS[1]).numel()) + q


def test_radix_tree_splits_matches_and_drops_least_recent_leaves():
    tree = RadixTree(capacity_tokens=8)
    kv = lambda n: [(torch.arange(n, dtype=torch.float32)[:, None, None], torch.zeros(n, 1, 1))]  # noqa: E731
    a = torch.tensor([1, 2, 3, 4, 5])
    tree.insert(a, tree.match(a), kv(5))
    b = torch.tensor([1, 2, 3, 9])
    path = tree.match(b)
    assert sum(n for _, n in path) == 3
    tree.insert(b, path, kv(1))
    assert tree.tokens == 6
    assert [n for _, n in tree.match(torch.tensor([1, 2, 3, 4, 5, 6]))] == [3, 2]
    c = torch.tensor([7, 7, 7, 7])
    tree.insert(c, tree.match(c), kv(4))  # 10 > 8: least recently used leaves go, [9] then [4, 5]
    assert tree.tokens == 7
    assert sum(n for _, n in tree.match(a)) == 3 and sum(n for _, n in tree.match(c)) == 4


def test_streaming_keeps_sinks_and_encodes_a_recalled_chunk_once(km):
    strategy = Streaming(km, sinks=3)
    for cid in (0, 1, 2):
        strategy.append(cid, TEXTS[cid])
    strategy.evict(0)
    assert strategy.blocks[0].cid is None and strategy.blocks[0].kv[0][0].shape[0] == 3
    assert [b.start for b in strategy.blocks[1:]] == [3, 3 + int(strategy.ids[1].numel())]
    strategy.evict(1)
    strategy.recall(1, 1)
    strategy.evict(1)
    strategy.recall(1, 0)
    assert strategy.forward_tokens["encode"] == int(strategy.ids[1].numel())
    strategy.evict(2)
    strategy.recall(0, 0)  # the sinks' own chunk back at the front: the sinks go
    assert all(b.cid is not None for b in strategy.blocks) and strategy.blocks[0].start == 0


def test_recording_window_evicts_as_the_window_does(km):
    from agentwin.window import Text, Window

    budget = 3 * int(km.tokenize(TEXTS[2]).numel())
    rec, win = RecordingWindow(km, budget), Window(km, budget_tokens=budget, patch="none")
    ids = {}
    for cid in range(5):
        ids[rec.append(Text(TEXTS[cid]))] = win.append(Text(TEXTS[cid]))
        assert [ids[c] for c in rec.chunks()] == win.chunks()
    for cid in (0, 1):
        if cid not in rec.chunks():
            rec.recall(cid, at=len(rec.chunks()))
            win.recall(ids[cid], at=len(win.chunks()))
            assert [ids[c] for c in rec.chunks()] == win.chunks()
    trace = Trace("rec", budget, rec.texts, rec.ops)
    assert trace.revisits and trace.decisions == 0


def test_trace_checks_and_round_trip():
    trace = Trace("t", 100, dict(TEXTS), _ops(), {"agent": "none"})
    assert Trace.from_json(json.loads(json.dumps(trace.to_json()))).ops == trace.ops
    with pytest.raises(ValueError, match="not in the window"):
        Trace("t", 100, dict(TEXTS), [{"op": "evict", "chunk": 0}])
    with pytest.raises(ValueError, match="not evicted"):
        Trace("t", 100, dict(TEXTS), [{"op": "append", "chunk": 0}, {"op": "recall", "chunk": 0, "at": 0}])
    with pytest.raises(ValueError, match="query"):
        Trace("t", 100, dict(TEXTS), [{"op": "decide"}])
    assert not Trace("t", 100, dict(TEXTS), [{"op": "append", "chunk": 0}]).revisits


def test_parsed_action_and_verdict():
    class Chars:
        @staticmethod
        def decode(ids):
            return "".join(map(chr, ids))

    prime = '{"action": "'
    assert parsed_action(Chars, prime, list(map(ord, 'next"}')), ["next"]) == {"action": "next"}
    assert parsed_action(Chars, prime, list(map(ord, 'goto", "page": 3')), ["goto"]) == {"action": "goto", "page": 3}
    assert parsed_action(Chars, prime, list(map(ord, 'fly"}')), ["next"]) == "malformed"
    row = lambda tokens, g: {"forwarded_tokens": tokens, "greedy16": g}  # noqa: E731
    traces = {"a": {"revisits": True, "strategies": {"prefix": row(1000, 1), "agentwin-r16": row(300, 0.8)},
                    "noise_floor": {"greedy16": 0.9}},
              "b": {"revisits": False, "strategies": {"prefix": row(1000, 1), "agentwin-r16": row(900, 0.1)},
                    "noise_floor": {"greedy16": 0.9}}}
    v = verdict(traces)
    assert v["met"] and list(v["per_trace"]) == ["a"]
    traces["a"]["strategies"]["agentwin-r16"]["greedy16"] = 0.79
    assert not verdict(traces)["met"]


def test_agentwin_strategy_refuses_a_trace_its_budget_contradicts(km):
    strategy = AgentwinStrategy(km, "agentwin-r16", budget_tokens=int(km.tokenize(TEXTS[0]).numel()))
    strategy.append(0, TEXTS[0])
    with pytest.raises(RuntimeError, match="differs from the trace"):
        strategy.append(1, TEXTS[1])  # the window had to evict on its own


@pytest.mark.slow
def test_bench_trace_quick_on_smollm2(tmp_path, monkeypatch):
    from tools.cli import main

    checks: list[tuple[str, int, int]] = []
    plain_replay = trace_mod.replay

    def hooked(trace, strategy, greedy=16, forced=None):
        models = {id(m): m for m in (strategy.km.model, getattr(strategy, "model", strategy.km.model))}
        counter = _Counter(*models.values())
        try:
            run = plain_replay(trace, strategy, greedy, forced)
        finally:
            counter.close()
        checks.append((run.strategy, sum(run.forward_tokens.values()), counter.tokens))
        return run

    monkeypatch.setattr(trace_mod, "replay", hooked)
    out, page = tmp_path / "trace.json", tmp_path / "TRACE.md"
    # Four greedy tokens per decision, not sixteen, and both of the runner's cores: the same code
    # paths in less time.
    assert main(["bench", "trace", "--quick", "--threads", "2", "--greedy", "4", "--json", str(out), "--page",
                 str(page)]) == 0
    result = json.loads(out.read_text())
    assert set(result["traces"]) == {"doc", "web", "video"}
    for key in ("noise_floor_greedy16", "loadavg_start", "loadavg_end", "threads", "model", "settings", "target"):
        assert key in result, key
    assert len(result["loadavg_start"]) == 3 and 0.0 <= result["noise_floor_greedy16"] <= 1.0
    for name, entry in result["traces"].items():
        assert isinstance(entry["revisits"], bool) and entry["revisits"], name
        rows = entry["strategies"]
        assert list(rows) == list(STRATEGIES)
        for strategy, row in rows.items():
            for key in ("forwarded_tokens", "vision_tower_runs", "wall_s", "peak_rss_mb", "kl_mean", "top1",
                        "greedy16", "same_action"):
                assert key in row, (name, strategy, key)
            assert row["vision_tower_runs"] == 0 and row["forwarded_tokens"] > 0
        assert rows["reprefill"]["kl_mean"] == 0.0 and rows["reprefill"]["greedy16"] == 1.0
        assert rows["prefix"]["forwarded_tokens"] <= rows["reprefill"]["forwarded_tokens"]
        assert rows["agentwin-exact"]["max_abs_logprob"] <= 1e-4, rows["agentwin-exact"]
        assert rows["prefix"]["max_abs_logprob"] <= 1e-4, rows["prefix"]
        assert entry["noise_floor"]["kl_mean"] > 0.0  # bf16 is not float32
    # Every replay's counted tokens are the tokens the model's forward actually took.
    assert len(checks) == 3 * (len(STRATEGIES) + 1)
    for strategy, counted, hooked_tokens in checks:
        assert counted == hooked_tokens, (strategy, counted, hooked_tokens)
    text = page.read_text()
    first = text.splitlines()[2]
    assert re.search(r"Written by `agentwin bench trace --json \S+ --page \S+ --quick --threads 2 --greedy 4`",
                     first), first
    assert result["settings"]["greedy"] == 4 and result["threads"] == 2
    assert ("Target met" in text) != ("Target missed" in text)
