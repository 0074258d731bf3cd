"""`agentwin bench recall --quick` end to end (small random-init models; the full run on SmolLM2
and the Qwen2.5-VL-3B-sized model is `agentwin bench recall --json FILE`)."""

import json
import math

import pytest

from tools import bench_recall as br
from tools.cli import main

FIELDS = ("speedup_vs_reprefill", "patch_overhead_vs_blind", "segment_tokens", "window_tokens", "model",
          "recall_seconds", "blind_recall_seconds", "reprefill_seconds", "kl_vs_reprefill", "first_token_same")


def test_quick_run_writes_every_field_and_recall_beats_reprefill(tmp_path, capsys):
    out = tmp_path / "recall.json"
    assert main(["bench", "recall", "--quick", "--repeats", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["workloads"]) == {"text", "video"}
    assert data["quick"] is True and data["repeats"] == 2 and data["threads"] == 1
    for name, r in data["workloads"].items():
        for field in FIELDS:
            assert field in r, (name, field)
        assert 0 < r["segment_tokens"] < r["window_tokens"]
        assert len(r["recall_seconds"]) == len(r["blind_recall_seconds"]) == len(r["reprefill_seconds"]) == 2
        # The figures are the medians of the raw times, not typed in.
        assert r["speedup_vs_reprefill"] == pytest.approx(r["reprefill_seconds_median"] / r["recall_seconds_median"])
        assert r["patch_overhead_vs_blind"] == pytest.approx(r["recall_seconds_median"] / r["blind_recall_seconds_median"])
        assert r["recall_seconds_median"] < r["reprefill_seconds_median"], name
        assert r["speedup_vs_reprefill"] > 1.0 and r["patch_overhead_vs_blind"] > 0
        assert all(math.isfinite(v) and v >= -1e-9 for v in r["kl_vs_reprefill"].values())
        # Rank-16 origin patches on the segment's own antecedent are closer to re-prefill than blind reuse.
        assert r["kl_vs_reprefill"]["origin"] < r["kl_vs_reprefill"]["blind"], name
        assert r["meets_target"] is False  # quick segments are under 4096 tokens
    assert data["workloads"]["video"]["frames"] == 16
    printed = capsys.readouterr().out
    assert "re-prefill" in printed and "speedup" in printed


def test_qwen25vl_config_has_the_3b_dimensions():
    config = br.qwen25vl_3b_config(4, 4)
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
    frames = br.make_frames(4, 56, 28)
    assert len(frames) == 4 and frames[0].shape == (28, 56, 3) and str(frames[0].dtype) == "uint8"
    assert (frames[0] != frames[1]).any()


@pytest.mark.parametrize("argv, message", [(["--repeats", "0"], "--repeats"), (["--frames", "1"], "--frames"),
                                           (["--workloads", "audio"], "--workloads")])
def test_bad_arguments_are_refused(argv, message, capsys):
    assert main(["bench", "recall", *argv]) == 2
    assert message in capsys.readouterr().err
