"""Redis URLs and clients for the remote tier: `redis.Redis` on a bounded pool for one server, or
`redis.cluster.RedisCluster` with `?cluster=1` (any node; db 0 only). Query options that would change the
bounded timeouts, retries or pool size are refused; others (e.g. `ssl_ca_certs`) pass through to redis-py."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

# URL query options redis-py would let override the bounded timeouts, retries and pool size.
_RESERVED_QUERY = frozenset({"socket_timeout", "socket_connect_timeout", "timeout", "max_connections",
                             "retry_on_timeout", "retry_on_error", "retry", "health_check_interval"})
_ON, _OFF = ("1", "true", "yes"), ("0", "false", "no")
FORMS = "redis://[user:password@]host[:port][/db] or rediss://... (TLS), with ?cluster=1 for a Redis Cluster"


def safe_url(url: str) -> str:
    """`url` without its user name and password (for messages)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"


def _cluster_option(url: str) -> tuple[bool, str]:
    """(whether `?cluster=` asks for a cluster, the URL without that option); ValueError on a
    value other than 1/true/yes/0/false/no or a repeated option."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    values = [v.lower() for k, v in query if k == "cluster"]
    if len(values) > 1 or any(v not in _ON + _OFF for v in values):
        raise ValueError(f"url option cluster must be given once as 1 (a Redis Cluster) or 0, got {values}")
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return bool(values) and values[0] in _ON, urlunsplit(parts._replace(query=rest))


def check_url(url: object) -> str:
    """`url` if it is a redis:// or rediss:// URL with a host, no reserved query option and (for a cluster) db 0;
    else ValueError/TypeError naming the accepted forms."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str ({FORMS}), got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"url must be {FORMS}, got {safe_url(url) if '://' in url else url!r}")
    reserved = sorted(_RESERVED_QUERY & {k for k, _ in parse_qsl(parts.query, keep_blank_values=True)})
    if reserved:
        raise ValueError(f"url query options {reserved} are set by RedisTier (timeout_s, max_connections; "
                         "no client retries); pass them as RedisTier / open_store arguments instead")
    cluster, _ = _cluster_option(url)
    if cluster and parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only; drop {parts.path!r} from {safe_url(url)}")
    return url


def is_cluster(url: str) -> bool:
    """Whether a checked `url` names a Redis Cluster (`?cluster=1`)."""
    return _cluster_option(url)[0]


def plain_client(redis: Any, url: str, timeout_s: float, max_connections: int) -> Any:
    """A `redis.Redis` on a blocking pool for one server: connects on first command; every connect, socket
    read/write and pool wait bounded by `timeout_s` seconds; no retries."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), health_check_interval=0)
    return redis.Redis(connection_pool=pool)


def cluster_client(redis: Any, url: str, timeout_s: float, max_connections: int) -> Any:
    """A `redis.cluster.RedisCluster` through the URL's node (connects: it asks for the slot map), bounded like
    `plain_client` with a pool per node; `require_full_coverage=False` keeps live nodes' slots usable."""
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    _, stripped = _cluster_option(url)
    return RedisCluster.from_url(
        stripped, retry=Retry(NoBackoff(), 0), require_full_coverage=False, max_connections=max_connections,
        connection_pool_class=redis.BlockingConnectionPool, timeout=timeout_s, socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s)
