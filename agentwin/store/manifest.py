"""The remote tier's manifest: its fields, their canonical JSON and its checked parse."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

from agentwin.store.tiers import DTYPES

FORMAT = "agentwin.store.remote/1"
HEX64 = re.compile(r"[0-9a-f]{64}")
TOKEN = re.compile(r"[0-9a-f]{16}")
MANIFEST_FIELDS = frozenset({"format", "digest", "model_fingerprint", "tenant", "token", "size", "sha256", "parts",
                              "tensors", "nbytes", "meta", "created"})


@dataclass(frozen=True, slots=True)
class Manifest:
    """One remote entry's manifest as read back: write token, payload size and sha256, part sizes, tensor specs,
    tensor bytes and meta (canonical JSON)."""

    token: str
    size: int
    sha256: str
    parts: tuple[int, ...]
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype name, shape)
    nbytes: int
    meta_json: str


def field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def canonical(o: object) -> bytes:
    return json.dumps(o, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def parse_manifest(body: bytes, digest: str) -> tuple[Manifest, str, str] | None:
    """(manifest, fingerprint, tenant) from the manifest JSON, or None when malformed."""
    try:
        o = json.loads(body)
        specs = {n: (s["dtype"], tuple(s["shape"])) for n, s in o["tensors"].items()}
        parts = tuple(o["parts"])
        ok = (set(o) == MANIFEST_FIELDS and o["format"] == FORMAT and o["digest"] == digest
              and isinstance(o["model_fingerprint"], str)
              and isinstance(o["tenant"], str) and isinstance(o["token"], str) and TOKEN.fullmatch(o["token"])
              and isinstance(o["sha256"], str) and HEX64.fullmatch(o["sha256"])
              and all(type(o[f]) is int and o[f] >= 0 for f in ("size", "nbytes"))
              and all(type(p) is int and p > 0 for p in parts) and sum(parts) == o["size"]
              and isinstance(o["meta"], dict) and type(o["created"]) in (int, float)
              and all(d in DTYPES and all(type(x) is int and x >= 0 for x in sh) for d, sh in specs.values()))
        if not ok:
            return None
        m = Manifest(o["token"], o["size"], o["sha256"], parts, specs, o["nbytes"],
                     canonical(o["meta"]).decode("utf-8"))
        return m, o["model_fingerprint"], o["tenant"]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
