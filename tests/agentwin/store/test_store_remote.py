"""Remote tier against a real redis-server started by the tests (free port on 127.0.0.1, no
persistence, a temp dir): sharing across processes, parts, faults (refused, blackholed, killed and
restarted server, writer killed before publishing), corruption, forgery and MAC, promotion under
the local budgets, `open_store`, and two Windows sharing canonical KV and patches through Redis."""

from __future__ import annotations

import signal
import socket
import threading
import time
import warnings

import pytest
import torch

from agentwin.store import ChunkStore, CorruptEntryWarning, RedisTier, RemoteWarning, open_store
from agentwin.store.remote import ORPHAN_TTL_S
from tests.agentwin.store._support import FP, Server, child, free_port, key, same, value

TIMEOUT = 0.5


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "redis").start()
    yield s
    s.stop()


def _tier(url: str, **kw) -> RedisTier:
    return RedisTier(url, timeout_s=kw.pop("timeout_s", 5.0), **kw)


def _store(url: str, tenant: str = "", ram_bytes: int = 1 << 30, root=None, **kw) -> ChunkStore:
    return ChunkStore(root, ram_bytes=ram_bytes, model_fingerprint=FP, tenant=tenant, remote=_tier(url, **kw))


def _keys(server: Server, pattern: str) -> list[bytes]:
    return sorted(server.client().scan_iter(match=pattern))


def _remote_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RemoteWarning)]


# A second process: reads the parent's entry, writes its own, then dies (SIGKILL) inside the put
# of entry 3 after its parts are uploaded and before they are published.
SECOND_PROCESS = """
import os, signal, sys
from agentwin.store import RedisTier, open_store
from tests.agentwin.store._support import FP, key, same, value
s = open_store(sys.argv[1], model_fingerprint=FP, secret=b"tenant-secret", timeout_s=5.0)
got = s.get(key(1))
print("found", got is not None and same(got[0], value(1, 70_000)) and got[1] == {"i": 1}, flush=True)
s.put(key(2), value(2, 70_000), {"i": 2})
print("wrote", s.stats().remote_errors == 0, flush=True)
RedisTier._publish = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
s.put(key(3), value(3, 70_000), {"i": 3})
print("not reached", flush=True)
"""


def test_two_processes_share_entries_and_a_killed_writer_publishes_nothing(server):
    a = open_store(server.url, model_fingerprint=FP, secret=b"tenant-secret", timeout_s=5.0)
    a.put(key(1), value(1, 70_000), {"i": 1})
    proc = child(SECOND_PROCESS, server.url, wait=False)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    assert out.split("\n")[:2] == ["found True", "wrote True"], (out, err)
    b = open_store(server.url, model_fingerprint=FP, secret=b"tenant-secret", timeout_s=5.0)
    got = b.get(key(2))  # the child's entry, from another process
    assert got is not None and same(got[0], value(2, 70_000)) and got[1] == {"i": 2}
    assert b.stats().remote_hits == 1 and b.tiers(key(2)) == {"ram", "remote"}
    # Entry 3's parts were uploaded under temporary keys but never published: invisible, and
    # they expire on their own.
    d3 = key(3).digest
    assert b.get(key(3)) is None and not b.contains(key(3)) and b.stats().remote_misses == 1
    assert _keys(server, f"agentwin:{{{d3}}}:m") == [] and _keys(server, f"agentwin:{{{d3}}}:p:*") == []
    tmp = _keys(server, f"agentwin:{{{d3}}}:t:*")
    assert tmp and all(0 < server.client().pttl(k) <= ORPHAN_TTL_S * 1000 for k in tmp)
    b.check_integrity()


def test_entry_larger_than_a_part_round_trips_and_rewrites_drop_old_parts(server):
    writer = _store(server.url, part_bytes=64 << 10)
    big = value(4, 300_000)  # 1.2 MB of float32: 19 parts of 64 KiB
    writer.put(key(4), big, {"i": 4, "text": "ünïcode"})
    d = key(4).digest
    parts = _keys(server, f"agentwin:{{{d}}}:p:*")
    assert len(parts) == -(-sum(server.client().strlen(k) for k in parts) // (64 << 10)) >= 19
    assert _keys(server, f"agentwin:{{{d}}}:t:*") == []
    reader = _store(server.url)  # reads whatever part size the writer used
    got = reader.get(key(4))
    assert got is not None and same(got[0], big) and got[1] == {"i": 4, "text": "ünïcode"}
    writer.put(key(4), value(4, 300_000, version=1), {"i": 4})  # a rewrite: new token, old parts deleted
    new_parts = _keys(server, f"agentwin:{{{d}}}:p:*")
    assert len(new_parts) == len(parts) and not set(new_parts) & set(parts)
    got = _store(server.url).get(key(4))
    assert got is not None and same(got[0], value(4, 300_000, version=1))
    assert writer.stats().remote_errors == 0 and writer.remote.stats().writes == 2


def test_readers_never_see_a_half_written_entry_during_rewrites(server):
    """A writer rewrites one entry (two alternating values, 16 KiB parts) while a reader reads it
    from another connection pool: every hit is one of the two values, bit-exact, and a read that
    races a rewrite is a plain miss that deletes nothing."""
    versions = [value(5, 20_000, version=v) for v in range(2)]
    wtier, rtier = _tier(server.url, part_bytes=16 << 10), _tier(server.url)
    d = key(5).digest
    prepared = [{n: t.contiguous() for n, t in v.items()} for v in versions]
    nbytes = sum(t.numel() * t.element_size() for t in versions[0].values())
    stop = threading.Event()
    failed: list[int] = []

    def write() -> None:
        i = 0
        while not stop.is_set():
            if not wtier.put(d, prepared[i % 2], "{}", nbytes, FP, ""):
                failed.append(i)
            i += 1

    t = threading.Thread(target=write)
    t.start()
    hits = 0
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            status, e = rtier.get(d, FP, "")
            assert status in ("hit", "absent"), status
            if e is not None:
                hits += 1
                assert same(e.tensors, versions[0]) or same(e.tensors, versions[1])
    finally:
        stop.set()
        t.join()
    assert not failed and hits > 0 and wtier.stats().writes > 2
    assert rtier.stats().corrupt == 0 and rtier.stats().errors == 0


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing-part", "manifest"])
def test_damaged_entry_is_detected_deleted_and_missed(server, damage):
    writer = _store(server.url, part_bytes=64 << 10)
    writer.put(key(6), value(6, 50_000), {"i": 6})
    d = key(6).digest
    c = server.client()
    part = _keys(server, f"agentwin:{{{d}}}:p:*")[1]
    if damage == "truncate":  # a value cut short
        c.set(part, c.get(part)[:-100])
    elif damage == "flip":
        c.setrange(part, 10, bytes([c.getrange(part, 10, 10)[0] ^ 1]))
    elif damage == "missing-part":  # e.g. evicted by the server's LRU
        c.delete(part)
    else:
        c.setrange(f"agentwin:{{{d}}}:m", 2, b"#")
    reader = _store(server.url)
    with pytest.warns(CorruptEntryWarning, match=f"remote tier {server.url}: entry {d} failed verification"):
        assert reader.get(key(6)) is None
    s = reader.stats()
    assert (s.remote_misses, s.remote_hits, s.corrupt_dropped, s.remote_errors) == (1, 0, 1, 0)
    assert reader.remote.stats().corrupt == 1
    assert _keys(server, f"agentwin:{{{d}}}:m") == []  # deleted, so the next put repairs it
    if damage != "manifest":
        assert _keys(server, f"agentwin:{{{d}}}:p:*") == []
    reader.put(key(6), value(6, 50_000), {"i": 6})  # the caller recomputed it
    got = _store(server.url).get(key(6))
    assert got is not None and same(got[0], value(6, 50_000))


def test_forged_entries_are_rejected(server):
    d = key(7, tenant="alice").digest
    # Tenant bob writes under alice's key: the manifest names bob, alice never serves it.
    bob = _store(server.url, tenant="bob")
    bob.put(key(7, tenant="alice"), value(666, 100), {"i": 666})
    alice = _store(server.url, tenant="alice", secret=b"alice-secret")
    assert alice.get(key(7, tenant="alice")) is None and alice.remote.stats().rejected == 1
    assert alice.stats().corrupt_dropped == 1 and _keys(server, f"agentwin:{{{d}}}:m") == []
    # A forger claiming to be alice, without her secret (no MAC, or a MAC under another secret).
    for forger_secret in (None, b"guess"):
        forger = _store(server.url, tenant="alice", secret=forger_secret)
        forger.put(key(7, tenant="alice"), value(666, 100), {"i": 666})
        assert not alice.contains(key(7, tenant="alice"))
        assert alice.get(key(7, tenant="alice")) is None
    assert alice.remote.stats().rejected == 3
    # Alice's own entry (signed) is served to another alice store with the same secret...
    alice.put(key(7, tenant="alice"), value(7, 100), {"i": 7})
    got = _store(server.url, tenant="alice", secret="alice-secret").get(key(7, tenant="alice"))
    assert got is not None and same(got[0], value(7, 100)) and got[1] == {"i": 7}
    # ...but not after its manifest is edited (the MAC covers the manifest, meta included).
    c = server.client()
    raw = c.get(f"agentwin:{{{d}}}:m")
    assert raw.count(b'"meta":{"i":7}') == 1
    c.set(f"agentwin:{{{d}}}:m", raw.replace(b'"meta":{"i":7}', b'"meta":{"i":8}'))
    fresh = _store(server.url, tenant="alice", secret=b"alice-secret")
    assert fresh.get(key(7, tenant="alice")) is None and fresh.remote.stats().rejected == 1
    # The MAC is bound to the key: a valid signed entry copied under another key of alice's is refused.
    alice.put(key(8, tenant="alice"), value(8, 100), {"i": 8})
    d8 = key(8, tenant="alice").digest
    for k in c.scan_iter(match=f"agentwin:{{{d8}}}:*"):
        c.copy(k, k.replace(d8.encode(), d.encode()), replace=True)
    c.set(f"agentwin:{{{d}}}:m", c.get(f"agentwin:{{{d}}}:m").replace(d8.encode(), d.encode()))
    assert fresh.get(key(7, tenant="alice")) is None and fresh.remote.stats().rejected == 2


def test_refused_connection_warns_once_backs_off_and_recovers(tmp_path):
    port = free_port()  # nothing listens here yet
    url = f"redis://agent:hunter2@127.0.0.1:{port}/0"
    s = open_store(url, model_fingerprint=FP, timeout_s=TIMEOUT)
    s.remote.retry_s = 0.3
    assert "hunter2" not in repr(s.remote)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            t0 = time.monotonic()
            assert s.get(key(i)) is None
            s.put(key(i), value(i, 100), {"i": i})  # stored locally; the write-back is skipped
            assert time.monotonic() - t0 < TIMEOUT * 3 + 1
    msgs = _remote_warnings(caught)
    assert len(msgs) == 1 and "hunter2" not in msgs[0] and "refused" in msgs[0].lower()
    st = s.stats()
    assert (st.remote_errors, st.remote_hits, st.remote_misses) == (8, 0, 0) and st.misses == 4
    assert s.get(key(0)) is not None  # local tiers still serve
    acl = ("--user", "agent", "on", ">hunter2", "~*", "&*", "+@all")  # the URL's user and password
    server = Server(tmp_path / "redis", port=port, extra=acl).start()
    try:
        time.sleep(0.35)  # past the back-off: the next call tries the server again
        s.put(key(9), value(9, 100), {"i": 9})
        assert s.stats().remote_errors == 8
        got = _store(server.url).get(key(9))
        assert got is not None and same(got[0], value(9, 100))
    finally:
        server.stop()


@pytest.mark.parametrize("kind", ["accepts-never-answers", "full-backlog"])
def test_blackholed_server_does_not_hang(kind):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0 if kind == "full-backlog" else 16)
    fillers = []
    if kind == "full-backlog":  # connections nobody accepts fill the queue: later SYNs are dropped
        for _ in range(4):
            f = socket.socket()
            f.setblocking(False)
            try:
                f.connect(srv.getsockname())
            except BlockingIOError:
                pass
            fillers.append(f)
        time.sleep(0.05)
    try:
        s = open_store(f"redis://127.0.0.1:{srv.getsockname()[1]}/0", model_fingerprint=FP, timeout_s=TIMEOUT)
        s.remote.retry_s = 0.0  # try the server on every call, to time each one
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for op in ("get", "put", "contains", "get"):
                t0 = time.monotonic()
                if op == "put":
                    s.put(key(1), value(1, 100))  # stored locally; the write-back times out
                elif op == "contains":
                    assert s.contains(key(1))  # from RAM; the remote is not asked
                else:
                    assert s.get(key(2)) is None
                assert time.monotonic() - t0 < TIMEOUT * 3 + 1, op
        assert len(_remote_warnings(caught)) == 1 and s.stats().remote_errors == 3
        s.close()
    finally:
        for f in fillers:
            f.close()
        srv.close()


def test_server_killed_during_large_write_then_restarted(tmp_path):
    """SIGKILL the server while a 32 MiB entry (1 MiB parts) is being written: the put returns
    (stored locally, write-back failed) with one warning; while it is down and after it restarts
    empty nothing corrupt is served and the stores carry on; after the back-off the next put
    reaches the restarted server."""
    server = Server(tmp_path / "redis").start()
    try:
        a = _store(server.url, part_bytes=1 << 20, timeout_s=2.0, retry_s=0.3)
        b = _store(server.url, timeout_s=2.0, retry_s=0.3)
        big = {"x": torch.randn(8 << 20, generator=torch.Generator().manual_seed(0))}
        base = int(server.client().info("memory")["used_memory"])
        killed = threading.Event()

        def killer() -> None:
            c = server.client()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if int(c.info("memory")["used_memory"]) > base + (4 << 20):
                    server.kill()
                    killed.set()
                    return
                time.sleep(0.001)

        t = threading.Thread(target=killer)
        t.start()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.monotonic()
            a.put(key(10), big, {"i": 10})
            elapsed = time.monotonic() - t0
            t.join()
            assert killed.is_set() and elapsed < 20
            assert a.stats().remote_errors == 1 and len(_remote_warnings(caught)) == 1
            got = a.get(key(10))  # RAM still has it
            assert got is not None and same(got[0], big)
            t0 = time.monotonic()
            assert b.get(key(10)) is None and b.get(key(11)) is None  # down: misses, at once
            assert time.monotonic() - t0 < 2 * 3 + 1 and b.stats().remote_errors == 2
            server.start()  # restarted, empty (no persistence)
            time.sleep(0.35)
            assert b.get(key(10)) is None and b.stats().remote_misses == 1  # nothing half-written
            assert a.remote.get(key(10).digest, FP, "")[0] == "absent"
            a.put(key(10), big, {"i": 10})  # the next write-back reaches the restarted server
            assert a.stats().remote_errors == 1
            got = b.get(key(10))
            assert got is not None and same(got[0], big) and b.stats().remote_hits == 1
            assert len(_remote_warnings(caught)) == 2  # a and b warned once each
    finally:
        server.stop()


def test_remote_hits_are_promoted_under_the_local_budgets(server, tmp_path):
    unit = value(0, 10_000)
    nb = sum(t.numel() * t.element_size() for t in unit.values())
    writer = _store(server.url)
    for i in range(4):
        writer.put(key(i), value(i, 10_000), {"i": i})
    writer.put(key(9), value(9, 30_000), {"i": 9})  # ~3 units: over the reader's ram_bytes
    reader = _store(server.url, ram_bytes=int(2.5 * nb))
    for i in range(3):
        got = reader.get(key(i))
        assert got is not None and same(got[0], value(i, 10_000))
    s = reader.stats()
    assert s.remote_hits == 3 and s.promotions == 3 and s.ram_entries == 2 and s.ram_bytes <= 2.5 * nb
    assert s.evictions == 1 and reader.tiers(key(0)) == {"remote"} and reader.tiers(key(2)) == {"ram", "remote"}
    reader.pin(key(1))
    assert reader.get(key(3)) is not None and reader.tiers(key(1)) == {"ram", "remote"}
    got = reader.get(key(9))
    assert got is not None and same(got[0], value(9, 30_000)) and reader.tiers(key(9)) == {"remote"}
    assert reader.stats().ram_bytes <= 2.5 * nb
    reader.check_integrity()
    # With a disk tier, a remote hit too big for RAM is kept on disk (if it fits there).
    cached = _store(server.url, ram_bytes=int(2.5 * nb), root=tmp_path / "cache")
    assert cached.get(key(9)) is not None and cached.tiers(key(9)) == {"disk", "remote"}
    cached.check_integrity()
    # delete reaches the remote tier too.
    assert reader.delete(key(3)) and not _store(server.url).contains(key(3))


def test_open_store_locations(server, tmp_path):
    ram = open_store(None, model_fingerprint=FP, ram_bytes=1 << 20)
    ram.put(key(1), value(1, 10))
    assert ram.remote is None and ram.tiers(key(1)) == {"ram"}
    disk = open_store(tmp_path / "d", model_fingerprint=FP)
    disk.put(key(1), value(1, 10))
    assert disk.remote is None and disk.tiers(key(1)) == {"ram", "disk"}
    assert open_store(str(tmp_path / "d"), model_fingerprint=FP).tiers(key(1)) == {"disk"}
    remote = open_store(server.url, model_fingerprint=FP, tenant="t", secret="s", cache_dir=tmp_path / "c")
    remote.put(key(2, tenant="t"), value(2, 10))
    assert remote.tiers(key(2, tenant="t")) == {"ram", "disk", "remote"}
    assert open_store(server.url.replace("redis://", "rediss://"), model_fingerprint=FP).remote is not None
    for bad, exc, match in [("http://127.0.0.1/", ValueError, "redis://"), ("", ValueError, "empty"),
                            ("redis://", ValueError, "redis://"), (42, TypeError, "filesystem path")]:
        with pytest.raises(exc, match=match):
            open_store(bad)
    with pytest.raises(ValueError, match="cache_dir"):
        open_store(tmp_path / "d", cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="secret"):
        open_store(server.url, secret=b"")
    with pytest.raises(ValueError, match="timeout_s"):
        open_store(server.url, timeout_s=0)
    with pytest.raises(ValueError, match="socket_timeout"):  # would lift the bound on every call
        open_store(server.url + "?socket_timeout=600")
    with pytest.raises(TypeError, match="RedisTier"):
        ChunkStore(remote=server.url)


def test_two_windows_share_canonical_kv_and_patches_through_redis(server):
    from agentwin.models.adapter import KameraModel
    from agentwin.window import Window

    texts = ["the harbour master keeps the tide log", "she wrote the storm surge in it",
             "the keeper climbed the tower at dawn"]
    query = "who climbed the tower?"
    km = KameraModel.from_pretrained("tiny-llama-gqa")
    first = Window(km, patch="origin", rank=None, store=open_store(server.url, model_fingerprint=km.fingerprint))
    for t in texts:
        first.append(t)
    expected = first.next_token_logprobs(query)
    assert first.stats().forwards.get("encode", 0) == len(texts)
    second = Window(km, patch="origin", rank=None, store=open_store(server.url, model_fingerprint=km.fingerprint))
    for t in texts:
        second.append(t)
    s = second.stats()
    assert "encode" not in s.forwards and sum(s.forwards.values()) == 0, dict(s.forwards)
    assert s.canonical_hits == len(texts) and s.store.remote_hits >= len(texts) and s.store.remote_errors == 0
    got = second.next_token_logprobs(query)
    assert float((got - expected).abs().max()) <= 1e-4
