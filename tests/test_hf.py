"""Fast tier: the HF-internals module on tiny random Llama, Mistral, Qwen2, Qwen3 models."""

from __future__ import annotations

import pytest
import torch

from scdviz.models import hf


def _ids(n: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (1, n), generator=g)


def test_captured_post_rope_keys_equal_cache_keys(tiny):
    ids = _ids()
    tr = hf.forward(tiny, ids, capture=hf.CAPTURE_ALL)
    cos, sin = hf.rope(tiny, tr.positions)
    n_layers = hf.n_layers(tiny)
    assert len(tr.keys_pre) == len(tr.keys) == n_layers
    for k_pre, k_post in zip(tr.keys_pre, tr.keys):
        assert k_pre.shape == k_post.shape == (1, 2, 12, k_post.shape[-1])
        torch.testing.assert_close(hf.rotate(k_pre, cos, sin), k_post)


def test_unrotate_inverts_rotate(tiny):
    positions = torch.arange(5, 25).unsqueeze(0)
    cos, sin = hf.rope(tiny, positions)
    head_dim = hf.attn_heads(tiny)[2]
    keys = torch.randn(1, 2, 20, head_dim)
    torch.testing.assert_close(hf.unrotate(hf.rotate(keys, cos, sin), cos, sin), keys)
    assert not torch.allclose(hf.rotate(keys, cos, sin), keys)


def test_h_in_is_the_input_layernorm_output(tiny):
    tr = hf.forward(tiny, _ids(), capture=hf.CAPTURE_ALL)
    for idx, layer in enumerate(hf.layers(tiny)):
        with torch.no_grad():
            expected = layer.input_layernorm(tr.resid[idx])
        torch.testing.assert_close(tr.h_in[idx], expected)
    # the residual stream after the last layer feeds the final norm
    with torch.no_grad():
        final = hf.decoder(tiny).norm(tr.resid[-1])
        torch.testing.assert_close(tiny.lm_head(final), tr.logits)


def test_kv_regenerated_from_h_in_equals_cache(tiny):
    tr = hf.forward(tiny, _ids(), capture=hf.CAPTURE_ALL)
    for idx in range(hf.n_layers(tiny)):
        k, v = hf.kv_from_hin(tiny, idx, tr.h_in[idx], tr.positions)
        torch.testing.assert_close(k, tr.keys[idx])
        torch.testing.assert_close(v, tr.values[idx])


def test_rebuilt_cache_continues_exactly(tiny):
    ids = _ids(16)
    prompt, cont = ids[:, :10], ids[:, 10:]
    full = hf.forward(tiny, ids).logits[:, 10:]
    tr = hf.forward(tiny, prompt)
    rebuilt = hf.make_cache(tiny, [k.clone() for k in tr.keys], [v.clone() for v in tr.values])
    torch.testing.assert_close(hf.continue_logits(tiny, rebuilt, cont, 10), full)
    assert hf.cache_len(rebuilt) == [10] * hf.n_layers(tiny)  # continue_logits cloned it


def test_generate_matches_argmax_chain_and_handles_pruned_cache(tiny):
    ids = _ids(10)
    tr = hf.forward(tiny, ids[:, :-1])
    out = hf.generate(tiny, tr.cache, ids[:, -1:], 9, 5)
    # reference: plain full recomputation each step
    seq = ids.clone()
    for token in out:
        nxt = int(hf.forward(tiny, seq).logits[0, -1].argmax())
        assert nxt == token
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    # a pruned cache (drop tokens 2..4) still decodes at the right positions
    keep = torch.tensor([0, 1, 5, 6, 7, 8])
    pruned = hf.make_cache(tiny, [k[:, :, keep] for k in tr.keys], [v[:, :, keep] for v in tr.values])
    steps = []
    hf.generate(tiny, pruned, ids[:, -1:], 9, 3, on_step=lambda c, s: steps.append(hf.cache_len(c)[0]))
    assert steps == [7, 8, 9]  # 6 kept + last prompt token, then + each generated token


def test_generate_each_equals_one_generation_per_cache(tiny):
    """Batched greedy decoding (a full cache beside pruned ones: left-padded, padding masked) produces
    each cache's own tokens; a cache whose layers differ in length is decoded alone; caches unchanged."""
    ids = _ids(14)
    tr = hf.forward(tiny, ids[:, :-1])
    full = hf.make_cache(tiny, tr.keys, tr.values)
    keep_a, keep_b = torch.tensor([0, 1, 5, 6, 7, 8, 12]), torch.tensor([0, 3, 4, 9, 10, 11, 12])
    pruned = [hf.make_cache(tiny, [k[:, :, i] for k in tr.keys], [v[:, :, i] for v in tr.values])
              for i in (keep_a, keep_b)]
    short = torch.tensor([0, 12])
    ragged = hf.make_cache(tiny, [k[:, :, keep_a if n % 2 else short] for n, k in enumerate(tr.keys)],
                           [v[:, :, keep_a if n % 2 else short] for n, v in enumerate(tr.values)])
    caches = [full, *pruned, ragged]
    each = hf.generate_each(tiny, caches, ids[:, -1:], 13, 6)
    alone = [hf.generate(tiny, c, ids[:, -1:], 13, 6) for c in caches]
    assert each == alone and len(set(map(tuple, alone))) > 1  # the caches do decode differently
    assert [hf.cache_len(c)[0] for c in caches[:3]] == [13, 7, 7]
    eos = alone[1][2]  # a row that meets its end-of-sequence token stops there, the others go on
    stopped = hf.generate_each(tiny, caches[:3], ids[:, -1:], 13, 6, eos_token_id=eos)
    assert stopped == [hf.generate(tiny, c, ids[:, -1:], 13, 6, eos_token_id=eos) for c in caches[:3]]
    assert stopped[1] == alone[1][:3]
    lengths = [6, 2, 4, 3]  # one length per cache: the short rows leave the batch, the rest go on
    assert hf.generate_each(tiny, caches, ids[:, -1:], 13, lengths) == [a[:n] for a, n in zip(alone, lengths)]


def test_continue_each_equals_one_continuation_per_cache(tiny):
    """Teacher-forced logits batched per cache length equal each cache's own; odd ones run alone."""
    ids = _ids(16)
    tr = hf.forward(tiny, ids[:, :12])
    cut = [torch.tensor(i) for i in ([0, 1, 5, 6, 7], [0, 2, 3, 9, 11], [1, 2, 3, 4, 5, 6, 7, 8])]
    caches = [hf.make_cache(tiny, [k[:, :, i] for k in tr.keys], [v[:, :, i] for v in tr.values]) for i in cut]
    caches.append(hf.make_cache(tiny, [k[:, :, cut[n % 2]] if n else k for n, k in enumerate(tr.keys)],
                                [v[:, :, cut[n % 2]] if n else v for n, v in enumerate(tr.values)]))
    each = hf.continue_each(tiny, caches, ids[:, 12:], 12)
    for got, cache in zip(each, caches, strict=True):
        torch.testing.assert_close(got, hf.continue_logits(tiny, cache, ids[:, 12:], 12)[0])
    assert not torch.allclose(each[0], each[1])
    assert [hf.cache_len(c)[0] for c in caches[:3]] == [5, 5, 8]  # not changed


def test_rows_attention_gives_eager_probabilities_and_sdpa_output(tiny):
    """``hf.ROWS``: SDPA's output with the attention probabilities computed from q·k grouped by KV head:
    eager's probabilities for a causal prefill and for a batch of decode steps; the logits unchanged."""
    ids = _ids(12)
    got = {}
    for impl in ("eager", hf.ROWS):
        with hf.attention(tiny, impl):
            prefill = hf.forward(tiny, ids, attentions=True)
            cache = hf.make_cache(tiny, [k.expand(3, -1, -1, -1) for k in prefill.keys],
                                  [v.expand(3, -1, -1, -1) for v in prefill.values])
            step = hf.forward(tiny, torch.tensor([[5], [6], [7]]), cache=cache, positions=torch.full((3, 1), 12),
                              attentions=True)
            got[impl] = (prefill, step)
    for eager, rows in zip(got["eager"], got[hf.ROWS], strict=True):
        torch.testing.assert_close(rows.logits, eager.logits)
        for a, b in zip(rows.attn, eager.attn, strict=True):
            torch.testing.assert_close(a, b)
    assert got[hf.ROWS][1].attn[0].shape == (3, 4, 1, 13)
    assert tiny.config._attn_implementation not in ("eager", hf.ROWS)  # restored
    last = hf.forward(tiny, ids, last_logits=True).logits  # the LM head on the last position only
    torch.testing.assert_close(last, got["eager"][0].logits[:, -1:])
    tail = hf.forward(tiny, ids, last_logits=5).logits  # an int: the last 5 positions
    assert tail.shape[1] == 5
    torch.testing.assert_close(tail, got["eager"][0].logits[:, -5:])


def test_attention_probabilities_need_eager_and_sum_to_one(tiny):
    with pytest.raises(ValueError, match="eager"):
        tiny.set_attn_implementation("sdpa")
        hf.forward(tiny, _ids(), attentions=True)
    hf.set_eager(tiny)
    tr = hf.forward(tiny, _ids(), attentions=True)
    assert len(tr.attn) == hf.n_layers(tiny)
    a = tr.attn[0]
    assert a.shape == (1, 4, 12, 12)
    torch.testing.assert_close(a.sum(-1), torch.ones(1, 4, 12))
    assert torch.all(a.triu(1) == 0)  # causal


def test_hooks_are_removed(tiny):
    hf.forward(tiny, _ids(), capture=hf.CAPTURE_ALL)
    for module in tiny.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_attention_hook_sees_each_layer_and_can_prune(tiny):
    hf.set_eager(tiny)
    seen = []

    def keep_last_four(module, hidden, keys, values, attn, kwargs):
        seen.append((module.layer_idx, tuple(attn.shape), tuple(hidden.shape)))
        return keys[:, :, -4:], values[:, :, -4:]

    with hf.attention_hook(tiny, keep_last_four):
        cache = hf.forward(tiny, _ids()).cache
    heads = hf.attn_heads(tiny)[0]
    assert [s[0] for s in seen] == list(range(hf.n_layers(tiny)))
    assert all(s[1] == (1, heads, 12, 12) for s in seen)
    assert hf.cache_len(cache) == [4] * hf.n_layers(tiny)
    assert hf.cache_len(hf.forward(tiny, _ids()).cache) == [12] * hf.n_layers(tiny)  # hooks removed


def test_a_forked_child_never_inherits_a_held_model_lock():
    """A ZeroGPU worker is forked from a server whose threads may hold a model's lock at that moment; the child's
    copy of a held lock would never be released, so the child gets locks of its own."""
    import os
    import threading

    from conftest import tiny_model

    model = tiny_model("llama")
    held, release = threading.Event(), threading.Event()

    def hold():
        with hf.exclusive(model):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: the model's lock is free here, though the parent's thread holds it
        got = threading.Event()

        def take():
            with hf.exclusive(model):
                got.set()

        threading.Thread(target=take, daemon=True).start()
        os._exit(0 if got.wait(5) else 1)
    release.set()
    thread.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
