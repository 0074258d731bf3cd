"""A video as an agent environment: one observation per segment of frames, and retrieval of segments.

`VideoEnv(path)` cuts a video into segments of `segment_seconds`; each observation is one segment's
sampled frames (PIL, RGB) with their timestamps, labelled "video 00:12-00:16". Frame sampling and
frame size follow qwen-vl-utils' conventions (the Qwen-VL processors expect them):

- frames are sampled at `fps` (2.0) per segment, at least `min_frames_per_segment` (4) and at most
  `max_frames_per_segment`, never more than the segment has, and always an even count
  (FRAME_FACTOR 2; a one-frame tail segment repeats its frame), spread evenly over the segment;
- every frame is resized with `qwen_vl_utils.smart_resize`: sides multiples of `image_factor`
  (28 = 14-pixel patches merged 2×2; 32 for Qwen3-VL), pixel count within
  [`min_pixels`, `max_pixels`] (defaults 128 and 768 visual tokens of 28×28), aspect ratio kept.

Reading uses decord, or PyAV where decord cannot read the file. A missing file, a file that is not
a video, or an mp4 cut short before its index can be read raise `EnvError` saying what to do. A file
whose index survives but whose data is cut short (an mp4 written with its index first, then
truncated) yields its readable part: a `UserWarning` at open, `truncated` set, and each
observation's text says how much is readable.

Actions: next, seek {time} (seconds), segment {index} (0-based).

Retrieval of segments by a question is the window's (`Window.nearest`: mean canonical keys per
layer, as ReKV retrieves by, cosine averaged over layers); by time, the agent loop's step records.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
from PIL import Image

from agents.base import ActionError, EnvError, Observation
from agents.media import check_size, ImageTooLarge

# qwen-vl-utils' conventions (qwen_vl_utils.vision_process): sampling rate, frame-count factor,
# minimum frames, and per-frame pixel bounds in visual tokens of IMAGE_FACTOR² pixels.
FPS = 2.0
FRAME_FACTOR = 2
FPS_MIN_FRAMES = 4
IMAGE_FACTOR = 28
VIDEO_MIN_PIXELS = 128 * IMAGE_FACTOR * IMAGE_FACTOR
VIDEO_MAX_PIXELS = 768 * IMAGE_FACTOR * IMAGE_FACTOR
BACKENDS = ("auto", "decord", "pyav")


def _clock(t: float) -> str:
    """Seconds as "mm:ss" ("h:mm:ss" past an hour; a tenth when not whole)."""
    whole = abs(t - round(t)) < 1e-6
    s = round(t) if whole else t
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    sec_txt = f"{int(sec):02d}" if whole else f"{sec:04.1f}"
    return f"{int(h)}:{int(m):02d}:{sec_txt}" if h else f"{int(m):02d}:{sec_txt}"


class _Reader:
    """Frame access by index: `num_frames`, `fps`, `size` (width, height), `frames(indices)`."""

    name: str
    num_frames: int
    fps: float
    size: tuple[int, int]
    truncated: bool = False

    def frames(self, indices: list[int]) -> list[np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _native_stderr_captured() -> Any:
    """Within the block, what native code writes to file descriptor 2 goes to a temporary file
    (decord's C++ logger prints failures there itself; VideoEnv reports them in its own error)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class _DecordReader(_Reader):
    name = "decord"

    def __init__(self, path: str) -> None:
        import decord

        decord.logging.set_level(decord.logging.QUIET)  # failures are reported by VideoEnv
        with _native_stderr_captured():
            self._vr = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1)
        self.num_frames = len(self._vr)
        self.fps = float(self._vr.get_avg_fps())
        if self.num_frames <= 0 or not self.fps > 0:
            raise RuntimeError(f"{self.num_frames} frames at {self.fps} fps")
        last = self._vr.get_batch([self.num_frames - 1]).asnumpy()  # the whole file is readable
        self.size = (int(last.shape[2]), int(last.shape[1]))

    def frames(self, indices: list[int]) -> list[np.ndarray]:
        batch = self._vr.get_batch(list(indices)).asnumpy()
        return [batch[i] for i in range(batch.shape[0])]

    def close(self) -> None:
        self._vr = None


class _AvReader(_Reader):
    """PyAV: a demux pass lists the frames' timestamps (no decoding); frames are decoded from the
    keyframe before the first one asked for. A file cut short keeps the frames that decode."""

    name = "pyav"

    def __init__(self, path: str) -> None:
        import av

        self._av = av
        self._c = av.open(path)
        if not self._c.streams.video:
            self._c.close()
            raise RuntimeError("the file has no video stream")
        self._s = self._c.streams.video[0]
        self._s.thread_type = "AUTO"
        rate = self._s.average_rate or self._s.guessed_rate
        self.fps = float(rate) if rate else 0.0
        pts, keys, damaged = [], [], False
        try:
            for packet in self._c.demux(self._s):
                if packet.pts is None or packet.size == 0:
                    continue
                pts.append(int(packet.pts))
                if packet.is_keyframe:
                    keys.append(int(packet.pts))
        except av.error.FFmpegError:
            damaged = True
        if not pts or not self.fps > 0:
            self._c.close()
            raise RuntimeError("no video frames could be read")
        self._pts = sorted(set(pts))
        declared = int(self._s.frames or 0)
        readable = self._readable_end(sorted(set(keys)) or self._pts[:1])
        if readable == 0:
            self._c.close()
            raise RuntimeError("no video frame decodes")
        self._pts = self._pts[:readable]
        self.num_frames = readable
        self.truncated = damaged or readable < declared
        first = self.frames([0])[0]
        self.size = (int(first.shape[1]), int(first.shape[0]))

    def _decode_from(self, pts: int, until: int, want: set[int] | None = None) -> dict[int, Any]:
        """Decoded frames with pts in `want` (all when None) from the keyframe at or before `pts`
        up to pts `until`; stops at the first decoding error."""
        out: dict[int, Any] = {}
        try:
            self._c.seek(pts, backward=True, any_frame=False, stream=self._s)
            for frame in self._c.decode(self._s):
                if frame.pts is None:
                    continue
                if want is None or frame.pts in want:
                    out[int(frame.pts)] = frame
                if frame.pts >= until:
                    break
        except self._av.error.FFmpegError:
            pass
        return out

    def _readable_end(self, keyframes: list[int]) -> int:
        """How many frames (in presentation order) decode: the last group of pictures is decoded
        to find where a cut-short file stops; earlier groups are tried when it has none."""
        for key in reversed(keyframes[-4:]):
            got = self._decode_from(key, self._pts[-1])
            if got:
                last = max(got)
                return sum(1 for p in self._pts if p <= last)
        return 0

    def frames(self, indices: list[int]) -> list[np.ndarray]:
        wanted = sorted({self._pts[i] for i in indices})
        got = self._decode_from(wanted[0], wanted[-1], set(wanted))
        if not got:
            raise EnvError(f"frames {indices[0]}-{indices[-1]} no longer decode; the file may have changed")
        arrays = {p: f.to_ndarray(format="rgb24") for p, f in got.items()}
        out = []
        for i in indices:
            p = self._pts[i]
            if p not in arrays:  # a frame lost to an error mid-way: the nearest earlier one stands in
                p = max((q for q in arrays if q <= p), default=min(arrays))
            out.append(arrays[p])
        return out

    def close(self) -> None:
        self._c.close()


def _open_reader(path: str, backend: str) -> tuple[_Reader, list[str]]:
    order = {"auto": ("decord", "pyav"), "decord": ("decord",), "pyav": ("pyav",)}[backend]
    reasons: list[str] = []
    for name in order:
        try:
            return (_DecordReader(path) if name == "decord" else _AvReader(path)), reasons
        except ImportError as e:
            reasons.append(f"{name} is not installed ({e})")
        except Exception as e:  # the readers raise their libraries' own errors
            text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            text = re.sub(r"^\[[\d:]+\] \S+:\d+: (Error: )?", "", text)  # decord's log prefix
            reasons.append(f"{name}: {text[:200]}")
    raise EnvError(
        f"cannot read {path} as a video ({'; '.join(reasons)}). If it is a video, it is truncated or "
        f"damaged (an mp4 cut short loses its index, the moov atom, at its end): download it again "
        f"or re-encode what is left with ffmpeg (`ffmpeg -i in.mp4 -c:v libx264 out.mp4`)."
    )


class VideoEnv:
    """A video file, one observation per segment (see the module docstring).

    Raises `EnvError` at construction for a missing file, a file that is not a video, or one that
    cannot be read at all; warns (`UserWarning`) and serves the readable part of a truncated one."""

    name = "video"

    def __init__(self, path: str | os.PathLike, segment_seconds: float = 4.0, fps: float = FPS,
                 min_frames_per_segment: int = FPS_MIN_FRAMES, max_frames_per_segment: int = 16,
                 min_pixels: int = VIDEO_MIN_PIXELS, max_pixels: int = VIDEO_MAX_PIXELS,
                 image_factor: int = IMAGE_FACTOR, backend: str = "auto",
                 max_source_pixels: int | None = None, cache_segments: int = 4) -> None:
        if not segment_seconds > 0:
            raise ValueError(f"segment_seconds must be > 0, got {segment_seconds}")
        if not fps > 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        if max_frames_per_segment < FRAME_FACTOR or min_frames_per_segment < 1:
            raise ValueError(f"max_frames_per_segment must be >= {FRAME_FACTOR} and min_frames_per_segment >= 1")
        if not 0 < min_pixels <= max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.path = os.fspath(path)
        self.segment_seconds = float(segment_seconds)
        self.fps = float(fps)
        # qwen-vl-utils rounds the bounds to the frame factor: min up, max down.
        self.min_frames = FRAME_FACTOR * math.ceil(min_frames_per_segment / FRAME_FACTOR)
        self.max_frames = FRAME_FACTOR * (max_frames_per_segment // FRAME_FACTOR)
        self.min_pixels, self.max_pixels, self.image_factor = int(min_pixels), int(max_pixels), int(image_factor)
        if not os.path.exists(self.path):
            raise EnvError(f"video {self.path} does not exist; check the path")
        if os.path.isdir(self.path):
            raise EnvError(f"{self.path} is a directory; give a video file")
        if os.path.getsize(self.path) == 0:
            raise EnvError(f"video {self.path} is empty (0 bytes); download or copy it again")
        self._reader, self._reasons = _open_reader(self.path, backend)
        try:
            check_size(self._reader.size, max_source_pixels, self.path)
        except ImageTooLarge as e:
            self._reader.close()
            raise EnvError(f"{e} (the video's frames)") from None
        self.backend = self._reader.name
        self.video_fps = self._reader.fps
        self.num_frames = self._reader.num_frames
        self.duration = self.num_frames / self.video_fps
        self.truncated = self._reader.truncated
        if self.truncated:
            warnings.warn(f"{self.path} is truncated or damaged: only its first {self.duration:.1f} s "
                          f"({self.num_frames} frames) are readable and used", UserWarning, stacklevel=2)
        self.num_segments = max(1, math.ceil(self.duration / self.segment_seconds - 1e-9))
        from qwen_vl_utils import smart_resize  # imports torchvision: only when a video is opened

        w, h = self._reader.size
        rh, rw = smart_resize(h, w, factor=self.image_factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        self.frame_size = (int(rw), int(rh))  # (width, height) of every observed frame
        self.position = 0
        self._cache: OrderedDict[int, Observation] = OrderedDict()
        self._cache_size = max(0, int(cache_segments))

    # geometry ---------------------------------------------------------------------------------
    def span(self, index: int) -> tuple[float, float]:
        """(start, end) seconds of segment `index`."""
        self._check_index(index)
        return index * self.segment_seconds, min((index + 1) * self.segment_seconds, self.duration)

    def segment_at(self, time: float) -> int:
        """The segment holding second `time`; `ActionError` outside the video."""
        t = float(time)
        if not math.isfinite(t) or t < 0 or t > self.duration + 1e-9:
            raise ActionError(f"time {time} s is outside the video (0-{self.duration:.1f} s)")
        return min(int(t // self.segment_seconds), self.num_segments - 1)

    def frame_indices(self, index: int) -> list[int]:
        """The source frames sampled for segment `index` (qwen-vl-utils' rule, per segment)."""
        t0, t1 = self.span(index)
        first = min(math.ceil(t0 * self.video_fps - 1e-6), self.num_frames - 1)
        last = min(math.ceil(t1 * self.video_fps - 1e-6) - 1, self.num_frames - 1)
        last = max(last, first)
        count = last - first + 1
        n = min(max(count / self.video_fps * self.fps, self.min_frames), self.max_frames, count)
        n = max(FRAME_FACTOR, FRAME_FACTOR * int(n // FRAME_FACTOR))
        return [int(round(x)) for x in np.linspace(first, last, n)]

    def _check_index(self, index: Any) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise ActionError(f"segment index must be an integer, got {index!r}")
        if not 0 <= index < self.num_segments:
            raise ActionError(f"segment {index} does not exist; segments are 0-{self.num_segments - 1}")
        return int(index)

    # observations -----------------------------------------------------------------------------
    def observe(self, index: int) -> Observation:
        """Segment `index` as an observation, without moving the position."""
        index = self._check_index(index)
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        idx = self.frame_indices(index)
        arrays = self._reader.frames(idx)
        images = tuple(Image.fromarray(a).convert("RGB").resize(self.frame_size, Image.Resampling.BICUBIC)
                       for a in arrays)
        stamps = tuple(round(i / self.video_fps, 6) for i in idx)
        t0, t1 = self.span(index)
        label = f"video {_clock(t0)}-{_clock(t1)}"
        text = (f"Video {os.path.basename(self.path)}, segment {index + 1}/{self.num_segments} (index {index}): "
                f"{_clock(t0)}-{_clock(t1)} ({t1 - t0:.1f} s of {self.duration:.1f} s). "
                f"{len(images)} frames, {self.frame_size[0]}×{self.frame_size[1]} px, at "
                + ", ".join(f"{s:.1f}" for s in stamps) + " s. No captions or transcript: the frames are the content.")
        if self.truncated:
            text += f" The file is truncated: only its first {self.duration:.1f} s are readable."
        obs = Observation(label=label, text=text, images=images, timestamps=stamps,
                          meta={"path": self.path, "segment": index, "start": t0, "end": t1,
                                "frame_indices": idx, "backend": self.backend, "truncated": self.truncated})
        if self._cache_size:
            self._cache[index] = obs
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return obs

    def reset(self) -> Observation:
        self.position = 0
        return self.observe(0)

    def actions(self) -> dict[str, str]:
        return {
            "next": "{} - the next segment of the video",
            "seek": '{"time": SECONDS} - the segment holding that second',
            "segment": f'{{"index": N}} - segment N (0-based; 0-{self.num_segments - 1})',
        }

    def action_arguments(self) -> dict[str, dict[str, Any]]:
        """Argument schemas refining `actions()` for decoding under a schema (`agents.grammar`)."""
        return {"seek": {"time": {"type": "number", "minimum": 0, "maximum": round(self.duration, 3)}},
                "segment": {"index": {"type": "integer", "minimum": 0, "maximum": self.num_segments - 1}}}

    def act(self, action: dict[str, Any]) -> Observation:
        if not isinstance(action, dict) or "action" not in action:
            raise ActionError(f"an action is a JSON object with an \"action\" key, got {action!r}")
        kind = action["action"]
        if kind == "next":
            if self.position + 1 >= self.num_segments:
                raise ActionError(f"segment {self.position} is the last one (the video ends at "
                                  f"{_clock(self.duration)}); use seek or segment to go back")
            target = self.position + 1
        elif kind == "seek":
            if "time" not in action:
                raise ActionError('seek needs "time" in seconds, e.g. {"action": "seek", "time": 12}')
            try:
                t = float(action["time"])
            except (TypeError, ValueError):
                raise ActionError(f"seek time must be a number of seconds, got {action['time']!r}") from None
            target = self.segment_at(t)
        elif kind == "segment":
            if "index" not in action:
                raise ActionError('segment needs "index", e.g. {"action": "segment", "index": 2}')
            target = self._check_index(action["index"])
        else:
            raise ActionError(f"unknown action {kind!r}; the video actions are {', '.join(self.actions())}")
        obs = self.observe(target)
        self.position = target
        return obs

    def close(self) -> None:
        self._cache.clear()
        self._reader.close()

    def __enter__(self) -> "VideoEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
