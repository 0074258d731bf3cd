"""The step loop every agent shares: observe -> window update -> decide -> act -> record.

- Observe: the environment's observation becomes chunk(s) that fit the window
  (`agents.fit.fit_observation`: text larger than half the window is split, what cannot fit is
  cut, and the step record says so). An observation whose content was seen before
  (`Observation.content_key()`) is not encoded again: still in view, nothing happens; evicted, its
  chunks are recalled (their KV is read back, not recomputed). New content is appended; the
  window's budget evicts the oldest chunks.
- Decide: the decider (the model through the window, or a script) reads the window and a prompt
  (task, actions, what is out of view, the last error) and replies with text. Where the model has
  a chat format (`agentwin.chat.Chat`: its tokenizer's template, or a built-in one), the window is
  a chat: the instructions and the action list are its pinned system head, appended once per run
  (the same for every task in one kind of environment, so tasks share the KV of the pages they
  read alike); each observation is a part of the user turn; the per-step prompt holds the task
  and what changes (what is out of view, the current observation, the last error) and closes the
  user turn, so the reply is the assistant's. Otherwise (models without one, e.g. the tiny test models) the
  whole prompt is read after the observations as plain text. A decider with
  `use_actions(actions, arguments, window)` is told the actions first (`WindowDecider` holds its reply to
  their JSON schema and stops where the action object closes).
- Act: the reply is parsed (`agents.actions`); "answer" ends the run, "recall" brings an earlier
  step's observation back, anything else goes to `Env.act`. A malformed reply or an action the
  environment refuses (`ActionError`) is shown to the model at the next step, and a decider with
  `avoid(names)` is held away from the actions refused since the environment last changed, so a
  small model cannot spend the remaining steps on one refused action; `EnvError` stops the run
  with its message. `max_steps` bounds the number of decisions.
- Record: one `StepRecord` per step (optionally appended to a JSONL file as it happens) with what
  the window did in that step (evictions, recalls, store hits, vision-tower runs, tokens forwarded
  by kind, read from `Window.stats()` before and after the step), and a `RunSummary` summed from
  the records (`agents.records.summarize`).

Progress: with `progress=True`, a bar on a terminal; elsewhere (a log file, a pipe) one plain line
per step on stderr.

On a window that evicts by relevance (`Window(evict="relevant")`), the budget drops the chunks
least like the task first (`Window.relevant_to(task)`, set when the run starts).

With `keep_relevant`, the observation closest to the task is kept in view: after each new
observation, the earlier observation whose chunks' key summaries are closest to the task text
(`Window.nearest`, the task encoded once per run) is recalled, just before the new one, when it is
out of view and both fit the window; older chunks are evicted to make room. The step record names
it (`kept`) and counts it among the step's recalls. Recalls write no KV and run no forward.

With `fidelity_query`, each recall is checked: the KL between the window's next-token
distribution after that query and a full re-prefill's (`Window.reference_logprobs`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from agents.actions import LOOP_ACTIONS, MalformedAction, describe_actions, parse_action, retry_message
from agents.base import ActionError, Env, EnvError, Observation
from agents.fit import fit_observation
from agents.model import Decider
from agents.records import Progress, RunSummary, StepRecord, summarize

__all__ = ["AgentLoop", "RunResult", "RunSummary", "StepRecord", "kl_to_reference", "observation_chunks"]


@dataclass
class RunResult:
    summary: RunSummary
    records: list[StepRecord]

    def to_json(self) -> dict[str, Any]:
        return {"summary": asdict(self.summary), "steps": [asdict(r) for r in self.records]}


def observation_chunks(obs: Observation, km: Any, chat: Any = None) -> list[Any]:
    """The chunks of one observation. Text models: one Text with the label and the text view (a
    part of the user turn, `chat.part`, in a chat window). Vision-language models (`km.is_vlm`):
    the images as `agentwin.Image` chunks, or the frames of a video observation (with timestamps)
    as one `agentwin.Frames` chunk, then the Text."""
    from agentwin import Text

    raw = f"\n[{obs.label}]\n{obs.text}".rstrip() + "\n"
    text = chat.part(raw) if chat is not None else Text(raw)
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


_COUNTERS = ("evictions", "recalls", "canonical_hits", "exact_hits", "encoder_calls", "encoder_hits")


def _counters(window: Any) -> tuple[dict[str, int], dict[str, int]]:
    """The window's running counters and forwarded tokens by kind (0 / {} where it has none)."""
    stats = window.stats()
    tokens = getattr(stats, "forward_tokens", None)
    return ({name: int(getattr(stats, name, 0) or 0) for name in _COUNTERS},
            {k: int(v) for k, v in tokens.items()} if isinstance(tokens, dict) else {})


def chat_of(window: Any) -> Any:
    """The chat format of the window's model (`agentwin.chat.Chat`), or None where it has none."""
    km = getattr(window, "km", None)
    if km is None or not hasattr(km, "tokenize"):
        return None
    from agentwin.chat import Chat

    try:
        return Chat(km)
    except (TypeError, ValueError):
        return None


class AgentLoop:
    """Runs one task in one environment on one window; see the module docstring. chat: lay the
    window out in the model's chat format where it has one (True, the default), or never."""

    def __init__(self, env: Env, window: Any, decider: Decider, task: str, max_steps: int = 20,
                 log_path: str | Path | None = None, fidelity_query: str | None = None,
                 progress: bool = False, on_step: Callable[[StepRecord], None] | None = None,
                 keep_relevant: bool = False, chat: bool = True) -> None:
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
        self.on_step, self.keep_relevant = on_step, bool(keep_relevant)
        self.log_path = Path(log_path) if log_path is not None else None
        self.chat = chat_of(window) if chat else None
        self._head: int | None = None  # the pinned system head's chunk id (chat windows)
        self.records: list[StepRecord] = []
        self._by_key: dict[str, list[int]] = {}  # content key -> chunk ids
        self._step_chunks: dict[int, list[int]] = {}  # step -> chunk ids of its observation
        self._step_label: dict[int, str] = {}
        self._step_meta: dict[int, dict[str, Any]] = {}
        self._tokens: dict[int, int] = {}  # chunk id -> its tokens
        self._chunk_step: dict[int, int] = {}  # chunk id -> step that first showed it
        self._current: tuple[int, str] | None = None
        self._mark: tuple[dict[str, int], dict[str, int]] = ({}, {})  # counters at the step's start
        self._present: set[int] = set()  # chunks in the window at any time during the step

    # ---- the run ------------------------------------------------------------------------------

    def run(self) -> RunResult:
        t_start = time.perf_counter()
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_text("")
        if hasattr(self.decider, "use_actions"):
            arguments = self.env.action_arguments() if hasattr(self.env, "action_arguments") else {}
            self.decider.use_actions(self.env.actions(), arguments, window=self.window)
        if getattr(self.window, "eviction", None) == "relevant":
            self.window.relevant_to(self.task)  # the budget drops what is least like the task first
        progress = Progress(self.max_steps, self.env.name, self.progress)
        stopped, answer, notice = "step limit", None, None
        try:
            record = self._begin(0)
            try:
                if self.chat is not None:
                    try:
                        self._head = self._place_head(self.chat.head(self.system_text()))
                    except ValueError as err:
                        raise EnvError(f"the instructions and the action list do not fit the window ({err}); "
                                       "raise --budget-tokens") from err
                self._observe(self.env.reset(), record)
            except EnvError as err:
                record.error, record.error_kind, stopped = str(err), "environment", f"error: {err}"
            self._finish(record)
            step = 0
            refused: set[str] = set()  # environment actions refused since the environment last changed
            while not stopped.startswith("error") and step < self.max_steps:
                step += 1
                record = self._begin(step)
                if hasattr(self.decider, "avoid"):
                    self.decider.avoid(refused)
                record.reply = self.decider.decide(self.window, self._prompt(notice))
                last = getattr(self.decider, "last", None)
                if isinstance(last, dict):
                    record.generated_tokens = last.get("generated_tokens")
                    record.tokens_after_close = last.get("tokens_after_close")
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
                        refused.clear()
                except MalformedAction as err:
                    record.error, record.error_kind = retry_message(err), "malformed"
                    notice = record.error
                except ActionError as err:
                    record.error, record.error_kind = str(err), "refused"
                    if record.action and record.action.get("action") in self.env.actions():
                        refused.add(record.action["action"])
                    notice = f"That action failed: {err}"
                except EnvError as err:
                    record.error, record.error_kind, stopped = str(err), "environment", f"error: {err}"
                self._finish(record)
                progress.step(record)
                if stopped == "answer":
                    break
        finally:
            progress.close()
        summary = summarize(self.records, env=self.env.name, model=str(getattr(self.window.km, "name", "?")),
                            task=self.task, stopped=stopped, answer=answer, window_tokens=self.window.tokens(),
                            budget_tokens=int(self.window.budget_tokens), wall_s=time.perf_counter() - t_start)
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
            missing = [c for c in ids if c not in before]
            if missing:
                self._bring_back(missing, record)
                record.event = "recall"
            else:
                record.event = "in-view"
        else:
            room = int(self.window.budget_tokens) - (self.window.chunk_tokens(self._head) if self._head is not None else 0)
            chunks, record.fitted = fit_observation(obs, self.window.km, room,
                                                    self.chat.part if self.chat is not None else None)
            ids = []
            for chunk in chunks:
                try:
                    ids.append(self._append(chunk))
                except ValueError as err:
                    raise EnvError(f"observation {obs.label!r} does not fit the window ({err}); raise "
                                   "--budget-tokens (or show less per observation: --max-chars for documents)") from err
            self._by_key[key] = ids
            for c in ids:
                self._chunk_step[c] = record.step
            record.event = "append"
            if self.keep_relevant and ids:
                self._keep_relevant(ids, record)
        record.chunks = list(ids)
        self._step_chunks[record.step] = list(ids)
        self._step_label[record.step] = obs.label
        self._step_meta[record.step] = obs.meta
        self._current = (record.step, obs.label)
        if hasattr(self.decider, "observe"):
            self.decider.observe(obs)

    def _bring_back(self, chunk_ids: list[int], record: StepRecord, before: list[int] | None = None) -> None:
        """Recall `chunk_ids` at the window's end, or just before the chunks `before`. Room for all
        of them is made first by the window's eviction policy (`Window.slide`), keeping `before`,
        the head and the other parts of the same observation; when those leave too little room,
        the other parts of the observation may go too."""
        protect = set(before or ()) | ({self._head} if self._head is not None else set())
        needed = sum(self._tokens.get(c, 0) for c in chunk_ids)
        try:
            self.window.slide(needed, keep=protect | set(self._by_key_of(chunk_ids[0])))
        except ValueError:
            self.window.slide(needed, keep=protect)  # raises, nothing evicted, when even that cannot fit
        for cid in chunk_ids:
            at = self.window.chunks().index(before[0]) if before else len(self.window.chunks())
            self.window.recall(cid, at=at, keep=protect | set(chunk_ids))
            self._present.add(cid)
        record.recalled_tokens += sum(self._tokens.get(c, 0) for c in chunk_ids)
        record.recalled = self._labels(chunk_ids)
        if self.fidelity_query:
            record.kl = kl_to_reference(self.window, self.fidelity_query)

    def _keep_relevant(self, current: list[int], record: StepRecord) -> None:
        """Recall the earlier observation closest to the task just before `current` (the chunks
        just appended) when it is out of view and both fit; see the module docstring."""
        steps = [s for s in self._first_steps() if s != record.step]
        step_of = {c: s for s in steps for c in self._step_chunks[s]}
        if not step_of:
            return
        best, score = self.window.nearest(self.task, k=1, among=list(step_of))[0]
        missing = [c for c in self._step_chunks[step_of[best]] if c not in self.window.chunks()]
        needed = sum(self.window.chunk_tokens(c) for c in missing + current)
        if missing and needed <= int(self.window.budget_tokens):
            self._bring_back(missing, record, before=current)
            record.kept = f"step {step_of[best]} ({self._step_label[step_of[best]]}), similarity {score:.2f}"

    def _by_key_of(self, chunk_id: int) -> list[int]:
        """The chunks of the observation that `chunk_id` belongs to."""
        step = self._chunk_step.get(chunk_id)
        return self._step_chunks.get(step, [chunk_id]) if step is not None else [chunk_id]

    def _append(self, chunk: Any) -> int:
        """Append one chunk; learn its token count from the window's totals (the chunks it
        evicted were appended here, so their counts are known)."""
        before, tokens = self.window.chunks(), self.window.tokens()
        cid = int(self.window.append(chunk))
        gone = [c for c in before if c not in self.window.chunks()]
        self._tokens[cid] = self.window.tokens() - tokens + sum(self._tokens.get(c, 0) for c in gone)
        self._present.add(cid)
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
        self._bring_back(missing, record)
        record.event = "recall"
        return f"Step {step} ({label}){how} is back in view."

    def _first_steps(self) -> list[int]:
        return [s for s in sorted(self._step_chunks) if self._step_chunks[s] and self._first_step_of(s) == s]

    def _retrieve(self, query: str) -> tuple[int, float]:
        """The observation whose chunks' key summaries are closest to the query's
        (`Window.nearest`: cosine per layer, averaged over layers); best chunk of each observation."""
        steps = self._first_steps()
        if not steps:
            raise ActionError("there is no earlier observation to recall")
        step_of = {c: step for step in steps for c in self._step_chunks[step]}
        try:
            ranked = self.window.nearest(query, k=len(step_of), among=list(step_of))
        except ValueError as err:
            raise ActionError(f"the recall query cannot be searched: {err}") from None
        chunk, score = ranked[0]
        return step_of[chunk], score

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

    # ---- prompt, records ----------------------------------------------------------------------

    def _place_head(self, head: Any) -> int:
        """The chat head pinned at the front: the window's own when it holds this very head (a
        second run of the same task on the same window), recalled when evicted, else appended."""
        found = self.window.find(head)
        if found is not None and found in self.window.chunks():
            self.window.pin(found)
            return int(found)
        if found is not None:
            self.window.recall(found, at=0)
            self.window.pin(found)
            return int(found)
        return int(self.window.append(head, pin=True))

    def system_text(self) -> str:
        """A chat window's pinned head: the instructions and the actions, which change neither
        during a run nor between tasks in the same kind of environment (the task itself is in
        each step's prompt), so every task's observations follow the same head: workers sharing a
        store reuse each other's KV for the same pages read in the same order."""
        return "\n".join([
            f"You are an agent working in {self.env.name}. The user shows you what you observe, one observation "
            "at a time, and asks for your next action towards a task.",
            "Reply with one JSON object naming an action and its arguments, for example "
            '{"action": "answer", "text": "..."}. Actions:',
            describe_actions(self.env.actions())])

    def _prompt(self, notice: str | None) -> str:
        in_view = set(self.window.chunks())
        out = [f"step {s} ({label})" for s, label in self._step_label.items()
               if not set(self._step_chunks[s]) & in_view and self._first_step_of(s) == s]
        if self.chat is not None:
            lines = [f"Task: {self.task}"]
            if out:
                lines.append("Out of view, recall by step: " + "; ".join(out[-8:]))
            if self._current is not None:
                lines.append(f"Current observation: step {self._current[0]} ({self._current[1]}).")
            if notice:
                lines.append(notice)
            lines.append("Your next action, as one JSON object:")
            return self.chat.question("\n".join(lines))
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

    def _begin(self, step: int) -> StepRecord:
        self._t0 = time.perf_counter()
        self._mark = _counters(self.window)
        self._present = set(self.window.chunks())
        return StepRecord(step=step)

    def _finish(self, record: StepRecord) -> None:
        """What the window did during the step, from its counters and chunks before and after."""
        counts, tokens = _counters(self.window)
        delta = {k: v - self._mark[0].get(k, 0) for k, v in counts.items()}
        record.evicted_chunks, record.recalled_chunks = delta["evictions"], delta["recalls"]
        record.store_hits = delta["canonical_hits"] + delta["exact_hits"]
        record.encoder_runs, record.encoder_reused = delta["encoder_calls"], delta["encoder_hits"]
        record.forward_tokens = {k: v - self._mark[1].get(k, 0) for k, v in tokens.items()
                                 if v - self._mark[1].get(k, 0)}
        now = set(self.window.chunks())
        record.evicted = self._labels(c for c in sorted(self._present) if c not in now)
        record.window_tokens = self.window.tokens()
        record.seconds = time.perf_counter() - self._t0
        self.records.append(record)
        if self.log_path is not None:
            with self.log_path.open("a") as fh:
                fh.write(json.dumps(asdict(record), default=repr) + "\n")
        if self.on_step is not None:
            self.on_step(record)


def _answer_text(action: dict[str, Any]) -> str:
    text = action.get("text", action.get("answer"))
    if text is None or (isinstance(text, str) and not text.strip()):
        raise MalformedAction('answer needs its "text", e.g. {"action": "answer", "text": "..."}')
    return str(text).strip()
