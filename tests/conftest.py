"""Shared fixtures: tiny random models (fast tier) and the built-in pair (slow tier).

Tiny models are built from configs in code, never downloaded. The slow tier loads the
built-in pair once per session (the producer is fetched and converted on first use).
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# One torch thread unless told otherwise: on a shared 2-core machine two threads made tiny
# models ~100x slower when another process was busy (the app picks threads by measurement).
torch.set_num_threads(int(os.environ.get("SCDVIZ_THREADS", "1")))

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

TINY = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
}


def tiny_model(kind: str = "llama", seed: int = 0, **overrides):
    """A tiny random decoder-only model of the given family, fp32, eval mode."""
    cfg_cls, model_cls, extra = TINY[kind]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**COMMON, **extra, **overrides})
    cfg.architectures = [model_cls.__name__]
    model = model_cls(cfg).eval()
    return model


class ByteTokenizer:
    """A fake tokenizer: one id per byte (mod vocab), enough for compatibility checks."""

    def __init__(self, vocab: int = 97, extra: str = ""):
        self.vocab = {chr(32 + i) + extra: i for i in range(vocab)}
        self.all_special_tokens = ["<s>"]

    def get_vocab(self):
        return dict(self.vocab)


@pytest.fixture(params=list(TINY))
def tiny(request):
    """Each tiny model family in turn."""
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A calibration text file of 60 short passages (the tiny SCD tests' calib, train and eval text)."""
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("\n\n".join(f"passage {i}: " + "the quick brown fox jumps over the lazy dog " * 4
                                for i in range(60)))
    return str(path)


@pytest.fixture(scope="module")
def tiny_pair():
    """The tiny SCD pair (test_scd's producer and a perturbed consumer), once per module."""
    from test_scd import make_pair, perturbed

    return make_pair(tiny_model("llama"), perturbed(1))


@pytest.fixture(scope="module")
def tiny_calib(tiny_pair, texts):
    """A small SCD calibration of ``tiny_pair`` on ``texts``, once per module."""
    from test_scd import small_cfg

    from scdviz.scd import calibrate as cal

    return cal.calibrate(small_cfg(texts), tiny_pair, progress=False)


@pytest.fixture(scope="session")
def builtin_pair():
    """The built-in producer with the jargon specialist (slow tier)."""
    from scdviz.models.pair import load_pair

    return load_pair("builtin:smollm2-135m", "builtin:jargon")


def user_text(n: int = 60, seed: int = 0) -> str:
    """A person's own text, made up here: blank-line separated passages of a small seaside vocabulary."""
    import random

    rng = random.Random(seed)
    words = ("the river ship harbour north wind sail rope lantern keeper storm tide island light rock gull net "
             "fisher morning evening").split()
    return "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(40, 70))).capitalize() + "."
                       for _ in range(n))


def tiny_folder(root, text: str):
    """A tiny random Llama saved as a model folder with a byte-level BPE tokenizer trained on ``text``:
    a local model source for CLI and notebook tests (no hub, no built-in pair)."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(root)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text.split("\n\n"), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<s>", unk_token="<unk>")
    tiny_model("llama", vocab_size=len(fast), max_position_embeddings=512).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder
