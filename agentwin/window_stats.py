"""`WindowStats`: what one window did, every forward counted by kind."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]

FORWARD_KINDS = ("encode", "in_context", "recompute", "conditioned", "query", "decode", "orbit", "retrieval", "guard")


@dataclass
class WindowStats:
    """Counters and times of one window (docs/DESIGN.md, "Accounting"); mutated by the window as it works.

    forwards / forward_tokens: forwards and the tokens they computed, by kind: encode (a chunk alone), in_context
        (its first pass), recompute (again, as what precedes it changed), conditioned (for a patch), query, decode,
        orbit, retrieval (`nearest`), guard; a forward computing several kinds counts once under each.
        passes: forwards run; forwarded_tokens: all of forward_tokens.
    exact_hits / exact_hit_tokens: placements served from in-context KV stored for exactly that placement, no
        forward; matched_tokens: rows reused after the same prefix (`agentwin.prefix.PrefixIndex`).
    computed_chunks: chunks a pass computed at their placement. waited: placements another worker computed while
        this window waited. approximate: placements served by a policy's approximation, not the model's own KV.
    relocations / relocated_tokens: placements (and their tokens) served by a shift (+ patch) with no forward
        there; never a chunk served from a pass this window ran. Placements, not savings.
    store_hit_tokens: tokens whose canonical KV came from the store. seconds: wall time by operation; wall_s: time
        in public operations, each counted once.
    patch_bytes / patched_kv_bytes: bytes of the patches fitted and of their chunks' canonical KV as held;
        kl_bytes / kl_ranks (max_kl): per patch its bytes and largest block rank kept (0: blind).
    guard_*: patch components (a layer's k or v) checked, dropped and their bytes; guard_fallbacks: patches
        dropped whole. stale_patches: placements served with a patch fitted after another antecedent, per read.
    held_bytes: KV and patch bytes the window references now; store: the store's tiers at the last stats() call.
    """

    passes: int = 0
    exact_hits: int = 0
    exact_hit_tokens: int = 0
    matched_tokens: int = 0
    approximate: int = 0
    waited: int = 0
    computed_chunks: int = 0
    patch_hits: int = 0
    patch_misses: int = 0
    canonical_hits: int = 0  # chunks whose canonical KV came from the store (no encode)
    store_hit_tokens: int = 0
    relocations: int = 0
    relocated_tokens: int = 0
    evictions: int = 0
    recalls: int = 0
    encoder_calls: int = 0  # vision-tower runs
    encoder_hits: int = 0  # vision-tower outputs served by the encoder cache
    patch_bytes: int = 0
    patched_kv_bytes: int = 0  # canonical KV bytes (as held) of the chunks those patches were fitted for
    guard_checked: int = 0  # patch components (a layer's k or v) the guard checked
    guard_dropped: int = 0  # ... and dropped (they did not lower the probe error)
    guard_dropped_bytes: int = 0
    guard_fallbacks: int = 0  # patches dropped whole: blind reuse read the chunk's last rows as well
    stale_patches: int = 0  # placements served with a patch fitted after another antecedent
    kl_ranks: list[int] = field(default_factory=list)  # max_kl: per patch the largest block rank kept (0: blind)
    kl_bytes: list[int] = field(default_factory=list)  # with max_kl: per fitted patch the bytes kept (0: blind)
    held_bytes: int = 0
    forwards: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    forward_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    wall_s: float = 0.0
    store: object = None  # StoreStats at the last stats() call

    def guarded(self, report: object) -> None:
        """Count one `kamera_core.guard.GuardReport`."""
        checked = 2 * len(report.layers)
        kept = sum(len(layer.choice) if layer.choice != "none" else 0 for layer in report.layers)
        self.guard_checked += checked
        self.guard_dropped += checked - kept
        self.guard_dropped_bytes += report.bytes_before - report.bytes_after

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in self.forward_tokens.items() if v)
        return (f"WindowStats({self.forwarded_tokens} tokens forwarded in {self.passes} passes ({kinds or 'none'}); "
                f"{self.exact_hits} placements from the store, {self.matched_tokens} rows reused, "
                f"{self.approximate} approximate; {self.evictions} evictions, {self.recalls} recalls; "
                f"vision tower {self.encoder_calls} runs, {self.encoder_hits} reused; "
                f"{self.held_bytes / 2 ** 20:.1f} MiB held)")

    def table(self) -> str:
        """The counters as aligned lines, for people: what ran, what was reused, what moved."""
        rows = [("forwarded tokens", f"{self.forwarded_tokens} in {self.passes} passes"),
                *((f"  {k}", f"{v} tokens, {self.forwards[k]} forwards") for k, v in self.forward_tokens.items() if v),
                ("placements from the store", f"{self.exact_hits} ({self.exact_hit_tokens} tokens)"),
                ("rows reused after the same prefix", str(self.matched_tokens)),
                ("approximate placements", f"{self.approximate} ({self.relocated_tokens} tokens relocated, "
                                           f"{self.stale_patches} stale patches)"),
                ("waited for another worker", str(self.waited)),
                ("evictions / recalls", f"{self.evictions} / {self.recalls}"),
                ("vision tower runs / reused", f"{self.encoder_calls} / {self.encoder_hits}"),
                ("canonical KV from the store", f"{self.canonical_hits} chunks"),
                ("patch bytes", f"{self.patch_bytes} for {self.patched_kv_bytes} bytes of KV"),
                ("held by the window", f"{self.held_bytes / 2 ** 20:.1f} MiB"),
                ("time in the window's calls", f"{self.wall_s:.2f} s")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def count(self, kind: str, tokens: int) -> None:
        """One forward of `tokens` tokens, of `kind` (one of FORWARD_KINDS)."""
        self.count_pass({kind: tokens})

    def count_pass(self, tokens: dict[str, int]) -> None:
        """One forward that computed `tokens[kind]` tokens of each kind (kinds of FORWARD_KINDS)."""
        for kind in tokens:
            if kind not in FORWARD_KINDS:
                raise ValueError(f"unknown forward kind {kind!r}; one of {FORWARD_KINDS}")
        self.passes += 1
        for kind, n in tokens.items():
            if n:
                self.forwards[kind] += 1
                self.forward_tokens[kind] += int(n)

    @property
    def conditioned_passes(self) -> int:
        """Forwards that computed a chunk for a patch (`forwards["conditioned"]`), alone or in a batched pass."""
        return int(self.forwards.get("conditioned", 0))

    @property
    def forwarded_tokens(self) -> int:
        return int(sum(self.forward_tokens.values()))


def kv_nbytes(kv: Sequence[LayerKV] | None) -> int:
    return 0 if kv is None else sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
