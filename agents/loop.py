"""The step loop every agent shares: observe -> window update -> decide -> act -> record.

- Observe: the environment's observation becomes chunk(s) (`observation_chunks`). An observation
  whose content was seen before (`Observation.content_key()`) is not encoded again: still in view,
  nothing happens; evicted, its chunks are recalled (their KV is read back, not recomputed). New
  content is appended; the window's budget evicts the oldest chunks.
- Decide: the decider (the model through the window, or a script) reads the window and a prompt
  (task, actions, what is out of view, the last error) and replies with text.
- Act: the reply is parsed (`agents.actions`); "answer" ends the run, "recall" brings an earlier
  step's observation back, anything else goes to `Env.act`. A malformed reply or an action the
  environment refuses (`ActionError`) is shown to the model at the next step; `EnvError` stops the
  run with its message. `max_steps` bounds the number of decisions.
- Record: one `StepRecord` per step (optionally appended to a JSONL file as it happens) and a
  `RunSummary` at the end: steps, evictions, recalls, reuse hits, encode and prefill work avoided,
  an estimate of the time saved, and the answer.

With `fidelity_query`, each recall is checked: the KL between the window's next-token
distribution after that query and a full re-prefill's (`Window.reference_logprobs`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from agents.actions import LOOP_ACTIONS, MalformedAction, describe_actions, parse_action, retry_message
from agents.base import ActionError, Env, EnvError, Observation
from agents.model import Decider


@dataclass
class StepRecord:
    """One step. Step 0 is the first observation (no decision); later steps hold the model's reply,
    the parsed action, and what the window did with the resulting observation."""

    step: int
    reply: str | None = None
    action: dict[str, Any] | None = None
    error: str | None = None  # malformed reply, refused action, or the environment's error
    observation: str | None = None  # label of the observation this step produced
    event: str | None = None  # "append" | "recall" | "in-view" (content seen before) | "answer"
    content_key: str | None = None
    chunks: list[int] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)  # "step N (label)" that left the window
    recalled: list[str] = field(default_factory=list)  # "step N (label)" that came back
    window_tokens: int = 0
    kl: float | None = None  # KL(re-prefill || window) at a recall, with fidelity_query
    seconds: float = 0.0


@dataclass
class RunSummary:
    """The run's figures. Token counts come from `Window.stats()`; `recalled_tokens` are tokens
    brought back by recalls (KV read back instead of encoded); `time_saved_s` estimates
    `prefill_tokens_avoided × prefill_s_per_token`, the latter measured at the end of the run by
    re-prefilling the final window once."""

    env: str
    model: str
    task: str
    steps: int
    stopped: str  # "answer", "step limit", or "error: ..."
    answer: str | None
    observations: int
    appended: int
    evictions: int
    recalls: int
    content_hits: int  # observations seen before (recalled or still in view), not encoded again
    store_hits: int  # chunks whose canonical KV came from the store (no encode)
    encode_tokens_avoided: int
    encoder_calls: int  # vision-tower runs (images and frames)
    encoder_hits: int  # vision-tower outputs served from the store instead
    recalled_tokens: int
    prefill_tokens_avoided: int
    conditioned_passes: int
    malformed_replies: int
    refused_actions: int
    prefill_s_per_token: float | None
    time_saved_s: float | None
    kl_at_recalls: list[float]
    window_tokens: int
    budget_tokens: int
    wall_s: float

    def table(self) -> str:
        """The summary as an aligned two-column table."""
        rows = [
            ("environment / model", f"{self.env} / {self.model}"),
            ("steps", f"{self.steps} (stopped: {self.stopped})"),
            ("observations", f"{self.observations} ({self.appended} appended, {self.content_hits} seen before)"),
            ("evictions / recalls", f"{self.evictions} / {self.recalls}"),
            ("reuse hits", f"{self.content_hits} content-key hits, {self.store_hits} store hits"),
            ("encode avoided", f"{self.encode_tokens_avoided} tokens from the store + {self.recalled_tokens} recalled"),
            ("vision encoder", f"{self.encoder_calls} runs, {self.encoder_hits} served from the store"),
            ("prefill avoided", f"{self.prefill_tokens_avoided} tokens placed by relocation "
                                f"({self.conditioned_passes} conditioned passes run)"),
            ("time saved (est.)", "n/a" if self.time_saved_s is None else
             f"{self.time_saved_s:.2f} s = {self.prefill_tokens_avoided} tokens x "
             f"{self.prefill_s_per_token * 1e3:.2f} ms/token prefill"),
            ("malformed / refused", f"{self.malformed_replies} / {self.refused_actions}"),
            ("window", f"{self.window_tokens} of {self.budget_tokens} tokens"),
            ("wall time", f"{self.wall_s:.1f} s"),
        ]
        if not (self.encoder_calls or self.encoder_hits):
            rows = [row for row in rows if row[0] != "vision encoder"]
        if self.kl_at_recalls:
            rows.append(("KL at recalls", ", ".join(f"{k:.2e}" for k in self.kl_at_recalls) + " nats"))
        rows.append(("answer", repr(self.answer) if self.answer is not None else "none"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


@dataclass
class RunResult:
    summary: RunSummary
    records: list[StepRecord]

    def to_json(self) -> dict[str, Any]:
        return {"summary": asdict(self.summary), "steps": [asdict(r) for r in self.records]}


def observation_chunks(obs: Observation, km: Any) -> list[Any]:
    """The chunks of one observation. Text models: one Text with the label and the text view.
    Vision-language models (`km.is_vlm`): the images as `agentwin.Image` chunks, or the frames of a
    video observation (with timestamps) as one `agentwin.Frames` chunk, then the Text."""
    from agentwin import Text

    text = Text(f"\n[{obs.label}]\n{obs.text}".rstrip() + "\n")
    if not obs.images or not getattr(km, "is_vlm", False):
        return [text]
    import agentwin

    if not hasattr(agentwin, "Image") or not hasattr(agentwin, "Frames"):
        raise EnvError("this agentwin has no image or frame chunks (agentwin.Image / agentwin.Frames); "
                       "use a text model")
    if obs.timestamps:
        return [agentwin.Frames(list(obs.images), timestamps=list(obs.timestamps)), text]
    return [agentwin.Image(image) for image in obs.images] + [text]


def kl_to_reference(window: Any, query: str) -> float:
    """KL(re-prefill || window) of the next-token distributions after `query`, in nats (float64)."""
    reused = window.next_token_logprobs(query).double()
    reference = window.reference_logprobs(query).double()
    return float((reference.exp() * (reference - reused)).sum())


class AgentLoop:
    """Runs one task in one environment on one window; see the module docstring."""

    def __init__(self, env: Env, window: Any, decider: Decider, task: str, max_steps: int = 20,
                 log_path: str | Path | None = None, fidelity_query: str | None = None,
                 progress: bool = False, measure_prefill: bool = True,
                 on_step: Callable[[StepRecord], None] | None = None) -> None:
        if not isinstance(env, Env):
            raise TypeError(f"env must implement agents.base.Env, got {type(env).__name__}")
        if not hasattr(decider, "decide"):
            raise TypeError(f"decider must have decide(window, prompt), got {type(decider).__name__}")
        if not isinstance(task, str) or not task.strip():
            raise ValueError("task must be a non-empty string (what the agent should find out or do)")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
        self.env, self.window, self.decider, self.task = env, window, decider, task.strip()
        self.max_steps, self.fidelity_query, self.progress = max_steps, fidelity_query, progress
        self.measure_prefill, self.on_step = measure_prefill, on_step
        self.log_path = Path(log_path) if log_path is not None else None
        self.records: list[StepRecord] = []
        self._by_key: dict[str, list[int]] = {}  # content key -> chunk ids
        self._step_chunks: dict[int, list[int]] = {}  # step -> chunk ids of its observation
        self._step_label: dict[int, str] = {}
        self._step_meta: dict[int, dict[str, Any]] = {}
        self._tokens: dict[int, int] = {}  # chunk id -> its tokens
        self._chunk_step: dict[int, int] = {}  # chunk id -> step that first showed it
        self._current: tuple[int, str] | None = None
        self._counts = {"content_hits": 0, "appended": 0, "recalled_tokens": 0, "malformed": 0, "refused": 0}
        self._kls: list[float] = []

    # ---- the run ------------------------------------------------------------------------------

    def run(self) -> RunResult:
        t_start = time.perf_counter()
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_text("")
        bar = _bar(self.max_steps, f"{self.env.name} steps", self.progress)
        stopped, answer, notice = "step limit", None, None
        try:
            record = StepRecord(step=0)
            t0 = time.perf_counter()
            try:
                self._observe(self.env.reset(), record)
            except EnvError as err:
                record.error, stopped = str(err), f"error: {err}"
            self._finish(record, t0)
            step = 0
            while not stopped.startswith("error") and step < self.max_steps:
                step += 1
                record, t0 = StepRecord(step=step), time.perf_counter()
                record.reply = self.decider.decide(self.window, self._prompt(notice))
                notice = None
                try:
                    action = parse_action(record.reply, allowed=set(self.env.actions()) | set(LOOP_ACTIONS))
                    record.action = action
                    if action["action"] == "answer":
                        answer = _answer_text(action)
                        record.event, stopped = "answer", "answer"
                    elif action["action"] == "recall":
                        notice = self._recall_step(action, record)
                    else:
                        self._observe(self.env.act(action), record)
                except MalformedAction as err:
                    self._counts["malformed"] += 1
                    record.error = notice = retry_message(err)
                except ActionError as err:
                    self._counts["refused"] += 1
                    record.error = str(err)
                    notice = f"That action failed: {err}"
                except EnvError as err:
                    record.error, stopped = str(err), f"error: {err}"
                self._finish(record, t0)
                bar.update(1)
                bar.set_postfix_str(f"{(record.action or {}).get('action', 'malformed')}, "
                                    f"{record.window_tokens} tok")
                if stopped == "answer":
                    break
        finally:
            bar.close()
        summary = self._summary(stopped, answer, time.perf_counter() - t_start)
        if self.log_path is not None:
            with self.log_path.open("a") as fh:
                fh.write(json.dumps({"summary": asdict(summary)}, default=repr) + "\n")
        return RunResult(summary, self.records)

    # ---- observation -> window --------------------------------------------------------------

    def _observe(self, obs: Observation, record: StepRecord) -> None:
        if not isinstance(obs, Observation):
            raise EnvError(f"{self.env.name} returned {type(obs).__name__}, not an Observation")
        key = obs.content_key()
        record.observation, record.content_key = obs.label, key
        before = self.window.chunks()
        if key in self._by_key:
            ids = self._by_key[key]
            self._counts["content_hits"] += 1
            missing = [c for c in ids if c not in before]
            if missing:
                self._bring_back(missing, record)
            else:
                record.event = "in-view"
        else:
            ids = []
            for chunk in observation_chunks(obs, self.window.km):
                try:
                    ids.append(self._append(chunk))
                except ValueError as err:
                    raise EnvError(f"observation {obs.label!r} does not fit the window ({err}); raise "
                                   "--budget-tokens or make observations smaller") from err
            self._by_key[key] = ids
            self._counts["appended"] += 1
            for c in ids:
                self._chunk_step[c] = record.step
            record.event = "append"
        record.chunks = list(ids)
        record.evicted = self._labels(c for c in before if c not in self.window.chunks())
        self._step_chunks[record.step] = list(ids)
        self._step_label[record.step] = obs.label
        self._step_meta[record.step] = obs.meta
        self._current = (record.step, obs.label)
        if hasattr(self.decider, "observe"):
            self.decider.observe(obs)

    def _bring_back(self, chunk_ids: list[int], record: StepRecord) -> None:
        """Recall `chunk_ids` at the window's end; the window evicts by its policy for room (a
        window that refuses instead has its oldest other chunks evicted here)."""
        for cid in chunk_ids:
            while True:
                try:
                    self.window.recall(cid, at=len(self.window.chunks()))
                    break
                except ValueError:
                    victims = [c for c in self.window.chunks() if c not in chunk_ids]
                    if not victims:
                        raise
                    self.window.evict(victims[0])
        self._counts["recalled_tokens"] += sum(self._tokens.get(c, 0) for c in chunk_ids)
        record.event = "recall"
        record.recalled = self._labels(chunk_ids)
        if self.fidelity_query:
            record.kl = kl_to_reference(self.window, self.fidelity_query)
            self._kls.append(record.kl)

    def _append(self, chunk: Any) -> int:
        """Append one chunk; learn its token count from the window's totals (the chunks it
        evicted were appended here, so their counts are known)."""
        before, tokens = self.window.chunks(), self.window.tokens()
        cid = int(self.window.append(chunk))
        gone = [c for c in before if c not in self.window.chunks()]
        self._tokens[cid] = self.window.tokens() - tokens + sum(self._tokens.get(c, 0) for c in gone)
        return cid

    def _recall_step(self, action: dict[str, Any], record: StepRecord) -> str:
        """{"step": N}, {"query": "..."} (closest key summary) or {"time": T} (meta start..end)."""
        how = ""
        if action.get("step") is not None:
            raw = action.get("step")
            try:
                step = int(raw)
            except (TypeError, ValueError):
                raise MalformedAction(f'recall needs an integer "step", got {raw!r}') from None
            if step not in self._step_chunks:
                known = ", ".join(str(s) for s in sorted(self._step_chunks)) or "none"
                raise ActionError(f"step {step} has no observation; steps with observations: {known}")
        elif isinstance(action.get("query"), str) and action["query"].strip():
            step, score = self._retrieve(action["query"])
            how = f" (closest to {action['query'].strip()!r}, similarity {score:.2f})"
        elif action.get("time") is not None:
            step = self._at_time(action["time"])
            how = f" (covers {float(action['time']):g} s)"
        else:
            raise MalformedAction('recall needs "step", "query" or "time", e.g. {"action": "recall", "step": 0}')
        ids = self._step_chunks[step]
        missing = [c for c in ids if c not in self.window.chunks()]
        label = self._step_label[step]
        record.observation = label
        record.chunks = list(ids)
        if not missing:
            record.event = "in-view"
            return f"Step {step} ({label}){how} is already in view."
        before = self.window.chunks()
        self._bring_back(missing, record)
        record.evicted = self._labels(c for c in before if c not in self.window.chunks())
        return f"Step {step} ({label}){how} is back in view."

    def _first_steps(self) -> list[int]:
        return [s for s in sorted(self._step_chunks) if self._step_chunks[s] and self._first_step_of(s) == s]

    def _retrieve(self, query: str) -> tuple[int, float]:
        """The observation whose chunks' key summaries (mean keys per layer) are closest to the
        query's: cosine per layer, averaged over layers, best chunk of each observation."""
        import torch

        steps = self._first_steps()
        if not steps:
            raise ActionError("there is no earlier observation to recall")
        ids = self.window.km.tokenize(query)
        if ids.numel() == 0:
            raise ActionError("the recall query has no tokens")
        q = torch.nn.functional.normalize(self.window.km.key_summary(ids).float(), dim=-1)
        best = None
        for step in steps:
            scores = [float((torch.nn.functional.normalize(self.window.key_summary(c).float(), dim=-1) * q)
                            .sum(-1).mean()) for c in self._step_chunks[step]]
            if best is None or max(scores) > best[1]:
                best = (step, max(scores))
        return best

    def _at_time(self, raw: Any) -> int:
        try:
            t = float(raw)
        except (TypeError, ValueError):
            raise MalformedAction(f'recall "time" must be a number of seconds, got {raw!r}') from None
        for step in self._first_steps():
            meta = self._step_meta.get(step, {})
            start, end = meta.get("start"), meta.get("end")
            if start is not None and end is not None and float(start) <= t <= float(end):
                return step
        raise ActionError(f"no earlier observation covers {t:g} s")

    # ---- prompt, records, summary -----------------------------------------------------------

    def _prompt(self, notice: str | None) -> str:
        in_view = set(self.window.chunks())
        out = [f"step {s} ({label})" for s, label in self._step_label.items()
               if not set(self._step_chunks[s]) & in_view and self._first_step_of(s) == s]
        lines = [f"\n\nTask: {self.task}",
                 "Reply with one JSON object naming an action and its arguments, for example "
                 '{"action": "answer", "text": "..."}. Actions:',
                 describe_actions(self.env.actions())]
        if out:
            lines.append("Out of view, recall by step: " + "; ".join(out[-8:]))
        if self._current is not None:
            lines.append(f"Current observation: step {self._current[0]} ({self._current[1]}).")
        if notice:
            lines.append(notice)
        lines.append("Action:")
        return "\n".join(lines)

    def _first_step_of(self, step: int) -> int:
        chunks = self._step_chunks[step]
        return self._chunk_step.get(chunks[0], step) if chunks else step

    def _labels(self, chunk_ids) -> list[str]:
        steps = sorted({self._chunk_step[c] for c in chunk_ids if c in self._chunk_step})
        return [f"step {s} ({self._step_label.get(s, '?')})" for s in steps]

    def _finish(self, record: StepRecord, t0: float) -> None:
        record.window_tokens = self.window.tokens()
        record.seconds = time.perf_counter() - t0
        self.records.append(record)
        if self.log_path is not None:
            with self.log_path.open("a") as fh:
                fh.write(json.dumps(asdict(record), default=repr) + "\n")
        if self.on_step is not None:
            self.on_step(record)

    def _summary(self, stopped: str, answer: str | None, wall: float) -> RunSummary:
        stats = self.window.stats()
        per_token = self._prefill_s_per_token() if self.measure_prefill else None
        return RunSummary(
            env=self.env.name, model=str(getattr(self.window.km, "name", "?")), task=self.task,
            steps=len(self.records) - 1, stopped=stopped, answer=answer,
            observations=sum(1 for r in self.records if r.event in ("append", "recall", "in-view")
                             and (r.action or {}).get("action") != "recall"),
            appended=self._counts["appended"], evictions=stats.evictions, recalls=stats.recalls,
            content_hits=self._counts["content_hits"], store_hits=stats.canonical_hits,
            encode_tokens_avoided=stats.encode_tokens_avoided, recalled_tokens=self._counts["recalled_tokens"],
            encoder_calls=int(getattr(stats, "encoder_calls", 0)), encoder_hits=int(getattr(stats, "encoder_hits", 0)),
            prefill_tokens_avoided=stats.prefill_tokens_avoided, conditioned_passes=stats.conditioned_passes,
            malformed_replies=self._counts["malformed"], refused_actions=self._counts["refused"],
            prefill_s_per_token=per_token,
            time_saved_s=None if per_token is None else per_token * stats.prefill_tokens_avoided,
            kl_at_recalls=list(self._kls), window_tokens=self.window.tokens(),
            budget_tokens=int(self.window.budget_tokens), wall_s=wall)

    def _prefill_s_per_token(self) -> float | None:
        """Seconds per token of one full re-prefill of the final window (plus a one-token query)."""
        tokens = self.window.tokens()
        if tokens == 0:
            return None
        query = "\n"
        t0 = time.perf_counter()
        self.window.reference_logprobs(query)
        return (time.perf_counter() - t0) / (tokens + int(self.window.km.tokenize(query).numel()))


def _answer_text(action: dict[str, Any]) -> str:
    text = action.get("text", action.get("answer"))
    if text is None or (isinstance(text, str) and not text.strip()):
        raise MalformedAction('answer needs its "text", e.g. {"action": "answer", "text": "..."}')
    return str(text).strip()


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=True, dynamic_ncols=True)
