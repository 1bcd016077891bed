"""Fast tier: compatibility checks, source resolution and prompt limits (no real models)."""

from __future__ import annotations

import pytest

from scdviz.models import pair as pairmod
from tests.conftest import ByteTokenizer, tiny_model


def _facts(kind="llama", tok=None, **overrides):
    return pairmod.facts_of(tiny_model(kind, **overrides), tok or ByteTokenizer())


def test_same_config_is_compatible():
    a, b = _facts(seed=0), _facts(seed=1)
    assert pairmod.mismatches(a, b) == []
    pairmod.check_compatible(a, b)


@pytest.mark.parametrize(
    "overrides, label, values",
    [
        ({"num_hidden_layers": 4}, "layers", "3 vs consumer 4"),
        ({"hidden_size": 64}, "hidden size", "32 vs consumer 64"),
        ({"num_attention_heads": 8, "hidden_size": 32}, "attention heads", "4 vs consumer 8"),
        ({"num_key_value_heads": 1}, "KV heads", "2 vs consumer 1"),
        ({"head_dim": 16}, "head_dim", "8 vs consumer 16"),
        ({"vocab_size": 99}, "vocabulary size", "97 vs consumer 99"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "RoPE theta",
         "10000.0 vs consumer 500000.0"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "RoPE scaling", "linear"),
    ],
)
def test_each_mismatch_is_named_with_both_values(overrides, label, values):
    found = pairmod.mismatches(_facts(), _facts(**overrides))
    assert any(m.startswith(label + ":") and values in m for m in found), found
    with pytest.raises(pairmod.PairError, match="incompatible pair"):
        pairmod.check_compatible(_facts(), _facts(**overrides))


def test_architecture_sliding_window_and_tokenizer_mismatches():
    found = pairmod.mismatches(_facts("llama"), _facts("mistral", sliding_window=16, tok=ByteTokenizer(extra="x")))
    text = "\n".join(found)
    assert "architecture class: producer 'LlamaForCausalLM' vs consumer 'MistralForCausalLM'" in text
    assert "sliding window: producer None vs consumer 16" in text
    assert "tokenizer (vocabulary hash)" in text


def test_layer_types_mismatch():
    types = ["full_attention", "sliding_attention", "full_attention"]
    found = pairmod.mismatches(_facts("qwen2"),
                               _facts("qwen2", layer_types=types, use_sliding_window=True, sliding_window=8))
    assert any(m.startswith("layer types:") for m in found)


def test_source_resolution_errors(tmp_path, monkeypatch):
    with pytest.raises(pairmod.PairError, match="empty model source"):
        pairmod.resolve_source("  ")
    with pytest.raises(pairmod.PairError, match="unknown built-in model 'nope'"):
        pairmod.resolve_source("builtin:nope")
    with pytest.raises(pairmod.PairError, match="not a model folder"):
        pairmod.resolve_source(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("{}")
    assert pairmod.resolve_source(str(tmp_path))[0] == "adapter"
    assert pairmod.resolve_source("org/model")[0] == "hub"
    # hosted mode's rules are the app's (test_hosting): the library resolves what it is given
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    assert pairmod.resolve_source(str(tmp_path))[0] == "adapter" and pairmod.resolve_source("org/model")[0] == "hub"


def test_choose_threads_respects_setting(monkeypatch):
    import torch

    monkeypatch.setenv("SCDVIZ_THREADS", "1")
    assert pairmod.choose_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.delenv("SCDVIZ_THREADS")
    assert pairmod.choose_threads((1,)) == 1
