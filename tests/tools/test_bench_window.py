"""The window benchmark's scenarios on a tiny model: exact patches reproduce the re-prefill after
every operation, blind reuse does not (the full run is `agentwin bench window` on SmolLM2)."""

import pytest

from agentwin.models.adapter import KameraModel
from tools import bench_window as bw
from tools.patch_texts import Case

# Short texts: the tiny model reads bytes, so a generated case would be thousands of tokens.
CASE = Case(seed=0, a="Anja Roth is the harbour master of Velmora and keeps the tide log in a cabinet.", b="She wrote the surge.", queries=("Who?", "Where?"),
            extra_chunks=("Tobias fixed it.", "The ferry waited."))


@pytest.mark.parametrize("scenario", bw.SCENARIOS)
def test_exact_is_exact_and_blind_is_not(scenario):
    km = KameraModel.from_pretrained("tiny-llama-gqa")
    exact, _ = bw._scenario(km, CASE, scenario, "origin", None)
    blind, stats = bw._scenario(km, CASE, scenario, "none", 16)
    assert exact <= 1e-8
    assert blind > 100 * max(exact, 1e-12)
    assert stats["conditioned_passes"] == 0
    # Blind appends encode every chunk (a forward): nothing is avoided until chunks are moved or
    # recalled without one.
    assert (stats["prefill_tokens_avoided"] > 0) == (scenario != "append")
