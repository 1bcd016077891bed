"""Fast tier: the layer-wise helpers SCD added to scdviz.models.hf, on every tiny family."""

from __future__ import annotations

import torch

from scdviz.models import hf


def test_run_layers_from_own_residual_reproduces_the_prefill(tiny):
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(0))
    tr = hf.forward(tiny, ids, capture={"resid"})
    out, keys, values = hf.run_layers(tiny, tr.resid[1], tr.positions, 1, 3)
    torch.testing.assert_close(out, tr.resid[3])
    for i, layer in enumerate(range(1, 3)):
        torch.testing.assert_close(keys[i], tr.keys[layer])
        torch.testing.assert_close(values[i], tr.values[layer])


def test_kv_weights_regenerate_the_values(tiny):
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    tr = hf.forward(tiny, ids, capture={"h_in"})
    wk, wv = hf.kv_weights(tiny, 0)
    n_kv, head_dim = hf.attn_heads(tiny)[1:]
    bias = hf.layers(tiny)[0].self_attn.v_proj.bias
    v = tr.h_in[0] @ wv.T + (bias if bias is not None else 0)
    torch.testing.assert_close(v.view(1, 7, n_kv, head_dim).transpose(1, 2), tr.values[0])
    assert wk.shape == (n_kv * head_dim, tiny.config.hidden_size)


def test_decoder_cache_equals_the_full_forward_cache(tiny):
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    full = hf.forward(tiny, ids).cache
    for a, b in zip(hf.decoder_cache(tiny, ids).layers, full.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
