"""`WindowIO`, the window's reads and writes of the store: canonical KV, in-context KV, patches, evicted pixels and
vision-tower outputs; every hit, store-read token and vision-tower run is counted in the window's stats."""

from __future__ import annotations

from typing import Any

from agentwin import pixels
from agentwin.models.adapter import KameraModel
from agentwin.models.kv import LayerKV
from agentwin.models.vision import VisionChunk
from agentwin.store import (ChunkKey, ChunkStore, EncoderCache, kv_to_tensors, patch_key, patch_to_tensors, tensors_to_kv,
                            tensors_to_patch)
from agentwin.window_stats import WindowStats
from kamera_core import patch as kp


class WindowIO:
    """Store access for one window; `settings` (`agentwin.patches.fit.PatchSettings`) name its patch keys."""

    def __init__(self, km: KameraModel, store: ChunkStore, stats: WindowStats, settings: Any) -> None:
        self.km, self.store, self._stats = km, store, stats
        self.rank, self.storage, self.method = settings.key_rank, settings.storage, settings.method
        self.encoder = EncoderCache(store)

    def features(self, vc: VisionChunk) -> dict:
        """Vision-tower outputs of `vc` through the encoder cache: the tower runs once per image."""
        computed = self.encoder.computed
        out = self.encoder.get_or_compute(self.encoder.key(bytes.fromhex(vc.digest)), lambda: self.km.features(vc),
                                          {"modality": vc.kind, "tokens": int(vc.ids.numel())})
        if self.encoder.computed > computed:
            self._stats.encoder_calls += 1
        else:
            self._stats.encoder_hits += 1
        return out

    def spill_pixels(self, chunk: Any) -> None:
        """Move an evicted vision chunk's pixels to the store (mutates `chunk`; kept if refused for size)."""
        if chunk.inputs.kind != "text" and chunk.pixels_key is None:
            spilled = pixels.spill(self.store, self.km.fingerprint, chunk.inputs)
            if spilled is not None:  # else refused for size: kept here
                chunk.inputs, chunk.pixels_key = spilled

    def restore_pixels(self, chunk: Any) -> None:
        """Pixels of an evicted vision chunk back from the store (mutates `chunk`; ValueError, nothing changed)."""
        if chunk.pixels_key is not None:
            chunk.inputs = pixels.restore(self.store, chunk.pixels_key, chunk.inputs, f"chunk {chunk.id}")
            chunk.pixels_key = None

    def load_canonical(self, key: ChunkKey, tokens: int) -> list[LayerKV] | None:
        """Canonical KV from the store (its own tensors, not copies), or None; RuntimeError if the entry mismatches."""
        hit = self.store.get(key)
        if hit is None:
            return None
        kv = tensors_to_kv(hit[0])
        if len(kv) != len(self.km.specs) or kv[0][0].shape[0] != tokens:
            raise RuntimeError(f"store entry {key} does not hold this chunk's KV ({len(kv)} layers, "
                               f"{kv[0][0].shape[0] if kv else 0} tokens); this indicates a bug")
        self._stats.canonical_hits += 1
        self._stats.store_hit_tokens += tokens
        return kv

    def load_placed(self, key: ChunkKey, tokens: int) -> list[LayerKV] | None:
        """A chunk's in-context KV at placement `key` from the store, or None (never computed, or dropped by the
        store's budgets); RuntimeError if the entry mismatches."""
        hit = self.store.get(key)
        if hit is None:
            return None
        kv = tensors_to_kv(hit[0])
        if len(kv) != len(self.km.specs) or kv[0][0].shape[0] != tokens:
            raise RuntimeError(f"store entry {key} does not hold this placement's KV ({len(kv)} layers, "
                               f"{kv[0][0].shape[0] if kv else 0} tokens); this indicates a bug")
        return kv

    def load_run(self, key: ChunkKey) -> list[LayerKV] | None:
        """In-context KV stored under a placement key, whatever its length (prefix matches)."""
        hit = self.store.get(key)
        return None if hit is None else tensors_to_kv(hit[0])

    def put_placed(self, key: ChunkKey, kv: list[LayerKV], modality: str, start: int) -> list[LayerKV]:
        """Store a chunk's exact in-context KV under its placement key; returns the store's copy, or `kv` itself
        when the store could not keep it (too big for its budgets)."""
        tokens = int(kv[0][0].shape[0])
        try:
            self.store.put(key, kv_to_tensors(kv), {"modality": modality, "tokens": tokens, "start": int(start),
                                                    "kind": "in_context"})
        except ValueError:
            return kv
        hit = self.store.get(key)
        return tensors_to_kv(hit[0]) if hit is not None else kv

    def put_canonical(self, chunk: Any, kv: list[LayerKV]) -> list[LayerKV]:
        """Store freshly encoded canonical KV; returns the store's copy (one set of bytes with its RAM tier), or `kv`
        itself when the store keeps it on disk only."""
        modality = chunk.inputs.kind
        self.store.put(chunk.key, kv_to_tensors(kv), {"modality": modality, "tokens": int(chunk.ids.numel())})
        hit = self.store.get(chunk.key)
        return tensors_to_kv(hit[0]) if hit is not None else kv

    def patch_key(self, chunk: Any, antecedent: tuple[ChunkKey, ...]) -> ChunkKey:
        return patch_key(chunk.key, antecedent, self.rank, self.method)

    def stored_patch(self, chunk: Any, antecedent: tuple[ChunkKey, ...]) -> kp.ChunkPatch | None:
        """The patch of `chunk` for `antecedent`: this window's copy, else the store's (cached in `chunk`), or None."""
        if antecedent in chunk.patches:
            return chunk.patches[antecedent]
        hit = self.store.get(self.patch_key(chunk, antecedent))
        if hit is None:
            return None
        chunk.patches[antecedent] = tensors_to_patch(*hit)
        return chunk.patches[antecedent]

    def keep_patch(self, chunk: Any, antecedent: tuple[ChunkKey, ...], patch: kp.ChunkPatch) -> kp.ChunkPatch:
        chunk.patches[antecedent] = patch
        self.store.put(self.patch_key(chunk, antecedent), *patch_to_tensors(patch))
        return patch

