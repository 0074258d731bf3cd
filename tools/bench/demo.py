"""The document-navigator demo (`agentwin demo`): the island survey, the heuristic moves, and a
re-prefill at every read of the window as the baseline run beside it in the same process.

At every step the window is read for the step's prompt (one query forward over its KV, as a
model-driven agent reads it to decide) and the same prompt is answered by a full re-prefill of the
window's tokens; both are timed and their tokens counted, and the KL between the two next-token
distributions is recorded. The moves are a fixed heuristic (`agents.doc.SkimSearchDecider`); the
answer is the model's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from kamera_core.metrics import kl_divergence

PAGES = [
    "Velmora survey, page 1: the harbour. The harbour master of Velmora is Anja Roth. She keeps the "
    "tide log in the harbour office and rings the bell when a storm is coming. The harbour has "
    "twelve moorings and one crane.",
    "Velmora survey, page 2: the lighthouse. The lighthouse keeper of Velmora is Tobias Mertens. He "
    "repairs the fog horn every spring and paints the tower white every third summer. The lamp "
    "can be seen for twenty kilometres.",
    "Velmora survey, page 3: the ferry. The ferry captain is Lena Okafor, and her ferry is called "
    "the Grey Heron. It leaves the north pier at seven in the morning and returns at six in the "
    "evening, except on Sundays.",
    "Velmora survey, page 4: the school. The island school is run by Pavel Ilic, who also plays "
    "the organ at the chapel on Sundays. Fourteen children attend the school; the oldest is "
    "eleven years old.",
    "Velmora survey, page 5: the bakery. The bakery on Mill Street belongs to Marta Vidal. She bakes "
    "rye bread on Mondays and almond cake on Fridays, and she delivers bread to the lighthouse by "
    "bicycle.",
    "Velmora survey, page 6: the weather station. The weather station on the western cliff is read "
    "by Jonas Berg at noon each day. The strongest wind he recorded was one hundred and ten "
    "kilometres per hour.",
]
QUESTION = "Who is the lighthouse keeper of Velmora?"
PHRASE = "lighthouse keeper"
EXPECTED = "Tobias Mertens"


def answer_query(question: str) -> str:
    return f"\nQuestion: {question}\nAnswer:"


def reference_generate(window: Any, query: str, max_new_tokens: int) -> tuple[str, int]:
    """Greedy continuation of `query` after a full re-prefill of the window's tokens (no reuse),
    and the number of forwards it ran (one prefill, then one per decoded token)."""
    km = window.km
    ids = window.input_ids(query)
    out, position, cache, forwards = [], 0, None, 0
    eos = getattr(km.model.config, "eos_token_id", None)
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    for _ in range(max_new_tokens):
        forwards += 1
        result = km.forward(ids, position, cache)
        cache, position = result.cache, position + int(ids.numel())
        token = int(result.logits[0, -1].argmax())
        if token in eos:
            break
        out.append(token)
        ids = torch.tensor([token])
    return km.tokenizer.decode(out), forwards


def prefix_tokens(sequences: list) -> int:
    """Tokens prefix caching forwards for these sequences in order (each read's ids, replies
    included): each computes what follows its longest common token prefix with any earlier one,
    its last token at least."""
    from agentwin.prefix import common_prefix

    total = 0
    for i, seq in enumerate(sequences):
        shared = max((common_prefix(seq, earlier) for earlier in sequences[:i]), default=0)
        total += int(seq.numel()) - min(shared, int(seq.numel()) - 1)
    return total


class DecisionReads:
    """Wraps the heuristic: before each move, the window is read for the step's prompt (one query
    forward over the window's KV, as a model-driven agent decides) and the same prompt is read by
    a full re-prefill (the baseline); both are timed and their KL recorded."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kls: list[float] = []
        self.baseline_tokens = 0
        self.baseline_s = 0.0
        self.sequences: list = []  # every read's token ids, for prefix caching's count

    def observe(self, obs: Any) -> None:
        self.inner.observe(obs)

    def decide(self, window: Any, prompt: str) -> str:
        mine = window.next_token_logprobs(prompt)
        t0 = time.perf_counter()
        reference = window.reference_logprobs(prompt)
        self.baseline_s += time.perf_counter() - t0
        self.baseline_tokens += int(window.input_ids(prompt).numel())
        self.sequences.append(window.input_ids(prompt))
        self.kls.append(kl_divergence(reference, mine, log_probs=True))
        return self.inner.decide(window, prompt)


def run_demo(km: Any, args: Any, pdf_path: Path, make_window: Callable[[Any, Any], Any], progress: bool = True) -> dict:
    """Write the PDF, run the navigator on `make_window(km, args)`, return the figures (and the
    run) as a dict; `args` carries the window options, `max_steps`, `log` and `new_tokens`."""
    from agents.doc import PdfEnv, SkimSearchDecider, write_text_pdf
    from agents.loop import AgentLoop, chat_of

    write_text_pdf(pdf_path, PAGES)
    window = make_window(km, args)
    chat = chat_of(window)  # SmolLM2 reads its chat template: the question closes the user turn
    query = chat.question(QUESTION) if chat is not None else answer_query(QUESTION)
    answers: dict[str, str] = {}

    def answer(win: Any) -> str:
        t0 = time.perf_counter()
        answers["window"] = win.generate(query, max_new_tokens=args.new_tokens).strip()
        answers["window_s"] = time.perf_counter() - t0
        return answers["window"]

    reads = DecisionReads(SkimSearchDecider(PHRASE, answer_fn=answer, recall_step=0))
    with PdfEnv(pdf_path, progress=progress) as env:
        loop = AgentLoop(env, window, reads, QUESTION, max_steps=args.max_steps, log_path=args.log,
                         progress=progress)
        result = loop.run()
    t0 = time.perf_counter()
    reference, decoded = reference_generate(window, query, args.new_tokens)
    reference = reference.strip()
    reference_s = time.perf_counter() - t0
    s = result.summary
    stats = window.stats()
    # The decision read after each recall is the first read of the window with the chunk back.
    recall_steps = [r.step for r in result.records if r.event == "recall"]
    kl_at_recalls = [reads.kls[step] for step in recall_steps if step < len(reads.kls)]
    answer_tokens = int(window.input_ids(query).numel()) + max(decoded - 1, 0)
    reads.sequences.append(window.input_ids(query))  # the answer's read; its reply is decoded after it
    prefix = prefix_tokens(reads.sequences) + max(decoded - 1, 0)
    figures = {
        "question": QUESTION,
        "expected": EXPECTED,
        "answer": s.answer,
        "reference_answer": reference,
        "answer_matches_reprefill": s.answer == reference,
        "answer_correct": s.answer is not None and EXPECTED.lower() in s.answer.lower(),
        "kl_at_decisions": reads.kls,
        "kl_at_recalls": kl_at_recalls,
        "max_kl": max((abs(k) for k in reads.kls), default=None),
        "decision_points": len(reads.kls),
        "agentwin": {"forwarded_tokens": stats.forwarded_tokens, "by_kind": dict(stats.forward_tokens),
                     "vision_tower_runs": stats.encoder_calls, "relocated_tokens": stats.relocated_tokens,
                     "wall_s": stats.wall_s},
        "reprefill": {"forwarded_tokens": reads.baseline_tokens + answer_tokens,
                      "wall_s": reads.baseline_s + reference_s},
        "prefix_caching_tokens": prefix,
        "rank": "exact" if args.rank is None else args.rank,
        "patch": args.patch,
        "chat": chat is not None,
        "budget_tokens": args.budget_tokens,
        "pages": len(PAGES),
        "answer_s_reused": answers.get("window_s"),
        "answer_s_reprefill": reference_s,
        "navigation": "heuristic (read all pages, search, go back, recall page 1 by step); the answer is SmolLM2's",
    }
    return {"figures": figures, **result.to_json(), "_result": result}
