"""Shared helpers for the store tests: deterministic values per key, bitwise comparison, and
running a store script in a child process (sys.executable with the repo on PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from agentwin.store import ChunkKey

REPO = Path(__file__).resolve().parents[3]
FP = "fp-test"


def key(i: int, fp: str = FP, tenant: str = "") -> ChunkKey:
    return ChunkKey.of(fp, "text", [i], tenant=tenant)


def value(i: int, numel: int, version: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic tensors for entry i (what the child writers write, so tests can recompute)."""
    g = torch.Generator().manual_seed(i * 1000 + version)
    return {"x": torch.randn(numel, generator=g), "i": torch.tensor([i, version], dtype=torch.int64)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two named-tensor dicts (NaN == NaN; dtype and shape must match)."""
    if a.keys() != b.keys():
        return False
    for n in a:
        x, y = a[n].cpu(), b[n].cpu()
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() and not torch.equal(x.contiguous().reshape(-1).view(torch.uint8),
                                         y.contiguous().reshape(-1).view(torch.uint8)):
            return False
    return True


# A child process writing entries `start..start+count-1` of `numel` float32 each, printing each
# index after its put returned (= committed). With argv[6] = "replace:N" it SIGKILLs itself just
# before its N-th os.replace; with "unlink-json:N", just after its N-th unlink of a sidecar (an
# eviction, before the data file goes).
WRITER = """
import os, pathlib, signal, sys
from agentwin.store import ChunkStore
from tests.agentwin.store._support import FP, key, value
root, start, count, numel, disk = sys.argv[1], *map(int, sys.argv[2:6])
if len(sys.argv) > 6:
    what, n = sys.argv[6].split(":")
    calls = [0]
    def crash_when(counted, before):
        def wrapper(*a, **k):
            counted_now = counted(*a)
            calls[0] += counted_now
            if before and calls[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)
            out = orig[what](*a, **k)
            if not before and counted_now and calls[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return wrapper
    orig = {"replace": os.replace, "unlink-json": pathlib.Path.unlink}
    if what == "replace":
        os.replace = crash_when(lambda *a: 1, before=True)
    else:
        pathlib.Path.unlink = crash_when(lambda p, *a: int(p.name.endswith(".json")), before=False)
s = ChunkStore(root, ram_bytes=8 << 20, disk_bytes=disk, model_fingerprint=FP)
for i in range(start, start + count):
    s.put(key(i), value(i, numel), {"i": i})
    print(i, flush=True)
"""


def child(code: str, *args: object, wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", code, *map(str, args)]
    if wait:
        return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
