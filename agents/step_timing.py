"""Where an agent step's time goes: the model's own forwards against everything else.

`measure_agent` runs one agent (the document navigator on a generated PDF, or the web agent on a
small site served from 127.0.0.1 in headless Chromium, text view only) with the model deciding
every step through the window, and times each step twice: as a whole (the loop's
`StepRecord.seconds`) and inside the model's top-level forward calls (`ForwardTimer`: a pre- and a
post-forward hook on the model, so every forward counts: the chunks' encode and in-context passes,
the prompt, each decoded token). What is left is the step's overhead: the environment (page text,
the browser), patch fitting, segment tables, constrained decoding's masks, prompt and records.

`run_steps` measures the agents named and returns the figures `agentwin bench steps` writes:
`step_s_median`, `overhead_share` (time outside the model's forwards over the steps' time, pooled
over the decision steps of every agent), `tokens_after_action_close` (tokens the model generated
after its action object closed, summed over the decisions), per agent the same, and the machine's
load average before and after, and torch's thread count. Step 0 (the first observation, no
decision, and the browser's start) is left out.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

AGENTS = ("doc", "web")
FACTS = [
    ("harbour", "The harbour master of Velmora is Anja Roth. She keeps the tide log and rings the storm bell."),
    ("lighthouse", "The lighthouse keeper of Velmora is Tobias Mertens. He repairs the fog horn every spring."),
    ("ferry", "The ferry captain is Lena Okafor; the Grey Heron leaves the north pier at seven."),
    ("school", "The island school is run by Pavel Ilic, who plays the organ at the chapel on Sundays."),
    ("bakery", "Marta Vidal bakes rye bread on Mondays and almond cake on Fridays in Mill Street."),
    ("weather", "Jonas Berg reads the weather station on the western cliff at noon each day."),
]
QUESTION = "Who is the lighthouse keeper of Velmora?"


class ForwardTimer:
    """Seconds spent inside `model.forward` (outermost calls only), via forward hooks."""

    def __init__(self, model: Any) -> None:
        self.seconds, self.calls = 0.0, 0
        self._depth, self._t0 = 0, 0.0
        self._hooks = [model.register_forward_pre_hook(self._enter), model.register_forward_hook(self._leave)]

    def _enter(self, *args: Any) -> None:
        if self._depth == 0:
            self._t0 = time.perf_counter()
        self._depth += 1

    def _leave(self, *args: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._t0
            self.calls += 1

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _pages() -> list[str]:
    pages = []
    for index, (topic, fact) in enumerate(FACTS * 2):
        filler = " ".join(f"Entry {index}.{k}: the {topic} records for the season were checked and filed." for k in range(6))
        pages.append(f"Velmora survey, page {index + 1}: the {topic}. {fact} {filler}")
    return pages


def _site() -> dict[str, str]:
    names = [topic for topic, _ in FACTS]
    links = "".join(f"<li><a href='/{n}.html'>{n.title()}</a></li>" for n in names)
    site = {"/": f"<html><head><title>Velmora</title></head><body><h1>Velmora island</h1><p>Pages about "
                 f"the island's people and places.</p><ul>{links}</ul></body></html>"}
    for topic, fact in FACTS:
        site[f"/{topic}.html"] = (f"<html><head><title>{topic.title()}</title></head><body><h1>{topic.title()}</h1>"
                                  f"<p>{fact}</p><p><a href='/'>Back to the index</a></p><ul>{links}</ul></body></html>")
    return site


@contextlib.contextmanager
def _environment(kind: str, workdir: Path, km: Any) -> Iterator[Any]:
    if kind == "doc":
        from agents.doc import PdfEnv, write_text_pdf

        env = PdfEnv(write_text_pdf(workdir / "velmora.pdf", _pages()))
        try:
            yield env
        finally:
            env.close()
    elif kind == "web":
        from agents.web import BrowserEnv

        from agents.local_site import serve

        with serve(_site()) as base:
            env = BrowserEnv(f"{base}/", screenshot=bool(getattr(km, "is_vlm", False)), timeout_s=30)
            try:
                yield env
            finally:
                env.close()
    else:
        raise ValueError(f"unknown agent {kind!r}; choose from {', '.join(AGENTS)}")


def measure_agent(km: Any, kind: str, budget_tokens: int = 1024, max_steps: int = 8, max_new_tokens: int = 48,
                  workdir: str | os.PathLike | None = None, guard: bool = False) -> dict[str, Any]:
    """One run of agent `kind` with the model deciding; every step's time, forward time and
    decoding figures (see the module docstring). The window has its default settings (`guard`:
    the patch policies' default, `agentwin.patches.policies.DEFAULT_PATCH_POLICY`, with the patch guard on)."""
    from agents.loop import AgentLoop
    from agents.model import WindowDecider
    from agentwin import Window
    from agentwin.patches.policies import DEFAULT_PATCH_POLICY

    steps: list[dict[str, Any]] = []
    timer = ForwardTimer(km.model)
    last = [0.0]

    def on_step(record: Any) -> None:
        forward = timer.seconds - last[0]
        last[0] = timer.seconds
        steps.append({"step": record.step, "reply": record.reply, "action": (record.action or {}).get("action"),
                      "event": record.event,
                      "error": record.error_kind, "step_s": record.seconds, "forward_s": forward,
                      "overhead_s": max(0.0, record.seconds - forward), "generated_tokens": record.generated_tokens,
                      "tokens_after_close": record.tokens_after_close,
                      "forward_tokens": dict(record.forward_tokens)})

    task = QUESTION if kind == "doc" else "Find out who the lighthouse keeper of Velmora is."
    try:
        with tempfile.TemporaryDirectory() as tmp, _environment(kind, Path(workdir or tmp), km) as env:
            # The default window; with `guard`, the patch policies' default with the patch guard on.
            window = Window(km, budget_tokens=budget_tokens, **({"patch": DEFAULT_PATCH_POLICY, "guard": True}
                                                                 if guard else {}))
            result = AgentLoop(env, window, WindowDecider(max_new_tokens), task, max_steps=max_steps,
                               on_step=on_step, keep_relevant=True).run()  # as `agentwin doc | web` run
    finally:
        timer.close()
    decisions = [s for s in steps if s["step"] >= 1]
    return {"agent": kind, "stopped": result.summary.stopped, "answer": result.summary.answer,
            **_figures(decisions), "steps": steps}


def _figures(decisions: list[dict[str, Any]]) -> dict[str, Any]:
    if not decisions:
        return {"decisions": 0}
    total = sum(s["step_s"] for s in decisions)
    forward = sum(s["forward_s"] for s in decisions)
    closed = [s["tokens_after_close"] for s in decisions if s["tokens_after_close"] is not None]
    return {"decisions": len(decisions),
            "step_s_median": statistics.median(s["step_s"] for s in decisions),
            "forward_s_median": statistics.median(s["forward_s"] for s in decisions),
            "overhead_s_median": statistics.median(s["overhead_s"] for s in decisions),
            "overhead_share": (total - forward) / total if total > 0 else None,
            "tokens_after_action_close": sum(closed),
            "actions_not_closed": sum(1 for s in decisions if s["tokens_after_close"] is None),
            "generated_tokens_median": statistics.median(s["generated_tokens"] or 0 for s in decisions)}


def run_steps(km: Any, agents: tuple[str, ...] = AGENTS, budget_tokens: int = 1024, max_steps: int = 8,
              max_new_tokens: int = 48, guard: bool = False) -> dict[str, Any]:
    """Every agent in `agents` measured once on `km`; pooled figures first, then per agent."""
    import torch

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    runs = [measure_agent(km, kind, budget_tokens, max_steps, max_new_tokens, guard=guard) for kind in agents]
    pooled = _figures([s for run in runs for s in run["steps"] if s["step"] >= 1])
    return {**pooled, "model": str(getattr(km, "name", "?")), "budget_tokens": budget_tokens, "max_steps": max_steps,
            "max_new_tokens": max_new_tokens, "guard": guard, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "wall_s": time.perf_counter() - t0, "agents": {run["agent"]: run for run in runs}}
