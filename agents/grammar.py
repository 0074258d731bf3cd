"""Actions as a grammar: the JSON schema of an agent's actions, and decoding held to it.

`action_schema(env_actions)` turns the action list an environment gives (`Env.actions()`, whose
meanings start with their arguments, `{"page": N} open page N`) plus the loop's own actions
(recall, answer) into one JSON schema: an object whose "action" is one of the names, followed by
exactly that action's arguments with their types (N: integer, SECONDS: number, "...": string,
true / false: an optional boolean). An environment may refine an action's arguments with
`action_arguments()` (name -> {argument: JSON schema}), e.g. an enum of directions.

`ActionGrammar(tokenizer, vocab_size)` compiles such a schema for one model's tokenizer with
xgrammar (compiled once per schema and kept) and hands out `ActionConstraint`s: a logits processor
with transformers' signature (`processor(input_ids, scores) -> scores`, usable in
`LogitsProcessorList`) that masks every token the schema does not allow next, plus `closed`, true
once the action object is complete, so decoding stops at its closing brace.

xgrammar was chosen over outlines (outlines-core) and lm-format-enforcer by measurement on the
embedded SmolLM2: all three gave the same replies, outlines-core builds a regex index over the
vocabulary for every schema (seconds per schema) and masks slower per token, and
lm-format-enforcer's transformers integration does not import under transformers 5
(`PreTrainedTokenizerBase` moved).
"""

from __future__ import annotations

import json
import re
from typing import Any

from agents.actions import LOOP_ACTIONS

# Bounds that keep an action within a decision's token budget (48 by default): a small model
# that loops inside a string is closed off instead of running out of tokens mid-object.
STRING_MAX = 80  # characters of a string argument (search texts, URLs, recall queries)
ANSWER_MAX = 120  # characters of an answer
INTEGER_MAX = 10**6

_PLACEHOLDER = re.compile(r'(:\s*)([A-Z][A-Z_]*)\b')


def _arguments_of(meaning: str) -> dict[str, Any]:
    """{argument: JSON schema} from the example object a meaning starts with ("{} ..." or none:
    no arguments)."""
    meaning = meaning.strip()
    if not meaning.startswith("{") or "}" not in meaning:
        return {}
    head = meaning[: meaning.index("}") + 1]
    filled = _PLACEHOLDER.sub(lambda m: m.group(1) + {"N": "0", "SECONDS": "0.5"}.get(m.group(2), '""'), head)
    try:
        example = json.loads(filled)
    except json.JSONDecodeError:
        raise ValueError(f"cannot read the arguments of the action description {meaning!r}; start it with "
                         'a JSON example such as {"page": N}') from None
    out = {}
    for name, value in example.items():
        if isinstance(value, bool):
            out[name] = {"type": "boolean"}
        elif isinstance(value, int):
            out[name] = {"type": "integer", "minimum": -INTEGER_MAX, "maximum": INTEGER_MAX}
        elif isinstance(value, float):
            out[name] = {"type": "number"}
        else:
            out[name] = {"type": "string", "maxLength": STRING_MAX}
    return out


def _variant(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    properties = {"action": {"const": name}, **arguments}
    required = ["action"] + [k for k, v in arguments.items() if v.get("type") != "boolean"]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def action_schema(env_actions: dict[str, str], refine: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The JSON schema of one action: the environment's (`env_actions`, as `Env.actions()` gives
    them; `refine`: per action, argument schemas that replace the derived ones) and the loop's own
    (recall by step, query or time; answer with its text)."""
    if not isinstance(env_actions, dict) or not env_actions:
        raise ValueError("env_actions must be a non-empty dict of action name -> description")
    variants = []
    for name, meaning in env_actions.items():
        if name in LOOP_ACTIONS:
            continue
        arguments = _arguments_of(meaning)
        arguments.update((refine or {}).get(name, {}))
        variants.append(_variant(name, arguments))
    text = {"type": "string", "minLength": 1, "maxLength": STRING_MAX}
    variants += [
        _variant("recall", {"step": {"type": "integer", "minimum": 0, "maximum": INTEGER_MAX}}),
        _variant("recall", {"query": text}),
        _variant("recall", {"time": {"type": "number"}}),
        _variant("answer", {"text": {**text, "maxLength": ANSWER_MAX}}),
    ]
    return {"anyOf": variants}


class ActionConstraint:
    """One decision's constraint: a logits processor (transformers' signature) over the tokens
    generated after `prime`, which the reply starts with; `closed` once the action is complete."""

    def __init__(self, compiled: Any, vocab_size: int, prime: str = "") -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._seen = 0  # generated tokens accepted so far
        self._first: int | None = None  # input length at the first call (the prompt)
        if prime and not self._matcher.accept_string(prime):
            raise ValueError(f"the reply prime {prime!r} does not start a valid action")

    @property
    def closed(self) -> bool:
        """The action object is complete (nothing but the end of the reply may follow)."""
        return self._matcher.is_completed()

    def accept(self, token: int) -> bool:
        """Advance over a generated token; False when the schema does not allow it."""
        self._seen += 1
        return bool(self._matcher.accept_token(int(token)))

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        """Mask `scores` `[1, vocab]` in place to the tokens allowed next. `input_ids` `[1, n]`
        are the tokens so far (prompt included, as transformers passes them): tokens past the
        first call's length that were not accepted yet are accepted here."""
        n = int(input_ids.shape[-1])
        if self._first is None:
            self._first = n
        for token in input_ids[0, self._first + self._seen:].tolist():
            if not self.accept(token):
                raise ValueError(f"token {token} does not fit the action schema")
        self._matcher.fill_next_token_bitmask(self._bitmask)
        vocab = scores.shape[-1]
        if vocab > self._bitmask.shape[-1] * 32:
            scores[..., self._bitmask.shape[-1] * 32:] = float("-inf")
        self._xgr.apply_token_bitmask_inplace(scores, self._bitmask.to(scores.device))
        return scores


class ActionGrammar:
    """Compiles action schemas for one tokenizer (xgrammar) and makes `ActionConstraint`s."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import xgrammar as xgr
        except ImportError as err:
            raise ImportError(f"constrained actions need xgrammar ({err}); run `make setup`") from None
        self.vocab_size = int(vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[str, Any] = {}

    def compile(self, schema: dict[str, Any]) -> Any:
        key = json.dumps(schema, sort_keys=True)
        if key not in self._compiled:
            self._compiled[key] = self._compiler.compile_json_schema(key, any_whitespace=False,
                                                                     separators=(", ", ": "))
        return self._compiled[key]

    def constraint(self, schema: dict[str, Any], prime: str = "") -> ActionConstraint:
        return ActionConstraint(self.compile(schema), self.vocab_size, prime)


_GRAMMARS: dict[int, tuple[Any, ActionGrammar]] = {}  # id(tokenizer) -> (tokenizer, its grammar)


def grammar_for(km: Any) -> ActionGrammar | None:
    """The (cached) `ActionGrammar` of a `KameraModel`'s tokenizer; None for a model without a
    transformers tokenizer (the built-in tiny models' byte tokenizer)."""
    tokenizer = getattr(km, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    config = km.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = max(int(text.vocab_size), len(tokenizer))
    held = _GRAMMARS.get(id(tokenizer))
    if held is None or held[0] is not tokenizer or held[1].vocab_size != vocab:
        held = _GRAMMARS[id(tokenizer)] = (tokenizer, ActionGrammar(tokenizer, vocab))
    return held[1]
