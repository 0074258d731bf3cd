"""Chat-formatted windows: `Chat(km)` cuts the model's chat template into a head (system turn, opening of the user
turn), parts of the user turn and a question (closing it, opening the assistant's), so that the chunks concatenated
tokenize to the model's own template applied to the conversation (`Chat.reference_ids`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from agentwin.content import Text

_SYSTEM, _USER = "\x00agentwin-system\x00", "\x00agentwin-user\x00"

# Families whose GGUF files carry no chat template: (prefix, between, suffix, no-system prefix).
_BUILT_IN = {
    "gemma3": ("<bos><start_of_turn>user\n", "\n\n", "<end_of_turn>\n<start_of_turn>model\n",
               "<bos><start_of_turn>user\n"),
}
_BUILT_IN["gemma3_text"] = _BUILT_IN["gemma3"]


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """A template cut at the texts: `prefix` + system + `between` + user content + `suffix`;
    `bare` is what precedes the user content when there is no system text."""

    prefix: str
    between: str
    suffix: str
    bare: str


def _cut(template_text: str, with_system: bool) -> tuple[str, str, str]:
    if with_system:
        a, rest = template_text.split(_SYSTEM)
        b, c = rest.split(_USER)
        return a, b, c
    a, c = template_text.split(_USER)
    return a, "", c


def chat_format(tokenizer: Any, model_type: str = "") -> ChatFormat:
    """The chat format of a tokenizer's template (or the built-in one of `model_type`).
    ValueError when there is neither, or the template does not place the texts in order."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        try:
            whole = tokenizer.apply_chat_template([{"role": "system", "content": _SYSTEM},
                                                   {"role": "user", "content": _USER}],
                                                  tokenize=False, add_generation_prompt=True)
            bare = tokenizer.apply_chat_template([{"role": "user", "content": _USER}],
                                                 tokenize=False, add_generation_prompt=True)
            prefix, between, suffix = _cut(whole, True)
            bare_prefix, _, bare_suffix = _cut(bare, False)
        except Exception as err:  # a template's own error: say which and what to do
            raise ValueError(f"the tokenizer's chat template cannot be cut into system / user / assistant places "
                             f"({type(err).__name__}: {err}); pass template= to Chat") from None
        if bare_suffix != suffix:
            raise ValueError("the chat template closes the user turn differently with and without a system message; "
                             "pass template= to Chat")
        return ChatFormat(prefix, between, suffix, bare_prefix)
    if model_type in _BUILT_IN:
        return ChatFormat(*_BUILT_IN[model_type])
    raise ValueError(f"the tokenizer has no chat template and agentwin has no built-in one for {model_type!r}; "
                     "pass template= (a Jinja chat template string) to Chat, or use plain Text chunks")


class Chat:
    """Chunks and questions in the chat format of `km`'s model; `template`: a Jinja chat template to use instead of the
    tokenizer's or the built-in one. TypeError for a non-KameraModel, ValueError for an unusable template; texts given
    to `head`, `part` and `question` must be non-blank str (else TypeError / ValueError)."""

    def __init__(self, km: Any, template: str | None = None) -> None:
        tokenizer = getattr(km, "tokenizer", None)
        if tokenizer is None or not hasattr(km, "tokenize"):
            raise TypeError(f"km must be a KameraModel, got {type(km).__name__}")
        if template is not None:
            if not isinstance(template, str) or not template.strip():
                raise ValueError("template must be a non-empty Jinja chat template string")
            if not hasattr(tokenizer, "apply_chat_template"):
                raise ValueError(f"{km.name}'s tokenizer cannot render a chat template (no apply_chat_template)")
            tokenizer = _WithTemplate(tokenizer, template)
        config = km.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.km, self._tokenizer = km, tokenizer
        self.format = chat_format(tokenizer, str(getattr(text, "model_type", "")))

    def head(self, system: str | None = None) -> Text:
        """The system turn and the opening of the user turn, to append pinned; None or "": no system message."""
        if system is None or system == "":
            return Text(self.format.bare)
        return Text(self.format.prefix + _clean(system, "system") + self.format.between)

    def part(self, text: str) -> Text:
        """One observation as a chunk of the user turn: stripped, ending with a newline."""
        return Text(_clean(text, "part") + "\n")

    def question(self, text: str) -> str:
        """The question closing the user turn plus the opening of the assistant's: the query to read the window with."""
        return _clean(text, "question") + self.format.suffix

    def reference_text(self, system: str | None, parts: Sequence[str], question: str) -> str:
        """The whole conversation as one string: what the chunks and the question concatenate to."""
        return "".join([self.head(system).text, *(self.part(p).text for p in parts), self.question(question)])

    def reference_ids(self, system: str | None, parts: Sequence[str], question: str) -> torch.Tensor:
        """Token ids `[T]` of the model's own chat template applied to [system, user: parts and question] with the
        generation prompt (without a tokenizer template: the built-in format tokenized whole)."""
        tokenizer = self._tokenizer
        content = "".join(self.part(p).text for p in parts) + _clean(question, "question")
        messages = ([{"role": "system", "content": _clean(system, "system")}] if system else []) + \
            [{"role": "user", "content": content}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = self.reference_text(system, parts, question)
        return self.km.tokenize(text)


class _WithTemplate:
    """A tokenizer seen through another chat template."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        self._tokenizer, self.chat_template = tokenizer, template

    def apply_chat_template(self, messages: list, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)


def _clean(text: object, what: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"the {what} must be a str, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise ValueError(f"the {what} is empty (or only whitespace); pass some text")
    return text
