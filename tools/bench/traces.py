"""Recording agent traces from the project's own agents.

The agent loop (`agents.loop.AgentLoop`) runs on an environment (`agents.doc.PdfEnv`,
`agents.web.BrowserEnv`, `agents.video.VideoEnv`) with a `RecordingWindow` in place of the window:
it keeps the chunks in order under the same token budget and FIFO eviction as `agentwin.Window`
and writes down every operation (`tools.bench.trace`), running no model forward. Each decision
records the prompt the loop showed its decider. The decider is scripted (`PlanDecider`): a fixed
navigation with returns to earlier pages, back and forward, and recalls, since the small model
the benchmark reads with does not navigate reliably on its own; the replies the model would give
are what the benchmark scores.

This package drives the agents (layer 5), so nothing below it imports it.
"""

from __future__ import annotations

import inspect
import json
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from tools.bench.trace import Trace
from agentwin.window_stats import WindowStats

PRIME = '{"action": "'  # the reply's opening, as agents.model.WindowDecider primes it


class _Stats(WindowStats):
    """The recording window's counters: evictions and recalls; any other counter the loop's
    summary reads is 0 (no forward runs while recording)."""

    def __getattr__(self, name: str) -> int:
        if name.startswith("__"):
            raise AttributeError(name)
        return 0


def _text_of(content: Any) -> str:
    text = content if isinstance(content, str) else getattr(content, "text", None)
    if not isinstance(text, str):
        raise TypeError(f"the benchmark records text chunks only, got {type(content).__name__}")
    return text


class RecordingWindow:
    """What `AgentLoop` needs of a window (chunks, tokens, append, evict, recall, slide, key_summary,
    stats, km, budget_tokens), keeping `agentwin.Window`'s order and FIFO budget rule, recording
    the operations. Text chunks only."""

    def __init__(self, km: Any, budget_tokens: int) -> None:
        self.km, self.budget_tokens = km, int(budget_tokens)
        self.texts: dict[int, str] = {}
        self.ops: list[dict[str, Any]] = []
        self._tokens: dict[int, int] = {}
        self._order: list[int] = []
        self._slot: dict[int, int] = {}
        self._pinned: set[int] = set()
        self._stats = _Stats()

    def chunks(self) -> list[int]:
        return list(self._order)

    def tokens(self) -> int:
        return sum(self._tokens[c] for c in self._order)

    def _plan(self, incoming: int, keep: Any = ()) -> list[int]:
        """The window's FIFO plan (`agentwin.eviction.Fifo`): ValueError, nothing changed, when
        the pinned and kept chunks leave too little room."""
        from agentwin.eviction import Fifo

        return Fifo().plan(self._order, self._tokens, self._pinned | set(keep), incoming, self.budget_tokens)

    def slide(self, free_tokens: int = 0, keep: Any = ()) -> list[int]:
        victims = self._plan(free_tokens, keep)
        for victim in victims:
            self.evict(victim)
        return victims

    def append(self, content: Any, pin: bool = False) -> int:
        text = _text_of(content)
        n = int(self.km.tokenize(text).numel())
        if n == 0 or n > self.budget_tokens:
            raise ValueError(f"chunk of {n} tokens does not fit budget_tokens={self.budget_tokens}")
        if pin and (self._order or self.texts):
            raise ValueError("the recorded traces pin only their first chunk (the chat head), as the replays do")
        for victim in self._plan(n):
            self.evict(victim)
        cid = len(self.texts)
        self.texts[cid], self._tokens[cid] = text, n
        self._order.append(cid)
        if pin:
            self._pinned.add(cid)
        self.ops.append({"op": "append", "chunk": cid})
        return cid

    def find(self, content: Any) -> int | None:
        """The chunk holding this text, in the window first, else the latest evicted one."""
        text = _text_of(content)
        found = [c for c in self._order if self.texts[c] == text]
        gone = [c for c in sorted(self.texts, reverse=True) if self.texts[c] == text]
        return (found or gone or [None])[0]

    def pin(self, cid: int) -> None:
        if cid not in self._order:
            raise ValueError(f"chunk {cid} is not in the window")
        if cid not in self._pinned:
            raise ValueError("the recorded traces pin only their first chunk (the chat head), as the replays do")

    def evict(self, cid: int) -> None:
        if cid not in self._order:
            raise ValueError(f"chunk {cid} is not in the window")
        if cid in self._pinned:
            raise ValueError(f"chunk {cid} is pinned")
        self._slot[cid] = self._order.index(cid)
        self._order.remove(cid)
        self._stats.evictions += 1
        self.ops.append({"op": "evict", "chunk": cid})

    def recall(self, cid: int, at: int | None = None, keep: Any = ()) -> list[int]:
        if cid not in self.texts or cid in self._order:
            raise ValueError(f"chunk {cid} is not an evicted chunk")
        index = self._slot.get(cid, 0) if at is None else int(at)
        victims = self._plan(self._tokens[cid], keep)
        for victim in victims:
            self.evict(victim)
        index = min(index, len(self._order))
        self._order.insert(index, cid)
        self._stats.recalls += 1
        self.ops.append({"op": "recall", "chunk": cid, "at": index})
        return victims

    def key_summary(self, cid: int) -> Any:
        return self.km.key_summary(self.km.tokenize(self.texts[cid]))

    def stats(self) -> WindowStats:
        return self._stats

    def decide(self, step: int, prompt: str, allowed: Sequence[str], scripted: str) -> None:
        self.ops.append({"op": "decide", "step": step, "query": f"{prompt} {PRIME}", "prime": PRIME,
                         "allowed": sorted(allowed), "scripted": scripted})


class PlanDecider:
    """Scripted moves: each entry of `plan` is an action dict, or a callable taking the last
    observation and returning one (to find an element number by its name). Every decision is
    written into the recording window before the move is returned."""

    def __init__(self, plan: Sequence[dict | Callable[[Any], dict]], allowed: Sequence[str]) -> None:
        self.plan, self.allowed = list(plan), list(allowed)
        self.last: Any = None
        self.step = 0

    def observe(self, obs: Any) -> None:
        self.last = obs

    def decide(self, window: RecordingWindow, prompt: str) -> str:
        if self.step >= len(self.plan):
            raise RuntimeError(f"the plan has {len(self.plan)} moves and was asked for move {self.step + 1}")
        move = self.plan[self.step]
        move = move(self.last) if callable(move) else move
        self.step += 1
        reply = json.dumps(move)
        window.decide(self.step, prompt, self.allowed, reply)
        return reply


def link(name: str) -> Callable[[Any], dict]:
    """A click on the element whose text view line reads `[N] link 'name'`."""

    def move(obs: Any) -> dict:
        for line in obs.text.splitlines():
            m = re.match(r"\[(\d+)\] link '([^']*)'", line)
            if m and m.group(2) == name:
                return {"action": "click", "element": int(m.group(1))}
        raise RuntimeError(f"no link {name!r} in the observation {obs.label!r}")

    return move


def _run(name: str, env: Any, km: Any, budget: int, task: str, plan: Sequence[Any], meta: dict) -> Trace:
    from agents.actions import LOOP_ACTIONS
    from agents.loop import AgentLoop

    window = RecordingWindow(km, budget)
    decider = PlanDecider(plan, set(env.actions()) | set(LOOP_ACTIONS))
    options = {"measure_prefill": False} if "measure_prefill" in inspect.signature(AgentLoop).parameters else {}
    # The traces are raw text, as the committed trace page was measured: no chat head.
    result = AgentLoop(env, window, decider, task, max_steps=len(plan), chat=False, **options).run()
    if result.summary.stopped.startswith("error"):
        raise RuntimeError(f"trace {name}: the scripted run stopped with {result.summary.stopped!r}")
    if plan and isinstance(plan[-1], dict) and plan[-1].get("action") == "answer" and result.summary.stopped != "answer":
        raise RuntimeError(f"trace {name}: the scripted run stopped with {result.summary.stopped!r}")
    events = [r.event for r in result.records]
    return Trace(name, budget, dict(window.texts), window.ops,
                 {**meta, "task": task, "steps": len(result.records) - 1, "events": events})


def doc_trace(km: Any, quick: bool, workdir: Path) -> Trace:
    """The document navigator on a PDF of 24 pages (quick: 20 short pages)."""
    from agents.doc import PdfEnv, write_text_pdf
    from tools.bench.trace_sources import doc_pages

    pages = doc_pages(20 if quick else 24, 2 if quick else 5, answer_page=3 if quick else 14)
    pdf = write_text_pdf(workdir / "velmora.pdf", pages)
    if quick:
        plan: list[Any] = [{"action": "next"}, {"action": "goto", "page": 1}]
        budget = 100
    else:
        plan = [{"action": "next"}, {"action": "next"}, {"action": "search", "text": "lighthouse keeper"},
                {"action": "goto", "page": 14}, {"action": "goto", "page": 2}, {"action": "previous"},
                {"action": "answer", "text": "Tobias Mertens"}]
        budget = 400
    with PdfEnv(pdf) as env:
        return _run("doc", env, km, budget, "Who is the lighthouse keeper of Velmora?", plan,
                    {"agent": "document navigator (agents.doc.PdfEnv)", "pdf_pages": len(pages),
                     "source": "agents.doc.write_text_pdf of seeded fact pages"})


def web_trace(km: Any, quick: bool) -> Trace:
    """The web agent on a local site served on 127.0.0.1, in headless Chromium, text view only.
    The browser has no forward action: going forward again after a back is a click on the same
    link (or a goto of its URL), which reaches the same content."""
    from agents.web import BrowserEnv
    from agents.local_site import serve
    from tools.bench.trace_sources import site_html

    pages = site_html(1 if quick else 2)
    if quick:
        plan: list[Any] = [link("Harbour"), {"action": "back"}]
        budget = 200
    else:
        plan = [link("Harbour"), link("Lighthouse"), {"action": "back"}, {"action": "back"}, link("Archive"),
                {"action": "back"}, link("Harbour"), {"action": "answer", "text": "Tobias Mertens"}]
        budget = 512
    with serve(pages) as base, BrowserEnv(f"{base}/index.html", viewport=(800, 600), screenshot=False,
                                          timeout_s=20) as env:
        return _run("web", env, km, budget, "Who is the lighthouse keeper of Velmora?", plan,
                    {"agent": "web agent (agents.web.BrowserEnv, headless Chromium, text view)",
                     "site_pages": len(pages), "source": "a generated site served on 127.0.0.1"})


def video_trace(km: Any, quick: bool, workdir: Path) -> Trace:
    """The long-video loop on a generated video, one observation per 4-second segment, its frames
    rendered as text for the text-only model; the window slides, recalls are by time."""
    from agents.video import VideoEnv
    from tools.bench.trace_sources import FramesAsText, write_video

    seconds = 20 if quick else 32
    path = write_video(workdir / "scenes.mp4", seconds)
    if quick:
        plan: list[Any] = [{"action": "next"}, {"action": "recall", "time": 1.0}]
        budget = 160
    else:
        plan = [{"action": "next"}, {"action": "next"}, {"action": "next"}, {"action": "recall", "time": 2.0},
                {"action": "seek", "time": 9.0}, {"action": "answer", "text": "red, then green"}]
        budget = 512
    env = FramesAsText(VideoEnv(path, segment_seconds=4.0, max_frames_per_segment=8))
    try:
        return _run("video", env, km, budget, "What colours does the background take, in order?", plan,
                    {"agent": "long-video loop (agents.video.VideoEnv), frames rendered as text",
                     "video_seconds": seconds, "source": "a generated mp4 of coloured scenes"})
    finally:
        env.close()


TRACES = ("doc", "web", "video")


def record(km: Any, names: Sequence[str] = TRACES, quick: bool = False, workdir: str | Path | None = None,
           log: Callable[[str], None] = lambda _: None) -> list[Trace]:
    """Record the named traces (doc, web, video) with `km`'s tokenizer."""
    unknown = [n for n in names if n not in TRACES]
    if unknown:
        raise ValueError(f"unknown traces {unknown}; choose from {TRACES}")
    with tempfile.TemporaryDirectory(prefix="agentwin-trace-") as tmp:
        folder = Path(workdir) if workdir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        out = []
        for name in names:
            log(f"recording the {name} trace ...")
            trace = {"doc": lambda: doc_trace(km, quick, folder), "web": lambda: web_trace(km, quick),
                     "video": lambda: video_trace(km, quick, folder)}[name]()
            log(f"  {trace.summary()['ops']} ({trace.decisions} decisions)")
            out.append(trace)
        return out
