"""The converted-weights cache of the embedded SmolLM2: a later load reads it and gives the same
model (logits equal to the GGUF load's, same tokenizer); a damaged cache is dropped with a
warning and rebuilt from the GGUF file; AGENTWIN_WEIGHT_CACHE=0 turns it off."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

from agentwin.models import zoo


TEXT = "The harbour master keeps the tide log. <|im_start|>user\nWho keeps it?<|im_end|>"


def _logits(model, tokenizer) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokenizer(TEXT).input_ids])).logits[0]


class _GGUFLoads:
    """Counts the model loads that read the GGUF file (conversions), not the cache."""

    def __init__(self, monkeypatch) -> None:
        from transformers import AutoModelForCausalLM

        self.count = 0
        plain = AutoModelForCausalLM.from_pretrained.__func__

        def counted(cls, *args, **kwargs):
            self.count += "gguf_file" in kwargs
            return plain(cls, *args, **kwargs)

        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counted))


@pytest.mark.slow
def test_second_load_reads_the_cache_and_a_damaged_one_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTWIN_WEIGHT_CACHE", raising=False)
    gguf = zoo.smollm2_gguf_path()
    # The machine's own cache (converted from GGUF on its first load; the other tests read it too)
    # seeds a cache in tmp_path, so this test converts once, not twice.
    zoo.load_smollm2(torch.float32)
    shared = zoo.converted_cache_dir(gguf, torch.float32)
    assert os.path.isfile(os.path.join(shared, "complete.json"))
    monkeypatch.setenv("AGENTWIN_CACHE_DIR", str(tmp_path))
    folder = zoo.converted_cache_dir(gguf, torch.float32)
    assert folder.startswith(str(tmp_path)) and os.path.basename(folder) == os.path.basename(shared)
    shutil.copytree(shared, folder)
    loads = _GGUFLoads(monkeypatch)

    cached, tok = zoo.load_smollm2(torch.float32)
    assert loads.count == 0  # read from the cache, no conversion
    assert cached.config._attn_implementation == "sdpa"
    assert cached.model.rotary_emb.inv_freq.dtype == torch.float32
    reference = _logits(cached, tok)
    # A second writer (another process converting at the same time) finds the cache finished:
    # its copy is discarded without a warning and the cache stays whole.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zoo._save_converted(cached, tok, folder)
    assert sorted(os.listdir(os.path.dirname(folder))) == [os.path.basename(folder)]
    del cached

    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.warns(UserWarning, match="converted-weights cache"):
        rebuilt, rebuilt_tok = zoo.load_smollm2(torch.float32)
    assert loads.count == 1  # converted from GGUF again
    assert rebuilt_tok(TEXT).input_ids == tok(TEXT).input_ids
    assert torch.equal(_logits(rebuilt, rebuilt_tok), reference)  # the cache gives the GGUF load's model
    assert os.path.isfile(os.path.join(folder, "complete.json"))
    assert os.path.getsize(weights) > 2 * 10**8  # written again in full
    del rebuilt
    again, _ = zoo.load_smollm2(torch.float32)
    assert loads.count == 1 and torch.equal(_logits(again, rebuilt_tok), reference)  # the rebuilt cache is read


def test_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTWIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AGENTWIN_WEIGHT_CACHE", "0")
    assert zoo.converted_cache_dir(zoo.smollm2_gguf_path(), torch.float32) is None  # load_smollm2 keeps nothing
    monkeypatch.setenv("AGENTWIN_WEIGHT_CACHE", "1")
    assert zoo.converted_cache_dir(zoo.smollm2_gguf_path(), torch.bfloat16) != \
        zoo.converted_cache_dir(zoo.smollm2_gguf_path(), torch.float32)  # one cache per dtype
