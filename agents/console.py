"""What the agent commands load and print: a model with its progress kept quiet off a terminal,
a model's kind told before it loads, the table of an agent run's steps, and the run itself
(`run_agent`: check the input, load the model, run the loop with the model deciding, report)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from argparse import ArgumentTypeError
from typing import Any, Callable, Iterator


class _Quiet(io.StringIO):
    """stderr while a model loads under --quiet: progress bars dropped, other lines kept."""

    def lines(self) -> list[str]:
        kept = []
        for line in self.getvalue().replace("\r", "\n").splitlines():
            if line.strip() and "it/s]" not in line and "%|" not in line and "s/it]" not in line:
                kept.append(line)
        return kept


def load_model(name: str, progress: bool = True) -> Any:
    """The KameraModel `name`; ValueError/OSError say what went wrong. With `progress`, a line
    before and after (and the library's own bars on a terminal); without, no progress output."""
    from agentwin import KameraModel

    if progress:
        print(f"loading {name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if progress and sys.stderr.isatty():
        km = KameraModel.from_pretrained(name)
    else:
        captured = _Quiet()
        try:
            with contextlib.redirect_stderr(captured):
                km = KameraModel.from_pretrained(name)
        finally:
            for line in captured.lines():
                print(line, file=sys.stderr)
    if progress:
        print(f"loaded {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return km


def model_kind(name: str) -> tuple[bool | None, bool]:
    """(vision-language?, random weights?) of a model name without loading it: built-in names,
    and local directories by their config.json; (None, False) when it cannot be told here."""
    from agentwin.models.zoo import TINY

    if name == "smollm2":
        return False, False
    if name in TINY:
        return TINY[name].multimodal, True
    config = os.path.join(name, "config.json")
    if os.path.isfile(config):
        try:
            with open(config) as fh:
                return "vision_config" in json.load(fh), False
        except (OSError, ValueError):
            return None, False
    return None, False


# The step table's wrapped columns: (title, width, alignment); notes follow, unwrapped.
_COLUMNS = (("step", 4, ">"), ("action", 34, "<"), ("observation", 30, "<"), ("window", 8, "<"), ("tokens", 6, ">"))


def steps_table(records: list) -> str:
    """One row per step: what was decided, what it showed, what the window did, and notes (fits,
    evictions, recalls, store hits, KL, the step's error). Nothing is cut: an action or an
    observation label longer than its column goes on over the lines below, in the same column,
    and the notes (the error whole) end the row's first line."""
    lines = [_row([title for title, _, _ in _COLUMNS], "notes")]
    for r in records:
        action = "(start)" if r.step == 0 else json.dumps(r.action) if r.action else "(malformed)"
        cells = [_wrap(text, width) for text, (_, width, _) in
                 zip((str(r.step), action, r.observation or "", r.event or "", str(r.window_tokens)), _COLUMNS)]
        for i in range(max(len(c) for c in cells)):
            lines.append(_row([c[i] if i < len(c) else "" for c in cells], _notes(r) if i == 0 else ""))
    return "\n".join(lines)


def _row(cells: list[str], notes: str) -> str:
    step, *rest = (f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, _COLUMNS))
    return f"  {step}  {' '.join(rest)}  {notes}".rstrip()


def _notes(r: Any) -> str:
    notes = []
    if getattr(r, "fitted", None):
        notes.append(r.fitted)
    if r.evicted:
        notes.append(f"evicted {getattr(r, 'evicted_chunks', len(r.evicted))} chunks of "
                     + ", ".join(e.split(" (")[0] for e in r.evicted))
    if r.recalled:
        notes.append(f"recalled {getattr(r, 'recalled_chunks', len(r.recalled))} chunks of "
                     + ", ".join(e.split(" (")[0] for e in r.recalled)
                     + (" (closest to the task)" if getattr(r, "kept", None) else ""))
    if getattr(r, "store_hits", 0):
        notes.append(f"{r.store_hits} chunks read from the store")
    if getattr(r, "encoder_runs", 0) or getattr(r, "encoder_reused", 0):
        notes.append(f"vision encoder {r.encoder_runs} runs, {r.encoder_reused} read back")
    if r.kl is not None:
        notes.append(f"KL {r.kl:.1e}")
    if r.error:
        notes.append("error: " + " ".join(r.error.splitlines()))
    return "; ".join(notes)


def _wrap(text: str, width: int) -> list[str]:
    """`text` in pieces of at most `width` characters that join back to `text`: each broken
    before a space, or after one of `/,&?`, in its second half where there is one, else at the
    width (a URL has no spaces)."""
    pieces = []
    while len(text) > width:
        cut = next((i for i in range(width, width // 2, -1) if text[i] == " " or text[i - 1] in "/,&?"), width)
        pieces.append(text[:cut])
        text = text[cut:]
    return pieces + [text]


VLM_HINT = ("pass a vision-language model with --model: a local path or Hugging Face id of a Qwen2-VL, "
            "Qwen2.5-VL or Qwen3-VL checkpoint (e.g. Qwen/Qwen2.5-VL-3B-Instruct)")


def make_window(km: Any, args: Any) -> Any:
    """The window the options describe; `args.store` (checked by the command's parser: a directory
    or a redis:// / rediss:// URL) is opened by `open_store`, as `agentwin batch` opens it."""
    from agentwin import Window
    from agentwin.store import open_store

    from agentwin.policies import PATCH_POLICIES

    store = open_store(args.store, model_fingerprint=km.fingerprint) if args.store else None
    if args.patch not in PATCH_POLICIES:  # exact, survive, refresh: no patch settings
        return Window(km, budget_tokens=args.budget_tokens, patch=args.patch, store=store)
    return Window(km, budget_tokens=args.budget_tokens, patch=args.patch, rank=args.rank, store=store,
                  patch_bytes=getattr(args, "patch_bytes", None), max_kl=getattr(args, "max_kl", None))


def window_option_error(args: Any) -> str | None:
    """What is wrong with the window options together (`--rank`, `--patch-bytes`, `--max-kl`), to be
    refused before a model is loaded; None when they agree."""
    from agentwin.policies import PATCH_POLICIES

    rank = "exact" if args.rank is None else args.rank
    patch = getattr(args, "patch", "exact")
    given = [flag for flag, set_ in (("--rank", args.rank not in ("budget", None)), ("--patch-bytes", getattr(args, "patch_bytes", None)
                                                                         is not None),
                                     ("--max-kl", getattr(args, "max_kl", None) is not None)) if set_]
    if patch not in PATCH_POLICIES and given:
        return (f"{', '.join(given)} set(s) the patches of a patch policy, and --patch {patch} fits none; "
                "add --patch origin-akin (or another patch policy) to use them")
    if getattr(args, "patch_bytes", None) is not None and args.rank != "budget":
        return f"--patch-bytes sets the patch ranks itself; use it with --rank budget, not --rank {rank}"
    if getattr(args, "max_kl", None) is not None and args.rank is None:
        return ("--max-kl is a fidelity target for low-rank patches; exact patches (--rank exact) meet any: "
                "drop --max-kl, or use --rank budget or a rank with it")
    return None


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2, default=repr)


def refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU threads set to `threads` inside the block (None: left as they are); the
    caller's count is back after it."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    vlm, random_weights = model_kind(args.model)
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
    with torch_threads(getattr(args, "threads", None)):
        return _load_and_run(args, task, make_env, needs_vlm)


def _load_and_run(args: Any, task: str, make_env: Callable[[Any], Any], needs_vlm: bool) -> int:
    from agents.base import EnvError
    from agents.loop import AgentLoop
    from agents.model import WindowDecider

    progress = not args.quiet
    try:
        km = load_model(args.model, progress)
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


# ---- command-line argument types (shared by `agentwin doc | web | video | batch | demo`) ----

def rank_arg(text: str) -> int | str | None:
    """`--rank`: `budget` (each chunk's patch within --patch-bytes of its KV bytes), a positive
    int, or `exact` (full-rank float32 patches: the window equals a re-prefill)."""
    if text.lower() in ("exact", "none", "full"):
        return None
    if text.lower() == "budget":
        return "budget"
    try:
        return positive_arg(text)
    except ArgumentTypeError:
        raise ArgumentTypeError(f"--rank must be 'budget', a positive integer or 'exact', got {text!r}") from None


def fraction_arg(text: str) -> float:
    """`--patch-bytes`: a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def kl_arg(text: str) -> float:
    """`--max-kl`: a positive, finite number of nats."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a positive KL in nats (such as 0.0024), got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ArgumentTypeError(f"expected a positive KL in nats (such as 0.0024), got {text!r}")
    return value


def question_arg(text: str) -> str:
    """`--question` / `--task`: text with something in it, encodable as UTF-8 (argv bytes that are
    not UTF-8 reach Python as lone surrogates)."""
    if not text.strip():
        raise ArgumentTypeError("is empty; say what the agent should find out or do")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ArgumentTypeError(f"is not valid UTF-8 text (byte {text[err.start].encode('utf-8', 'surrogateescape')!r} "
                                f"at character {err.start}); write it in UTF-8") from None
    return text


def positive_float_arg(text: str) -> float:
    """A positive, finite number (seconds, frames per second)."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a positive, finite number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ArgumentTypeError(f"expected a positive, finite number, got {text!r}")
    return value


def positive_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
