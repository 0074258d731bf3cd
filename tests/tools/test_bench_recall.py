"""`agentwin bench recall`: the page is the JSON's figures, every forward is accounted for, and the
cached-vision baseline runs no vision tower yet gives the plain re-prefill's logits. The full run
on SmolLM2 and the Qwen2.5-VL-3B-sized model is `agentwin bench recall --json FILE`."""

import json
import statistics

import pytest
import torch

from agentwin.content import Frames, Image
from tools.bench import recall, recall_page
from tools.bench.runs import vision_tower
from agentwin.models.adapter import KameraModel
from agentwin.window import Window
from tools.cli import main


def _log(_: str) -> None:
    pass


class RawHook:
    """Forward pre-hooks of the test's own: tokens of every top-level forward, vision-tower runs."""

    def __init__(self, model):
        self.tokens = self.forwards = self.vision = 0
        self.handles = [model.register_forward_pre_hook(self._forward, with_kwargs=True)]
        if vision_tower(model) is not None:
            self.handles.append(vision_tower(model).register_forward_pre_hook(self._vision))

    def _forward(self, module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.tokens += ids.shape[-1]
        self.forwards += 1

    def _vision(self, module, args):
        self.vision += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def _accounted(result, repeats):
    works = [result["setup"]["appends"]]
    for side in result["sides"].values():
        works += [side["work"]] * repeats + [side.get("untimed_work")] * repeats * ("untimed_work" in side)
    return (sum(sum(w["forwarded_tokens"].values()) for w in works), sum(sum(w["forwards"].values()) for w in works),
            sum(w["encoder_calls"] for w in works))


def test_quick_run_writes_the_page_from_its_json(tmp_path, capsys):
    out = tmp_path / "recall.json"
    assert main(["bench", "recall", "--quick", "--repeats", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    page = (tmp_path / "RECALL.md").read_text()
    assert page == recall_page.render(data)
    assert data["command"] == f"agentwin bench recall --json {out} --quick --repeats 2"
    assert f"Written by `{data['command']}`" in page.splitlines()[2]
    assert " / ".join(f"{x:.2f}" for x in data["load_average_start"]) in page
    assert " / ".join(f"{x:.2f}" for x in data["load_average_end"]) in page
    assert set(data["workloads"]) == {"text", "video"} and data["threads"] == 1
    for name, w in data["workloads"].items():
        assert set(w["sides"]) == ({"origin", "blind", "reprefill"} | ({"reprefill_cached_vision"} if name == "video" else set()))
        for side, s in w["sides"].items():
            assert len(s["runs"]) == 2
            assert s["min_s"] == min(s["runs"]) and s["median_s"] == statistics.median(s["runs"])
            row = f"| {name} | {recall_page.label(side, 16)} | {recall_page.seconds(s['min_s'])} | " \
                  f"{recall_page.seconds(s['median_s'])} |"
            assert row in page, row
        for key, r in w["ratios"].items():
            base, side = key.split("/")
            assert r["min"] == pytest.approx(w["sides"][base]["min_s"] / w["sides"][side]["min_s"])
            assert r["median"] == pytest.approx(w["sides"][base]["median_s"] / w["sides"][side]["median_s"])
            if base.startswith("reprefill"):
                assert f"{recall_page.ratio(r['min'])} / {recall_page.ratio(r['median'])}" in page
        q = w["query_tokens"]
        for side in ("origin", "blind"):
            work = w["sides"][side]["work"]
            assert work["forwarded_tokens"] == {"query": q} and work["encoder_calls"] == 0
            assert work["relocated_tokens"] >= w["segment_tokens"]
            assert f"| {recall_page.by_kind(work['forwarded_tokens'])} |" in page
        assert w["sides"]["reprefill"]["work"]["forwarded_tokens"] == {"prefill": w["window_tokens"] + q}
        assert w["sides"]["reprefill"]["work"]["encoder_calls"] == (1 if name == "video" else 0)
        hooks = w["hooks"]
        assert _accounted(w, 2) == (hooks["tokens"], hooks["forwards"], hooks["vision_runs"])
        assert w["sides"]["origin"]["kl_vs_reprefill"] < w["sides"]["blind"]["kl_vs_reprefill"], name
    cached = data["workloads"]["video"]["sides"]["reprefill_cached_vision"]
    assert cached["work"]["encoder_calls"] == 0 and cached["first_token_same"]
    assert cached["work"]["forwarded_tokens"] == data["workloads"]["video"]["sides"]["reprefill"]["work"]["forwarded_tokens"]
    assert "avoided" not in page and "saved" not in page
    assert "re-prefill" in capsys.readouterr().out


def _tiny_workloads():
    text = KameraModel.from_pretrained("tiny-llama-gqa")
    words = "the tide log was kept in the cabinet by the harbour master of the town "
    yield recall.Workload("text", text, "tiny", ["Anja Roth keeps the log.", " " + words * 4, " Tobias came.",
                                                 " The ferry left."], 1, " Who?")
    vl = KameraModel.from_pretrained("tiny-qwen2.5-vl")
    yield recall.Workload("video", vl, "tiny", recall.video_contents(recall.frames_segment(vl, 4, 8)), 1, " What?")


@pytest.mark.parametrize("index", [0, 1])
def test_recorded_work_equals_what_a_hook_on_the_model_sees(index):
    wl = list(_tiny_workloads())[index]
    hook = RawHook(wl.km.model)
    try:
        result = recall.measure(wl, 2, 4, _log)
    finally:
        hook.remove()
    assert _accounted(result, 2) == (hook.tokens, hook.forwards, hook.vision)
    assert (hook.vision > 0) == (wl.name == "video")
    # Each recall read forwards only the query; each re-prefill the whole window and the query.
    assert result["sides"]["origin"]["work"]["forwarded_tokens"] == {"query": result["query_tokens"]}
    assert result["sides"]["reprefill"]["work"]["forwarded_tokens"] == \
        {"prefill": result["window_tokens"] + result["query_tokens"]}


def test_cached_vision_reprefill_runs_no_vision_tower_and_matches_the_reprefill():
    km = KameraModel.from_pretrained("tiny-qwen2.5-vl")
    g = torch.Generator().manual_seed(0)
    pictures = [torch.randint(0, 256, (56, 84, 3), generator=g, dtype=torch.uint8).numpy() for _ in range(2)]
    contents = ["A shelf.", Image(pictures[0]), " then", Image(pictures[1]), " and a clip:",
                recall.frames_segment(km, 4, 8), " end."]
    win = Window(km, budget_tokens=1 << 16, rank=None)
    for c in contents:
        win.append(c)
    win.materialize()  # the window's passes run the tower once per image and clip
    parts = recall.window_parts(km, contents, " What changed?")
    plain = km.reference_inputs(parts)
    assert torch.equal(plain["input_ids"], win.reference_inputs(" What changed?")["input_ids"])
    cached = recall.cached_vision_inputs(km, parts, recall.encoder_cache_features(win))
    assert "pixel_values" not in cached and "pixel_values_videos" not in cached
    assert set(cached["mm_encoder_outputs"]) == {"image", "video"}
    hook = RawHook(km.model)
    try:
        ref = recall.reprefill_logits(km, plain)
        assert hook.vision == 2  # the plain re-prefill runs the tower (images, then the video)
        logits = recall.reprefill_logits(km, cached)
        assert hook.vision == 2  # ... the cached one does not
    finally:
        hook.remove()
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    # Only the window's cache serves it: a chunk it never saw is refused, not encoded.
    other = Window(km, budget_tokens=1 << 16, rank=None)
    with pytest.raises(RuntimeError, match="encoder cache"):
        recall.cached_vision_inputs(km, parts, recall.encoder_cache_features(other))


def test_qwen25vl_config_has_the_3b_dimensions():
    config = recall.qwen25vl_3b_config(4, 4)
    text, vision = config.get_text_config(), config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_attention_heads, text.num_key_value_heads,
            text.vocab_size, text.num_hidden_layers) == (2048, 11008, 16, 2, 151936, 4)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.rope_parameters["rope_theta"] == 1e6
    assert (vision.hidden_size, vision.out_hidden_size, vision.intermediate_size, vision.num_heads, vision.patch_size,
            vision.temporal_patch_size, vision.spatial_merge_size, vision.window_size, vision.depth) == \
        (1280, 2048, 3420, 16, 14, 2, 2, 112, 4)
    assert vision.fullatt_block_indexes == [3]
    assert (config.vision_start_token_id, config.vision_end_token_id, config.image_token_id, config.video_token_id) == \
        (151652, 151653, 151655, 151656)


def test_frames_are_generated_and_differ():
    frames = recall.make_frames(4, 56, 28)
    assert len(frames) == 4 and frames[0].shape == (28, 56, 3) and str(frames[0].dtype) == "uint8"
    assert (frames[0] != frames[1]).any()
    assert isinstance(recall.frames_segment(KameraModel.from_pretrained("tiny-qwen2.5-vl"), 4, 8), Frames)


@pytest.mark.parametrize("argv, message", [(["--repeats", "0"], "--repeats"), (["--frames", "1"], "--frames"),
                                           (["--workloads", "audio"], "--workloads")])
def test_bad_arguments_are_refused(argv, message, capsys):
    assert main(["bench", "recall", *argv]) == 2
    assert message in capsys.readouterr().err
