"""Disk tier: crash safety (SIGKILLed writers), corrupt and truncated files (and the warning they
raise), crash leftovers, and two processes sharing one root."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import warnings
from pathlib import Path

import pytest

from agentwin.store import ChunkStore, CorruptEntryWarning
from tests.agentwin.store._support import FP, WRITER, child, key, same, value

NUMEL = 1 << 20  # 4 MiB float32 per entry, so a kill often lands inside a write


def _files(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def test_sigkilled_writer_leaves_a_consistent_store(tmp_path):
    """A child writes 4 MiB entries in a loop (disk budget ~6 entries, so it also evicts); we
    SIGKILL it at a random moment after it has committed some, three times over on the same
    root. Then a fresh store: check_integrity passes, every entry it serves is bit-exact, the
    last acknowledged entry is served, temp files are gone and are never served."""
    rng = random.Random(1234)
    disk = 6 * (4 * NUMEL + 1500)
    start, leftovers = 0, 0
    for _ in range(3):
        proc = child(WRITER, tmp_path, start, 1000, NUMEL, disk, wait=False)
        committed = []
        want = rng.randint(1, 4)
        while len(committed) < want:
            line = proc.stdout.readline()
            assert line, f"writer died early: {proc.stderr.read()}"
            committed.append(int(line))
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        leftovers += any(n.startswith(".tmp.") for n in _files(tmp_path))
        s = ChunkStore(tmp_path, ram_bytes=64 << 20, disk_bytes=disk, model_fingerprint=FP)
        s.check_integrity()
        assert not any(n.startswith(".tmp.") for n in _files(tmp_path))
        served = []
        for i in range(start + 1000):
            got = s.get(key(i))
            if got is not None:
                assert same(got[0], value(i, NUMEL)) and got[1] == {"i": i}, f"entry {i} served wrong data"
                served.append(i)
        assert committed[-1] in served, f"acknowledged entry {committed[-1]} lost; served {served}"
        assert s.stats().corrupt_dropped == 0 and s.stats().disk_bytes <= disk
        s.check_integrity()
        s.close()
        start += 1000
    print(f"kills that left a temp file behind: {leftovers}/3")


# Entries 0, 1, 2 commit; the put of entry 3 first evicts entry 0 (budget), then writes.
@pytest.mark.parametrize("crash, leftover", [
    ("unlink-json:1", "data"),  # killed inside the eviction of 0: its sidecar gone, its data file left
    ("replace:7", "tmp"),       # 0 evicted; 3's data file fully written as a temp, never replaced in
    ("replace:8", "tmp+data"),  # 0 evicted; 3's data file committed, its sidecar still a temp
])
def test_writer_killed_at_each_commit_step(tmp_path, crash, leftover):
    """The writer SIGKILLs itself at an exact step of a put (see WRITER); the directory then holds
    that step's leftovers, and a fresh store removes them, passes check_integrity and serves
    exactly the committed entries, bit-exact (disk budget: 3.5 entries)."""
    probe = ChunkStore(tmp_path / "probe", model_fingerprint=FP)
    probe.put(key(0), value(0, 1000), {"i": 0})
    disk = int(3.5 * probe.stats().disk_bytes)
    proc = child(WRITER, tmp_path / "root", 0, 10, 1000, disk, crash, wait=False)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and out.split() == ["0", "1", "2"]
    names = _files(tmp_path / "root")
    temps = [n for n in names if n.startswith(".tmp.")]
    data = {n.split(".")[0] for n in names if n.endswith(".safetensors")}
    sides = {n.split(".")[0] for n in names if n.endswith(".json")}
    assert bool(temps) == ("tmp" in leftover) and bool(data - sides) == ("data" in leftover), names
    s = ChunkStore(tmp_path / "root", disk_bytes=disk, model_fingerprint=FP)
    s.check_integrity()
    assert not any(n.startswith(".tmp.") for n in _files(tmp_path / "root"))
    got = {i: s.get(key(i)) for i in range(4)}
    assert {i for i, g in got.items() if g is not None} == {1, 2}
    assert all(same(got[i][0], value(i, 1000)) and got[i][1] == {"i": i} for i in (1, 2))
    assert s.stats().corrupt_dropped == 0


def test_crash_leftovers_are_collected_and_never_served(tmp_path):
    s = ChunkStore(tmp_path, model_fingerprint=FP)
    s.put(key(0), value(0, 100))
    s.put(key(1), value(1, 100))
    names = _files(tmp_path)
    data0 = next(n for n in names if n.startswith(key(0).digest) and n.endswith(".safetensors"))
    data1 = next(n for n in names if n.startswith(key(1).digest) and n.endswith(".safetensors"))
    # A complete-looking temp copy of entry 0's data and sidecar (a writer killed before os.replace),
    # an orphan data file of an unknown digest, and entry 1's sidecar without its data file.
    (tmp_path / f".tmp.{data0}.999.abcd").write_bytes((tmp_path / data0).read_bytes())
    (tmp_path / f".tmp.{key(0).digest}.json.999.abcd").write_bytes((tmp_path / f"{key(0).digest}.json").read_bytes())
    (tmp_path / f"{key(5).digest}.0123456789abcdef.safetensors").write_bytes(b"junk")
    os.unlink(tmp_path / data1)
    os.unlink(tmp_path / f"{key(0).digest}.json")  # entry 0 was never committed
    (tmp_path / "unrelated.txt").write_text("left alone")
    with pytest.warns(CorruptEntryWarning, match=f"entry {key(1).digest} failed verification \\(data file missing\\)"):
        fresh = ChunkStore(tmp_path, model_fingerprint=FP)
    fresh.check_integrity()
    assert _files(tmp_path) == sorted([".lock", "unrelated.txt"])
    assert fresh.get(key(0)) is None and fresh.get(key(1)) is None and fresh.get(key(5)) is None
    assert fresh.stats().corrupt_dropped == 1  # the sidecar whose data file was missing


def _one_entry(tmp_path: Path) -> tuple[Path, Path]:
    ChunkStore(tmp_path, model_fingerprint=FP).put(key(7), value(7, 1000), {"i": 7})
    data = next(p for p in tmp_path.iterdir() if p.suffix == ".safetensors")
    return data, tmp_path / f"{key(7).digest}.json"


def _assert_dropped_then_repaired(tmp_path: Path, data: Path, side: Path) -> None:
    with pytest.warns(CorruptEntryWarning, match=f"disk tier .*: entry {key(7).digest} failed verification"):
        s = ChunkStore(tmp_path, model_fingerprint=FP)  # fresh: nothing in RAM, the disk copy is read
        assert s.get(key(7)) is None
    st = s.stats()
    assert st.corrupt_dropped == 1 and st.misses == 1 and st.hits == 0
    assert not data.exists() and not side.exists() and not s.contains(key(7))
    s.check_integrity()
    s.put(key(7), value(7, 1000), {"i": 7})
    again = ChunkStore(tmp_path, model_fingerprint=FP).get(key(7))
    assert again is not None and same(again[0], value(7, 1000)) and again[1] == {"i": 7}


@pytest.mark.parametrize("where", [0, 9, "header_end", "middle", -1])
def test_flipped_byte_is_dropped_as_corrupt(tmp_path, where):
    data, side = _one_entry(tmp_path)
    raw = bytearray(data.read_bytes())
    header = int.from_bytes(raw[:8], "little") + 8
    pos = {"header_end": header - 1, "middle": len(raw) // 2}.get(where, where)
    raw[pos] ^= 0x01
    data.write_bytes(bytes(raw))
    _assert_dropped_then_repaired(tmp_path, data, side)


@pytest.mark.parametrize("keep", [0, 7, 100, "half", "all_but_one"])
def test_truncated_file_is_dropped_as_corrupt(tmp_path, keep):
    data, side = _one_entry(tmp_path)
    raw = data.read_bytes()
    n = {"half": len(raw) // 2, "all_but_one": len(raw) - 1}.get(keep, keep)
    data.write_bytes(raw[:n])
    _assert_dropped_then_repaired(tmp_path, data, side)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong_sha", "wrong_digest"])
def test_damaged_sidecar_is_dropped(tmp_path, damage):
    data, side = _one_entry(tmp_path)
    text = side.read_text()
    sidecar = json.loads(text)
    sidecar["sha256"] = sidecar["sha256"][:-1] + ("0" if sidecar["sha256"][-1] != "0" else "1")  # name still fits
    side.write_text({"garbage": "{not json", "truncated": text[: len(text) // 2], "wrong_sha": json.dumps(sidecar),
                     "wrong_digest": text.replace(key(7).digest, key(8).digest)}[damage])
    _assert_dropped_then_repaired(tmp_path, data, side)


def test_corrupt_entry_in_a_running_store_after_ram_eviction(tmp_path):
    s = ChunkStore(tmp_path, ram_bytes=5000, model_fingerprint=FP)
    s.put(key(1), value(1, 1000))  # 4000 + 16 bytes: fits RAM
    s.put(key(2), value(2, 1000))  # pushes 1 out of RAM (demoted: its disk copy stays)
    assert s.tiers(key(1)) == {"disk"}
    data = next(p for p in tmp_path.iterdir() if p.name.startswith(key(1).digest) and p.suffix == ".safetensors")
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.warns(CorruptEntryWarning, match=key(1).digest):
        assert s.get(key(1)) is None
    assert s.stats().corrupt_dropped == 1 and not data.exists()
    got = s.get(key(2))
    assert got is not None and same(got[0], value(2, 1000))
    s.check_integrity()


def _flip(root: Path, k) -> None:
    data = next(p for p in root.iterdir() if p.name.startswith(k.digest) and p.suffix == ".safetensors")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))


def test_corrupt_entry_warns_once_naming_the_tier_and_the_key(tmp_path):
    """Flipped bytes in a disk entry: the get is a miss, with one CorruptEntryWarning that names
    the disk tier and the key's digest and points at the caller; the recomputed value is then
    served. The same entry found corrupt again in this process is not warned about twice (but is
    still dropped); another entry gets its own warning. ram_bytes=0: every get reads the disk."""
    s = ChunkStore(tmp_path, ram_bytes=0, model_fingerprint=FP)
    for i in (1, 2):
        s.put(key(i), value(i, 1000), {"i": i})
    _flip(tmp_path, key(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert s.get(key(1)) is None
        assert s.stats().corrupt_dropped == 1 and s.stats().misses == 1 and not s.contains(key(1))
        s.put(key(1), value(1, 1000), {"i": 1})  # the caller recomputes it
        got = s.get(key(1))
        assert got is not None and same(got[0], value(1, 1000)) and got[1] == {"i": 1}
        _flip(tmp_path, key(1))
        assert s.get(key(1)) is None and s.stats().corrupt_dropped == 2
        _flip(tmp_path, key(2))
        assert s.get(key(2)) is None and s.stats().corrupt_dropped == 3
    found = [w for w in caught if issubclass(w.category, CorruptEntryWarning)]
    assert [str(w.message) for w in found] == [
        f"disk tier {tmp_path}: entry {key(i).digest} failed verification (sha256 of the data file differs from "
        "its sidecar's); deleted and read as a miss, so it is recomputed" for i in (1, 2)]
    assert all(w.filename == __file__ for w in found)  # attributed to the caller of get
    s.check_integrity()


READER = """
import sys
from agentwin.store import ChunkStore, CorruptEntryWarning
from tests.agentwin.store._support import FP, key, value, same
s = ChunkStore(sys.argv[1], model_fingerprint=FP)
got = s.get(key(int(sys.argv[2])))
assert got is not None and same(got[0], value(int(sys.argv[2]), 5000)), "child could not read the entry"
print("ok")
"""


def test_two_processes_share_a_root(tmp_path):
    parent = ChunkStore(tmp_path, model_fingerprint=FP)  # opened before the child writes
    assert parent.get(key(3)) is None
    child(WRITER, tmp_path, 3, 1, 5000, 1 << 30)
    got = parent.get(key(3))  # a miss in RAM re-reads the directory
    assert got is not None and same(got[0], value(3, 5000)) and got[1] == {"i": 3}
    parent.put(key(4), value(4, 5000))
    assert child(READER, tmp_path, 4).stdout.strip() == "ok"
    parent.check_integrity()
    assert parent.stats().disk_entries == 2


def test_concurrent_writers_keep_the_shared_budget(tmp_path):
    disk = 10 * (4 * 20000 + 1500)
    procs = [child(WRITER, tmp_path, start, 25, 20000, disk, wait=False) for start in (0, 100)]
    reader = ChunkStore(tmp_path, disk_bytes=disk, model_fingerprint=FP)
    seen = 0
    while any(p.poll() is None for p in procs):
        for i in list(range(25)) + list(range(100, 125)):
            got = reader.get(key(i))
            if got is not None:
                assert same(got[0], value(i, 20000))
                seen += 1
        time.sleep(0.02)  # two CPUs are enough for the writers and this reader
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err
        assert out.split()[-1] in ("24", "124")
    reader.check_integrity()
    assert reader.stats().disk_bytes <= disk and reader.stats().corrupt_dropped == 0
    fresh = ChunkStore(tmp_path, disk_bytes=disk, model_fingerprint=FP)  # what is on disk now
    final = [i for i in list(range(25)) + list(range(100, 125)) if fresh.get(key(i)) is not None]
    assert 0 < len(final) <= 10
    assert all(same(fresh.get(key(i))[0], value(i, 20000)) for i in final)
    print(f"reader saw {seen} entries while the writers ran; {len(final)} remain")
