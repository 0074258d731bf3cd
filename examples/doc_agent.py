"""Answer a question from a PDF with the document navigator on the reversible window.

Usage: `.venv/bin/python examples/doc_agent.py [FILE.pdf "question"]`. Without arguments it writes
a three-page PDF and asks about it. The embedded SmolLM2 decides every step (it is small: expect
malformed replies, which the loop answers with a retry message, and perhaps no answer).
"""

import sys
import tempfile
from pathlib import Path

from agents.doc import PdfEnv, write_text_pdf
from agents.loop import AgentLoop
from agents.model import WindowDecider
from agentwin import KameraModel, Window

if len(sys.argv) == 3:
    path, question = Path(sys.argv[1]), sys.argv[2]
else:
    path = Path(tempfile.mkdtemp()) / "island.pdf"
    write_text_pdf(path, ["The harbour master is Anja Roth.", "The lighthouse keeper is Tobias Mertens.",
                          "The ferry captain is Lena Okafor."])
    question = "Who is the lighthouse keeper?"

km = KameraModel.from_pretrained("smollm2")
window = Window(km, budget_tokens=512)  # exact: a re-prefill's values; patch="origin-akin" for patches
with PdfEnv(path) as env:  # render=True gives page images, for a vision-language model
    result = AgentLoop(env, window, WindowDecider(max_new_tokens=32), question, max_steps=8).run()
for record in result.records:
    print(record.step, record.action, record.observation or "", record.event or "", record.error or "")
print(result.summary.table())
