"""Which kvpress presses cannot score a model's family correctly, and why: they are refused by name, never run wrong.

Some kvpress presses rebuild a layer's queries and attention themselves rather than read the model's
(``kvpress.utils.get_prerope_query_states``, then rotate-half RoPE over the whole head from the layer's
``position_embeddings`` or ``module.rotary_emb``, scores x 1/sqrt(head_dim), a plain softmax):

  always                  ExpectedAttention (the statistics of future queries), and AdaKV over it;
  without probabilities   SnapKV, TOVA, PyramidKV, KVzip and the AdaKV / CriticalKV wrappers over SnapKV: given
                          eager attention (the shared prefill of ``bench evict`` and the eviction view, the decode
                          evictor's rows) they read the model's own probabilities and are exact on every family.

A rebuilt attention is the model's only when the family has nothing that rebuild leaves out; ``limits`` names
what it does leave out: RoPE per layer type (Gemma-3), partial rotary (Phi-3.5/4-mini), NoPE layers (SmolLM3), a
q-norm kvpress does not apply (over all heads, OLMo-2; Qwen3-MoE's, whose attention class kvpress does not know),
a scaling other than 1/sqrt(head_dim) (Granite's attention multiplier, a Gemma query_pre_attn_scalar other than
head_dim) and logit softcapping (Gemma-2). Such a press is refused on such a model (``refusal``), in one line.
"""

from __future__ import annotations

import math

from scdviz.models import hf


def _kinds():
    from kvpress import ExpectedAttentionPress, KVzipPress, SnapKVPress, TOVAPress

    return (ExpectedAttentionPress,), (SnapKVPress, TOVAPress, KVzipPress)  # PyramidKV is a SnapKVPress


def limits(model) -> list[str]:
    """What in ``model``'s attention kvpress's rebuilt attention leaves out (empty: a Llama-like attention)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    fam = hf.family(model)
    out = []
    if fam.rope_per_type:
        out.append("RoPE per layer type")
    if fam.rotary_dim < fam.head_dim:
        out.append(f"partial rotary ({fam.rotary_dim} of {fam.head_dim} dims)")
    if not all(fam.rope):
        out.append("NoPE layers")
    attns = [layer.self_attn for layer in hf.layers(model)]
    if any(getattr(a, "q_norm", None) is not None and not isinstance(a, Qwen3Attention | Gemma3Attention)
           for a in attns):
        out.append("a q-norm kvpress does not apply")
    scaling = {float(getattr(a, "scaling", fam.head_dim ** -0.5)) for a in attns}
    if any(not math.isclose(s, fam.head_dim ** -0.5, rel_tol=1e-6) for s in scaling):
        out.append(f"attention scaling {sorted(scaling)[0]:.4g}, not 1/sqrt(head_dim)")
    if fam.softcap:
        out.append(f"attention-logit softcapping ({fam.softcap:g})")
    return out


def _inner(press):
    """The scorer inside kvpress's wrapper presses (AdaKV, CriticalKV, ...), or the press itself."""
    while hasattr(press, "press") and press.press is not press:
        press = press.press
    return press


def rebuilds(press, eager: bool) -> bool:
    """Whether ``press`` rebuilds queries and attention itself (``eager``: attention probabilities are given)."""
    always, without_probabilities = _kinds()
    inner = _inner(press)
    return isinstance(inner, always) or (not eager and isinstance(inner, without_probabilities))


def refusal(press, model, eager: bool) -> str | None:
    """Why ``press`` cannot score ``model`` correctly (one line), or None when it can."""
    if not rebuilds(press, eager):
        return None
    missing = limits(model)
    if not missing:
        return None
    how = "" if isinstance(_inner(press), _kinds()[0]) else " without attention probabilities (SDPA)"
    return (f"kvpress's {type(_inner(press)).__name__} rebuilds each layer's queries and attention{how} as Llama's "
            f"(rotate-half RoPE on whole heads, 1/sqrt(head_dim), no softcapping); this "
            f"{hf.family(model).model_type} model has {', '.join(missing)}")


def check(press, model, eager: bool) -> None:
    """ValueError with ``refusal``'s line when the press cannot score the model correctly."""
    why = refusal(press, model, eager)
    if why:
        raise ValueError(why)
