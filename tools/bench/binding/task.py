"""The binding task: vocabulary, word-level tokenizer, item generator and training batches
(the task itself is described in `tools.bench.binding`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

NUM_ENTITIES = 16
NUM_OBJECTS = 16
MEMBERS = 4  # entities listed in A (and claims in B)
A_FILLER_MAX = 8  # A opens with 0..8 filler words before its list
LEAD_MAX = 64  # B opens with 0..64 filler words before its claims (uniform): the claims sit anywhere
TRAIL_MAX = 8  # and closes with 0..8 filler words after them
AUX_SHARE = 0.25  # share of training sequences where B names the entity in place of each "it"
TRAIN_QUESTIONS = 4  # questions per training sequence, drawn with replacement (evaluation items ask one)
REVERSE_SHARE = 0.5  # share of training questions asked in reverse ("of o9" -> "E12"; training only)

SPECIALS = ["<pad>", "<bos>", "<eos>"]
FUNCTION_WORDS = ["members", ":", ",", ".", "it", "so", "of"]
FILLERS = [
    ("then", "rain", "came"), ("the", "bell", "rang"), ("later", "the", "day", "was", "quiet"),
    ("a", "cart", "passed"), ("the", "wind", "turned"), ("someone", "sang", "outside"),
]
ENTITIES = [f"E{i}" for i in range(NUM_ENTITIES)]
OBJECTS = [f"o{i}" for i in range(NUM_OBJECTS)]


def _vocabulary() -> list[str]:
    words = list(SPECIALS) + list(FUNCTION_WORDS)
    for sentence in FILLERS:
        words += [w for w in sentence if w not in words]
    return words + ENTITIES + OBJECTS


VOCAB = _vocabulary()
assert len(VOCAB) == len(set(VOCAB)), "vocabulary words must be distinct"
PAD, BOS, EOS = 0, 1, 2


@dataclass
class Encoded:
    """What a transformers tokenizer call returns, as far as the project uses it."""

    input_ids: list[int]


class BindingTokenizer:
    """Word-level tokenizer over the generator's vocabulary: whitespace-separated words, nothing else.

    `tok(text, add_special_tokens=False).input_ids` as a transformers tokenizer; with
    `add_special_tokens=True` a `<bos>` is prepended. Unknown words raise ValueError.
    """

    bos_token_id = BOS
    eos_token_id = EOS
    pad_token_id = PAD

    def __init__(self, vocab: Sequence[str] = VOCAB) -> None:
        self.vocab = list(vocab)
        self.index = {w: i for i, w in enumerate(self.vocab)}
        if len(self.index) != len(self.vocab):
            raise ValueError("vocabulary words must be distinct")

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = [BOS] if add_special_tokens else []
        for word in text.split():
            if word not in self.index:
                raise ValueError(f"word {word!r} is not in the binding vocabulary")
            ids.append(self.index[word])
        return ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoded:
        return Encoded(self.encode(text, add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.vocab[int(i)] for i in ids)


# ---- the generator -------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """One binding item: chunk texts, the questions and their one-word answers, and where B's
    claims start (`lead`: filler words before them)."""

    a: str
    b: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    members: tuple[str, ...]
    owned: tuple[str, ...]
    lead: int = 0


def filler_words(rng: random.Random, count: int) -> list[str]:
    """`count` words of random filler sentences ("then rain came . a cart passed . ..."), cut at `count`."""
    words: list[str] = []
    while len(words) < count:
        words += list(rng.choice(FILLERS)) + ["."]
    return words[:count]


@dataclass(frozen=True)
class Layout:
    """Ranges (inclusive) of the filler word counts: before A's list, before B's claims, after
    them. With `balance`, A closes with `balance` − lead filler words after its list, so every
    claim sits at one distance from its entity however deep in B it is."""

    a_filler: tuple[int, int] = (0, A_FILLER_MAX)
    lead: tuple[int, int] = (0, LEAD_MAX)
    trail: tuple[int, int] = (0, TRAIL_MAX)
    balance: int | None = LEAD_MAX


VARIABLE = Layout()  # the task: claims anywhere in B, one claim-to-entity distance
UNBALANCED = Layout(balance=None)  # claims anywhere in B and the distance varies: bind by order
FIXED_OFFSET = Layout((0, 0), (36, 36), (0, 0), None)  # first training stage: every claim 36 words into B
LAYOUTS = {"variable": VARIABLE, "unbalanced": UNBALANCED, "fixed-offset": FIXED_OFFSET}


def _draw(rng: random.Random, span: tuple[int, int]) -> int:
    lo, hi = span
    return lo if lo == hi else rng.randint(lo, hi)  # a fixed count draws nothing


def antecedent(rng: random.Random, members: Sequence[str], span: tuple[int, int] = VARIABLE.a_filler,
               close: int = 0) -> str:
    """A: filler words (a count drawn from `span`), "members : E5 , E12 , E3 , E7 .", then `close`
    filler words."""
    return " ".join(filler_words(rng, _draw(rng, span)) + ["members", ":"] + " , ".join(members).split() + ["."]
                    + filler_words(rng, close))


def make_item(rng: random.Random, aux: bool = False, num_questions: int = 1, layout: Layout = VARIABLE) -> Item:
    """A random item; `aux` names each entity in place of its "it" in B (training only), so the
    loss on it is read at the object's position: the place where the full-context model must bind
    the object to A's entity."""
    members = rng.sample(ENTITIES, MEMBERS)
    owned = rng.sample(OBJECTS, MEMBERS)
    if layout.balance is None:
        a = antecedent(rng, members, layout.a_filler)
        lead = _draw(rng, layout.lead)
    else:
        lead = _draw(rng, layout.lead)
        a = antecedent(rng, members, layout.a_filler, layout.balance - lead)
    claims = [f"{obj} {entity if aux else 'it'}" for entity, obj in zip(members, owned)]
    b = " ".join(filler_words(rng, lead) + claims + ["."] + filler_words(rng, _draw(rng, layout.trail)))
    # With replacement: asking every member once would let the last answers follow by elimination.
    asked = [rng.randrange(MEMBERS) for _ in range(num_questions)]
    questions = tuple(f"so {members[k]}" for k in asked)
    return Item(a, b, questions, tuple(owned[k] for k in asked), tuple(members), tuple(owned), lead)


def eval_items(count: int, seed: int = 10_000, layout: Layout = VARIABLE) -> list[Item]:
    """Held-out evaluation items (one question each) from their own seed stream; training draws
    from `random.Random(int)` per step, so the streams never coincide."""
    rng = random.Random(f"binding-eval-{seed}")
    return [make_item(rng, layout=layout) for _ in range(count)]


REUSE_CONDITIONS = ("same-list", "other-list")


@dataclass(frozen=True)
class ReuseItem:
    """B reused after antecedent `a` (A′), its patch fitted after `a_fit` (A ≠ A′).

    same-list: A′ lists the same entities in the same order as A, with other filler (other words,
    and another count before the list), so B means the same after both; other-list: A′ lists
    other entities, so B's claims bind differently and a patch fitted after A is stale. The
    question and answer are A′'s."""

    a_fit: str
    item: Item
    condition: str

    @property
    def a(self) -> str:
        return self.item.a


def reuse_items(count: int, split: str, condition: str, seed: int = 0, layout: Layout = VARIABLE) -> list[ReuseItem]:
    """`count` reuse items of one split ("validation" or "test") and condition, from a seed
    stream of their own (disjoint from training's and from the other split's)."""
    if split not in ("validation", "test"):
        raise ValueError(f"split must be 'validation' or 'test', got {split!r}")
    if condition not in REUSE_CONDITIONS:
        raise ValueError(f"condition must be one of {REUSE_CONDITIONS}, got {condition!r}")
    rng = random.Random(f"binding-{split}-{condition}-{seed}")
    close = 0 if layout.balance is None else layout.balance
    out = []
    while len(out) < count:
        item = make_item(rng, layout=layout)
        if condition == "same-list":
            a_fit = antecedent(rng, item.members, layout.a_filler, close - (item.lead if close else 0))
        else:
            others = rng.sample(ENTITIES, MEMBERS)
            if tuple(others) == item.members:
                continue
            a_fit = antecedent(rng, others, layout.a_filler, close - (item.lead if close else 0))
        if a_fit != item.a:
            out.append(ReuseItem(a_fit, item, condition))
    return out


def training_sequence(rng: random.Random, tok: BindingTokenizer, layout: Layout = VARIABLE
                      ) -> tuple[list[int], list[int]]:
    """(ids, labels) of one training sequence: <bos> A B (question answer)*; labels −100 except
    on answers and, in auxiliary sequences, on the entity after each "it"."""
    aux = rng.random() < AUX_SHARE
    item = make_item(rng, aux=aux, num_questions=TRAIN_QUESTIONS, layout=layout)
    ids = tok.encode(item.a, add_special_tokens=True)
    labels = [-100] * len(ids)
    b_ids = tok.encode(item.b)
    entity_ids = {tok.index[e] for e in ENTITIES}
    labels += [t if aux and t in entity_ids else -100 for t in b_ids]
    ids += b_ids
    for q, ans in zip(item.questions, item.answers):
        if rng.random() < REVERSE_SHARE:  # reverse question: which entity owns this object
            q, ans = f"of {ans}", q.split()[1]
        q_ids = tok.encode(q)
        ids += q_ids
        labels += [-100] * len(q_ids)
        ids.append(tok.index[ans])
        labels.append(tok.index[ans])
    return ids, labels


def batch(rng: random.Random, tok: BindingTokenizer, size: int, layout: Layout = VARIABLE
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, attention_mask) `[size, L]`, right-padded. Labels are already aligned
    with the token they are (loss at position t predicts labels[t] from tokens < t via the usual
    shift in `loss_fn`)."""
    seqs = [training_sequence(rng, tok, layout) for _ in range(size)]
    length = max(len(s[0]) for s in seqs)
    ids = torch.full((size, length), PAD, dtype=torch.long)
    labels = torch.full((size, length), -100, dtype=torch.long)
    mask = torch.zeros((size, length), dtype=torch.long)
    for i, (s, l) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, : len(l)] = torch.tensor(l)
        mask[i, : len(s)] = 1
    return ids, labels, mask


def item_ids(tok: BindingTokenizer, item: Item) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(A ids with <bos>, B ids, question ids, answer id) of a one-question item."""
    return (torch.tensor(tok.encode(item.a, True)), torch.tensor(tok.encode(item.b)),
            torch.tensor(tok.encode(item.questions[0])), tok.index[item.answers[0]])

