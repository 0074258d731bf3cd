"""`KameraModel`: a loaded transformers causal LM wrapped for chunk-level KV work.

It owns what the window needs from the model and nothing else: tokenizing, encoding a chunk alone
in its chunk-local frame, the conditioned pass of a chunk after its antecedent, building a cache
from token-major KV, and next-token logits of a query read after a cache. Text models with 1-D
RoPE (Llama-style, GPT-NeoX, Gemma-3) and MLA (DeepSeek-V2/V3) are covered here; a model whose
keys cannot be relocated exactly is refused when wrapped (`UnsupportedModelError`).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from agentwin.models.kv import LayerKV, build_cache, extract_kv
from kamera_core import kv_layout, model_name, rope_specs


class ByteTokenizer:
    """Bytes of UTF-8 text mapped into a tiny model's vocabulary (ids 3..vocab-1): for the seeded
    random-init models, which ship no tokenizer."""

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

    def __init__(self, model: Any, tokenizer: Any = None, name: str | None = None) -> None:
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a transformers model (torch.nn.Module with .config), got {type(model).__name__}")
        self.model = model.eval()
        self.name = name or model_name(model.config)
        if getattr(model.config, "vision_config", None) is not None:
            raise ValueError(f"{self.name}: vision-language models are not wrapped by this adapter yet; use a text model")
        self.specs = list(rope_specs(model.config))  # refuses what cannot be relocated exactly
        self.layout = kv_layout(model.config)
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer(int(model.config.vocab_size))
        self.fingerprint = self._fingerprint()

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: torch.dtype = torch.float32) -> "KameraModel":
        """`smollm2` (the embedded model), a built-in `tiny-*` name, or a path / hub name."""
        from agentwin.models.zoo import TINY, build_tiny, load_smollm2

        if not isinstance(name_or_path, str) or not name_or_path:
            raise TypeError(f"name_or_path must be a non-empty string, got {name_or_path!r}")
        if name_or_path == "smollm2":
            model, tokenizer = load_smollm2(dtype)
            return cls(model, tokenizer, name="smollm2")
        if name_or_path in TINY:
            return cls(build_tiny(name_or_path, dtype=dtype), None, name=name_or_path)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation="eager")
        return cls(model, tokenizer, name=name_or_path)

    def _fingerprint(self) -> str:
        """Changes with the config and the weights (the first and last parameter tensors hashed
        whole, every other one by name, shape and dtype), so caches never cross models."""
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

    def forward(self, ids: torch.Tensor, start: int, cache: Any = None) -> Any:
        """The model's forward of `ids` `[T]` at positions start..start+T-1, after `cache`."""
        positions = torch.arange(start, start + int(ids.shape[0]))[None]
        with torch.no_grad():
            return self.model(input_ids=ids[None], position_ids=positions, cache=cache, use_cache=True)

    def encode(self, ids: torch.Tensor) -> list[LayerKV]:
        """KV of the chunk alone in its chunk-local frame (start 0); owned copies."""
        return [(k.clone(), v.clone()) for k, v in extract_kv(self.forward(ids, 0).cache, self.layout)]

    def key_summary(self, ids: torch.Tensor) -> torch.Tensor:
        """`[layers, width]` float32 mean over tokens of the chunk-local keys of `ids` (MLA: c_KV),
        comparable with `Window.key_summary` for retrieval."""
        return torch.stack([k.float().mean(0).reshape(-1) for k, _ in self.encode(ids)])

    def encode_after(self, prefix: Sequence[LayerKV], prefix_len: int, ids: torch.Tensor) -> list[LayerKV]:
        """KV of `ids` read after a cache of `prefix` (placed at 0..prefix_len), at its own positions."""
        cache = build_cache(prefix, self.model.config, self.layout) if prefix_len else None
        out = self.forward(ids, prefix_len, cache)
        return [(k[prefix_len:].clone(), v[prefix_len:].clone()) for k, v in extract_kv(out.cache, self.layout)]

    def query_logits(self, kv: Sequence[LayerKV], length: int, query_ids: torch.Tensor) -> torch.Tensor:
        """Last-position logits `[vocab]` float32 of `query_ids` read after a cache holding `kv`."""
        cache = build_cache(kv, self.model.config, self.layout) if length else None
        return self.forward(query_ids, length, cache).logits[0, -1].float()
