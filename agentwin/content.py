"""What a window holds, as users hand it over: text, images and runs of video frames.

Each is a frozen value checked when it is made; `Window.append` turns it into model inputs (token
ids, or a `VisionChunk` of processed pixels) and a content key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union


@dataclass(frozen=True, slots=True)
class Text:
    """A text chunk."""

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Text needs a str, got {type(self.text).__name__}")
        if not self.text:
            raise ValueError("Text needs at least one character")


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
