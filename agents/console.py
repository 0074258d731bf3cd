"""What the agent commands load and print: a model with its progress kept quiet off a terminal,
a model's kind told before it loads, and the table of an agent run's steps."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from typing import Any


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


def steps_table(records: list) -> str:
    """One line per step: what was decided, what the window did."""
    lines = [f"  {'step':>4}  {'action':<34} {'observation':<26} {'window':<8} {'tokens':>6}  notes"]
    for r in records:
        action = "(start)" if r.step == 0 else json.dumps(r.action) if r.action else "(malformed)"
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
            notes.append(f"{r.store_hits} store hits")
        if getattr(r, "encoder_runs", 0) or getattr(r, "encoder_reused", 0):
            notes.append(f"vision encoder {r.encoder_runs} runs, {r.encoder_reused} read back")
        if r.kl is not None:
            notes.append(f"KL {r.kl:.1e}")
        if r.error:
            notes.append("error: " + (r.error if len(r.error) < 60 else r.error[:57] + "..."))
        action = action if len(action) <= 34 else action[:31] + "..."
        lines.append(f"  {r.step:>4}  {action:<34} {(r.observation or '')[:26]:<26} {r.event or '':<8} "
                     f"{r.window_tokens:>6}  {'; '.join(notes)}")
    return "\n".join(lines)
