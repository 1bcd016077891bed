"""Gemma-3-270m's GGUF in transformers 5.2: perplexity with transformers' own tokenizer vs the rebuilt one.

    SCDVIZ_THREADS=1 python -m research.gemma_check

Four passages of Austen's eval split (about 1,150 characters each, from offsets 0, 30k, 60k
and 90k), scored by the same model weights (transformers' GGUF loading) under four
tokenisations: transformers' conversion as it is, the same with <bos> prepended by hand,
and the BPE rebuild (``scdviz.models.builtin.gemma_tokenizer``) with and without <bos>.
Per-token perplexities of different tokenisations are not comparable, so nats per
character are printed too. Also greedy text for one prompt under each tokenizer.
"""

from __future__ import annotations

import argparse
import math

import torch

from scdviz import settings
from scdviz.models import builtin
from scdviz.models.pair import choose_threads


def passages() -> list[str]:
    text = (settings.ASSETS_DIR / "text" / "austen" / "eval.txt").read_text()
    out = []
    for off in (0, 30000, 60000, 90000):
        a = text.index(" ", off) + 1 if off else 0
        out.append(text[a : text.rindex(" ", 0, a + 1150)])
    return out


def score(model, encode, texts: list[str]) -> tuple[float, float, int]:
    """(perplexity, nats per character, tokens scored)."""
    nll, n, chars = 0.0, 0, 0
    for t in texts:
        ids = torch.tensor([encode(t)])
        with torch.no_grad():
            nll += float(model(ids, labels=ids).loss) * (ids.shape[1] - 1)
        n, chars = n + ids.shape[1] - 1, chars + len(t)
    return math.exp(nll / n), nll / chars, n


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m research.gemma_check", description=__doc__.splitlines()[0]).parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    choose_threads()
    gguf = builtin.fetch_gemma_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ours = builtin.gemma_tokenizer(gguf)
    bos = ours.bos_token_id

    def plain(tok):
        return lambda t: tok(t, add_special_tokens=False)["input_ids"]

    def with_bos(tok):
        return lambda t: [bos] + tok(t, add_special_tokens=False)["input_ids"]

    texts = passages()
    print(f"{'tokenisation':45} {'PPL':>8} {'nats/char':>10} {'tokens':>7}")
    for name, enc in (("transformers 5.2's conversion", lambda t: theirs(t)["input_ids"]),
                      ("transformers' conversion + <bos> by hand", with_bos(theirs)),
                      ("rebuilt as BPE, no <bos>", plain(ours)),
                      ("rebuilt as BPE (adds <bos> itself)", lambda t: ours(t)["input_ids"])):
        ppl, npc, n = score(model, enc, texts)
        print(f"{name:45} {ppl:8.2f} {npc:10.3f} {n:7d}")
    prompt = "The capital of France is"
    for name, tok in (("transformers' tokenizer", theirs), ("rebuilt tokenizer", ours)):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        out = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
        print(f"{name}: {ids[0].tolist()} -> {tok.decode(out)!r}")


if __name__ == "__main__":
    main()
