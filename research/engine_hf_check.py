"""Does scdviz's transformers layer (scdviz.models.hf, the codec) give the same numbers under the engine venv's
transformers (5.19) as under the project's (5.2)? Run it in both environments on the same token ids and compare:

    python -m research.engine_hf_check dump OUT_52.pt                 # project env: windows + results
    .engine-venv/bin/python -m research.engine_hf_check dump OUT_519.pt --ids OUT_52.pt
    python -m research.engine_hf_check compare OUT_52.pt OUT_519.pt

Models are loaded from the safetensors folders (scdviz.serving.models writes the merged specialist) with
AutoModelForCausalLM in float32, never through load_pair (peft and the 5.2 tokenizer are absent in the venv).
"""

from __future__ import annotations

import sys
import time

import torch


def windows(n: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from scdviz import data
    from scdviz.serving import models

    tok = AutoTokenizer.from_pretrained(models.producer_folder())
    return [w.ids for w in data.eval_windows(tok, "jargon", "dev", length, n)]


def dump(out: str, ids_from: str | None) -> None:
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from scdviz import metrics
    from scdviz.data import split_prompt
    from scdviz.models import hf
    from scdviz.scd import transfer
    from scdviz.scd.calibration import Calibration
    from scdviz.scd.codec import Codec
    from scdviz.settings import ASSETS_DIR

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    prod_dir = sys.argv[sys.argv.index("--producer") + 1] if "--producer" in sys.argv else None
    cons_dir = sys.argv[sys.argv.index("--consumer") + 1] if "--consumer" in sys.argv else None
    if prod_dir is None:
        from scdviz.serving import models
        prod_dir, cons_dir = str(models.producer_folder()), str(models.specialist_folder("jargon"))
    ws = torch.load(ids_from)["windows"] if ids_from else windows(3, 257 + 32)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    producer, consumer = load(prod_dir), load(cons_dir)
    calib = Calibration.load(ASSETS_DIR / "scd" / "jargon")
    codecs = {"raw": Codec.raw(hf.n_layers(producer)), "scd": Codec.of(calib)}
    res = {"windows": ws, "transformers": transformers.__version__, "logits": {}, "bytes": {}, "kl": {}}
    t0 = time.perf_counter()
    for i, w in enumerate(ws):
        prefix, fed, targets = split_prompt(w, 32)
        own = hf.decoder_cache(consumer, prefix)
        oracle, _ = transfer.continuation(consumer, own, fed, prefix.shape[1])
        res["logits"][i, "oracle"] = oracle
        for name, codec in codecs.items():
            tr = hf.forward(producer, prefix, capture={"h_in"})
            keys, values = hf.cache_kv(tr.cache)
            h_in = {layer: tr.h_in[layer][0] for layer in codec.plan.layers_in("patch")}
            blob = codec.encode_kv(producer, prefix, keys, values, h_in)
            cache = codec.decode(consumer, blob)
            logits, _ = transfer.continuation(consumer, cache, fed, prefix.shape[1])
            res["logits"][i, name], res["bytes"][i, name] = logits, len(blob)
            res["kl"][i, name] = float(metrics.kl_per_token(oracle, logits).mean())
    res["seconds"] = time.perf_counter() - t0
    torch.save(res, out)
    print(transformers.__version__, {k: round(v, 5) for k, v in res["kl"].items()}, f"{res['seconds']:.1f} s")


def compare(a: str, b: str) -> None:
    ra, rb = torch.load(a), torch.load(b)
    print(ra["transformers"], "vs", rb["transformers"])
    for key in ra["logits"]:
        la, lb = ra["logits"][key], rb["logits"][key]
        print(key, "max |dlogit|", f"{(la - lb).abs().max():.2e}", "kl", ra["kl"].get(key), rb["kl"].get(key),
              "bytes", ra["bytes"].get(key), rb["bytes"].get(key))


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[sys.argv.index("--ids") + 1] if "--ids" in sys.argv else None)
    else:
        compare(sys.argv[2], sys.argv[3])
