"""What the agent commands load and print: a model with its progress kept quiet off a terminal,
a model's kind told before it loads, the table of an agent run's steps, torch's threads for a
block. The commands themselves (their options and the run) are in `tools/`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from typing import Any, Iterator


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
