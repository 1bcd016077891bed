"""Sliding-window layers under eviction, by one rule (``scdviz.models.family``): they are never compressed.

A model's sliding-window layers (Mistral v0.1, Gemma-2/3, Phi-3-mini-4k, ...) already attend over at most W tokens;
kvpress leaves them alone for Gemma-3, and scdviz does so for every family. Eviction budgets apply to the
full-attention layers; a window layer keeps every token its cache holds (the attention mask applies its window).
A model whose every layer is sliding has nothing to compress: every eviction entry point refuses it.

Every entry point asks here, so the rule has one implementation:

  ``compressed_layers(model)``  the full-attention layers (ValueError, naming the window, when there are none);
                                reading it also registers the model's family, which ``is_window`` needs
  ``is_window(module)``         whether an attention layer is a window layer (hooks skip it)
  ``WindowLayersKept``          a kvpress press mixin: its forward hook leaves window layers alone, and applying it
                                to an all-sliding model is refused (``with press(model):`` used directly follows
                                the rule, not only ``hf.press_prefill``)
  ``compressed(model, x)``      a per-layer tensor (layers first) restricted to the full-attention layers (the
                                tensor itself when there are no window layers: a Llama-family model is untouched)
  ``counted(model)``            what a kept-token count counts, in words (``per layer and KV head`` without window
                                layers)
  ``kept_per_head(model, c)``   a pruned cache's tokens per KV head, over the full-attention layers
"""

from __future__ import annotations

import torch
from torch import Tensor

from scdviz.models import family as families
from scdviz.models import hf


def compressed_layers(model) -> list[int]:
    """The layers eviction compresses (all but the sliding-window ones); ValueError when every layer is sliding."""
    fam = hf.family(model)
    full = fam.full_layers
    if not full:
        raise ValueError(f"every layer of this model ({fam.model_type}) attends over a {fam.window}-token sliding "
                         "window: eviction has nothing to compress (sliding-window layers are never compressed, their "
                         "cache is already bounded by the window)")
    return full


def window_layers(model) -> list[int]:
    """The sliding-window layers (never compressed); empty for a model without them."""
    fam = hf.family(model)
    return [i for i in range(len(fam.layer_types)) if fam.sliding(i)]


def is_window(module) -> bool:
    """Whether an attention module is a sliding-window layer (its model's family read first: ``compressed_layers``)."""
    return hf.is_window_layer(module)


def layers_of(module) -> list[int]:
    """The full-attention layers of the model an attention module belongs to (every layer while its family was
    never read: a press applied inside a wrapper that skipped ``post_init_from_model``)."""
    fam = families.of_attention(module)
    return fam.full_layers if fam is not None else list(range(module.config.num_hidden_layers))


def compressed(model, per_layer: Tensor, dim: int = 0) -> Tensor:
    """``per_layer`` (layers along ``dim``) restricted to the full-attention layers; the same tensor when the model
    has no window layers."""
    if not window_layers(model):
        return per_layer
    index = torch.tensor(compressed_layers(model), device=per_layer.device)
    return per_layer.index_select(dim, index)


def counted(model) -> str:
    """What a count of kept tokens counts: ``per layer and KV head``, or, with window layers, per full-attention layer
    and KV head, naming the window layers left whole."""
    windows = window_layers(model)
    if not windows:
        return "per layer and KV head"
    full, fam = compressed_layers(model), hf.family(model)
    return (f"per full-attention layer and KV head (layers {_listed(full)}; the sliding-window layers "
            f"{_listed(windows)} are never compressed: they attend over {fam.window}-token windows)")


def _listed(layers: list[int]) -> str:
    if len(layers) <= 8:
        return ", ".join(map(str, layers))
    return f"{', '.join(map(str, layers[:6]))}, ... ({len(layers)} in all)"


def kept_per_head(model, cache) -> float:
    """Mean tokens a pruned cache lets each full-attention layer's KV heads attend to (``hf.kept_per_head`` over
    those layers; over every layer without window layers)."""
    return hf.kept_per_head(model, cache, compressed_layers(model) if window_layers(model) else None)


class WindowLayersKept:
    """Mixin for a kvpress press (first among its bases): window layers are never compressed.

    ``forward_hook`` returns a window layer's output untouched (its cache whole) and hands every other layer to
    ``full_layer_hook`` (kvpress's hook by default; a press with a hook of its own overrides that one);
    ``post_init_from_model`` (kvpress calls it on ``with press(model):``) refuses a model whose every layer is
    sliding and registers the model's family.
    """

    def post_init_from_model(self, model) -> None:
        compressed_layers(model)
        super().post_init_from_model(model)

    def forward_hook(self, module, input, kwargs, output):
        if is_window(module):
            return output
        return self.full_layer_hook(module, input, kwargs, output)

    def full_layer_hook(self, module, input, kwargs, output):
        """The press's hook on a full-attention layer."""
        return super().forward_hook(module, input, kwargs, output)
