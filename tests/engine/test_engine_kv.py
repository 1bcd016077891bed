"""The paged KV layout, prefix keys and file store of scdviz.serving.kv, and the engine table rendered from its record
(scdviz.serving.table): no engine needed."""

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


def _engine_record():
    from scdviz import records

    def row(spec, prefix, channel, method, engine_ms, ttft=None, **more):
        out = {"specialist": spec, "prefix_tokens": prefix, "channel": channel, "method": method,
               "engine_ms": engine_ms, "engine_iqr_ms": [engine_ms - 5, engine_ms + 5], "producer_request_ms": 2000.0}
        if ttft is not None:
            out.update({f"ttft_{g}gbps_ms": t for g, t in zip((1, 10, 100), ttft, strict=True)})
            out.update({f"ttft_with_encode_{g}gbps_ms": t + 250.0 for g, t in zip((1, 10, 100), ttft, strict=True)})
            out.update({"bytes_per_token": 6745.0, "encode_ms": 250.0, "load_ms": 600.0, "kl_engine": 0.0325,
                        "kl_outside": 0.0324, "top1_engine": 0.89, "top1_outside": 0.89})
        return out | more

    rows = [row("jargon", 1024, "own", "own prefill", 3000.0),
            row("jargon", 1024, "raw", "raw KV", 500.0, (690.0, 520.0, 502.0)),
            row("jargon", 1024, "scd-jargon-reuse", "SCD reuse-only int4", 850.0, (910.0, 856.0, 851.0)),
            row("austen-before", 1024, "own", "own prefill", 700.0),
            row("austen-before", 1024, "scd-austen-before-reuse", "SCD reuse-only int4", 800.0, (860.0, 806.0, 801.0))]
    settings = {"research": "engine_demo", "slice": "dev", "latency_ms": 0.5, "repeats": 3, "timing_prompts": 2,
                "prompts": 2, "cont": 32, "domains": ["jargon", "austen"],
                "command": "python -m research.engine_demo --record"}
    versions = {"hardware": {"cpu_count": 2}, "engine": {"vllm": "0.32.0"},
                "load_average": {"start": [1.0, 1.5, 2.0], "end": [1.2, 1.4, 1.9]}}
    return records.BenchRecord("ttft", settings, 0, rows, versions)


def test_the_engine_table_comes_from_its_record(tmp_path):
    """scdviz.serving.table: a row per run, the link columns the rows carry, the formula, the load average, the
    issue's bar per specialist (SCD below the own prefill at 1k tokens and 1 Gbit/s, or said NOT to be) and the
    record's command; ``scd_engine`` reads through the reader it is given (report.shipped_record in the docs)."""
    from scdviz import records
    from scdviz.serving import table

    record = _engine_record()
    text = table.render(record, "assets/scd/engine.json")
    assert "TTFT ms at 1 / 10 / 100 Gbit/s" in text
    assert ("| jargon | 1,024 + 1 | SCD reuse-only int4 | 6,745 | 850 [845, 855] | 600 | 910 / 856 / 851 | 250 | "
            "0.03250 / 0.03240 | 0.8900 / 0.8900 |") in text
    assert "| jargon | 1,024 + 1 | own prefill |  | 3,000 [2,995, 3,005] |  | = engine ms (nothing sent) |" in text
    assert "TTFT = engine ms + latency (0.5 ms) + payload bytes × 8 / bandwidth" in text
    assert "at start 1.00 / 1.50 / 2.00" in text
    assert ("jargon, 1k tokens at 1 Gbit/s: own prefill 3,000 ms; raw KV 690 ms (below; 940 ms with the producer's "
            "encode added, below); SCD reuse-only int4 910 ms (below; 1,160 ms with the producer's encode added, "
            "below).") in text
    assert "SCD reuse-only int4 860 ms (NOT below; 1,110 ms with the producer's encode added, NOT below)" in text
    last = text.splitlines()[-1]  # as every table of scdviz.report ends
    assert last == ("*Records (and the command that made each):* `assets/scd/engine.json` (dev slice): "
                    "`python -m research.engine_demo --record`.")
    path = records.write(record, tmp_path / "engine.json")
    asked = []
    assert table.scd_engine(lambda rel: asked.append(rel) or records.read(path)) == text
    assert asked == [table.RECORD]
