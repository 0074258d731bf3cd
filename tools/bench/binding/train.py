"""Training the binding model from a fixed seed (in stages), and the README written beside its checkpoint."""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

import torch

from tools.bench.binding.model import accuracy_full, load, loss_fn, new_model
from tools.bench.binding.task import (A_FILLER_MAX, AUX_SHARE, FILLERS, LAYOUTS, LEAD_MAX, MEMBERS, NUM_ENTITIES,
                                        NUM_OBJECTS, REVERSE_SHARE, TRAIL_MAX, TRAIN_QUESTIONS, BindingTokenizer, batch,
                                        eval_items)

TRAIN_DEFAULTS = dict(seed=0, steps=3000, batch_size=64, lr=2e-3, warmup=200, weight_decay=0.01,
                      max_minutes=60.0, eval_every=250)


def train(out: str | os.PathLike, seed: int = 0, steps: int = 3000, batch_size: int = 64, lr: float = 2e-3,
          warmup: int = 200, weight_decay: float = 0.01, max_minutes: float = 60.0, eval_every: int = 250,
          log=print, threads: int | None = 1, model_over: dict | None = None, layout: str = "variable",
          init: str | os.PathLike | None = None) -> dict:
    """Train for `steps` steps (or until `max_minutes` of wall time) on items of `layout`
    ("variable": the task; "fixed-offset": every claim at one offset, an easier first stage) and
    write the checkpoint (model.safetensors, config.json, binding.json) to `out`; returns the
    record. Starts from `seed`'s initialisation, or from the weights of checkpoint `init` (a
    further stage: its record's stages are kept before this one).

    Each step's batch is drawn from `random.Random(seed * 1_000_003 + step)`, so a stage is
    reproducible on the same software and thread count. AdamW, linear warm-up then cosine decay
    to 10% over `steps`; gradient norm clipped at 1.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(out, dict(seed=seed, batch_size=batch_size, lr=lr, warmup=warmup, weight_decay=weight_decay,
                                planned_steps=steps, torch_threads=threads, layout=layout),
                      max_minutes, eval_every, log, model_over, init)
    finally:
        torch.set_num_threads(saved_threads)


def _train(out, stage: dict, max_minutes, eval_every, log, model_over, init) -> dict:
    tok = BindingTokenizer()
    seed, steps, lr, warmup, layout = (stage[k] for k in ("seed", "planned_steps", "lr", "warmup", "layout"))
    earlier: list[dict] = []
    if init is not None:
        model, _ = load(init)
        parent = json.loads((Path(init) / "binding.json").read_text())
        earlier = parent_stages(parent)
        stage["init"] = str(init)
    else:
        model = new_model(seed, **(model_over or {}))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=stage["weight_decay"], betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, steps - warmup))
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    probe = eval_items(200, seed=20_000, layout=LAYOUTS[layout])
    history, t0 = [], time.perf_counter()
    stage.update(history=history, torch=torch.__version__, steps_done=0, seconds=0.0)
    run_loss, run_acc, run_n = 0.0, 0.0, 0
    for step in range(steps):
        if (time.perf_counter() - t0) / 60 > max_minutes:
            log(f"stopping at step {step}: {max_minutes} minutes of training reached")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids, labels, mask = batch(random.Random(seed * 1_000_003 + step), tok, stage["batch_size"], LAYOUTS[layout])
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
            stage.update(steps_done=step + 1, seconds=time.perf_counter() - t0)
            _save(model, out, tok, [*earlier, stage])
    model.eval()
    stage["seconds"] = time.perf_counter() - t0
    record = _save(model, out, tok, [*earlier, stage])
    log(f"trained {stage['steps_done']} steps in {stage['seconds'] / 60:.1f} min; checkpoint in {out}")
    return record


def parent_stages(record: dict) -> list[dict]:
    """The training stages of a checkpoint record (a record written before stages were kept is
    one stage on the layout its generator describes)."""
    if "stages" in record:
        return list(record["stages"])
    layout = "fixed-offset" if record["generator"].get("prefix_words") == 36 else "variable"
    return [{**record["training"], "layout": layout}]


def _save(model, out, tok, stages: list[dict]) -> dict:
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.pop("_attn_implementation_autoset", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    last = stages[-1]
    record = {
        "task": "ordinal coreference across two chunks (see tools/bench/binding)",
        "generator": {"num_entities": NUM_ENTITIES, "num_objects": NUM_OBJECTS, "members": MEMBERS,
                      "a_filler_max": A_FILLER_MAX, "lead_max": LEAD_MAX, "trail_max": TRAIL_MAX,
                      "layouts": {k: vars(v) for k, v in LAYOUTS.items()},
                      "aux_share": AUX_SHARE, "reverse_share": REVERSE_SHARE, "train_questions_per_sequence": TRAIN_QUESTIONS,
                      "fillers": [" ".join(f) for f in FILLERS]},
        "stages": stages,
        "training": {"steps_done": sum(s["steps_done"] for s in stages), "seconds": sum(s["seconds"] for s in stages),
                     "torch_threads": last["torch_threads"], "torch": last["torch"],
                     "stages": [{k: v for k, v in s.items() if k != "history"} for s in stages]},
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
    stages = parent_stages(d)
    lines = [
        "# Binding model",
        "",
        "A tiny Llama-architecture model (RoPE, GQA) trained on the cross-chunk binding task of",
        "`tools/bench/binding`, for measuring multi-hop accuracy under KV reuse (`agentwin bench eval`).",
        "",
        "## Task (ordinal coreference)",
        "",
        "    <bos> <f1> members : E5 , E12 , E3 , E7 . <f2>   <f3> o4 it o9 it o1 it o7 it . <f4>   so E12  -> o9",
        "",
        f"A opens with 0–{g['a_filler_max']} filler words (f1), lists {g['members']} distinct entities out of "
        f"{g['num_entities']}, and closes with {g['lead_max']} − n filler words (f2). B opens with n filler words (f3, "
        f"n uniform in 0–{g['lead_max']}), then one claim per entity, in order: \"o_k it\" (o_k is its, the owner's), "
        f"with distinct objects out of {g['num_objects']}, then 0–{g['trail_max']} filler words (f4); the k-th \"it\" "
        "is A's k-th entity. The claims sit anywhere in B, from its first token on, while every claim stays at one "
        "distance from its entity. The question names an entity; the answer is its object. B never names an "
        "entity, so only B read after A defines who owns what.",
        f"Training sequences carry {g['train_questions_per_sequence']} questions with loss on the answers, a share "
        f"{g['reverse_share']} of them asked in reverse (\"of o9\" -> \"E12\"); a share {g['aux_share']} of the "
        "sequences name each entity in place of its \"it\" (\"o9 E12\") with loss on it. Evaluation asks forward "
        "questions only.",
        "",
        "## Model and training",
        "",
        f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, MLP {m['intermediate_size']}, "
        f"{m['num_attention_heads']} query heads / {m['num_key_value_heads']} KV heads × {m['head_dim']}, vocabulary "
        f"{m['vocab_size']} words, {d['parameters']:,} parameters, tied embeddings. Trained in {len(stages)} "
        f"stage(s), {t['steps_done']} steps and {t['seconds'] / 60:.1f} min of wall time in all; AdamW (warm-up, then "
        "cosine to 10%), gradient norm clipped at 1:",
        "",
    ]
    for n, st in enumerate(stages, start=1):
        last = st["history"][-1] if st.get("history") else {}
        lines.append(f"{n}. layout `{st['layout']}`{' from the stage before' if n > 1 else ', from seed ' + str(st['seed'])}: "
                     f"lr {st['lr']}, warm-up {st['warmup']}, weight decay {st['weight_decay']}, batch {st['batch_size']}, "
                     f"batch seed {st['seed']}; {st['steps_done']} of {st['planned_steps']} planned steps in "
                     f"{st['seconds'] / 60:.1f} min on {st['torch_threads']} CPU thread(s) (torch {st['torch']})"
                     + (f"; last log: loss {last['loss']:.4f}, probe accuracy (full context, 200 items of the "
                        f"stage's layout) {last['probe_acc']:.3f}." if last else "."))
    lines += ["", "Reproduce (batches are drawn from seeded generators; bit-identical weights need the same torch build "
              "and thread count):", ""]
    for n, st in enumerate(stages, start=1):
        lines.append(f"    python -m tools.binding train --out STAGE{n} --layout {st['layout']} --seed {st['seed']} "
                     f"--steps {st['planned_steps']} --batch-size {st['batch_size']} --lr {st['lr']} --warmup {st['warmup']} "
                     f"--max-minutes 600" + (f" --init STAGE{n - 1}" if n > 1 else ""))
    if "eval" in d:
        e = d["eval"]
        lines += ["", "## Held-out accuracy", "",
                  f"{e['items']} held-out items (`eval_items`, seed {e['eval_seed']}, layout `{e.get('layout', 'fixed-offset')}`): full context "
                  f"{e['full_context_acc']:.3f}, blind reuse (B encoded alone, relocated, no patch) "
                  f"{e['blind_reuse_acc']:.3f}. `{e['command']}`"]
        if e["full_context_acc"] < 0.95:
            lines += ["", f"Status: below the 95% full-context target ({e['full_context_acc']:.3f}). Train longer "
                      "(`--steps`, `--max-minutes`) and re-record with `python -m tools.binding eval --record`."]
    (folder / "README.md").write_text("\n".join(lines) + "\n")


def record_eval(folder: str | os.PathLike, items: int, full: float, blind: float, eval_seed: int = 10_000,
                layout: str = "variable") -> None:
    """Write held-out accuracies (on items of `layout`) into a checkpoint's binding.json and
    rewrite its README."""
    path = Path(folder) / "binding.json"
    desc = json.loads(path.read_text())
    desc["eval"] = {"items": items, "eval_seed": eval_seed, "layout": layout, "full_context_acc": full,
                    "blind_reuse_acc": blind,
                    "command": f"python -m tools.binding eval --items {items} --layout {layout}"}
    path.write_text(json.dumps(desc, indent=1))
    write_readme(folder)
