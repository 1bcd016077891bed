"""The settings of every command of ``python -m scdviz``: one dataclass each, the flags it parses into.

Each field is a flag (``scdviz.config.opt``: default, help, choices); a nested config dataclass
(a method's own settings, such as ``ScdBenchConfig``) becomes its flags in turn. ``scdviz.cli``
runs the commands; ``scdviz.report`` reads the bench commands' defaults to name the command
that made a record. This module runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scdviz.config import opt
from scdviz.evict.bench import EvalConfig
from scdviz.evict.cost import CostConfig
from scdviz.evict.student_fit import FitConfig
from scdviz.evict.train import TrainConfig
from scdviz.finetune import FinetuneConfig
from scdviz.scd.bench import ScdBenchConfig
from scdviz.scd.calibration import CalibConfig
from scdviz.scd.distil import DistilConfig
from scdviz.scd.ttft import TtftConfig

PRODUCER = "builtin:smollm2-135m"  # the built-in producer
SOURCE_HELP = ("model source: builtin:NAME (builtin:smollm2-135m, builtin:gemma3-270m, or a built-in specialist: "
               "builtin:jargon, builtin:austen-before), a local folder (a transformers model, or a LoRA adapter folder "
               "such as `finetune` writes, applied to the producer), or a hub id (needs network)")
TEXTS_HELP = ("your text: a .txt (passages separated by blank lines) or .jsonl ('text' field) file, split by passage "
              "60/20/20 into train/calib/eval, or a folder of train/calib/eval files; each command reads its own split")
NAME_HELP = ("run name: the run is written to <runs>/{kind}/<name> (runs: SCDVIZ_WORK, else SCDVIZ_CACHE, else the "
             "platform cache folder)")
MAINTAINER_HELP = "allow writing into the repository's assets/ (maintainers refreshing a shipped artefact)"
FIGURES_HELP = "also write the record's figures here as PNG, SVG and standalone HTML (the Results tab's figures)"


@dataclass
class PairInfo:
    producer: str = opt(PRODUCER, f"producer {SOURCE_HELP}")
    consumer: str = opt("builtin:jargon", f"consumer {SOURCE_HELP}")
    eval: bool = opt(False, "also held-out perplexity, raw-reuse drift and the consumer's task, on windows spread "
                     "through each shipped corpus's dev slice")
    texts: str | None = opt(None, TEXTS_HELP + "; --eval measures windows spread through its eval split instead of "
                            "every shipped corpus")
    limit: int = opt(16, "held-out prompts per corpus")
    prompt_len: int = opt(256, "prompt tokens")
    cont_len: int = opt(32, "teacher-forced continuation tokens")
    out: str | None = opt(None, "write the report as JSON")


@dataclass
class ModelCard:
    name: str = opt(help="specialist folder under assets/adapters/", required=True)
    limit: int = opt(16, "held-out prompts per corpus")
    maintainer: bool = opt(False, MAINTAINER_HELP + ": the card is written into assets/adapters/<name> (required)")


@dataclass
class PrepareText:
    maintainer: bool = opt(False, MAINTAINER_HELP + ": assets/text is rebuilt (required)")


@dataclass
class Finetune:
    name: str | None = opt(None, NAME_HELP.format(kind="specialists") + " (default: the text's file name or the "
                           "corpus)")
    maintainer: bool = opt(False, MAINTAINER_HELP + ": without --out, writes assets/adapters/<name>")
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)


@dataclass
class Calibrate:
    producer: str = opt(PRODUCER, f"producer {SOURCE_HELP}")
    consumer: str = opt("builtin:jargon", f"consumer {SOURCE_HELP}")
    name: str | None = opt(None, NAME_HELP.format(kind="calibrations") + " (default: the consumer's name)")
    out: str | None = opt(None, "output folder instead of the runs folder")
    maintainer: bool = opt(False, MAINTAINER_HELP + ": without --out, writes assets/scd/<specialist>")
    store_rank: int | None = opt(None, "store codes up to this rank only (smaller file)")
    calib: CalibConfig = field(default_factory=CalibConfig)


@dataclass
class Rate:
    producer: str = opt(PRODUCER, f"producer {SOURCE_HELP}")
    consumer: str = opt("builtin:jargon", f"consumer {SOURCE_HELP}")
    calib: str | None = opt(None, "calibration folder to measure (default: yours in the runs folder, else the shipped "
                            "one)")
    windows: int = opt(6, "calibration windows to measure on")
    maintainer: bool = opt(False, MAINTAINER_HELP + ": update a shipped calibration in place (else the result "
                           "is saved as a calibration in the runs folder)")


@dataclass
class Distil:
    producer: str = opt(PRODUCER, f"producer {SOURCE_HELP}")
    consumer: str = opt("builtin:austen-before", f"consumer {SOURCE_HELP}")
    calib: str | None = opt(None, "calibration folder to train the correction stage of (default: yours in the runs "
                            "folder, else the shipped one)")
    name: str | None = opt(None, NAME_HELP.format(kind="calibrations") + " (default: <calibration>-distil)")
    out: str | None = opt(None, "output folder instead of the runs folder")
    work: str | None = opt(None, "folder of the fit's checkpoint (default: <runs>/distil-work/<name>); the same "
                           "command with the same --work resumes a fit that was stopped")
    spool: str | None = opt(None, "folder of the prepared windows (default: <work>/spool); fits of the same "
                            "calibration, plans and window length may share one, each preparing only the windows "
                            "it lacks")
    prepare_part: list[int] = opt([], "I N: only prepare the I-th of every N windows into the spool, then stop (N "
                                  "of these at once, one core each, prepare a large fit's windows faster)")
    maintainer: bool = opt(False, MAINTAINER_HELP + ": --out may then write into assets/")
    distil: DistilConfig = field(default_factory=DistilConfig)


@dataclass
class BenchScd:
    producer: str = opt(PRODUCER, f"producer {SOURCE_HELP}")
    consumers: list[str] = opt([], "consumer sources (default: every built-in specialist); " + SOURCE_HELP)
    calibs: list[str] = opt([], "calibration folders, one per consumer (default: yours in the runs folder, else the "
                            "shipped one)")
    name: str | None = opt(None, NAME_HELP.format(kind="bench") + " (default: scd-<UTC time>)")
    out: str | None = opt(None, "write the record (JSON) to this file instead; its config goes beside it (.toml)")
    maintainer: bool = opt(False, MAINTAINER_HELP)
    figures: str | None = opt(None, FIGURES_HELP)
    bench: ScdBenchConfig = field(default_factory=ScdBenchConfig)


@dataclass
class BenchTtft:
    producer: str = opt(PRODUCER, f"producer {SOURCE_HELP}")
    consumer: str = opt("builtin:jargon", f"consumer {SOURCE_HELP}")
    calib: str | None = opt(None, "calibration folder (default: yours in the runs folder, else the shipped one)")
    name: str | None = opt(None, NAME_HELP.format(kind="bench") + " (default: ttft-<UTC time>)")
    out: str | None = opt(None, "write the record (JSON) to this file instead; its config goes beside it (.toml)")
    maintainer: bool = opt(False, MAINTAINER_HELP)
    figures: str | None = opt(None, FIGURES_HELP)
    ttft: TtftConfig = field(default_factory=TtftConfig)


@dataclass
class TrainPolicy:
    model: str = opt(PRODUCER, f"{SOURCE_HELP}: the model whose caches are pruned")
    name: str | None = opt(None, NAME_HELP.format(kind="policies") + " (default: policy-<UTC time>)")
    maintainer: bool = opt(False, MAINTAINER_HELP + " (with --out under assets/policy)")
    resume: bool = opt(False, "continue the run named by --name or --out")
    train: TrainConfig = field(default_factory=TrainConfig)


@dataclass
class FitStudent:
    model: str = opt(PRODUCER, f"{SOURCE_HELP}: the model whose caches are pruned")
    name: str | None = opt(None, NAME_HELP.format(kind="policies") + " (default: student-<UTC time>)")
    work: str | None = opt(None, "folder of the fit's checkpoint and listwise spool (default: <runs>/fit-work/<name>); "
                           "the same command with the same --work resumes a fit that was stopped; removed once the "
                           "student is saved")
    maintainer: bool = opt(False, MAINTAINER_HELP + " (with --out under assets/policy)")
    fit: FitConfig = field(default_factory=FitConfig)


@dataclass
class BenchEvict:
    models: list[str] = opt([PRODUCER], "model sources; the first is the policies' own, the others test zero-shot "
                            "transfer; " + SOURCE_HELP)
    name: str | None = opt(None, NAME_HELP.format(kind="bench") + " (default: evict-<UTC time>)")
    out: str | None = opt(None, "write the record (JSON) to this file instead; its config goes beside it (.toml)")
    maintainer: bool = opt(False, MAINTAINER_HELP)
    figures: str | None = opt(None, FIGURES_HELP)
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class BenchCost:
    model: str = opt(PRODUCER, f"{SOURCE_HELP}: the model whose caches are pruned")
    name: str | None = opt(None, NAME_HELP.format(kind="bench") + " (default: cost-<UTC time>)")
    out: str | None = opt(None, "write the record (JSON) to this file instead; its config goes beside it (.toml)")
    maintainer: bool = opt(False, MAINTAINER_HELP)
    cost: CostConfig = field(default_factory=CostConfig)


@dataclass
class Report:
    check: bool = opt(False, "write nothing; exit 1 listing each marked table block that differs from the records")
    tables: list[str] = opt([], "print only these tables (default: rewrite every marked block of README.md and docs/)")
    root: str | None = opt(None, "the checkout whose README.md and docs/ to write or check (default: this one)")


# settings records made before they were retired carry; the CLI no longer has them (the first two timed decoding
# inside the quality bench, which ``bench cost`` now measures for every method alike; the SCD bench's span,
# rank-claim and raw-layer sweeps left with their variants, and its token-0, KIVI-window, entropy-coding and
# raw-layer-precision switches with theirs: docs/history.md, "Retired in the one-recipe cleanup")
RETIRED_SETTINGS = frozenset({"eval.throughput_contexts", "eval.decode_steps", "bench.spans", "bench.rank_claim",
                              "bench.sink", "bench.kivi_window", "bench.entropy", "bench.raw_layer_bits",
                              "bench.raw_layers"})
BENCHES = {"scd": BenchScd, "ttft": BenchTtft, "evict": BenchEvict, "cost": BenchCost}  # ``bench KIND`` -> its settings
