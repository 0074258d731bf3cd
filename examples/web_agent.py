"""Browse from a start page to do a task with the web agent on the reversible window.

Usage: `.venv/bin/python examples/web_agent.py URL "task"`, e.g. a page served locally with
`python -m http.server 8000` and URL http://127.0.0.1:8000/. Only the start URL's host is visited
(pass allow_hosts=[...] to BrowserEnv for more). The embedded SmolLM2 reads the page's text view
and the numbered elements; a vision-language model would also get the screenshots.
"""

import sys

from agents.loop import AgentLoop
from agents.model import WindowDecider
from agents.web import BrowserEnv
from agentwin import KameraModel, Window

if len(sys.argv) != 3:
    sys.exit('usage: examples/web_agent.py URL "task"')
url, task = sys.argv[1], sys.argv[2]

km = KameraModel.from_pretrained("smollm2")
window = Window(km, budget_tokens=2048)
env = BrowserEnv(url, allow_hosts=None, screenshot=getattr(km, "is_vlm", False))
try:
    result = AgentLoop(env, window, WindowDecider(max_new_tokens=48), task, max_steps=10, progress=True).run()
finally:
    env.close()
print(result.summary.table())
