"""Write a 30-page PDF for trying the document navigator on a small window.

Usage: `.venv/bin/python examples/survey_pdf.py OUT.pdf`, then for example
`agentwin doc OUT.pdf --question "Who is the lighthouse keeper of Velmora?" --budget-tokens 400
--max-steps 40 --json run.json`. Each page is about 150 SmolLM2 tokens, so a 400-token window holds
two pages: reading on evicts pages, and going back to one recalls it. The answer is on page 3; the
last page says the names are on the early pages.
"""

import sys

from agents.doc import write_text_pdf

TOPICS = ["harbour", "lighthouse", "ferry", "school", "bakery", "weather", "mill", "chapel", "market", "library"]


def pages() -> list[str]:
    out = []
    for i in range(30):
        topic = TOPICS[i % len(TOPICS)]
        body = " ".join(f"Section {i + 1}.{k}: the {topic} ledger for the season was reviewed by the island council "
                        "and filed in the records room." for k in range(5))
        extra = ""
        if i == 2:
            extra = " The lighthouse keeper of Velmora is Tobias Mertens."
        if i == 29:
            extra = " End of the survey. The names of the island's keepers are given on the early pages."
        out.append(f"Velmora survey, page {i + 1} of 30: the {topic}.{extra} {body}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: examples/survey_pdf.py OUT.pdf")
    print(write_text_pdf(sys.argv[1], pages()))
