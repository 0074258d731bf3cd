"""Actions the model emits: one JSON object per decision, parsed tolerantly.

Small models wrap JSON in code fences, use single quotes, add prose before or after it, or leave a
trailing comma. `parse_action` accepts all of that: it takes the first balanced `{...}` object in
the reply (fenced blocks first) that reads as an object with an "action" name, reading each as
JSON, then as a Python literal (single quotes, True/False/None), then with trailing commas
removed; a reply cut off inside its object is closed. What it cannot read raises `MalformedAction` with a message the loop shows
to the model (`retry_message`) before asking again.

Every action is a dict with a string "action" key, e.g. `{"action": "goto", "page": 3}`. The
loop's own actions are "answer" (`{"action": "answer", "text": "..."}`, ends the run) and "recall"
(`{"action": "recall", "step": 2}`, brings back the observation of an earlier step; `"query"`
instead of `"step"` finds it by similarity, `"time"` by the seconds it covers).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Iterable

LOOP_ACTIONS = {
    "recall": '{"step": N} bring the observation of step N back into view (or "query": "..." for the closest '
              'one, "time": SECONDS for the one covering that second)',
    "answer": '{"text": "..."} finish with this answer',
}
EXAMPLE = '{"action": "answer", "text": "..."}'


class MalformedAction(ValueError):
    """The model's reply holds no usable action; the message says what was wrong."""


_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*\n?(.*?)```", re.S)


def _objects(text: str):
    """Balanced {...} spans of `text` in order, respecting quoted strings (single or double)."""
    start = text.find("{")
    while start != -1:
        depth, quote, escaped, end = 0, None, False, None
        for index in range(start, len(text)):
            ch = text[index]
            if quote:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == quote:
                    quote = None
            elif ch in "\"'":
                quote = ch
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    end = index + 1
                    break
        if end is not None:
            yield text[start:end]
            start = text.find("{", end)
        else:  # unbalanced from this brace (an apostrophe opened a "string"?): try the next one
            start = text.find("{", start + 1)


def _loads(candidate: str) -> Any:
    """JSON, then a Python literal, then both again without trailing commas."""
    attempts = [candidate, re.sub(r",\s*([}\]])", r"\1", candidate)]
    for text in attempts:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
        pythonic = re.sub(r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", re.sub(r"\bnull\b", "None", text)))
        try:
            return ast.literal_eval(pythonic)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    raise MalformedAction(f"could not read {_clip(candidate)} as JSON")


def _clip(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


def parse_action(reply: str, allowed: Iterable[str] | None = None) -> dict[str, Any]:
    """The action in a model reply; `allowed`: the action names accepted (None: any).

    MalformedAction when the reply holds no JSON object, the object has no string "action", or
    the action is not allowed."""
    if not isinstance(reply, str):
        raise MalformedAction(f"the reply must be text, got {type(reply).__name__}")
    if not reply.strip():
        raise MalformedAction("the reply was empty")
    sources = [m.group(1) for m in _FENCE.finditer(reply)] + [reply]
    candidates = [obj for source in sources for obj in _objects(source)]
    if not candidates and "{" in reply:  # cut off mid-object (token limit): try closing it
        tail = reply[reply.index("{"):].rstrip().rstrip(",")
        candidates = [tail + "}", tail + '"}', tail + "'}"]
    first_error: MalformedAction | None = None
    for candidate in candidates:
        try:
            action = _loads(candidate)
            if not isinstance(action, dict):
                raise MalformedAction(f"expected a JSON object, got {type(action).__name__}")
            name = action.get("action")
            if not isinstance(name, str) or not name.strip():
                raise MalformedAction(f'the object {_clip(candidate)} has no "action" name')
            break
        except MalformedAction as err:
            first_error = first_error or err
    else:
        raise first_error or MalformedAction(f"no JSON object in the reply {_clip(reply)}")
    action = {str(k): v for k, v in action.items()}
    action["action"] = name.strip().lower()
    if allowed is not None:
        names = sorted(set(allowed))
        if action["action"] not in names:
            raise MalformedAction(f"unknown action {action['action']!r}; choose one of {', '.join(names)}")
    return action


def retry_message(error: Exception | str) -> str:
    """What the model is told after a reply that could not be used."""
    return (f"Your last reply could not be used: {error}. Reply with exactly one JSON object, "
            f"for example {EXAMPLE}.")


def describe_actions(env_actions: dict[str, str]) -> str:
    """The action list for the prompt, one JSON example per line: the environment's actions, then
    the loop's own. A meaning that starts with its arguments (`{"page": N} open page N`) has them
    merged into the example (`{"action": "goto", "page": N} open page N`)."""
    lines = []
    for name, meaning in {**env_actions, **LOOP_ACTIONS}.items():
        meaning = meaning.strip()
        args = ""
        if meaning.startswith("{") and "}" in meaning:
            inner, meaning = meaning[1:meaning.index("}")].strip(), meaning[meaning.index("}") + 1:]
            args = f", {inner}" if inner else ""
            meaning = meaning.strip().lstrip("-:").strip()
        lines.append(f'- {{"action": "{name}"{args}}} {meaning}'.rstrip())
    return "\n".join(lines)
