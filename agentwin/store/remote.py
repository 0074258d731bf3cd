"""The remote tier: `RedisTier`, entries shared across processes and machines on a Redis server or Cluster.
Keys of entry `D` under prefix `P`, all with hash tag `{D}` (one cluster slot): `P{D}:m` manifest,
`P{D}:p:<token>:<i>` parts, `P{D}:t:<token>:<i>` parts being uploaded, `P{D}:l` lease. Faults never raise: the
call reports "error" (a miss, a skipped write), warned once per server or node, then left alone for `retry_s`.
Eviction is the server's (`maxmemory` with `maxmemory-policy allkeys-lru`)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import safetensors
import safetensors.torch
import torch

from agentwin.store.remote_client import check_url, cluster_client, is_cluster, plain_client, safe_url
from agentwin.store.lease import check_seconds
from agentwin.store.manifest import FORMAT, Manifest, canonical, field, parse_manifest
from agentwin.store.stats import RemoteStats, RemoteWarning
from agentwin.store.tiers import CorruptEntryWarning, Entry

__all__ = ["FORMAT", "ORPHAN_TTL_S", "PART_BYTES", "RedisTier", "RemoteStats", "RemoteWarning", "check_url", "safe_url"]

PART_BYTES = 8 << 20
MAX_PART_BYTES = 256 << 20  # well under Redis's proto-max-bulk-len (512 MiB)
ORPHAN_TTL_S = 600.0
_MAC_DOMAIN = b"agentwin.store.remote.mac/1"
_log = logging.getLogger(__name__)
# Deletes the lease only while it still holds the caller's token (a lapsed lease may be another's).
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_WHY = {"corrupt": "a part missing or cut short, or its checksum, parse or tensor specs failed",
        "rejected": "its manifest names another model fingerprint or tenant, or has no valid MAC"}

Status = Literal["hit", "absent", "corrupt", "rejected", "error"]
T = TypeVar("T")


class RedisTier:
    """Entries on a Redis server or Cluster (`url`: see `remote_client`). timeout_s (seconds) bounds connecting, each
    socket read/write and each pool wait; max_connections is the pool size (per node); payloads are cut into
    `part_bytes` parts; ttl_s expires entries (None: kept until the server evicts them); with `secret`, every entry
    carries HMAC-SHA256 and entries without a valid one are rejected (one secret per tenant, shared by its
    processes); after a fault the server or node is left alone for `retry_s`; `prefix` has no braces.
    Thread-safe. Making one does not connect; the first call does."""

    def __init__(self, url: str, *, timeout_s: float = 1.0, max_connections: int = 8,
                 part_bytes: int = PART_BYTES, ttl_s: float | None = None, secret: bytes | str | None = None,
                 retry_s: float = 2.0, prefix: str = "agentwin:") -> None:
        url = check_url(url)
        self.timeout_s = check_seconds(timeout_s, "timeout_s")
        self.retry_s = check_seconds(retry_s, "retry_s", allow_zero=True)
        self.ttl_s = check_seconds(ttl_s, "ttl_s", allow_none=True)
        for what, v, lo, hi in (("max_connections", max_connections, 1, 1 << 16),
                                ("part_bytes", part_bytes, 1, MAX_PART_BYTES)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{what} must be an int, got {type(v).__name__} {v!r}")
            if not lo <= v <= hi:
                raise ValueError(f"{what} must be in [{lo}, {hi}], got {v}")
        self.part_bytes = part_bytes
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise TypeError(f"secret must be non-empty bytes or str, or None; got {type(secret).__name__}")
        self._secret = secret
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must be a str without braces (they delimit the hash tag), got {prefix!r}")
        self.prefix = prefix
        self.url = safe_url(url) + ("?cluster=1" if is_cluster(url) else "")
        try:
            import redis
            import redis.cluster  # noqa: F401  (RedisClusterException below; the cluster client)
        except ImportError as exc:
            raise ImportError("RedisTier needs the redis client: pip install redis==8.1.0 (or run scripts/setup.sh)"
                              ) from exc
        self._redis = redis
        self._faults: tuple[type[BaseException], ...] = (
            redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)
        self.cluster = is_cluster(url)
        self._url, self._max_connections = url, max_connections
        # A cluster client asks a node for the slot map when made: made on first use instead.
        self._client: Any = None if self.cluster else plain_client(redis, url, self.timeout_s, max_connections)
        self._lock = threading.Lock()
        self._retry_at: dict[str, float] = {}  # node ("" = the server, or the whole cluster) -> time.monotonic()
        self._warned: set[str] = set()  # nodes a RemoteWarning was issued for, until they answer again
        self._warned_entries: set[str] = set()  # digests a CorruptEntryWarning was issued for
        self._counts = dict.fromkeys(("hits", "absent", "corrupt", "rejected", "errors", "writes"), 0)

    def __repr__(self) -> str:
        return (f"RedisTier({self.url!r}, timeout_s={self.timeout_s}, signed={self._secret is not None}, "
                f"cluster={self.cluster})")

    def close(self) -> None:
        """Closes pooled connections (a later call opens new ones)."""
        with self._lock:
            client = self._client
            if self.cluster:
                self._client = None
        if client is None:
            return
        if self.cluster:
            client.close()
        else:
            client.connection_pool.disconnect()

    def _conn(self) -> Any:
        """The client, made here on first use for a cluster; a fault propagates."""
        client = self._client
        if client is None:
            made = cluster_client(self._redis, self._url, self.timeout_s, self._max_connections)
            with self._lock:
                if self._client is None:
                    self._client, made = made, None
                client = self._client
            if made is not None:
                made.close()
        return client

    def stats(self) -> RemoteStats:
        with self._lock:
            return RemoteStats(**self._counts)

    # -- keys ------------------------------------------------------------------------------------
    def manifest_key(self, digest: str) -> str:
        return f"{self.prefix}{{{digest}}}:m"

    def part_key(self, digest: str, token: str, i: int) -> str:
        return f"{self.prefix}{{{digest}}}:p:{token}:{i}"

    def _tmp_key(self, digest: str, token: str, i: int) -> str:
        return f"{self.prefix}{{{digest}}}:t:{token}:{i}"

    def lease_key(self, digest: str) -> str:
        return f"{self.prefix}{{{digest}}}:l"

    # -- fault handling --------------------------------------------------------------------------
    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _available(self, node: str) -> bool:
        """False (counted as an error) while backing off after a fault of `node`."""
        with self._lock:
            if time.monotonic() < self._retry_at.get(node, 0.0):
                self._counts["errors"] += 1
                return False
            return True

    def _fault(self, op: str, node: str, exc: BaseException) -> None:
        with self._lock:
            self._counts["errors"] += 1
            self._retry_at[node] = time.monotonic() + self.retry_s
            first = node not in self._warned
            self._warned.add(node)
        if first:
            where = f"{self.url} (node {node})" if node else self.url
            warnings.warn(f"remote store {where}: {op} failed ({type(exc).__name__}: {exc}); carrying on "
                          f"with the local tiers (misses are computed locally), retrying {'it' if node else 'the server'} "
                          f"at most every {self.retry_s:g} s; no further warning until it answers again",
                          RemoteWarning, stacklevel=5)

    def _answered(self, node: str) -> None:
        if node in self._warned:
            with self._lock:
                recovered = node in self._warned
                self._warned.discard(node)
            if recovered:
                _log.info("remote store %s answers again", f"{self.url} (node {node})" if node else self.url)

    def _call(self, op: str, digest: str, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """(True, fn()), or (False, None) on a fault (counted, warned once, node backed off) or during a back-off."""
        if not self._available(""):
            return False, None
        node = ""
        try:
            client = self._conn()
            if self.cluster:
                node = self._node(client, digest)
                if not self._available(node):
                    return False, None
            out = fn()
        except self._faults as exc:
            self._fault(op, node, exc)
            return False, None
        self._answered(node)
        return True, out

    def _node(self, client: Any, digest: str) -> str:
        """The node serving `digest`'s slot, from the slot map (no round trip); "slot N" when no node covers it."""
        key = self.manifest_key(digest)
        try:
            return client.get_node_from_key(key).name
        except self._redis.exceptions.SlotNotCoveredError:
            return f"slot {client.keyslot(key)}"

    def _warn_corrupt(self, digest: str, status: str) -> None:
        with self._lock:
            first = digest not in self._warned_entries
            self._warned_entries.add(digest)
        if first:
            warnings.warn(f"remote tier {self.url}: entry {digest} failed verification ({_WHY[status]}); deleted "
                          "and read as a miss, so it is recomputed", CorruptEntryWarning, stacklevel=5)

    # -- manifests -------------------------------------------------------------------------------
    def _mac(self, digest: str, body: bytes, sha: str) -> str:
        if self._secret is None:
            raise RuntimeError("MAC requested without a secret; this indicates a bug")
        msg = field(_MAC_DOMAIN) + field(digest.encode()) + field(body) + field(sha.encode())
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def _check_manifest(self, digest: str, raw: bytes, fingerprint: str, tenant: str
                        ) -> tuple[Status, Manifest | None]:
        """("hit" | "corrupt" | "rejected", manifest): parsed, owner and MAC checked."""
        body, sep, mac = raw.rpartition(b"\n")
        got = parse_manifest(body, digest) if sep else None
        if got is None:
            return "corrupt", None
        m, fp, ten = got
        if (fp, ten) != (fingerprint, tenant):
            return "rejected", m
        if self._secret is not None:
            want = self._mac(digest, body, m.sha256).encode()
            if not hmac.compare_digest(mac, want):
                return "rejected", m
        return "hit", m

    def _part_keys(self, digest: str, m: Manifest | None) -> list[str]:
        return [] if m is None else [self.part_key(digest, m.token, i) for i in range(len(m.parts))]

    def _drop_if_unchanged(self, digest: str, raw: bytes, m: Manifest | None) -> bool:
        """Deletes the entry if its manifest is still `raw` (WATCH/MULTI); False if it changed."""
        mkey = self.manifest_key(digest)
        with self._conn().pipeline(transaction=True) as pipe:
            try:
                pipe.watch(mkey)
                if pipe.get(mkey) != raw:
                    return False
                pipe.multi()
                pipe.delete(mkey, *self._part_keys(digest, m))
                pipe.execute()
                return True
            except self._redis.exceptions.WatchError:
                return False

    # -- entry operations ------------------------------------------------------------------------
    def get(self, digest: str, fingerprint: str, tenant: str) -> tuple[Status, Entry | None]:
        """("hit", entry) with verified contiguous CPU tensors, or (status, None): "absent", "corrupt" / "rejected" (the
        entry was deleted; one CorruptEntryWarning per entry), "error" (fault or back-off)."""
        ok, got = self._call("get", digest, lambda: self._get(digest, fingerprint, tenant))
        if not ok or got is None:
            return "error", None
        status, entry = got
        self._count({"hit": "hits"}.get(status, status))
        if status in _WHY:
            self._warn_corrupt(digest, status)
        return status, entry

    def _get(self, digest: str, fingerprint: str, tenant: str) -> tuple[Status, Entry | None]:
        raw = self._conn().get(self.manifest_key(digest))
        if raw is None:
            return "absent", None
        status, m = self._check_manifest(digest, raw, fingerprint, tenant)
        if status == "hit" and m is not None:
            pipe = self._conn().pipeline(transaction=False)
            for k in self._part_keys(digest, m):
                pipe.get(k)
            parts = pipe.execute()
            entry = self._assemble(m, parts)
            if entry is not None:
                return "hit", entry
            status = "corrupt"
        # Delete it, unless a writer replaced it meanwhile (then the parts we missed were the old
        # version's, deleted by that writer: a plain miss).
        return (status if self._drop_if_unchanged(digest, raw, m) else "absent"), None

    @staticmethod
    def _assemble(m: Manifest, parts: list[bytes | None]) -> Entry | None:
        """The entry from its parts, or None when any check fails."""
        if len(parts) != len(m.parts) or any(p is None or len(p) != n for p, n in zip(parts, m.parts)):
            return None
        blob = b"".join(parts)  # type: ignore[arg-type]
        if len(blob) != m.size or hashlib.sha256(blob).hexdigest() != m.sha256:
            return None
        try:
            tensors = safetensors.torch.load(blob)
        except (safetensors.SafetensorError, ValueError, TypeError):
            return None  # matches its checksum but does not parse: written wrong
        got = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if got != m.tensors or nbytes != m.nbytes:
            return None
        return Entry({n: t.contiguous() for n, t in tensors.items()}, m.meta_json, nbytes)

    def put(self, digest: str, tensors: dict[str, torch.Tensor], meta_json: str, nbytes: int,
            fingerprint: str, tenant: str) -> bool:
        """Publishes the entry (contiguous CPU tensors), replacing any under `digest`; False on a fault or during the
        back-off. A half-written entry is never visible."""
        blob = safetensors.torch.save(tensors)
        sha = hashlib.sha256(blob).hexdigest()
        n = self.part_bytes
        parts = [blob[i:i + n] for i in range(0, len(blob), n)]
        token = secrets.token_hex(8)
        manifest = {"format": FORMAT, "digest": digest, "model_fingerprint": fingerprint, "tenant": tenant,
                    "token": token, "size": len(blob), "sha256": sha, "parts": [len(p) for p in parts],
                    "tensors": {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                                for k, t in tensors.items()},
                    "nbytes": nbytes, "meta": json.loads(meta_json), "created": time.time()}
        body = canonical(manifest)
        raw = body + b"\n" + (self._mac(digest, body, sha).encode() if self._secret is not None else b"")

        def write() -> bool:
            self._upload(digest, token, parts)
            return self._publish(digest, token, len(parts), raw)

        ok, published = self._call("put", digest, write)
        if not ok:
            return False
        if not published:
            self._count("errors")
            return False
        self._count("writes")
        return True

    def _upload(self, digest: str, token: str, parts: list[bytes]) -> None:
        """The parts under temporary keys that expire should this writer die, in one pipeline."""
        pipe = self._conn().pipeline(transaction=False)
        for i, p in enumerate(parts):
            pipe.set(self._tmp_key(digest, token, i), p, px=int(ORPHAN_TTL_S * 1000))
        pipe.execute()

    def _publish(self, digest: str, token: str, count: int, raw: bytes) -> bool:
        """One MULTI/EXEC: temporary keys → part keys (with the entry's TTL), then the manifest; False (the entry
        withdrawn) when a temporary part vanished before the rename."""
        mkey = self.manifest_key(digest)
        ttl_ms = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        tx = self._conn().pipeline(transaction=True)
        tx.get(mkey)
        for i in range(count):
            # execute_command: redis-py's cluster pipeline refuses its rename() wrapper, which could
            # cross slots; these two keys share the entry's hash tag, so one slot.
            tx.execute_command("RENAME", self._tmp_key(digest, token, i), self.part_key(digest, token, i))
            if ttl_ms is None:
                tx.persist(self.part_key(digest, token, i))
            else:
                tx.pexpire(self.part_key(digest, token, i), ttl_ms)
        tx.set(mkey, raw, px=ttl_ms)
        results = tx.execute(raise_on_error=False)
        old = results[0]
        if any(isinstance(r, Exception) for r in results):
            # e.g. a temporary part evicted by the server's LRU before the rename: the manifest
            # would name a missing part; withdraw it (readers would reject it anyway).
            body = raw.rpartition(b"\n")[0]
            got = parse_manifest(body, digest)
            self._drop_if_unchanged(digest, raw, got[0] if got else None)
            return False
        if isinstance(old, bytes) and old != raw:
            got = parse_manifest(old.rpartition(b"\n")[0], digest)
            if got is not None and got[0].token != token:
                stale = self._part_keys(digest, got[0])
                if stale:
                    self._conn().delete(*stale)
        return True

    def contains(self, digest: str, fingerprint: str, tenant: str) -> bool:
        """Whether a manifest of this owner (with a valid MAC, given a secret) is published; parts are verified only by
        get. False on a fault."""
        ok, raw = self._call("contains", digest, lambda: self._conn().get(self.manifest_key(digest)))
        return ok and raw is not None and self._check_manifest(digest, raw, fingerprint, tenant)[0] == "hit"

    def delete(self, digest: str) -> bool:
        """Deletes the manifest under `digest` and the parts it names, whatever owner it names; True when a manifest was
        deleted, False when none was there or on a fault."""
        mkey = self.manifest_key(digest)

        def delete() -> bool:
            raw = self._conn().get(mkey)
            if raw is None:
                return False
            got = parse_manifest(raw.rpartition(b"\n")[0], digest)
            return bool(self._conn().delete(mkey, *self._part_keys(digest, got[0] if got else None)))

        ok, removed = self._call("delete", digest, delete)
        return bool(ok and removed)

    # -- leases ----------------------------------------------------------------------------------
    def try_lease(self, digest: str, token: str, ttl_s: float) -> Literal["granted", "held", "error"]:
        """Sets the entry's lease to `token` for `ttl_s` seconds unless another token holds it: "granted", "held" or
        "error" (a fault or the back-off: the caller goes on without a lease)."""
        ttl_ms = max(1, int(check_seconds(ttl_s, "ttl_s") * 1000))
        ok, set_ = self._call("lease", digest, lambda: self._conn().set(self.lease_key(digest), token, nx=True,
                                                                         px=ttl_ms))
        if not ok:
            return "error"
        return "granted" if set_ else "held"

    def release_lease(self, digest: str, token: str) -> bool:
        """Deletes the entry's lease if `token` still holds it; False when it had lapsed (perhaps taken over) or on a
        fault (it then lapses on its own)."""
        ok, n = self._call("release", digest, lambda: self._conn().eval(_RELEASE, 1, self.lease_key(digest), token))
        return bool(ok and n)
