"""Command line for DistillCache: ``train-policy`` and ``bench evict``.

Thin wrappers over scdviz.evict.trainer and scdviz.evict.evaluate; user errors are
raised as ValueError (printed as one line by scdviz.__main__).
"""

from __future__ import annotations

import json


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in _floats(text))


def _train(args) -> None:
    from scdviz.evict.policy import PolicyConfig
    from scdviz.evict.trainer import TrainConfig, train
    from scdviz.models.pair import choose_threads

    print(f"torch threads: {choose_threads()}")
    cfg = TrainConfig(
        out=args.out,
        model=args.model,
        corpora=tuple(args.corpora.split(",")),
        contexts=args.contexts,
        context_len=args.context_len,
        cont_len=args.cont_len,
        keeps=_floats(args.keeps),
        samples=args.samples,
        steps=args.steps,
        warm_steps=args.warm_steps,
        lr=args.lr,
        entropy_coef=args.entropy,
        checkpoint_every=args.checkpoint_every,
        val_contexts=args.val_contexts,
        seed=args.seed,
        policy=PolicyConfig(hidden=args.hidden, per_head=not args.global_set, window=args.window),
    )
    log = train(cfg, resume=args.resume)
    best = min(log["val"], key=lambda v: v["kl"]) if log["val"] else None
    print(f"done in {log['seconds']} s; heuristic val KL {log['val_heuristic']}; best val KL {best}")


def _bench(args) -> None:
    from scdviz.evict import evaluate
    from scdviz.models.pair import choose_threads

    print(f"torch threads: {choose_threads()}")
    cfg = evaluate.EvalConfig(
        models=tuple(args.models.split(",")),
        policies=tuple(args.policies.split(",")) if args.policies else (),
        texts=args.texts,
        corpora=tuple(args.corpora.split(",")),
        limit=args.limit,
        context_len=args.context_len,
        cont_len=args.cont_len,
        keeps=_floats(args.keeps),
        token_budgets=_ints(args.tokens),
        question_len=args.question_len,
        modes=tuple(args.modes.split(",")),
        throughput_contexts=args.throughput_contexts,
        qa=args.qa,
    )
    records = evaluate.run(cfg)
    print(evaluate.table(records))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(records, fh, indent=1)
        print(f"wrote {len(records)} records to {args.out}")


def register(sub, bench_sub) -> None:
    """Add ``train-policy`` to the top-level commands and ``evict`` to ``bench``."""
    p = sub.add_parser("train-policy", help="train the DistillCache eviction policy (REINFORCE)")
    p.add_argument("--out", required=True, help="run folder: policy.safetensors, best.safetensors, log.json")
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--corpora", default="jargon,bible", help="shipped corpora (train split; calib for validation)")
    p.add_argument("--contexts", type=int, default=32)
    p.add_argument("--val-contexts", type=int, default=8)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--cont-len", type=int, default=24)
    p.add_argument("--keeps", default="0.25,0.125", help="kept fractions trained on")
    p.add_argument("--samples", type=int, default=4, help="M, Gumbel samples per context")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warm-steps", type=int, default=100, help="imitation of observed attention first (0: none)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--entropy", type=float, default=1e-3, help="entropy bonus weight")
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--window", type=int, default=512, help="W, recent queries the features use")
    p.add_argument("--global-set", action="store_true", help="one token set for all layers (as specified)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.set_defaults(fn=_train)

    p = bench_sub.add_parser("evict", help="learned eviction vs kvpress baselines (KL, top-1, PPL, wins)")
    p.add_argument(
        "--models", default="builtin:smollm2-135m", help="comma-separated; specialists test zero-shot transfer"
    )
    p.add_argument("--policies", default="", help="comma-separated policy files (default: the shipped ones)")
    p.add_argument("--texts", help=".txt (blank-line passages) or .jsonl with 'text'; default: shipped eval splits")
    p.add_argument("--corpora", default="jargon,bible", help="shipped corpora (eval split) when --texts is absent")
    p.add_argument("--limit", type=int, default=16, help="contexts")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--cont-len", type=int, default=32)
    p.add_argument("--keeps", default="0.5,0.25,0.125", help="kept fractions")
    p.add_argument("--tokens", default="64", help="fixed token budgets")
    p.add_argument("--question-len", type=int, default=16, help="question tokens (question-aware mode)")
    p.add_argument("--modes", default="agnostic", help="agnostic and/or aware")
    p.add_argument("--throughput-contexts", type=int, default=2, help="contexts on which decode speed is timed")
    p.add_argument("--qa", action="store_true", help="also the context-QA task (recall a quoted passage; agnostic mode)")
    p.add_argument("--out", help="write the records as JSON")
    p.set_defaults(fn=_bench)
