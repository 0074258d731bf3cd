"""Counters of a `ChunkStore` and of a `RedisTier`, and the warning a remote tier gives when it cannot be reached."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters since the store was opened, and what each tier holds now. hits / misses: `get` calls served / not.
    *_bytes, *_entries: held now (RAM, device: tensor bytes; disk: data + sidecar file bytes of every entry under
    root). evictions: entries deleted for budget from their last tier. demotions: RAM entries moved to disk, and
    device copies dropped for budget. promotions: copies made by get/pin (disk or remote → RAM, remote → disk,
    RAM → device). corrupt_dropped: disk and remote entries deleted on failing verification (remote: also another
    owner or no valid MAC). remote_hits / remote_misses: gets that reached the remote tier, served / not;
    remote_errors: remote gets and write-backs lost to a fault or the back-off (all three 0 without a remote
    tier). lease_waits: get_or_compute calls that found the key leased and waited; lease_hits: those served by
    the holder's entry; lease_takeovers: those that computed after all."""

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
    """Counters of one RedisTier since it was created (all stores using it together): hits (verified entries
    served), absent, corrupt / rejected (entries deleted: a failed check / another owner or no valid MAC),
    errors (faults and back-off skips), writes (entries published)."""

    hits: int
    absent: int
    corrupt: int
    rejected: int
    errors: int
    writes: int
