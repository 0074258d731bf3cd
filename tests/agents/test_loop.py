"""The shared step loop end to end: a scripted model, the real PdfEnv on PDFs written by the test,
and a real window over a tiny Llama (exact patches) or the real SmolLM2."""

import json

import pytest
import torch

from agents.base import EnvError, Observation
from agents.doc import PdfEnv, write_text_pdf
from agents.loop import AgentLoop, kl_to_reference, observation_chunks
from agents.model import ScriptedDecider, ScriptExhausted, WindowDecider
from agentwin import KameraModel, Window
from tests.support import forward_growth, tolerance

PAGES = [
    "Harbour. The harbour master is Anja Roth. She keeps the tide log.",
    "Lighthouse. The keeper is Tobias Mertens; he repairs the fog horn.",
    "Ferry. Captain Lena Okafor sails the Grey Heron from the north pier.",
    "School. Pavel Ilic runs the school and plays the organ on Sundays.",
]
QUERY = "\nQuestion: who repairs the fog horn? Answer:"


@pytest.fixture(scope="module")
def tiny():
    return KameraModel.from_pretrained("tiny-llama-gqa")


@pytest.fixture
def pdf(tmp_path):
    return write_text_pdf(tmp_path / "island.pdf", PAGES)


def _page_tokens(km, env, page, chat=None):
    (chunk,) = observation_chunks(env.act({"action": "goto", "page": page}), km, chat)
    return int(km.tokenize(chunk.text).numel())


def _count_encodes(km, monkeypatch):
    calls = []
    original = km.encode
    monkeypatch.setattr(km, "encode", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


def test_revisited_page_is_recalled_without_encoding_and_exact(tiny, pdf, monkeypatch):
    with PdfEnv(pdf) as env:
        page1_tokens = _page_tokens(tiny, env, 1)
        budget = page1_tokens + _page_tokens(tiny, env, 2) + 5  # two pages fit, not three
        window = Window(tiny, budget_tokens=budget, patch="origin", rank=None)
        encodes = _count_encodes(tiny, monkeypatch)
        seen = []
        script = ScriptedDecider([{"action": "next"}, {"action": "next"}, {"action": "goto", "page": 1},
                                  {"action": "answer", "text": "Tobias Mertens"}])
        loop = AgentLoop(env, window, script, "Who repairs the fog horn?", max_steps=6,
                         fidelity_query=QUERY, on_step=lambda r: seen.append((r.step, len(encodes))))
        result = loop.run()
    records, summary = result.records, result.summary
    forwarded = dict(window.stats().forward_tokens)  # before the checks below run forwards of their own
    assert [r.event for r in records] == ["append", "append", "append", "recall", "answer"]
    assert records[2].evicted == ["step 0 (page 1/4)"]
    revisit = records[3]
    assert revisit.observation == "page 1/4" and revisit.recalled == ["step 0 (page 1/4)"]
    assert revisit.chunks == records[0].chunks  # the same chunk came back, no new one
    encodes_by_step = dict(seen)
    assert encodes_by_step[3] == encodes_by_step[2] == 3  # three pages encoded once each, none at the revisit
    assert summary.content_hits == 1 and summary.appended == 3 and summary.recalls == 1
    assert summary.evictions == 2 and summary.recalled_tokens == page1_tokens
    assert summary.stopped == "answer" and summary.answer == "Tobias Mertens" and summary.steps == 4
    # Exact patches: the window after the recall reads like a re-prefill of its token sequence.
    assert revisit.kl is not None and abs(revisit.kl) < 1e-4 and summary.kl_at_recalls == [revisit.kl]
    reused, reference = window.next_token_logprobs(QUERY), window.reference_logprobs(QUERY)
    assert float((reused - reference).abs().max()) < 1e-4
    assert window.input_ids().numel() == window.tokens() <= budget
    # Every count of the summary is the sum over the steps, and the steps agree with the window.
    stats = window.stats()
    assert [r.evicted_chunks for r in records] == [0, 0, 1, 1, 0] and summary.evictions == stats.evictions == 2
    assert summary.eviction_steps == [2, 3] and summary.recall_steps == [3]
    assert summary.recalls == stats.recalls == 1 and summary.store_hits == sum(r.store_hits for r in records)
    assert {k: v for k, v in summary.forward_tokens.items() if v} == {k: v for k, v in forwarded.items() if v}
    assert not hasattr(summary, "time_saved_s") and not hasattr(summary, "prefill_tokens_avoided")


def test_malformed_reply_gets_a_retry_message_then_the_loop_recovers(tiny, pdf):
    script = ScriptedDecider(["I would like to see the next page please.", "```json\n{'action': 'next',}\n```",
                              '{"action": "answer", "text": "Anja Roth"} because page 1 says so'])
    with PdfEnv(pdf) as env:
        result = AgentLoop(env, Window(tiny, budget_tokens=2000, rank=None), script, "Who keeps the tide log?",
                           max_steps=5).run()
    first, second, third = result.records[1:]
    assert first.action is None and "no JSON object in the reply" in first.error
    assert "Your last reply could not be used: no JSON object" in script.prompts[1]
    assert "could not be used" not in script.prompts[2]  # shown once, then cleared
    assert second.action == {"action": "next"} and second.observation == "page 2/4"
    assert third.event == "answer" and result.summary.answer == "Anja Roth"
    assert result.summary.malformed_replies == 1 and result.summary.stopped == "answer"


def test_step_limit_ends_a_run_without_an_answer(tiny, pdf):
    script = ScriptedDecider(lambda window, prompt: {"action": "next"})
    with PdfEnv(pdf) as env:
        result = AgentLoop(env, Window(tiny, budget_tokens=2000), script, "Read on.", max_steps=6).run()
    summary = result.summary
    assert summary.stopped == "step limit" and summary.answer is None and summary.steps == 6
    assert summary.refused_actions == 3  # pages 2..4, then three refusals at the last page
    assert "That action failed: already at the last page (4)" in script.prompts[-1]
    assert [r.observation for r in result.records[1:4]] == ["page 2/4", "page 3/4", "page 4/4"]


def test_recall_by_step_and_its_errors(tiny, pdf):
    script = ScriptedDecider([{"action": "next"}, {"action": "next"}, {"action": "recall", "step": 0},
                              {"action": "recall", "step": "2"}, {"action": "recall", "step": 9},
                              {"action": "recall", "step": "two"}, {"action": "answer", "text": "done"}])
    with PdfEnv(pdf) as env:
        budget = _page_tokens(tiny, env, 1) + _page_tokens(tiny, env, 2) + 5
        window = Window(tiny, budget_tokens=budget, patch="origin", rank=None)
        result = AgentLoop(env, window, script, "Find the captain.", max_steps=8, fidelity_query=QUERY).run()
    r = result.records
    assert "Out of view, recall by step: step 0 (page 1/4)" in script.prompts[2]
    assert r[3].event == "recall" and r[3].recalled == ["step 0 (page 1/4)"] and r[3].chunks == r[0].chunks
    assert "Step 0 (page 1/4) is back in view." in script.prompts[3]
    assert r[4].event == "in-view" and "Step 2 (page 3/4) is already in view." in script.prompts[4]
    assert "step 9 has no observation; steps with observations: 0, 1, 2" in r[5].error
    assert 'recall needs an integer "step"' in r[6].error
    assert result.summary.recalls == 1 and result.summary.content_hits == 0  # asked for, not seen again
    assert abs(result.summary.kl_at_recalls[0]) < 1e-4


def test_every_step_is_logged_as_jsonl(tiny, pdf, tmp_path):
    log = tmp_path / "run" / "steps.jsonl"
    script = ScriptedDecider([{"action": "search", "text": "organ"}, {"action": "goto", "page": 4},
                              {"action": "answer", "text": "Pavel Ilic"}])
    with PdfEnv(pdf) as env:
        result = AgentLoop(env, Window(tiny, budget_tokens=2000), script, "Who plays the organ?", log_path=log).run()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines[:-1]] == [0, 1, 2, 3]
    assert lines[1]["observation"] == "search 'organ'" and lines[2]["action"] == {"action": "goto", "page": 4}
    assert lines[-1]["summary"]["answer"] == "Pavel Ilic" and lines[-1]["summary"]["steps"] == 3
    assert json.loads(json.dumps(result.to_json()))["summary"]["appended"] == 3


def test_environment_failure_stops_the_run_with_its_message(tiny, pdf):
    class Broken(PdfEnv):
        def act(self, action):
            raise EnvError("the document went away; open it again")

    with Broken(pdf) as env:
        result = AgentLoop(env, Window(tiny, budget_tokens=2000), ScriptedDecider([{"action": "next"}]), "x").run()
    assert result.summary.stopped == "error: the document went away; open it again"
    assert result.summary.steps == 1 and result.records[1].error == "the document went away; open it again"


def test_an_observation_larger_than_the_budget_is_split_and_cut_and_the_run_goes_on(tiny, tmp_path):
    """A dense table-of-contents page (dot leaders) is far larger than the window: it is split into
    chunks of at most half the window, what does not fit is cut, the step record says so, and the
    run goes on to its answer (it used to stop with "chunk of N tokens exceeds budget_tokens")."""
    toc = "Contents\n" + "\n".join(f"{i}. Section {i} " + "." * 60 + f" {i * 3}" for i in range(1, 24))
    pdf = write_text_pdf(tmp_path / "manual.pdf", [toc, "The harbour master is Anja Roth. " * 5], width_chars=100)
    budget = 400
    with PdfEnv(pdf, max_chars=1500) as env:
        assert int(tiny.tokenize(env._observe(1).text).numel()) > 2 * budget
        window = Window(tiny, budget_tokens=budget, rank=None)
        script = ScriptedDecider([{"action": "next"}, {"action": "previous"}, {"action": "answer", "text": "Anja Roth"}])
        result = AgentLoop(env, window, script, "Who is the harbour master?", max_steps=4).run()
    first, page2, back = result.records[:3]
    assert result.summary.stopped == "answer" and first.event == "append" and len(first.chunks) == 2
    assert "split into 2 chunks" in first.fitted and "tokens of text cut to fit the window of 400" in first.fitted
    assert all(window.chunk_tokens(c) <= budget // 2 for c in first.chunks)
    assert page2.evicted == ["step 0 (page 1/2)"] and back.event == "recall"  # the page came back whole
    assert back.recalled_chunks == page2.evicted_chunks >= 1 and set(first.chunks) <= set(window.chunks())
    assert result.summary.fitted_observations == 1
    assert "1 observations split or cut to fit the window" in result.summary.table()


def test_an_exhausted_script_says_so(tiny, pdf):
    with PdfEnv(pdf) as env, pytest.raises(ScriptExhausted, match="has 1 replies and was asked for reply 2"):
        AgentLoop(env, Window(tiny, budget_tokens=2000), ScriptedDecider([{"action": "next"}]), "x").run()


def test_loop_checks_its_arguments(tiny, pdf):
    with PdfEnv(pdf) as env:
        window = Window(tiny, budget_tokens=100)
        with pytest.raises(TypeError, match="agents.base.Env"):
            AgentLoop(object(), window, ScriptedDecider([]), "x")
        with pytest.raises(ValueError, match="task"):
            AgentLoop(env, window, ScriptedDecider([]), "  ")
        with pytest.raises(ValueError, match="max_steps"):
            AgentLoop(env, window, ScriptedDecider([]), "x", max_steps=0)


def test_observation_chunks_by_model_kind(tiny):
    from PIL import Image as PILImage

    import agentwin

    frames = tuple(PILImage.new("RGB", (28, 28), (i * 40, 0, 0)) for i in range(2))
    obs = Observation("video 00:00-00:02", text="two frames", images=frames, timestamps=(0.0, 1.0))
    assert [c.text for c in observation_chunks(obs, tiny)] == ["\n[video 00:00-00:02]\ntwo frames\n"]

    class Vlm:
        is_vlm = True

    if hasattr(agentwin, "Image") and hasattr(agentwin, "Frames"):
        video = observation_chunks(obs, Vlm())
        assert [type(c).__name__ for c in video] == ["Frames", "Text"]
        shot = observation_chunks(Observation("page", text="t", images=frames[:1]), Vlm())
        assert [type(c).__name__ for c in shot] == ["Image", "Text"]
    else:
        with pytest.raises(EnvError, match="no image or frame chunks"):
            observation_chunks(obs, Vlm())


@pytest.mark.slow
def test_smollm2_revisit_is_exact_and_the_model_decides(smollm2, tmp_path):
    """The real SmolLM2: a scripted revisit is a recall within 1e-4 of a re-prefill (exact
    patches), then the model itself decides through the window."""
    model, tokenizer = smollm2
    km = KameraModel(model, tokenizer, name="smollm2")
    pdf = write_text_pdf(tmp_path / "island.pdf", PAGES[:3])
    # One thread, as `agentwin demo` runs: exact patches' small eigendecompositions crawl with two
    # threads on cores other processes share (the test suite's 2-core runner).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _smollm2_session(km, pdf)
    finally:
        torch.set_num_threads(threads)


def _smollm2_session(km, pdf):
    with PdfEnv(pdf) as env:
        # The chat window's pinned head (instructions, task, actions) plus two pages.
        probe = AgentLoop(env, Window(km), ScriptedDecider([]), "Who keeps the tide log?")
        head = len(km.tokenize(probe.chat.head(probe.system_text()).text))
        budget = head + _page_tokens(km, env, 1, probe.chat) + _page_tokens(km, env, 2, probe.chat) + 4
        window = Window(km, budget_tokens=budget, patch="origin", rank=None)
        script = ScriptedDecider([{"action": "next"}, {"action": "next"}, {"action": "goto", "page": 1},
                                  {"action": "answer", "text": "-"}])
        result = AgentLoop(env, window, script, "Who keeps the tide log?", fidelity_query=QUERY).run()
        assert [r.event for r in result.records] == ["append", "append", "append", "recall", "answer"]
        assert abs(result.records[3].kl) < 1e-4 and result.summary.content_hits == 1
        decider = WindowDecider(max_new_tokens=16)
        model_run = AgentLoop(env, window, decider, "Who keeps the tide log?", max_steps=2).run()
    replies = [r.reply for r in model_run.records[1:]]
    assert replies and all(r.startswith('{"action": "') for r in replies)  # the primed reply
    assert model_run.summary.stopped in ("answer", "step limit")
    for r in model_run.records[1:]:  # each reply became an action, or the model was told why not
        assert r.action is not None or r.error.startswith("Your last reply could not be used")


def test_recall_by_query_and_by_time(tiny, pdf):
    """By query: the observation whose key summary is closest (its own text scores 1.0); by time:
    the observation whose meta covers that second."""

    class Timed(PdfEnv):  # pages as 10-second spans, like video segments
        def _observe(self, page):
            obs = super()._observe(page)
            return Observation(obs.label, obs.text, meta={"start": 10.0 * (page - 1), "end": 10.0 * page})

    with Timed(pdf) as env:
        page1 = observation_chunks(env._observe(1), tiny)[0].text
        budget = _page_tokens(tiny, env, 1) + _page_tokens(tiny, env, 2) + 5
        script = ScriptedDecider([{"action": "next"}, {"action": "next"}, {"action": "recall", "query": page1},
                                  {"action": "next"}, {"action": "recall", "time": 15},
                                  {"action": "recall", "time": 99}, {"action": "recall"},
                                  {"action": "answer", "text": "x"}])
        result = AgentLoop(env, Window(tiny, budget_tokens=budget, rank=None), script, "x", max_steps=9).run()
    r = result.records
    assert r[3].event == "recall" and r[3].recalled == ["step 0 (page 1/4)"]
    assert "Step 0 (page 1/4) (closest to" in script.prompts[3] and "similarity 1.00) is back in view" in script.prompts[3]
    assert r[5].event == "recall" and r[5].recalled == ["step 1 (page 2/4)"]
    assert "no earlier observation covers 99 s" in r[6].error
    assert 'recall needs "step", "query" or "time"' in r[7].error
    assert result.summary.recalls == 2


def test_vlm_page_images_are_recalled_and_then_store_hits(tmp_path):
    """A vision-language model sees each page as an Image chunk plus its text. A revisited page
    runs no vision tower and no encode (recall), within 1e-4 of a re-prefill with exact patches;
    a second session on the same store encodes nothing at all (store hits, counted)."""
    import agentwin
    from agentwin.store import ChunkStore

    km = KameraModel.from_pretrained("tiny-qwen2.5-vl")
    assert km.is_vlm and hasattr(agentwin, "Image")
    pdf = write_text_pdf(tmp_path / "p.pdf", PAGES[:3])
    store = ChunkStore(tmp_path / "store", model_fingerprint=km.fingerprint)
    script = [{"action": "next"}, {"action": "next"}, {"action": "goto", "page": 1}, {"action": "answer", "text": "-"}]

    def session():
        window = Window(km, budget_tokens=200, patch="origin", rank=None, store=store)
        runs = []
        with PdfEnv(pdf, render=True, max_pixels=64 * 28 * 28) as env:
            result = AgentLoop(env, window, ScriptedDecider(script), "Who keeps the tide log?", fidelity_query=QUERY,
                               on_step=lambda r: runs.append(window.stats().encoder_calls)).run()
        return result, runs

    first, runs = session()
    r = first.records
    assert [type(c).__name__ for c in observation_chunks(PdfEnv(pdf, render=True)._observe(1), km)] == ["Image", "Text"]
    assert [x.event for x in r] == ["append", "append", "append", "recall", "answer"]
    assert len(r[0].chunks) == 2 and r[3].chunks == r[0].chunks
    assert runs[:3] == [1, 2, 3] and runs[3] == 3  # one tower run per new page, none at the revisit
    assert abs(r[3].kl) < 1e-4 and first.summary.content_hits == 1 and first.summary.encoder_calls == 3
    second, runs = session()
    # 3 pages x (image, text) at append, and the revisited page's two chunks read back at the
    # recall (an evicted chunk's KV lives in the store only)
    assert second.summary.encoder_calls == 0 and second.summary.store_hits == 8
    assert sum(r.store_hits for r in second.records) == 8 and second.records[3].store_hits == 2
    assert second.summary.answer == "-" and abs(second.records[3].kl) < 1e-4


def test_fidelity_check_sees_blind_reuse(tiny, pdf):
    """The KL at a recall is measured, not assumed: blind reuse (no patches) of the same revisit
    is visibly off a re-prefill, exact patches are not."""
    kls = {}
    for patch, rank in (("none", 16), ("origin", None)):
        with PdfEnv(pdf) as env:
            budget = _page_tokens(tiny, env, 1) + _page_tokens(tiny, env, 2) + 5
            window = Window(tiny, budget_tokens=budget, patch=patch, rank=rank)
            script = ScriptedDecider([{"action": "next"}, {"action": "next"}, {"action": "goto", "page": 1},
                                      {"action": "answer", "text": "-"}])
            result = AgentLoop(env, window, script, "x", fidelity_query=QUERY).run()
        kls[patch] = result.summary.kl_at_recalls[0]
        # Measured again on the same window: the two reads round differently (the second reuses
        # rows the first computed), each within δ of the exact log-probabilities, and the KL is
        # summed from float32 log-probabilities, so the two agree to first order, within 2·δ.
        logp = float(window.reference_logprobs(QUERY).abs().max())
        delta = tolerance(torch.float32, logp, forward_growth(tiny.model.config))
        assert kls[patch] == pytest.approx(kl_to_reference(window, QUERY), abs=2 * delta)
    assert abs(kls["origin"]) < 1e-4 and kls["none"] > 100 * max(abs(kls["origin"]), 1e-7)


def test_progress_off_a_terminal_is_one_plain_line_per_step(tiny, pdf, capsys):
    """stderr is not a terminal here (a log, a pipe): no bar redraws, no cursor moves."""
    script = ScriptedDecider([{"action": "next"}, {"action": "answer", "text": "x"}])
    with PdfEnv(pdf) as env:
        AgentLoop(env, Window(tiny, budget_tokens=2000), script, "x", max_steps=3, progress=True).run()
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b[" not in err
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("doc step 1/3: next -> page 2/4, window ")
    assert lines[1].startswith("doc step 2/3: answer, window ")


def test_summary_lines_are_sums_of_the_step_records():
    """Every count the summary prints comes from the steps: nothing is reported that no step
    shows, and no saving is claimed (there is no baseline in a run)."""
    from agents.records import StepRecord, summarize

    records = [StepRecord(0, event="append", forward_tokens={"encode": 40}),
               StepRecord(1, action={"action": "next"}, event="append", evicted=["step 0 (a)"], evicted_chunks=2,
                          encoder_runs=1, forward_tokens={"encode": 30, "in_context": 30, "query": 90, "decode": 3}),
               StepRecord(2, action={"action": "goto"}, event="recall", recalled=["step 0 (a)"], recalled_chunks=2,
                          recalled_tokens=40, store_hits=2, encoder_reused=1, forward_tokens={"query": 95}),
               StepRecord(3, action={"action": "fly"}, error="nope", error_kind="refused"),
               StepRecord(4, reply="??", error="Your last reply could not be used: x", error_kind="malformed")]
    s = summarize(records, env="doc", model="m", task="t", stopped="step limit", answer=None, window_tokens=70,
                  budget_tokens=100, wall_s=1.5)
    assert (s.evictions, s.eviction_steps, s.recalls, s.recall_steps) == (2, [1], 2, [2])
    assert (s.store_hits, s.encoder_calls, s.encoder_hits, s.recalled_tokens) == (2, 1, 1, 40)
    assert (s.content_hits, s.appended, s.observations, s.refused_actions, s.malformed_replies) == (1, 2, 3, 1, 1)
    assert s.forward_tokens["query"] == 185 and sum(s.forward_tokens.values()) == 288
    table = s.table()
    assert "2 chunks in step 1" in table and "2 chunks (40 tokens) in step 2" in table
    assert "encode 70, in_context 30, query 185, decode 3 (total 288)" in table
    assert "1 runs, 1 outputs read back" in table
    quiet = summarize(records[:1], env="doc", model="m", task="t", stopped="answer", answer="x", window_tokens=40,
                      budget_tokens=100, wall_s=0.1).table()
    assert "0 chunks\n" in quiet and "vision encoder" not in quiet
    for claim in ("saved", "avoided", "relocation", "prefill"):
        assert claim not in table and claim not in quiet


class _AvoidingScript(ScriptedDecider):
    """A scripted decider that records what the loop tells it to avoid before each decision."""

    def __init__(self, replies):
        super().__init__(replies)
        self.avoided = []

    def avoid(self, names):
        self.avoided.append(set(names))


def test_refused_actions_are_avoided_until_the_environment_changes(tiny, pdf):
    script = _AvoidingScript([{"action": "previous"}, {"action": "goto", "page": 9}, {"action": "next"},
                              {"action": "next"}, {"action": "answer", "text": "Tobias Mertens"}])
    with PdfEnv(pdf) as env:
        result = AgentLoop(env, Window(tiny, budget_tokens=2000), script, "Who repairs the fog horn?").run()
    assert [r.error_kind for r in result.records[1:]] == ["refused", "refused", None, None, None]
    # before each decision: nothing; then "previous" refused at page 1; then "goto" too; then
    # "next" succeeded (the page changed), so nothing is avoided any more
    assert script.avoided == [set(), {"previous"}, {"previous", "goto"}, set(), set()]


def test_window_decider_leaves_avoided_actions_out_of_its_schema(pdf):
    decider = WindowDecider()
    with PdfEnv(pdf) as env:
        decider.use_actions(env.actions(), env.action_arguments())
    names = lambda: {v["properties"]["action"]["const"] for v in decider.schema["anyOf"]}  # noqa: E731
    assert {"next", "previous", "goto", "search", "recall", "answer"} <= names()
    decider.avoid({"next", "goto"})
    assert "next" not in names() and "goto" not in names() and {"previous", "recall", "answer"} <= names()
    decider.avoid(set())
    assert "next" in names()
    decider.avoid({"next", "previous", "goto", "search"})  # never every environment action
    assert {"next", "previous", "goto", "search"} <= names()


def test_keep_relevant_recalls_the_observation_closest_to_the_task(tiny, pdf):
    """The task is page 1's own text, so page 1 is the closest observation: each
    time the budget pushes it out, it comes back just before the new page, and the task is encoded
    once for the whole run."""
    with PdfEnv(pdf) as env:
        task = observation_chunks(env._observe(1), tiny)[0].text
        budget = _page_tokens(tiny, env, 1) + _page_tokens(tiny, env, 2) + 5  # two pages fit, not three
    plan = [{"action": "next"}] * 3 + [{"action": "answer", "text": "x"}]
    runs = {}
    for keep in (False, True):
        with PdfEnv(pdf) as env:
            window = Window(tiny, budget_tokens=budget, rank=None)
            result = AgentLoop(env, window, ScriptedDecider(list(plan)), task, max_steps=6, fidelity_query=QUERY,
                               keep_relevant=keep).run()
        runs[keep] = (result, window)
    plain, (kept, window) = runs[False][0], runs[True]
    assert plain.summary.recalls == 0 and all(r.kept is None for r in plain.records)
    r = kept.records
    assert [x.observation for x in r[1:4]] == ["page 2/4", "page 3/4", "page 4/4"]
    assert r[1].kept is None  # page 1 still in view
    for step in (2, 3):
        assert r[step].kept.startswith("step 0 (page 1/4), similarity ")
        assert r[step].recalled == ["step 0 (page 1/4)"] and r[step].recalled_chunks == 1
        assert r[step].kl is not None and abs(r[step].kl) < 1e-4  # exact patches: reads like a re-prefill
    assert r[2].evicted == ["step 1 (page 2/4)"] and r[3].evicted == ["step 2 (page 3/4)"]
    assert window.chunks() == r[0].chunks + r[3].chunks  # page 1 just before the newest page
    assert window.tokens() <= budget
    summary = kept.summary
    assert summary.recalls == window.stats().recalls == 2 and summary.recall_steps == [2, 3]
    assert summary.forward_tokens.get("recall", 0) == 0  # a recall runs no forward
    once = Window(tiny, budget_tokens=budget, rank=None)
    once.append("x")
    once.nearest(kept.summary.task)
    assert summary.forward_tokens["retrieval"] == once.stats().forward_tokens["retrieval"]  # one encode of the task


def test_agent_commands_keep_the_relevant_observation_by_default():
    import argparse

    from tools.agents_cli import _doc_arguments

    parser = argparse.ArgumentParser()
    _doc_arguments(parser)
    assert parser.parse_args(["f.pdf", "--question", "q"]).keep_relevant is True
    assert parser.parse_args(["f.pdf", "--question", "q", "--no-keep-relevant"]).keep_relevant is False


def test_a_relevance_window_keeps_the_observation_like_the_task_in_view(tiny, pdf):
    """On a window that evicts by relevance the run targets its task: page 1 is the task's own
    text, so the budget drops the later pages and page 1 never leaves (FIFO drops it first)."""
    with PdfEnv(pdf) as env:
        task = observation_chunks(env._observe(1), tiny)[0].text
        budget = _page_tokens(tiny, env, 1) + _page_tokens(tiny, env, 2) + 5  # two pages fit, not three
    plan = [{"action": "next"}] * 3 + [{"action": "answer", "text": "x"}]
    runs, windows = {}, {}
    for evict in ("fifo", "relevant"):
        with PdfEnv(pdf) as env:
            window = Window(tiny, budget_tokens=budget, evict=evict)
            result = AgentLoop(env, window, ScriptedDecider(list(plan)), task, max_steps=6, chat=False,
                               keep_relevant=False).run()
        runs[evict] = result.records
        windows[evict] = window
    first = runs["relevant"][0].chunks[0]
    assert runs["fifo"][2].evicted == ["step 0 (page 1/4)"]
    assert all("step 0 (page 1/4)" not in (r.evicted or []) for r in runs["relevant"])
    assert runs["relevant"][2].evicted == ["step 1 (page 2/4)"] and runs["relevant"][3].evicted == ["step 2 (page 3/4)"]
    assert windows["relevant"].chunks() == [first, *runs["relevant"][3].chunks]  # page 1, then the newest page
    assert first not in windows["fifo"].chunks()
    assert all(r.recalled is None or r.recalled == [] for r in runs["relevant"])  # kept, never recalled


def test_agent_commands_take_the_eviction_policy():
    import argparse

    from tools.agents_cli import _doc_arguments

    parser = argparse.ArgumentParser()
    _doc_arguments(parser)
    assert parser.parse_args(["f.pdf", "--question", "q"]).evict == "fifo"
    assert parser.parse_args(["f.pdf", "--question", "q", "--evict", "relevant"]).evict == "relevant"
    with pytest.raises(SystemExit):
        parser.parse_args(["f.pdf", "--question", "q", "--evict", "random"])
