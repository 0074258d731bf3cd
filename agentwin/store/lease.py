"""Leases deciding which worker computes an entry while the others wait (`ChunkStore.get_or_compute`), and lease
files in a disk root. Advisory: a lease that lapses mid-compute costs a second compute, never a wrong value."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Literal

import torch

from agentwin.store.disk import LEASE_FORMAT, TMP_PREFIX, DiskTier
from agentwin.store.keys import ChunkKey

LeaseTier = Literal["remote", "disk", "ram", "none"]


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease on `key`: `token` (random per grant), the `tier` holding it ("none": uncoordinated, after a
    remote fault) and `expires_at` (`time.time()` seconds), after which others may take it over."""

    key: ChunkKey
    token: str
    tier: LeaseTier
    expires_at: float


@dataclass(frozen=True, slots=True)
class Resolved:
    """What `ChunkStore.get_or_compute` returns. `how`: "hit", "waited" (another worker computed it) or "computed"
    (here; `tensors` are then compute's own, on their devices). `meta`: a fresh dict."""

    tensors: dict[str, torch.Tensor]
    meta: dict
    how: Literal["hit", "waited", "computed"]


def new_token() -> str:
    return secrets.token_hex(16)


def check_seconds(value: object, what: str, allow_none: bool = False, allow_zero: bool = False) -> float | None:
    """`value` as float seconds: finite and > 0 (>= 0 with `allow_zero`; None passes with `allow_none`); TypeError
    for another type, ValueError out of range."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not ((0 <= value if allow_zero else 0 < value) and value < float("inf")):
        raise ValueError(f"{what} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


class DiskLeases:
    """Lease files `<digest>.lease` (JSON token and expiry) in a disk tier's root, changed under its exclusive flock."""

    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk

    def _path(self, digest: str):
        return self.disk.root / f"{digest}.lease"

    def holder(self, digest: str) -> tuple[str, float] | None:
        """(token, expires_at) of the lease file; ("", 0.0) when unreadable (taken over like a lapsed lease); None
        when there is none."""
        try:
            raw = self._path(digest).read_bytes()
        except FileNotFoundError:
            return None
        try:
            o = json.loads(raw)
            if o["format"] != LEASE_FORMAT or o["digest"] != digest or not isinstance(o["token"], str):
                return "", 0.0
            return o["token"], float(o["expires_at"])
        except (ValueError, TypeError, KeyError):
            return "", 0.0

    def try_acquire(self, digest: str, token: str, ttl_s: float) -> float | None:
        """Writes a lease for `token` expiring in `ttl_s` seconds unless another live lease holds `digest`; its
        expiry time, or None when held by another."""
        with self.disk.locked(exclusive=True):
            now = time.time()
            held = self.holder(digest)
            if held is not None and held[0] != token and held[1] > now:
                return None
            expires = now + ttl_s
            body = json.dumps({"format": LEASE_FORMAT, "digest": digest, "token": token, "expires_at": expires,
                               "host": socket.gethostname(), "pid": os.getpid()}).encode("utf-8")
            # Replaced atomically, so a reader sees a whole lease or none; not fsynced: a lease lost
            # in a crash only lets another worker compute the entry too.
            tmp = self.disk.root / f"{TMP_PREFIX}{digest}.lease.{os.getpid()}.{secrets.token_hex(4)}"
            try:
                tmp.write_bytes(body)
                os.utime(tmp, (expires, expires))  # mtime = expiry: refresh collects lapsed files by stat
                os.replace(tmp, self._path(digest))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return expires

    def release(self, digest: str, token: str) -> bool:
        """Deletes the lease file if `token` still holds it; False otherwise."""
        with self.disk.locked(exclusive=True):
            held = self.holder(digest)
            if held is None or held[0] != token:
                return False
            self._path(digest).unlink(missing_ok=True)
            return True
