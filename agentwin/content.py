"""What users hand a window: `Text`, `Image` and `Frames`, frozen values checked when made, and `model_inputs`, which
turns one into model inputs and a content key for `Window.append`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

from agentwin.models.adapter import ChunkInput, KameraModel
from agentwin.models.vision import TextChunk
from agentwin.store import ChunkKey


@dataclass(frozen=True, slots=True)
class Text:
    """A text chunk. TypeError for a non-str; ValueError for an empty or whitespace-only str (the patch fit has nothing
    to weigh) or one UTF-8 cannot encode (a lone surrogate), refused here rather than inside `Window.append`."""

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
    """An image chunk (VLMs): a PIL image, path, encoded bytes or `[H, W, 3]` uint8 array, resized to
    `min_tokens..max_tokens` tokens; ValueError for bad budgets."""

    source: Any
    min_tokens: int = 4
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        _check_tokens(self.min_tokens, self.max_tokens)


@dataclass(frozen=True)
class Frames:
    """A run of video frames as one chunk (VLMs), sampled by the caller; `timestamps` in seconds (default i / fps);
    token budgets are per frame."""

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
    """A chunk's model inputs (`TextChunk` or `VisionChunk`) and content key, which covers what fixes its canonical KV.
    TypeError / ValueError for content the model cannot take."""
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
