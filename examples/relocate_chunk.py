"""Encode a chunk once at start 0, then place it anywhere by RoPE re-rotation.

Runs in seconds on a CPU with a seeded tiny Qwen2.5-VL-shaped model (random weights: this shows
the KV algebra, not answer quality). Usage: `.venv/bin/python examples/relocate_chunk.py`.
"""

import torch

from agentwin.models.kv import extract_kv, relocate_kv
from agentwin.models.zoo import build_tiny
from kamera_core import kv_layout, rope_specs

model = build_tiny("tiny-qwen2.5-vl")
specs, layout = rope_specs(model.config), kv_layout(model.config)
ids = torch.randint(3, 240, (1, 24))


def encode(start: int):
    # Text under M-RoPE: t, h and w positions are equal; moving the chunk shifts all three.
    positions = torch.arange(start, start + ids.shape[1]).expand(3, 1, -1)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, use_cache=True)
    return extract_kv(out.cache, layout)


local = encode(0)                          # canonical KV, chunk-local frame
for start in (1, 1000, 32768):
    moved = relocate_kv(local, specs, layout, start)   # no forward pass
    direct = encode(start)                             # what re-prefilling there would give
    err = max(float((m[0] - d[0]).abs().max()) for m, d in zip(moved, direct))
    scale = max(float(d[0].abs().max()) for d in direct)
    print(f"start {start:>6}: relocated keys vs re-prefill, max abs diff / max|k| = {err / scale:.1e}")
print("(at large starts most of that difference is the model's own float32 angle error; "
      "see tests/kamera_core/test_relocate_oracle.py for the float64 comparison)")
