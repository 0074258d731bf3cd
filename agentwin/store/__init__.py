"""agentwin.store: content-addressed canonical KV, patches and encoder outputs (layer 2).

Tiers (accelerator, host RAM, disk as safetensors + JSON sidecars) with byte budgets, LRU,
pinning, checksums, model/tenant isolation and multi-process sharing of one root. See README.md.
Imports only torch, safetensors, the standard library and kamera_core.
"""

from agentwin.store.encoder import EncoderCache
from agentwin.store.keys import ChunkKey, Digest, patch_key
from agentwin.store.serial import kv_to_tensors, patch_to_tensors, tensors_to_kv, tensors_to_patch
from agentwin.store.store import ChunkStore, StoreStats

__all__ = [
    "ChunkKey",
    "ChunkStore",
    "Digest",
    "EncoderCache",
    "StoreStats",
    "kv_to_tensors",
    "patch_key",
    "patch_to_tensors",
    "tensors_to_kv",
    "tensors_to_patch",
]
