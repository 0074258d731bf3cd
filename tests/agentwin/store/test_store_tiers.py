"""ChunkStore tiers: exact LRU eviction order with pins, oversized entries, the device tier,
hypothesis-driven budget invariants, bad inputs, isolation by fingerprint/tenant, EncoderCache."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

from agentwin.store import ChunkKey, ChunkStore, EncoderCache
from tests.agentwin.store._support import FP, key, same

UNIT = 100  # bytes: 25 float32


def unit_value(i: int, units: int = 1, version: int = 0) -> dict[str, torch.Tensor]:
    return {"x": torch.full((units * UNIT // 4,), float(i * 100 + version))}


def ram_keys(s: ChunkStore, n: int = 8) -> set[int]:
    return {i for i in range(n) if "ram" in s.tiers(key(i))}


def test_ram_lru_eviction_order_with_pins():
    """RAM budget 3 units, no root (eviction = drop):
    1. put 0, 1, 2                   → RAM LRU order [0, 1, 2]
    2. get 0                         → [1, 2, 0]
    3. pin 1
    4. put 3 (1 unit)                → drops 2 (least recent unpinned; 1 is pinned): [1, 0, 3]
    5. put 4 (2 units)               → drops 0 then 3: [1, 4]
    6. put 5 (3 units)               → ValueError (1 is pinned), nothing changes
    7. unpin 1, put 5 (3 units)      → drops 1 and 4: [5]
    """
    s = ChunkStore(ram_bytes=3 * UNIT)
    for i in range(3):
        s.put(key(i), unit_value(i))
    assert s.get(key(0)) is not None
    s.pin(key(1))
    s.put(key(3), unit_value(3))
    assert ram_keys(s) == {0, 1, 3} and s.stats().evictions == 1
    s.put(key(4), unit_value(4, 2))
    assert ram_keys(s) == {1, 4} and s.stats().evictions == 3
    before = s.stats()
    with pytest.raises(ValueError, match="pinned"):
        s.put(key(5), unit_value(5, 3))
    assert ram_keys(s) == {1, 4} and s.stats() == before
    s.unpin(key(1))
    s.put(key(5), unit_value(5, 3))
    assert ram_keys(s) == {5} and s.stats().evictions == 5 and s.stats().ram_bytes == 3 * UNIT
    assert s.get(key(1)) is None and s.stats().misses == 1
    s.check_integrity()


def test_ram_demotes_to_disk_and_disk_lru(tmp_path):
    """RAM budget 1 unit, disk budget 3.5 entries (data + sidecar bytes), root given:
    put 0, 1, 2 → RAM [2], disk [0, 1, 2] (write-through; RAM demotions 0 and 1 need no write)
    get 0       → disk hit, promoted: RAM [0] (2 demoted), disk order [1, 2, 0]
    put 3       → disk deletes 1 (least recently used): disk [2, 0, 3]; RAM [3]
    get 2       → disk [0, 3, 2]; put 4 → disk deletes 0: disk [3, 2, 4]
    """
    s = ChunkStore(tmp_path, ram_bytes=UNIT, disk_bytes=10**6, model_fingerprint=FP)
    s.put(key(0), unit_value(0))
    entry = s.stats().disk_bytes
    s.delete(key(0))
    s = ChunkStore(tmp_path, ram_bytes=UNIT, disk_bytes=int(3.5 * entry), model_fingerprint=FP)
    disk = lambda: {i for i in range(6) if "disk" in s.tiers(key(i))}  # noqa: E731
    for i in range(3):
        s.put(key(i), unit_value(i))
    assert disk() == {0, 1, 2} and ram_keys(s) == {2} and s.stats().demotions == 2
    got = s.get(key(0))
    assert got is not None and same(got[0], unit_value(0)) and ram_keys(s) == {0}
    assert s.stats().promotions == 1 and s.stats().demotions == 3
    s.put(key(3), unit_value(3))
    assert disk() == {0, 2, 3} and s.stats().evictions == 1
    assert s.get(key(2)) is not None
    s.put(key(4), unit_value(4))
    assert disk() == {2, 3, 4} and s.stats().evictions == 2
    s.check_integrity()


def test_oversized_entries(tmp_path):
    big = unit_value(0, 5)
    with pytest.raises(ValueError, match="no disk tier"):
        ChunkStore(ram_bytes=3 * UNIT).put(key(0), big)
    s = ChunkStore(tmp_path, ram_bytes=3 * UNIT, disk_bytes=4000, model_fingerprint=FP)
    s.put(key(0), big)  # over ram_bytes: straight to disk
    assert s.tiers(key(0)) == {"disk"}
    got = s.get(key(0))
    assert got is not None and same(got[0], big) and s.tiers(key(0)) == {"disk"}
    with pytest.raises(ValueError, match="pin"):
        s.put(key(1), big, pin=True)
    with pytest.raises(ValueError, match="ram_bytes"):
        s.pin(key(0))
    with pytest.raises(ValueError, match="disk_bytes"):
        s.put(key(2), unit_value(2, 50))
    assert not s.contains(key(1)) and not s.contains(key(2))
    with pytest.raises(ValueError, match="not in the store"):
        s.pin(key(3))
    s.check_integrity()


def test_device_tier_mirrors_hot_ram_entries():
    """Device tier (here on the CPU device, for the logic) of 2 units over RAM of 3 units."""
    s = ChunkStore(ram_bytes=3 * UNIT, device="cpu", device_bytes=2 * UNIT)
    for i in range(3):
        s.put(key(i), unit_value(i))
    assert s.stats().device_entries == 0  # put does not fill the device tier; get does
    for i in (0, 1, 2):
        assert s.get(key(i)) is not None
    assert {i for i in range(3) if "device" in s.tiers(key(i))} == {1, 2}
    assert s.stats().promotions == 3 and s.stats().demotions == 1
    s.put(key(3), unit_value(3))  # RAM drops 0 (LRU); device keeps 1, 2
    s.put(key(4), unit_value(4))  # RAM drops 1, and with it the device copy
    assert {i for i in range(5) if "device" in s.tiers(key(i))} == {2}
    s.put(key(2), unit_value(2, version=1))  # a new value invalidates the device copy
    got = s.get(key(2))
    assert got is not None and same(got[0], unit_value(2, version=1))
    s.check_integrity()
    with pytest.raises(ValueError):
        ChunkStore(device="cpu")
    with pytest.raises(ValueError):
        ChunkStore(device_bytes=10)
    with pytest.raises(ValueError):
        ChunkStore(device="nonsense", device_bytes=10)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            ChunkStore(device="cuda", device_bytes=10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU-only); the device-tier logic itself is tested with device=\"cpu\"")
def test_device_tier_on_cuda(tmp_path):
    s = ChunkStore(tmp_path, ram_bytes=3 * UNIT, device="cuda", device_bytes=2 * UNIT, model_fingerprint=FP)
    for i in range(3):
        s.put(key(i), unit_value(i))
        got = s.get(key(i))
        assert got is not None and got[0]["x"].is_cuda and same(got[0], unit_value(i))
    assert s.stats().device_entries == 2 and s.stats().device_bytes == 2 * UNIT
    s.check_integrity()


OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "get", "pin", "unpin", "delete"]),
                         st.integers(0, 3), st.integers(0, 40), st.booleans()), min_size=8, max_size=40)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, with_root=st.booleans(), with_device=st.booleans(), ram_units=st.integers(0, 6),
       disk_entries=st.integers(1, 4))
def test_budgets_hold_under_random_operations(ops, with_root, with_device, ram_units, disk_entries):
    with tempfile.TemporaryDirectory() as tmp:
        s = ChunkStore(tmp if with_root else None, ram_bytes=ram_units * 40, disk_bytes=disk_entries * 1100,
                       device="cpu" if with_device else None, device_bytes=60 if with_device else 0,
                       model_fingerprint=FP)
        latest: dict[int, dict[str, torch.Tensor]] = {}
        pinned: set[int] = set()
        version = 0
        for op, i, size, flag in ops:
            version += 1
            before = (s.stats(), {j: s.tiers(key(j)) for j in range(4)})
            if op == "put":
                v = {"x": torch.full((size,), math.nan if flag and size % 3 == 0 else float(version))}
                try:
                    s.put(key(i), v, {"v": version}, pin=flag)
                except ValueError as exc:
                    event(f"put refused: {'pinned' if 'pinned' in str(exc) else 'size'}")
                    after = (s.stats(), {j: s.tiers(key(j)) for j in range(4)})
                    assert after == before, "a refused put changed the store"
                else:
                    latest[i] = v
                    if flag:
                        pinned.add(i)
            elif op == "get":
                got = s.get(key(i))
                if got is not None:
                    assert i in latest and same(got[0], latest[i])
                assert i not in pinned or got is not None
            elif op == "pin":
                try:
                    s.pin(key(i))
                    pinned.add(i)
                except ValueError:
                    assert s.stats().ram_entries == before[0].ram_entries
            elif op == "unpin":
                s.unpin(key(i))
                pinned.discard(i)
            else:
                s.delete(key(i))
                latest.pop(i, None)
                pinned.discard(i)
                assert not s.contains(key(i)) and s.get(key(i)) is None
            s.check_integrity()
            stats = s.stats()
            assert stats.ram_bytes <= ram_units * 40 and stats.disk_bytes <= disk_entries * 1100
            assert stats.device_bytes <= (60 if with_device else 0)
            assert all("ram" in s.tiers(key(j)) for j in pinned)
        s.close()
        final = s.stats()
        for name in ("evictions", "demotions", "promotions", "hits"):
            event(f"{name} > 0: {getattr(final, name) > 0}")


def test_bad_inputs_and_copies(tmp_path):
    s = ChunkStore(tmp_path, model_fingerprint=FP)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for bad in ("k", b"k", key(0).digest, None):
        with pytest.raises(TypeError):
            s.put(bad, {"x": t})  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            s.get(bad)  # type: ignore[arg-type]
        for f in (s.contains, s.pin, s.unpin, s.delete):
            with pytest.raises(TypeError):
                f(bad)  # type: ignore[arg-type]
    for bad_tensors, exc in (([t], TypeError), ({"x": [1.0]}, TypeError), ({"x": t.numpy()}, TypeError),
                             ({1: t}, ValueError), ({"": t}, ValueError), ({"__metadata__": t}, ValueError),
                             ({"x": t.to_sparse()}, TypeError), ({"x": t.to(torch.complex64)}, TypeError)):
        with pytest.raises(exc):
            s.put(key(0), bad_tensors)
    for bad_meta, exc in (({"a": object()}, TypeError), ({"a": float("inf")}, ValueError), ({1: 2}, TypeError),
                          ("meta", TypeError)):
        with pytest.raises(exc):
            s.put(key(0), {"x": t}, bad_meta)
    with pytest.raises(TypeError):
        s.put(key(0), {"x": t}, pin=1)
    assert not s.contains(key(0)) and s.stats().disk_entries == 0
    view = t.t()  # non-contiguous
    nan = torch.tensor([math.nan, -math.nan, math.inf, 1.0])
    grad = torch.ones(2, requires_grad=True)
    s.put(key(1), {"view": view, "nan": nan, "grad": grad}, {"note": "ok", "n": [1, 2]})
    t.add_(1)  # mutating the caller's tensors after put changes nothing stored
    got = s.get(key(1))
    assert got is not None and got[0]["view"].is_contiguous() and not got[0]["grad"].requires_grad
    assert same(got[0], {"view": (t - 1).t().contiguous(), "nan": nan, "grad": torch.ones(2)})
    assert got[1] == {"note": "ok", "n": [1, 2]}
    got[1]["note"] = "changed"  # meta comes back as a fresh dict
    fresh = ChunkStore(tmp_path, model_fingerprint=FP).get(key(1))
    assert fresh is not None and same(fresh[0], got[0]) and fresh[1] == {"note": "ok", "n": [1, 2]}
    for kwargs, exc in ((dict(ram_bytes=-1), ValueError), (dict(ram_bytes="1"), TypeError),
                        (dict(disk_bytes=1.5), TypeError), (dict(model_fingerprint=3), TypeError),
                        (dict(tenant=None), TypeError)):
        with pytest.raises(exc):
            ChunkStore(**kwargs)
    with pytest.raises(TypeError):
        ChunkStore(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["model_fingerprint", "tenant"])
def test_other_fingerprint_or_tenant_never_served(tmp_path, field):
    forced = ChunkKey("ab" * 32)  # the same digest in both stores, as if ChunkKey.of collided
    owner = ChunkStore(tmp_path, model_fingerprint="m1", tenant="t1")
    other = ChunkStore(tmp_path, **({"model_fingerprint": "m1", "tenant": "t1"} | {field: "other"}))
    owner.put(forced, {"x": torch.ones(3)}, {"secret": 1})
    assert other.get(forced) is None and not other.contains(forced) and other.tiers(forced) == frozenset()
    assert not other.delete(forced)
    with pytest.raises(ValueError, match="another model fingerprint or tenant"):
        other.put(forced, {"x": torch.zeros(3)})
    assert other.stats().corrupt_dropped == 0 and other.stats().misses == 1
    got = ChunkStore(tmp_path, model_fingerprint="m1", tenant="t1").get(forced)
    assert got is not None and same(got[0], {"x": torch.ones(3)})
    # Keys from ChunkKey.of differ anyway, so both coexist.
    k1, k2 = ChunkKey.of("m1", "text", [1], tenant="t1"), ChunkKey.of(other.model_fingerprint, "text", [1],
                                                                      tenant=other.tenant)
    owner.put(k1, {"x": torch.ones(1)})
    other.put(k2, {"x": torch.zeros(1)})
    assert k1 != k2 and other.get(k1) is None and owner.get(k2) is None
    owner.check_integrity()
    other.check_integrity()


def test_encoder_cache(tmp_path):
    calls = []

    def encode():
        calls.append(1)
        return {"embeds": torch.randn(4, 8, generator=torch.Generator().manual_seed(5))}

    cache = EncoderCache(ChunkStore(tmp_path, model_fingerprint=FP))
    pixels = bytes(range(256)) * 4
    k = cache.key(pixels, {"min_pixels": 3136, "max_pixels": 12845056})
    assert k == ChunkKey.of(FP, "vision-encoder", pixels, {"max_pixels": 12845056, "min_pixels": 3136})
    assert k != cache.key(pixels, {"min_pixels": 3136})
    first = cache.get_or_compute(k, encode)
    second = cache.get_or_compute(k, encode)
    assert len(calls) == 1 and (cache.computed, cache.reused) == (1, 1) and same(first, second)
    again = EncoderCache(ChunkStore(tmp_path, model_fingerprint=FP))  # a new process would see the same
    assert same(again.get_or_compute(k, encode), first) and len(calls) == 1 and again.reused == 1
    with pytest.raises(TypeError):
        cache.get_or_compute(k, "not callable")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cache.get_or_compute(cache.key(b"other"), lambda: [torch.ones(1)])  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError):
        cache.key("pixels")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        EncoderCache("store")  # type: ignore[arg-type]
    assert cache.computed == 1
