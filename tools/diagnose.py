"""`agentwin diagnose`: the deficit of one chunk after another, for any supported text model.

    agentwin diagnose --a-file A.txt --b-file B.txt --question "Who ...? Answer:" [--model PATH]
    agentwin diagnose --case code          (a built-in hard case, `tools.bench.hard_cases`)

Reports per layer the relative deficit ‖Δ‖/‖KV(B|A)‖ of K and V and the share of its energy in
the top 8/16/32/64 directions, then next-token KL against a full re-prefill for blind reuse,
oracle token recompute, each patch method at 1.5–25% of B's KV bytes, and `window`: the patch a
`Window` at its default settings builds for B after A, its bytes as a share of B's KV and its KL
(and `window+guard`: the same with the patch guard on, `agentwin.patches.guard`; `window+max_kl`: with a
KL target instead of a rank, `Window(max_kl=...)`). `--model` takes `smollm2` (the embedded model,
default) or a local path / hub name that transformers can load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agents.console import torch_threads
from tools.options import positive_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or a path / name transformers can load")
    parser.add_argument("--a-file", help="text file of the antecedent chunk A")
    parser.add_argument("--b-file", help="text file of the chunk B that reads A")
    parser.add_argument("--question", action="append",
                        help="a question read after [A, B]; repeat for several")
    parser.add_argument("--case", help="a built-in hard case instead of the files and questions: "
                                       "code, roles, table or steps (tools.bench.hard_cases)")
    parser.add_argument("--storage", choices=("fp16", "bf16", "int8"), default="fp16")
    parser.add_argument("--json", metavar="FILE", help="write all figures to FILE")
    parser.add_argument("--threads", type=positive_arg, default=1, help="torch CPU threads (default 1, as the demo's)")


def load_text_model(name: str) -> tuple[Any, Any]:
    """(model, tokenizer) in float32 with eager attention; ValueError for what Kamera cannot relocate and for VLMs."""
    import torch

    from agentwin.models.zoo import REAL, load_real
    from kamera_core import rope_specs

    if name in REAL:
        model, tokenizer = load_real(name, torch.float32)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, attn_implementation="eager").eval()
    rope_specs(model.config)  # UnsupportedModelError (a ValueError) with the reason
    if getattr(model.config, "vision_config", None) is not None:
        raise ValueError(f"{name}: diagnose takes text chunks; vision-language models are measured through the Python API")
    return model, tokenizer


def _read(path: str, what: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {what} from {path!r}: {err}") from None
    if not text.strip():
        raise ValueError(f"{what} file {path!r} is empty")
    return text


def run(args: argparse.Namespace) -> int:
    with torch_threads(args.threads):
        return _diagnose(args)


def _diagnose(args: argparse.Namespace) -> int:
    from tools.bench.harness import BUDGETS, measure_texts, print_report, summarise

    try:
        if args.case is not None:
            from tools.bench.hard_cases import hard_case

            if args.a_file or args.b_file or args.question:
                raise ValueError("--case replaces --a-file, --b-file and --question; give one or the other")
            a_text, b_text, questions = hard_case(args.case).texts()
        else:
            if not (args.a_file and args.b_file and args.question):
                raise ValueError("give --a-file, --b-file and at least one --question (or --case NAME)")
            a_text, b_text = _read(args.a_file, "chunk A"), _read(args.b_file, "chunk B")
            questions = args.question
        print(f"loading {args.model} ...", flush=True)
        model, tokenizer = load_text_model(args.model)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    figures = measure_texts(model, tokenizer, a_text, b_text, questions, args.storage, window=True)
    print(f"{'layer':>5} {'|dK|/|K|':>9} {'|dV|/|V|':>9} " + " ".join(f"K top{t:<3}" for t in (8, 16, 32, 64)))
    for row in figures["layers"]:
        print(f"{row['layer']:>5} {row['rel_delta_k']:>9.4f} {row['rel_delta_v']:>9.4f} "
              + " ".join(f"{row[f'energy_top{t}_k']:>8.1%}" for t in (8, 16, 32, 64)))
    summary = summarise([{"seed": 0, **figures}], [])
    summary["seeds"] = ["given chunks"]
    print_report(summary)
    for name in ("window", "window+guard", "window+max_kl"):
        w = figures[name]
        target = f", max_kl {w['max_kl']:g}: largest block rank kept {w['kl_ranks']}" if w.get("max_kl") else ""
        print(f"{name:<14} bytes {w['bytes_frac']:.2%} of B's KV, KL {w['kl']:.4f} (blind {figures['blind_kl']:.4f}; "
              f"rank {w['rank']}{target}, {w['storage']}, guard {'on' if w['guard'] else 'off'}"
              + (f": kept {w['guard_checked'] - w['guard_dropped']}/{w['guard_checked']} layer k/v patches"
                 f"{', fell back to blind' if w['guard_fallbacks'] else ''}" if w["guard"] else "") + ")")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**summary, "case": figures, "budgets": BUDGETS}, fh, indent=1)
        print(f"figures written to {args.json}")
    return 0
