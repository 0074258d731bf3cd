"""`agentwin web | video | doc`: run an agent on the reversible window from the command line.

    agentwin doc FILE.pdf --question "Who keeps the lighthouse?"
    agentwin web http://127.0.0.1:8000/ --task "Find the opening hours" [--allow-host HOST ...]
    agentwin video FILE.mp4 --question "What colour is the car?" --model Qwen/Qwen2.5-VL-3B-Instruct

The model decides every step through the window: it reads the observations' reused KV and
replies with one JSON action, decoded under the actions' JSON schema and stopped where the action
closes. The window holds `--budget-tokens` tokens; older observations are evicted and recalled
when seen again or asked for; an observation larger than the window is split into chunks, or cut
(the step record says so). At the end every step and a summary are printed (steps, evictions,
recalls, store hits, tokens forwarded by kind, wall time, the answer), each count summed from the
steps; `--json FILE` writes them, `--log FILE` appends each step as a JSON line while it runs.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from types import SimpleNamespace
from typing import Any, Callable

from agents import console
from agents.console import VLM_HINT
from tools.options import (fraction_arg, kl_arg, make_window, positive_arg, positive_float_arg, question_arg, rank_arg,
                           refuse, window_option_error, write_json)
from tools.store_args import add_store_argument

EXIT_CODES = ("exit status: 0 the agent answered; 1 no answer within --max-steps; 2 an error (bad input: "
              "a file that is not a PDF or a video, an unreachable start page, a model that cannot be "
              "loaded or cannot read the observations)")
MODELS = ("models: smollm2 (default for doc and web) is the embedded SmolLM2-135M-Instruct, a real "
          "text model. For page images, screenshots and video give a vision-language model: a local "
          "path or Hugging Face id of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint (e.g. "
          "Qwen/Qwen2.5-VL-3B-Instruct). The built-in tiny-* models have random weights: they "
          "cannot read or answer and exist for tests (--allow-random-weights runs them anyway).")

def add_window_arguments(parser: argparse.ArgumentParser, model: str | None, budget: int, max_steps: int,
                         rank: str = "budget") -> None:
    """The options every agent command shares."""
    group = parser.add_argument_group("model and window")
    what = (f"smollm2, a local path or a Hugging Face id (default {model})" if model else
            "a local path or Hugging Face id of a vision-language model (required)")
    group.add_argument("--model", default=model, help=f"{what}; see below")
    group.add_argument("--budget-tokens", type=positive_arg, default=budget, help=f"window size in tokens (default {budget})")
    group.add_argument("--patch", choices=("exact", "survive", "refresh", "origin-akin", "origin-similar", "origin",
                                           "fresh", "none"), default="exact",
                       help="how a chunk is served where the chunks before it changed: exact (recomputed: the "
                            "window equals a re-prefill and never forwards more than prefix caching), survive (its "
                            "KV kept and moved), refresh (survival, the chunks near the change recomputed), or a "
                            "patch policy: origin-akin (canonical KV + a patch fitted at append, withheld after an "
                            "unlike antecedent), origin-similar, origin, fresh (a pass per new antecedent), none "
                            "(blind) (default exact)")
    group.add_argument("--evict", choices=("fifo", "lru", "relevant"), default="fifo",
                       help="which observation the budget drops first: the oldest (fifo), the least recently "
                            "used (lru), or the least relevant to the task by key similarity (relevant) "
                            "(default fifo)")
    group.add_argument("--rank", type=rank_arg, default=rank_arg(rank),
                       help=f"patch policies: 'budget' (each patch within --patch-bytes of the chunk's KV bytes), "
                            f"a rank (checked by the patch guard), or 'exact' (default {rank})")
    group.add_argument("--patch-bytes", type=fraction_arg, default=None,
                       help="patch policies with --rank budget: the patch's share of a chunk's canonical KV bytes "
                            "(default 0.06)")
    group.add_argument("--max-kl", type=kl_arg, default=None, metavar="NATS",
                       help="patch policies: a fidelity target instead of a fixed size: each text chunk's patch is "
                            "tried at --patch-bytes, then twice that and so on (with --rank N: rank N, 2N, ...) until "
                            "the chunk's last rows read within NATS of KL of its own pass (default: none)")
    add_store_argument(group, "shared across runs (default: none, the run's own RAM)")
    group.add_argument("--threads", type=positive_arg, default=1,
                       help="torch CPU threads (default 1: the patch policies' small eigendecompositions slow down "
                            "by orders of magnitude with 2 threads on cores shared with other processes; "
                            "SmolLM2's forwards barely gain from a second thread)")
    group.add_argument("--max-steps", type=positive_arg, default=max_steps, help=f"decisions before giving up (default {max_steps})")
    group.add_argument("--max-new-tokens", type=positive_arg, default=48,
                       help="most tokens the model may write per decision; decoding stops earlier, where the "
                            "action closes (default 48)")
    group.add_argument("--json", metavar="FILE", help="write the summary and every step to FILE")
    group.add_argument("--log", metavar="FILE", help="append each step to FILE as a JSON line while running")
    group.add_argument("--quiet", action="store_true", help="no progress output")


def _agent_arguments(parser: argparse.ArgumentParser, model: str | None, budget: int, max_steps: int) -> None:
    add_window_arguments(parser, model, budget, max_steps)
    parser.add_argument("--keep-relevant", action=argparse.BooleanOptionalAction, default=True,
                        help="after each new observation, recall the earlier one closest to the task (by key "
                             "similarity) just before it when it is out of view and both fit (default on)")
    parser.add_argument("--allow-random-weights", action="store_true",
                        help="run a built-in tiny-* model although its weights are random (tests only)")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = textwrap.fill(MODELS, 88) + "\n\n" + textwrap.fill(EXIT_CODES, 88)


# ---- the three commands ------------------------------------------------------------------------

def _doc_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.pdf", help="the PDF to read")
    parser.add_argument("--question", required=True, type=question_arg, help="what to find out from the document")
    parser.add_argument("--max-chars", type=positive_arg, default=1500, help="page text shown per observation (default 1500)")
    _agent_arguments(parser, model="smollm2", budget=1024, max_steps=12)


def _doc_run(args: argparse.Namespace) -> int:
    from agents.doc import PdfEnv

    def check() -> None:
        PdfEnv(args.file, max_chars=args.max_chars).close()

    return run_agent(args, args.question, lambda km: PdfEnv(
        args.file, render=bool(getattr(km, "is_vlm", False)), max_chars=args.max_chars, progress=not args.quiet),
        check=check)


def _web_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL", help="the start page (http or https)")
    parser.add_argument("--task", required=True, type=question_arg, help="what the agent should find out or do")
    parser.add_argument("--allow-host", action="append", metavar="HOST",
                        help="another host the agent may visit besides the start URL's (repeatable; "
                             "'*.example.org' for a domain and its subdomains)")
    _agent_arguments(parser, model="smollm2", budget=2048, max_steps=12)


def _web_run(args: argparse.Namespace) -> int:
    from agents.web import BrowserEnv, check_reachable

    def make(km: Any) -> Any:
        return BrowserEnv(args.url, allow_hosts=args.allow_host,
                          screenshot=bool(getattr(km, "is_vlm", False)))

    return run_agent(args, args.task, make, check=lambda: check_reachable(args.url))


def _video_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the video (mp4, mkv, webm, ...)")
    parser.add_argument("--question", required=True, type=question_arg, help="what to find out from the video")
    parser.add_argument("--segment-seconds", type=positive_float_arg, default=4.0,
                        help="seconds per segment chunk (default 4)")
    parser.add_argument("--fps", type=positive_float_arg, default=2.0,
                        help="frames sampled per second (default 2, as qwen-vl-utils)")
    _agent_arguments(parser, model=None, budget=4096, max_steps=16)


def _video_run(args: argparse.Namespace) -> int:
    from agents.video import VideoEnv

    def make(km: Any) -> Any:
        return VideoEnv(args.file, segment_seconds=args.segment_seconds, fps=args.fps)

    return run_agent(args, args.question, make, needs_vlm=True, check=lambda: make(None).close())


def _doc(first_line: str) -> str:
    return first_line + "\n\n" + __doc__.split("\n\n", 1)[1]


DOC = SimpleNamespace(__doc__=_doc("Read a PDF page by page and answer a question (the document navigator)."),
                      add_arguments=_doc_arguments, run=_doc_run)
WEB = SimpleNamespace(__doc__=_doc("Browse from a start page in headless Chromium to do a task (the web agent)."),
                      add_arguments=_web_arguments, run=_web_run)
VIDEO = SimpleNamespace(__doc__=_doc("Watch a video segment by segment and answer a question (the long-video loop)."),
                        add_arguments=_video_arguments, run=_video_run)


def run_agent(args: Any, task: str, make_env: Callable[[Any], Any], needs_vlm: bool = False,
              check: Callable[[], None] | None = None) -> int:
    """Check the input (`check`, raising EnvError) and the model name, load the model, open the
    environment, run the loop with the model deciding, report; torch runs `args.threads` threads
    meanwhile. The task text and the numbers were checked by the parser (`question_arg`, ...)."""
    from agents.base import EnvError

    if not isinstance(task, str) or not task.strip():
        return refuse("the question or task is empty; say what the agent should find out or do")
    if args.model is None:
        return refuse(f"this agent reads video frames and needs a vision-language model; {VLM_HINT}")
    problem = window_option_error(args)
    if problem:
        return refuse(problem)
    vlm, random_weights = console.model_kind(args.model)
    if random_weights and not args.allow_random_weights:
        return refuse(f"{args.model} is a built-in test model with random weights: it cannot read the "
                       f"observations or answer, only exercise the code. "
                       + (VLM_HINT[0].upper() + VLM_HINT[1:] if needs_vlm else
                          "Use --model smollm2 (the embedded text model) or a local path / Hugging Face id")
                       + "; --allow-random-weights runs it anyway (for tests)")
    if needs_vlm and vlm is False:
        return refuse(f"{args.model} is a text-only model; this agent reads video frames: {VLM_HINT}")
    try:
        if check is not None:
            check()
    except EnvError as err:
        return refuse(str(err))
    with console.torch_threads(getattr(args, "threads", None)):
        return _load_and_run(args, task, make_env, needs_vlm)


def _load_and_run(args: Any, task: str, make_env: Callable[[Any], Any], needs_vlm: bool) -> int:
    from agents.base import EnvError
    from agents.loop import AgentLoop
    from agents.model import WindowDecider

    progress = not args.quiet
    try:
        km = console.load_model(args.model, progress)  # looked up at call time: tests replace it
    except (ValueError, OSError, FileNotFoundError) as err:
        return refuse(f"cannot load model {args.model!r}: {err}")
    if needs_vlm and not getattr(km, "is_vlm", False):
        return refuse(f"{args.model} is a text-only model; this agent reads video frames: {VLM_HINT}")
    try:
        window = make_window(km, args)
        env = make_env(km)
    except EnvError as err:
        return refuse(str(err))
    try:
        loop = AgentLoop(env, window, WindowDecider(args.max_new_tokens), task, max_steps=args.max_steps,
                         log_path=args.log, progress=progress, keep_relevant=args.keep_relevant)
        result = loop.run()
    finally:
        env.close()
        window.store.close()  # a Redis tier's connections, a disk tier's lock
    print("\nsteps:")
    print(console.steps_table(result.records))
    print("\nsummary:")
    print(result.summary.table())
    if args.json:
        write_json(args.json, result.to_json())
        print(f"written to {args.json}")
    stopped = result.summary.stopped
    if stopped.startswith("error"):
        print(stopped, file=sys.stderr)
        return 2
    return 0 if stopped == "answer" else 1
