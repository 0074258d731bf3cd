"""`ChunkStore`: content-addressed entries (named tensors + a JSON meta dict) in up to four tiers (device, RAM,
disk, remote), each under a byte budget with LRU, plus pinning, checksums, model/tenant isolation and leases.
Budgets hold after every call: a call that cannot keep them raises ValueError and changes nothing."""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType

import torch

from agentwin.store.disk import DiskTier
from agentwin.store.keys import ChunkKey, canonical_json, check_key
from agentwin.store.lease import DiskLeases, Lease, Resolved, check_seconds, new_token
from agentwin.store.remote import RedisTier
from agentwin.store.stats import StoreStats
from agentwin.store.tiers import Entry, MemoryTier, prepare_tensors

Tensor = torch.Tensor
MAX_META_BYTES = 1 << 20
LEASE_TTL_S = 30.0
_EMPTY: Mapping[str, object] = MappingProxyType({})


def _budget(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int number of bytes, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


class ChunkStore:
    """Content-addressed store of entries `(dict[str, Tensor], meta dict)` keyed by `ChunkKey`.

    root: the disk tier's directory (None: no disk tier), shareable by processes of any owner, which then share
    `disk_bytes`. ram_bytes / disk_bytes / device_bytes: budgets in bytes (tensor bytes in RAM and on the device,
    file bytes on disk); device (e.g. "cuda") needs device_bytes > 0. Entries recorded under another
    model_fingerprint or tenant are never returned. remote: a `RedisTier`, read after RAM and disk, written back
    after every put, closed by close(). Returned tensors are the cached ones: do not modify them in place; meta is
    a fresh dict. Thread-safe (one lock; remote calls run under it, each bounded by its timeout); process-safe
    through flock on the root, and across machines through the remote tier.

    """

    def __init__(self, root: str | os.PathLike | None = None, *, ram_bytes: int = 2 << 30,
                 disk_bytes: int = 20 << 30, device: str | None = None, device_bytes: int = 0,
                 model_fingerprint: str = "", tenant: str = "", remote: RedisTier | None = None) -> None:
        ram_bytes, disk_bytes = _budget(ram_bytes, "ram_bytes"), _budget(disk_bytes, "disk_bytes")
        device_bytes = _budget(device_bytes, "device_bytes")
        for what, v in (("model_fingerprint", model_fingerprint), ("tenant", tenant)):
            if not isinstance(v, str):
                raise TypeError(f"{what} must be a str, got {type(v).__name__} {v!r}")
        if root is not None and not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path or None, got {type(root).__name__}")
        if remote is not None and not isinstance(remote, RedisTier):
            raise TypeError(f"remote must be an agentwin.store.RedisTier or None, got {type(remote).__name__}")
        self._fp, self._tenant = model_fingerprint, tenant
        self._remote = remote
        self._remote_hits = self._remote_misses = self._remote_errors = self._remote_dropped = 0
        self._dev: MemoryTier | None = None
        if device is None:
            if device_bytes:
                raise ValueError(f"device_bytes={device_bytes} needs a device (e.g. device='cuda')")
        else:
            try:
                dev = torch.device(device)
            except (TypeError, RuntimeError) as exc:
                raise ValueError(f"device must name a torch device, got {device!r}: {exc}") from None
            if dev.type == "cuda":
                if not torch.cuda.is_available():
                    raise ValueError(f"device={device!r} but CUDA is not available")
                dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
            if device_bytes == 0:
                raise ValueError(f"device={device!r} needs device_bytes > 0")
            self._dev = MemoryTier("device", device_bytes, dev)
        self._ram = MemoryTier("ram", ram_bytes, torch.device("cpu"))
        self._disk = DiskTier(Path(root), disk_bytes) if root is not None else None
        self._leases = DiskLeases(self._disk) if self._disk is not None else None
        self._hits = self._misses = self._evictions = self._demotions = self._promotions = 0
        self._lease_waits = self._lease_hits = self._lease_takeovers = 0
        self._mutex = threading.RLock()

    @property
    def model_fingerprint(self) -> str:
        return self._fp

    @property
    def tenant(self) -> str:
        return self._tenant

    @property
    def remote(self) -> RedisTier | None:
        return self._remote

    def close(self) -> None:
        """Releases the lock file and the remote tier's connections; later calls that need the disk raise ValueError."""
        if self._disk is not None:
            self._disk.close()
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API --------------------------------------------------------------------------------
    def put(self, key: ChunkKey, tensors: Mapping[str, Tensor], meta: Mapping[str, object] = _EMPTY,
            pin: bool = False) -> None:
        """Stores contiguous CPU copies of `tensors` (any shapes, supported dtypes) and JSON-able `meta` under `key`,
        replacing any entry; pin=True keeps it in RAM (an existing pin stays). ValueError, changing nothing, over a
        budget or with RAM full of pins. Then written back to the remote tier (a fault counts in remote_errors)."""
        with self._mutex:
            digest = check_key(key).digest
            if not isinstance(pin, bool):
                raise TypeError(f"pin must be a bool, got {type(pin).__name__} {pin!r}")
            prepared = prepare_tensors(tensors)
            meta_json = canonical_json(meta, "meta")
            if len(meta_json.encode("utf-8")) > MAX_META_BYTES:
                raise ValueError(f"meta is {len(meta_json)} bytes of JSON; keep it under {MAX_META_BYTES}")
            nbytes = sum(t.numel() * t.element_size() for t in prepared.values())
            victims: list[str] | None = None
            if nbytes > self._ram.budget:
                if pin or digest in self._ram.pinned or self._disk is None:
                    why = "there is no disk tier (root=None)" if self._disk is None else "it is pinned"
                    raise ValueError(f"entry {key} has {nbytes} bytes, over ram_bytes={self._ram.budget}, and {why}")
            else:
                victims = self._ram.victims(nbytes, replacing=digest)
                if victims is None:
                    raise ValueError(f"entry {key} ({nbytes} bytes) does not fit in ram_bytes={self._ram.budget}: "
                                     f"{self._ram.pinned_bytes(excluding=digest)} bytes are pinned; unpin some")
            if self._disk is not None:
                self._disk.write(digest, prepared, meta_json, nbytes, self._fp, self._tenant)
            if self._dev is not None:
                self._dev.remove(digest)
            if victims is None:
                self._ram.remove(digest)  # a stale copy of an older value
            else:
                for v in victims:
                    self._demote(v)
                self._ram.insert(digest, Entry(prepared, meta_json, nbytes))
                if pin:
                    self._ram.pinned.add(digest)
            if self._remote is not None and not self._remote.put(digest, prepared, meta_json, nbytes,
                                                                 self._fp, self._tenant):
                self._remote_errors += 1

    def get(self, key: ChunkKey) -> tuple[dict[str, Tensor], dict] | None:
        """`(tensors, meta)`, or None on a miss (absent, another owner's, failed verification and deleted, or a remote
        fault). Tensors are on the device when the device tier holds the entry, else on the CPU."""
        with self._mutex:
            digest = check_key(key).digest
            e = self._ram.get(digest)
            if e is not None:
                self._hits += 1
                if self._disk is not None:
                    self._disk.touch(digest)
                return self._deliver(digest, e)
            if self._disk is not None and (got := self._disk.load(digest, self._fp, self._tenant)) is not None:
                self._hits += 1
                tensors, rec = got
                e = Entry(tensors, rec.meta_json, rec.nbytes)
                if self._promote(digest, e):
                    return self._deliver(digest, e)
                return dict(e.tensors), json.loads(e.meta_json)  # disk-only: too big for RAM now
            if self._remote is not None and (e := self._remote_get(digest)) is not None:
                self._hits += 1
                if self._promote(digest, e):
                    return self._deliver(digest, e)
                self._to_disk(digest, e)
                return dict(e.tensors), json.loads(e.meta_json)  # too big for RAM now
            self._misses += 1
            return None

    def contains(self, key: ChunkKey) -> bool:
        """Whether get would find the entry (only get verifies checksums and remote parts); False on a remote fault."""
        with self._mutex:
            digest = check_key(key).digest
            return digest in self._ram or (
                self._disk is not None and self._disk.owned(digest, self._fp, self._tenant)) or (
                self._remote is not None and self._remote.contains(digest, self._fp, self._tenant))

    def pin(self, key: ChunkKey) -> None:
        """Keeps the entry in RAM until unpinned, loading it from disk or remote if needed. ValueError when it is not in
        the store or does not fit in RAM next to the other pins."""
        with self._mutex:
            digest = check_key(key).digest
            if digest not in self._ram:
                e = None
                if self._disk is not None and (got := self._disk.load(digest, self._fp, self._tenant)) is not None:
                    e = Entry(got[0], got[1].meta_json, got[1].nbytes)
                elif self._remote is not None:
                    e = self._remote_get(digest)
                if e is not None:
                    if not self._promote(digest, e):
                        raise ValueError(f"cannot pin {key}: {e.nbytes} bytes do not fit in ram_bytes="
                                         f"{self._ram.budget} with {self._ram.pinned_bytes()} bytes pinned")
            if digest not in self._ram:
                raise ValueError(f"cannot pin {key}: it is not in the store")
            self._ram.pinned.add(digest)

    def unpin(self, key: ChunkKey) -> None:
        """Lets the entry be evicted again (no-op when it is not pinned)."""
        with self._mutex:
            self._ram.pinned.discard(check_key(key).digest)

    def delete(self, key: ChunkKey) -> bool:
        """Removes the entry from every tier, remote included (never another owner's disk entry); True if any went."""
        with self._mutex:
            digest = check_key(key).digest
            removed = self._ram.remove(digest) is not None
            if self._dev is not None:
                self._dev.remove(digest)
            if self._disk is not None:
                removed = self._disk.delete(digest, self._fp, self._tenant) or removed
            if self._remote is not None:
                removed = self._remote.delete(digest) or removed
            return removed

    def tiers(self, key: ChunkKey) -> frozenset[str]:
        """Diagnostics: the tiers ("device", "ram", "disk", "remote") holding the entry now."""
        with self._mutex:
            digest = check_key(key).digest
            out = {"ram"} if digest in self._ram else set()
            if self._dev is not None and digest in self._dev:
                out.add("device")
            if self._disk is not None and self._disk.owned(digest, self._fp, self._tenant):
                out.add("disk")
            if self._remote is not None and self._remote.contains(digest, self._fp, self._tenant):
                out.add("remote")
            return frozenset(out)

    def stats(self) -> StoreStats:
        with self._mutex:
            dev, disk = self._dev, self._disk
            return StoreStats(
                hits=self._hits, misses=self._misses,
                device_bytes=dev.bytes if dev else 0, ram_bytes=self._ram.bytes, disk_bytes=disk.bytes if disk else 0,
                device_entries=len(dev.entries) if dev else 0, ram_entries=len(self._ram.entries),
                disk_entries=len(disk.index) if disk else 0,
                evictions=self._evictions + (disk.evictions if disk else 0), demotions=self._demotions,
                promotions=self._promotions,
                corrupt_dropped=(disk.corrupt_dropped if disk else 0) + self._remote_dropped,
                remote_hits=self._remote_hits, remote_misses=self._remote_misses, remote_errors=self._remote_errors,
                lease_waits=self._lease_waits, lease_hits=self._lease_hits, lease_takeovers=self._lease_takeovers)

    def check_integrity(self) -> None:
        """RuntimeError on any broken invariant: tiers over budget or miscounted, pins outside RAM, device entries
        outside RAM, misplaced tensors, the disk index versus its files."""
        with self._mutex:
            self._ram.check()
            if self._dev is not None:
                self._dev.check()
                if not set(self._dev.entries) <= set(self._ram.entries):
                    raise RuntimeError("device tier holds entries RAM does not; this indicates a bug")
            if self._disk is not None:
                self._disk.check()
            if min(self._hits, self._misses, self._evictions, self._demotions, self._promotions, self._remote_hits,
                   self._remote_misses, self._remote_errors, self._remote_dropped, self._lease_waits,
                   self._lease_hits, self._lease_takeovers) < 0 or self._lease_hits + self._lease_takeovers > self._lease_waits:
                raise RuntimeError("negative counter; this indicates a bug")

    # -- leases: an entry computed once across the processes sharing the store -------------------
    def try_lease(self, key: ChunkKey, ttl_s: float = LEASE_TTL_S) -> Lease | None:
        """A lease on `key` for `ttl_s` seconds, or None while another holder's lease has not lapsed. Held on the remote
        tier if any (a fault there grants tier "none", counted in remote_errors), else as a file in the disk root,
        else granted at once (RAM only)."""
        check_key(key)
        ttl = check_seconds(ttl_s, "ttl_s")
        with self._mutex:
            return self._acquire(key, new_token(), ttl)

    def release(self, lease: Lease) -> bool:
        """Gives `lease` back so a waiting worker takes over at once. False when it had lapsed (it may be another's;
        theirs is left alone) or on a remote fault (it then lapses on its own); True for RAM and "none" leases."""
        if not isinstance(lease, Lease):
            raise TypeError(f"lease must be a Lease from try_lease, got {type(lease).__name__}")
        with self._mutex:
            if lease.tier == "remote" and self._remote is not None:
                return self._remote.release_lease(lease.key.digest, lease.token)
            if lease.tier == "disk" and self._leases is not None:
                return self._leases.release(lease.key.digest, lease.token)
            return lease.tier in ("ram", "none")

    @contextmanager
    def lease(self, key: ChunkKey, ttl_s: float = LEASE_TTL_S) -> Iterator[Lease | None]:
        """`try_lease` as a context manager, released on leaving; yields None when another holder has the key."""
        held = self.try_lease(key, ttl_s)
        try:
            yield held
        finally:
            if held is not None:
                self.release(held)

    def get_or_compute(self, key: ChunkKey, compute: Callable[[], Mapping[str, Tensor]],
                       meta: Mapping[str, object] = _EMPTY, *, ttl_s: float = LEASE_TTL_S,
                       wait_s: float | None = None, poll_s: float = 0.05) -> Resolved:
        """The entry under `key`, computed at most once by the workers sharing this store. A hit returns how="hit".
        Else the lease holder runs `compute()` (names → tensors), puts it with `meta`, releases the lease and returns
        compute's own tensors (how="computed"); the others poll every `poll_s` seconds for its entry (how="waited")
        and compute themselves once the lease is released or lapses or `wait_s` (default ttl_s) passes. `ttl_s`
        should exceed the longest compute, else a second worker computes too. A remote fault never blocks or fails
        the call. Errors from compute or the put (ValueError over a budget) propagate after the lease is released."""
        check_key(key)
        if not callable(compute):
            raise TypeError(f"compute must be callable, got {type(compute).__name__}")
        ttl = check_seconds(ttl_s, "ttl_s")
        wait = check_seconds(wait_s, "wait_s", allow_none=True) or ttl
        poll = check_seconds(poll_s, "poll_s")
        meta_json = canonical_json(meta, "meta")  # a bad meta fails before the compute, not after
        hit = self.get(key)
        if hit is not None:
            return Resolved(hit[0], hit[1], "hit")
        token = new_token()
        with self._mutex:
            held = self._acquire(key, token, ttl)
            if held is None:
                self._lease_waits += 1
        waited = held is None
        deadline = time.monotonic() + wait
        while held is None:
            time.sleep(max(0.0, min(poll, deadline - time.monotonic())))
            if self.contains(key) and (hit := self.get(key)) is not None:
                break
            with self._mutex:
                held = self._acquire(key, token, ttl)
            if held is None and time.monotonic() >= deadline:
                break  # computed without the lease
        try:
            # Also a holder before us may have put the entry between our get and our lease.
            if hit is None and self.contains(key):
                hit = self.get(key)
            if hit is not None:
                if waited:
                    with self._mutex:
                        self._lease_hits += 1
                return Resolved(hit[0], hit[1], "waited" if waited else "hit")
            if waited:
                with self._mutex:
                    self._lease_takeovers += 1
            out = compute()
            if not isinstance(out, Mapping):
                raise TypeError(f"compute must return a mapping of names to tensors, got {type(out).__name__}")
            self.put(key, out, meta)
        finally:
            if held is not None:
                self.release(held)
        return Resolved(dict(out), json.loads(meta_json), "computed")

    # -- internals ---------------------------------------------------------------------------------
    def _acquire(self, key: ChunkKey, token: str, ttl: float) -> Lease | None:
        """try_lease's work, under the store's mutex."""
        if self._remote is not None:
            got = self._remote.try_lease(key.digest, token, ttl)
            if got == "held":
                return None
            if got == "error":
                self._remote_errors += 1
            return Lease(key, token, "remote" if got == "granted" else "none", time.time() + ttl)
        if self._leases is not None:
            expires = self._leases.try_acquire(key.digest, token, ttl)
            return None if expires is None else Lease(key, token, "disk", expires)
        return Lease(key, token, "ram", time.time() + ttl)

    def _remote_get(self, digest: str) -> Entry | None:
        """The verified remote entry, or None (counted as a remote miss or error)."""
        if self._remote is None:
            raise RuntimeError("remote get without a remote tier; this indicates a bug")
        status, e = self._remote.get(digest, self._fp, self._tenant)
        if status == "hit":
            if e is None:
                raise RuntimeError("remote hit without an entry; this indicates a bug")
            self._remote_hits += 1
            return e
        if status == "error":
            self._remote_errors += 1
        else:
            self._remote_misses += 1
            self._remote_dropped += status in ("corrupt", "rejected")
        return None

    def _to_disk(self, digest: str, e: Entry) -> None:
        """Keeps a remote hit too big for RAM on disk, when there is one and it fits there."""
        if self._disk is None or self._disk.owned(digest, self._fp, self._tenant):
            return
        try:
            self._disk.write(digest, e.tensors, e.meta_json, e.nbytes, self._fp, self._tenant)
        except ValueError:
            return  # over disk_bytes (or the digest is held by another owner): served, not kept
        except OSError as exc:
            warnings.warn(f"not keeping remote hit {digest[:16]} on disk: writing it failed: {exc}", stacklevel=3)
            return
        self._promotions += 1

    def _promote(self, digest: str, e: Entry) -> bool:
        """Disk or remote → RAM when it fits next to the pins (moving LRU entries out); False otherwise."""
        if e.nbytes > self._ram.budget or (victims := self._ram.victims(e.nbytes, replacing=digest)) is None:
            return False
        for v in victims:
            self._demote(v)
        self._ram.insert(digest, e)
        self._promotions += 1
        return True

    def _demote(self, digest: str) -> None:
        """Moves an unpinned entry out of RAM and the device: to disk when there is a root, else dropped."""
        if digest in self._ram.pinned:
            raise RuntimeError(f"demoting pinned entry {digest[:16]}; this indicates a bug")
        e = self._ram.remove(digest)
        if e is None:
            raise RuntimeError(f"demoting {digest[:16]}, which RAM does not hold; this indicates a bug")
        if self._dev is not None:
            self._dev.remove(digest)
        if self._disk is None:
            self._evictions += 1
            return
        if not self._disk.owned(digest, self._fp, self._tenant):
            try:
                self._disk.write(digest, e.tensors, e.meta_json, e.nbytes, self._fp, self._tenant)
            except (OSError, ValueError) as exc:
                warnings.warn(f"dropping {digest[:16]} from RAM: writing it to disk failed: {exc}", stacklevel=3)
                self._evictions += 1
                return
        else:
            self._disk.touch(digest)
        self._demotions += 1

    def _deliver(self, digest: str, e: Entry) -> tuple[dict[str, Tensor], dict]:
        """The RAM entry, or its device copy (made if it fits the device budget)."""
        dev = self._dev
        if dev is not None:
            d = dev.get(digest)
            if d is None and e.nbytes <= dev.budget:
                victims = dev.victims(e.nbytes)
                if victims is None:
                    raise RuntimeError("device tier has pins; this indicates a bug")
                try:
                    copy = {n: t.to(dev.device) for n, t in e.tensors.items()}
                except torch.OutOfMemoryError:
                    copy = None
                if copy is not None:
                    for v in victims:
                        dev.remove(v)
                        self._demotions += 1
                    d = Entry(copy, e.meta_json, e.nbytes)
                    dev.insert(digest, d)
                    self._promotions += 1
            if d is not None:
                return dict(d.tensors), json.loads(e.meta_json)
        return dict(e.tensors), json.loads(e.meta_json)
