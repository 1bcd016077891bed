"""DistillCachePress: the learned policy as a kvpress press (prefill compression).

A kvpress ``ScorerPress``: use it as ``with press(model): model(...)`` or in kvpress's
pipeline beside the other presses. Its scores come from the policy over the 5 token
features of each layer's attention (needs eager attention, like ObservedAttentionPress).
A lookahead policy (``PolicyConfig.lookahead``) also reads continuations sampled after the
whole prefill, which a layer-by-layer hook cannot see: the press refuses it with a message
(use ``scdviz.evict.context.observe`` and ``prune``, as ``bench evict`` and the app do).

Two scopes, following the policy's config:
  per_head  each layer and KV head keeps its own top-B (``score`` returns (B, Hkv, T));
  global    one token set for all layers: features are averaged over layers while the
            prefill runs, and at the last layer every layer's cache is pruned to the same
            tokens (as the method is specified: docs/design.md).

Sliding-window layers are never compressed (``scdviz.evict.windows.WindowLayersKept``): the hook leaves them whole
and the global scope's "all layers" are the full-attention ones (features averaged over them, the set chosen at
the last of them); a model whose every layer is sliding is refused.

Inside kvpress's wrapper presses (tests/test_press_wrappers.py):
  per_head  works in KeyRerotationPress, CriticalKVPress, PerLayerCompressionPress,
            DecodingPress, and first in a ComposedPress (a press after another that pruned
            the layer gets attention over the unpruned tokens: refused with a message).
            AdaKVPress refuses eager attention (kvpress's head-wise masking does not cover
            it) while the press needs attention probabilities, so AdaKV needs an attention
            implementation registered under another name that returns them; ChunkPress
            refuses attention probabilities altogether.
  global    refuses every wrapper that scores layer by layer, runs beside another pruning
            press or changes the ratio per layer, with a ValueError naming the way out.

This module does not train the policy (train.py) nor evict while decoding (decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvpress import ScorerPress
from kvpress.presses.base_press import is_prefilling
from torch import Tensor, nn

from scdviz.evict import features as F
from scdviz.evict import windows
from scdviz.evict.context import gather_kv
from scdviz.evict.policy import Policy, compression_ratio, keep_count, top_b
from scdviz.models import hf


@dataclass
class DistillCachePress(windows.WindowLayersKept, ScorerPress):
    """Learned KV-cache eviction (DistillCache): an MLP over 5 attention features per token.

    The DistillCache method (docs/design.md): REINFORCE-trained top-B selection.

    Parameters
    ----------
    policy : Policy
        The trained scorer (``Policy.load(path)``); its config decides per-head vs global
        scope and the query window W.
    compression_ratio : float
        Fraction of the context removed (kvpress convention); ``DistillCachePress.keeping``
        builds one from a kept fraction.
    """

    policy: Policy | None = None
    compression_ratio: float = 0.0
    _global: list[Tensor] = field(default_factory=list, repr=False)  # per-layer (B, 1, T, 5) during a prefill
    _layers: list[int] = field(default_factory=list, repr=False)  # the full-attention layers of the model it is on
    _ratio: float = field(default=0.0, repr=False)  # global scope: the compression ratio at layer 0 of this prefill

    def __post_init__(self):
        super().__post_init__()
        if self.policy is None:
            raise ValueError("DistillCachePress needs a policy (Policy.load(path))")

    def post_init_from_model(self, model) -> None:
        """Remember the layers it compresses (a cache may grow its layers lazily during the prefill); a model
        whose every layer is sliding is refused (``windows.WindowLayersKept``)."""
        super().post_init_from_model(model)
        self._layers = windows.compressed_layers(model)
        self._global.clear()
        self.policy.to(hf.device_of(model))  # features are computed on the model's device (in fp32)

    @classmethod
    def keeping(cls, policy: Policy, keep: float) -> DistillCachePress:
        """A press that keeps the fraction ``keep`` of the context."""
        return cls(policy=policy, compression_ratio=compression_ratio(keep))

    @classmethod
    def from_pretrained(cls, path, compression_ratio: float = 0.0) -> DistillCachePress:
        """A press from a saved policy file (``Policy.save``; safetensors, no code), kvpress-style.

        The policy moves to the model's device when the press is applied (``with press(model):``).
        """
        return cls(policy=Policy.load(path), compression_ratio=compression_ratio)

    def _refuse_wrapping(self, how: str) -> None:
        raise ValueError(
            f"the global DistillCache press keeps one token set for all layers, chosen at the last layer, so it "
            f"cannot run {how}; use a per-head policy (PolicyConfig(per_head=True)) there, or apply the global "
            "press on its own")

    def layer_features(self, module: nn.Module, values: Tensor, attentions: Tensor | None, groups: int) -> Tensor:
        """Features of one layer after a prefill: (B, groups, T, 5)."""
        if attentions is None:
            raise ValueError('DistillCachePress needs attention probabilities: use attn_implementation="eager"')
        if attentions.shape[-1] != values.shape[-2]:
            if not self.policy.config.per_head:
                self._refuse_wrapping("beside another press that prunes layer by layer (ComposedPress)")
            raise ValueError(
                f"DistillCachePress scores from the attention over all {attentions.shape[-1]} prefill tokens, but "
                f"layer {module.layer_idx} holds {values.shape[-2]}: a press before it pruned the layer; put "
                "DistillCachePress first in a ComposedPress")
        device = attentions.device
        if next(self.policy.parameters()).device != device:  # wrappers that skip post_init_from_model
            self.policy.to(device)
        return F.prefill_layer_features(attentions, values, self.policy.config.window, groups)

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> Tensor:
        """Policy scores (B, Hkv, T) of one layer's tokens (per-head scope; wrappers such as
        KeyRerotationPress or AdaKVPress call this, which the global scope refuses)."""
        if not self.policy.config.per_head:
            self._refuse_wrapping("inside a wrapper press that scores layer by layer "
                                  "(KeyRerotationPress, AdaKVPress, ...)")
        with torch.no_grad():
            return self.policy(self.layer_features(module, values, attentions, keys.shape[1]))

    def full_layer_hook(self, module: nn.Module, input: list[Tensor], kwargs: dict, output: list):
        """On a full-attention layer (window layers are left whole: ``windows.WindowLayersKept``). Per-head scope:
        kvpress's hook. Global scope: collect features, prune every full-attention layer at the last of them."""
        if self.policy.config.per_head:
            return super().full_layer_hook(module, input, kwargs, output)
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output
        layers = self._layers or windows.layers_of(module)  # a wrapper may have skipped post_init_from_model
        if module.layer_idx == layers[0]:  # a new prefill
            self._global.clear()
            self._ratio = self.compression_ratio
        elif self.compression_ratio != self._ratio:
            self._global.clear()
            self._refuse_wrapping("with a compression ratio per layer (PerLayerCompressionPress)")
        if self.compression_ratio == 0:
            return output
        cache = kwargs["past_key_values"]
        self._global.append(self.layer_features(module, hf.layer_kv(cache, module.layer_idx)[1], output[1], 1))
        if module.layer_idx == layers[-1]:
            self._prune_all(cache, layers)
        return output

    def _prune_all(self, cache, layers: list[int]) -> None:
        """Keep one token set, chosen from the features averaged over ``layers`` (the full-attention ones), in each
        of them."""
        with torch.no_grad():
            scores = self.policy(F.global_features(self._global))  # (B, T)
        self._global.clear()
        idx = top_b(scores, keep_count(scores.shape[-1], 1.0 - self.compression_ratio))
        # (a window layer after the last full one is not in the cache yet)
        if any(hf.layer_kv(cache, layer)[0].shape[-2] != scores.shape[-1] for layer in layers):
            self._refuse_wrapping("beside another press that prunes layer by layer (ComposedPress)")
        for layer in layers:
            hf.set_layer_kv(cache, layer, *gather_kv(*hf.layer_kv(cache, layer), idx))
