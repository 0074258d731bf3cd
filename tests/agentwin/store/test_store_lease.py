"""Leases and `get_or_compute`: an entry computed once by the processes sharing a store (a disk
root, or a real redis-server started here), an abandoned lease taken over after its ttl, a
released lease taken over at once, a lapsed holder unable to release its successor's lease, a
remote fault that computes instead of blocking, RAM-only stores, and the encoder cache."""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest

from agentwin.store import ChunkStore, EncoderCache, Lease, RedisTier, RemoteWarning, open_store
from tests.agentwin.store._support import FP, Server, child, free_port, key, same, value

NUMEL = 5000


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "redis").start()
    yield s
    s.stop()


@pytest.fixture(params=["disk", "redis"])
def location(request, tmp_path):
    """A shared location: a disk root, or a redis-server started for the test."""
    if request.param == "disk":
        yield str(tmp_path / "root")
        return
    s = Server(tmp_path / "redis").start()
    yield s.url
    s.stop()


def _open(location: str) -> ChunkStore:
    return open_store(location, model_fingerprint=FP, timeout_s=5.0)


# A contender: opens the store, says "ready", waits for the file argv[2], then asks for entry 1,
# whose compute takes 0.4 s; prints how it got it, whether the value is right, its lease counters.
CONTENDER = """
import os, sys, time
from agentwin.store import open_store
from tests.agentwin.store._support import FP, key, same, value
location, go, numel = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = open_store(location, model_fingerprint=FP, timeout_s=5.0)
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.002)
def compute():
    time.sleep(0.4)
    return value(1, numel)
got = s.get_or_compute(key(1), compute, {"i": 1})
st = s.stats()
print(got.how, same(got.tensors, value(1, numel)) and got.meta == {"i": 1}, st.lease_waits, st.lease_hits,
      st.lease_takeovers, flush=True)
"""


@pytest.mark.slow
def test_two_processes_compute_an_entry_once(location, tmp_path):
    """Three workers ask for the same new entry at the same moment: a child process and two
    threads here, each on its own store object. One computes it (0.4 s), the other two wait for
    its entry and get it bit-exact, counted as lease hits."""
    go = tmp_path / "go"
    proc = child(CONTENDER, location, go, NUMEL, wait=False)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    stores = [_open(location) for _ in range(2)]
    computes = []

    def compute():
        computes.append(1)
        time.sleep(0.4)
        return value(1, NUMEL)

    got = [None, None]
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, stores[i].get_or_compute(key(1), compute, {"i": 1})))
               for i in range(2)]
    go.touch()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    lines = [f"{g.how} {same(g.tensors, value(1, NUMEL)) and g.meta == {'i': 1}}" for g in got]
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    how, ok, waits, hits, takeovers = out.split()
    lines.append(f"{how} {ok}")
    assert (int(waits), int(hits), int(takeovers)) == ((1, 1, 0) if how == "waited" else (0, 0, 0))
    assert sorted(lines) == ["computed True", "waited True", "waited True"], lines
    assert len(computes) == sum(g.how == "computed" for g in got)
    for g, s in zip(got, stores):
        st = s.stats()
        assert (st.lease_waits, st.lease_hits, st.lease_takeovers) == ((1, 1, 0) if g.how == "waited" else (0, 0, 0))
    assert stores[0].try_lease(key(1)) is not None  # released by its holder, nothing left behind
    stores[0].check_integrity()


def test_an_abandoned_lease_is_taken_over_after_its_ttl(location):
    """A worker takes the lease and never releases it (it died: nothing else of it remains in
    the store): the next worker waits until the lease lapses, then computes and stores it."""
    ttl = 1.0
    dead = _open(location).try_lease(key(1), ttl_s=ttl)
    t_dead = time.monotonic()
    assert dead is not None and dead.tier == ("remote" if "://" in location else "disk")
    s = _open(location)
    assert s.try_lease(key(1)) is None  # the dead worker's lease still holds
    got = s.get_or_compute(key(1), lambda: value(1, NUMEL), {"i": 1}, poll_s=0.02)
    waited = time.monotonic() - t_dead
    assert got.how == "computed" and same(got.tensors, value(1, NUMEL)) and got.meta == {"i": 1}
    assert ttl - 0.1 <= waited < ttl + 1.0, f"waited {waited:.2f} s on a lease of {ttl} s"
    st = s.stats()
    assert (st.lease_waits, st.lease_hits, st.lease_takeovers) == (1, 0, 1)
    got = _open(location).get(key(1))  # stored for the others
    assert got is not None and same(got[0], value(1, NUMEL))
    assert s.try_lease(key(1)) is not None  # and the taken-over lease was released
    if "://" not in location:
        s.check_integrity()


def test_a_released_lease_is_taken_over_at_once(location):
    """The holder's compute fails (it releases with no entry): the waiter computes at once, long
    before the lease's ttl."""
    holder, waiter = _open(location), _open(location)
    lease = holder.try_lease(key(2), ttl_s=30.0)
    assert isinstance(lease, Lease) and lease.tier == ("remote" if "://" in location else "disk")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("got", waiter.get_or_compute(
        key(2), lambda: value(2, NUMEL), poll_s=0.02)))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # waiting on the holder
    assert holder.release(lease)
    t.join(timeout=10)
    assert not t.is_alive() and time.monotonic() - t0 < 3.0
    assert result["got"].how == "computed" and same(result["got"].tensors, value(2, NUMEL))
    st = waiter.stats()
    assert (st.lease_waits, st.lease_hits, st.lease_takeovers) == (1, 0, 1)


def test_a_lapsed_holder_cannot_release_its_successors_lease(location):
    a, b, c = _open(location), _open(location), _open(location)
    first = a.try_lease(key(3), ttl_s=0.2)
    assert first is not None and b.try_lease(key(3), ttl_s=30.0) is None
    time.sleep(0.3)
    second = b.try_lease(key(3), ttl_s=30.0)  # taken over
    assert second is not None and second.token != first.token
    assert not a.release(first)  # token check: a's lease had lapsed
    assert c.try_lease(key(3)) is None  # b still holds it
    assert b.release(second) and c.try_lease(key(3)) is not None
    with a.lease(key(4)) as held:
        assert held is not None and b.try_lease(key(4)) is None
    assert b.try_lease(key(4)) is not None  # released on leaving the block


def test_encoder_cache_runs_the_tower_once_across_stores(location):
    """Two stores on one location (two workers), each with its EncoderCache, encode one image at
    the same time: the tower runs once; the other gets its outputs."""
    caches = [EncoderCache(_open(location)) for _ in range(2)]
    k = caches[0].key(b"\x89PNG same pixels", {"max_pixels": 1024})
    runs = []
    barrier = threading.Barrier(2)

    def tower():
        runs.append(1)
        time.sleep(0.3)
        return {"embeds": value(9, 256)["x"].reshape(16, 16)}

    def encode(cache):
        barrier.wait()
        return cache.get_or_compute(k, tower, {"modality": "image"})

    out = [None, None]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, encode(caches[i]))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(runs) == 1 and all(same(o, out[0]) for o in out)
    assert sorted((c.computed, c.reused) for c in caches) == [(0, 1), (1, 0)]
    assert sum(c.store.stats().lease_hits for c in caches) == 1


def test_ram_only_leases_always_grant_and_compute_once():
    s = ChunkStore(None, model_fingerprint=FP)
    a, b = s.try_lease(key(5)), s.try_lease(key(5))
    assert a is not None and b is not None and a.tier == b.tier == "ram" and a.token != b.token
    assert s.release(a) and s.release(b)
    calls = []
    first = s.get_or_compute(key(5), lambda: calls.append(1) or value(5, 10), {"i": 5})
    again = s.get_or_compute(key(5), lambda: calls.append(1) or value(5, 10), {"i": 5})
    assert (first.how, again.how, len(calls)) == ("computed", "hit", 1)
    assert same(again.tensors, value(5, 10)) and again.meta == first.meta == {"i": 5}
    st = s.stats()
    assert (st.lease_waits, st.lease_hits, st.lease_takeovers, st.hits, st.misses) == (0, 0, 0, 1, 1)


def test_a_remote_fault_computes_instead_of_blocking():
    """Nothing listens on the remote tier's port: get_or_compute computes at once (its lease is
    granted uncoordinated, tier "none"), counts the faults, and warns once."""
    s = open_store(f"redis://127.0.0.1:{free_port()}/0", model_fingerprint=FP, timeout_s=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        got = s.get_or_compute(key(6), lambda: value(6, 100))
        assert time.monotonic() - t0 < 3 * 0.5 + 1
        lease = s.try_lease(key(7))
    assert got.how == "computed" and same(got.tensors, value(6, 100))
    assert lease is not None and lease.tier == "none" and s.release(lease)
    assert s.stats().remote_errors >= 3 and s.get(key(6)) is not None  # kept locally
    assert len([w for w in caught if issubclass(w.category, RemoteWarning)]) == 1


def test_get_or_compute_errors_propagate_and_release_the_lease(tmp_path):
    s = ChunkStore(tmp_path, model_fingerprint=FP)
    with pytest.raises(TypeError, match="compute must be callable"):
        s.get_or_compute(key(8), value(8, 10))
    with pytest.raises(ValueError, match="ttl_s must be a finite number of seconds > 0"):
        s.get_or_compute(key(8), lambda: value(8, 10), ttl_s=0)
    with pytest.raises(TypeError, match="meta"):
        s.get_or_compute(key(8), lambda: pytest.fail("computed despite a bad meta"), {"x": object()})
    with pytest.raises(TypeError, match="compute must return a mapping"):
        s.get_or_compute(key(8), lambda: [1, 2])

    def fails():
        raise RuntimeError("the encoder crashed")

    with pytest.raises(RuntimeError, match="the encoder crashed"):
        s.get_or_compute(key(8), fails)
    assert s.try_lease(key(8)) is not None and s.get(key(8)) is None  # released, nothing stored
    with pytest.raises(TypeError, match="lease must be a Lease"):
        s.release("a token")


def test_lapsed_lease_files_are_collected_and_live_ones_kept(tmp_path):
    s = ChunkStore(tmp_path, model_fingerprint=FP)
    old, live = s.try_lease(key(10), ttl_s=30.0), s.try_lease(key(11), ttl_s=30.0)
    assert old is not None and live is not None
    lapsed_at = time.time() - 120  # two minutes past its expiry (the file's mtime is its expiry)
    os.utime(tmp_path / f"{key(10).digest}.lease", (lapsed_at, lapsed_at))
    s.put(key(12), value(12, 10))  # a write re-scans the root under the exclusive lock
    names = set(os.listdir(tmp_path))
    assert f"{key(10).digest}.lease" not in names and f"{key(11).digest}.lease" in names
    s.check_integrity()
    assert ChunkStore(tmp_path, model_fingerprint=FP).try_lease(key(11)) is None  # still held
    assert s.release(live) and not s.release(old)


def test_redis_lease_key_shares_the_entrys_hash_slot(server):
    tier = RedisTier(server.url, timeout_s=5.0)
    d = key(13).digest
    assert tier.lease_key(d) == f"agentwin:{{{d}}}:l"
    assert tier.try_lease(d, "tok-a", 5.0) == "granted" and tier.try_lease(d, "tok-b", 5.0) == "held"
    assert 0 < server.client().pttl(tier.lease_key(d)) <= 5000  # expires on its own
    assert not tier.release_lease(d, "tok-b") and server.client().get(tier.lease_key(d)) == b"tok-a"
    assert tier.release_lease(d, "tok-a") and server.client().get(tier.lease_key(d)) is None
