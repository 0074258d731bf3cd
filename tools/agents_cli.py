"""`agentwin web | video | doc`: run an agent on the reversible window from the command line.

    agentwin doc FILE.pdf --question "Who keeps the lighthouse?"
    agentwin web http://127.0.0.1:8000/ --task "Find the opening hours" [--allow-host HOST ...]
    agentwin video FILE.mp4 --question "What colour is the car?" --model tiny-qwen2.5-vl

The model (`--model`: `smollm2`, the embedded SmolLM2-135M-Instruct, by default; `tiny-*` names,
a local path or a hub name) decides every step through the window: it reads the observations'
reused KV and replies with one JSON action. The window holds `--budget-tokens` tokens; older
observations are evicted and recalled when seen again or asked for. At the end a summary table is
printed (steps, evictions, recalls, reuse hits, work avoided, time saved, the answer); `--json
FILE` writes it with every step, `--log FILE` appends each step as a JSON line while it runs.

Exit status: 0 when the agent answered, 1 when it ran out of steps, 2 on bad input (a file that is
not a PDF, an unreachable start page, a model that cannot read the observations).
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace
from typing import Any, Callable


def rank_arg(text: str) -> int | None:
    """`--rank`: a positive int, or `exact` (full-rank float32 patches: the window equals a re-prefill)."""
    if text.lower() in ("exact", "none", "full"):
        return None
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--rank must be a positive integer or 'exact', got {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_window_arguments(parser: argparse.ArgumentParser, model: str, budget: int, max_steps: int,
                         rank: str = "16") -> None:
    """The options every agent command shares."""
    group = parser.add_argument_group("model and window")
    group.add_argument("--model", default=model, help=f"smollm2, a tiny-* name, a local path or a hub name (default {model})")
    group.add_argument("--budget-tokens", type=_positive, default=budget, help=f"window size in tokens (default {budget})")
    group.add_argument("--rank", type=rank_arg, default=rank_arg(rank),
                       help=f"antecedent patch rank, or 'exact' (default {rank})")
    group.add_argument("--patch", choices=("origin", "fresh", "none"), default="origin",
                       help="patch policy: origin (fitted at append), fresh (a pass per new antecedent), none (blind)")
    group.add_argument("--store", metavar="DIR", help="keep canonical KV and patches on disk in DIR, shared across runs")
    group.add_argument("--max-steps", type=_positive, default=max_steps, help=f"decisions before giving up (default {max_steps})")
    group.add_argument("--max-new-tokens", type=_positive, default=48, help="tokens the model may write per decision (default 48)")
    group.add_argument("--json", metavar="FILE", help="write the summary and every step to FILE")
    group.add_argument("--log", metavar="FILE", help="append each step to FILE as a JSON line while running")
    group.add_argument("--quiet", action="store_true", help="no progress bars")


def load_model(name: str, progress: bool = True) -> Any:
    """The KameraModel `name`, with a progress line; ValueError/OSError say what went wrong."""
    from tqdm.auto import tqdm

    from agentwin import KameraModel

    bar = tqdm(total=1, desc=f"loading {name}", disable=not progress, leave=True,
               bar_format="{desc}: {elapsed}{postfix}")
    try:
        km = KameraModel.from_pretrained(name)
    finally:
        bar.update(1)
        bar.close()
    return km


def make_window(km: Any, args: argparse.Namespace) -> Any:
    from agentwin import Window
    from agentwin.store import ChunkStore

    store = ChunkStore(args.store, model_fingerprint=km.fingerprint) if args.store else None
    return Window(km, budget_tokens=args.budget_tokens, patch=args.patch, rank=args.rank, store=store)


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2, default=repr)


def steps_table(records: list) -> str:
    """One line per step: what was decided, what the window did."""
    lines = [f"  {'step':>4}  {'action':<34} {'observation':<26} {'window':<8} {'tokens':>6}  notes"]
    for r in records:
        action = "(start)" if r.step == 0 else json.dumps(r.action) if r.action else "(malformed)"
        notes = []
        if r.evicted:
            notes.append("evicted " + ", ".join(e.split(" (")[0] for e in r.evicted))
        if r.recalled:
            notes.append("recalled " + ", ".join(e.split(" (")[0] for e in r.recalled))
        if r.kl is not None:
            notes.append(f"KL {r.kl:.1e}")
        if r.error:
            notes.append("error: " + (r.error if len(r.error) < 60 else r.error[:57] + "..."))
        action = action if len(action) <= 34 else action[:31] + "..."
        lines.append(f"  {r.step:>4}  {action:<34} {(r.observation or '')[:26]:<26} {r.event or '':<8} "
                     f"{r.window_tokens:>6}  {'; '.join(notes)}")
    return "\n".join(lines)


def run_agent(args: argparse.Namespace, task: str, make_env: Callable[[Any], Any], needs_vlm: bool = False) -> int:
    """Load the model, open the environment, run the loop with the model deciding, report."""
    from agents.base import EnvError
    from agents.loop import AgentLoop
    from agents.model import WindowDecider

    progress = not args.quiet
    try:
        km = load_model(args.model, progress)
    except (ValueError, OSError, FileNotFoundError) as err:
        print(f"error: cannot load model {args.model!r}: {err}", file=sys.stderr)
        return 2
    if needs_vlm and not getattr(km, "is_vlm", False):
        print(f"error: {args.model} is a text-only model; this agent reads video frames and needs a "
              "vision-language model (--model tiny-qwen2.5-vl, or a Qwen2/2.5/3-VL path)", file=sys.stderr)
        return 2
    try:
        window = make_window(km, args)
        env = make_env(km)
    except EnvError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        loop = AgentLoop(env, window, WindowDecider(args.max_new_tokens), task, max_steps=args.max_steps,
                         log_path=args.log, progress=progress)
        result = loop.run()
    finally:
        env.close()
    print("\nsteps:")
    print(steps_table(result.records))
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


# ---- the three commands ------------------------------------------------------------------------

def _doc_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.pdf", help="the PDF to read")
    parser.add_argument("--question", required=True, help="what to find out from the document")
    parser.add_argument("--max-chars", type=_positive, default=1500, help="page text shown per observation (default 1500)")
    add_window_arguments(parser, model="smollm2", budget=1024, max_steps=12)


def _doc_run(args: argparse.Namespace) -> int:
    from agents.doc import PdfEnv

    return run_agent(args, args.question, lambda km: PdfEnv(
        args.file, render=bool(getattr(km, "is_vlm", False)), max_chars=args.max_chars, progress=not args.quiet))


def _web_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL", help="the start page (http or https)")
    parser.add_argument("--task", required=True, help="what the agent should find out or do")
    parser.add_argument("--allow-host", action="append", metavar="HOST",
                        help="a host the agent may visit (repeatable; '*.example.org' for subdomains); "
                             "default: the start URL's host")
    add_window_arguments(parser, model="smollm2", budget=2048, max_steps=12)


def _web_run(args: argparse.Namespace) -> int:
    from agents.web import BrowserEnv

    def make(km: Any) -> Any:
        return BrowserEnv(args.url, allow_hosts=args.allow_host or None, screenshot=bool(getattr(km, "is_vlm", False)))

    return run_agent(args, args.task, make)


def _video_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the video (mp4, mkv, webm, ...)")
    parser.add_argument("--question", required=True, help="what to find out from the video")
    parser.add_argument("--segment-seconds", type=float, default=4.0, help="seconds per segment chunk (default 4)")
    parser.add_argument("--fps", type=float, default=2.0, help="frames sampled per second (default 2, as qwen-vl-utils)")
    add_window_arguments(parser, model="tiny-qwen2.5-vl", budget=4096, max_steps=16)


def _video_run(args: argparse.Namespace) -> int:
    from agents.video import VideoEnv

    if not args.segment_seconds > 0 or not args.fps > 0:
        print("error: --segment-seconds and --fps must be positive", file=sys.stderr)
        return 2
    return run_agent(args, args.question, lambda km: VideoEnv(args.file, segment_seconds=args.segment_seconds,
                                                              fps=args.fps), needs_vlm=True)


def _doc(first_line: str) -> str:
    return first_line + "\n\n" + __doc__.split("\n\n", 1)[1]


DOC = SimpleNamespace(__doc__=_doc("Read a PDF page by page and answer a question (the document navigator)."),
                      add_arguments=_doc_arguments, run=_doc_run)
WEB = SimpleNamespace(__doc__=_doc("Browse from a start page in headless Chromium to do a task (the web agent)."),
                      add_arguments=_web_arguments, run=_web_run)
VIDEO = SimpleNamespace(__doc__=_doc("Watch a video segment by segment and answer a question (the long-video loop)."),
                        add_arguments=_video_arguments, run=_video_run)
