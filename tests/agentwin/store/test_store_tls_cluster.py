"""The remote tier against the deployments it claims, each started here: a redis-server that only
speaks TLS (a CA and a server certificate made with openssl), and a local Redis Cluster of three
nodes (`redis-cli --cluster create`) reached with `?cluster=1`: entries across slots, leases,
a corrupt part, and a node SIGKILLed mid-run."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

from agentwin.store import ChunkStore, CorruptEntryWarning, RedisTier, RemoteWarning, open_store
from tests.agentwin.store._support import FP, Cluster, Server, key, make_certs, same, value

NUMEL = 20_000  # 80 KB of float32: 5 parts of 16 KiB


def _warnings(caught, category) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, category)]


def test_tls_server_round_trip_and_certificate_checks(tmp_path):
    certs = make_certs(tmp_path / "certs")
    server = Server(tmp_path / "redis", tls=certs).start()  # --port 0: no plaintext port at all
    try:
        url = server.url
        assert url.startswith("rediss://") and f"ssl_ca_certs={certs['ca']}" in url
        writer = open_store(url, model_fingerprint=FP, secret=b"s", timeout_s=5.0)
        writer.put(key(1), value(1, NUMEL), {"i": 1})
        assert writer.stats().remote_errors == 0
        reader = open_store(url, model_fingerprint=FP, secret=b"s", timeout_s=5.0)
        got = reader.get(key(1))
        assert got is not None and same(got[0], value(1, NUMEL)) and got[1] == {"i": 1}
        assert reader.stats().remote_hits == 1 and reader.tiers(key(1)) == {"ram", "remote"}
        assert server.client().exists(f"agentwin:{{{key(1).digest}}}:m") == 1
        assert reader.get_or_compute(key(2), lambda: value(2, 10)).how == "computed"
        # Without our CA the server's certificate is not trusted; plaintext to a TLS port fails:
        # misses, counted and warned about, never an exception.
        for bad in (url.split("?")[0], url.replace("rediss://", "redis://").split("?")[0]):
            s = open_store(bad, model_fingerprint=FP, timeout_s=2.0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert s.get(key(1)) is None
            assert s.stats().remote_errors == 1 and len(_warnings(caught, RemoteWarning)) == 1
            if bad.startswith("rediss://"):
                assert "certificate" in _warnings(caught, RemoteWarning)[0].lower()
    finally:
        server.stop()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path / "cluster").start()
    yield c
    c.stop()


def _cluster_store(url: str, **kw) -> ChunkStore:
    tier = RedisTier(url, timeout_s=kw.pop("timeout_s", 2.0), retry_s=kw.pop("retry_s", 0.3), **kw)
    return ChunkStore(None, ram_bytes=1 << 30, model_fingerprint=FP, remote=tier)


@pytest.mark.slow
def test_cluster_entries_across_slots_leases_corruption_and_a_killed_node(cluster):
    a = _cluster_store(cluster.url(0), part_bytes=16 << 10)
    assert a.remote.cluster and "cluster=1" in repr(a.remote)
    for i in range(24):
        a.put(key(i), value(i, NUMEL), {"i": i})
    assert a.stats().remote_errors == 0
    # Every entry sits whole on the node of its hash slot, and the entries cover every node.
    raw = cluster.client()
    node_of = {}
    for i in range(24):
        d = key(i).digest
        slot = raw.keyslot(f"agentwin:{{{d}}}:m")
        assert {raw.keyslot(k) for k in raw.scan_iter(match=f"agentwin:{{{d}}}:*", target_nodes=raw.ALL_NODES)} == {slot}
        node_of[i] = raw.get_node_from_key(f"agentwin:{{{d}}}:m").name
    assert set(node_of.values()) == {cluster.name(n) for n in range(3)}
    b = _cluster_store(cluster.url(1))  # reached through another node
    for i in range(24):
        got = b.get(key(i))
        assert got is not None and same(got[0], value(i, NUMEL)) and got[1] == {"i": i}
    assert b.stats().remote_hits == 24
    # Leases on the cluster: one holder at a time, token-checked release, waiters served.
    lease = a.try_lease(key(30))
    assert lease is not None and lease.tier == "remote" and b.try_lease(key(30)) is None
    assert b.release(lease) and b.try_lease(key(30)) is not None
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.3)
        return value(31, NUMEL)

    out = [None, None]
    threads = [threading.Thread(target=lambda i=i, s=s: out.__setitem__(i, s.get_or_compute(key(31), slow)))
               for i, s in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and sorted(o.how for o in out) == ["computed", "waited"]
    assert all(same(o.tensors, value(31, NUMEL)) for o in out)
    # A flipped byte in a part (under WATCH/MULTI on the cluster): a miss, deleted, warned.
    d5 = key(5).digest
    part = sorted(raw.scan_iter(match=f"agentwin:{{{d5}}}:p:*", target_nodes=raw.ALL_NODES))[1]
    raw.setrange(part, 7, bytes([raw.getrange(part, 7, 7)[0] ^ 1]))
    c = _cluster_store(cluster.url(2))
    with pytest.warns(CorruptEntryWarning, match=f"remote tier .*cluster=1: entry {d5} failed verification"):
        assert c.get(key(5)) is None
    assert c.stats().corrupt_dropped == 1 and raw.exists(f"agentwin:{{{d5}}}:m") == 0
    a.put(key(5), value(5, NUMEL), {"i": 5})  # repaired by the caller's recompute

    # SIGKILL one node while a writer is putting new entries: nothing corrupt is served, calls for
    # its slots become misses and skipped write-backs, the live nodes keep serving and storing.
    dead = cluster.name(2)
    written, failed = [], []
    stop = threading.Event()

    def writer():
        w = _cluster_store(cluster.url(0), part_bytes=16 << 10)
        for i in range(100, 160):
            if stop.is_set():
                break
            errors = w.stats().remote_errors
            w.put(key(i), value(i, NUMEL), {"i": i})
            (failed if w.stats().remote_errors > errors else written).append(i)
            time.sleep(0.01)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = threading.Thread(target=writer)
        t.start()
        while len(written) + len(failed) < 10 and t.is_alive():
            time.sleep(0.005)
        cluster.nodes[2].kill()
        t.join(timeout=60)
        stop.set()
        assert not t.is_alive() and len(written) + len(failed) == 60 and failed
        time.sleep(0.6)  # past the node timeout: the live nodes have marked it failed
        t0 = time.monotonic()
        reader = _cluster_store(cluster.url(0))
        owner = {i: raw.get_node_from_key(f"agentwin:{{{key(i).digest}}}:m").name for i in [*range(24), *range(100, 160)]}
        for i in owner:
            got = reader.get(key(i))
            # Served: bit-exact. Missed: its node is the dead one, or its write-back was skipped.
            assert (got is not None) == (owner[i] != dead and i not in failed), (i, owner[i])
            assert got is None or (same(got[0], value(i, NUMEL)) and got[1] == {"i": i}), f"entry {i} served wrong data"
        st = reader.stats()
        on_dead = sum(o == dead for o in owner.values())
        assert 0 < on_dead < len(owner) and st.remote_hits == len(owner) - on_dead - len([i for i in failed if owner[i] != dead])
        assert st.remote_errors == on_dead and st.corrupt_dropped == 0 and st.remote_misses == st.misses - on_dead
        # Later puts and gets: keys on live nodes round-trip, keys on the dead node are skipped.
        before = a.stats().remote_errors
        fresh = {}
        for i in range(200, 230):
            a.put(key(i), value(i, 100), {"i": i})
            fresh[i] = raw.get_node_from_key(f"agentwin:{{{key(i).digest}}}:m").name
        dead_keys = [i for i in fresh if fresh[i] == dead]
        assert dead_keys and a.stats().remote_errors - before == len(dead_keys)
        later = _cluster_store(cluster.url(1))
        for i in fresh:
            got = later.get(key(i))
            assert (got is None) == (fresh[i] == dead), i
            assert got is None or same(got[0], value(i, 100))
        got = later.get_or_compute(key(dead_keys[0]), lambda: value(dead_keys[0], 100))
        assert got.how == "computed"  # no lease to be had on the dead node: computed, not blocked
        assert time.monotonic() - t0 < 20
    assert _warnings(caught, RemoteWarning) and all(dead in m for m in _warnings(caught, RemoteWarning))
    assert _warnings(caught, CorruptEntryWarning) == []
    with pytest.raises(ValueError, match="database 0 only"):
        open_store(cluster.url(0).replace("/0?", "/3?"))
    with pytest.raises(ValueError, match="cluster"):
        open_store(cluster.url(0).replace("cluster=1", "cluster=maybe"))


def test_cluster_tier_is_made_lazily_and_faults_are_misses(tmp_path):
    """Nothing listens: creating the tier does not connect; each call is a miss within the
    timeout, counted, with one warning, and torch tensors stay local."""
    from tests.agentwin.store._support import free_port

    s = open_store(f"redis://127.0.0.1:{free_port()}/0?cluster=1", model_fingerprint=FP, timeout_s=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        assert s.get(key(1)) is None
        s.put(key(1), {"x": torch.ones(3)})
        assert time.monotonic() - t0 < 3
    assert s.stats().remote_errors == 2 and len(_warnings(caught, RemoteWarning)) == 1
    assert s.get(key(1)) is not None  # the local tier serves it
