"""`KameraModel.from_pretrained(path)` on a Qwen2.5-VL checkpoint directory, the way users load
real models: config, weights and processor (tokenizer, image and video processors) read from disk
by transformers' Auto classes. The checkpoint is the tiny random model, saved with a byte-level
tokenizer whose special tokens sit at the config's ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentwin import Image, KameraModel, Text, Window
from tests.support import assert_close, forward_growth


def _save_checkpoint(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import Qwen2TokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from agentwin.models.zoo import build_tiny

    model = build_tiny("tiny-qwen2.5-vl")
    model.save_pretrained(path)
    symbols = bytes_to_unicode()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({symbols[b]: 3 + i for i, b in enumerate(range(32, 127))})  # printable ASCII
    specials = {"<|image_pad|>": 250, "<|video_pad|>": 251, "<|vision_start|>": 252, "<|vision_end|>": 253}
    vocab.update(specials)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = Qwen2TokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token=None, eos_token="</s>",
                                   pad_token="</s>", additional_special_tokens=list(specials))
    vision = model.config.vision_config
    kw = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
              merge_size=vision.spatial_merge_size)
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**kw), tokenizer=tokenizer,
                                    video_processor=Qwen2VLVideoProcessor(**kw))
    processor.save_pretrained(path)


def test_qwen2_5_vl_checkpoint_directory_loads_and_is_exact(tmp_path):
    _save_checkpoint(tmp_path)
    km = KameraModel.from_pretrained(str(tmp_path))
    assert km.is_vlm and km.tokenize("ab").tolist() == [3 + ord("a") - 32, 3 + ord("b") - 32]
    win = Window(km, budget_tokens=2048, patch="origin", rank=None)
    win.append(Text("the page:"))
    shot = win.append(Image(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8), max_tokens=12))
    win.append(Text(" and below it"))
    win.evict(shot)
    win.recall(shot)
    with torch.no_grad():
        ref = torch.log_softmax(km.model(**win.reference_inputs(" what?")).logits[0, -1].float(), -1)
    # float32 rounding through the forward (tests.support.forward_growth)
    assert_close(win.next_token_logprobs(" what?"), ref, what="next-token log-probabilities",
                 growth=forward_growth(km.model.config))
    assert win.stats().encoder_calls == 1


def test_unreadable_model_path_says_what_it_accepts(tmp_path):
    with pytest.raises(ValueError, match="not a built-in name"):
        KameraModel.from_pretrained(str(tmp_path / "nothing-here"))
