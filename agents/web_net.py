"""The web agent's network side: reasons for failed loads, the shared Playwright driver, and the
start URL's checks (scheme, reachability) that run before a browser or a model is started."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from agents.base import EnvError

_NET_ERRORS = {
    "ECONNREFUSED": "connection refused (nothing listens there; is the server running and the port right?)",
    "ERR_CONNECTION_REFUSED": "connection refused (nothing listens there; is the server running and the port right?)",
    "ENOTFOUND": "the host name does not resolve (check the spelling)",
    "EAI_AGAIN": "the host name does not resolve (check the spelling, or the network)",
    "ERR_NAME_NOT_RESOLVED": "the host name does not resolve (check the spelling)",
    "ECONNRESET": "the connection was reset by the server",
    "EHOSTUNREACH": "the host is unreachable",
    "ENETUNREACH": "the network is unreachable",
    "ERR_UNSAFE_PORT": "the browser refuses that port as unsafe",
    "ERR_CERT": "the server's TLS certificate is not valid",
    "Connection refused": "connection refused (nothing listens there; is the server running and the port right?)",
    "Name or service not known": "the host name does not resolve (check the spelling)",
    "Temporary failure in name resolution": "the host name does not resolve (check the spelling, or the network)",
    "No route to host": "the host is unreachable",
    "Timeout": "timed out",
    "timed out": "timed out",
}


_DRIVERS = threading.local()  # one Playwright driver per thread, shared by that thread's browsers


def acquire_driver() -> Any:
    from playwright.sync_api import sync_playwright

    if getattr(_DRIVERS, "pw", None) is None:
        _DRIVERS.pw, _DRIVERS.users = sync_playwright().start(), 0
    _DRIVERS.users += 1
    return _DRIVERS.pw


def release_driver() -> None:
    if getattr(_DRIVERS, "pw", None) is None:
        return
    _DRIVERS.users -= 1
    if _DRIVERS.users <= 0:
        pw, _DRIVERS.pw = _DRIVERS.pw, None
        pw.stop()


def reason(message: str) -> str:
    for code, text in _NET_ERRORS.items():
        if code in message:
            return text
    return message.strip().splitlines()[0][:200] if message.strip() else "unknown error"


def check_start_url(url: str) -> str:
    """The start URL's host; `EnvError` unless it is an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EnvError(f"start URL {url!r} is not an http(s) URL; the browser visits web pages "
                       f"only (file:// and other schemes are refused)")
    return parts.hostname.lower()


def check_reachable(url: str, timeout_s: float = 10.0) -> None:
    """`EnvError` unless a server answers at `url` (any HTTP status counts as an answer): checked
    before a model or a browser is started. No proxy is used, as in the browser."""
    check_start_url(url)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "agentwin"}), timeout=timeout_s) as r:
            r.read(1)
    except urllib.error.HTTPError:
        return  # the server answered (a 404 page is still a page the agent can read)
    except (urllib.error.URLError, OSError, ValueError) as err:
        why = getattr(err, "reason", err)
        raise EnvError(f"the start page {url} cannot be reached ({reason(str(why))}); check that the server "
                       f"is running and the address is right") from None
