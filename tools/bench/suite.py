"""The evaluation suite behind `agentwin bench eval`: runs the workloads (`tools.bench.workloads`),
summarises them, chooses each method's settings on the validation split (`tools.bench.selection`)
and writes the page, the JSON and the plots (`tools.bench.page`).

The page records the command, the wall time, the torch threads and the load average at start and
end; it is rewritten by every run and never edited by hand.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tools.bench import binding as bd, page, selection, workloads as wl

BINDING_BUDGETS = (0.03, 0.06, 0.12, 0.25, 0.5)
KAMERA_BUDGETS = (0.03, 0.06, 0.12, 0.25)
GREEDY = 16
QUICK_SWEEPS = {"cacheblend": (0.15,), "epic": (16, 64), "vlcache": (0.05,)}
# SmolLM2's test cases decode 16 greedy tokens per query for the chosen settings: a shorter sweep keeps the run short.
SMOLLM2_SWEEPS = {"cacheblend": (0.05, 0.15, 0.40), "epic": (16, 64, 128), "vlcache": (0.05, 0.20, 0.40)}


@dataclass
class Options:
    """What `agentwin bench eval` runs (its command-line options)."""

    quick: bool = False
    binding_val_items: int = 200
    binding_test_items: int = 150
    binding_test_sets: int = 3
    smollm2_val_cases: int = 2
    smollm2_test_cases: int = 4
    smollm2_queries: int = 4
    vl_seeds: int = 2
    binding_checkpoint: str | None = None
    skip: list = field(default_factory=list)
    threads: int | None = None  # torch threads (None: torch's default)

    @classmethod
    def from_args(cls, args: Any) -> "Options":
        return cls(**{k: getattr(args, k) for k in cls.__dataclass_fields__ if hasattr(args, k)})


SMOLLM2_VAL_SEED = 100  # validation cases are seeds 100, 101, ...; test cases 0, 1, ...


def plan_sizes(opts: Options) -> dict:
    """The sizes a run uses: the options, or the quick ones."""
    if opts.quick:
        return dict(b_val=12, b_test=12, b_sets=2, s_val=[SMOLLM2_VAL_SEED], s_test=[0], queries=2, vl=1,
                    b_budgets=(0.06, 0.25), k_budgets=(0.06, 0.12), sweeps=QUICK_SWEEPS, s_sweeps=QUICK_SWEEPS, greedy=4,
                    s_tokens=48)
    return dict(b_val=opts.binding_val_items, b_test=opts.binding_test_items, b_sets=opts.binding_test_sets,
                s_val=list(range(SMOLLM2_VAL_SEED, SMOLLM2_VAL_SEED + opts.smollm2_val_cases)),
                s_test=list(range(opts.smollm2_test_cases)), queries=opts.smollm2_queries, vl=opts.vl_seeds,
                b_budgets=BINDING_BUDGETS, k_budgets=KAMERA_BUDGETS, sweeps=wl.SWEEPS, s_sweeps=SMOLLM2_SWEEPS,
                greedy=GREEDY, s_tokens=None)


def binding_results(opts: Options, z: dict, log: Callable[[str], None]) -> dict:
    model, tok = bd.load(opts.binding_checkpoint)
    res = wl.binding_workload(model, tok, z["b_val"], z["b_test"], z["b_sets"], z["b_budgets"], z["sweeps"], log=log)
    summary = selection.summarise(res.pop("rows"), ("split", "condition"))
    desc = json.loads((Path(opts.binding_checkpoint or bd.CHECKPOINT_DIR) / "binding.json").read_text())
    return {**res, "summary": summary, "selected": selection.select(summary, ("condition",), "acc", True),
            "sweeps": _swept(z["sweeps"]), "budgets": list(z["b_budgets"]), "val_items": z["b_val"], "test_items": z["b_test"], "test_sets": z["b_sets"], "model": desc["model"],
            "parameters": desc["parameters"], "generator": desc["generator"],
            "training": {k: v for k, v in desc["training"].items() if k != "history"}}


def smollm2_results(opts: Options, z: dict, log: Callable[[str], None]) -> dict:
    from agentwin.models.zoo import load_smollm2

    model, tokenizer = load_smollm2(torch.float32)
    # SDPA (grouped KV heads read directly), for the reference and every method alike.
    model.set_attn_implementation("sdpa")
    res = wl.smollm2_workload(model, tokenizer, z["s_val"], z["s_test"], z["k_budgets"], z["greedy"], z["queries"],
                              z["s_sweeps"], log=log, max_tokens=z["s_tokens"])
    summary = selection.summarise(res["rows"], ("split", "trace"))
    return {**res, "summary": summary, "selected": selection.select(summary, ("trace",), "kl", False),
            "queries": z["queries"], "sweeps": _swept(z["s_sweeps"]), "budgets": list(z["k_budgets"])}


def _swept(sweeps: dict) -> dict:
    """Every setting each anchor is run at: its sweep and its paper setting."""
    return {name: sorted(set(sweeps.get(name, ())) | {p}) for name, p in wl.PAPER.items()}


def multimodal_results(opts: Options, z: dict, log: Callable[[str], None]) -> dict:
    res = wl.multimodal_workload(z["vl"], z["k_budgets"], log=log)
    return {**res, "summary": selection.summarise(res["rows"], ("split", "model"))}


def _plots(name: str, res: dict, out_dir: Path) -> list[str]:
    """The workload's plots (test rows, every setting) and the page lines that show them."""
    test = [s for s in res["summary"] if s["split"] == "test" and s["method"] not in ("full", "oracle")]
    far = f"compute_at_{selection.AMORTISE[-1]}"
    if name == "binding":
        panels = []
        for cond in dict.fromkeys(s["condition"] for s in test):
            rows = [s for s in test if s["condition"] == cond]
            panels += [(f"{cond}: accuracy vs bytes", rows, "bytes_frac", "acc", False),
                       (f"{cond}: accuracy vs compute", rows, far, "acc", False)]
        page.plot_panels(panels, out_dir / "eval_binding.png", "Binding model, test split")
        return ["![binding accuracy](results/eval_binding.png)", ""]
    if name == "smollm2":
        traces = list(dict.fromkeys(s["trace"] for s in test))
        for key, tag in (("bytes_frac", "bytes"), (far, "compute")):
            panels = [(f"{t}: KL vs {tag}", [s for s in test if s["trace"] == t], key, "kl", True) for t in traces]
            page.plot_panels(panels, out_dir / f"eval_smollm2_{tag}.png", f"SmolLM2-135M, test split: KL vs {tag}")
        return ["![KL vs bytes](results/eval_smollm2_bytes.png)", "",
                "![KL vs compute](results/eval_smollm2_compute.png)", ""]
    panels = []
    for model in dict.fromkeys(s["model"] for s in test):
        rows = [s for s in test if s["model"] == model]
        panels += [(f"{model}: KL vs bytes", rows, "bytes_frac", "kl", True),
                   (f"{model}: KL vs compute", rows, far, "kl", True)]
    page.plot_panels(panels, out_dir / "eval_multimodal.png", "Tiny random Qwen-VL: KL of every method")
    return ["![multimodal KL](results/eval_multimodal.png)", ""]


def run_suite(opts: Options, root: Path, log: Callable[[str], None] = print) -> Path:
    """Run the workloads and write `root`/RESULTS.md and `root`/results/eval_*; returns the page."""
    saved = torch.get_num_threads()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    try:
        return _run_suite(opts, root, log)
    finally:
        torch.set_num_threads(saved)


def _run_suite(opts: Options, root: Path, log: Callable[[str], None]) -> Path:
    t_start, load_start = time.perf_counter(), os.getloadavg()
    z = plan_sizes(opts)
    out_dir = root / "results"
    done: dict[str, dict] = {}
    earlier: list[str] = []
    runners = {"binding": binding_results, "smollm2": smollm2_results, "multimodal": multimodal_results}
    for name, runner in runners.items():
        path = out_dir / f"eval_{name}.json"
        if name in opts.skip:
            if path.is_file():
                earlier.append(name)
                done[name] = json.loads(path.read_text())
            continue
        log(f"{name} workload ...")
        t0 = time.perf_counter()
        res = runner(opts, z, log)
        res["minutes"] = (time.perf_counter() - t0) / 60
        _dump(path, {k: v for k, v in res.items() if k != "rows"} if name == "binding" else res)
        done[name] = res
    sections: list[list[str]] = [page.targets_section(done.get("binding"), done.get("smollm2")), page.protocol_lines()]
    if "binding" in done:
        sections.append(page.binding_section(done["binding"], wl.PAPER) + _plots("binding", done["binding"], out_dir))
    if "smollm2" in done:
        sections.append(page.smollm2_section(done["smollm2"], wl.PAPER) + _plots("smollm2", done["smollm2"], out_dir))
    if "multimodal" in done:
        sections.append(page.multimodal_section(done["multimodal"]) + _plots("multimodal", done["multimodal"], out_dir))
    minutes, load_end = (time.perf_counter() - t_start) / 60, os.getloadavg()
    command = ("agentwin bench eval" + (" --quick" if opts.quick else "")
               + (f" --skip {' '.join(opts.skip)}" if opts.skip else "") + (f" --threads {opts.threads}" if opts.threads else ""))
    parts = [f"{name} {w['minutes']:.1f} min" for name, w in done.items() if "minutes" in w and name not in earlier]
    header = ["# Evaluation: Kamera against blind reuse, token-recompute methods and a token-sparse store", "",
              f"Generated by `{command}` in {minutes:.1f} min ({', '.join(parts)}, loading included) on "
              f"{os.cpu_count()} CPU core(s) with {torch.get_num_threads()} torch thread(s), load average "
              f"{'/'.join(f'{x:.1f}' for x in load_start)} at the start and {'/'.join(f'{x:.1f}' for x in load_end)} "
              f"at the end (1/5/15 min), torch {torch.__version__}. The page, the JSON and the plots under "
              "`results/eval_*` are rewritten by every run. Methods: `tools/bench/baselines.py` (recompute anchors), "
              "`tools/bench/fits.py` (patches, token-sparse); protocol: `tools/bench/workloads.py` and "
              "`tools/bench/selection.py`.", ""]
    if earlier:
        header += [f"Figures of {', '.join(earlier)} come from an earlier run into the same directory (this run "
                   "skipped them); their own JSON records the settings.", ""]
    if opts.quick:
        header += [f"**Quick mode**: a few items per workload and SmolLM2 chunks cut to {z['s_tokens']} "
                   "tokens, for checking the harness; the figures are not the results.", ""]
    path = root / "RESULTS.md"
    page.write_page(path, sections, header)
    log(f"wrote {path} and {out_dir}/eval_* in {minutes:.1f} min")
    return path


def _dump(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=float))
