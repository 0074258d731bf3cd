"""`agentwin demo`: the document navigator on the real embedded SmolLM2, forcing evictions and recalls.

The demo writes a six-page PDF of facts about an island (pypdfium2 reads it back), opens it in
`agents.doc.PdfEnv` and runs the shared agent loop on a window too small for the document, so
pages are evicted as the agent reads on and recalled when it comes back to them. It prints, all
measured in that run:
- every step: the action, the page, what the window evicted and recalled;
- at each recall, the KL between the window's next-token distribution for the question and a full
  re-prefill of the same tokens (`Window.next_token_logprobs` vs `Window.reference_logprobs`);
- the answer SmolLM2 generates through the window, and the answer a full re-prefill generates;
- the work, next to a baseline run in the same process on the same inputs: at every step the
  window is read for the step's prompt, as a model-driven agent reads it to decide, and the same
  prompt is answered by a full re-prefill of the window's tokens (what an agent without a
  reusable cache does); tokens forwarded by kind and wall time on both sides, and the KL between
  the two next-token distributions at every step.

The moves are a fixed heuristic, not the model (SmolLM2-135M is too small to navigate reliably):
read every page in order, search for the question's key phrase, go back to the page found, recall
page 1 by its step number, answer. The answer is the model's. `agentwin doc FILE.pdf --question`
lets the model make the moves too. `agentwin demo --relocation` runs the relocation demo (KV moved
30000 positions by RoPE re-rotation).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kamera_core.metrics import kl_divergence

from tools import relocation_demo
from tools.agents_cli import add_window_arguments, load_model, make_window, steps_table, write_json

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--relocation", action="store_true",
                        help="run the relocation demo instead (KV moved by RoPE re-rotation; --start, --new-tokens)")
    parser.add_argument("--start", type=int, default=None,
                        help="relocation demo only: original start position (default 30000)")
    parser.add_argument("--new-tokens", type=int, default=20,
                        help="tokens of the answer (and of the relocation demo's continuations) (default 20)")
    parser.add_argument("--pdf", metavar="FILE", help="also keep the generated PDF at FILE")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: the small eigendecompositions of exact patches "
                             "slow down by orders of magnitude with 2 threads on cores shared with other "
                             "processes; SmolLM2's forwards barely gain from a second thread)")
    add_window_arguments(parser, model="smollm2", budget=320, max_steps=14, rank="exact")


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


class DecisionReads:
    """Wraps the heuristic: before each move, the window is read for the step's prompt (one query
    forward over the window's KV, as a model-driven agent decides) and the same prompt is read by
    a full re-prefill (the baseline); both are timed and their KL recorded."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kls: list[float] = []
        self.baseline_tokens = 0
        self.baseline_s = 0.0

    def observe(self, obs: Any) -> None:
        self.inner.observe(obs)

    def decide(self, window: Any, prompt: str) -> str:
        mine = window.next_token_logprobs(prompt)
        t0 = time.perf_counter()
        reference = window.reference_logprobs(prompt)
        self.baseline_s += time.perf_counter() - t0
        self.baseline_tokens += int(window.input_ids(prompt).numel())
        self.kls.append(kl_divergence(reference, mine, log_probs=True))
        return self.inner.decide(window, prompt)


def run_demo(km: Any, args: argparse.Namespace, pdf_path: Path, progress: bool = True, log=print) -> dict:
    """Write the PDF, run the navigator, return the figures (and the run) as a dict."""
    from agents.doc import PdfEnv, SkimSearchDecider, write_text_pdf
    from agents.loop import AgentLoop

    write_text_pdf(pdf_path, PAGES)
    window = make_window(km, args)
    query = answer_query(QUESTION)
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
        "rank": "exact" if args.rank is None else args.rank,
        "patch": args.patch,
        "budget_tokens": args.budget_tokens,
        "pages": len(PAGES),
        "answer_s_reused": answers.get("window_s"),
        "answer_s_reprefill": reference_s,
        "navigation": "heuristic (read all pages, search, go back, recall page 1 by step); the answer is SmolLM2's",
    }
    return {"figures": figures, **result.to_json(), "_result": result}


def _report(run: dict, log=print) -> None:
    result, f = run["_result"], run["figures"]
    s = result.summary
    log("\nsteps (moves by a fixed heuristic, not the model; the answer is generated by the model):")
    log(steps_table(result.records))
    log("\nsummary:")
    log(s.table())
    rank = "exact patches (rank=None)" if f["rank"] == "exact" else f"rank-{f['rank']} {f['patch']} patches"
    log(f"\nquestion: {f['question']}")
    log(f"  answer through the window : {f['answer']!r}")
    log(f"  answer from a re-prefill  : {f['reference_answer']!r}  "
        f"({'identical' if f['answer_matches_reprefill'] else 'DIFFERENT'})")
    log(f"  expected '{f['expected']}': {'found' if f['answer_correct'] else 'not found'} in the answer")
    kls = ", ".join(f"{k:.2e}" for k in f["kl_at_recalls"]) or "none"
    log(f"KL(re-prefill || window) at the read after each recall, {rank}: {kls} nats "
        f"(largest over all {f['decision_points']} reads: {f['max_kl']:.2e})")
    a, b = f["agentwin"], f["reprefill"]
    kinds = ", ".join(f"{kind} {n}" for kind, n in a["by_kind"].items() if n)
    log(f"\nwork, both sides run here on the same steps ({f['decision_points']} window reads + the answer):")
    log(f"  agentwin window          : {a['forwarded_tokens']} tokens forwarded ({kinds}), "
        f"{a['wall_s']:.2f} s in the window's calls")
    log(f"  re-prefill at every read : {b['forwarded_tokens']} tokens forwarded, {b['wall_s']:.2f} s")
    log(f"  agentwin / re-prefill    : {a['forwarded_tokens'] / max(b['forwarded_tokens'], 1):.2f} of the tokens, "
        f"{a['wall_s'] / max(b['wall_s'], 1e-9):.2f} of the time; {a['relocated_tokens']} tokens were served "
        f"by relocation (computed once, at append)")


def run(args: argparse.Namespace) -> int:
    if args.relocation:
        args.start = 30000 if args.start is None else args.start
        return relocation_demo.run(args)
    if args.start is not None:
        print("error: --start belongs to the relocation demo: add --relocation (or use agentwin relocation-demo)",
              file=sys.stderr)
        return 2
    if args.new_tokens < 1:
        print("error: --new-tokens must be positive", file=sys.stderr)
        return 2
    if args.threads < 1:
        print("error: --threads must be positive", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _navigator(args)
    finally:
        torch.set_num_threads(threads)


def _navigator(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    progress = not args.quiet
    print(f"loading {args.model} ...", flush=True)
    try:
        km = load_model(args.model, progress)
    except (ValueError, OSError) as err:
        print(f"error: cannot load model {args.model!r}: {err}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t_start
    with tempfile.TemporaryDirectory() as tmp:
        pdf = Path(args.pdf) if args.pdf else Path(tmp) / "velmora.pdf"
        demo = run_demo(km, args, pdf, progress=progress)
    demo["figures"]["load_s"] = load_s
    demo["figures"]["total_s"] = time.perf_counter() - t_start
    _report(demo)
    print(f"\nmodel load {load_s:.1f} s, whole demo {demo['figures']['total_s']:.1f} s")
    if args.json:
        write_json(args.json, {k: v for k, v in demo.items() if k != "_result"})
        print(f"figures written to {args.json}")
    s = demo["_result"].summary
    return 0 if s.stopped == "answer" and s.recalls > 0 else 1


# The relocation demo's measurement, for callers that used it from here.
measure = relocation_demo.measure
