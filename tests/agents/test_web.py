"""BrowserEnv against real Chromium and pages served from 127.0.0.1 by a server in this module."""

from __future__ import annotations

import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from agents.base import ActionError, Env, EnvError
from agents.web import BrowserEnv
from tests.support import send_html

VIEWPORT = (640, 480)

PAGES = {
    "/a.html": """<!doctype html><html><head><title>Page A</title><style>
      @keyframes spin { from { transform: rotate(0deg); } to { transform: rotate(360deg); } }
      .spinner { width: 40px; height: 40px; background: #c33; animation: spin 0.7s linear infinite; }
      a:hover { background: yellow; }
    </style></head><body>
      <h1>Harbour notes</h1><p>Anja Roth is the harbour master.</p><div class="spinner"></div>
      <a href="/b.html">Next page</a>
      <a href="http://elsewhere.test/x.html">Elsewhere</a>
      <a href="file:///etc/hostname">Local file</a>
      <form action="/search" method="get"><input name="q" placeholder="Search" autofocus>
      <button type="submit">Go</button></form>
    </body></html>""",
    "/b.html": """<!doctype html><html><head><title>Page B</title></head><body>
      <p>Tobias keeps the lighthouse.</p><a href="/a.html">Back to A</a></body></html>""",
    "/jsnav.html": """<!doctype html><html><head><title>Script page</title></head><body>
      <button onclick="location.href='http://elsewhere.test/'">Leave by script</button>
      <button onclick="location.href='/b.html'">Stay by script</button></body></html>""",
    "/dead.html": """<!doctype html><html><head><title>Dead link</title></head><body>
      <a href="/gone.html">Gone</a></body></html>""",
    "/long.html": "<!doctype html><html><head><title>Long</title></head><body>"
    + "".join(f'<p style="height:200px">Paragraph {i}</p>' for i in range(30)) + "</body></html>",
}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        if url.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.test/landing.html")
            self.end_headers()
            return
        if url.path == "/slow.html":
            time.sleep(3)
        if url.path == "/broken.html":
            self.send_error(500)
            return
        if url.path == "/search":
            q = parse_qs(url.query).get("q", [""])[0]
            body = f"<html><head><title>Search</title></head><body><p>Results for {q}</p></body></html>"
        elif url.path == "/slow.html":
            body = "<html><head><title>Slow</title></head><body>late</body></html>"
        else:
            body = PAGES.get(url.path)
        send_html(self, body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def site():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def env(site):
    browser = BrowserEnv(f"{site}/a.html", viewport=VIEWPORT, timeout_s=10)
    yield browser
    browser.close()


def _element(obs, pattern: str) -> int:
    """The number [N] of the first element line matching `pattern` in the text view."""
    for line in obs.text.splitlines():
        m = re.match(r"\[(\d+)\] (.*)", line)
        if m and re.search(pattern, m.group(2)):
            return int(m.group(1))
    raise AssertionError(f"no element matching {pattern!r} in:\n{obs.text}")


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_text_view_lists_numbered_elements(env, site):
    assert isinstance(env, Env)
    obs = env.reset()
    lines = obs.text.splitlines()
    assert lines[0] == "Title: Page A" and lines[1] == f"URL: {site}/a.html"
    assert "Anja Roth is the harbour master." in obs.text
    elements = [line for line in lines if re.match(r"\[\d+\] ", line)]
    assert elements[0] == "[1] link 'Next page' -> /b.html"
    assert "[2] link 'Elsewhere' -> http://elsewhere.test/x.html" in elements
    assert any(re.fullmatch(r"\[\d+\] input 'Search' \(text\)", e) for e in elements)
    assert any(re.fullmatch(r"\[\d+\] button 'Go'", e) for e in elements)
    assert [int(re.match(r"\[(\d+)\]", e).group(1)) for e in elements] == list(range(1, len(elements) + 1))
    assert obs.label == f"{site}/a.html" and obs.meta["url"] == f"{site}/a.html"
    (shot,) = obs.images
    assert shot.size == VIEWPORT and shot.mode == "RGB"
    assert len(shot.getcolors(maxcolors=1 << 20)) > 3  # a rendered page, not a blank image


def test_click_follows_link_and_back_returns(env, site):
    obs = env.reset()
    b = env.act({"action": "click", "element": _element(obs, r"link 'Next page'")})
    assert b.meta["url"] == f"{site}/b.html" and "Tobias keeps the lighthouse." in b.text
    a = env.act({"action": "back"})
    assert a.meta["url"] == f"{site}/a.html" and "Title: Page A" in a.text


def test_type_and_submit_a_form(env, site):
    obs = env.reset()
    box = _element(obs, r"input 'Search'")
    typed = env.act({"action": "type", "element": box, "text": "lighthouse keeper"})
    assert typed.meta["url"] == f"{site}/a.html"
    assert re.search(r"input 'Search' \(text\) = 'lighthouse keeper'", typed.text)
    done = env.act({"action": "type", "element": _element(typed, r"input 'Search'"), "text": "harbour", "submit": True})
    assert done.meta["url"] == f"{site}/search?q=harbour"
    assert "Results for harbour" in done.text


def test_revisit_gives_the_same_content_key(env, site):
    first = env.reset()
    again = env.act({"action": "goto", "url": f"{site}/a.html"})  # reload: animation restarts
    assert again.content_key() == first.content_key()
    other = env.act({"action": "click", "element": _element(again, r"link 'Next page'")})
    assert other.content_key() != first.content_key()
    relative = env.act({"action": "goto", "url": "/a.html"})
    assert relative.content_key() == first.content_key()
    env.act({"action": "click", "element": _element(relative, r"link 'Next page'")})
    back = env.act({"action": "back"})  # hover and focus of the clicked link leave no trace
    assert back.content_key() == first.content_key()


def test_other_host_is_refused(env, site):
    obs = env.reset()
    with pytest.raises(ActionError, match=r"elsewhere\.test.*not in the allow-list"):
        env.act({"action": "goto", "url": "http://elsewhere.test/"})
    with pytest.raises(ActionError, match="allow-list"):
        env.act({"action": "click", "element": _element(obs, r"link 'Elsewhere'")})
    script = env.act({"action": "goto", "url": "/jsnav.html"})
    with pytest.raises(ActionError, match=r"refused to open http://elsewhere\.test/"):
        env.act({"action": "click", "element": _element(script, r"button 'Leave by script'")})
    stay = env.act({"action": "click", "element": _element(script, r"button 'Stay by script'")})
    assert stay.meta["url"] == f"{site}/b.html"  # the tab still works after the refusal


def test_unreachable_url_is_an_action_error_and_the_tab_goes_on(env, site):
    env.reset()
    url = f"http://127.0.0.1:{_closed_port()}/nothing.html"
    with pytest.raises(ActionError, match="connection refused"):
        env.act({"action": "goto", "url": url})
    obs = env.act({"action": "goto", "url": "/b.html"})
    assert obs.meta["url"] == f"{site}/b.html" and "Tobias" in obs.text
    assert env.act({"action": "back"}).meta["url"] == f"{site}/a.html"


def test_redirect_to_another_host_is_refused(env, site):
    env.reset()
    with pytest.raises(ActionError, match=r"refused to open http://elsewhere\.test/landing\.html"):
        env.act({"action": "goto", "url": "/redirect"})
    assert env.act({"action": "goto", "url": "/b.html"}).meta["url"] == f"{site}/b.html"


def test_a_page_answered_with_an_http_error_is_a_failed_navigation_and_the_page_stays(env, site):
    env.reset()
    with pytest.raises(ActionError, match=rf"could not load {site}/missing\.html: the server answered HTTP 404 "
                                          rf"\(Not Found\); the page stayed at {site}/a\.html"):
        env.act({"action": "goto", "url": "/missing.html"})
    with pytest.raises(ActionError, match=r"broken\.html: the server answered HTTP 500 \(Internal Server Error\)"):
        env.act({"action": "goto", "url": "/broken.html"})
    b = env.act({"action": "goto", "url": "/b.html"})
    assert b.meta["status"] == 200 and "HTTP status" not in b.text
    dead = env.act({"action": "goto", "url": "/dead.html"})
    with pytest.raises(ActionError, match=rf"gone\.html: the server answered HTTP 404 .*stayed at {site}/dead\.html"):
        env.act({"action": "click", "element": _element(dead, r"link 'Gone'")})  # a link to a missing page


def test_a_start_page_with_an_error_status_is_still_read(site):
    """`check_reachable` lets a start page answered with 404 through: the agent reads what it says."""
    browser = BrowserEnv(f"{site}/missing.html", viewport=VIEWPORT, timeout_s=10, screenshot=False)
    try:
        obs = browser.reset()
        assert obs.meta["status"] == 404 and "HTTP status: 404" in obs.text
        with pytest.raises(ActionError, match="HTTP 404"):
            browser.act({"action": "goto", "url": "/also-missing.html"})
    finally:
        browser.close()


@pytest.mark.parametrize("url, message", [("http://[::1/x", "Invalid IPv6 URL"),
                                          ("http://127.0.0.1:99999/", "Port out of range")])
def test_a_url_that_cannot_be_parsed_is_an_action_error(env, site, url, message):
    env.reset()
    with pytest.raises(ActionError, match=rf"{re.escape(repr(url))} is not a valid URL \({message}"):
        env.act({"action": "goto", "url": url})
    assert env.act({"action": "goto", "url": "/b.html"}).meta["url"] == f"{site}/b.html"


def test_slow_page_times_out(env, site):
    env.reset()
    env.timeout_s = 1.0  # page loads are fetched with the timeout current at the time
    try:
        with pytest.raises(ActionError, match=r"could not load .*/slow\.html: timed out"):
            env.act({"action": "goto", "url": "/slow.html"})
    finally:
        env.timeout_s = 10.0
    assert env.act({"action": "goto", "url": "/b.html"}).meta["status"] == 200


def test_file_urls_are_refused(env, site):
    obs = env.reset()
    with pytest.raises(ActionError, match="file: scheme is not allowed"):
        env.act({"action": "goto", "url": "file:///etc/hostname"})
    with pytest.raises(ActionError, match="file: scheme is not allowed"):
        env.act({"action": "click", "element": _element(obs, r"link 'Local file'")})
    after = env.act({"action": "click", "element": _element(obs, r"link 'Next page'")})
    assert after.meta["url"] == f"{site}/b.html"  # the tab stayed on page A and still works


def test_scroll_moves_the_view_and_stops_at_the_top(env, site):
    env.reset()
    top = env.act({"action": "goto", "url": "/long.html"})
    assert re.search(r"View: 0-480 of \d+ px \(scroll down for more\)", top.text)
    assert "Paragraph 0" in top.text and "Paragraph 10" not in top.text
    down = env.act({"action": "scroll", "direction": "down"})
    assert re.search(r"View: 384-864 of", down.text) and "Paragraph 0\n" not in down.text
    assert "Paragraph 3" in down.text
    env.act({"action": "scroll", "direction": "up"})
    with pytest.raises(ActionError, match="already at the top"):
        env.act({"action": "scroll", "direction": "up"})


def test_bad_actions_say_what_is_wrong(env):
    obs = env.reset()
    n = len([line for line in obs.text.splitlines() if re.match(r"\[\d+\] ", line)])
    with pytest.raises(ActionError, match=rf"no element \[99\] on this page \(elements: 1-{n}\)"):
        env.act({"action": "click", "element": 99})
    with pytest.raises(ActionError, match="type needs an input"):
        env.act({"action": "type", "element": _element(obs, r"link 'Next page'"), "text": "x"})
    with pytest.raises(ActionError, match="unknown action 'fly'"):
        env.act({"action": "fly"})
    assert set(env.actions()) == {"goto", "click", "type", "scroll", "back"}


def test_start_url_that_cannot_load_is_an_env_error():
    with pytest.raises(EnvError, match="not an http"):
        BrowserEnv("file:///etc/hostname")
    browser = BrowserEnv(f"http://127.0.0.1:{_closed_port()}/", viewport=VIEWPORT, timeout_s=5)
    try:
        with pytest.raises(EnvError, match="start page could not be loaded.*connection refused"):
            browser.reset()
    finally:
        browser.close()


def test_allow_hosts_add_to_the_start_host_and_refusals_state_the_fact():
    browser = BrowserEnv("http://127.0.0.1:9/a.html", allow_hosts=["docs.example.org", "*.example.net", "127.0.0.1"])
    assert browser.allow_hosts == ("127.0.0.1", "docs.example.org", "*.example.net")
    assert browser.allowed("http://127.0.0.1:8000/x") and browser.allowed("https://a.example.net/")
    url = browser.action_arguments()["goto"]["url"]["pattern"]  # what the model may write for a goto
    assert all(re.fullmatch(url, u) for u in ("/b.html", "http://127.0.0.1:8000/x?q=1", "https://docs.example.org/",
                                              "https://a.b.example.net/p"))
    assert not any(re.fullmatch(url, u) for u in ("https://www.google.com/search?q=x", "b.html", "/" + "x" * 80,
                                                  "file:///etc/hostname", "http://example.net.evil.test/"))
    message = str(browser._refusal("http://elsewhere.test/"))
    assert "not in the allow-list (127.0.0.1, docs.example.org, *.example.net)" in message
    assert "stay on the allowed site" not in message


def test_goto_without_a_url_suggests_a_link_of_this_page(env, site):
    env.reset()
    with pytest.raises(ActionError, match=r'goto needs "url", e\.g\. \{"action": "goto", "url": "/b\.html"\}'):
        env.act({"action": "goto"})
    env.act({"action": "goto", "url": "/long.html"})  # no links: the page itself
    with pytest.raises(ActionError, match=r'"url": "/long\.html"'):
        env.act({"action": "goto", "url": " "})


def test_a_failed_navigation_is_the_steps_error_in_the_record_and_the_table(site):
    """What the agent loop makes of a missing page: the step's record holds the error (the page
    stays, so nothing is observed), the model is told, and the printed table shows it whole."""
    from agents.console import steps_table
    from agents.loop import AgentLoop
    from agents.model import ScriptedDecider
    from agentwin import KameraModel, Window

    window = Window(KameraModel.from_pretrained("tiny-llama-gqa"), budget_tokens=2048, rank=None)
    script = ScriptedDecider([{"action": "goto", "url": "/missing.html"}, {"action": "goto", "url": "/b.html"},
                              {"action": "answer", "text": "Tobias"}])
    browser = BrowserEnv(f"{site}/a.html", viewport=VIEWPORT, timeout_s=10, screenshot=False)
    try:
        result = AgentLoop(browser, window, script, "Who keeps the lighthouse?", max_steps=4).run()
    finally:
        browser.close()
    failed, after = result.records[1], result.records[2]
    assert failed.error_kind == "refused" and failed.observation is None and failed.event is None
    assert failed.error == (f"could not load {site}/missing.html: the server answered HTTP 404 (Not Found); "
                            f"the page stayed at {site}/a.html")
    assert f"That action failed: {failed.error}" in script.prompts[1]  # the model is told at the next step
    assert after.error is None and after.observation == f"{site}/b.html"
    assert result.summary.stopped == "answer" and result.summary.refused_actions == 1
    assert f"error: {failed.error}" in steps_table(result.records)
