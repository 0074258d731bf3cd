"""The disk tier: per entry one safetensors data file `<digest>.<sha16>.safetensors` and one JSON sidecar
`<digest>.json` (the commit record), flat under a root with `.lock` (flock), `.tmp.*` (writes in progress) and
`<digest>.lease` files. Writes are crash-safe and every load is verified; a bad entry is deleted and read as a miss."""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import re
import secrets
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from agentwin.store.tiers import DTYPES, CorruptEntryWarning

FORMAT = "agentwin.store/1"
LEASE_FORMAT = "agentwin.store.lease/1"
LEASE_GC_S = 60.0  # lease files this long past their expiry are deleted by refresh
LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp."
_SIDECAR = re.compile(r"([0-9a-f]{64})\.json")
_DATA = re.compile(r"([0-9a-f]{64})\.([0-9a-f]{16})\.safetensors")
_LEASE = re.compile(r"([0-9a-f]{64})\.lease")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Record:
    """One entry on disk, as parsed from its sidecar."""

    fingerprint: str
    tenant: str
    file: str
    data_size: int
    side_size: int
    sha256: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype name, shape)
    nbytes: int
    meta_json: str
    created: float
    sig: tuple[int, int, int]  # sidecar (st_ino, st_size, st_ctime_ns): re-read when it changes

    @property
    def size(self) -> int:
        return self.data_size + self.side_size


def _parse(raw: bytes, digest: str, sig: tuple[int, int, int]) -> Record | None:
    """The sidecar's Record, or None when it is malformed in any way."""
    try:
        o = json.loads(raw)
        specs = {n: (s["dtype"], tuple(s["shape"])) for n, s in o["tensors"].items()}
        ok = (o["format"] == FORMAT and o["digest"] == digest and isinstance(o["model_fingerprint"], str)
              and isinstance(o["tenant"], str) and isinstance(o["sha256"], str) and _HEX64.fullmatch(o["sha256"])
              and o["file"] == f"{digest}.{o['sha256'][:16]}.safetensors"
              and all(type(o[f]) is int and o[f] >= 0 for f in ("size", "nbytes"))
              and isinstance(o["meta"], dict) and isinstance(o["created"], (int, float))
              and all(d in DTYPES and all(type(x) is int and x >= 0 for x in sh) for d, sh in specs.values()))
        if not ok:
            return None
        meta_json = json.dumps(o["meta"], sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return Record(o["model_fingerprint"], o["tenant"], o["file"], o["size"], len(raw), o["sha256"], specs,
                      o["nbytes"], meta_json, float(o["created"]), sig)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class DiskTier:
    """Entries under `root` within `budget` bytes (data + sidecar files), LRU first in `index`. The index covers every
    entry in the directory, whatever its owner (all share the budget); callers check ownership. Processes sharing
    a root should use one budget."""

    def __init__(self, root: Path, budget: int) -> None:
        self.root, self.budget = root, budget
        root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        self._lock_pid = os.getpid()  # a forked child shares the fd's lock: it reopens its own
        self._lock_mode: int | None = None
        self.index: OrderedDict[str, Record] = OrderedDict()
        self.bytes = 0
        self.evictions = self.corrupt_dropped = 0
        self._warned: set[str] = set()  # digests a CorruptEntryWarning was issued for
        with self.locked(exclusive=True):
            self.refresh()

    def close(self) -> None:
        if getattr(self, "_lock_fd", -1) >= 0 and self._lock_pid == os.getpid():
            os.close(self._lock_fd)
        self._lock_fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    # -- locking and low-level file operations ---------------------------------------------------
    @contextmanager
    def locked(self, exclusive: bool) -> Iterator[None]:
        """flock on `.lock`; re-entrant inside an exclusive hold; RuntimeError when asked for inside a shared hold."""
        if self._lock_pid != os.getpid():
            self._lock_fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            self._lock_pid, self._lock_mode = os.getpid(), None
        if self._lock_fd < 0:
            raise ValueError("this ChunkStore was closed; open a new one")
        if self._lock_mode == fcntl.LOCK_EX:
            yield
            return
        if self._lock_mode is not None:
            raise RuntimeError("disk lock requested while a shared lock is held; this indicates a bug")
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        fcntl.flock(self._lock_fd, mode)
        self._lock_mode = mode
        try:
            yield
        finally:
            self._lock_mode = None
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _require_ex(self) -> None:
        if self._lock_mode != fcntl.LOCK_EX:
            raise RuntimeError("disk mutation without the exclusive lock; this indicates a bug")

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _atomic_write(self, name: str, data: bytes) -> None:
        """Writes `name` via a temp file in root, fsynced, os.replace'd, then fsyncs the directory."""
        tmp = self.root / f"{TMP_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._fsync_dir()

    def _corrupt(self, digest: str, why: str) -> None:
        """Counts a corrupt entry (already deleted) and warns once per digest."""
        self.corrupt_dropped += 1
        if digest not in self._warned:
            self._warned.add(digest)
            warnings.warn(f"disk tier {self.root}: entry {digest} failed verification ({why}); deleted and read "
                          "as a miss, so it is recomputed", CorruptEntryWarning, stacklevel=4)

    def _drop(self, digest: str) -> None:
        """Deletes the sidecar (the commit record) before the data files, so no sidecar names a missing file."""
        self._require_ex()
        (self.root / f"{digest}.json").unlink(missing_ok=True)
        for p in self.root.glob(f"{digest}.*.safetensors"):
            p.unlink(missing_ok=True)
        self._fsync_dir()
        self._unindex(digest)

    def _index(self, digest: str, rec: Record) -> None:
        self._unindex(digest)
        self.index[digest] = rec
        self.bytes += rec.size

    def _unindex(self, digest: str) -> None:
        old = self.index.pop(digest, None)
        if old is not None:
            self.bytes -= old.size

    def _read_sidecar(self, digest: str) -> tuple[str, Record | None]:
        """("absent" | "corrupt" | "ok", record), read from the directory, not the index."""
        path = self.root / f"{digest}.json"
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                raw = f.read()
        except FileNotFoundError:
            return "absent", None
        rec = _parse(raw, digest, (st.st_ino, st.st_size, st.st_ctime_ns))
        return ("ok", rec) if rec is not None else ("corrupt", None)

    # -- index maintenance -----------------------------------------------------------------------
    def refresh(self) -> None:
        """Under the exclusive lock: re-reads changed sidecars into the index and deletes garbage (malformed sidecars or
        ones whose data file is gone, counted as corrupt; temp files; unnamed data files; lease files long lapsed)."""
        self._require_ex()
        names = set(os.listdir(self.root))
        seen: dict[str, Record] = {}
        new: list[tuple[int, str]] = []
        changed = False
        for name in names:
            m = _SIDECAR.fullmatch(name)
            if m is None:
                continue
            digest = m[1]
            try:
                st = os.stat(self.root / name)
            except FileNotFoundError:
                continue
            sig = (st.st_ino, st.st_size, st.st_ctime_ns)
            old = self.index.get(digest)
            if old is not None and old.sig == sig:
                rec: Record | None = old
            else:
                status, rec = self._read_sidecar(digest)
            if rec is None or rec.file not in names:  # malformed, or its data file is gone
                (self.root / name).unlink(missing_ok=True)
                self._corrupt(digest, "malformed sidecar" if rec is None else "data file missing")
                changed = True
                continue
            seen[digest] = rec
            if old is None:
                new.append((st.st_mtime_ns, digest))
            elif old is not rec:
                self.index[digest] = rec  # keeps its LRU position
                self.bytes += rec.size - old.size
        for digest in [d for d in self.index if d not in seen]:
            self._unindex(digest)
        for _, digest in sorted(new):
            self._index(digest, seen[digest])
        wanted = {r.file for r in seen.values()}
        stale_before = time.time() - LEASE_GC_S
        for name in names:
            if name.startswith(TMP_PREFIX) or (_DATA.fullmatch(name) and name not in wanted):
                (self.root / name).unlink(missing_ok=True)
                changed = True
            elif _LEASE.fullmatch(name):
                try:
                    lapsed = os.stat(self.root / name).st_mtime < stale_before  # mtime = its expiry
                except FileNotFoundError:
                    continue
                if lapsed:
                    (self.root / name).unlink(missing_ok=True)
        if changed:
            self._fsync_dir()

    # -- entry operations ------------------------------------------------------------------------
    def write(self, digest: str, tensors: dict[str, torch.Tensor], meta_json: str, nbytes: int,
              fingerprint: str, tenant: str) -> None:
        """Commits one entry (replacing this owner's entry under `digest`), deleting LRU entries until it fits.
        ValueError, changing nothing, when it exceeds the budget or the digest is held by another fingerprint/tenant."""
        blob = safetensors.torch.save(tensors)
        sha = hashlib.sha256(blob).hexdigest()
        now = time.time()
        side = {"format": FORMAT, "digest": digest, "model_fingerprint": fingerprint, "tenant": tenant,
                "file": f"{digest}.{sha[:16]}.safetensors", "size": len(blob), "sha256": sha,
                "tensors": {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                            for n, t in tensors.items()},
                "nbytes": nbytes, "meta": json.loads(meta_json), "created": now, "last_used": now}
        if len(blob) > self.budget:  # cheap early refusal; the exact check (with the sidecar) is below
            raise ValueError(f"entry {digest[:16]} takes over {len(blob)} bytes on disk, over disk_bytes={self.budget}")
        with self.locked(exclusive=True):
            self.refresh()
            status, old = self._read_sidecar(digest)
            if old is not None and (old.fingerprint, old.tenant) != (fingerprint, tenant):
                raise ValueError(f"key digest {digest[:16]} is held on disk by another model fingerprint or "
                                 "tenant; ChunkKey.of never collides across them, so this key was forged")
            if old is not None:
                side["created"] = old.created
            side_raw = json.dumps(side, sort_keys=True, ensure_ascii=False).encode("utf-8")
            size = len(blob) + len(side_raw)
            if size > self.budget:
                raise ValueError(f"entry {digest[:16]} takes {size} bytes on disk, over disk_bytes={self.budget}")
            held = self.bytes - (self.index[digest].size if digest in self.index else 0)
            for victim in list(self.index):
                if held + size <= self.budget:
                    break
                if victim != digest:
                    held -= self.index[victim].size
                    self._drop(victim)
                    self.evictions += 1
            if held + size > self.budget:
                raise RuntimeError("disk eviction could not make room; this indicates a bug")
            self._atomic_write(side["file"], blob)
            self._atomic_write(f"{digest}.json", side_raw)
            if old is not None and old.file != side["file"]:
                (self.root / old.file).unlink(missing_ok=True)
            status, rec = self._read_sidecar(digest)
            if rec is None:
                raise RuntimeError(f"sidecar of {digest[:16]} unreadable right after writing; this indicates a bug")
            self._index(digest, rec)

    def _try_load(self, digest: str, fingerprint: str, tenant: str
                  ) -> tuple[str, Record | None, dict[str, torch.Tensor] | None, str]:
        """("absent" | "foreign" | "corrupt" | "ok", record, tensors, what failed); verifies size, sha256, names, dtypes
        and shapes."""
        status, rec = self._read_sidecar(digest)
        if rec is None:
            return status, None, None, "malformed sidecar"
        if (rec.fingerprint, rec.tenant) != (fingerprint, tenant):
            return "foreign", rec, None, ""
        path = self.root / rec.file
        try:
            # Hashed through a read-only mmap so the file is not copied into this process before parsing.
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != rec.data_size or size == 0:
                    return "corrupt", rec, None, f"data file has {size} bytes, its sidecar says {rec.data_size}"
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                    if hashlib.sha256(view).hexdigest() != rec.sha256:
                        return "corrupt", rec, None, "sha256 of the data file differs from its sidecar's"
        except FileNotFoundError:
            return "corrupt", rec, None, "data file missing"
        try:
            tensors = safetensors.torch.load_file(str(path))
        except (safetensors.SafetensorError, ValueError, TypeError):
            # Matches its checksum yet does not parse: written wrong, so corrupt. Memory and I/O errors propagate.
            return "corrupt", rec, None, "data file does not parse as safetensors"
        got = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}
        if got != rec.tensors or sum(t.numel() * t.element_size() for t in tensors.values()) != rec.nbytes:
            return "corrupt", rec, None, "tensor names, dtypes or shapes differ from the sidecar's"
        return "ok", rec, tensors, ""

    def load(self, digest: str, fingerprint: str, tenant: str) -> tuple[dict[str, torch.Tensor], Record] | None:
        """The verified entry (marked used), or None: absent, another owner's, or corrupt (then deleted, counted in
        `corrupt_dropped` and warned about once per digest with a CorruptEntryWarning)."""
        with self.locked(exclusive=False):
            status, rec, tensors, _ = self._try_load(digest, fingerprint, tenant)
        if status == "corrupt":
            with self.locked(exclusive=True):  # re-check: another process may have replaced it
                status, rec, tensors, why = self._try_load(digest, fingerprint, tenant)
                if status == "corrupt":
                    self._drop(digest)
                    self._corrupt(digest, why)
        if status == "absent":
            self._unindex(digest)
        if status != "ok" or rec is None or tensors is None:
            return None
        if self.index.get(digest) != rec:
            self._index(digest, rec)
        self.touch(digest, persist=True)
        return tensors, rec

    def owned(self, digest: str, fingerprint: str, tenant: str) -> bool:
        """Whether a sidecar of this owner names an existing data file (no checksum)."""
        _, rec = self._read_sidecar(digest)
        return (rec is not None and (rec.fingerprint, rec.tenant) == (fingerprint, tenant)
                and (self.root / rec.file).exists())

    def delete(self, digest: str, fingerprint: str, tenant: str) -> bool:
        """Deletes the entry if this owner's (or malformed); never another owner's."""
        with self.locked(exclusive=True):
            status, rec = self._read_sidecar(digest)
            if status == "absent" or (rec is not None and (rec.fingerprint, rec.tenant) != (fingerprint, tenant)):
                if status == "absent":
                    self._unindex(digest)
                return False
            self._drop(digest)
            return True

    def touch(self, digest: str, persist: bool = False) -> None:
        """Marks `digest` most recently used here; with `persist`, also bumps its sidecar's mtime (the shared clock)."""
        if digest in self.index:
            self.index.move_to_end(digest)
        if persist:
            try:
                os.utime(self.root / f"{digest}.json")
            except FileNotFoundError:
                pass

    def check(self) -> None:
        """RuntimeError when the directory and the index disagree or the budget is exceeded (after a refresh)."""
        with self.locked(exclusive=True):
            self.refresh()
            names = set(os.listdir(self.root))
            total = 0
            for digest, rec in self.index.items():
                for name, want in ((f"{digest}.json", rec.side_size), (rec.file, rec.data_size)):
                    try:
                        size = os.stat(self.root / name).st_size
                    except FileNotFoundError:
                        raise RuntimeError(f"disk index names missing file {name}; this indicates a bug") from None
                    if size != want:
                        raise RuntimeError(f"{name} is {size} bytes, its sidecar says {want}; this indicates a bug")
                total += rec.size
            if total != self.bytes or total > self.budget:
                raise RuntimeError(f"disk holds {total} bytes, counts {self.bytes}, budget {self.budget}; "
                                   "this indicates a bug")
            indexed = {f"{d}.json" for d in self.index} | {r.file for r in self.index.values()}
            stray = {n for n in names if n.startswith(TMP_PREFIX) or _SIDECAR.fullmatch(n) or _DATA.fullmatch(n)}
            if stray - indexed:
                raise RuntimeError(f"unindexed store files {sorted(stray - indexed)[:3]}; this indicates a bug")
