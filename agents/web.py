"""A web browser as an agent environment: Playwright driving the system's Chromium, headless.

Each observation is the viewport's screenshot (PIL, for vision-language models) and a compact text
view of the page (for text-only models and for grounding):

    Title: Search results
    URL: http://127.0.0.1:8000/a.html
    View: 0-800 of 2400 px (scroll down for more)
    Text:
    Results for "harbour" ...
    Elements:
    [1] link 'Next page' -> /b.html
    [2] input 'Search' (text)
    [3] button 'Go'

Actions: goto {url}, click {element}, type {element, text, submit?}, scroll {direction: up|down},
back. Element numbers refer to the last observation.

Only http(s) pages on allowed hosts are visited: the start URL's host (any port) and the hosts in
`allow_hosts`.
`goto` to another host or scheme (file://, data:, chrome:) is refused with `ActionError`; so is a
link to one; a navigation that a click, a form, a script or a redirect starts towards one is stopped
by request interception, and the page stays where it was. Requests for other hosts' images, scripts and styles
are blocked too (the agent sees only allowed content and the browser stays offline). Page loads go
through Playwright's request interception, so an unreachable URL, a timeout or a page the server
answers with an HTTP error status (4xx, 5xx) leaves the page where it was and gives an `ActionError`
saying why, which the loop records as the step's error; a URL that cannot be parsed is an
`ActionError` too. The start page is the exception: an error status there is read as a page (it is
all there is to read). `EnvError` when the start URL cannot be loaded or the browser cannot start.

Screenshots are deterministic for the same page state (fixed viewport and scale, animations
stopped, caret hidden, focus rings hidden, the mouse parked in a corner), so a revisited page gives
the same `Observation.content_key()` and its chunk is recalled instead of encoded again.

Playwright's sync API ties the browser to the thread that started it: use one `BrowserEnv` from
one thread, and not inside a running asyncio event loop. The scripts run in the page and the
element lines are in `agents.web_page`; network errors, the shared driver and the start URL's
checks (`check_reachable`, run before a model is loaded) in `agents.web_net`.
"""

from __future__ import annotations

import io
import re
import shutil
import tempfile
from typing import Any
from urllib.parse import urljoin, urlsplit

from PIL import Image

from agents.base import ActionError, EnvError, Observation
from agents.web_net import acquire_driver, check_reachable, check_start_url, reason, release_driver
from agents.web_page import INIT_SCRIPT, OBSERVE_JS, SCREENSHOT_STYLE, describe_element

__all__ = ["BrowserEnv", "CHROMIUM", "check_reachable"]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic",
    "--hide-scrollbars", "--font-render-hinting=none",
)


def _status_phrase(status: int, text: str) -> str:
    """The reason phrase of an HTTP status: the server's, else the standard one."""
    from http import HTTPStatus

    if text:
        return text
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"


class BrowserEnv:
    """A headless Chromium tab on allowed hosts (see the module docstring).

    `allow_hosts`: host names (any port) that may be visited besides the start URL's host,
    `"*.example.org"` for a domain and its subdomains. `timeout_s` bounds every page load and action.
    `screenshot=False` gives text-only observations."""

    name = "web"

    def __init__(self, start_url: str, allow_hosts: list[str] | tuple[str, ...] | None = None,
                 viewport: tuple[int, int] = (1280, 800), timeout_s: float = 15,
                 screenshot: bool = True, max_text_chars: int = 2000, max_elements: int = 60,
                 executable_path: str = CHROMIUM) -> None:
        start_host = check_start_url(start_url)
        self.start_url = start_url
        extra = [h.lower().strip() for h in (allow_hosts or ()) if h and h.strip()]
        self.allow_hosts = tuple(dict.fromkeys([start_host, *extra]))
        self.viewport = (int(viewport[0]), int(viewport[1]))
        self.timeout_s = float(timeout_s)
        self.screenshot = bool(screenshot)
        self.max_text_chars = int(max_text_chars)
        self.max_elements = int(max_elements)
        self.executable_path = executable_path
        self._pw = self._ctx = self._page = None
        self._profile: str | None = None
        self._elements: dict[int, dict[str, Any]] = {}
        self._refused: list[str] = []  # navigations stopped by the allow-list during this action
        self._failed: list[tuple[str, str]] = []  # navigations that could not load: (url, reason)
        self._dialogs: list[str] = []
        self._status: int | None = None
        self._last_url: str | None = None
        self._starting = False  # loading the start page: an HTTP error status is still a page to read

    # the allow-list -----------------------------------------------------------------------------
    def allowed(self, url: str) -> bool:
        """Whether `url` may be visited: http(s) on an allowed host."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        host = parts.hostname.lower()
        for entry in self.allow_hosts:
            if entry.startswith("*."):
                if host == entry[2:] or host.endswith(entry[1:]):
                    return True
            elif host == entry:
                return True
        return False

    def _refusal(self, url: str) -> ActionError:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            why = f"the {parts.scheme or 'empty'}: scheme is not allowed (only http and https pages)"
        else:
            why = f"host {parts.hostname!r} is not in the allow-list ({', '.join(self.allow_hosts)})"
        return ActionError(f"refused to open {url}: {why}; only pages on the allowed hosts are opened")

    # browser life cycle ---------------------------------------------------------------------------
    def _start(self) -> None:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError as e:
            raise EnvError(f"Playwright is not installed ({e}); run `make setup`") from None
        if shutil.which(self.executable_path) is None:
            raise EnvError(f"Chromium not found at {self.executable_path}; install it "
                           f"(`apt-get install chromium`) or pass executable_path=")
        self._profile = tempfile.mkdtemp(prefix="agentwin-chromium-")
        try:
            self._pw = acquire_driver()
            self._ctx = self._pw.chromium.launch_persistent_context(
                self._profile, executable_path=self.executable_path, headless=True, args=list(CHROMIUM_ARGS),
                viewport={"width": self.viewport[0], "height": self.viewport[1]}, device_scale_factor=1,
                accept_downloads=False, reduced_motion="reduce", service_workers="block",
                timeout=self.timeout_s * 1000 * 2)
        except Exception as e:
            self.close()
            if "asyncio loop" in str(e):
                raise EnvError("BrowserEnv uses Playwright's sync API, which cannot run inside an asyncio "
                               "event loop (e.g. a notebook cell); run it in a plain thread") from None
            raise EnvError(f"Chromium at {self.executable_path} did not start: {reason(str(e))}") from None
        self._ctx.set_default_timeout(self.timeout_s * 1000)
        self._ctx.set_default_navigation_timeout(self.timeout_s * 1000)
        self._ctx.add_init_script(INIT_SCRIPT)
        self._ctx.route("**/*", self._route)
        self._page = self._ctx.pages[0] if self._ctx.pages else self._ctx.new_page()
        self._page.on("dialog", self._dialog)

    def _route(self, route: Any) -> None:
        """Every request: other hosts' are stopped; page loads are fetched here, so a failure leaves
        the page where it was (a 204 answer) and the action reports why."""
        from playwright.sync_api import Error as PWError

        request = route.request
        navigation = request.is_navigation_request() and request.frame.parent_frame is None
        if not self.allowed(request.url):
            if navigation:
                self._refused.append(request.url)
                route.fulfill(status=204, body="")
            else:
                route.abort("blockedbyclient")
            return
        if not navigation:
            route.continue_()
            return
        try:
            # No redirects followed here: the browser follows them, through this check again.
            response = route.fetch(max_redirects=0, timeout=self.timeout_s * 1000)
        except PWError as e:
            self._failed.append((request.url, reason(str(e))))
            route.fulfill(status=204, body="")
            return
        location = response.headers.get("location")
        if 300 <= response.status < 400 and location:
            # The browser follows a fulfilled redirect without routing the next request: the
            # target is checked here.
            target = urljoin(request.url, location)
            if not self.allowed(target):
                self._refused.append(target)
                route.fulfill(status=204, body="")
                return
        if response.status >= 400 and not self._starting:
            # The page stays where it was and the action fails, saying so: a model shown the error
            # page as a new observation (with no error) asks for it again.
            self._failed.append((request.url, f"the server answered HTTP {response.status} "
                                              f"({_status_phrase(response.status, response.status_text)})"))
            route.fulfill(status=204, body="")
            return
        self._status = response.status
        route.fulfill(response=response)

    def _dialog(self, dialog: Any) -> None:
        self._dialogs.append(f"{dialog.type}: {dialog.message[:200]}")
        dialog.dismiss()

    def reset(self) -> Observation:
        """Start the browser (first call) and load the start URL; `EnvError` when it cannot load."""
        if self._page is None:
            self._start()
        self._starting = True
        try:
            self._navigate(self.start_url)
        except (ActionError, EnvError) as e:
            self.close()
            raise EnvError(f"the start page could not be loaded: {e}") from None
        finally:
            self._starting = False
        return self._observe()

    def close(self) -> None:
        try:
            if self._ctx is not None:
                self._ctx.close()
        except Exception:
            pass  # already gone
        if self._pw is not None:
            try:
                release_driver()
            except Exception:
                pass
        self._ctx = self._pw = self._page = None
        if self._profile:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None

    def __enter__(self) -> "BrowserEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_profile", None):
            shutil.rmtree(self._profile, ignore_errors=True)

    # actions --------------------------------------------------------------------------------------
    def actions(self) -> dict[str, str]:
        return {
            "goto": '{"url": URL} - open a page on the allowed site (a path is relative to this page)',
            "click": '{"element": N} - click element [N] of the last observation',
            "type": '{"element": N, "text": "...", "submit": false} - fill input [N] (or choose an option '
                    'of select [N]); submit: press Enter afterwards',
            "scroll": '{"direction": "down"} - scroll the page down or up by most of a screen',
            "back": "{} - go back to the previous page",
        }

    def action_arguments(self) -> dict[str, dict[str, Any]]:
        """Argument schemas refining `actions()` for decoding under a schema (`agents.grammar`):
        a goto URL is a path on this site or an http(s) URL on an allowed host, of bounded length
        (a model cannot write a URL that would be refused), and scroll goes up or down."""
        hosts = "|".join(r"([a-z0-9-]+\.)*" + re.escape(h[2:]) if h.startswith("*.") else re.escape(h)
                         for h in self.allow_hosts)
        path = r"/[A-Za-z0-9._~!$&'()*+,;=:@%/?#-]{0,48}"
        url = rf"^({path}|https?://({hosts})(:[0-9]{{1,5}})?({path})?)$"
        return {"goto": {"url": {"type": "string", "pattern": url}},
                "scroll": {"direction": {"enum": ["down", "up"]}}}

    def act(self, action: dict[str, Any]) -> Observation:
        from playwright.sync_api import Error as PWError, TimeoutError as PWTimeout

        if self._page is None:
            raise EnvError("the browser is not running; call reset() first")
        if not isinstance(action, dict) or "action" not in action:
            raise ActionError(f"an action is a JSON object with an \"action\" key, got {action!r}")
        kind = action["action"]
        handlers = {"goto": self._goto, "click": self._click, "type": self._type, "scroll": self._scroll,
                    "back": self._back}
        if kind not in handlers:
            raise ActionError(f"unknown action {kind!r}; the browser's actions are {', '.join(handlers)}")
        try:
            handlers[kind](action)
        except PWTimeout:
            self._recover()
            raise ActionError(f"{kind} timed out after {self.timeout_s:g} s; the page may be slow or "
                              f"stuck: try again, or go elsewhere") from None
        except PWError as e:
            if "closed" in str(e).lower() and "Target" in str(e):
                raise EnvError(f"the browser closed unexpectedly ({reason(str(e))}); start again") from None
            self._recover()
            raise ActionError(f"{kind} failed: {reason(str(e))}") from None
        return self._observe()

    def _begin(self) -> None:
        self._refused.clear()
        self._failed.clear()

    def _check_outcome(self) -> None:
        """After an action that may navigate: report a refused or failed page load."""
        if self._refused:
            raise self._refusal(self._refused[0])
        if self._failed:
            url, why = self._failed[0]
            raise ActionError(f"could not load {url}: {why}; the page stayed at {self._page.url}")
        if not self.allowed(self._page.url) and self._page.url != "about:blank":
            url = self._page.url
            self._recover(force=True)
            raise self._refusal(url)

    def _navigate(self, url: str) -> None:
        from playwright.sync_api import Error as PWError, TimeoutError as PWTimeout

        if not self.allowed(url):
            raise self._refusal(url)
        self._begin()
        try:
            self._page.goto(url, wait_until="load")
        except PWTimeout:
            self._recover()
            raise ActionError(f"could not load {url}: timed out after {self.timeout_s:g} s") from None
        except PWError as e:
            self._check_outcome()
            self._recover()
            raise ActionError(f"could not load {url}: {reason(str(e))}") from None
        self._check_outcome()

    def _goto(self, action: dict[str, Any]) -> None:
        url = action.get("url")
        if not isinstance(url, str) or not url.strip():
            raise ActionError(f'goto needs "url", e.g. {{"action": "goto", "url": "{self._example_url()}"}}')
        try:
            target = urljoin(self._page.url, url.strip())
            urlsplit(target).port  # noqa: B018 (raises ValueError for a port out of range)
        except ValueError as e:
            raise ActionError(f"{url.strip()!r} is not a valid URL ({e}); give a path on this site, such as "
                              f"{self._example_url()!r}, or an http(s) URL on an allowed host") from None
        self._navigate(target)

    def _example_url(self) -> str:
        """A URL to show in an example: a link of the current page on an allowed host (as the
        text view shows it), else the current page."""
        base = urlsplit(self._page.url)
        for e in self._elements.values():
            href = e.get("href") or ""
            if e.get("kind") == "link" and href and self.allowed(href):
                target = urlsplit(href)
                if (target.scheme, target.netloc) == (base.scheme, base.netloc):
                    return target.path + (f"?{target.query}" if target.query else "")
                return href
        return base.path or "/"

    def _element(self, action: dict[str, Any], verb: str) -> tuple[dict[str, Any], Any]:
        n = action.get("element")
        if isinstance(n, str) and n.strip().strip("[]").isdigit():
            n = int(n.strip().strip("[]"))
        if isinstance(n, bool) or not isinstance(n, int):
            raise ActionError(f'{verb} needs "element": the number N of an element [N], got {n!r}')
        if n not in self._elements:
            have = f"1-{max(self._elements)}" if self._elements else "none on this page"
            raise ActionError(f"no element [{n}] on this page (elements: {have}); use a number from the last observation")
        locator = self._page.locator(f'[data-agentwin-id="{n}"]')
        if locator.count() == 0:
            raise ActionError(f"element [{n}] is gone (the page changed since it was observed); look again")
        return self._elements[n], locator.first

    def _settle(self) -> None:
        """Wait for a page load the action may have started (quick when there is none)."""
        self._page.wait_for_load_state("load")

    def _click(self, action: dict[str, Any]) -> None:
        info, locator = self._element(action, "click")
        if info["disabled"]:
            raise ActionError(f"element [{info['id']}] ({info['kind']} '{info['name']}') is disabled")
        href = info.get("href") or ""
        if href and not href.lower().startswith("javascript:") and not self.allowed(href):
            raise self._refusal(href)
        self._begin()
        locator.click()
        self._settle()
        self._check_outcome()

    def _type(self, action: dict[str, Any]) -> None:
        info, locator = self._element(action, "type")
        text = action.get("text")
        if not isinstance(text, str):
            raise ActionError('type needs "text", e.g. {"action": "type", "element": 2, "text": "harbour"}')
        if info["disabled"]:
            raise ActionError(f"element [{info['id']}] is disabled")
        self._begin()
        if info["kind"] == "select":
            try:
                locator.select_option(label=text, timeout=self.timeout_s * 1000)
            except Exception:
                options = ", ".join(info["options"])
                raise ActionError(f"select [{info['id']}] has no option {text!r}; options: {options}") from None
        elif info["kind"] in ("input", "textarea", "textbox") and info["type"] not in ("checkbox", "radio", "file"):
            locator.fill(text)
        else:
            raise ActionError(f"element [{info['id']}] is a {info['kind']} ({info['type'] or info['tag']}); "
                              f"type needs an input, textarea or select (use click for the rest)")
        if action.get("submit"):
            locator.press("Enter")
            self._settle()
        self._check_outcome()

    def _scroll(self, action: dict[str, Any]) -> None:
        direction = str(action.get("direction", "down")).lower()
        if direction not in ("up", "down"):
            raise ActionError(f'scroll direction must be "up" or "down", got {direction!r}')
        before = self._page.evaluate("window.scrollY")
        step = int(self.viewport[1] * 0.8) * (1 if direction == "down" else -1)
        self._page.evaluate("(dy) => window.scrollBy(0, dy)", step)
        if self._page.evaluate("window.scrollY") == before:
            where = "bottom" if direction == "down" else "top"
            raise ActionError(f"already at the {where} of the page")

    def _back(self, action: dict[str, Any]) -> None:
        self._begin()
        self._status = None  # a page restored from the back-forward cache is not fetched again
        if self._page.go_back(wait_until="load") is None:
            # None: no history entry, or a same-document one (an anchor): tell them apart by URL.
            if self._page.evaluate("history.length") <= 1:
                raise ActionError("there is no earlier page to go back to")
        self._check_outcome()

    def _recover(self, force: bool = False) -> None:
        """Put the tab back on an allowed, working page after a failure."""
        try:
            healthy = self._page.evaluate("1") == 1 and self.allowed(self._page.url)
        except Exception:
            healthy = False
        if healthy and not force:
            return
        back_to = self._last_url or self.start_url
        try:
            if not healthy:
                self._page.close()
                self._page = self._ctx.new_page()
                self._page.on("dialog", self._dialog)
            self._page.goto(back_to, wait_until="load")
        except Exception as e:
            raise EnvError(f"the browser could not return to {back_to} after an error ({reason(str(e))}); "
                           f"start again") from None

    # observation ----------------------------------------------------------------------------------
    def _observe(self) -> Observation:
        page = self._page
        data = page.evaluate(OBSERVE_JS, [self.max_text_chars, self.max_elements])
        self._elements = {e["id"]: e for e in data["elements"]}
        url = page.url
        self._last_url = url
        lines = [f"Title: {data['title'] or '(none)'}", f"URL: {url}"]
        if self._status is not None and self._status >= 400:
            lines.append(f"HTTP status: {self._status}")
        top, height, vh = data["scrollY"], data["height"], data["vh"]
        more = " (scroll down for more)" if top + vh < height else ""
        lines.append(f"View: {top}-{min(top + vh, height)} of {height} px{more}")
        for message in self._dialogs:
            lines.append(f"Dialog (dismissed) {message}")
        self._dialogs.clear()
        lines.append("Text:")
        lines.append(data["text"] or "(no text in view)")
        lines.append("Elements:" if data["elements"] else "Elements: none")
        base = urlsplit(url)
        for e in data["elements"]:
            lines.append(describe_element(e, base))
        if data["total"] > len(data["elements"]):
            lines.append(f"({data['total'] - len(data['elements'])} more elements elsewhere on the page; scroll to see them)")
        images: tuple[Any, ...] = ()
        if self.screenshot:
            page.mouse.move(0, 0)  # no hover effects from the last click
            png = page.screenshot(type="png", animations="disabled", caret="hide", scale="css",
                                  style=SCREENSHOT_STYLE)
            images = (Image.open(io.BytesIO(png)).convert("RGB"),)
        return Observation(label=url, text="\n".join(lines), images=images,
                           meta={"url": url, "title": data["title"], "status": self._status,
                                 "elements": len(data["elements"])})
