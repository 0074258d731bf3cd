"""Content keys: `ChunkKey` (sha256 of what determines a chunk's canonical KV) and `patch_key`. Every field is
length-prefixed behind a domain tag, so no two different inputs hash the same byte stream."""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
import struct
from array import array
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from types import MappingProxyType
from typing import NewType

import torch

Digest = NewType("Digest", str)  # 64 lowercase hex characters

_HEX64 = re.compile(r"[0-9a-f]{64}")
_CHUNK_DOMAIN = b"agentwin.ChunkKey/1"
_PATCH_DOMAIN = b"agentwin.PatchKey/1"
_EMPTY: Mapping[str, object] = MappingProxyType({})


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _hash(domain: bytes, fields: Sequence[bytes]) -> Digest:
    h = hashlib.sha256(_field(domain))
    for f in fields:
        h.update(_field(f))
    return Digest(h.hexdigest())


def _text(value: object, what: str, allow_empty: bool = True) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} {value!r}")
    if not allow_empty and not value:
        raise ValueError(f"{what} must be a non-empty string")
    return value.encode("utf-8", "surrogatepass")


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a dense tensor, in row-major order (copied to CPU)."""
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"only dense (strided, unquantised) tensors can be hashed, got layout {t.layout}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()  # view(uint8): every dtype incl. bf16 / bool


def _content(content: object) -> list[bytes]:
    """(kind tag, payload...) for the three content forms; the tag keeps forms apart."""
    if isinstance(content, (bytes, bytearray, memoryview)):
        return [b"bytes", bytes(content)]
    if isinstance(content, torch.Tensor):
        shape = ",".join(str(s) for s in content.shape)
        return [b"tensor", str(content.dtype).encode(), shape.encode(), tensor_bytes(content)]
    if isinstance(content, (str, Mapping)) or not isinstance(content, Sequence):
        raise TypeError(
            "content must be bytes, a sequence of int token ids or a torch.Tensor, "
            f"got {type(content).__name__}"
        )
    for i, x in enumerate(content):
        if isinstance(x, bool) or not hasattr(x, "__index__"):
            raise TypeError(f"content[{i}] must be an int token id, got {type(x).__name__} {x!r}")
    try:
        ids = array("q", (operator.index(x) for x in content))
    except OverflowError:
        raise ValueError("content token ids must fit in int64") from None
    if ids.itemsize != 8:  # pragma: no cover - array('q') is 8 bytes on every supported platform
        raise RuntimeError("array('q') is not 8 bytes wide; this indicates a bug")
    if struct.pack("=H", 1) != struct.pack("<H", 1):  # pragma: no cover - big-endian host
        ids.byteswap()
    return [b"ids", ids.tobytes()]


def _check_json_keys(value: object, where: str) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} keys must be str, got {type(k).__name__} {k!r}")
            _check_json_keys(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json_keys(v, f"{where}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value!r}")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise TypeError(f"{where} must be JSON-able (str, int, float, bool, None, list, dict), "
                        f"got {type(value).__name__}")


def canonical_json(value: Mapping[str, object], what: str) -> str:
    """Sorted-key compact JSON of a str-keyed mapping, tuples as lists; TypeError/ValueError name the bad entry."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping with str keys, got {type(value).__name__}")
    _check_json_keys(value, what)
    return json.dumps(dict(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Content address of a chunk or a patch: `digest`, the sha256 as 64 lowercase hex characters."""

    digest: str

    def __post_init__(self) -> None:
        if not isinstance(self.digest, str) or not _HEX64.fullmatch(self.digest):
            raise ValueError(f"ChunkKey.digest must be 64 lowercase hex characters, got {self.digest!r}")

    def __str__(self) -> str:
        return self.digest[:16]

    @staticmethod
    def of(
        model_fingerprint: str,
        modality: str,
        content: bytes | Sequence[int] | torch.Tensor,
        settings: Mapping[str, object] = _EMPTY,
        tenant: str = "",
    ) -> ChunkKey:
        """sha256 of (model fingerprint, modality, content, settings, tenant), each length-prefixed. content: bytes, int
        token ids (as int64) or a tensor (dtype, shape and bytes: it keys apart from the same ids as a list); settings:
        JSON-able with str keys, hashed as sorted canonical JSON; tenant: a salt (another tenant, another key)."""
        fields = [
            _text(model_fingerprint, "model_fingerprint"),
            _text(modality, "modality", allow_empty=False),
            *_content(content),
            canonical_json(settings, "settings").encode("utf-8"),
            _text(tenant, "tenant"),
        ]
        return ChunkKey(_hash(_CHUNK_DOMAIN, fields))


def check_key(key: object, what: str = "key") -> ChunkKey:
    if not isinstance(key, ChunkKey):
        raise TypeError(f"{what} must be a ChunkKey, got {type(key).__name__} {key!r}")
    return key


def patch_key(
    chunk: ChunkKey,
    antecedent: Sequence[ChunkKey] | frozenset[ChunkKey],
    rank: int | None,
    method: str,
) -> ChunkKey:
    """Key of a patch of `chunk`: its antecedent, rank (None: exact) and fit method. A sequence antecedent is ordered
    (origin, fresh patches), a set is order-free (orbit); the same keys as sequence and as set give different keys."""
    check_key(chunk, "chunk")
    if isinstance(antecedent, Set):
        keys = [check_key(k, "antecedent element") for k in antecedent]
        kind, digests = b"set", sorted(k.digest for k in keys)
    elif isinstance(antecedent, Sequence) and not isinstance(antecedent, (str, bytes)):
        kind, digests = b"seq", [check_key(k, f"antecedent[{i}]").digest for i, k in enumerate(antecedent)]
    else:
        raise TypeError(f"antecedent must be a sequence or frozenset of ChunkKeys, got {type(antecedent).__name__}")
    if rank is None:
        rank_field = b"exact"
    elif isinstance(rank, bool) or not hasattr(rank, "__index__"):
        raise TypeError(f"rank must be an int or None, got {type(rank).__name__} {rank!r}")
    elif (r := operator.index(rank)) < 0:
        raise ValueError(f"rank must be >= 0 or None, got {r}")
    else:
        rank_field = b"rank:%d" % r
    fields = [chunk.digest.encode(), kind, str(len(digests)).encode(), *(d.encode() for d in digests),
              rank_field, _text(method, "method", allow_empty=False)]
    return ChunkKey(_hash(_PATCH_DOMAIN, fields))
