"""The workloads of `agentwin bench eval`: every method on the same contexts, in a validation and
a test split, with every patch fitted in another context than the one it is scored in.

1. binding accuracy (`tools.bench.binding`): B's patch is fitted after A and B is read after
   A′ ≠ A, under two conditions: A′ lists the same entities behind other filler (B means the same),
   or A′ lists other entities (the patch is stale);
2. SmolLM2 fidelity (`tools.bench.datasets` texts): recall ([A′, B], A′ = a preamble + A, the
   patch fitted on [A, B]), reorder ([A, B, E1, E2] read as [A, E2, B, E1]; orbit patches fitted on
   the other five orders only) and slide ([B, E1, E2]; patches fitted with A present);
3. multimodal plumbing on tiny random Qwen-VL models (patches fitted with another first chunk).
Each row is one (context, method, setting) with its metric and its costs: patch bytes, compute at
reuse and one-time compute (token-layers, as shares of a re-prefill of the reused chunks), and the
measured seconds of both.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Sequence

import torch

from tools.bench import baselines as bl, binding as bd, contexts as cx, fits as ek, metrics as mt, selection
from tools.bench.datasets import make_case
from agentwin.models.residual import projection_metrics
from agentwin.window_chunk import key_summary
from kamera_core.metrics import layer_cosine

PATCH_METHODS = ("kamera-svd", "kamera-query", "kamera-alloc", "kamera-output",
                 "kamera-svd-int8", "kamera-query-int8", "kamera-alloc-int8", "kamera-output-int8",
                 "kamera-output-half-int8", "kamera-output-abs-int8", "kamera-residual-int8",
                 "kamera-residual-mixed")
PAPER = {"cacheblend": 0.15, "epic": 16, "vlcache": 0.05}  # each anchor's published default
SWEEPS = {"cacheblend": (0.05, 0.10, 0.15, 0.25, 0.40), "epic": (2, 4, 8, 16, 32, 64),
          "vlcache": (0.02, 0.05, 0.10, 0.20, 0.40)}
TRACES = ("recall", "reorder", "slide")
VL_MODELS = ("tiny-qwen2.5-vl", "tiny-qwen3-vl")
PREAMBLE = ["These notes were copied out of the parish archive.", "A few pages were damp and hard to read.",
            "Spelling has been kept as it was written.", "The archive room is open on weekday mornings.",
            "A second copy of the notes is kept at the library.", "Nothing has been added to the entries."]


def setting_name(method: str, p: Any) -> str:
    if method == "epic":
        return f"k={p}"
    if method == "vlcache":
        return f"r={p:.0%}"
    if method == "cacheblend":
        return f"{p:.0%}"
    return f"{p:.1%}"


def method_plan(budgets: Sequence[float], sweeps: dict[str, Sequence] = SWEEPS, orbit: bool = False,
                sparse: bool = True) -> list[tuple[str, str, Any]]:
    """(method, setting, parameter) in report order: the ceiling and the floor, each anchor's
    sweep (its paper setting included), the patch methods and the byte-matched token-sparse
    baseline at every byte budget."""
    plan: list[tuple[str, str, Any]] = [("full", "", None), ("blind", "", None)]
    for name in ("cacheblend", "epic", "vlcache"):
        for p in sorted(set(sweeps.get(name, ())) | {PAPER[name]}):
            plan.append((name, setting_name(name, p), p))
    for m in PATCH_METHODS + (("kamera-orbit",) if orbit else ()) + (("token-sparse",) if sparse else ()):
        for b in budgets:
            plan.append((m, setting_name(m, b), b))
    return plan


def _kv_bytes(kv) -> int:
    return sum((k.numel() + v.numel()) * 2 for k, v in kv)


def run_context(ctx: cx.Context, conds: Sequence, plan, greedy: int, orbit: dict | None = None,
                greedy_for: set[tuple[str, str]] | None = None) -> list[dict]:
    """Every method of `plan` on one context. conds[i]: the `Conditioning` of context chunk i in
    the context its patch was fitted in (None: no patch for that chunk); orbit: {"members":
    context indices of the reordered set, "head": the chunks read before it, "leave_out": the
    scored order, left out of the fit}; greedy_for: the (method, setting) pairs that also decode
    `greedy` tokens (None: all). Returns one scored row per method."""
    model, layers = ctx.model, len(ctx.full_kv)
    fits: dict[tuple[str, int], Any] = {}
    fit_s: dict[str, float] = {}
    orbit_cost = [0.0, 0]

    def tokens(i: int) -> int:
        return ctx.bounds[i][1] - ctx.bounds[i][0]

    def fits_for(method: str, i: int):
        if (method, i) not in fits:
            t0 = time.perf_counter()
            if method == "kamera-orbit":
                if ("orbit-deltas", 0) not in fits:
                    members = orbit["members"]
                    deltas = ek.orbit_deltas(model, orbit["head"], [ctx.chunks[j] for j in members],
                                             [ctx.canonical[j] for j in members], orbit["leave_out"])
                    fits[("orbit-deltas", 0)] = dict(zip(members, deltas))
                    orders = len(ek.orbit_orders(len(members), orbit["leave_out"]))
                    orbit_cost[:] = [time.perf_counter() - t0, orders * sum(tokens(j) for j in members) * layers]
                source = fits[("orbit-deltas", 0)][i]
            else:
                source = conds[i]
            vms = projection_metrics(model, ctx.layout.num_kv_heads, ctx.layout.value_dim) \
                if method == ek.RESIDUAL_METHOD else None
            fits[(method, i)] = ek.patch_fits(source, method, ctx.layout.num_kv_heads,
                                              [v for _, v in ctx.canonical[i]], vms)
            fit_s[method] = fit_s.get(method, 0.0) + time.perf_counter() - t0
        return fits[(method, i)]

    done: list[tuple[Any, Any]] = []
    for method, setting, p in plan:
        if method == "full":
            res = bl.method_full(ctx)
        elif method == "blind":
            res = bl.method_blind(ctx)
        elif method in ("cacheblend", "epic", "vlcache"):
            res = getattr(bl, f"method_{method}")(ctx, p)
        elif method == "kamera-orbit" and orbit is None:
            continue
        else:
            if method == "kamera-orbit":
                reused = list(orbit["members"])
            else:
                reused = [i for i in range(1, len(ctx.chunks)) if conds[i] is not None]
            t0 = time.perf_counter()
            if method == "token-sparse":
                chosen = {i: ek.sparse_rows(conds[i].deltas, int(p * _kv_bytes(ctx.canonical[i]))) for i in reused}
                build = time.perf_counter() - t0
            else:
                fitted, storage = storage_of(method)
                chosen = {i: ek.patch_at(fits_for(fitted, i), int(p * _kv_bytes(ctx.canonical[i])), storage)
                          for i in reused}
                # This method's decomposition (shared by its budgets) plus this budget's truncation.
                build = time.perf_counter() - t0 + fit_s.get(fitted, 0.0)
            if method == "kamera-orbit":
                build, build_tl = build + orbit_cost[0], orbit_cost[1]
            else:  # the conditioned pass each patch is fitted from
                build += sum(conds[i].seconds for i in reused)
                build_tl = sum(tokens(i) for i in reused) * layers
            patches = [chosen.get(i) for i in range(1, len(ctx.chunks))]
            res = ek.method_patched(ctx, method, setting, patches, build, build_tl)
        done.append((res, p))
    # The queries are read for several methods at once (one batched forward per decoding step);
    # only the methods in `greedy_for` decode.
    decode = [greedy_for is None or (res.method, res.setting) in greedy_for for res, _ in done]
    scored = {}
    for flag in (True, False):
        idx = [i for i, d in enumerate(decode) if d == flag]
        for i, row in zip(idx, mt.score_many(ctx, [done[i][0] for i in idx], greedy if flag else 0)):
            scored[i] = row
    rows = [scored[i] for i in range(len(done))]
    for row, (_, p) in zip(rows, done):
        row["param"] = p
    return rows


def storage_of(method: str) -> tuple[str, str]:
    """(fit method, factor storage) of a patch method's name: "-int8" and "-mixed" suffixes, else fp16."""
    for suffix in ("int8", "mixed"):
        if method.endswith(f"-{suffix}"):
            return method.removesuffix(f"-{suffix}"), suffix
    return method, "fp16"


# ---- workload 1: binding accuracy ------------------------------------------------------------

def binding_workload(model: Any, tok: Any, val_items: int, test_items: int, test_sets: int, budgets,
                     sweeps=SWEEPS, conditions: Sequence[str] = bd.REUSE_CONDITIONS,
                     log: Callable[[str], None] = print) -> dict:
    """Accuracy of every method on reuse items of both splits and every condition."""
    plan = method_plan(budgets, sweeps)
    rows = []
    t0 = time.perf_counter()
    for condition in conditions:
        for split, count, sets in (("validation", val_items, 1), ("test", test_items, test_sets)):
            for s in range(sets):
                for n, r in enumerate(bd.reuse_items(count, split, condition, seed=s)):
                    rows += binding_item_rows(model, tok, r, plan, {"split": split, "condition": condition,
                                                                   "set": s, "item": n})
            log(f"  binding {condition} {split}: {count * sets} items ({time.perf_counter() - t0:.0f} s)")
    return {"rows": rows, "plan": [list(p[:2]) for p in plan]}


def binding_item_rows(model: Any, tok: Any, r: Any, plan, tags: dict) -> list[dict]:
    """Every method on one reuse item: the context is [A′, B], B's patch is fitted after r.a_fit."""
    a, b, q, ans = bd.item_ids(tok, r.item)
    ctx = cx.build_context(model, [cx.text_chunk(a), cx.text_chunk(b)], [q])
    fit_a = cx.text_chunk(torch.tensor(tok.encode(r.a_fit, True)))
    conds = [None, *ek.conditionings(model, [fit_a, ctx.chunks[1]], [None, ctx.canonical[1]])]
    # What the window's stale-patch guards read (`agentwin.patches.policies`): the cosine of the key
    # summaries of A′ and of the A the patch was fitted after (encoded alone), and of B's and A's.
    old = key_summary(cx.encode_alone(model, fit_a))[None]
    similarity = float(layer_cosine(key_summary(ctx.canonical[0]), old)[0])
    own_similarity = float(layer_cosine(key_summary(ctx.canonical[1]), old)[0])
    # Diagnostic: recompute exactly B's object tokens, where the binding lives.
    lo = ctx.bounds[1][0]
    objects = torch.tensor([lo + j for j, t in enumerate(b.tolist()) if tok.vocab[t] in bd.OBJECTS])
    oracle = mt.score(ctx, bl.method_tokens(ctx, "oracle", "B's objects", objects))
    oracle["param"] = None
    out = []
    for row in [*run_context(ctx, conds, plan, 0), oracle]:
        row.pop("kls")
        row["correct"] = float(row.pop("argmax")[0] == ans)
        out.append({**tags, "similarity": similarity, "own_similarity": own_similarity, **row})
    return out


# ---- workload 2: SmolLM2 fidelity ---------------------------------------------------------------

def preamble(seed: int) -> str:
    """Two or three neutral sentences put before A in the recall trace (A′ = preamble + A)."""
    rng = random.Random(f"preamble-{seed}")
    return " ".join(rng.sample(PREAMBLE, rng.randint(2, 3))) + " "


def smollm2_case_rows(model, tokenizer, case, budgets, greedy: int, max_queries: int | None, sweeps=SWEEPS,
                      traces: Sequence[str] = TRACES, max_tokens: int | None = None,
                      greedy_for: dict[str, set[tuple[str, str]]] | None = None) -> list[dict]:
    """Every trace of one case. Origin patches are fitted on the appended chunks [A, B, E1, E2]
    (one conditioned pass); each trace reads the chunks in another context. `max_tokens` cuts
    every chunk to its first tokens (a quick check only)."""

    def enc(text: str, special: bool = False) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=special).input_ids)[:max_tokens]

    a = cx.text_chunk(enc(case.a, True))
    b, e1, e2 = (cx.text_chunk(enc(" " + t)) for t in (case.b, *case.extra_chunks))
    queries = [enc(q) for q in case.queries[:max_queries]]
    appended = [a, b, e1, e2]
    canonical = [cx.encode_alone(model, c) for c in appended]
    conds_by = dict(zip([id(c) for c in appended], [None, *ek.conditionings(model, appended, canonical)]))
    out = []
    for trace in traces:
        orbit = None
        if trace == "recall":
            pre = torch.tensor(tokenizer(preamble(case.seed), add_special_tokens=True).input_ids)
            bos = getattr(tokenizer, "bos_token_id", None)
            body = a.ids[1:] if bos is not None and int(a.ids[0]) == bos else a.ids  # one leading <bos>, not two
            final = [cx.text_chunk(torch.cat([pre, body])), b]
        elif trace == "reorder":
            final = [a, e2, b, e1]
            orbit = {"members": [1, 2, 3], "head": [a], "leave_out": (0, 1, 2)}
        elif trace == "slide":
            final = [b, e1, e2]
        else:
            raise ValueError(f"unknown trace {trace!r}")
        ctx = cx.build_context(model, final, queries, greedy=greedy)
        conds = [None] + [conds_by.get(id(c)) for c in final[1:]]
        plan = method_plan(budgets, sweeps, orbit=orbit is not None)
        decode = None if greedy_for is None else greedy_for.get(trace, set())
        for r in run_context(ctx, conds, plan, greedy, orbit, decode):
            out.append({"trace": trace, "queries": len(queries), **r})
    return out


def smollm2_workload(model, tokenizer, val_seeds: Sequence[int], test_seeds: Sequence[int], budgets, greedy: int,
                     max_queries: int | None, sweeps=SWEEPS, log: Callable[[str], None] = print,
                     max_tokens: int | None = None) -> dict:
    """Validation cases are scored by KL only. Test cases are scored by KL for every setting, and
    by greedy decoding for the settings chosen on validation (per trace, family and cost cap), the
    anchors' paper settings, full and blind reuse: the rows the page reports greedy agreement for."""
    rows = []
    t0 = time.perf_counter()
    decode = None
    for split, seeds, steps in (("validation", val_seeds, 0), ("test", test_seeds, greedy)):
        if split == "test":
            decode = greedy_settings(rows)
        for seed in seeds:
            for r in smollm2_case_rows(model, tokenizer, make_case(seed), budgets, steps, max_queries, sweeps,
                                       max_tokens=max_tokens, greedy_for=decode):
                rows.append({"split": split, "seed": seed, **r})
            log(f"  smollm2 {split} case {seed} done ({time.perf_counter() - t0:.0f} s)")
    return {"rows": rows, "greedy_tokens": greedy, "validation_seeds": list(val_seeds), "test_seeds": list(test_seeds),
            "greedy_scored": {t: sorted(map(list, pairs)) for t, pairs in (decode or {}).items()}}


def greedy_settings(validation_rows: Sequence[dict]) -> dict[str, set[tuple[str, str]]]:
    """Per trace: the (method, setting) pairs test cases decode greedily: each family's setting
    chosen on these validation rows at every cost cap, the anchors' paper settings, full and blind."""
    fixed = {("full", ""), ("blind", "")} | {(n, setting_name(n, p)) for n, p in PAPER.items()}
    chosen = selection.select(selection.summarise(validation_rows, ("split", "trace")), ("trace",), "kl", False)
    out: dict[str, set[tuple[str, str]]] = {}
    for r in validation_rows:
        out.setdefault(r["trace"], set(fixed))
    for c in chosen:
        out[c["trace"]].add((c["method"], c["setting"]))
    return out


# ---- workload 3: multimodal plumbing ----------------------------------------------------------

def multimodal_workload(seeds: int, budgets, log: Callable[[str], None] = print) -> dict:
    """Text haystack chunks around an image needle and a frame needle (MM-NIAH-like layout):
    [text, image, text, frame, text] then a text query; KL against the re-prefill. Patches are
    fitted with another first text chunk (other tokens, other length) in front."""
    from agentwin.models.zoo import build_tiny

    plan = method_plan(budgets, {name: (p,) for name, p in PAPER.items()})
    rows = []
    for name in VL_MODELS:
        model = build_tiny(name)
        for seed in range(seeds):
            base = 100 * seed
            chunks = [cx.random_text_chunk(model, base + 1, 24), cx.image_chunk(model, base + 2),
                      cx.random_text_chunk(model, base + 3, 20), cx.image_chunk(model, base + 4, kind="frame"),
                      cx.random_text_chunk(model, base + 5, 16)]
            queries = [torch.randint(3, 240, (6,), generator=torch.Generator().manual_seed(base + 6 + k)) for k in range(2)]
            ctx = cx.build_context(model, chunks, queries)
            fit_chunks = [cx.random_text_chunk(model, base + 7, 18), *chunks[1:]]
            conds = [None, *ek.conditionings(model, fit_chunks, ctx.canonical)]
            for r in run_context(ctx, conds, plan, 0):
                rows.append({"split": "test", "model": name, "seed": seed, **r})
        log(f"  {name}: {seeds} layouts done")
    return {"rows": rows, "seeds": seeds}
