"""Image and frame chunks for the Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each the self-contained token
block the model's processor would write for one image or frame run, its pixels resized the qwen-vl-utils way and
processed by the model's own processor, its chunk-local M-RoPE positions and span from the model's `get_rope_index`."""

from __future__ import annotations

import functools
import hashlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
MAX_SOURCE_PIXELS = 100_000_000  # images are decoded only below this (about 10000 x 10000)


class VisionInputError(ValueError):
    """An image or frame source that cannot be used; the message says why and what to do."""


@dataclass(frozen=True, eq=False)
class TextChunk:
    """Token ids `[T]` of one text chunk: one position per token, no pixels."""

    ids: torch.Tensor
    kind = "text"

    def __post_init__(self) -> None:
        if not isinstance(self.ids, torch.Tensor) or self.ids.dim() != 1 or self.ids.is_floating_point():
            raise TypeError(f"TextChunk needs 1-D integer token ids, got {getattr(self.ids, 'shape', type(self.ids))}")

    @property
    def span(self) -> int:
        return int(self.ids.shape[0])

    @property
    def mm_type(self) -> torch.Tensor:
        return torch.zeros(self.span, dtype=torch.int32)

    def placed_positions(self, start: int, vlm: bool) -> torch.Tensor:
        """Positions of the chunk placed at `start`: `[1, T]`, or `[3, 1, T]` on an M-RoPE model."""
        positions = torch.arange(start, start + self.span)[None]
        return positions.expand(3, 1, -1) if vlm else positions


@dataclass(frozen=True)
class VisionChunk:
    """Token ids, pixels and chunk-local M-RoPE positions of one image or frame run."""

    kind: str  # "image" | "video"
    ids: torch.Tensor  # [T] int64
    mm_type: torch.Tensor  # [T] int32: 0 text, 1 image, 2 video
    pixels: torch.Tensor  # pixel_values / pixel_values_videos of the processor
    grid_thw: torch.Tensor  # [1, 3] int64
    positions: torch.Tensor  # [3, T] int64, chunk-local (start 0)
    span: int  # position units taken: the next chunk starts this far after this one's start
    second_per_grid: float | None = None  # video on Qwen2.5-VL
    settings: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of what fixes the chunk's canonical KV (cached: it keys the chunk and its vision-tower outputs)."""
        h = hashlib.sha256()
        for t in (self.ids, self.grid_thw, self.pixels):
            h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
            h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        h.update(repr((self.kind, self.second_per_grid, sorted(self.settings.items()))).encode())
        return h.hexdigest()

    def placed_positions(self, start: int, vlm: bool = True) -> torch.Tensor:
        """`[3, 1, T]` M-RoPE positions of the chunk placed at `start` (position units)."""
        return (self.positions + start)[:, None]

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The processor-style kwargs of this chunk for the model's own forward."""
        if self.kind == "image":
            return {"pixel_values": self.pixels, "image_grid_thw": self.grid_thw}
        out = {"pixel_values_videos": self.pixels, "video_grid_thw": self.grid_thw}
        if self.second_per_grid is not None:
            out["second_per_grid_ts"] = torch.tensor([self.second_per_grid])
        return out


def is_qwen_vl(config: Any) -> bool:
    return getattr(config, "model_type", None) in QWEN_VL


def load_image(source: Any) -> Any:
    """A PIL RGB image from a PIL image, path, encoded bytes or `[H, W, 3]` uint8 array. VisionInputError for a missing,
    unreadable, empty or over-`MAX_SOURCE_PIXELS` image (checked before decoding); TypeError for another source type."""
    from PIL import Image as PILImage

    if isinstance(source, PILImage.Image):
        image = source
    elif isinstance(source, (str, os.PathLike, bytes, bytearray)):
        what = f"image file {str(source)!r}" if not isinstance(source, (bytes, bytearray)) else "image bytes"
        if not isinstance(source, (bytes, bytearray)) and not Path(source).is_file():
            raise VisionInputError(f"{what} does not exist")
        try:
            image = PILImage.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
        except PILImage.DecompressionBombError as e:
            raise VisionInputError(f"{what} is too large to decode safely ({e}); downscale it first") from None
        except Exception as e:  # PIL raises several types for undecodable data
            raise VisionInputError(f"{what} is not a readable image ({type(e).__name__}: {e})") from None
    elif hasattr(source, "shape") and hasattr(source, "dtype"):
        import numpy as np

        array = source.numpy() if isinstance(source, torch.Tensor) else np.asarray(source)
        if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
            raise VisionInputError(f"an image array must be [H, W, 3] uint8, got {tuple(array.shape)} {array.dtype}")
        image = PILImage.fromarray(array)
    else:
        raise TypeError(f"an image must be a PIL image, a path, bytes or an [H, W, 3] uint8 array, got {type(source).__name__}")
    width, height = image.size
    if width * height > MAX_SOURCE_PIXELS:
        raise VisionInputError(f"image of {width}x{height} pixels is over the {MAX_SOURCE_PIXELS:,}-pixel limit; "
                               "downscale it before adding it to the window")
    if width < 1 or height < 1:
        raise VisionInputError(f"image of {width}x{height} pixels is empty")
    try:
        return image.convert("RGB")
    except Exception as e:
        raise VisionInputError(f"image could not be decoded ({type(e).__name__}: {e}); the file may be truncated") from None


class VisionPreparer:
    """Builds `VisionChunk`s for one Qwen-VL model (its processor, or one made from its config)."""

    def __init__(self, model: Any, tokenize: Any, processor: Any = None) -> None:
        config = model.config
        if not is_qwen_vl(config):
            raise ValueError(f"{config.model_type}: image and frame chunks need a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model")
        self.model, self.config, self.tokenize = model, config, tokenize
        vision = config.vision_config
        self.patch, self.merge, self.temporal = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
        self.factor = self.patch * self.merge
        self.qwen3 = config.model_type == "qwen3_vl"
        self.image_processor, self.video_processor = self._processors(processor)

    def _processors(self, processor: Any) -> tuple[Any, Any]:
        if processor is not None and hasattr(processor, "image_processor"):
            return processor.image_processor, getattr(processor, "video_processor", None)
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        kw: dict[str, Any] = dict(patch_size=self.patch, temporal_patch_size=self.temporal, merge_size=self.merge)
        if self.qwen3:
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

            half = [0.5, 0.5, 0.5]
            return Qwen2VLImageProcessor(**kw, image_mean=half, image_std=half), Qwen3VLVideoProcessor(**kw)
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        return Qwen2VLImageProcessor(**kw), Qwen2VLVideoProcessor(**kw)

    def _size(self, width: int, height: int, min_tokens: int, max_tokens: int) -> tuple[int, int]:
        from qwen_vl_utils.vision_process import smart_resize

        f2 = self.factor * self.factor
        try:
            h, w = smart_resize(height, width, self.factor, min_pixels=min_tokens * f2, max_pixels=max_tokens * f2)
        except ValueError as e:  # extreme aspect ratios
            raise VisionInputError(f"image of {width}x{height} cannot be resized for the model: {e}") from None
        return w, h

    def image(self, source: Any, min_tokens: int = 4, max_tokens: int = 1024) -> VisionChunk:
        image = load_image(source)
        w, h = self._size(*image.size, min_tokens, max_tokens)
        image = image.resize((w, h), resample=3) if (w, h) != image.size else image
        out = self.image_processor(images=[image], do_resize=False, return_tensors="pt")
        grid = out["image_grid_thw"].long()
        n = int(grid.prod()) // self.merge ** 2
        c = self.config
        ids = torch.tensor([c.vision_start_token_id] + [c.image_token_id] * n + [c.vision_end_token_id])
        mm_type = (ids == c.image_token_id).to(torch.int32)
        settings = {"size": [w, h], "min_tokens": min_tokens, "max_tokens": max_tokens}
        return self._finish("image", ids, mm_type, out["pixel_values"], grid, None, settings)

    def frames(self, frames: Sequence[Any], timestamps: Sequence[float] | None = None, fps: float = 2.0,
               min_tokens: int = 128, max_tokens: int = 768) -> VisionChunk:
        """A run of frames (sampled by the caller) as one chunk; `timestamps` in seconds (default i / fps); each frame
        resized to the first one's budgeted size. VisionInputError for empty frames, bad fps or timestamps."""
        import numpy as np

        if isinstance(frames, (str, bytes)) or not isinstance(frames, Sequence) or not frames:
            raise VisionInputError("frames must be a non-empty sequence of images")
        if not (isinstance(fps, (int, float)) and fps > 0):
            raise VisionInputError(f"fps must be a positive number, got {fps!r}")
        images = [load_image(f) for f in frames]
        stamps = [i / fps for i in range(len(images))] if timestamps is None else [float(t) for t in timestamps]
        if len(stamps) != len(images):
            raise VisionInputError(f"{len(stamps)} timestamps for {len(images)} frames")
        if any(b < a for a, b in zip(stamps, stamps[1:])):
            raise VisionInputError("frame timestamps must not decrease")
        while len(images) % self.temporal:  # qwen-vl-utils: a whole number of temporal patches
            images.append(images[-1])
            stamps.append(stamps[-1])
        w, h = self._size(*images[0].size, min_tokens, max_tokens)
        video = np.stack([np.asarray(im.resize((w, h), resample=3) if im.size != (w, h) else im) for im in images])
        out = self.video_processor(videos=[video], do_resize=False, do_sample_frames=False, cap_pixels_per_frame=False,
                                   return_tensors="pt")
        grid = out["video_grid_thw"].long()
        per_frame = int(grid[0, 1] * grid[0, 2]) // self.merge ** 2
        c = self.config
        block = [c.vision_start_token_id] + [c.video_token_id] * per_frame + [c.vision_end_token_id]
        interval = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1) if len(stamps) > 1 else 1.0 / fps
        if self.qwen3:
            ids: list[int] = []
            for i in range(int(grid[0, 0])):
                pair = stamps[i * self.temporal:(i + 1) * self.temporal]
                ids += self.tokenize(f"<{(pair[0] + pair[-1]) / 2:.1f} seconds>").tolist() + block
            second = None
        else:
            ids = [c.vision_start_token_id] + [c.video_token_id] * (per_frame * int(grid[0, 0])) + [c.vision_end_token_id]
            second = self.temporal * (interval if interval > 0 else 1.0 / fps)
        ids_t = torch.tensor(ids)
        mm_type = 2 * (ids_t == c.video_token_id).to(torch.int32)
        settings = {"size": [w, h], "timestamps": [round(s, 6) for s in stamps], "min_tokens": min_tokens,
                    "max_tokens": max_tokens}
        return self._finish("video", ids_t, mm_type, out["pixel_values_videos"], grid, second, settings)

    def _finish(self, kind: str, ids: torch.Tensor, mm_type: torch.Tensor, pixels: torch.Tensor,
                grid: torch.Tensor, second: float | None, settings: dict[str, Any]) -> VisionChunk:
        chunk = VisionChunk(kind, ids, mm_type, pixels, grid, torch.zeros(3, 0, dtype=torch.long), 0, second, settings)
        positions, span = rope_positions(self.model, [chunk], tail=1)
        return VisionChunk(kind, ids, mm_type, pixels, grid, positions[:, :-1].clone(), int(positions[0, -1]),
                           second, settings)


def as_chunk(part: Any) -> TextChunk | VisionChunk:
    """A chunk's model input as a chunk object: 1-D token ids become a `TextChunk`."""
    if isinstance(part, (TextChunk, VisionChunk)):
        return part
    if isinstance(part, torch.Tensor):
        return TextChunk(part)
    raise TypeError(f"a chunk is token ids, a TextChunk or a VisionChunk, got {type(part).__name__}")


def rope_positions(model: Any, parts: Sequence[Any], tail: int = 0) -> tuple[torch.Tensor, int]:
    """The model's own `[3, T]` int64 positions of `parts` (VisionChunk or 1-D text ids) followed by `tail` text tokens,
    and the span of the parts (the position of the first tail token; 0 without a tail)."""
    ids, types, image_grids, video_grids, seconds = [], [], [], [], []
    for part in parts:
        part = as_chunk(part)
        ids.append(part.ids)
        types.append(part.mm_type)
        if part.kind != "text":
            (image_grids if part.kind == "image" else video_grids).append(part.grid_thw)
        if part.kind == "video":
            seconds.append(1.0 if part.second_per_grid is None else part.second_per_grid)
    if tail:
        ids.append(torch.full((tail,), 3, dtype=torch.long))
        types.append(torch.zeros(tail, dtype=torch.int32))
    all_ids, all_types = torch.cat(ids)[None], torch.cat(types)[None]
    if not image_grids and not video_grids:
        positions = torch.arange(all_ids.shape[1]).expand(3, -1).clone()
    else:
        kw: dict[str, Any] = {}
        if image_grids:
            kw["image_grid_thw"] = torch.cat(image_grids)
        if video_grids:
            kw["video_grid_thw"] = torch.cat(video_grids)
            if model.config.model_type == "qwen2_5_vl":
                kw["second_per_grid_ts"] = torch.tensor(seconds)
        positions = model.model.get_rope_index(input_ids=all_ids, mm_token_type_ids=all_types, **kw)[0][:, 0]
    return positions, int(positions[0, -tail]) if tail else 0


def vision_features(model: Any, chunk: VisionChunk) -> dict[str, torch.Tensor]:
    """The vision tower's outputs for one chunk as named tensors (what the encoder cache stores)."""
    getter = model.model.get_image_features if chunk.kind == "image" else model.model.get_video_features
    with torch.no_grad():
        out = getter(chunk.pixels, chunk.grid_thw, return_dict=True)
    tensors = {"embeds": torch.cat(list(out.pooler_output)).contiguous()}
    for i, level in enumerate(getattr(out, "deepstack_features", None) or []):
        tensors[f"deepstack.{i}"] = torch.cat(list(level)).contiguous()
    return tensors


def encoder_outputs(model: Any, chunk: VisionChunk, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`mm_encoder_outputs=` for the model's forward from stored vision-tower outputs."""
    import sys

    from transformers.modeling_outputs import BaseModelOutputWithPooling

    deep = [tensors[f"deepstack.{i}"] for i in range(len(tensors) - 1)]
    if deep:
        cls = getattr(sys.modules[type(model.model).__module__], "BaseModelOutputWithDeepstackFeatures")
        out = cls(pooler_output=(tensors["embeds"],), deepstack_features=[(d,) for d in deep])
    else:
        out = BaseModelOutputWithPooling(pooler_output=(tensors["embeds"],))
    return {chunk.kind: out}
