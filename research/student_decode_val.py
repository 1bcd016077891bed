"""Decode-time validation of students as ``fit-student`` logs it (``student_fit.decode_kls``), for
students fitted before it did: the fit's validation contexts (calib split, windows spread through
each corpus), ``val_decode`` of them (evenly spaced) decoding ``val_decode_tokens`` greedy tokens with
every layer's cache held at 25 % of the context, a cut every ``decode_interval`` tokens; H2O held
the same way beside them.

    SCDVIZ_THREADS=1 python -m research.student_decode_val [STUDENT ...]

Default: the shipped students. Prints each one's mean per-step KL, its ratio to H2O's and the
paired-bootstrap interval of that ratio over the contexts (calib text: for choices only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scdviz import settings

DEFAULT = [settings.ASSETS_DIR / "policy" / name for name in ("student", "student_spread", "student_layer")]


def main(argv: list[str] | None = None) -> None:
    from scdviz import metrics
    from scdviz.evict import student_fit
    from scdviz.evict.student import Student
    from scdviz.models.pair import choose_threads, load_model

    parser = argparse.ArgumentParser(prog="python -m research.student_decode_val", description=__doc__.splitlines()[0])
    parser.add_argument("students", nargs="*", default=[str(p) for p in DEFAULT], help="student folders or files")
    args = parser.parse_args(argv)
    choose_threads()
    model, tokenizer = load_model("builtin:smollm2-135m")
    cfg = student_fit.FitConfig()
    val = student_fit.prepared_samples(model, tokenizer, cfg, "calib", cfg.val_contexts, True)
    episodes = student_fit.decode_episodes(model, student_fit.decoded_subset(val, cfg.val_decode),
                                           cfg.val_decode_tokens)
    h2o = student_fit.decode_kls(model, episodes, cfg.keeps[0], cfg.decode_interval)
    print(f"{len(episodes)} calib contexts, {cfg.val_decode_tokens} greedy tokens held at {cfg.keeps[0]:g}, "
          f"a cut every {cfg.decode_interval}")
    print(f"{'scorer':44} {'KL':>8} {'x H2O':>6}   [95% CI, paired bootstrap over contexts]")
    print(f"{'H2O (ObservedAttention while decoding)':44} {sum(h2o) / len(h2o):8.5f} {1:6.3f}")
    for path in args.students:
        kls = student_fit.decode_kls(model, episodes, cfg.keeps[0], cfg.decode_interval, Student.load(path))
        boot = metrics.paired_bootstrap(h2o, kls)
        shown = Path(path).relative_to(settings.REPO_DIR) if Path(path).is_relative_to(settings.REPO_DIR) else path
        print(f"{str(shown):44} {sum(kls) / len(kls):8.5f} {boot['ratio']:6.3f}   "
              f"[{boot['ratio_ci'][0]:.3f}, {boot['ratio_ci'][1]:.3f}]", flush=True)


if __name__ == "__main__":
    main()
