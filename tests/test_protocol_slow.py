"""Slow tier: the eval slices with the built-in pair's tokenizer: what was read before the protocol is
in dev, and the test slice is big enough for every headline (>= 64 items)."""

from __future__ import annotations

import itertools

import pytest

from scdviz import data

pytestmark = pytest.mark.slow

# The largest windows any record or script read before the slices existed, all from the opening of each
# eval split: the eviction protocol's 11 contexts of 512 + 16 + 32 tokens per corpus (the most), the SCD
# benches' 16 prompts of 256 + 32, the TTFT bench's 3 prompts of 1024 + 1 (jargon).
READ_BEFORE = ((560, 11), (288, 16), (1025, 3))


@pytest.mark.parametrize("corpus", sorted(data.corpora()))
def test_every_window_read_before_the_protocol_lies_in_dev(builtin_pair, corpus):
    tok = builtin_pair.tokenizer
    passages = data.load_split(corpus, "eval")
    dev = len(data.slice_passages(passages, "dev"))
    lengths = [len(tok(p + "\n\n", add_special_tokens=False)["input_ids"]) for p in passages]
    ends = list(itertools.accumulate(lengths))
    for length, count in READ_BEFORE:
        read = length * count  # tokens read from the start of the split
        last = next(i for i, end in enumerate(ends) if end >= read)  # the passage holding the last token read
        assert last < dev, f"{corpus}: {count} windows of {length} reach passage {last}, dev ends at {dev}"


@pytest.mark.parametrize(("corpus", "length", "n"), [("austen", 288, 64), ("jargon", 288, 64)]
                         + [(c, 560, 11) for c in ("austen", "bible", "gcide", "handbook", "jargon", "manpages")])
def test_the_test_slice_holds_every_headline(builtin_pair, corpus, length, n):
    """The SCD headlines: 64 prompts of 256 + 32 tokens on each specialist's own domain; the eviction
    headline: 66 contexts, 11 per corpus. Windows are distinct and come from many passages."""
    windows = data.eval_windows(builtin_pair.tokenizer, corpus, "test", length, n)
    assert len(windows) == n and len({tuple(w.ids) for w in windows}) == n
    dev_end = len(data.slice_passages(data.load_split(corpus, "eval"), "dev"))
    assert min(w.passage for w in windows) >= dev_end
    assert len({w.cluster for w in windows}) >= min(n, 20)
