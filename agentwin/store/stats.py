"""What a `ChunkStore` counted since it was opened and what each tier holds now; what a remote
tier counted, and the warning it gives when it cannot be reached."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters since the store was opened, and current tier occupancy.

    hits / misses: `get` calls served / not served. *_bytes, *_entries: what each tier holds now
    (RAM and device: tensor bytes; disk: file bytes, data + sidecar, of every entry under root).
    evictions: entries deleted for budget from their last tier (disk LRU deletions; RAM drops
    without a root or when the disk write failed). demotions: RAM entries moved out to disk, and
    device copies dropped for budget (their RAM copy stays). promotions: disk → RAM, remote → RAM
    (or → disk, for an entry too big for RAM) and RAM → device copies made by get/pin.
    corrupt_dropped: disk entries deleted because their sidecar or data failed verification, and
    remote entries deleted because a part was missing or cut short, a check failed, or the
    manifest named another owner or had no valid MAC.
    remote_hits / remote_misses: gets that reached the remote tier (after RAM and disk missed)
    and were served / found no valid entry. remote_errors: remote gets and write-backs that
    failed on a fault (server down, refused, timeout, error) or were skipped during its back-off.
    All three stay 0 without a remote tier.
    lease_waits: get_or_compute calls that found another holder's lease on their key and waited.
    lease_hits: those served by that holder's entry (a compute this store did not run).
    lease_takeovers: those that computed after all: the holder's lease lapsed or was released
    with no entry, or wait_s ran out.
    """

    hits: int
    misses: int
    device_bytes: int
    ram_bytes: int
    disk_bytes: int
    device_entries: int
    ram_entries: int
    disk_entries: int
    evictions: int
    demotions: int
    promotions: int
    corrupt_dropped: int
    remote_hits: int = 0
    remote_misses: int = 0
    remote_errors: int = 0
    lease_waits: int = 0
    lease_hits: int = 0
    lease_takeovers: int = 0


class RemoteWarning(RuntimeWarning):
    """The remote tier could not be used for a while; the store carried on with its local tiers."""


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """Counters of one RedisTier since it was created (all stores using it together).

    hits: verified entries served. absent: gets that found no entry (or raced a rewrite).
    corrupt: entries deleted because a part was missing or cut short, or the checksum, parse or
    tensor specs failed. rejected: entries deleted because their manifest names another
    fingerprint or tenant, or (with a secret) carries no valid MAC. errors: operations that failed
    on a fault or were skipped during the back-off. writes: entries published.
    """

    hits: int
    absent: int
    corrupt: int
    rejected: int
    errors: int
    writes: int
