"""VideoEnv over mp4 files written here with PyAV (libx264), read by the real readers."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from agents.base import ActionError, Env, EnvError
from agents.video import VideoEnv

SECONDS, FPS, W, H = 12, 10, 64, 48
# One colour per second of video: a frame's colour tells which second it comes from.
PALETTE = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (200, 30, 200), (30, 200, 200),
           (120, 120, 120), (240, 140, 40), (40, 140, 240), (140, 40, 240), (240, 240, 240), (20, 20, 20)]


def _write_mp4(path, faststart: bool = False) -> None:
    import av

    rng = np.random.default_rng(0)
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as out:
        stream = out.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.options = {"g": str(FPS), "crf": "12"}  # a keyframe each second
        for i in range(SECONDS * FPS):
            # Faint noise keeps the frames' data larger than the file's index, as in real videos.
            pixels = np.clip(np.array(PALETTE[i // FPS]) + rng.integers(-6, 7, (H, W, 3)), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _second_of(image) -> int:
    """The second a frame comes from, by its mean colour's nearest palette entry."""
    mean = np.asarray(image, dtype=np.float64).reshape(-1, 3).mean(0)
    return int(np.argmin([np.sum((mean - np.array(c)) ** 2) for c in PALETTE]))


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    _write_mp4(d / "clip.mp4")
    _write_mp4(d / "faststart.mp4", faststart=True)
    for name in ("clip", "faststart"):
        data = (d / f"{name}.mp4").read_bytes()
        (d / f"{name}_half.mp4").write_bytes(data[: len(data) // 2])
    (d / "notes.mp4").write_text("meeting notes, not a video\n")
    return d


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_segments_timestamps_and_frames(videos, backend):
    env = VideoEnv(videos / "clip.mp4", backend=backend)
    assert isinstance(env, Env) and env.backend == backend
    assert (env.num_frames, env.video_fps, env.duration, env.num_segments) == (120, 10.0, 12.0, 3)
    for i in range(3):
        obs = env.observe(i)
        assert obs.label == f"video 00:{4 * i:02d}-00:{4 * i + 4:02d}"
        assert obs.meta["segment"] == i and (obs.meta["start"], obs.meta["end"]) == (4.0 * i, 4.0 * i + 4)
        # 4 s sampled at 2 fps: 8 frames (even), spread from the segment's first to its last frame
        assert len(obs.images) == len(obs.timestamps) == 8
        assert list(obs.timestamps) == sorted(obs.timestamps)
        assert obs.timestamps[0] == 4.0 * i and obs.timestamps[-1] == pytest.approx(4.0 * i + 3.9)
        assert all(4 * i <= t < 4 * i + 4 for t in obs.timestamps)
        assert [_second_of(im) for im in obs.images] == [int(t) for t in obs.timestamps]
        assert f"segment {i + 1}/3 (index {i})" in obs.text and "8 frames" in obs.text
    env.close()


def test_frames_are_resized_by_qwen_rules(videos):
    env = VideoEnv(videos / "clip.mp4")  # 64×48 is under the 128-token minimum: scaled up
    w, h = env.frame_size
    assert w % 28 == 0 and h % 28 == 0 and 128 * 28 * 28 <= w * h <= 768 * 28 * 28
    assert abs(w / h - W / H) <= 28 / h  # aspect ratio kept up to one grid cell
    assert all(im.size == (w, h) and im.mode == "RGB" for im in env.reset().images)
    # 64×48 rounds to 56×56 on the 28 grid, over 2800 px: scaled by 1/1.047, then floored to the grid
    small = VideoEnv(videos / "clip.mp4", min_pixels=28 * 28, max_pixels=2800)
    assert small.frame_size == (56, 28) and small.reset().images[0].size == (56, 28)
    qwen3 = VideoEnv(videos / "clip.mp4", image_factor=32, min_pixels=32 * 32, max_pixels=64 * 64 * 2)
    assert qwen3.frame_size == (64, 64)  # 64×48 rounds to 64×64 on a 32 grid, within the bounds
    for e in (env, small, qwen3):
        e.close()


@pytest.mark.parametrize("seconds, fps, max_frames, counts", [
    (5.0, 2.0, 16, [10, 10, 4]),   # last segment 2 s: 4 frames (qwen's minimum of 4)
    (1.0, 2.0, 16, [4] * 12),      # 2 frames by rate, raised to the minimum 4
    (12.0, 2.0, 6, [6]),           # 24 by rate, capped at 6
    (12.0, 0.5, 16, [6]),          # 6 by rate
    (3.5, 2.0, 16, [6, 6, 6, 4]),  # 7 by rate: floored to an even 6; the 1.5 s tail gets 4
])
def test_frame_counts_follow_the_sampling_rule(videos, seconds, fps, max_frames, counts):
    env = VideoEnv(videos / "clip.mp4", segment_seconds=seconds, fps=fps, max_frames_per_segment=max_frames,
                   min_pixels=28 * 28, max_pixels=4 * 28 * 28)
    assert env.num_segments == len(counts)
    got = [len(env.frame_indices(i)) for i in range(env.num_segments)]
    assert got == counts and all(n % 2 == 0 for n in got)
    last = env.observe(env.num_segments - 1)
    assert last.meta["end"] == 12.0 and all(last.meta["start"] <= t < 12.0 for t in last.timestamps)
    env.close()


def test_actions_next_seek_segment(videos):
    env = VideoEnv(videos / "clip.mp4", min_pixels=28 * 28, max_pixels=4 * 28 * 28)
    assert env.reset().label == "video 00:00-00:04"
    assert env.act({"action": "next"}).label == "video 00:04-00:08"
    obs = env.act({"action": "seek", "time": 9.5})
    assert obs.label == "video 00:08-00:12" and _second_of(obs.images[3]) >= 8
    with pytest.raises(ActionError, match="last one"):
        env.act({"action": "next"})
    assert env.act({"action": "segment", "index": 1}).label == "video 00:04-00:08"
    assert env.act({"action": "seek", "time": "2"}).label == "video 00:00-00:04"
    with pytest.raises(ActionError, match=r"outside the video \(0-12.0 s\)"):
        env.act({"action": "seek", "time": 99})
    with pytest.raises(ActionError, match="segments are 0-2"):
        env.act({"action": "segment", "index": 7})
    with pytest.raises(ActionError, match="unknown action"):
        env.act({"action": "rewind"})
    assert env.position == 0  # failed actions leave the position alone
    assert env.observe(1).content_key() == env.observe(1).content_key()  # same segment, same key
    assert env.observe(1).content_key() != env.observe(2).content_key()
    env.close()


def test_bad_files_give_env_errors(videos, tmp_path):
    with pytest.raises(EnvError, match="does not exist"):
        VideoEnv(tmp_path / "missing.mp4")
    with pytest.raises(EnvError, match=r"cannot read .*notes\.mp4 as a video"):
        VideoEnv(videos / "notes.mp4")
    # An mp4 cut short before its index (the moov atom, written last): nothing can be read.
    with pytest.raises(EnvError, match=r"truncated or damaged.*ffmpeg"):
        VideoEnv(videos / "clip_half.mp4")
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(EnvError, match="empty"):
        VideoEnv(tmp_path / "empty.mp4")


def test_truncated_file_with_its_index_serves_the_readable_part(videos):
    with pytest.warns(UserWarning, match=r"truncated or damaged: only its first \d+\.\d s"):
        env = VideoEnv(videos / "faststart_half.mp4", min_pixels=28 * 28, max_pixels=4 * 28 * 28)
    assert env.truncated and env.backend == "pyav"  # decord refuses the file; PyAV reads what is there
    assert 1.0 <= env.duration < SECONDS and env.num_segments == math.ceil(env.duration / 4)
    for i in range(env.num_segments):
        obs = env.observe(i)
        assert "truncated" in obs.text and len(obs.images) % 2 == 0
        assert [_second_of(im) for im in obs.images] == [int(t) for t in obs.timestamps]
        assert obs.timestamps[-1] < env.duration
    with pytest.raises(ActionError, match="outside the video"):
        env.act({"action": "seek", "time": 11})
    env.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole file: no warning
        assert not VideoEnv(videos / "faststart.mp4", backend="pyav").truncated

