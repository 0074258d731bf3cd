"""`agentwin bench steps`: the median step time of the document and web agents, split into the
model's own forwards and everything else.

Each agent runs once with the model deciding every step through a window of `--budget-tokens`
(`agents.step_timing`): the document navigator on a generated 12-page PDF, the web agent on a
small site served from 127.0.0.1 in headless Chromium (text view). Figures: `step_s_median`,
`overhead_share` (time outside the model's forwards over the step time; target <= 0.15),
`tokens_after_action_close` (tokens generated after the action object closed; target 0), the
same per agent, the load average before and after, and torch's threads. `--json FILE` writes
them; `--md FILE` writes a short results page naming the command that made it.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), a local path or a Hugging Face id")
    parser.add_argument("--budget-tokens", type=int, default=1024, help="window size in tokens (default 1024)")
    parser.add_argument("--steps", type=int, default=8, help="decisions per agent (default 8)")
    parser.add_argument("--agents", default="doc,web", help="comma-separated: doc, web (default both)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="most tokens per decision (default 48)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--guard", action="store_true", help="run the windows with the patch guard on (its cost)")
    parser.add_argument("--allow-random-weights", action="store_true", help="allow a tiny-* model (a check of the command)")
    parser.add_argument("--json", metavar="FILE", help="write the figures and every step to FILE")
    parser.add_argument("--md", metavar="FILE", help="write a short results page to FILE")


def _command(args: argparse.Namespace) -> str:
    parts = ["agentwin bench steps"]
    if args.model != "smollm2":
        parts.append(f"--model {args.model}")
    for flag, value, default in (("--budget-tokens", args.budget_tokens, 1024), ("--steps", args.steps, 8),
                                 ("--agents", args.agents, "doc,web"), ("--threads", args.threads, 2)):
        if value != default:
            parts.append(f"{flag} {value}")
    parts += ["--guard"] if args.guard else []
    parts += [f"--json {args.json}"] if args.json else []
    parts += [f"--md {args.md}"] if args.md else []
    return " ".join(parts)


def page(figures: dict, command: str) -> str:
    """The results page of one run."""
    lines = [f"# Agent step time ({figures['model']})", "", f"Written by `{command}`.", "",
             f"Window of {figures['budget_tokens']} tokens (default patch settings"
             f"{', patch guard on' if figures.get('guard') else ''}), up to {figures['max_steps']} decisions per agent, "
             f"{figures['threads']} torch threads on {figures['cpus']} CPUs; load average "
             f"{figures['load_average_before'][0]:.2f} before, {figures['load_average_after'][0]:.2f} after. "
             "Step 0 (the first observation, and the browser's start) is left out.", "",
             "| agent | decisions | step s (median) | model forward s (median) | overhead s (median) | "
             "overhead share | tokens after the action closed |", "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = [(name, run) for name, run in figures["agents"].items()] + [("all", figures)]
    for name, run in rows:
        if not run.get("decisions"):
            lines.append(f"| {name} | 0 | | | | | |")
            continue
        lines.append(f"| {name} | {run['decisions']} | {run['step_s_median']:.2f} | {run['forward_s_median']:.2f} | "
                     f"{run['overhead_s_median']:.2f} | {run['overhead_share']:.3f} | "
                     f"{run['tokens_after_action_close']} |")
    lines += ["", "Overhead is the step's time outside the model's own forward calls (environment, patch fitting, "
              "segment tables, the decoding masks, prompt and records); targets: overhead share <= 0.15, "
              "0 tokens after the action closes.", ""]
    for name, run in figures["agents"].items():
        lines.append(f"- {name}: stopped by {run['stopped']}; actions "
                     + ", ".join(str(s["action"]) for s in run["steps"] if s["step"] >= 1))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import torch

    from agents.step_timing import AGENTS, run_steps
    from agents.console import load_model, model_kind

    agents = tuple(a.strip() for a in args.agents.split(",") if a.strip())
    if not agents or set(agents) - set(AGENTS):
        print(f"error: --agents takes a comma-separated list of {', '.join(AGENTS)}, got {args.agents!r}", file=sys.stderr)
        return 2
    if min(args.budget_tokens, args.steps, args.max_new_tokens, args.threads) < 1:
        print("error: --budget-tokens, --steps, --max-new-tokens and --threads must be >= 1", file=sys.stderr)
        return 2
    if model_kind(args.model)[1] and not args.allow_random_weights:
        print(f"error: {args.model} has random weights; pass --allow-random-weights to time it anyway", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        km = load_model(args.model, progress=False)
    except (ValueError, OSError) as err:
        print(f"error: cannot load model {args.model!r}: {err}", file=sys.stderr)
        return 2
    figures = run_steps(km, agents, args.budget_tokens, args.steps, args.max_new_tokens, guard=args.guard)
    figures["command"] = _command(args)
    print(f"step time, median: {figures['step_s_median']:.2f} s ({figures['forward_s_median']:.2f} s in the model's "
          f"forwards); overhead share {figures['overhead_share']:.3f}; tokens after the action closed: "
          f"{figures['tokens_after_action_close']} over {figures['decisions']} decisions")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2, default=repr)
        print(f"written to {args.json}")
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(page(figures, figures["command"]))
        print(f"written to {args.md}")
    return 0
