"""`agentwin bench eval`: Kamera against blind reuse, CacheBlend-, EPIC- and VLCache-style recompute on one harness, written to docs/RESULTS.md.

Three workloads, every method on the same contexts and queries (tools/eval_methods.py):
1. multi-hop accuracy on the binding model (tools/binding.py, the shipped checkpoint): [A, B] then
   a question whose answer needs B read after A; accuracy per method over held-out items, in
   seeded sets, and the share of the full-versus-blind gap each method recovers;
2. fidelity on the real SmolLM2-135M-Instruct over generated texts (tools/patch_texts.py): next-token
   KL, top-1 agreement and identical 16-token greedy continuations against a full re-prefill, for
   recall ([A, B], B back from canonical storage), reorder ([A, B, E1, E2] read as [A, E2, B, E1])
   and slide (A evicted: [B, E1, E2]) traces;
3. multimodal plumbing on tiny random Qwen2.5-VL and Qwen3-VL: text haystack chunks with image and
   frame needle chunks, KL only (random weights carry no accuracy).
Every method reports its extra bytes (patch storage, as a share of the reused chunks' fp16 KV) and
its extra compute (tokens recomputed summed over layers, as a share of a re-prefill of the reused
chunks, and measured seconds). `--quick` runs the whole harness on a few items in minutes.
The page itself is written by tools/eval_page.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tools.eval_page import (binding_section, multimodal_section, plot_panels, smollm2_section, targets_section,
                             write_page)

KAMERA_BUDGETS = (0.03, 0.06, 0.12, 0.25)
BINDING_BUDGETS = (0.03, 0.06, 0.12, 0.25, 0.5)
PATCH_METHODS = ("kamera-svd", "kamera-query", "kamera-query-int8", "kamera-alloc")
RECOMPUTE = (("cacheblend", 0.15), ("epic", 16), ("epic", 32), ("vlcache", 0.05))
TRACES = ("recall", "reorder", "slide")
VL_MODELS = ("tiny-qwen2.5-vl", "tiny-qwen3-vl")
GREEDY = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a few items per workload: checks the harness end to end in minutes")
    parser.add_argument("--results", metavar="DIR", default=None,
                        help="where RESULTS.md and results/eval_*.{json,png} go (default: docs/; "
                             "with --quick a temporary directory)")
    parser.add_argument("--binding-items", type=int, default=250, help="held-out items per seed (default 250)")
    parser.add_argument("--binding-seeds", type=int, default=4, help="held-out item sets (default 4)")
    parser.add_argument("--smollm2-seeds", type=int, default=5, help="generated SmolLM2 cases (default 5)")
    parser.add_argument("--smollm2-queries", type=int, default=4, help="questions per SmolLM2 case (default 4)")
    parser.add_argument("--vl-seeds", type=int, default=2, help="multimodal layouts per model (default 2)")
    parser.add_argument("--binding-checkpoint", metavar="DIR", default=None,
                        help="binding checkpoint directory (default: the shipped agentwin/models/data/binding)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("binding", "smollm2", "multimodal"),
                        help="workloads not to run; their figures from an earlier run in the same results "
                             "directory (results/eval_<name>.json) stay on the page, marked as such")


# ---- running the methods on one context ------------------------------------------------------

def method_plan(budgets: Sequence[float], orbit: bool) -> list[tuple[str, str, Any]]:
    """(method, setting, parameter) in report order."""
    plan: list[tuple[str, str, Any]] = [("full", "", None), ("blind", "", None)]
    for name, p in RECOMPUTE:
        plan.append((name, f"{p:.0%}" if name != "epic" else f"k={p}", p))
    for m in PATCH_METHODS + (("kamera-orbit",) if orbit else ()):
        for b in budgets:
            plan.append((m, f"{b:.1%}", b))
    return plan


def run_context(ctx, conds: Sequence, plan, greedy: int, orbit_members: Sequence[int] | None = None,
                orbit_head: Sequence | None = None) -> list[dict]:
    """Every method of `plan` on one context. conds[i]: chunk i's `Conditioning` (its deficit in
    the context its origin patch is fitted on: its antecedent when it was appended; conds[0] is
    unused); orbit_members: context indices of the reordered set, orbit_head: the chunks read
    before it."""
    from tools import eval_kamera as ek
    from tools import eval_methods as em

    model = ctx.model

    def cond(i: int):
        return conds[i]

    fits: dict[tuple[str, int], Any] = {}
    fit_s: dict[str, float] = {}

    def fits_for(method: str, i: int):
        if (method, i) not in fits:
            t0 = time.perf_counter()
            if method == "kamera-orbit":
                if not fits.get(("orbit-deltas", 0)):
                    members = [ctx.chunks[j] for j in orbit_members]
                    deltas = ek.orbit_deltas(model, orbit_head, members, [ctx.canonical[j] for j in orbit_members])
                    fits[("orbit-deltas", 0)] = dict(zip(orbit_members, deltas))
                source = fits[("orbit-deltas", 0)][i]
            else:
                source = cond(i)
            fits[(method, i)] = ek.patch_fits(source, method, ctx.layout.num_kv_heads)
            fit_s[method] = fit_s.get(method, 0.0) + time.perf_counter() - t0
        return fits[(method, i)]

    done: list[tuple[Any, float | None]] = []
    for method, setting, p in plan:
        if method == "full":
            res = em.method_full(ctx)
        elif method == "blind":
            res = em.method_blind(ctx)
        elif method == "cacheblend":
            res = em.method_cacheblend(ctx, p)
        elif method == "epic":
            res = em.method_epic(ctx, p)
        elif method == "vlcache":
            res = em.method_vlcache(ctx, p)
        else:
            if method == "kamera-orbit" and orbit_members is None:
                continue
            reused = range(1, len(ctx.chunks))
            if method == "kamera-orbit":
                reused = [i for i in reused if i in orbit_members]
            t0 = time.perf_counter()
            fitted, storage = (method[:-5], "int8") if method.endswith("-int8") else (method, "fp16")
            chosen = {i: ek.patch_at(fits_for(fitted, i), int(p * _kv_bytes(ctx.canonical[i])), storage)
                      for i in reused}
            patches = [chosen.get(i) for i in range(1, len(ctx.chunks))]
            # One-time cost of this patch: the conditioned passes (origin patches) and this method's
            # decomposition (shared by its budgets), plus this budget's truncation.
            build = time.perf_counter() - t0 + fit_s.get(fitted, 0.0)
            if method != "kamera-orbit":
                build += sum(cond(i).seconds for i in reused)
            res = ek.method_patched(ctx, method, setting, patches, build)
        done.append((res, p if method.startswith("kamera") else None))
    # The queries are read for every method at once (one batched forward per decoding step).
    rows = em.score_many(ctx, [res for res, _ in done], greedy)
    for row, (_, budget) in zip(rows, done):
        row["budget"] = budget
    return rows


def _kv_bytes(kv) -> int:
    return sum((k.numel() + v.numel()) * 2 for k, v in kv)


# ---- workload 1: binding accuracy ------------------------------------------------------------

def binding_workload(items_per_seed: int, seeds: int, budgets: Sequence[float], log=print,
                     checkpoint: str | None = None) -> dict:
    from tools import binding as bd
    from tools import eval_kamera as ek
    from tools import eval_methods as em

    model, tok = bd.load(checkpoint)
    plan = method_plan(budgets, orbit=False)
    rows = []
    t0 = time.perf_counter()
    for seed in range(seeds):
        items = bd.eval_items(items_per_seed, seed=10_000 + seed)
        for n, item in enumerate(items):
            a, b, q, ans = bd.item_ids(tok, item)
            ctx = em.build_context(model, [em.text_chunk(a), em.text_chunk(b)], [q])
            conds = [None, *ek.conditionings(model, ctx.chunks, ctx.canonical)]
            # Diagnostic: recompute exactly B's object tokens, where the binding lives.
            lo = ctx.bounds[1][0]
            objects = torch.tensor([lo + j for j, t in enumerate(b.tolist()) if tok.vocab[t] in bd.OBJECTS])
            oracle = em.score(ctx, em.method_tokens(ctx, "oracle", "B's objects", objects))
            oracle["budget"] = None
            for row in [*run_context(ctx, conds, plan, 0), oracle]:
                row.pop("kls")
                row["correct"] = float(row.pop("argmax")[0] == ans)
                rows.append({"seed": seed, "item": n, **row})
        log(f"  binding seed {seed}: {items_per_seed} items done ({time.perf_counter() - t0:.0f} s)")
    desc = json.loads((Path(checkpoint or bd.CHECKPOINT_DIR) / "binding.json").read_text())
    return {"rows": rows, "summary": summarise_binding(rows), "items_per_seed": items_per_seed,
            "seeds": seeds, "model": desc["model"], "parameters": desc["parameters"], "generator": desc["generator"],
            "training": {k: v for k, v in desc["training"].items() if k != "history"}}


def _key(row: dict) -> tuple[str, str]:
    return row["method"], row["setting"]


def summarise_binding(rows: list[dict]) -> list[dict]:
    """Per (method, setting): accuracy per seed, mean, and the gap recovered per seed."""
    keys = list(dict.fromkeys(_key(r) for r in rows))
    seeds = sorted({r["seed"] for r in rows})

    def acc(key, seed):
        vals = [r["correct"] for r in rows if _key(r) == key and r["seed"] == seed]
        return sum(vals) / len(vals)

    full = {s: acc(("full", ""), s) for s in seeds}
    blind = {s: acc(("blind", ""), s) for s in seeds}
    out = []
    for key in keys:
        sel = [r for r in rows if _key(r) == key]
        per_seed = [acc(key, s) for s in seeds]
        gaps = [(a - blind[s]) / (full[s] - blind[s]) if full[s] > blind[s] else math.nan
                for a, s in zip(per_seed, seeds)]
        out.append({"method": key[0], "setting": key[1], "items": len(sel),
                    "acc": sum(r["correct"] for r in sel) / len(sel), "acc_per_seed": per_seed,
                    "gap": statistics.fmean(gaps), "gap_per_seed": gaps,
                    "kl": statistics.fmean(r["kl"] for r in sel),
                    "bytes_frac": statistics.fmean(r["bytes_frac"] for r in sel),
                    "compute_frac": statistics.fmean(r["compute_frac"] for r in sel),
                    "ms": 1e3 * statistics.fmean(r["seconds"] for r in sel),
                    "build_ms": 1e3 * statistics.fmean(r["build_seconds"] for r in sel),
                    "budget": sel[0]["budget"]})
    return out


# ---- workload 2: SmolLM2 fidelity ---------------------------------------------------------------

def smollm2_trace(model, tokenizer, case, trace: str, budgets, greedy: int, max_queries: int | None,
                  cache: dict | None = None) -> list[dict]:
    """One trace of one case. `cache` (shared by the traces of a case) keeps the conditioned pass
    over the appended chunks [A, B, E1, E2]: every origin patch is fitted on it."""
    from tools import eval_kamera as ek
    from tools import eval_methods as em

    cache = {} if cache is None else cache

    def enc(text: str, special: bool = False) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=special).input_ids)

    a = em.text_chunk(enc(case.a, True))
    b, e1, e2 = (em.text_chunk(enc(" " + t)) for t in (case.b, *case.extra_chunks))
    queries = [enc(q) for q in case.queries[:max_queries]]
    appended = [a, b, e1, e2]

    orbit_members = orbit_head = None
    if trace == "recall":
        final = [a, b]
    elif trace == "reorder":
        final = [a, e2, b, e1]
        orbit_members, orbit_head = [1, 2, 3], [a]
    elif trace == "slide":
        final = [b, e1, e2]
    else:
        raise ValueError(f"unknown trace {trace!r}")
    ctx = em.build_context(model, final, queries, greedy=greedy)
    if "conds" not in cache:
        canon = {id(c): k for c, k in zip(final, ctx.canonical)}
        canonical = [canon[id(c)] if id(c) in canon else em.encode_alone(model, c) for c in appended]
        cache["conds"] = [None, *ek.conditionings(model, appended, canonical)]
    by_chunk = {id(c): cache["conds"][i] for i, c in enumerate(appended)}
    conds = [by_chunk[id(c)] for c in final]
    rows = run_context(ctx, conds, method_plan(budgets, orbit=trace == "reorder"), greedy,
                       orbit_members=orbit_members, orbit_head=orbit_head)
    for r in rows:
        r["trace"] = trace
        r["queries"] = len(queries)
    return rows


def smollm2_workload(seeds: int, budgets, greedy: int, max_queries: int | None, traces=TRACES, log=print) -> dict:
    from agentwin.models.zoo import load_smollm2

    model, tokenizer = load_smollm2(torch.float32)
    # SDPA (grouped KV heads read directly), for the reference and every method alike.
    model.set_attn_implementation("sdpa")
    return _smollm2_cases(model, tokenizer, seeds, budgets, greedy, max_queries, traces, log)


def _smollm2_cases(model, tokenizer, seeds, budgets, greedy, max_queries, traces, log) -> dict:
    from tools.patch_texts import make_case

    rows = []
    t0 = time.perf_counter()
    for seed in range(seeds):
        case = make_case(seed)
        cache: dict = {}
        for trace in traces:
            for r in smollm2_trace(model, tokenizer, case, trace, budgets, greedy, max_queries, cache):
                rows.append({"seed": seed, **r})
        log(f"  smollm2 seed {seed} done ({time.perf_counter() - t0:.0f} s)")
    return {"rows": rows, "summary": summarise_kl(rows, ("trace",)), "seeds": seeds, "greedy_tokens": greedy}


def summarise_kl(rows: list[dict], group: Sequence[str]) -> list[dict]:
    """Per (group..., method, setting): mean KL, top-1, greedy agreement (query-weighted), costs,
    and the per-seed mean KL."""
    keys = list(dict.fromkeys(tuple(r[g] for g in group) + _key(r) for r in rows))
    out = []
    for key in keys:
        sel = [r for r in rows if tuple(r[g] for g in group) + _key(r) == key]
        kls = [k for r in sel for k in r["kls"]]
        row = {**dict(zip(group, key)), "method": key[-2], "setting": key[-1], "cases": len(kls),
               "kl": statistics.fmean(kls), "kl_per_seed": [statistics.fmean(r["kls"]) for r in sel],
               "top1": statistics.fmean(r["top1"] for r in sel),
               "bytes_frac": statistics.fmean(r["bytes_frac"] for r in sel),
               "compute_frac": statistics.fmean(r["compute_frac"] for r in sel),
               "ms": 1e3 * statistics.fmean(r["seconds"] for r in sel), "budget": sel[0]["budget"]}
        if "greedy_same" in sel[0]:
            weights = [len(r["kls"]) for r in sel]
            row["greedy_same"] = sum(r["greedy_same"] * w for r, w in zip(sel, weights)) / sum(weights)
            row["greedy_prefix"] = sum(r["greedy_prefix"] * w for r, w in zip(sel, weights)) / sum(weights)
        out.append(row)
    return out


# ---- workload 3: multimodal plumbing ----------------------------------------------------------

def multimodal_workload(seeds: int, budgets, log=print) -> dict:
    """Text haystack chunks around an image needle and a frame needle (MM-NIAH-like layout):
    [text, image, text, frame, text] then a text query; KL against the re-prefill."""
    from agentwin.models.zoo import build_tiny
    from tools import eval_kamera as ek
    from tools import eval_methods as em

    rows = []
    for name in VL_MODELS:
        model = build_tiny(name)
        for seed in range(seeds):
            base = 100 * seed
            chunks = [em.random_text_chunk(model, base + 1, 24), em.image_chunk(model, base + 2),
                      em.random_text_chunk(model, base + 3, 20), em.image_chunk(model, base + 4, kind="frame"),
                      em.random_text_chunk(model, base + 5, 16)]
            queries = [torch.randint(3, 240, (6,), generator=torch.Generator().manual_seed(base + 6 + k)) for k in range(2)]
            ctx = em.build_context(model, chunks, queries)
            conds = [None, *ek.conditionings(model, chunks, ctx.canonical)]
            for r in run_context(ctx, conds, method_plan(budgets, orbit=False), 0):
                rows.append({"model": name, "seed": seed, **r})
        log(f"  {name}: {seeds} layouts done")
    return {"rows": rows, "summary": summarise_kl(rows, ("model",)), "seeds": seeds}


# ---- the command ---------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    for name in ("binding_items", "binding_seeds", "smollm2_seeds", "smollm2_queries", "vl_seeds"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    t_start = time.perf_counter()
    if args.quick:
        b_items, b_seeds, s_seeds, vl_seeds = 20, 2, 1, 1
        b_budgets, k_budgets, max_q, greedy = (0.06, 0.25), (0.06, 0.12), 2, GREEDY
    else:
        b_items, b_seeds, s_seeds, vl_seeds = args.binding_items, args.binding_seeds, args.smollm2_seeds, args.vl_seeds
        b_budgets, k_budgets, max_q, greedy = BINDING_BUDGETS, KAMERA_BUDGETS, args.smollm2_queries, GREEDY
    root = Path(args.results) if args.results else (Path(tempfile.mkdtemp(prefix="agentwin-eval-")) if args.quick
                                                   else Path(__file__).resolve().parent.parent / "docs")
    out_dir = root / "results"
    log = lambda s: print(s, flush=True)
    binding = smol = mm = None
    sections: list[list[str]] = []
    earlier: list[str] = []

    def previous(name: str) -> dict | None:
        path = out_dir / f"eval_{name}.json"
        if path.is_file():
            earlier.append(name)
            return json.loads(path.read_text())
        return None

    def workload(name: str, runner: Callable[[], dict], keep_rows: bool = True) -> dict | None:
        """Run a workload and write its JSON, or (skipped) read an earlier run's."""
        if name in args.skip:
            return previous(name)
        log(f"{name} workload ...")
        t0 = time.perf_counter()
        res = runner()
        res["minutes"] = (time.perf_counter() - t0) / 60
        _dump(out_dir / f"eval_{name}.json", res if keep_rows else {k: v for k, v in res.items() if k != "rows"})
        return res

    binding = workload("binding", lambda: binding_workload(b_items, b_seeds, b_budgets, log, args.binding_checkpoint),
                       keep_rows=False)
    if binding is not None:
        s = [r for r in binding["summary"] if r["method"] != "full"]
        plot_panels([("accuracy vs extra bytes", s, "bytes_frac", "acc", False),
               ("accuracy vs extra compute", s, "compute_frac", "acc", False)],
              out_dir / "eval_binding.png", "Binding model: multi-hop accuracy (full context: "
              f"{next(r['acc'] for r in binding['summary'] if r['method'] == 'full'):.3f})")
        sections.append(binding_section(binding) + ["![binding accuracy](results/eval_binding.png)", ""])
    smol = workload("smollm2", lambda: smollm2_workload(s_seeds, k_budgets, greedy, max_q, log=log))
    if smol is not None:
        panels = []
        for trace in TRACES:
            rows = [r for r in smol["summary"] if r["trace"] == trace and r["method"] != "full"]
            panels.append((f"{trace}: KL vs extra bytes", rows, "bytes_frac", "kl", True))
        for trace in TRACES:
            rows = [r for r in smol["summary"] if r["trace"] == trace and r["method"] != "full"]
            panels.append((f"{trace}: KL vs extra compute", rows, "compute_frac", "kl", True))
        plot_panels(panels[:3], out_dir / "eval_smollm2_bytes.png", "SmolLM2-135M: KL vs extra bytes")
        plot_panels(panels[3:], out_dir / "eval_smollm2_compute.png", "SmolLM2-135M: KL vs extra compute")
        sections.append(smollm2_section(smol) + ["![KL vs bytes](results/eval_smollm2_bytes.png)", "",
                                                 "![KL vs compute](results/eval_smollm2_compute.png)", ""])
    mm = workload("multimodal", lambda: multimodal_workload(vl_seeds, k_budgets, log))
    if mm is not None:
        panels = []
        for name in VL_MODELS:
            rows = [r for r in mm["summary"] if r["model"] == name and r["method"] != "full"]
            panels.append((f"{name}: KL vs extra bytes", rows, "bytes_frac", "kl", True))
            panels.append((f"{name}: KL vs extra compute", rows, "compute_frac", "kl", True))
        plot_panels(panels, out_dir / "eval_multimodal.png", "Tiny random Qwen-VL: KL of every method")
        sections.append(multimodal_section(mm) + ["![multimodal KL](results/eval_multimodal.png)", ""])
    minutes = (time.perf_counter() - t_start) / 60
    command = "agentwin bench eval" + (" --quick" if args.quick else "")
    parts = [f"{name} {w['minutes']:.1f} min" for name, w in (("binding", binding), ("SmolLM2", smol), ("multimodal", mm))
             if w is not None and "minutes" in w]
    header = ["# Evaluation: Kamera against blind reuse and token-recompute methods", "",
              f"Generated by `{command}` in {minutes:.1f} min ({', '.join(parts)}, loading included) on "
              f"{os.cpu_count()} CPU core(s), torch "
              f"{torch.__version__} (the page, the JSON and the plots under `results/eval_*` are rewritten "
              "by every run). Methods and what each costs are defined in `tools/eval_methods.py`; extra "
              "bytes are patch storage (fp16 factors; int8 with float32 scales for kamera-query-int8) as a share of the reused chunks' fp16 KV; extra "
              "compute is tokens recomputed summed over layers, as a share of re-prefilling the reused chunks.",
              "", "Anchors as implemented here: CacheBlend-style 15% (layer 0 over every reused token, then "
              "gradual filtering: at each later layer the selected tokens whose values deviate most from "
              "the reused ones are kept, 30% of each chunk at layer 1 narrowing linearly to 15% at the "
              "last layer), EPIC-style LegoLink k = 16 and 32 (first "
              "k tokens of each reused chunk, every layer), VLCache-style r = 5% (first 5% of each reused "
              "image/frame chunk; of each reused chunk on text-only workloads).", ""]
    if earlier:
        header += [f"Figures of {', '.join(earlier)} come from an earlier run into the same directory "
                   f"(this run skipped {'it' if len(earlier) == 1 else 'them'}); "
                   f"{'its' if len(earlier) == 1 else 'their'} own JSON records the settings.", ""]
    if args.quick:
        header += ["**Quick mode**: a few items per workload, for checking the harness; the figures are "
                   "not the results.", ""]
    sections.insert(0, targets_section(binding, smol))
    page = root / "RESULTS.md"
    write_page(page, sections, header)
    log(f"wrote {page} and {out_dir}/eval_* in {minutes:.1f} min")
    return 0


def _dump(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=float))
