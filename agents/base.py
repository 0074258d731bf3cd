"""What every agent environment shares: observations, the environment protocol and its errors.

An environment (a browser, a video, a PDF) turns actions into observations. The loop
(`agents.loop`) turns observations into window chunks and asks the model for the next action.

- `Observation`: what the agent sees after a step. `text` is a compact text view (for text-only
  models and for grounding); `images` are the pixels (screenshot, rendered page, video frames) for
  vision-language models; `content_key()` identifies the content, so that the same page seen again
  is recognised and its chunk recalled instead of re-encoded.
- `Env`: `reset()` gives the first observation, `act(action)` performs one action (a dict parsed
  from the model's JSON, e.g. `{"action": "click", "element": 3}`) and gives the next one,
  `actions()` describes the actions for the model's prompt, `close()` frees resources.
- `ActionError`: the action could not be done (unknown element, host not allowed, page unreachable,
  page out of range). The loop shows the message to the model and goes on.
- `EnvError`: the environment cannot start or go on at all (not a PDF, unreadable video, no
  browser). The loop stops with the message.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class ActionError(Exception):
    """An action that could not be performed; recoverable (the message goes back to the model)."""


class EnvError(Exception):
    """The environment cannot start or continue; the message says what to do."""


@dataclass(frozen=True)
class Observation:
    """One observation. `label` names it for people and for the model ("https://.../a.html",
    "page 3/12", "video 00:12-00:16"); `timestamps` are seconds, one per frame, for video."""

    label: str
    text: str = ""
    images: tuple[Any, ...] = ()  # PIL.Image.Image
    timestamps: tuple[float, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError("Observation needs a non-empty str label")
        if not isinstance(self.text, str):
            raise TypeError(f"Observation.text must be a str, got {type(self.text).__name__}")
        if not isinstance(self.images, tuple):
            raise TypeError("Observation.images must be a tuple of PIL images")
        if self.timestamps and len(self.timestamps) != len(self.images):
            raise ValueError(f"{len(self.timestamps)} timestamps for {len(self.images)} frames")

    def content_key(self) -> str:
        """sha256 of the text and the images' pixels (mode, size, raw bytes); the label is left
        out, so the same content reached under another name is still recognised."""
        h = hashlib.sha256()
        h.update(len(self.text.encode()).to_bytes(8, "little") + self.text.encode())
        for image in self.images:
            raw = image.tobytes() if hasattr(image, "tobytes") else _png(image)
            h.update(f"{getattr(image, 'mode', '?')}:{getattr(image, 'size', '?')}:{len(raw)}".encode())
            h.update(raw)
        return h.hexdigest()


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@runtime_checkable
class Env(Protocol):
    """An agent environment; see the module docstring."""

    name: str

    def reset(self) -> Observation: ...

    def actions(self) -> dict[str, str]:
        """Action name -> its arguments and meaning, for the model's prompt ("answer" is the
        loop's own and is not listed)."""
        ...

    def act(self, action: dict[str, Any]) -> Observation: ...

    def close(self) -> None: ...
