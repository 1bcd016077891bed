"""Validation KL of policies at decode time (what `train-policy --val-decode` logs), on the
shipped policies' validation contexts (6 contexts of the jargon and bible calib splits, 512
tokens + 24 teacher-forced, kept 25 % and 12.5 %, a cut every 4 decoded tokens).

    SCDVIZ_THREADS=2 python -m research.policy_decode_val [POLICY_FILE ...]

Default: the shipped per-head W = 64 policy and the sequential-REINFORCE checkpoint beside it;
H2O's scores held the same way are printed for reference (``val_heuristic_decode``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scdviz import settings

DEFAULT = [settings.ASSETS_DIR / "policy" / "per_head_w64" / "best.safetensors",
           settings.ASSETS_DIR / "policy" / "sequential_w64" / "policy.safetensors"]


def main(argv: list[str] | None = None) -> None:
    from kvpress import ObservedAttentionPress

    from scdviz import metrics
    from scdviz.evict import train as trainer
    from scdviz.evict.policy import Policy, PolicyConfig
    from scdviz.evict.press import DistillCachePress
    from scdviz.models.pair import choose_threads, load_model

    parser = argparse.ArgumentParser(prog="python -m research.policy_decode_val", description=__doc__.splitlines()[0])
    parser.add_argument("policies", nargs="*", default=[str(p) for p in DEFAULT], help="per-head policy files")
    args = parser.parse_args(argv)
    choose_threads()
    model, tokenizer = load_model("builtin:smollm2-135m")
    cfg = trainer.TrainConfig(val_contexts=6, policy=PolicyConfig(per_head=True, window=64))
    held_out = trainer.prepare(model, tokenizer, cfg, "calib", cfg.val_contexts)
    h2o = trainer.validation_kls(model, lambda s: trainer.rows_of_feature(s.obs, True, 0), True, held_out, cfg.keeps,
                                 ObservedAttentionPress(), cfg.decode_interval, cfg.policy.window)
    k = len(cfg.keeps)
    per_context = lambda kls: [sum(kls[i : i + k]) / k for i in range(0, len(kls), k)]  # noqa: E731 - both budgets
    print(f"{'scorer':62} {'val KL':>8}   minus H2O [95% CI, paired bootstrap over the {len(h2o) // k} contexts]")
    print(f"{'H2O scores (alpha at prefill, ObservedAttention while decoding)':62} {sum(h2o) / len(h2o):8.5f}")
    for path in args.policies:
        policy = Policy.load(path)
        kls = trainer.validation_kls(model, lambda s, p=policy: trainer.rows(p, s.obs), True, held_out, cfg.keeps,
                                     DistillCachePress(policy=policy), cfg.decode_interval, policy.config.window)
        boot = metrics.paired_bootstrap(per_context(h2o), per_context(kls))
        shown = Path(path).relative_to(settings.REPO_DIR) if Path(path).is_relative_to(settings.REPO_DIR) else path
        print(f"{str(shown):62} {sum(kls) / len(kls):8.5f}   {boot['diff']:+.5f} "
              f"[{boot['diff_ci'][0]:+.5f}, {boot['diff_ci'][1]:+.5f}]")


if __name__ == "__main__":
    main()
