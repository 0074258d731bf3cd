"""What a window holds, as users hand it over: text, images and runs of video frames.

Each is a frozen value checked when it is made; `model_inputs` turns it into model inputs (token
ids, or a `VisionChunk` of processed pixels) and a content key for `Window.append`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

from agentwin.models.adapter import ChunkInput, KameraModel
from agentwin.models.vision import TextChunk
from agentwin.store import ChunkKey


@dataclass(frozen=True, slots=True)
class Text:
    """A text chunk: a str with at least one character that is not whitespace, encodable as UTF-8.

    Whitespace alone gives the patch fit nothing to weight, and a lone surrogate (what
    `errors="surrogateescape"` or a JSON `\\ud800` escape leaves) cannot reach the tokenizer: both
    are refused here rather than deep inside `Window.append`."""

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Text needs a str, got {type(self.text).__name__}")
        if not self.text:
            raise ValueError("Text needs at least one character")
        if self.text.isspace():
            raise ValueError(f"Text is only whitespace ({self.text[:16]!r}); a chunk needs at least one visible "
                             "character: put the whitespace at the start of the next chunk's text, or leave it out")
        try:
            self.text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"Text cannot be encoded as UTF-8: lone surrogate {self.text[err.start]!r} at index "
                             f"{err.start}; pass text decoded with errors='replace' (or with the surrogate "
                             "removed)") from None


@dataclass(frozen=True)
class Image:
    """An image chunk (vision-language models): a PIL image, a path, encoded bytes or an
    `[H, W, 3]` uint8 array, resized the qwen-vl-utils way to `min_tokens..max_tokens` tokens."""

    source: Any
    min_tokens: int = 4
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        _check_tokens(self.min_tokens, self.max_tokens)


@dataclass(frozen=True)
class Frames:
    """A run of video frames as one chunk (vision-language models), sampled by the caller (see
    `agents.video`); `timestamps` in seconds (default i / fps); token budgets are per frame."""

    frames: Sequence[Any]
    timestamps: Sequence[float] | None = None
    fps: float = 2.0
    min_tokens: int = 128
    max_tokens: int = 768

    def __post_init__(self) -> None:
        _check_tokens(self.min_tokens, self.max_tokens)


def _check_tokens(lo: object, hi: object) -> None:
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"token budgets need 1 <= min_tokens <= max_tokens (ints), got {lo!r}, {hi!r}")


Content = Union[Text, Image, Frames, str]


def model_inputs(km: KameraModel, tenant: str, content: Any) -> tuple[ChunkInput, ChunkKey]:
    """Model inputs of a chunk (a `TextChunk` of token ids, or a `VisionChunk`) and its content key, which covers
    what fixes its canonical KV (token ids; for images and frames the processed pixels, grid and
    settings). TypeError / ValueError for content the model cannot take."""
    fp = km.fingerprint
    if isinstance(content, Text):
        ids = km.tokenize(content.text)
        if ids.numel() == 0:
            raise ValueError("the text tokenizes to no tokens")
        return TextChunk(ids), ChunkKey.of(fp, "text", ids.tolist(), tenant=tenant)
    if isinstance(content, Image):
        vc = km.image(content.source, content.min_tokens, content.max_tokens)
    elif isinstance(content, Frames):
        vc = km.frames(content.frames, content.timestamps, content.fps, content.min_tokens, content.max_tokens)
    else:
        raise TypeError(f"append takes Text, Image, Frames or str, got {type(content).__name__}")
    return vc, ChunkKey.of(fp, vc.kind, bytes.fromhex(vc.digest), tenant=tenant)
