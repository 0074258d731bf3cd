"""ChunkKey / patch_key: deterministic and sensitive to every field; KV and patch serialisation
round trips (fp16, bf16, int8 with scales, None slots) exactly, including through a disk store."""

from __future__ import annotations

import pytest
import torch

from agentwin.store import (
    ChunkKey,
    ChunkStore,
    kv_to_tensors,
    patch_key,
    patch_to_tensors,
    tensors_to_kv,
    tensors_to_patch,
)
from kamera_core import patch as kp
from tests.agentwin.store._support import same

IDS = [1, 2, 3, 50000]


def test_chunk_key_deterministic_and_sensitive_to_every_field():
    base = ChunkKey.of("m", "text", IDS, {"a": 1, "b": [1, 2]}, tenant="t")
    assert base == ChunkKey.of("m", "text", list(IDS), {"b": [1, 2], "a": 1}, tenant="t")  # settings order
    assert base == ChunkKey.of("m", "text", tuple(IDS), {"b": (1, 2), "a": 1}, tenant="t")
    variants = [
        ChunkKey.of("m2", "text", IDS, {"a": 1, "b": [1, 2]}, tenant="t"),
        ChunkKey.of("m", "image", IDS, {"a": 1, "b": [1, 2]}, tenant="t"),
        ChunkKey.of("m", "text", IDS[:-1], {"a": 1, "b": [1, 2]}, tenant="t"),
        ChunkKey.of("m", "text", [1, 2, 3, 50001], {"a": 1, "b": [1, 2]}, tenant="t"),
        ChunkKey.of("m", "text", IDS, {"a": 2, "b": [1, 2]}, tenant="t"),
        ChunkKey.of("m", "text", IDS, {"a": 1, "b": [2, 1]}, tenant="t"),
        ChunkKey.of("m", "text", IDS, {"a": 1}, tenant="t"),
        ChunkKey.of("m", "text", IDS, {"a": 1, "b": [1, 2]}, tenant="u"),
        ChunkKey.of("m", "text", IDS, {"a": 1, "b": [1, 2]}),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert len(base.digest) == 64 and int(base.digest, 16) >= 0


def test_chunk_key_fields_cannot_collide_by_concatenation_or_form():
    assert ChunkKey.of("ab", "c", b"") != ChunkKey.of("a", "bc", b"")
    assert ChunkKey.of("m", "t", b"x", tenant="") != ChunkKey.of("m", "t", b"", tenant="x")
    ids_as_bytes = torch.tensor(IDS, dtype=torch.int64).numpy().tobytes()
    forms = {ChunkKey.of("m", "t", IDS), ChunkKey.of("m", "t", ids_as_bytes),
             ChunkKey.of("m", "t", torch.tensor(IDS)), ChunkKey.of("m", "t", torch.tensor(IDS, dtype=torch.int32))}
    assert len(forms) == 4
    x = torch.arange(12, dtype=torch.float32)
    assert ChunkKey.of("m", "t", x) != ChunkKey.of("m", "t", x.reshape(3, 4))  # shape is hashed
    assert ChunkKey.of("m", "t", x.reshape(3, 4).t()) == ChunkKey.of("m", "t", x.reshape(3, 4).t().contiguous())
    assert ChunkKey.of("m", "t", x.bfloat16()) == ChunkKey.of("m", "t", x.bfloat16().clone())
    px = ChunkKey.of("m", "t", b"px")
    assert ChunkKey.of("m", "t", bytearray(b"px")) == px == ChunkKey.of("m", "t", memoryview(b"px"))
    nested = ChunkKey.of("m", "t", b"", {"o": {"y": 1, "x": 2}})
    assert nested == ChunkKey.of("m", "t", b"", {"o": {"x": 2, "y": 1}})


@pytest.mark.parametrize("args, exc", [
    (("m", "t", "a string"), TypeError),
    (("m", "t", [1, "2"]), TypeError),
    (("m", "t", [True]), TypeError),
    (("m", "t", 5), TypeError),
    (("m", "t", [1 << 63]), ValueError),
    (("m", "", b""), ValueError),
    ((1, "t", b""), TypeError),
    (("m", "t", b"", {1: "x"}), TypeError),
    (("m", "t", b"", {"a": float("nan")}), ValueError),
    (("m", "t", b"", {"a": object()}), TypeError),
    (("m", "t", b"", ["not", "a mapping"]), TypeError),
])
def test_chunk_key_bad_inputs(args, exc):
    with pytest.raises(exc):
        ChunkKey.of(*args)
    with pytest.raises(TypeError):
        ChunkKey.of("m", "t", b"", tenant=None)  # type: ignore[arg-type]


def test_chunk_key_validates_digest():
    for bad in ("", "xyz", "A" * 64, "0" * 63, 5):
        with pytest.raises(ValueError):
            ChunkKey(bad)  # type: ignore[arg-type]


def test_patch_key():
    a, b, c = (ChunkKey.of("m", "t", [i]) for i in range(3))
    k = patch_key(c, [a, b], 16, "svd")
    assert k == patch_key(c, (a, b), 16, "svd")
    assert k != patch_key(c, [b, a], 16, "svd")  # ordered antecedent
    assert patch_key(c, frozenset({a, b}), 16, "svd") == patch_key(c, frozenset({b, a}), 16, "svd")
    assert patch_key(c, frozenset({a, b}), 16, "svd") == patch_key(c, {b, a}, 16, "svd")
    distinct = {k, patch_key(c, frozenset({a, b}), 16, "svd"), patch_key(c, [a, b], 8, "svd"),
                patch_key(c, [a, b], None, "svd"), patch_key(c, [a, b], 0, "svd"), patch_key(c, [a, b], 16, "query"),
                patch_key(a, [c, b], 16, "svd"), patch_key(c, [a], 16, "svd"), patch_key(c, [], 16, "svd"),
                patch_key(c, frozenset(), 16, "svd")}
    assert len(distinct) == 10
    for bad, exc in ((dict(antecedent="ab"), TypeError), (dict(antecedent=[a, "b"]), TypeError),
                     (dict(rank=-1), ValueError), (dict(rank=1.5), TypeError), (dict(rank=True), TypeError),
                     (dict(method=""), ValueError), (dict(chunk="c"), TypeError)):
        kw = dict(chunk=c, antecedent=[a], rank=4, method="svd") | bad
        with pytest.raises(exc):
            patch_key(**kw)


def _kv(dtype: torch.dtype, layers: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(7, 2, 8, generator=g).to(dtype), torch.randn(7, 2, 8, generator=g).to(dtype))
            for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_round_trip_through_disk(tmp_path, dtype):
    kv = _kv(dtype)
    kv[1] = (kv[1][0].transpose(0, 1).contiguous().transpose(0, 1), kv[1][1])  # a non-contiguous view
    kv.append((torch.randn(7, 16).to(dtype), torch.randn(7, 4).to(dtype)))  # MLA-style slots
    kv[0][0][0, 0, 0] = float("nan")
    d = kv_to_tensors(kv)
    assert sorted(d) == sorted([f"{s}.{i}" for i in range(4) for s in "kv"])
    key = ChunkKey.of("m", "text", [1, 2])
    ChunkStore(tmp_path, model_fingerprint="m").put(key, d)
    got = ChunkStore(tmp_path, model_fingerprint="m").get(key)  # fresh store: read from disk
    assert got is not None
    back = tensors_to_kv(got[0])
    assert len(back) == len(kv)
    for (k0, v0), (k1, v1) in zip(kv, back):
        assert same({"k": k0, "v": v0}, {"k": k1, "v": v1})


def test_tensors_to_kv_rejects_bad_names():
    t = torch.zeros(1)
    for bad in ({"k.0": t}, {"k.0": t, "v.0": t, "k.2": t, "v.2": t}, {"k.0": t, "v.0": t, "x": t},
                {"k.00": t, "v.00": t}):
        with pytest.raises(ValueError):
            tensors_to_kv(bad)
    with pytest.raises(TypeError):
        tensors_to_kv({"k.0": t, "v.0": [0]})
    with pytest.raises(TypeError):
        kv_to_tensors([(t,)])
    with pytest.raises(TypeError):
        kv_to_tensors([(t, "v")])
    assert tensors_to_kv({}) == []


def _patch(storage: str) -> kp.ChunkPatch:
    g = torch.Generator().manual_seed(3)
    fk = kp.fit(torch.randn(9, 2, 4, generator=g), 3)
    fv = kp.fit(torch.randn(9, 2, 4, generator=g), 2)

    def q(f: kp.Factors, head: int = 1) -> kp.Factors:  # mixed: `head` int8 components, the rest 4-bit
        return kp.quantize(f, storage, head) if storage == "mixed" else kp.quantize(f, storage)

    layers = (kp.LayerPatch(q(fk), None), kp.LayerPatch(None, None),
              kp.LayerPatch(q(fk, 0), q(fv)), kp.LayerPatch(None, q(fv)),
              kp.LayerPatch(None, None))
    return kp.ChunkPatch(layers, "query")


def _same_factors(a: kp.Factors | None, b: kp.Factors | None) -> bool:
    if a is None or b is None:
        return a is b
    def parts(f: kp.Factors) -> dict[str, torch.Tensor]:
        named = (("u", f.u), ("vt", f.vt), ("us", f.u_scale), ("vs", f.vt_scale), ("u4", f.u4), ("vt4", f.vt4))
        return {n: t for n, t in named if t is not None}

    return same(parts(a), parts(b))


@pytest.mark.parametrize("storage", ["fp16", "bf16", "int8", "fp32", "mixed"])
def test_patch_round_trip_through_disk(tmp_path, storage):
    p = _patch(storage)
    d, meta = patch_to_tensors(p)
    key = patch_key(ChunkKey.of("m", "t", [1]), [ChunkKey.of("m", "t", [0])], 3, p.method)
    ChunkStore(tmp_path, model_fingerprint="m").put(key, d, meta | {"extra": 1})
    got = ChunkStore(tmp_path, model_fingerprint="m").get(key)
    assert got is not None
    q = tensors_to_patch(*got)
    assert q.method == p.method and len(q.layers) == len(p.layers) == 5 and q.ranks() == p.ranks()
    for la, lb in zip(p.layers, q.layers):
        assert _same_factors(la.k, lb.k) and _same_factors(la.v, lb.v)
    if storage == "int8":
        assert q.layers[0].k.u_scale is not None and q.layers[0].k.u.dtype == torch.int8
    if storage == "mixed":  # 1 + 2 and 0 + 3 int8 + 4-bit components on K, 1 + 1 on V
        assert [(f.rank, f.int4_rank) for f in (q.layers[0].k, q.layers[2].k, q.layers[2].v)] == [(3, 2), (3, 3), (2, 1)]
        assert torch.equal(q.layers[2].k.dense(), p.layers[2].k.dense())
    assert q.nbytes == p.nbytes


def test_tensors_to_patch_rejects_bad_input():
    d, meta = patch_to_tensors(_patch("int8"))
    for bad in ({"format": "x"}, {"num_layers": -1}, {"num_layers": 2}, {"method": 3}):
        bad_meta = {**meta, **bad}
        with pytest.raises(ValueError):
            tensors_to_patch(d, bad_meta)
    with pytest.raises(ValueError):
        tensors_to_patch({k: v for k, v in d.items() if k != "p.0.k.u_scale"}, meta)  # one scale missing
    with pytest.raises(ValueError):
        tensors_to_patch({**d, "p.0.k.w": d["p.0.k.u"]}, meta)
    with pytest.raises(TypeError):
        patch_to_tensors("not a patch")  # type: ignore[arg-type]
