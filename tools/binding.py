"""Cross-chunk binding: a generated task that only a model reading B *after* A can answer, and
the trainer of the tiny Llama-architecture model that solves it.

The task (ordinal coreference):
    A:  "members : E5 , E12 , E3 , E7 ."                 (MEMBERS distinct entities, in order)
    B:  "<PREFIX_WORDS filler words> o4 it o9 it o1 it o7 it ."
        each "o_k it" is a claim (o_k is its, the owner's); the k-th "it" means A's k-th entity
    Q:  "so E12"   answer: "o9"
B never names an entity, so which entity owns which object is only defined by B read after A.
With full context the model binds each claim while it reads B: every claim sits at one fixed
distance from its entity in A (A's entries and B's claims are two words wide), so the object's
position can take in the entity with one attention step, and the question then looks the entity
up among B's objects. A B encoded alone has nothing there to bind to, so blind reuse has to lose
accuracy unless the question redoes both hops (find E12's slot in A, then the claim at the
matching slot of B) itself. The filler that opens B puts the claims past the first 32 tokens of
B: a cross-chunk reference in the body of a chunk, not at its start.

Training uses a next-token loss on the answers, with two auxiliary signals that teach the
cross-chunk binding directly (answer-only training sat at chance in every run here):
- on a share of the sequences (`AUX_SHARE`), B names each entity in place of its "it" ("o9 E12")
  with loss on it: that loss is read at the object's position, where the binding must form;
- a share of the training questions (`REVERSE_SHARE`) is asked in reverse, "of o9" -> "E12":
  the question finds o9 in B by its own token and must read the owner bound there, which pulls
  the binding into the object's keys and values at a middle layer. Evaluation asks forward only.
With both, the model left chance within 1000 steps; with either alone it was still at chance after
1000 (measured on this machine, same seed).

The model is a transformers `LlamaForCausalLM` (RoPE, GQA) over a word-level vocabulary of the
generator's own words (`BindingTokenizer`), so it wraps as `KameraModel(model, tokenizer)` and
every KV tool of the project applies to it. `python -m tools.binding train --out DIR` trains it
from a fixed seed; the shipped checkpoint lives in `agentwin/models/data/binding/`
(`model.safetensors`, `config.json`, `binding.json` with the generator and training record).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

CHECKPOINT_DIR = Path(__file__).resolve().parent.parent / "agentwin" / "models" / "data" / "binding"

NUM_ENTITIES = 16
NUM_OBJECTS = 16
MEMBERS = 4  # entities listed in A (and claims in B); fixed, so every claim sits at one offset from its entity
PREFIX_WORDS = 36  # filler words that open B before its claims (the claims sit past EPIC's 32 recomputed tokens)
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
    """One binding item: chunk texts, the questions and their one-word answers."""

    a: str
    b: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    members: tuple[str, ...]
    owned: tuple[str, ...]


def filler_words(rng: random.Random, count: int) -> list[str]:
    """`count` words of random filler sentences ("then rain came . a cart passed . ..."), cut at `count`."""
    words: list[str] = []
    while len(words) < count:
        words += list(rng.choice(FILLERS)) + ["."]
    return words[:count]


def make_item(rng: random.Random, aux: bool = False, num_questions: int = 1) -> Item:
    """A random item; `aux` names each entity in place of its "it" in B (training only), so the
    loss on it is read at the object's position: the place where the full-context model must bind
    the object to A's entity."""
    members = rng.sample(ENTITIES, MEMBERS)
    owned = rng.sample(OBJECTS, MEMBERS)
    a = "members : " + " , ".join(members) + " ."
    claims = [f"{obj} {entity if aux else 'it'}" for entity, obj in zip(members, owned)]
    b = " ".join(filler_words(rng, PREFIX_WORDS) + claims + ["."])
    # With replacement: asking every member once would let the last answers follow by elimination.
    asked = [rng.randrange(MEMBERS) for _ in range(num_questions)]
    questions = tuple(f"so {members[k]}" for k in asked)
    return Item(a, b, questions, tuple(owned[k] for k in asked), tuple(members), tuple(owned))


def eval_items(count: int, seed: int = 10_000) -> list[Item]:
    """Held-out evaluation items (one question each) from their own seed stream; training draws
    from `random.Random(seed)` with seed < 10000 per step, so the streams never coincide."""
    rng = random.Random(f"binding-eval-{seed}")
    return [make_item(rng) for _ in range(count)]


def training_sequence(rng: random.Random, tok: BindingTokenizer) -> tuple[list[int], list[int]]:
    """(ids, labels) of one training sequence: <bos> A B (question answer)*; labels −100 except
    on answers and, in auxiliary sequences, on the entity after each "it"."""
    aux = rng.random() < AUX_SHARE
    item = make_item(rng, aux=aux, num_questions=TRAIN_QUESTIONS)
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


def batch(rng: random.Random, tok: BindingTokenizer, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, attention_mask) `[size, L]`, right-padded. Labels are already aligned
    with the token they are (loss at position t predicts labels[t] from tokens < t via the usual
    shift in `loss_fn`)."""
    seqs = [training_sequence(rng, tok) for _ in range(size)]
    length = max(len(s[0]) for s in seqs)
    ids = torch.full((size, length), PAD, dtype=torch.long)
    labels = torch.full((size, length), -100, dtype=torch.long)
    mask = torch.zeros((size, length), dtype=torch.long)
    for i, (s, l) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, : len(l)] = torch.tensor(l)
        mask[i, : len(s)] = 1
    return ids, labels, mask


# ---- the model -----------------------------------------------------------------------------

MODEL_CONFIG = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rope_theta=10000.0,
                    tie_word_embeddings=True)


def make_config(**over: Any) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=len(VOCAB), bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                      **{**MODEL_CONFIG, **over})
    cfg._attn_implementation = "eager"
    return cfg


def new_model(seed: int, **over: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(make_config(**over))


def loss_fn(model: Any, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over supervised tokens, accuracy over them)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    sel = target != -100
    acc = (logits.argmax(-1)[sel] == target[sel]).float().mean()
    return loss, acc


def load(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32) -> tuple[Any, BindingTokenizer]:
    """(model in eval mode with eager attention, tokenizer) of a binding checkpoint directory
    (default: the shipped one)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(path) if path is not None else CHECKPOINT_DIR
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"no binding checkpoint at {folder} (expected model.safetensors); "
                                "train one with `python -m tools.binding train --out DIR`")
    cfg = LlamaConfig.from_json_file(str(folder / "config.json"))
    cfg._attn_implementation = "eager"
    desc = json.loads((folder / "binding.json").read_text())
    if desc["vocab"] != VOCAB:
        raise ValueError(f"{folder}: the checkpoint's vocabulary differs from this generator's")
    model = LlamaForCausalLM(cfg)
    state = load_file(str(weights))
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state)
    return model.to(dtype).eval(), BindingTokenizer()


# ---- accuracy --------------------------------------------------------------------------------

def item_ids(tok: BindingTokenizer, item: Item) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(A ids with <bos>, B ids, question ids, answer id) of a one-question item."""
    return (torch.tensor(tok.encode(item.a, True)), torch.tensor(tok.encode(item.b)),
            torch.tensor(tok.encode(item.questions[0])), tok.index[item.answers[0]])


def accuracy_full(model: Any, tok: BindingTokenizer, items: Sequence[Item], batch_size: int = 128) -> float:
    """Share of items whose argmax next token after [<bos> A B question] is the answer (batched,
    right-padded; each row read at its own last token)."""
    correct = 0
    for lo in range(0, len(items), batch_size):
        rows = []
        for item in items[lo: lo + batch_size]:
            a, b, q, ans = item_ids(tok, item)
            rows.append((torch.cat([a, b, q]), ans))
        length = max(len(r) for r, _ in rows)
        ids = torch.full((len(rows), length), PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (r, _) in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        last = mask.sum(1) - 1
        pred = logits[torch.arange(len(rows)), last].argmax(-1)
        correct += int(sum(int(p) == ans for p, (_, ans) in zip(pred, rows)))
    return correct / len(items)


def accuracy_blind(model: Any, tok: BindingTokenizer, items: Sequence[Item]) -> float:
    """Share answered right when B's KV is B encoded alone (start 0) moved after A by exact RoPE
    re-rotation, no patch: the blind-reuse floor."""
    from agentwin.models.kv import build_cache, concat_kv, extract_kv, relocate_kv
    from kamera_core import kv_layout, rope_specs

    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    correct = 0
    for item in items:
        a, b, q, ans = item_ids(tok, item)
        with torch.no_grad():
            a_kv = extract_kv(model(input_ids=a[None], use_cache=True).cache, layout)
            b_kv = extract_kv(model(input_ids=b[None], use_cache=True).cache, layout)
            placed = concat_kv(a_kv, relocate_kv(b_kv, specs, layout, len(a)))
            start = len(a) + len(b)
            out = model(input_ids=q[None], position_ids=torch.arange(start, start + len(q))[None],
                        cache=build_cache(placed, model.config, layout), use_cache=True)
        correct += int(int(out.logits[0, -1].argmax()) == ans)
    return correct / len(items)


# ---- training --------------------------------------------------------------------------------

TRAIN_DEFAULTS = dict(seed=0, steps=3000, batch_size=64, lr=2e-3, warmup=200, weight_decay=0.01,
                      max_minutes=60.0, eval_every=250)


def train(out: str | os.PathLike, seed: int = 0, steps: int = 3000, batch_size: int = 64, lr: float = 2e-3,
          warmup: int = 200, weight_decay: float = 0.01, max_minutes: float = 60.0, eval_every: int = 250,
          log=print, threads: int | None = 1, model_over: dict | None = None) -> dict:
    """Train from `seed` for `steps` steps (or until `max_minutes` of wall time) and write the
    checkpoint (model.safetensors, config.json, binding.json) to `out`; returns the record.

    Each step's batch is drawn from `random.Random(seed * 1_000_003 + step)`, so a run is
    reproducible on the same software and thread count. AdamW, linear warm-up then cosine decay
    to 10% over `steps`; gradient norm clipped at 1.
    """
    from safetensors.torch import save_file

    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(out, seed, steps, batch_size, lr, warmup, weight_decay, max_minutes, eval_every, log,
                      threads, model_over)
    finally:
        torch.set_num_threads(saved_threads)


def _train(out, seed, steps, batch_size, lr, warmup, weight_decay, max_minutes, eval_every, log, threads,
           model_over) -> dict:
    from safetensors.torch import save_file

    tok = BindingTokenizer()
    model = new_model(seed, **(model_over or {}))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, steps - warmup))
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    probe = eval_items(200, seed=20_000)
    history, t0, step = [], time.perf_counter(), 0
    run_loss, run_acc, run_n = 0.0, 0.0, 0
    for step in range(steps):
        if (time.perf_counter() - t0) / 60 > max_minutes:
            log(f"stopping at step {step}: {max_minutes} minutes of training reached")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids, labels, mask = batch(random.Random(seed * 1_000_003 + step), tok, batch_size)
        loss, acc = loss_fn(model, ids, labels, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run_loss, run_acc, run_n = run_loss + float(loss.detach()), run_acc + float(acc), run_n + 1
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            model.eval()
            probe_acc = accuracy_full(model, tok, probe)
            model.train()
            row = {"step": step + 1, "minutes": (time.perf_counter() - t0) / 60, "loss": run_loss / run_n,
                   "train_acc": run_acc / run_n, "probe_acc": probe_acc, "lr": lr_at(step)}
            history.append(row)
            log(f"step {row['step']:>5}  {row['minutes']:6.1f} min  loss {row['loss']:.4f}  "
                f"train acc {row['train_acc']:.3f}  probe acc (full context, 200 items) {probe_acc:.3f}")
            run_loss, run_acc, run_n = 0.0, 0.0, 0
            _save(model, out, tok, seed, batch_size, lr, warmup, weight_decay, steps, history,
                  time.perf_counter() - t0, threads, save_file)
    model.eval()
    minutes = (time.perf_counter() - t0) / 60
    record = _save(model, out, tok, seed, batch_size, lr, warmup, weight_decay, steps, history,
                   time.perf_counter() - t0, threads, save_file)
    log(f"trained {history[-1]['step'] if history else 0} steps in {minutes:.1f} min; checkpoint in {out}")
    return record


def _save(model, out, tok, seed, batch_size, lr, warmup, weight_decay, steps, history, seconds, threads, save_file) -> dict:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.pop("_attn_implementation_autoset", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    record = {
        "task": "ordinal coreference across two chunks (see tools/binding.py)",
        "generator": {"num_entities": NUM_ENTITIES, "num_objects": NUM_OBJECTS,
                      "members": MEMBERS, "prefix_words": PREFIX_WORDS,
                      "aux_share": AUX_SHARE, "reverse_share": REVERSE_SHARE, "train_questions_per_sequence": TRAIN_QUESTIONS,
                      "fillers": [" ".join(f) for f in FILLERS]},
        "training": {"seed": seed, "batch_size": batch_size, "lr": lr, "warmup": warmup,
                     "weight_decay": weight_decay, "planned_steps": steps,
                     "steps_done": history[-1]["step"] if history else 0, "seconds": seconds,
                     "torch_threads": threads, "torch": torch.__version__, "history": history},
        "model": {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")},
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": tok.vocab,
    }
    (folder / "binding.json").write_text(json.dumps(record, indent=1))
    write_readme(folder)
    return record


def write_readme(folder: str | os.PathLike) -> None:
    """README.md of a checkpoint directory, from its binding.json."""
    folder = Path(folder)
    d = json.loads((folder / "binding.json").read_text())
    g, t, m = d["generator"], d["training"], d["model"]
    last = t["history"][-1] if t["history"] else {}
    lines = [
        "# Binding model",
        "",
        "A tiny Llama-architecture model (RoPE, GQA) trained on the cross-chunk binding task of",
        "`tools/binding.py`, for measuring multi-hop accuracy under KV reuse (`agentwin bench eval`).",
        "",
        "## Task (ordinal coreference)",
        "",
        "    <bos> members : E5 , E12 , E3 , E7 .   <filler> o4 it o9 it o1 it o7 it .   so E12  -> o9",
        "",
        f"A lists {g['members']} distinct entities out of {g['num_entities']}. B opens with {g['prefix_words']} filler "
        f"words, then one claim per entity, in order: \"o_k it\" (o_k is its, the owner's), with distinct objects out of "
        f"{g['num_objects']}; the k-th \"it\" is A's k-th entity. The question names an entity; the answer is its "
        "object. B never names an entity, so only B read after A defines who owns what.",
        f"Training sequences carry {g['train_questions_per_sequence']} questions with loss on the answers, a share "
        f"{g['reverse_share']} of them asked in reverse (\"of o9\" -> \"E12\"); a share {g['aux_share']} of the "
        "sequences name each entity in place of its \"it\" (\"o9 E12\") with loss on it. Evaluation asks forward "
        "questions only.",
        "",
        "## Model and training",
        "",
        f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, MLP {m['intermediate_size']}, "
        f"{m['num_attention_heads']} query heads / {m['num_key_value_heads']} KV heads × {m['head_dim']}, vocabulary "
        f"{m['vocab_size']} words, {d['parameters']:,} parameters, tied embeddings.",
        f"AdamW (lr {t['lr']}, warm-up {t['warmup']}, cosine to 10%, weight decay {t['weight_decay']}), batch "
        f"{t['batch_size']}, seed {t['seed']}; {t['steps_done']} of {t['planned_steps']} planned steps in "
        f"{t['seconds'] / 60:.1f} min of wall time on {t['torch_threads']} CPU thread(s) (torch {t['torch']}).",
        "",
        f"Reproduce: `python -m tools.binding train --out DIR --seed {t['seed']} --steps {t['planned_steps']} "
        f"--batch-size {t['batch_size']} --lr {t['lr']} --warmup {t['warmup']} --max-minutes 600` (batches are "
        "drawn from seeded generators; bit-identical weights need the same torch build and thread count).",
    ]
    if last:
        lines += ["", f"Last training log: step {last['step']}, loss {last['loss']:.4f}, probe accuracy "
                  f"(full context, 200 items) {last['probe_acc']:.3f}."]
    if "eval" in d:
        e = d["eval"]
        lines += ["", "## Held-out accuracy", "",
                  f"{e['items']} held-out items (`eval_items`, seed {e['eval_seed']}): full context "
                  f"{e['full_context_acc']:.3f}, blind reuse (B encoded alone, relocated, no patch) "
                  f"{e['blind_reuse_acc']:.3f}. `{e['command']}`"]
        if e["full_context_acc"] < 0.95:
            lines += ["", f"Status: below the 95% full-context target. At {e['full_context_acc']:.3f} the model answers "
                      "with one of B's objects at about chance (1/members): the answer lookup did not form within "
                      "this training budget, so blind reuse cannot lose accuracy against it yet. Train longer "
                      "(`--steps`, `--max-minutes`; a GPU makes this minutes) and re-record with "
                      "`python -m tools.binding eval --record`."]
    (folder / "README.md").write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.binding", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train the binding model from a fixed seed")
    tr.add_argument("--out", default=str(CHECKPOINT_DIR))
    for key, value in TRAIN_DEFAULTS.items():
        tr.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    tr.add_argument("--threads", type=int, default=1)
    ev = sub.add_parser("eval", help="full-context and blind-reuse accuracy of a checkpoint")
    ev.add_argument("--path", default=str(CHECKPOINT_DIR))
    ev.add_argument("--items", type=int, default=1000)
    ev.add_argument("--record", action="store_true", help="write the figures into the checkpoint's binding.json")
    args = parser.parse_args(argv)
    if args.cmd == "train":
        train(args.out, args.seed, args.steps, args.batch_size, args.lr, args.warmup, args.weight_decay,
              args.max_minutes, args.eval_every, log=lambda s: print(s, flush=True), threads=args.threads)
        return 0
    model, tok = load(args.path)
    items = eval_items(args.items)
    full, blind = accuracy_full(model, tok, items), accuracy_blind(model, tok, items)
    print(f"full context: {full:.4f}  blind reuse: {blind:.4f} ({args.items} held-out items)")
    if args.record:
        path = Path(args.path) / "binding.json"
        desc = json.loads(path.read_text())
        desc["eval"] = {"items": args.items, "eval_seed": 10_000, "full_context_acc": full, "blind_reuse_acc": blind,
                        "command": f"python -m tools.binding eval --items {args.items}"}
        path.write_text(json.dumps(desc, indent=1))
        write_readme(args.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
