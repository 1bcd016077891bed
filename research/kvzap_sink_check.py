"""Why the KVzap-style student needs sinks: where its score ranks token 0, and its validation KL at 25 %
kept with and without token 0 forced into every kept set, beside H2O's, on every 4th of the fit's calib
validation contexts (calib text: for choices only).

    SCDVIZ_THREADS=1 python -m research.kvzap_sink_check [STUDENT]

Default: the shipped KVzap-style student (assets/policy/kvzap, fitted with --sinks 4; the check sets its
sinks to 0 first, so it measures the fitted score alone).
"""

from __future__ import annotations

import argparse
import dataclasses

from scdviz import settings


def main(argv: list[str] | None = None) -> None:
    import torch

    from scdviz.evict import student_fit
    from scdviz.evict import train as trainer
    from scdviz.evict.student import Student
    from scdviz.models.pair import choose_threads, load_model

    parser = argparse.ArgumentParser(prog="python -m research.kvzap_sink_check", description=__doc__.splitlines()[0])
    parser.add_argument("student", nargs="?", default=str(settings.ASSETS_DIR / "policy" / "kvzap"))
    args = parser.parse_args(argv)
    choose_threads()
    model, tokenizer = load_model("builtin:smollm2-135m")
    cfg = student_fit.FitConfig()
    val = student_fit.prepared_samples(model, tokenizer, cfg, "calib", cfg.val_contexts, True)[::4]
    student = Student.load(args.student)
    student.config = dataclasses.replace(student.config, sinks=0)

    def rows(sample, bonus: float = 0.0):
        out = torch.cat([student(layer, h, v)[0] for layer, (h, v) in
                         enumerate(zip(sample.obs.hidden, sample.obs.values, strict=True))], 0).clone()
        out[:, 0] += bonus
        return out

    ranks = [float((r > r[:, :1]).sum(-1).float().mean()) for r in map(rows, val)]
    print(f"{len(val)} calib contexts of {cfg.context_len} tokens; token 0's mean rank over the layer x head rows: "
          f"{sum(ranks) / len(ranks):.1f} (0 = the top score)")
    for name, scorer in (("fitted score", rows), ("token 0 kept", lambda s: rows(s, 1e4)),
                         ("H2O", lambda s: trainer.rows_of_feature(s.obs, True, 0))):
        kls = trainer.validation_kls(model, scorer, True, val, (0.25,))
        print(f"  {name:>13}: KL at 25 % kept {sum(kls) / len(kls):.4f}")


if __name__ == "__main__":
    main()
