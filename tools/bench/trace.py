"""Agent traces and their replay: one recorded sequence of window operations, run identically
through every context strategy (`tools.bench.strategies`) and scored against the reference.

A `Trace` holds its chunks (id -> text, as the agent's observations became chunks) and its
operations, in order:

    {"op": "append", "chunk": C}
    {"op": "evict", "chunk": C}
    {"op": "recall", "chunk": C, "at": I}        # back into the window at index I
    {"op": "decide", "step": S, "query": Q, "prime": P, "allowed": [...]}

An eviction the window's budget made is written as its own "evict" before the append or recall
that needed the room, so replaying the operations gives every strategy the same window before
every decision. A decision's query is the prompt the agent loop showed its decider followed by
the reply's opening (`prime`), as `agents.model.WindowDecider` reads it; the reply is `prime`
plus the greedy continuation, parsed as the agent would parse it (`agents.actions.parse_action`,
with the actions allowed at that step).

`replay` runs a strategy over a trace and returns one `Reading` per decision with the counts and
the wall time; `score` compares readings with the reference's: next-token KL
(`kamera_core.metrics.kl_divergence`), top-1 agreement, greedy agreement (the first `greedy`
tokens identical) and `same_action` (both replies parse to the same action; a reply that cannot
be parsed counts as the action "malformed", which the agent would answer with a retry).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tools.bench.strategies import Reading, Strategy
from kamera_core.metrics import kl_divergence, top1_agrees

OPS = ("append", "evict", "recall", "decide")


@dataclass
class Trace:
    """A recorded agent run (see the module docstring). `meta` says how it was recorded."""

    name: str
    budget_tokens: int
    chunks: dict[int, str]
    ops: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first operation that does not follow from the ones before it."""
        order: list[int] = []
        seen: set[int] = set()
        for index, op in enumerate(self.ops):
            kind, cid = op.get("op"), op.get("chunk")
            where = f"trace {self.name!r}, op {index} ({op})"
            if kind not in OPS:
                raise ValueError(f"{where}: unknown op; ops are {OPS}")
            if kind == "append":
                if cid not in self.chunks or cid in seen:
                    raise ValueError(f"{where}: appends an unknown chunk or one appended before")
                seen.add(cid)
                order.append(cid)
            elif kind == "evict":
                if cid not in order:
                    raise ValueError(f"{where}: evicts a chunk that is not in the window")
                order.remove(cid)
            elif kind == "recall":
                if cid not in seen or cid in order or not 0 <= int(op.get("at", -1)) <= len(order):
                    raise ValueError(f"{where}: recalls a chunk that is not evicted, or at a bad index")
                order.insert(int(op["at"]), cid)
            elif not isinstance(op.get("query"), str) or not op["query"]:
                raise ValueError(f"{where}: a decision needs its query text")

    @property
    def revisits(self) -> bool:
        """Whether content that had left the window came back (a recall)."""
        return any(op["op"] == "recall" for op in self.ops)

    @property
    def decisions(self) -> int:
        return sum(op["op"] == "decide" for op in self.ops)

    def summary(self) -> dict[str, Any]:
        counts = {kind: sum(op["op"] == kind for op in self.ops) for kind in OPS}
        return {"chunks": len(self.chunks), "ops": counts, "decisions": counts["decide"],
                "budget_tokens": self.budget_tokens, "revisits": self.revisits, **self.meta}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "budget_tokens": self.budget_tokens,
                "chunks": {str(k): v for k, v in self.chunks.items()}, "ops": self.ops, "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Trace":
        return cls(data["name"], int(data["budget_tokens"]), {int(k): v for k, v in data["chunks"].items()},
                   list(data["ops"]), dict(data.get("meta", {})))


def save_traces(traces: Sequence[Trace], path: str | Path) -> None:
    Path(path).write_text(json.dumps([t.to_json() for t in traces], indent=1))


def load_traces(path: str | Path) -> list[Trace]:
    return [Trace.from_json(d) for d in json.loads(Path(path).read_text())]


@dataclass
class Run:
    """One replay of a trace: a reading per decision, the strategy's counts, its wall time."""

    strategy: str
    readings: list[Reading]
    forwards: dict[str, int]
    forward_tokens: dict[str, int]
    vision_tower_runs: int
    wall_s: float
    info: dict[str, Any]


def replay(trace: Trace, strategy: Strategy, greedy: int = 16, forced: Sequence[Sequence[int]] | None = None) -> Run:
    """Run every operation of `trace` on a fresh `strategy`; the window it holds is checked
    against the trace's after every operation. forced: one reply per decision (the reference's
    greedy tokens), read by teacher forcing instead of decoding (`Strategy.decide`)."""
    if forced is not None and len(forced) != trace.decisions:
        raise ValueError(f"forced holds {len(forced)} replies for {trace.decisions} decisions")
    if strategy.order or strategy.ids:
        raise ValueError(f"{strategy.name}: replay needs a fresh strategy")
    readings: list[Reading] = []
    order: list[int] = []
    t0 = time.perf_counter()
    for op in trace.ops:
        kind = op["op"]
        if kind == "append":
            strategy.append(op["chunk"], trace.chunks[op["chunk"]])
            order.append(op["chunk"])
        elif kind == "evict":
            strategy.evict(op["chunk"])
            order.remove(op["chunk"])
        elif kind == "recall":
            strategy.recall(op["chunk"], int(op["at"]))
            order.insert(int(op["at"]), op["chunk"])
        else:
            readings.append(strategy.decide(op["query"], greedy, None if forced is None else forced[len(readings)]))
        if strategy.order != order:
            raise RuntimeError(f"{strategy.name} holds {strategy.order} where the trace holds {order}")
    wall = time.perf_counter() - t0
    forwards, tokens = strategy.counts()
    return Run(strategy.name, readings, forwards, tokens, strategy.vision_tower_runs(), wall, strategy.info())


def parsed_action(tokenizer: Any, prime: str, tokens: Sequence[int], allowed: Sequence[str] | None) -> Any:
    """The action the agent would take on the reply `prime + decode(tokens)`: the parsed dict, or
    "malformed" when the reply holds none."""
    from agents.actions import MalformedAction, parse_action

    try:
        return parse_action(prime + tokenizer.decode(list(tokens)), allowed=allowed)
    except MalformedAction:
        return "malformed"


def score(trace: Trace, reference: Run, other: Run, tokenizer: Any, greedy: int) -> list[dict[str, Any]]:
    """Per decision: KL(reference || other) in nats, top-1 and greedy agreement, same action."""
    decisions = [op for op in trace.ops if op["op"] == "decide"]
    if not len(decisions) == len(reference.readings) == len(other.readings):
        raise ValueError("the runs do not have one reading per decision of the trace")
    rows = []
    for op, ref, mine in zip(decisions, reference.readings, other.readings):
        ref_action = parsed_action(tokenizer, op.get("prime", ""), ref.tokens, op.get("allowed"))
        action = parsed_action(tokenizer, op.get("prime", ""), mine.tokens, op.get("allowed"))
        rows.append({"step": op.get("step"), "kl": kl_divergence(ref.logprobs, mine.logprobs, log_probs=True),
                     "max_abs_logprob": float((ref.logprobs - mine.logprobs).abs().max()),
                     "top1": top1_agrees(ref.logprobs, mine.logprobs),
                     "greedy": ref.tokens[:greedy] == mine.tokens[:greedy],
                     "same_action": action == ref_action,
                     "reference_action": ref_action if isinstance(ref_action, str) else ref_action.get("action"),
                     "action": action if isinstance(action, str) else action.get("action")})
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over decisions of the scored rows."""
    n = len(rows)
    if n == 0:
        return {"decisions": 0}
    return {"decisions": n, "kl_mean": sum(r["kl"] for r in rows) / n, "kl_max": max(r["kl"] for r in rows),
            "max_abs_logprob": max(r["max_abs_logprob"] for r in rows),
            "top1": sum(r["top1"] for r in rows) / n, "greedy16": sum(r["greedy"] for r in rows) / n,
            "same_action": sum(r["same_action"] for r in rows) / n}


class PeakRss:
    """Peak resident memory of this process over a stretch of work, in MB (`mb`), and the resident
    size at its start (`start_mb`). The kernel's high-water mark (VmHWM) is reset at the start
    where Linux allows it (`/proc/self/clear_refs`); elsewhere the figure is the process's peak so
    far (`exact` False)."""

    def __enter__(self) -> "PeakRss":
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.exact = True
        except OSError:
            self.exact = False
        self.start_mb = _status_mb("VmRSS") or 0.0
        self.mb = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mb = peak_rss_mb()


def _status_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    peak = _status_mb("VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(trace: Trace, make: Callable[[], Strategy], repeats: int, greedy: int,
            log: Callable[[str], None] = lambda _: None,
            forced: Sequence[Sequence[int]] | None = None) -> tuple[Run, dict[str, Any]]:
    """`repeats` replays of `trace` on fresh strategies from `make()`; the first run's readings
    and counts (every run computes the same), wall time min and median, the process's CPU time
    (median), peak RSS of the runs and its growth over the resident size at their start."""
    import gc

    runs, walls, cpus = [], [], []
    with PeakRss() as rss:
        for index in range(repeats):
            gc.collect()
            strategy = make()
            cpu = time.process_time()
            run = replay(trace, strategy, greedy, forced)
            cpus.append(time.process_time() - cpu)
            walls.append(run.wall_s)
            if index == 0:
                runs.append(run)
            elif run.forward_tokens != runs[0].forward_tokens:
                raise RuntimeError(f"{run.strategy}: repeat {index} forwarded {run.forward_tokens}, the first "
                                   f"{runs[0].forward_tokens}; replays must be deterministic")
            del strategy
            log(f"  {trace.name} / {run.strategy}: {sum(run.forward_tokens.values())} tokens, {run.wall_s:.1f} s")
    return runs[0], {"wall_s": statistics.median(walls), "wall_s_min": min(walls), "cpu_s": statistics.median(cpus),
                     "repeats": len(walls), "peak_rss_mb": round(rss.mb, 1),
                     "rss_growth_mb": round(rss.mb - rss.start_mb, 1), "peak_rss_exact": rss.exact}


def row_of(run: Run, timing: dict[str, Any], fidelity: dict[str, Any]) -> dict[str, Any]:
    """One strategy's entry in the results."""
    return {"forwarded_tokens": int(sum(run.forward_tokens.values())), "vision_tower_runs": run.vision_tower_runs,
            **timing, **{k: v for k, v in fidelity.items() if k != "decisions"}, "decisions": len(run.readings),
            "forward_tokens": dict(sorted(run.forward_tokens.items())), "forwards": dict(sorted(run.forwards.items())),
            **({"info": run.info} if run.info else {})}


def to_jsonable(value: Any) -> Any:
    """Tensors and tuples turned into JSON values (for the results file)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value
