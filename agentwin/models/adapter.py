"""`KameraModel`: a transformers causal LM wrapped for chunk-level KV work: tokenizing, encoding a chunk alone or
after others, segment caches, query logits. A chunk is 1-D token ids, a `TextChunk` or a `VisionChunk` (Qwen-VL);
positions are in position units (`VisionChunk.span`)."""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from typing import Any, Callable, Sequence, Union

import torch

from agentwin.models import residual
from agentwin.models.kv import LayerKV
from agentwin.models.segments import ATTENTION, SegmentCache, register
from agentwin.models.vision import (TextChunk, VisionChunk, VisionPreparer, as_chunk, encoder_outputs, is_qwen_vl, vision_features)
from kamera_core import UnsupportedModelError, kv_layout, model_name, rope_specs
from kamera_core.segment import Segment

ChunkInput = Union[TextChunk, VisionChunk, torch.Tensor]  # token ids are taken as a TextChunk
Features = Callable[[VisionChunk], dict]




class ByteTokenizer:
    """UTF-8 bytes mapped to ids 3..vocab-1: the tokenizer of the seeded tiny models, which ship none."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 4:
            raise ValueError(f"vocab_size must be at least 4, got {vocab_size}")
        self.span = vocab_size - 3

    def encode(self, text: str) -> list[int]:
        return [3 + b % self.span for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(32 + (i - 3) % 95) for i in ids)


class KameraModel:
    """A causal LM plus its tokenizer, checked for exact relocation at construction."""

    def __init__(self, model: Any, tokenizer: Any = None, name: str | None = None, processor: Any = None) -> None:
        """TypeError for a non-transformers model; ValueError for a non-Qwen-VL vision family; UnsupportedModelError for
        keys that cannot be relocated exactly. processor: a Qwen-VL `AutoProcessor` (default: built from the config)."""
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a transformers model (torch.nn.Module with .config), got {type(model).__name__}")
        self.model = model.eval()
        self.name = name or model_name(model.config)
        self.is_vlm = getattr(model.config, "vision_config", None) is not None
        if self.is_vlm and not is_qwen_vl(model.config):
            raise ValueError(f"{self.name}: vision-language family {model.config.model_type!r} is not supported; "
                             "image and frame chunks need Qwen2-VL, Qwen2.5-VL or Qwen3-VL (a text model works too)")
        self.specs = list(rope_specs(model.config))  # refuses what cannot be relocated exactly
        self.layout = kv_layout(model.config)
        self._use_segment_attention()
        if tokenizer is None and processor is not None:
            tokenizer = getattr(processor, "tokenizer", None)
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer(int(text_config.vocab_size))
        self.vision = VisionPreparer(model, self.tokenize, processor) if self.is_vlm else None
        self.fingerprint = self._fingerprint()

    def _text_config(self) -> Any:
        config = self.model.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def _use_segment_attention(self) -> None:
        """Switch the decoder (not a vision tower) to the "kamera" attention; UnsupportedModelError where it cannot
        reproduce the model's attention exactly (logit soft-capping, sinks, no `AttentionInterface` dispatch)."""
        text = self._text_config()
        for attr, what in (("attn_logit_softcapping", "attention logit soft-capping"),):
            if getattr(text, attr, None) is not None:
                raise UnsupportedModelError(f"{self.name}: {what} is not supported by agentwin's segment attention")
        if any(hasattr(m, "sinks") for m in self.model.modules()):
            raise UnsupportedModelError(f"{self.name}: attention sinks are not supported by agentwin's segment attention")
        register()
        if not self.model._can_set_attn_implementation():
            raise UnsupportedModelError(f"{self.name}: the model does not dispatch attention through transformers' "
                                        "AttentionInterface, so agentwin cannot serve its KV in place")
        if self.is_vlm:
            self.model.set_attn_implementation({"text_config": ATTENTION})
        else:
            self.model.set_attn_implementation(ATTENTION)

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: torch.dtype = torch.float32) -> "KameraModel":
        """A built-in name (`smollm2`, `gemma3-270m`, `tiny-*`) or a path / hub name; ValueError if it cannot load."""
        from agentwin.models.zoo import REAL, TINY, build_tiny, load_real

        if not isinstance(name_or_path, str) or not name_or_path:
            raise TypeError(f"name_or_path must be a non-empty string, got {name_or_path!r}")
        if name_or_path in REAL:
            model, tokenizer = load_real(name_or_path, dtype)
            return cls(model, tokenizer, name=name_or_path)
        if name_or_path in TINY:
            return cls(build_tiny(name_or_path, dtype=dtype), None, name=name_or_path)
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(name_or_path)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load {name_or_path!r}: not a built-in name ({', '.join([*REAL, *TINY])}) "
                             f"and not a readable model directory or reachable hub name ({e})") from None
        if getattr(config, "vision_config", None) is not None:
            from transformers import AutoModelForImageTextToText, AutoProcessor

            if not is_qwen_vl(config):
                raise ValueError(f"{name_or_path}: vision-language family {config.model_type!r} is not supported; "
                                 "use a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint")
            processor = AutoProcessor.from_pretrained(name_or_path)
            model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype, attn_implementation="sdpa")
            return cls(model, processor.tokenizer, name=name_or_path, processor=processor)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation="sdpa")
        return cls(model, tokenizer, name=name_or_path)

    def _fingerprint(self) -> str:
        """Hash of the config and weights (first and last tensors whole, others by name, shape, dtype)."""
        h = hashlib.sha256(self.model.config.to_json_string().encode())
        params = list(self.model.named_parameters())
        for index, (name, p) in enumerate(params):
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            if index in (0, len(params) - 1):
                h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:32]

    def tokenize(self, text: str) -> torch.Tensor:
        """Token ids `[T]` int64 of `text` with no special tokens added."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.tokenizer.encode(text) if isinstance(self.tokenizer, ByteTokenizer) else \
            self.tokenizer(text, add_special_tokens=False).input_ids
        return torch.tensor(ids, dtype=torch.long)

    # ---- chunks -------------------------------------------------------------------------------

    def image(self, source: Any, min_tokens: int = 4, max_tokens: int = 1024) -> VisionChunk:
        """An image chunk from a PIL image, path, encoded bytes or `[H, W, 3]` uint8 array, within the token budget."""
        return self._preparer().image(source, min_tokens, max_tokens)

    def frames(self, frames: Sequence[Any], timestamps: Sequence[float] | None = None, fps: float = 2.0,
               min_tokens: int = 128, max_tokens: int = 768) -> VisionChunk:
        """A frame-run chunk (frames sampled by the caller); token budgets are per frame."""
        return self._preparer().frames(frames, timestamps, fps, min_tokens, max_tokens)

    def _preparer(self) -> VisionPreparer:
        if self.vision is None:
            raise ValueError(f"{self.name} is a text-only model: it cannot take image or frame chunks; "
                             "pass the observation's text, or use a Qwen-VL model")
        return self.vision

    @staticmethod
    def span(chunk: ChunkInput) -> int:
        """Position units a chunk takes (tokens for text)."""
        return as_chunk(chunk).span

    @staticmethod
    def ids(chunk: ChunkInput) -> torch.Tensor:
        return as_chunk(chunk).ids

    def features(self, chunk: VisionChunk) -> dict:
        """The vision tower's outputs for `chunk` (no caching; the window caches them)."""
        return vision_features(self.model, chunk)

    # ---- forward passes -----------------------------------------------------------------------

    def _positions(self, chunk: ChunkInput, start: int) -> torch.Tensor:
        return as_chunk(chunk).placed_positions(start, self.is_vlm)

    def cache(self, segments_per_layer: Sequence[Sequence[Segment]] | None = None, first: int = 0) -> Any:
        """A `SegmentCache` with `segments_per_layer[i]` in layer i (default none), its tail at token index `first`."""
        if segments_per_layer is None:
            segments_per_layer = [()] * len(self.specs)
        return SegmentCache(segments_per_layer, first, self.specs, self.layout)

    def forward(self, chunk: ChunkInput, start: int, cache: Any = None, features: Features | None = None,
                logits_to_keep: int = 0) -> Any:
        """The forward of one chunk at `start` (position units) after `cache` (default empty), appending the chunk's KV
        to the cache's tail (mutates `cache`). features: vision-tower outputs per chunk (default: run the tower);
        logits_to_keep: 0 all, n the last n. TypeError / ValueError for a cache of another kind or model;
        RuntimeError if the model's attention was switched after wrapping."""
        cache = self.cache() if cache is None else cache
        if self._text_config()._attn_implementation != ATTENTION:
            raise RuntimeError(f"{self.name}: the model's attention was switched to "
                               f"{self._text_config()._attn_implementation!r} after it was wrapped; agentwin reads "
                               f"its KV through {ATTENTION!r} attention: call model.set_attn_implementation("
                               f"{ATTENTION!r}) or wrap the model again")
        if not isinstance(cache, SegmentCache):
            raise TypeError(f"cache must be a SegmentCache (KameraModel.cache()), got {type(cache).__name__}")
        if cache.specs != tuple(self.specs) or cache.layout != self.layout:
            raise ValueError(f"the cache was built for another model (its RoPE specs or KV layout differ from "
                             f"{self.name}'s); build it with this model's KameraModel.cache()")
        kw: dict[str, Any] = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        chunk = as_chunk(chunk)
        if chunk.kind != "text":
            tensors = (features or self.features)(chunk)
            kw = {**kw, "mm_encoder_outputs": encoder_outputs(self.model, chunk, tensors),
                  "mm_token_type_ids": chunk.mm_type[None]}
        ids = self.ids(chunk)
        with torch.no_grad():
            return self.model(input_ids=ids[None], position_ids=self._positions(chunk, start), cache=cache,
                              segment_cache=cache, use_cache=True, **kw)

    def forward_variants(self, ids: torch.Tensor, start: int, variants: Sequence[Sequence[Sequence[Segment]]],
                         first: int, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits `[B, n, vocab]` float32 of text `ids` `[T]` at `start` (token index `first`), read after each of the B
        `variants` (per-layer segments) in one batched forward. Not for MLA; ValueError for a vision chunk."""
        chunk = as_chunk(ids)
        if chunk.kind != "text":
            raise ValueError("forward_variants takes text tokens")
        cache = SegmentCache.variants(variants, first, self.specs, self.layout)
        batch = len(variants)
        kw: dict[str, Any] = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        positions = self._positions(chunk, start)
        with torch.no_grad():
            out = self.model(input_ids=self.ids(chunk)[None].expand(batch, -1),
                             position_ids=positions.expand(*positions.shape[:-2], batch, positions.shape[-1]),
                             cache=cache, segment_cache=cache, use_cache=True, **kw)
        return out.logits.float()

    def reference_inputs(self, parts: Sequence[ChunkInput]) -> dict[str, torch.Tensor]:
        """Keyword arguments of a plain re-prefill of `parts` (`input_ids` `[1, T]`, token types, pixels, grids)."""
        if not parts:
            raise ValueError("nothing to run: no chunks and no query")
        parts = [as_chunk(p) for p in parts]
        kw: dict[str, Any] = {"input_ids": torch.cat([p.ids for p in parts])[None]}
        vision = [p for p in parts if p.kind != "text"]
        if vision:
            kw["mm_token_type_ids"] = torch.cat([p.mm_type for p in parts])[None]
            for kind, pix, grid in (("image", "pixel_values", "image_grid_thw"),
                                    ("video", "pixel_values_videos", "video_grid_thw")):
                chosen = [p for p in vision if p.kind == kind]
                if chosen:
                    kw[pix] = torch.cat([p.pixels for p in chosen])
                    kw[grid] = torch.cat([p.grid_thw for p in chosen])
                    if kind == "video" and self.model.config.model_type == "qwen2_5_vl":
                        kw["second_per_grid_ts"] = torch.tensor([p.second_per_grid for p in chosen])
        return kw

    def reference_forward(self, parts: Sequence[ChunkInput]) -> Any:
        """The model's own forward over `parts` (its positions, SDPA, no segments): a plain re-prefill."""
        with torch.no_grad():
            return self.model(use_cache=False, **self.reference_inputs(parts))

    def prefill_kv(self, parts: Sequence[ChunkInput]) -> list[LayerKV]:
        """Token-major KV (owned copies) of a plain forward over `parts`, every token kept (sliding layers too)."""
        cache = self.cache()
        with torch.no_grad():
            self.model(use_cache=True, cache=cache, segment_cache=cache, **self.reference_inputs(parts))
        return [(k.clone(), v.clone()) for k, v in cache.tail_kv()]

    def encode(self, chunk: ChunkInput, features: Features | None = None) -> list[LayerKV]:
        """KV of the chunk alone in its chunk-local frame (start 0); owned contiguous copies."""
        cache = self.cache()
        self.forward(chunk, 0, cache, features, logits_to_keep=1)  # KV is the product: one row of logits
        return [(k.contiguous(), v.contiguous()) for k, v in cache.tail_kv()]

    def key_summary(self, ids: torch.Tensor) -> torch.Tensor:
        """`[layers, width]` float32 mean over tokens of the chunk-local keys (MLA: c_KV) of `ids` `[T]`."""
        return torch.stack([k.float().mean(0).reshape(-1) for k, _ in self.encode(ids)])

    def encode_after(self, segments_per_layer: Sequence[Sequence[Segment]], first: int, start: int, chunk: ChunkInput,
                     features: Features | None = None, probe: Any = None) -> list[LayerKV]:
        """KV of `chunk` at `start` (position units) and token index `first`, read after the segments; owned copies.
        probe: a `QueryProbe` (mutated) that gets the queries and next-token logits of its rows, the chunk's last,
        and with `keep_residual` the residual stream's squared norm entering each layer."""
        cache = self.cache(segments_per_layer, first)
        cache.probe = probe
        rows = 1 if probe is None else max(1, int(probe.rows.numel()))
        with residual.recording(self.model) if probe is not None and probe.keep_residual else nullcontext() as found:
            out = self.forward(chunk, start, cache, features, logits_to_keep=rows)
        if found is not None:
            probe.residual = dict(found)
        if probe is not None:
            probe.logits = out.logits[0, -rows:].float()
        return [(k.contiguous(), v.contiguous()) for k, v in cache.tail_kv()]

    def query_logits(self, cache: Any, start: int, query_ids: torch.Tensor) -> torch.Tensor:
        """Last-position logits `[vocab]` float32 of `query_ids` `[T]` at `start` after `cache` (None: none before)."""
        return self.forward(query_ids, start, cache, logits_to_keep=1).logits[0, -1].float()
