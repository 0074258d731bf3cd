"""The model side of the loop: anything that reads the window plus a prompt and replies with text.

`Decider.decide(window, prompt)` returns the model's raw reply; the loop parses the action out of
it (`agents.actions`). The window holds the observations as chunks; the prompt is the query read
after them (task, actions, the last error, what is in and out of view).

- `WindowDecider`: the real model through the window (greedy), so every decision reads the
  reused KV of the observations and only the prompt is prefilled. Told the actions
  (`use_actions`, which the loop calls), it holds the reply to their JSON schema
  (`agents.grammar`, xgrammar's token masks) and stops decoding where the action object closes.
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
    """The window's model, greedy, replying after `prompt + " " + prime` (after `prompt + prime`
    when the prompt ends in whitespace, as a chat prompt ends where the assistant's turn begins).

    `prime` starts the reply for the model (default `{"action": "`): the reply returned is `prime`
    plus what the model wrote. After `use_actions(actions, arguments)` (the loop calls it with the
    environment's actions) every token is held to the actions' JSON schema (`constrain=True`, on
    models with a transformers tokenizer) and decoding stops at the token that closes the action
    object; without a schema it still stops there (braces counted outside strings).
    `max_new_tokens` bounds a reply either way. `last` describes the last decision:
    `generated_tokens`, `tokens_after_close` (0 when decoding stopped at the close; None when the
    object never closed) and `constrained`. `avoid(names)` leaves those environment actions out
    of the schema until the next `avoid` (the loop passes the actions the environment has just
    refused in the state the model still sees)."""

    def __init__(self, max_new_tokens: int = 48, prime: str = '{"action": "', constrain: bool = True) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if not isinstance(prime, str):
            raise TypeError(f"prime must be a str, got {type(prime).__name__}")
        self.max_new_tokens, self.prime, self.constrain = max_new_tokens, prime, bool(constrain)
        self.schema: dict | None = None
        self.last: dict[str, Any] = {}
        self._actions: tuple[dict[str, str], dict[str, dict] | None] | None = None
        self._avoided: frozenset[str] = frozenset()

    def use_actions(self, actions: dict[str, str], arguments: dict[str, dict] | None = None,
                    window: Any = None) -> None:
        """Hold later replies to the schema of these actions (and the loop's recall / answer);
        with `window`, the schema is compiled for its model's tokenizer now rather than at the
        first decision."""
        from agents.grammar import action_schema, grammar_for

        self._actions, self._avoided = (dict(actions), arguments), frozenset()
        self.schema = action_schema(actions, arguments)
        if window is not None and self.constrain:
            grammar = grammar_for(window.km)
            if grammar is not None:
                grammar.compile(self.schema)

    def avoid(self, names: set[str] | frozenset[str]) -> None:
        """Leave the environment actions `names` out of the schema (empty: none); at least one
        environment action always stays, and the loop's recall and answer are never left out."""
        from agents.grammar import action_schema

        names = frozenset(names)
        if self._actions is None or names == self._avoided:
            return
        actions, arguments = self._actions
        kept = {n: d for n, d in actions.items() if n not in names}
        self._avoided = names if kept else frozenset()
        self.schema = action_schema(kept or actions, arguments)

    def decide(self, window: Any, prompt: str) -> str:
        # A chat prompt ends where the assistant's turn begins (a newline): the reply starts there.
        query = (prompt + self.prime if prompt[-1:].isspace() else f"{prompt} {self.prime}") if self.prime else prompt
        if not hasattr(window, "generate_ids"):  # a window without token-level decoding
            text = window.generate(query, max_new_tokens=self.max_new_tokens)
            self.last = {"generated_tokens": None, "tokens_after_close": None, "constrained": False}
            return self.prime + text
        constraint = self._constraint(window)
        decode = window.km.tokenizer.decode
        if constraint is not None:
            def stop(ids: list[int]) -> bool:
                return not constraint.accept(ids[-1]) or constraint.closed
        else:
            def stop(ids: list[int]) -> bool:
                return _closes(self.prime + decode(ids))
        ids = window.generate_ids(query, self.max_new_tokens, logits_processor=constraint, stop=stop)
        self.last = {"generated_tokens": len(ids), "tokens_after_close": _after_close(self.prime, ids, decode),
                     "constrained": constraint is not None}
        return self.prime + decode(ids)

    def _constraint(self, window: Any) -> Any:
        if not self.constrain or self.schema is None:
            return None
        from agents.grammar import grammar_for

        grammar = grammar_for(window.km)
        return None if grammar is None else grammar.constraint(self.schema, self.prime)


def _closes(text: str) -> bool:
    """Whether `text` holds a complete top-level JSON object (braces outside strings balance)."""
    depth, quote, escaped, opened = 0, False, False, False
    for ch in text:
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quote = False
        elif ch == '"':
            quote = True
        elif ch == "{":
            depth, opened = depth + 1, True
        elif ch == "}" and opened:
            depth -= 1
            if depth == 0:
                return True
    return False


def _after_close(prime: str, ids: list[int], decode: Callable[[list[int]], str]) -> int | None:
    """Tokens of `ids` after the one that closed the action object (None: it never closed)."""
    for n in range(1, len(ids) + 1):
        if _closes(prime + decode(ids[:n])):
            return len(ids) - n
    return None
