"""Shared helpers for the store tests: deterministic values per key, bitwise comparison, running
a store script in a child process (sys.executable with the repo on PYTHONPATH), and real Redis
servers started by the tests themselves: a plain or TLS redis-server (`Server`, certificates from
`make_certs`) and a local Redis Cluster of three nodes (`Cluster`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentwin.store import ChunkKey

REPO = Path(__file__).resolve().parents[3]
FP = "fp-test"


def key(i: int, fp: str = FP, tenant: str = "") -> ChunkKey:
    return ChunkKey.of(fp, "text", [i], tenant=tenant)


def value(i: int, numel: int, version: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic tensors for entry i (what the child writers write, so tests can recompute)."""
    g = torch.Generator().manual_seed(i * 1000 + version)
    return {"x": torch.randn(numel, generator=g), "i": torch.tensor([i, version], dtype=torch.int64)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two named-tensor dicts (NaN == NaN; dtype and shape must match)."""
    if a.keys() != b.keys():
        return False
    for n in a:
        x, y = a[n].cpu(), b[n].cpu()
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() and not torch.equal(x.contiguous().reshape(-1).view(torch.uint8),
                                         y.contiguous().reshape(-1).view(torch.uint8)):
            return False
    return True


# A child process writing entries `start..start+count-1` of `numel` float32 each, printing each
# index after its put returned (= committed). With argv[6] = "replace:N" it SIGKILLs itself just
# before its N-th os.replace; with "unlink-json:N", just after its N-th unlink of a sidecar (an
# eviction, before the data file goes).
WRITER = """
import os, pathlib, signal, sys
from agentwin.store import ChunkStore
from tests.agentwin.store._support import FP, key, value
root, start, count, numel, disk = sys.argv[1], *map(int, sys.argv[2:6])
if len(sys.argv) > 6:
    what, n = sys.argv[6].split(":")
    calls = [0]
    def crash_when(counted, before):
        def wrapper(*a, **k):
            counted_now = counted(*a)
            calls[0] += counted_now
            if before and calls[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)
            out = orig[what](*a, **k)
            if not before and counted_now and calls[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return wrapper
    orig = {"replace": os.replace, "unlink-json": pathlib.Path.unlink}
    if what == "replace":
        os.replace = crash_when(lambda *a: 1, before=True)
    else:
        pathlib.Path.unlink = crash_when(lambda p, *a: int(p.name.endswith(".json")), before=False)
s = ChunkStore(root, ram_bytes=8 << 20, disk_bytes=disk, model_fingerprint=FP)
for i in range(start, start + count):
    s.put(key(i), value(i, numel), {"i": i})
    print(i, flush=True)
"""


def child(code: str, *args: object, wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", code, *map(str, args)]
    if wait:
        return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---- real Redis servers ---------------------------------------------------------------------

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require(tool: str) -> None:
    """Fails the test with a clear reason when a server binary the test starts is missing."""
    if not os.access(tool, os.X_OK):
        pytest.fail(f"{tool} is not installed (the remote-tier tests start real Redis servers): run "
                    "scripts/setup.sh, which installs Debian's redis-server and redis-cli")


def make_certs(folder: Path) -> dict[str, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 signed by it (openssl command line,
    EC P-256 keys): {"ca", "cert", "key"}."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command line is needed to make the TLS test certificates")
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key, cert, key_, csr = (folder / n for n in ("ca.pem", "ca.key", "server.pem", "server.key", "server.csr"))
    ext = folder / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (["openssl", "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=agentwin test CA"],
                ["openssl", "req", *ec, "-keyout", key_, "-out", csr, "-subj", "/CN=127.0.0.1"],
                ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                 "-days", "2", "-extfile", ext]):
        subprocess.run([str(c) for c in cmd], check=True, capture_output=True, timeout=30)
    return {"ca": ca, "cert": cert, "key": key_}


class Server:
    """A redis-server child on 127.0.0.1:`port` (no RDB, no AOF, LRU eviction, data dir `root`);
    with `tls` (make_certs' files) it listens with TLS only on that port (`--port 0`)."""

    def __init__(self, root: Path, port: int | None = None, extra: tuple[str, ...] = (),
                 tls: dict[str, Path] | None = None) -> None:
        require(REDIS_SERVER)
        self.root, self.port = root, port or free_port()
        self.extra, self.tls = extra, tls
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls['ca']}"
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        if self.tls is not None:
            return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10, ssl=True,
                               ssl_ca_certs=str(self.tls["ca"]))
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def start(self) -> "Server":
        import redis

        self.root.mkdir(parents=True, exist_ok=True)
        listen = ["--port", str(self.port)]
        if self.tls is not None:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls["cert"]),
                      "--tls-key-file", str(self.tls["key"]), "--tls-ca-cert-file", str(self.tls["ca"]),
                      "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen(
            [REDIS_SERVER, *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root), "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """A local Redis Cluster: `n` redis-server nodes with cluster mode on (free ports, one temp
    dir each, no persistence, node timeout 500 ms, full coverage not required, so the nodes that
    are up keep serving their slots while another is down), joined by `redis-cli --cluster create`
    with no replicas."""

    def __init__(self, root: Path, n: int = 3) -> None:
        require(REDIS_CLI)
        extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "500",
                 "--cluster-require-full-coverage", "no")
        # The cluster bus port is given too: its default, port + 10000, may be taken or past 65535.
        self.nodes = [Server(root / f"node{i}", extra=(*extra, "--cluster-port", str(free_port()))) for i in range(n)]

    def url(self, i: int = 0) -> str:
        return f"redis://127.0.0.1:{self.nodes[i].port}/0?cluster=1"

    def name(self, i: int) -> str:
        return f"127.0.0.1:{self.nodes[i].port}"

    def start(self) -> "Cluster":
        try:
            for node in self.nodes:
                node.start()
            subprocess.run([REDIS_CLI, "--cluster", "create", *(self.name(i) for i in range(len(self.nodes))),
                            "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
            deadline = time.monotonic() + 20
            while not all(n.client().cluster("info")["cluster_state"] == "ok" for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the local Redis Cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def client(self):
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=10, require_full_coverage=False)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
