"""The paged KV layout, prefix keys and file store of scdviz.serving.kv: plain torch, no engine needed."""

from __future__ import annotations

import pytest
import torch

from scdviz.serving import kv


def test_scatter_then_gather_gives_back_the_keys_and_values():
    cache = torch.zeros(6, 3, 8, 2 * 4)  # [blocks, Hkv, block_size, 2 D]
    keys, values = torch.randn(3, 16, 4), torch.randn(3, 16, 4)
    kv.scatter(cache, [4, 1], keys, values)
    k, v = kv.gather(cache, [4, 1, 2], 16)
    assert torch.equal(k, keys) and torch.equal(v, values)
    k, v = kv.gather(cache, [4, 1], 11)  # a prefix that ends inside a block
    assert torch.equal(k, keys[:, :11]) and torch.equal(v, values[:, :11])
    assert cache[[0, 2, 3, 5]].abs().sum() == 0  # other blocks untouched


def test_the_layout_is_transposed_keys_then_token_major_values_per_block_and_head():
    """What the vec kernels hold (found against transformers' K / V, docstring of scdviz.serving.kv)."""
    bs, d = 8, 4
    cache = torch.zeros(2, 1, bs, 2 * d)
    keys, values = torch.randn(1, bs, d), torch.randn(1, bs, d)
    kv.scatter(cache, [1], keys, values)
    block = cache[1, 0].reshape(-1)
    assert torch.equal(block[: bs * d].view(d, bs), keys[0].T)  # a key's dimensions lie block_size apart
    assert torch.equal(block[bs * d:].view(bs, d), values[0])


def test_only_whole_blocks_are_written():
    cache = torch.zeros(4, 1, 8, 8)
    with pytest.raises(ValueError, match="whole blocks"):
        kv.scatter(cache, [0, 1], torch.zeros(1, 12, 4), torch.zeros(1, 12, 4))


def test_matchable_leaves_a_token_and_takes_whole_blocks():
    assert kv.matchable(248, 128) == 128
    assert kv.matchable(257, 128) == 256
    assert kv.matchable(256, 128) == 128  # the last prompt token is always computed
    assert kv.matchable(100, 128) == 0


def test_the_store_finds_the_longest_stored_prefix_of_its_channel(tmp_path):
    store = kv.Store(tmp_path)
    ids = list(range(1000, 1400))
    store.put(kv.prefix_key("raw", ids[:128]), b"a")
    store.put(kv.prefix_key("raw", ids[:256]), b"bb")
    assert store.longest("raw", ids, 128) == 256
    assert store.longest("raw", ids[:256], 128) == 128  # 256 would leave no token to compute
    assert store.longest("scd-x", ids, 128) == 0  # another channel's payloads are not its own
    assert store.longest("raw", [7, *ids[1:]], 128) == 0  # another prefix
    assert store.get(kv.prefix_key("raw", ids[:256])) == b"bb"
    assert not list(tmp_path.glob(".*partial"))
