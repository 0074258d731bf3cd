"""Watch a video segment by segment and answer a question, with the long-video loop.

Usage: `.venv/bin/python examples/video_agent.py FILE.mp4 "question" [MODEL]`. Segments of frames
become Frames chunks; the window slides over a video longer than its budget, and earlier
segments come back by recall: {"action": "recall", "time": 12} or {"action": "recall", "query":
"a red car"} (closest mean keys per layer). The default model, tiny-qwen2.5-vl, has random
weights: it shows the mechanics; pass a Qwen2.5-VL path for real answers.
"""

import sys

from agents.loop import AgentLoop
from agents.model import WindowDecider
from agents.video import VideoEnv
from agentwin import KameraModel, Window

if len(sys.argv) not in (3, 4):
    sys.exit('usage: examples/video_agent.py FILE.mp4 "question" [MODEL]')
path, question = sys.argv[1], sys.argv[2]
model = sys.argv[3] if len(sys.argv) == 4 else "tiny-qwen2.5-vl"

km = KameraModel.from_pretrained(model)
window = Window(km, budget_tokens=4096)
with VideoEnv(path, segment_seconds=4.0, fps=2.0) as env:
    result = AgentLoop(env, window, WindowDecider(max_new_tokens=32), question, max_steps=12, progress=True).run()
print(result.summary.table())
