"""The step table the agent commands print: every action, label and error shown whole."""

import json
import re

from agents.console import steps_table
from agents.records import StepRecord

LONG_URL = "http://127.0.0.1:41234/reports/2024/harbour-master/annual-tide-log-summary.html?page=3&lang=en"


def _records() -> list[StepRecord]:
    goto = {"action": "goto", "url": LONG_URL}
    typed = {"action": "type", "element": 12, "text": "who keeps the lighthouse on the north pier", "submit": True}
    error = (f"could not load {LONG_URL}: the server answered HTTP 404 (Not Found); the page stayed at "
             "http://127.0.0.1:41234/index.html")
    return [StepRecord(step=0, observation="http://127.0.0.1:41234/index.html", event="append", window_tokens=312),
            StepRecord(step=1, action=goto, error=error, error_kind="refused", window_tokens=312),
            StepRecord(step=2, action=typed, observation=LONG_URL, event="append", window_tokens=790,
                       evicted=["step 0 (http://127.0.0.1:41234/index.html)"], evicted_chunks=1),
            StepRecord(step=3, action={"action": "answer", "text": "Tobias"}, event="answer", window_tokens=790)]


def _columns(table: str) -> dict[int, dict[str, str]]:
    """Each step's action and observation cells, their lines joined back (the padding dropped)."""
    lines = table.splitlines()
    header = lines[0]
    spans = {name: (header.index(name), header.index(nxt)) for name, nxt in
             (("action", "observation"), ("observation", "window"))}
    cells: dict[int, dict[str, str]] = {}
    step = None
    for line in lines[1:]:
        if line[:6].strip():
            step = int(line[:6])
            cells[step] = {"action": "", "observation": ""}
        for name, (start, end) in spans.items():
            cells[step][name] += line[start:end].rstrip()
    return cells


def test_the_step_table_shows_every_action_and_url_whole():
    records = _records()
    table = steps_table(records)
    cells = _columns(table)
    assert cells[0]["action"] == "(start)" and cells[0]["observation"] == "http://127.0.0.1:41234/index.html"
    assert cells[1]["action"] == json.dumps(records[1].action) and cells[1]["observation"] == ""
    assert cells[2]["action"] == json.dumps(records[2].action) and cells[2]["observation"] == LONG_URL
    assert cells[3]["action"] == json.dumps(records[3].action)
    assert "..." not in table and "…" not in table


def test_a_failed_step_shows_its_whole_error():
    records = _records()
    table = steps_table(records)
    assert f"error: {records[1].error}" in table
    (row,) = [line for line in table.splitlines() if re.match(r"\s+1\s", line)]
    assert row.endswith(f"error: {records[1].error}")  # on the step's first line, after the window's figures
    assert "evicted 1 chunks of step 0" in table


def test_columns_stay_aligned_when_cells_continue():
    table = steps_table(_records())
    header, *rows = table.splitlines()
    window_at = header.index("window")
    for line in rows:
        assert len(line) <= window_at or line[window_at - 1] == " "  # nothing runs into the next column
