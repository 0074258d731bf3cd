"""What a run leaves behind: one `StepRecord` per step, and a `RunSummary` computed from them.

Every count in the summary is a sum over the step records (`summarize`), so the summary can never
report an eviction, a recall, a store hit or a vision-tower run that no step shows. The window's
work is given as the tokens its forwards computed, by kind (encode, in_context, conditioned,
query, decode, orbit), and the run's wall time; no saving is claimed, since none is measured
against a baseline run on the same inputs here. `Progress` shows the steps as they finish.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

FORWARD_KINDS = ("encode", "in_context", "conditioned", "query", "decode", "orbit")


@dataclass
class StepRecord:
    """One step. Step 0 is the first observation (no decision); later steps hold the model's reply,
    the parsed action, and what the window did with the resulting observation."""

    step: int
    reply: str | None = None
    action: dict[str, Any] | None = None
    error: str | None = None  # malformed reply, refused action, or the environment's error
    error_kind: str | None = None  # "malformed" | "refused" | "environment"
    observation: str | None = None  # label of the observation this step produced
    event: str | None = None  # "append" | "recall" | "in-view" (content seen before) | "answer"
    content_key: str | None = None
    chunks: list[int] = field(default_factory=list)
    fitted: str | None = None  # what was done to make the observation fit the window (split, cut)
    evicted: list[str] = field(default_factory=list)  # "step N (label)" that left the window
    recalled: list[str] = field(default_factory=list)  # "step N (label)" that came back
    kept: str | None = None  # the observation recalled as the closest to the task (keep_relevant)
    evicted_chunks: int = 0  # chunks that left the window during this step
    recalled_chunks: int = 0  # chunks brought back during this step
    recalled_tokens: int = 0  # their tokens
    store_hits: int = 0  # chunks whose KV was read from the store instead of computed (in-context or canonical)
    encoder_runs: int = 0  # vision-tower runs
    encoder_reused: int = 0  # vision-tower outputs read back instead of computed
    forward_tokens: dict[str, int] = field(default_factory=dict)  # tokens the window's forwards computed, by kind
    generated_tokens: int | None = None  # tokens the model wrote for this decision
    tokens_after_close: int | None = None  # of those, tokens after the action object closed
    window_tokens: int = 0
    kl: float | None = None  # KL(re-prefill || window) at a recall, with fidelity_query
    seconds: float = 0.0


@dataclass
class RunSummary:
    """The run's figures, every count summed over the step records (see `summarize`)."""

    env: str
    model: str
    task: str
    steps: int
    stopped: str  # "answer", "step limit", or "error: ..."
    answer: str | None
    observations: int
    appended: int
    evictions: int  # chunks evicted, over all steps
    eviction_steps: list[int]  # the steps that evicted
    recalls: int  # chunks recalled, over all steps
    recall_steps: list[int]  # the steps that recalled
    content_hits: int  # observations seen before (recalled or still in view), not encoded again
    store_hits: int  # chunks whose KV came from the store (no forward of them)
    encoder_calls: int  # vision-tower runs (images and frames)
    encoder_hits: int  # vision-tower outputs read back instead of computed
    recalled_tokens: int  # tokens of the chunks recalled
    forward_tokens: dict[str, int]  # tokens the window's forwards computed, by kind
    fitted_observations: int  # observations split, scaled or cut to fit the window
    malformed_replies: int
    refused_actions: int
    kl_at_recalls: list[float]
    window_tokens: int
    budget_tokens: int
    wall_s: float

    def table(self) -> str:
        """The summary as an aligned two-column table."""
        evict_steps, recall_steps = _steps(self.eviction_steps), _steps(self.recall_steps)
        forwarded = ", ".join(f"{k} {v}" for k, v in self.forward_tokens.items() if v) or "none"
        rows = [
            ("environment / model", f"{self.env} / {self.model}"),
            ("steps", f"{self.steps} (stopped: {self.stopped})"),
            ("observations", f"{self.observations} ({self.appended} appended, {self.content_hits} seen before)"),
            ("evictions", f"{self.evictions} chunks" + (f" in {evict_steps}" if evict_steps else "")),
            ("recalls", f"{self.recalls} chunks ({self.recalled_tokens} tokens)"
             + (f" in {recall_steps}" if recall_steps else "")),
            ("store hits", f"{self.store_hits} chunks read from the store instead of computed"),
            ("vision encoder", f"{self.encoder_calls} runs, {self.encoder_hits} outputs read back"),
            ("fitted", f"{self.fitted_observations} observations split or cut to fit the window"),
            ("forwarded tokens", f"{forwarded} (total {sum(self.forward_tokens.values())})"),
            ("malformed / refused", f"{self.malformed_replies} / {self.refused_actions}"),
            ("window", f"{self.window_tokens} of {self.budget_tokens} tokens"),
            ("wall time", f"{self.wall_s:.1f} s"),
        ]
        if not (self.encoder_calls or self.encoder_hits):
            rows = [row for row in rows if row[0] != "vision encoder"]
        if not self.fitted_observations:
            rows = [row for row in rows if row[0] != "fitted"]
        if self.kl_at_recalls:
            rows.append(("KL at recalls", ", ".join(f"{k:.2e}" for k in self.kl_at_recalls) + " nats"))
        rows.append(("answer", repr(self.answer) if self.answer is not None else "none"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)



def _steps(steps: list[int]) -> str:
    if not steps:
        return ""
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


def summarize(records: list[StepRecord], *, env: str, model: str, task: str, stopped: str, answer: str | None,
              window_tokens: int, budget_tokens: int, wall_s: float) -> RunSummary:
    """The run's summary from its step records alone."""
    forwarded = {kind: 0 for kind in FORWARD_KINDS}
    for r in records:
        for kind, tokens in r.forward_tokens.items():
            forwarded[kind] = forwarded.get(kind, 0) + int(tokens)
    seen_before = [r for r in records if r.event in ("recall", "in-view") and (r.action or {}).get("action") != "recall"]
    return RunSummary(
        env=env, model=model, task=task, steps=max(0, len(records) - 1), stopped=stopped, answer=answer,
        observations=sum(1 for r in records if r.event in ("append", "recall", "in-view")
                         and (r.action or {}).get("action") != "recall"),
        appended=sum(1 for r in records if r.event == "append"),
        evictions=sum(r.evicted_chunks for r in records),
        eviction_steps=[r.step for r in records if r.evicted_chunks],
        recalls=sum(r.recalled_chunks for r in records),
        recall_steps=[r.step for r in records if r.recalled_chunks],
        content_hits=len(seen_before), store_hits=sum(r.store_hits for r in records),
        encoder_calls=sum(r.encoder_runs for r in records), encoder_hits=sum(r.encoder_reused for r in records),
        recalled_tokens=sum(r.recalled_tokens for r in records), forward_tokens=forwarded,
        fitted_observations=sum(1 for r in records if r.fitted),
        malformed_replies=sum(1 for r in records if r.error_kind == "malformed"),
        refused_actions=sum(1 for r in records if r.error_kind == "refused"),
        kl_at_recalls=[r.kl for r in records if r.kl is not None], window_tokens=window_tokens,
        budget_tokens=budget_tokens, wall_s=wall_s)


class Progress:
    """Step progress on stderr: a tqdm bar on a terminal, one plain line per step elsewhere (no
    carriage returns or cursor moves in logs), nothing when disabled."""

    def __init__(self, total: int, name: str, enabled: bool) -> None:
        self.total, self.name, self.enabled = total, name, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.bar = None
        if self.tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=f"{name} steps", leave=True, dynamic_ncols=True)

    def step(self, record: StepRecord) -> None:
        what = (record.action or {}).get("action", "malformed")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{what}, {record.window_tokens} tok")
        elif self.enabled:
            where = f" -> {record.observation}" if record.observation and record.event != "answer" else ""
            print(f"{self.name} step {record.step}/{self.total}: {what}{where}, window {record.window_tokens} "
                  f"tokens, {record.seconds:.1f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
