"""`open_store(location)`: a `ChunkStore` for None (RAM), a path (a disk tier) or a redis:// URL."""

from __future__ import annotations

import os

from agentwin.store.remote import RedisTier, check_url
from agentwin.store.store import ChunkStore


def open_store(location: str | os.PathLike | None = None, *, model_fingerprint: str = "", tenant: str = "",
               secret: bytes | str | None = None, ram_bytes: int = 2 << 30, disk_bytes: int = 20 << 30,
               timeout_s: float = 1.0, cache_dir: str | os.PathLike | None = None) -> ChunkStore:
    """A `ChunkStore` for `location`: None → RAM only; a path → RAM + a disk tier rooted there (shared by processes
    on this machine); "redis://[user:password@]host[:port][/db]" or "rediss://..." (TLS), "?cluster=1" for a Redis
    Cluster → RAM (+ a disk tier at `cache_dir`) + a `RedisTier` shared across machines. Nothing connects here; a
    server that is down makes remote calls misses (one RemoteWarning). `timeout_s` bounds each remote socket
    operation; `secret` signs remote entries (HMAC-SHA256, one per tenant); both are validated whatever the
    location. ValueError for another location form or a `cache_dir` with a local one; TypeError for wrong types."""
    forms = ("None (RAM only), a filesystem path (disk tier at that root), or a redis://[user:password@]host"
             "[:port][/db] / rediss://... URL, ?cluster=1 for a Redis Cluster (remote tier, with a disk tier at "
             "cache_dir if given)")
    if secret is not None and not isinstance(secret, (bytes, str)):
        raise TypeError(f"secret must be bytes, str or None, got {type(secret).__name__}")
    if isinstance(secret, (bytes, str)) and not secret:
        raise ValueError("secret must not be empty; pass None for unsigned entries")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__} {timeout_s!r}")
    if not (timeout_s > 0 and timeout_s != float("inf")):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a path or None, got {type(cache_dir).__name__}")
    common = {"ram_bytes": ram_bytes, "model_fingerprint": model_fingerprint, "tenant": tenant}
    if isinstance(location, str) and "://" in location:
        url = check_url(location) if location.split("://", 1)[0] in ("redis", "rediss") else None
        if url is None:
            raise ValueError(f"location {location.split('://', 1)[0]}://... is not supported; location must be {forms}")
        remote = RedisTier(url, timeout_s=timeout_s, secret=secret)
        return ChunkStore(cache_dir, disk_bytes=disk_bytes, remote=remote, **common)
    if cache_dir is not None:
        raise ValueError("cache_dir only applies to a redis:// or rediss:// location; for a local disk tier pass "
                         "its path as location")
    if location is None:
        return ChunkStore(None, disk_bytes=disk_bytes, **common)
    if isinstance(location, str) and not location:
        raise ValueError(f"location is an empty string; location must be {forms}")
    if not isinstance(location, (str, os.PathLike)):
        raise TypeError(f"location must be {forms}; got {type(location).__name__} {location!r}")
    return ChunkStore(location, disk_bytes=disk_bytes, **common)
