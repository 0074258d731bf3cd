"""The binding model: a transformers `LlamaForCausalLM` over the task's vocabulary, its loader,
and its accuracy with full context and with blind reuse."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from tools.bench.binding.task import BOS, EOS, PAD, VOCAB, BindingTokenizer, Item, item_ids

CHECKPOINT_DIR = Path(__file__).resolve().parent / "data"

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

