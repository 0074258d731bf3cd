"""The shared loop on the other agents' real environments: headless Chromium on pages served from
127.0.0.1, and an mp4 written here with PyAV read by the real video reader. A scripted model moves;
a tiny Qwen2.5-VL window (exact patches) takes the screenshots and frames."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from agents.loop import AgentLoop
from agents.model import ScriptedDecider
from agentwin import KameraModel, Window
from tests.support import send_html

QUERY = "\nQuestion: what did you see? Answer:"
SITE = {
    "/a.html": "<html><head><title>A</title></head><body><h1>Harbour</h1><p>Anja Roth is the harbour "
               "master.</p><a href='/b.html'>Lighthouse</a></body></html>",
    "/b.html": "<html><head><title>B</title></head><body><h1>Lighthouse</h1><p>Tobias keeps the "
               "lighthouse.</p><a href='/a.html'>Harbour</a></body></html>",
}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        send_html(self, SITE.get(self.path.split("?")[0]))

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def vlm():
    return KameraModel.from_pretrained("tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def site():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _encoder_calls(window):
    return window.stats().encoder_calls


def test_web_loop_recalls_a_revisited_page_without_the_vision_tower(vlm, site):
    from agents.web import BrowserEnv

    env = BrowserEnv(f"{site}/a.html", viewport=(320, 240), timeout_s=10)
    window = Window(vlm, budget_tokens=260, patch="origin", rank=None)
    calls = []
    script = ScriptedDecider([{"action": "goto", "url": f"{site}/b.html"},
                              {"action": "goto", "url": "http://elsewhere.test/"},
                              {"action": "back"},
                              {"action": "answer", "text": "Anja Roth"}])
    try:
        result = AgentLoop(env, window, script, "Who is the harbour master?", max_steps=6, fidelity_query=QUERY,
                           on_step=lambda r: calls.append(_encoder_calls(window))).run()
    finally:
        env.close()
    r, s = result.records, result.summary
    assert [x.event for x in r] == ["append", "append", None, "recall", "answer"], [x.error for x in r]
    assert "not in the allow-list" in r[2].error and "That action failed" in script.prompts[2]
    assert r[3].chunks == r[0].chunks and r[3].recalled == [f"step 0 ({r[0].observation})"]
    assert calls[1] == 2 and calls[3] == calls[1]  # a screenshot per new page, none for the page seen again
    assert abs(r[3].kl) < 1e-4 and s.content_hits == 1 and s.refused_actions == 1 and s.answer == "Anja Roth"


def _write_mp4(path, seconds=6, fps=4, size=(56, 56)):
    import av

    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (200, 30, 200), (30, 200, 200)]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(seconds * fps):
            pixels = np.full((size[1], size[0], 3), colours[(i // fps) % len(colours)], dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def test_video_loop_slides_over_segments_and_recalls_by_time_query_and_revisit(vlm, tmp_path):
    from agents.video import VideoEnv

    path = tmp_path / "clip.mp4"
    _write_mp4(path)
    env = VideoEnv(path, segment_seconds=1.0, fps=2.0, min_pixels=4 * 28 * 28, max_pixels=4 * 28 * 28,
                   max_frames_per_segment=2)
    first = env.reset()
    budget = 3 * (len(vlm.tokenize(f"\n[{first.label}]\n{first.text}\n")) + 8)  # about two segments in view
    window = Window(vlm, budget_tokens=budget, patch="origin", rank=None)
    calls = []
    script = ScriptedDecider([{"action": "next"}, {"action": "next"}, {"action": "next"},
                              {"action": "recall", "time": 0.5},
                              {"action": "segment", "index": 1},
                              {"action": "answer", "text": "red, then green"}])
    with env:
        result = AgentLoop(env, window, script, "What colours does the video show?", max_steps=8,
                           fidelity_query=QUERY, on_step=lambda r: calls.append(_encoder_calls(window))).run()
    r, s = result.records, result.summary
    assert [x.observation for x in r[:4]] == ["video 00:00-00:01", "video 00:01-00:02", "video 00:02-00:03",
                                               "video 00:03-00:04"]
    assert s.evictions >= 2, "the window must slide over the video"
    assert r[4].event == "recall" and r[4].recalled == ["step 0 (video 00:00-00:01)"]
    assert "(covers 0.5 s) is back in view" in script.prompts[4]
    assert r[5].observation == "video 00:01-00:02" and r[5].event in ("recall", "in-view") and s.content_hits == 1
    assert calls[3] == 4 and calls[-1] == 4  # one Frames tower run per new segment, none for recalls
    assert all(abs(k) < 1e-4 for k in s.kl_at_recalls) and s.kl_at_recalls
    assert s.answer == "red, then green"
    # The summary is the sum of the steps, and every eviction and tower run shows in a step.
    stats = window.stats()
    assert s.evictions == sum(x.evicted_chunks for x in r) == stats.evictions
    assert all(bool(x.evicted) == bool(x.evicted_chunks) for x in r)
    assert s.encoder_calls == sum(x.encoder_runs for x in r) == stats.encoder_calls
    assert s.encoder_hits == sum(x.encoder_reused for x in r) == stats.encoder_hits
    table = s.table()
    assert f"{s.evictions} chunks in steps " in table and "saved" not in table and "avoided" not in table
