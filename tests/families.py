"""Tiny random models of every supported family (issue 58), as kvpress's tests/default_presses.py lists presses.

Not a test module (nothing here is collected): ``tests/test_families.py`` runs the public entry points over
``FAMILIES`` and checks that ``UNSUPPORTED`` families are refused. Every builder takes a seed (and optional
config overrides, e.g. ``vocab_size`` for a saved folder's tokenizer) and returns a tiny random fp32 *ForCausalLM
in eval mode, built from its transformers config class as ``conftest.tiny_model`` builds its models: hidden
32 (64 for phi4-mini: head_dim 16, of which 12 rotate, as 96 of Phi-4-mini's 128 do), 4 layers (SmolLM3's NoPE
layer is every 4th), 4 query heads, 2 KV heads, the 97-token vocabulary of conftest's ByteTokenizer (a saved
folder's tokenizer sets its own: ``family_folder``), 512 positions, token ids 1 for bos / eos and no pad.

Each entry exercises what sets its family apart from Llama, and ``FEATURES`` says what that is. transformers
initialises biases to zero and norm weights to one (Gemma's to zero, read as 1 + w), which would hide a biased
projection or a q/k norm from every test, so the builders overwrite them with seeded random values.
``check(name, model)`` asserts that every such setting took effect on the built model (a config kwarg that
transformers ignores silently would otherwise make a family test the Llama path again).

Sliding windows are 16 tokens (``WINDOW``): the tests' prompts (40-64 tokens) are longer than the window.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers as T

WINDOW = 16  # sliding window of the windowed families: shorter than every test prompt
VOCAB = 97  # conftest.ByteTokenizer's vocabulary

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,  # family_folder's tokenizer: "<s>" is id 1 (Phi-3's and SmolLM3's own ids are past 97)
    eos_token_id=1,
    pad_token_id=None,
)

SLIDING, FULL = "sliding_attention", "full_attention"


def _build(cfg_cls, model_cls, seed: int, fixed: dict, overrides: dict):
    """The model of ``cfg_cls(**COMMON, **fixed, **overrides)``, weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**COMMON, **fixed, **overrides})
    cfg.architectures = [model_cls.__name__]
    return model_cls(cfg).eval()


def _randomise(model, seed: int, names: tuple[str, ...], scale: float = 0.5, around: float = 0.0) -> None:
    """Overwrite every parameter whose name ends with one of ``names`` by ``around + scale * N(0, 1)`` (seeded)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    hit = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(names):
                p.copy_(around + scale * torch.randn(p.shape, generator=g))
                hit += 1
    assert hit, f"no parameter ends with {names}"


QKV_BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")
QK_NORMS = ("q_norm.weight", "k_norm.weight")


def llama3(seed: int = 0, **overrides):
    """Llama with Llama-3's RoPE scaling (rope_type "llama3": low frequencies stretched by ``factor``)."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return _build(T.LlamaConfig, T.LlamaForCausalLM, seed, {"rope_parameters": rope}, overrides)


def mistral(seed: int = 0, **overrides):
    """Mistral without a sliding window (v0.2 and later)."""
    return _build(T.MistralConfig, T.MistralForCausalLM, seed, {"sliding_window": None}, overrides)


def mistral_v01(seed: int = 0, **overrides):
    """Mistral-7B-v0.1: every layer attends over a sliding window (only sliding layers)."""
    return _build(T.MistralConfig, T.MistralForCausalLM, seed, {"sliding_window": WINDOW}, overrides)


def qwen25(seed: int = 0, **overrides):
    """Qwen2.5: q/k/v projections with biases (random here, not transformers' zeros), no sliding window."""
    model = _build(T.Qwen2Config, T.Qwen2ForCausalLM, seed, {"use_sliding_window": False}, overrides)
    _randomise(model, seed, QKV_BIASES)
    return model


def qwen3(seed: int = 0, **overrides):
    """Qwen3: head_dim set apart from hidden / heads, per-head RMS q/k norms (random weights)."""
    model = _build(T.Qwen3Config, T.Qwen3ForCausalLM, seed, {"head_dim": 8}, overrides)
    _randomise(model, seed, QK_NORMS, around=1.0)
    return model


def qwen3_moe(seed: int = 0, **overrides):
    """Qwen3-MoE: a sparse MLP of 4 experts (2 per token) in every layer, q/k norms (random weights)."""
    fixed = {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "decoder_sparse_step": 1, "norm_topk_prob": True}
    model = _build(T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, seed, fixed, overrides)
    _randomise(model, seed, QK_NORMS, around=1.0)
    return model


def gemma2(seed: int = 0, **overrides):
    """Gemma-2: attention-logit and final-logit soft-capping, sliding and full layers alternating."""
    fixed = {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW,
             "layer_types": [SLIDING, FULL, SLIDING, FULL], "attn_logit_softcapping": 5.0,
             "final_logit_softcapping": 0.5}
    model = _build(T.Gemma2Config, T.Gemma2ForCausalLM, seed, fixed, overrides)
    _randomise(model, seed, ("layernorm.weight",), scale=0.3)  # Gemma norms scale by 1 + w; w starts at 0
    # q, k weights large enough that attention logits reach the cap (at the 0.02 init they stay near 0, where
    # tanh is the identity and the cap changes nothing); the tiny logits (|z| < 0.5) reach the final cap
    _randomise(model, seed + 1, ("q_proj.weight", "k_proj.weight"), scale=0.3)
    return model


def gemma3(seed: int = 0, **overrides):
    """Gemma-3 text: sliding and full layers with a RoPE theta of their own each, q/k norms (random weights)."""
    rope = {FULL: {"rope_type": "default", "rope_theta": 1_000_000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0}}
    fixed = {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW,
             "layer_types": [SLIDING, SLIDING, FULL, SLIDING], "rope_parameters": rope}
    model = _build(T.Gemma3TextConfig, T.Gemma3ForCausalLM, seed, fixed, overrides)
    _randomise(model, seed, QK_NORMS, scale=0.5)  # Gemma norms scale by 1 + w
    return model


def phi3(seed: int = 0, **overrides):
    """Phi-3-mini: fused qkv_proj (and gate_up_proj), every layer over a sliding window."""
    return _build(T.Phi3Config, T.Phi3ForCausalLM, seed, {"sliding_window": WINDOW}, overrides)


def phi4_mini(seed: int = 0, **overrides):
    """Phi-4-mini: Phi3's fused projections with RoPE on 3/4 of each head's channels, no window."""
    fixed = {"hidden_size": 64, "intermediate_size": 128, "sliding_window": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}
    return _build(T.Phi3Config, T.Phi3ForCausalLM, seed, fixed, overrides)


def olmo2(seed: int = 0, **overrides):
    """OLMo-2: norms after attention and MLP (post-norm), q/k RMS norms over the full projection width."""
    model = _build(T.Olmo2Config, T.Olmo2ForCausalLM, seed, {}, overrides)
    _randomise(model, seed, QK_NORMS + ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
               around=1.0)
    return model


def smollm3(seed: int = 0, **overrides):
    """SmolLM3: every 4th layer has no RoPE at all (NoPE), the others RoPE."""
    fixed = {"no_rope_layers": [1, 1, 1, 0], "use_sliding_window": False}
    return _build(T.SmolLM3Config, T.SmolLM3ForCausalLM, seed, fixed, overrides)


def granite(seed: int = 0, **overrides):
    """Granite: embedding, residual and attention multipliers and a logits divisor, none of them the default 1."""
    fixed = {"embedding_multiplier": 6.0, "residual_multiplier": 0.3, "attention_multiplier": 0.05,
             "logits_scaling": 4.0}
    return _build(T.GraniteConfig, T.GraniteForCausalLM, seed, fixed, overrides)


FAMILIES: dict[str, Callable[..., T.PreTrainedModel]] = {
    "llama3": llama3,
    "mistral": mistral,
    "mistral-v0.1": mistral_v01,
    "qwen2.5": qwen25,
    "qwen3": qwen3,
    "qwen3-moe": qwen3_moe,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "phi3": phi3,
    "phi4-mini": phi4_mini,
    "olmo2": olmo2,
    "smollm3": smollm3,
    "granite": granite,
}

FEATURES = {
    "llama3": "llama3 RoPE scaling",
    "mistral": "no sliding window",
    "mistral-v0.1": "every layer sliding (16)",
    "qwen2.5": "random q/k/v biases",
    "qwen3": "head_dim 8, random q/k norms",
    "qwen3-moe": "4 experts, random q/k norms",
    "gemma2": "attention/final soft-capping, sliding/full alternating",
    "gemma3": "sliding/full, theta per layer type, q/k norms",
    "phi3": "fused qkv_proj, every layer sliding (16)",
    "phi4-mini": "fused qkv_proj, partial RoPE 0.75",
    "olmo2": "post-norm, full-width q/k norms",
    "smollm3": "NoPE every 4th layer",
    "granite": "multipliers and logits scaling",
}


def gpt_neox(seed: int = 0, **overrides):
    """GPT-NeoX (Pythia): fused query_key_value, parallel residual, partial RoPE; not a supported family."""
    kw = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
    torch.manual_seed(seed)
    cfg = T.GPTNeoXConfig(**{**kw, **overrides})
    cfg.architectures = ["GPTNeoXForCausalLM"]
    return T.GPTNeoXForCausalLM(cfg).eval()


def falcon(seed: int = 0, **overrides):
    """Falcon (new decoder architecture, grouped KV heads); not a supported family."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_kv_heads=2,
              new_decoder_architecture=True, max_position_embeddings=512, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(seed)
    cfg = T.FalconConfig(**{**kw, **overrides})
    cfg.architectures = ["FalconForCausalLM"]
    return T.FalconForCausalLM(cfg).eval()


UNSUPPORTED: dict[str, Callable[..., T.PreTrainedModel]] = {
    "gpt-neox": gpt_neox,
    "falcon": falcon,
}

MODEL_TYPES = {"gpt-neox": "gpt_neox", "falcon": "falcon"}  # what a refusal must name


# ----------------------------------------------------------------------------- the settings took effect


def _attn(model, i: int = 0):
    return model.model.layers[i].self_attn


def sliding_layers(model) -> list[int]:
    """Layers whose KV cache transformers keeps as a sliding window (what ``DynamicCache(config=...)`` builds)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, DynamicSlidingWindowLayer)]


SLIDING_LAYERS = {  # family -> its sliding-window layers
    "mistral-v0.1": [0, 1, 2, 3],
    "gemma2": [0, 2],
    "gemma3": [0, 1, 3],
    "phi3": [0, 1, 2, 3],
}


def _softcap_effect(model) -> float:
    """Largest change of a Gemma-2's eager logits when its attention and final soft-caps are removed."""
    import copy

    ids = torch.randint(0, model.config.vocab_size, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    plain = copy.deepcopy(model)
    plain.config.final_logit_softcapping = None
    for layer in plain.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    out = []
    for m in (model, plain):
        before = m.config._attn_implementation
        m.set_attn_implementation("eager")  # transformers' sdpa path drops the attention cap (its softcap kwarg)
        with torch.no_grad():
            out.append(m(ids).logits)
        m.set_attn_implementation(before)
    return float((out[0] - out[1]).abs().max())


def check(name: str, model) -> None:
    """Assert that the family's distinguishing settings took effect on the built ``model``."""
    cfg = model.config
    n = cfg.num_hidden_layers
    assert n == 4 and cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2, name
    assert not model.training and next(model.parameters()).dtype == torch.float32, name
    assert sliding_layers(model) == SLIDING_LAYERS.get(name, []), (name, sliding_layers(model))
    rot = model.model.rotary_emb
    if name == "llama3":
        assert cfg.rope_parameters["rope_type"] == "llama3" and rot.rope_type == "llama3"
        plain = 1.0 / (500000.0 ** (torch.arange(0, 8, 2).float() / 8))
        assert not torch.allclose(rot.inv_freq, plain)  # the low frequencies were stretched
    elif name == "mistral":
        assert cfg.sliding_window is None
    elif name == "qwen2.5":
        assert cfg.sliding_window is None and not cfg.use_sliding_window
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert proj.bias is not None and proj.bias.abs().min() > 0
    elif name in ("qwen3", "qwen3-moe"):
        assert cfg.head_dim == 8 and _attn(model).k_proj.out_features == 2 * 8
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                assert norm.weight.shape == (8,) and (norm.weight - 1).abs().min() > 0  # not all ones
        if name == "qwen3-moe":
            mlp = model.model.layers[0].mlp
            assert type(mlp).__name__ == "Qwen3MoeSparseMoeBlock" and cfg.num_experts == 4
    elif name == "gemma2":
        assert cfg.attn_logit_softcapping == 5.0 and cfg.final_logit_softcapping == 0.5
        assert _attn(model).attn_logit_softcapping == 5.0
        assert _softcap_effect(model) > 1e-2  # both caps change the (eager) logits
        assert [model.model.layers[i].self_attn.sliding_window for i in range(n)] == [WINDOW, None, WINDOW, None]
    elif name == "gemma3":
        assert cfg.model_type == "gemma3_text"
        thetas = {t: cfg.rope_parameters[t]["rope_theta"] for t in (FULL, SLIDING)}
        assert thetas == {FULL: 1_000_000.0, SLIDING: 10_000.0}
        assert not torch.allclose(getattr(rot, f"{FULL}_inv_freq"), getattr(rot, f"{SLIDING}_inv_freq"))
        for layer in model.model.layers:
            assert layer.self_attn.k_norm.weight.abs().min() > 0  # Gemma's norm is 1 + w: w = 0 is the identity
    elif name in ("phi3", "phi4-mini"):
        assert hasattr(_attn(model), "qkv_proj") and not hasattr(_attn(model), "k_proj")
        if name == "phi4-mini":
            assert cfg.sliding_window is None and cfg.rope_parameters["partial_rotary_factor"] == 0.75
            assert rot.inv_freq.numel() * 2 == int(0.75 * _attn(model).head_dim) == 12  # 12 of 16 channels rotate
        else:
            assert cfg.sliding_window == WINDOW and rot.inv_freq.numel() * 2 == _attn(model).head_dim
    elif name == "olmo2":
        attn = _attn(model)
        assert attn.k_norm.weight.shape == (2 * 8,) and (attn.k_norm.weight - 1).abs().min() > 0  # full width
        assert not hasattr(model.model.layers[0], "input_layernorm")  # post-norm: no norm before attention
    elif name == "smollm3":
        assert cfg.no_rope_layers == [1, 1, 1, 0]
        assert [bool(_attn(model, i).use_rope) for i in range(n)] == [True, True, True, False]
    elif name == "granite":
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) \
            == (6.0, 0.3, 0.05, 4.0)
        assert _attn(model).scaling == 0.05 and model.model.layers[0].residual_multiplier == 0.3


# ----------------------------------------------------------------------------- a model folder


def family_tokenizer(text: str):
    """A byte-level BPE tokenizer trained on ``text`` (conftest.tiny_folder's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text.split("\n\n"), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<s>", unk_token="<unk>")


def family_folder(root, name: str, text: str, seed: int = 0, model=None) -> Path:
    """A model folder ``load_pair`` and the CLI can load: family ``name`` (from ``FAMILIES`` or ``UNSUPPORTED``)
    with the vocabulary of a byte-level BPE tokenizer trained on ``text``, saved as safetensors beside the
    tokenizer (conftest.tiny_folder's recipe). ``model``: save this model instead (e.g. a perturbed consumer
    built with ``vocab_size=len(family_tokenizer(text))``)."""
    folder = Path(root)
    fast = family_tokenizer(text)
    if model is None:
        model = {**FAMILIES, **UNSUPPORTED}[name](seed, vocab_size=len(fast))
    assert model.config.vocab_size == len(fast), (model.config.vocab_size, len(fast))
    model.save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder)
    return folder
