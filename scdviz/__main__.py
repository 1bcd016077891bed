"""Command line: ``python -m scdviz <command> ...`` (download, pair-info, finetune, model-card, bench, ...).

Each command is a thin wrapper over a library function; errors a user can fix are
printed as one line (no traceback) with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys


def _app(args) -> None:
    from scdviz.webapp import main

    main()


def _download(args) -> None:
    from scdviz.models import builtin

    print(builtin.producer_dir())


def _finetune(args) -> None:
    from scdviz.finetune import FinetuneConfig, finetune
    from scdviz.models.pair import choose_threads

    print(f"torch threads: {choose_threads()}")
    cfg = FinetuneConfig(
        corpus=args.corpus,
        out=args.out,
        base=args.base,
        rank=args.rank,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
    )
    log = finetune(cfg)
    print(f"done in {log['seconds']} s; loss {log['loss'][0]} -> {sum(log['loss'][-5:]) / 5:.3f} (mean of last 5)")


def _pair_info(args) -> None:
    from scdviz import drift
    from scdviz.models.pair import load_pair

    pair = load_pair(args.producer, args.consumer)
    print(drift.facts_table(pair))
    print(f"loaded in {pair.load_seconds:.1f} s on {pair.device} ({pair.dtype})")
    if args.eval:
        report = drift.evaluate_pair(pair, n_prompts=args.limit, prompt_len=args.prompt_len, cont_len=args.cont_len)
        print(drift.report_table(report))
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(report, fh, indent=1)


def _model_card(args) -> None:
    from scdviz.modelcard import write_card

    print(write_card(args.name, n_prompts=args.limit))


def _prepare_text(args) -> None:
    from scdviz import prepare_text

    prepare_text.main()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scdviz", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("app", help="start the web app (settings from SCDVIZ_* / GRADIO_SERVER_* variables)")
    p.set_defaults(fn=_app)

    p = sub.add_parser("download", help="fetch and convert the built-in producer (first use)")
    p.set_defaults(fn=_download)

    p = sub.add_parser("pair-info", help="print a pair's facts; --eval adds perplexity and drift")
    p.add_argument("--producer", default="builtin:smollm2-135m")
    p.add_argument("--consumer", default="builtin:jargon")
    p.add_argument("--eval", action="store_true", help="held-out perplexity and raw-reuse drift")
    p.add_argument("--limit", type=int, default=16, help="held-out prompts per corpus")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--cont-len", type=int, default=32, help="teacher-forced continuation tokens")
    p.add_argument("--out", help="write the report as JSON")
    p.set_defaults(fn=_pair_info)

    p = sub.add_parser("finetune", help="train a LoRA specialist on a shipped corpus")
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--base", default="builtin:smollm2-135m")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_finetune)

    p = sub.add_parser("model-card", help="measure a built-in specialist and write its model card")
    p.add_argument("--name", required=True, help="specialist folder under assets/adapters/")
    p.add_argument("--limit", type=int, default=16, help="held-out prompts per corpus")
    p.set_defaults(fn=_model_card)

    p = sub.add_parser("prepare-text", help="rebuild assets/text from Debian's text packages")
    p.set_defaults(fn=_prepare_text)

    bench = sub.add_parser("bench", help="benchmarks that print tables (scd, evict)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    # Method CLIs register their own commands here: register(sub, bench_sub).
    from scdviz.evict import cli as evict_cli
    from scdviz.scd import cli as scd_cli

    evict_cli.register(sub, bench_sub)
    scd_cli.register(sub, bench_sub)

    args = parser.parse_args(argv)
    from scdviz.models.pair import PairError

    try:
        args.fn(args)
    except (PairError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
