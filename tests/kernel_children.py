"""Kernel tests that run their cases in a child process (the Triton interpreter must be chosen
before Triton is first imported, so each test file re-runs itself as a script in a fresh process
with or without TRITON_INTERPRET=1 and reports one JSON line per case)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cases(script: str | Path, mode: str, interpret: bool) -> dict[str, dict]:
    """Run `python script mode` (with TRITON_INTERPRET=1 when `interpret`) and collect its JSON
    lines by their "id"; a crash is reported under "__crash__" with the tail of its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(Path(script).resolve()), mode], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record.pop("id")] = record
    if proc.returncode != 0:
        results["__crash__"] = {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    return results


def check_case(results: dict[str, dict], case_id: str, tolerance: float) -> None:
    """Fail unless the child reported `case_id` with the reference's shape and dtype and a max
    difference within `tolerance` (absolute)."""
    assert "__crash__" not in results, results["__crash__"]["error"]
    assert case_id in results, f"{case_id} not reported by the interpreter run"
    result = results[case_id]
    assert "error" not in result, result["error"]
    assert result["same_shape_dtype"], "kernel output shape or dtype differs from the reference"
    assert result["max_diff"] <= tolerance, result
