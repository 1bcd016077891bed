"""Transform coding vs the rate-distortion plan, on text neither was fitted or reported on.

    python -m research.transform_coding_check            # both parts, both built-in specialists

Part 1 (the choice of the default budget coder): KL of raw reuse, the rate-distortion plan and
the transform-coded plan at 2,304 and 3,840 B/token on the calibration's selection windows
(calibration text, never its fit windows and never eval text: the validation set the default was
chosen on). Part 2 (where transform coding's bytes go): on 4 eval prompts per specialist, the
real coded bodies vs the same integers packed at a fixed width per channel
(ceil(log2(max - min + 1)) bits, 4 bytes of range per live channel), i.e. the entropy coder's share.
Part 3 (``--records`` alone: no model run): from the shipped budget records' per-layer ``sent``
account, the mean highest channel sent and the bits per value spent (headers, scales and models
included) of every budget-sweep method, and transform coding's KL relative to the rate-distortion
plan's at each budget with a 95% paired-bootstrap interval over the records' prompts.
"""

from __future__ import annotations

import argparse
import math

import torch

from scdviz import data, metrics, settings
from scdviz.models import builtin
from scdviz.models.pair import load_pair
from scdviz.scd import calibration, entropy, payload, transfer
from scdviz.scd import plan as plans

BUDGETS = (2304, 3840)


def validation(pair, calib, name: str) -> None:
    select = calibration.windows(pair, calib.config)[2]
    cases = [transfer.prepare_case(pair.producer, pair.consumer, w, calib.config.cont_len) for w in select]
    n = cases[0].state.ids.shape[1]
    lineup = [plans.raw_plan(calib.n_layers)]
    for b in BUDGETS:
        lineup += [plans.rd_plan(calib.rate, b, n)[0], plans.tc_plan(calib, b)]
    for plan in lineup:
        kls = [float(metrics.kl_per_token(c.oracle_logits,
                                          transfer.run_plan(pair.consumer, c, plan, calib).logits).mean())
               for c in cases]
        print(f"validation  {name:10s} {plan.name:36s} KL {sum(kls) / len(kls):.4f}  ({len(kls)} selection windows)",
              flush=True)


def entropy_share(pair, calib, name: str, corpus: str, n_prompts: int = 4) -> None:
    windows = data.token_windows(pair.tokenizer, data.passages(corpus, "eval"), 288, n_prompts)
    for b in BUDGETS:
        coded = packed = 0
        for w in windows:
            state = transfer.producer_state(pair.producer, torch.tensor([w[:256]]))
            blob = transfer.build_payload(state, plans.tc_plan(calib, b), calib)
            for sp in payload.spans(blob)[1]:
                data_, step = entropy.decode_uniform(blob[sp.start : sp.end], sp.rows, sp.cols)
                q = torch.round(data_.double() / step).long()
                coded += sp.end - sp.start
                for j in range(q.shape[1]):
                    lo, hi = int(q[:, j].min()), int(q[:, j].max())
                    width = math.ceil(math.log2(hi - lo + 1)) if hi > lo else 0
                    packed += math.ceil(width * q.shape[0] / 8) + (4 if hi != lo or lo != 0 else 0)
        print(f"entropy     {name:10s} @{b} B/token: coded bodies {coded:,} B, the same integers packed {packed:,} B "
              f"({packed / coded:.2f}x), {len(windows)} eval prompts", flush=True)


def records_account() -> None:
    import json

    for name in builtin.specialists():
        path = settings.ASSETS_DIR / "scd" / name / "bench.json"
        rows = json.loads(path.read_text())["rows"]
        by = {row["method"]: row for row in rows if row.get("group") == "budget sweep"}
        for b in BUDGETS:
            tc, rd = by[f"SCD transform-coded @{b} B/token"], by[f"SCD RD @{b} B/token"]
            boot = metrics.paired_bootstrap(rd["kl_per_prompt"], tc["kl_per_prompt"])
            print(f"records     {name:10s} @{b} B/token: transform-coded KL / RD KL {tc['kl'] / rd['kl']:.3f} "
                  f"[{boot['ratio_ci'][0]:.3f}, {boot['ratio_ci'][1]:.3f}] ({len(tc['kl_per_prompt'])} eval prompts)")
        for row in rows:
            if row.get("group") != "budget sweep":
                continue
            sent = row["sent"]
            rank = {k: sum(sent[f"cols_{k}"]) / len(sent[f"cols_{k}"]) for k in "kv"}
            bits = {k: 8 * sum(sent[f"bytes_{k}"]) / max(sum(sent[f"cols_{k}"]), 1) for k in "kv"}
            print(f"records     {name:10s} {row['method']:36s} mean highest channel sent K {rank['k']:.0f} V "
                  f"{rank['v']:.0f}, bits per value K {bits['k']:.2f} V {bits['v']:.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.transform_coding_check", description=__doc__.splitlines()[0])
    ap.add_argument("--records", action="store_true", help="part 3 alone, from the shipped records (no model run)")
    args = ap.parse_args(argv)
    records_account()
    if args.records:
        return
    for name in builtin.specialists():
        pair = load_pair("builtin:smollm2-135m", f"builtin:{name}")
        calib = calibration.Calibration.load(calibration.shipped_folder(f"builtin:{name}"), pair)
        validation(pair, calib, name)
        entropy_share(pair, calib, name, builtin.training_corpus(name))


if __name__ == "__main__":
    main()
