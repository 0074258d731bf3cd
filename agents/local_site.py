"""A static site served on 127.0.0.1 at a free port: the pages the web agent's benchmarks and step
timings browse (no network beyond this machine).

    with serve({"/index.html": "<html>…</html>", "/a.html": "…"}) as base:
        BrowserEnv(f"{base}/index.html")

"/" serves "/index.html" (or "/" when the site names it); "/search?q=…" answers "No results" when
the site has no page of that path; any other path not in the site is a 404.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator


def _page(pages: dict[str, str], raw_path: str) -> str | None:
    path = raw_path.split("?")[0]
    if path == "/" and "/" not in pages:
        path = "/index.html"
    body = pages.get(path)
    if body is None and path == "/search":
        q = raw_path.partition("q=")[2]
        body = f"<html><head><title>Search</title></head><body><p>No results for {q}.</p></body></html>"
    return body


def send_html(handler: BaseHTTPRequestHandler, body: str | None) -> None:
    """Answer an http.server request with `body` as UTF-8 HTML, or 404 when it is None."""
    if body is None:
        handler.send_error(404)
        return
    data = body.encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "text/html; charset=utf-8")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@contextmanager
def serve(pages: dict[str, str]) -> Iterator[str]:
    """Serve `pages` (path -> HTML) until the block ends; yields the base URL (no trailing slash)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            send_html(self, _page(pages, self.path))

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
