"""`agentwin bench window` on a tiny model: exact patches reproduce the re-prefill after every
operation and blind reuse does not; the recorded work is what a hook on the model sees; the page is
the JSON's figures (the full run is `agentwin bench window` on SmolLM2)."""

import json

import pytest

from tools.bench import window_ops
from tools.bench.datasets import Case
from agentwin.models.adapter import KameraModel
from tools.cli import main

# Short texts: the tiny model reads bytes, so a generated case would be thousands of tokens.
CASE = Case(seed=0, a="Anja Roth is the harbour master of Velmora and keeps the tide log in a cabinet.",
            b="She wrote the surge.", queries=("Who?", "Where?"), extra_chunks=("Tobias fixed it.", "The ferry waited."))


@pytest.fixture(scope="module")
def km():
    return KameraModel.from_pretrained("tiny-llama-gqa")


@pytest.mark.parametrize("scenario", window_ops.SCENARIOS)
def test_exact_is_exact_and_blind_is_not(km, scenario):
    exact = window_ops.scenario(km, CASE, scenario, "origin", None)
    blind = window_ops.scenario(km, CASE, scenario, "none", 16)
    assert exact["kl"] <= 1e-8
    assert blind["kl"] > 100 * max(exact["kl"], 1e-12)
    assert blind["total"]["conditioned_passes"] == 0 and "conditioned" not in blind["total"]["forwarded_tokens"]
    # Blind reuse encodes each chunk alone (a forward); only a moved or recalled chunk is relocated.
    assert (blind["total"]["relocated_tokens"] > 0) == (scenario != "append")
    # Exact patches pay for every new antecedent with a conditioned pass, counted by kind.
    new_antecedent = scenario in ("evict", "reorder", "slide")
    assert (exact["after_build"]["forwarded_tokens"].get("conditioned", 0) > 0) == new_antecedent


class TokenHook:
    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.tokens += (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape[-1]


@pytest.mark.parametrize("policy, rank", [("none", 16), ("origin", 16), ("orbit", 16), ("origin", None)])
@pytest.mark.parametrize("scenario", ["reorder", "slide"])
def test_forwarded_tokens_are_what_a_hook_on_the_model_sees(km, scenario, policy, rank):
    hook = TokenHook(km.model)
    try:
        res = window_ops.scenario(km, CASE, scenario, policy, rank)
    finally:
        hook.handle.remove()
    window = sum(res["total"]["forwarded_tokens"].values())
    assert window + res["reference_tokens"] == hook.tokens
    assert res["total"]["forwarded_tokens"]["query"] == sum(len(km.tokenize(q)) for q in CASE.queries)
    assert sum(res["build"]["forwarded_tokens"].values()) + sum(res["after_build"]["forwarded_tokens"].values()) == window
    assert ("orbit" in res["build"]["forwarded_tokens"]) == (policy == "orbit")


def test_the_page_is_written_from_the_json(tmp_path):
    out = tmp_path / "window.json"
    assert main(["bench", "window", "--model", "tiny-llama-gqa", "--quick", "--seeds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    page = (tmp_path / "WINDOW.md").read_text()
    assert page == window_ops.render(data)
    assert data["command"] == f"agentwin bench window --seeds 1 --model tiny-llama-gqa --quick --json {out}"
    assert f"Written by `{data['command']}`" in page
    labels = [label for label, _, _ in window_ops.policies(16)]
    for sc in window_ops.SCENARIOS:
        rows = {r["policy"]: r for r in data["rows"] if r["scenario"] == sc}
        # One seed: the table's KL is the row's mean over its questions, printed as recorded.
        cells = " | ".join(f"{data['table'][sc][label]:.2e}" for label in labels)
        assert f"| {window_ops.SCENARIO_LABELS[sc]} | {cells} |" in page
        for label in labels:
            assert data["table"][sc][label] == pytest.approx(sum(rows[label]["kl_per_question"]) / 2)
            w = data["work"][sc][label]
            assert w["forwarded_tokens_all"] == sum(rows[label]["total"]["forwarded_tokens"].values())
            assert f"| {sc} | {label} |" in page and f" | {w['forwarded_tokens_all']:.0f} | " in page
    for word in ("avoided", "saved", "no prefill"):
        assert word not in page
