"""`EncoderCache`: vision-encoder outputs in a `ChunkStore`, keyed by the pixels and settings."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from agentwin.store.keys import ChunkKey, check_key
from agentwin.store.store import ChunkStore

Tensor = torch.Tensor
MODALITY = "vision-encoder"
_EMPTY: Mapping[str, object] = MappingProxyType({})


class EncoderCache:
    """Runs a vision encoder at most once per (model, pixels, settings, tenant) across the processes sharing the
    store (through `ChunkStore.get_or_compute`). `computed` counts calls of `fn` here, `reused` outputs served."""

    def __init__(self, store: ChunkStore) -> None:
        if not isinstance(store, ChunkStore):
            raise TypeError(f"store must be a ChunkStore, got {type(store).__name__}")
        self.store = store
        self.computed = 0
        self.reused = 0

    def key(self, pixels: bytes | Tensor, settings: Mapping[str, object] = _EMPTY) -> ChunkKey:
        """The key of `pixels` (encoded or raw image bytes, or a pixel tensor, hashed with dtype and shape) and
        `settings` under the store's fingerprint and tenant."""
        if not isinstance(pixels, (bytes, bytearray, memoryview, Tensor)):
            raise TypeError(f"pixels must be bytes or a torch.Tensor, got {type(pixels).__name__}")
        return ChunkKey.of(self.store.model_fingerprint, MODALITY, pixels, settings, self.store.tenant)

    def get_or_compute(self, key: ChunkKey, fn: Callable[[], Mapping[str, Tensor]],
                       meta: Mapping[str, object] = _EMPTY) -> dict[str, Tensor]:
        """The stored outputs for `key`, else `fn()` (e.g. `{"embeds": [tokens, hidden]}`), stored, then returned as fn
        returned them. Errors from fn or the store (e.g. over budget) propagate and count nothing."""
        check_key(key)
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        got = self.store.get_or_compute(key, fn, meta)
        if got.how == "computed":
            self.computed += 1
        else:
            self.reused += 1
        return got.tensors
