"""Observations made to fit the window: split into chunks, scaled, or cut, and said so.

A window of `budget_tokens` cannot hold a chunk larger than itself, and one observation (a dense
page, a long web page, a screenshot, a run of video frames) may be larger. `fit_observation`
turns an observation into chunks that together take at most the budget:

- text that fits what the images leave of the budget stays one chunk, as it is; longer text is
  split at line ends (a line longer than that at a space) into parts of at most half the budget,
  each with its own header (`[page 3/30, part 2/4]`), so the window can evict and recall them one
  by one;
- images are scaled to at most half the budget between them (`Image.max_tokens`), video frames
  to a per-frame token count that makes the segment fit (`Frames.max_tokens`); frames that cannot
  fit at the smallest size are left out;
- text parts past what is left of the budget are cut: the last part kept says how many tokens
  did not fit, and the returned note says what was done, for the step record.

Text is measured with the model's tokenizer (`km.tokenize`), as the window counts it; vision
chunks by the upper bound their token budget sets.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from agents.base import EnvError, Observation

MIN_VISION_TOKENS = 4  # the smallest image / frame size asked of the processor
TIMESTAMP_TOKENS = 14  # per frame pair: vision start / end and a "<12.5 seconds>" stamp (Qwen3-VL)


def _header(label: str, index: int, parts: int) -> str:
    return f"\n[{label}]\n" if parts == 1 else f"\n[{label}, part {index}/{parts}]\n"


def _notice(tokens: int) -> str:
    return f"\n[... {tokens} more tokens did not fit]\n"


def split_text(text: str, limit: int, count: Callable[[str], int]) -> list[str]:
    """`text` in pieces of at most `limit` tokens by `count`, cut at line ends where possible,
    else at the last space (else anywhere) within the limit; no character is lost or repeated."""
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    pieces: list[str] = []
    current = ""
    for line in text.splitlines(keepends=True):
        if count(current + line) <= limit:
            current += line
            continue
        if current:
            pieces.append(current)
            current = ""
        while count(line) > limit:
            cut = _longest_prefix(line, limit, count)
            pieces.append(line[:cut])
            line = line[cut:]
        current = line
    if current:
        pieces.append(current)
    return pieces


def _longest_prefix(line: str, limit: int, count: Callable[[str], int]) -> int:
    """The length of the longest prefix of `line` within `limit` tokens (at least 1 character),
    moved back to just after a space when one is in its second half."""
    lo, hi = 1, len(line)
    while lo < hi:  # the largest n with count(line[:n]) <= limit
        mid = (lo + hi + 1) // 2
        if count(line[:mid]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    space = line.rfind(" ", 0, lo)
    return space + 1 if space >= lo // 2 else lo


def _vision_chunks(obs: Observation, share: int) -> tuple[list[Any], int, list[str]]:
    """The observation's images as Image chunks, or its frames as one Frames chunk, within
    `share` tokens (upper bound); returns (chunks, tokens bound, notes)."""
    import agentwin

    if not hasattr(agentwin, "Image") or not hasattr(agentwin, "Frames"):
        raise EnvError("this agentwin has no image or frame chunks (agentwin.Image / agentwin.Frames); "
                       "use a text model")
    notes: list[str] = []
    if obs.timestamps:
        frames, stamps = list(obs.images), list(obs.timestamps)
        default = agentwin.Frames(frames, timestamps=stamps)
        while True:
            groups = math.ceil(len(frames) / 2)
            per_frame = min(default.max_tokens, (share - 2) // groups - TIMESTAMP_TOKENS)
            if per_frame >= MIN_VISION_TOKENS or len(frames) <= 2:
                break
            frames, stamps = frames[:-2], stamps[:-2]
        per_frame = max(per_frame, MIN_VISION_TOKENS)
        if len(frames) < len(obs.images):
            notes.append(f"{len(obs.images) - len(frames)} of {len(obs.images)} frames left out")
        if per_frame < default.max_tokens:
            notes.append(f"frames scaled to at most {per_frame} tokens each")
        chunk = agentwin.Frames(frames, timestamps=stamps, min_tokens=min(default.min_tokens, per_frame),
                                max_tokens=per_frame)
        return [chunk], groups * (per_frame + TIMESTAMP_TOKENS) + 2, notes
    default = agentwin.Image(obs.images[0])
    each = max(MIN_VISION_TOKENS, min(default.max_tokens, share // len(obs.images) - 2))
    if each < default.max_tokens:
        notes.append(f"{'images' if len(obs.images) > 1 else 'image'} scaled to at most {each} tokens")
    chunks = [agentwin.Image(image, min_tokens=min(default.min_tokens, each), max_tokens=each) for image in obs.images]
    return chunks, len(chunks) * (each + 2), notes


def fit_observation(obs: Observation, km: Any, budget_tokens: int, form: Callable[[str], Any] | None = None
                    ) -> tuple[list[Any], str | None]:
    """The chunks of `obs` for a window of `budget_tokens` (see the module docstring) and a note
    of what was done to make them fit (None when nothing was). form: how a text chunk's text
    becomes the chunk (default `agentwin.Text`; a chat window's `Chat.part`), measured as formed."""
    from agentwin import Text

    form = Text if form is None else form
    count = lambda s: int(km.tokenize(form(s).text).numel()) if s.strip() else 0  # noqa: E731
    chunks: list[Any] = []
    notes: list[str] = []
    room = int(budget_tokens)
    if obs.images and getattr(km, "is_vlm", False):
        chunks, used, notes = _vision_chunks(obs, budget_tokens // 2)
        room -= used
    body = obs.text.rstrip() + "\n" if obs.text.strip() else ""
    single = f"\n[{obs.label}]\n{obs.text}".rstrip() + "\n"
    total = count(single)
    if total <= room:
        return chunks + [form(single)], "; ".join(notes) or None
    notice = _notice(99999)
    reserve = count(_header(obs.label, 99, 99)) + count(notice)
    part_limit = min(budget_tokens // 2, room) - reserve
    if part_limit < 8:
        notes.append(f"its text ({total} tokens) left out: no room for it in the window")
        return chunks, "; ".join(notes)
    pieces = split_text(body, part_limit, count) or [""]
    kept, used = [], 0
    for piece in pieces:
        tokens = count(piece) + reserve
        if used + tokens > room:
            break
        kept.append(piece)
        used += tokens
    cut_tokens = sum(count(p) for p in pieces[len(kept):])
    texts = []
    for index, piece in enumerate(kept, 1):
        text = _header(obs.label, index, len(kept)) + piece
        if index == len(kept) and cut_tokens:
            text = text.rstrip("\n") + _notice(cut_tokens)
        texts.append(text)
    if len(kept) > 1:
        notes.append(f"text of {total} tokens split into {len(kept)} chunks")
    if cut_tokens:
        notes.append(f"{cut_tokens} tokens of text cut to fit the window of {budget_tokens}")
    return chunks + [form(t) for t in texts], "; ".join(notes) or None
