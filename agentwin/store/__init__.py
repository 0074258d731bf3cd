"""agentwin.store (layer 2): content-addressed canonical KV, patches and encoder outputs in device, RAM, disk and
Redis tiers under byte budgets. `open_store(location)` opens one. Imports only torch, safetensors, the standard
library and kamera_core (and the redis client, when a RedisTier is created)."""

from agentwin.store.encoder import EncoderCache
from agentwin.store.keys import ChunkKey, Digest, patch_key
from agentwin.store.lease import Lease, Resolved
from agentwin.store.remote import RedisTier, RemoteStats, RemoteWarning
from agentwin.store.serial import kv_to_tensors, patch_to_tensors, tensors_to_kv, tensors_to_patch
from agentwin.store.open import open_store
from agentwin.store.stats import StoreStats
from agentwin.store.store import ChunkStore
from agentwin.store.tiers import CorruptEntryWarning

__all__ = [
    "ChunkKey",
    "ChunkStore",
    "CorruptEntryWarning",
    "Digest",
    "EncoderCache",
    "Lease",
    "RedisTier",
    "RemoteStats",
    "RemoteWarning",
    "Resolved",
    "StoreStats",
    "kv_to_tensors",
    "open_store",
    "patch_key",
    "patch_to_tensors",
    "tensors_to_kv",
    "tensors_to_patch",
]
