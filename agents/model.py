"""The model side of the loop: anything that reads the window plus a prompt and replies with text.

`Decider.decide(window, prompt)` returns the model's raw reply; the loop parses the action out of
it (`agents.actions`). The window holds the observations as chunks; the prompt is the query read
after them (task, actions, the last error, what is in and out of view).

- `WindowDecider`: the real model through `Window.generate` (greedy), so every decision reads the
  reused KV of the observations and only the prompt is prefilled.
- `ScriptedDecider`: fixed replies or a function, for tests and for scripted navigation.

A decider that keeps its own state may also have `observe(observation)`: the loop calls it with
every observation the environment gives (heuristic policies follow the pages this way).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Protocol, runtime_checkable


@runtime_checkable
class Decider(Protocol):
    """Reads the window and the prompt, returns the model's raw reply."""

    def decide(self, window: Any, prompt: str) -> str: ...


class ScriptExhausted(RuntimeError):
    """A ScriptedDecider was asked for more replies than it was given."""


class ScriptedDecider:
    """Replies from a list (str, or dicts sent as JSON) or from `fn(window, prompt) -> str | dict`.

    `prompts` keeps every prompt it was shown, for tests to inspect."""

    def __init__(self, replies: Iterable[str | dict] | Callable[[Any, str], str | dict]) -> None:
        if callable(replies):
            self._fn, self._replies = replies, None
        else:
            self._fn, self._replies = None, list(replies)
            bad = [r for r in self._replies if not isinstance(r, (str, dict))]
            if bad:
                raise TypeError(f"scripted replies must be str or dict, got {type(bad[0]).__name__}")
        self.prompts: list[str] = []

    def decide(self, window: Any, prompt: str) -> str:
        self.prompts.append(prompt)
        if self._fn is not None:
            reply = self._fn(window, prompt)
        else:
            index = len(self.prompts) - 1
            if index >= len(self._replies):
                raise ScriptExhausted(f"the script has {len(self._replies)} replies and was asked for reply {index + 1}; "
                                      "add replies or lower the step limit")
            reply = self._replies[index]
        return json.dumps(reply) if isinstance(reply, dict) else str(reply)


class WindowDecider:
    """The window's model, greedy: `window.generate(prompt + " " + prime, max_new_tokens)`.

    `prime` starts the reply for the model (default `{"action": "`): small models then complete a
    JSON action instead of writing prose; the reply returned is `prime` plus what the model wrote.
    `prime=""` leaves the reply entirely to the model."""

    def __init__(self, max_new_tokens: int = 48, prime: str = '{"action": "') -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if not isinstance(prime, str):
            raise TypeError(f"prime must be a str, got {type(prime).__name__}")
        self.max_new_tokens, self.prime = max_new_tokens, prime

    def decide(self, window: Any, prompt: str) -> str:
        query = f"{prompt} {self.prime}" if self.prime else prompt
        return self.prime + window.generate(query, max_new_tokens=self.max_new_tokens)
