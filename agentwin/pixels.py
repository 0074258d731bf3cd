"""Pixels of evicted image and frame chunks, kept in the store (under its budgets) instead of the window, so a
long-running loop does not hold every frame it saw; the window keeps the chunk without them until a recall."""

from __future__ import annotations

import dataclasses

from agentwin.models.vision import VisionChunk
from agentwin.store import ChunkKey, ChunkStore


def _with_pixels(chunk: VisionChunk, pixels: object, digest: str) -> VisionChunk:
    out = dataclasses.replace(chunk, pixels=pixels)
    # `digest` is a cached property of the frozen chunk: seed it with the real pixels' digest.
    out.__dict__["digest"] = digest
    return out


def spill(store: ChunkStore, fingerprint: str, chunk: VisionChunk) -> tuple[VisionChunk, ChunkKey] | None:
    """Put `chunk`'s pixels in the store; returns the chunk without them and their key, or None when the store refuses
    them for size."""
    key = ChunkKey.of(fingerprint, "pixels", bytes.fromhex(chunk.digest), tenant=store.tenant)
    try:
        store.put(key, {"pixels": chunk.pixels}, {"modality": chunk.kind})
    except ValueError:
        return None
    return _with_pixels(chunk, chunk.pixels[:0], chunk.digest), key


def restore(store: ChunkStore, key: ChunkKey, chunk: VisionChunk, what: str) -> VisionChunk:
    """`chunk` with its pixels read back from the store; ValueError naming `what` when the budget dropped them."""
    hit = store.get(key)
    if hit is None:
        raise ValueError(f"{what}'s pixels were dropped by the store's budget while it was evicted; append the "
                         "image or frames again (or give the store a disk root or a larger budget)")
    return _with_pixels(chunk, hit[0]["pixels"], chunk.digest)
