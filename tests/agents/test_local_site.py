"""The static site the web benchmarks browse: index, pages, search and 404, on 127.0.0.1."""

import urllib.error
import urllib.request

import pytest

from agents.local_site import serve


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_serves_pages_index_search_and_404_then_stops():
    with serve({"/index.html": "<p>home</p>", "/a.html": "<p>a</p>"}) as base:
        assert base.startswith("http://127.0.0.1:")
        assert _get(f"{base}/") == "<p>home</p>"
        assert _get(f"{base}/a.html?x=1") == "<p>a</p>"
        assert "No results for tides" in _get(f"{base}/search?q=tides")
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(f"{base}/missing.html")
        assert err.value.code == 404
    with pytest.raises(urllib.error.URLError):
        _get(f"{base}/a.html")


def test_a_site_with_its_own_root_page_serves_it():
    with serve({"/": "<p>root</p>", "/index.html": "<p>index</p>"}) as base:
        assert _get(f"{base}/") == "<p>root</p>"
