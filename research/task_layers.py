"""Where a specialist's task lives in its cache: which layers' K, V it needs to answer (issue 62).

On a specialist's eval windows, each followed by the context-QA question it was trained on (scdviz.qa; the one
`bench scd` asks it), the specialist answers from a base cache of the prompt: raw reuse (the producer's K, V as
they are), or with ``--calib`` the calibration's operating plan (SCD full, closed form or trained). Then the
same, with the specialist's own (the oracle's) K, V swapped into

- one block of ``--block`` consecutive layers at a time (0-4, 5-9, ...), and
- every layer from 0 up to a depth (0-4, 0-9, ...), and from a depth to the last,

and its token F1 against the reference answer, per prompt. A block whose own K, V restore the oracle's F1 is where
the task reads the cache; a base that fails and an oracle block that restores it say what a transfer must carry.
The calibration's own ideal-patch gains measure the same swap on continuation KL, not on the task.

    python -m research.task_layers --consumer runs/r62/bt_all16 [--calib DIR] --limit 64 --out FILE.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from scdviz import data, metrics, protocol, qa, records
from scdviz.models import hf
from scdviz.models import pair as pairmod
from scdviz.models.pair import choose_threads, load_pair
from scdviz.progress import steps
from scdviz.scd import calibration, measure, transfer
from scdviz.scd import plan as plans


def layer_sets(n_layers: int, block: int) -> dict[str, list[int]]:
    """The swapped layer sets by label: none, each block, each prefix and suffix of blocks, all."""
    starts = list(range(0, n_layers, block))
    out = {"none": []}
    out |= {f"{s}-{min(s + block, n_layers) - 1}": list(range(s, min(s + block, n_layers))) for s in starts}
    out |= {f"0-{min(s + block, n_layers) - 1}": list(range(min(s + block, n_layers))) for s in starts[1:-1]}
    out |= {f"{s}-{n_layers - 1}": list(range(s, n_layers)) for s in starts[1:-1]}
    out["all"] = list(range(n_layers))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producer", default="builtin:smollm2-135m")
    ap.add_argument("--consumer", required=True)
    ap.add_argument("--calib", default="", help="base: this calibration's operating plan (default: raw reuse)")
    ap.add_argument("--domain", default=None, help="the text measured (default: the consumer's training corpus)")
    ap.add_argument("--slice", default="dev", choices=data.SLICES)
    ap.add_argument("--limit", type=int, default=64, help="eval windows")
    ap.add_argument("--block", type=int, default=5, help="layers per block")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--cont-len", type=int, default=32)
    ap.add_argument("--qa-answer-len", type=int, default=8)
    ap.add_argument("--out", default="", help="write the record here (every per-prompt F1)")
    args = ap.parse_args()
    protocol.check_slice(args.slice)
    print(f"torch threads: {choose_threads()}")
    t0 = time.perf_counter()
    pair = load_pair(args.producer, args.consumer)
    kind = qa.kind_for(pair.consumer_source)
    domain = args.domain or pairmod.training_log(args.consumer).get("config", {}).get("corpus")
    if not domain:
        raise SystemExit(f"{args.consumer}: no training corpus known; give --domain")
    n = pair.consumer_facts.layers
    calib = calibration.Calibration.load(Path(args.calib), pair) if args.calib else None
    base = plans.operating_plan(calib) if calib else plans.raw_plan(n)
    windows = data.eval_windows(pair.tokenizer, domain, args.slice, args.prompt_len + args.cont_len, args.limit)
    torch.manual_seed(0)
    cases = measure.prepare_cases(pair, [w.ids for w in windows], args.cont_len, True, args.qa_answer_len, kind)
    sets = layer_sets(n, args.block)
    f1 = {label: [] for label in ["oracle", *sets]}
    with torch.no_grad():
        for case in steps(cases, f"{len(sets)} layer sets per prompt", True):
            start = case.state.ids.shape[1]
            keys, values = hf.cache_kv(transfer.transferred(pair.consumer, case.state, base, calib))
            own_k, own_v = hf.cache_kv(case.oracle_cache)
            f1["oracle"].append(qa.answer(pair.consumer, hf.make_cache(pair.consumer, own_k, own_v), case.qa_item,
                                          start)["qa_f1"])
            for label, layers in sets.items():
                k2 = [own_k[i] if i in layers else keys[i] for i in range(n)]
                v2 = [own_v[i] if i in layers else values[i] for i in range(n)]
                f1[label].append(qa.answer(pair.consumer, hf.make_cache(pair.consumer, k2, v2), case.qa_item,
                                           start)["qa_f1"])
    clusters = [w.cluster for w in windows]
    table = []
    for label, items in f1.items():
        share = metrics.paired_bootstrap(f1["oracle"], items, clusters=clusters)
        table.append({"oracle K, V in layers": label, "task F1": round(sum(items) / len(items), 3),
                      "of the oracle's": f"{share['ratio']:.2f} [{share['ratio_ci'][0]:.2f}, "
                                         f"{share['ratio_ci'][1]:.2f}]"})
    print(f"\n== {args.consumer} on {domain} ({args.slice}, {len(cases)} prompts, question: {kind}); base: "
          f"{base.name}; the specialist's own K, V swapped into these layers ==")
    print(protocol.show(pd.DataFrame(table)))
    if args.out:
        settings = {"research": "task_layers", **{k: v for k, v in vars(args).items() if k != "out"}}
        row = {"consumer": args.consumer, "domain": domain, "question": kind, "base": base.name,
               "passages": clusters, "sets": sets, "qa_f1": f1}
        records.write(records.make("scd", settings, 0, [row], "cpu", time.perf_counter() - t0), Path(args.out))
        print(f"record: {args.out}")


if __name__ == "__main__":
    main()
