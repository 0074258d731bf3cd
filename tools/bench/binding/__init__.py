"""Cross-chunk binding: a generated task that only a model reading B *after* A can answer, and
the trainer of the tiny Llama-architecture model that solves it.

The task (ordinal coreference):
    A:  "<0-8 filler> members : E5 , E12 , E3 , E7 . <64 - n filler>"   (MEMBERS distinct entities)
    B:  "<n filler> o4 it o9 it o1 it o7 it . <0-8 filler>"             (n uniform in 0-64)
        each "o_k it" is a claim (o_k is its, the owner's); the k-th "it" means A's k-th entity
    Q:  "so E12"   answer: "o9"
B never names an entity, so which entity owns which object is only defined by B read after A.
The filler before B's claims is drawn uniformly from 0-64 words, so the claims sit anywhere in B:
at its first token as often as past any fixed recompute budget. A closes with the balance of the
filler, so every claim sits at one distance from its entity, and the full-context model binds it
while reading B with one attention step at that distance. A B encoded alone has nothing to bind
to, so blind reuse loses accuracy unless the question redoes both hops itself. (`UNBALANCED`
drops the balance, so claims must be bound by their order: fine-tuned from the first stage below
(lr 1e-3, batch 64), the model was still near chance on it after 1250 steps, 0.31 on the probe,
67 min on one thread of this project's machine.)

Training uses a next-token loss on the answers, with two auxiliary signals that teach the
cross-chunk binding directly (answer-only training sat at chance in every run here):
- on a share of the sequences (`AUX_SHARE`), B names each entity in place of its "it" ("o9 E12")
  with loss on it: that loss is read at the object's position, where the binding must form;
- a share of the training questions (`REVERSE_SHARE`) is asked in reverse, "of o9" -> "E12":
  the question finds o9 in B by its own token and must read the owner bound there, which pulls
  the binding into the object's keys and values at a middle layer. Evaluation asks forward only.
Training runs in stages (`Layout`): first every claim 36 words into B (`FIXED_OFFSET`), then the
task's layout (`VARIABLE`) from those weights.

The model is a transformers `LlamaForCausalLM` (RoPE, GQA) over a word-level vocabulary of the
generator's own words (`BindingTokenizer`), so it wraps as `KameraModel(model, tokenizer)` and
every KV tool of the project applies to it. `python -m tools.binding train --out DIR` trains it
from a fixed seed; the shipped checkpoint lives in `tools/bench/binding/data/`
(`model.safetensors`, `config.json`, `binding.json` with the generator and training record).

Modules: `task` (vocabulary, tokenizer, generator, training batches), `model` (configuration,
loader, accuracy), `train` (trainer and the checkpoint's README).
"""

from tools.bench.binding.model import (CHECKPOINT_DIR, MODEL_CONFIG, accuracy_blind, accuracy_full, load, loss_fn,
                                         make_config, new_model)
from tools.bench.binding.task import (A_FILLER_MAX, AUX_SHARE, BOS, ENTITIES, EOS, FILLERS, FIXED_OFFSET,
                                        FUNCTION_WORDS, LAYOUTS, LEAD_MAX, MEMBERS, NUM_ENTITIES, NUM_OBJECTS, OBJECTS,
                                        PAD, REUSE_CONDITIONS, REVERSE_SHARE, SPECIALS, TRAIL_MAX, TRAIN_QUESTIONS,
                                        UNBALANCED, VARIABLE, VOCAB, BindingTokenizer, Encoded, Item, Layout, ReuseItem,
                                        antecedent, batch, eval_items, filler_words, item_ids, make_item, reuse_items,
                                        training_sequence)
from tools.bench.binding.train import TRAIN_DEFAULTS, record_eval, train, write_readme
