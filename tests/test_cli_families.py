"""Issue 58's done-when for the command line: "every CLI command exits 0 or refuses with a one-line message on
each family (no stack trace)".

Each user-facing command runs in-process (``scdviz.cli.main``, output captured by capsys) with the smallest
settings that still make it do its work, on local folders of tests/families.py's tiny random models (made by
test_families' ``World``: a producer, and a consumer whose attention projections were nudged) and on the user's
own text (``--texts``). One cell per (family, command):

  * exit 0, and the command produced what it must (a record, a calibration, a student, a policy, an adapter, or
    the table it prints); or
  * exit 2 with exactly one non-empty stderr line, ``error: ...`` (a refusal a user can act on);
  * never an exception out of ``main`` and never "Traceback" in what was printed.

phi3 (every layer sliding) must be refused by the eviction commands, in a line that says "sliding"; the
unsupported family (gpt-neox) must be refused by every command, in a line naming its model type. ``rate``,
``distil`` and ``bench scd`` use the calibration the ``calibrate`` cell made (run once per family, whichever cell
asks first; ``rate`` measures a copy of it, so the cells do not depend on their order).

Each cell records its outcome as the junit property ``cell`` (``--junitxml``): the family x command table.
"""

from __future__ import annotations

import dataclasses
import shutil
import traceback
from pathlib import Path

import pytest
from families import MODEL_TYPES
from test_families import World

from scdviz import cli, records

FAMILY_NAMES = ["qwen2.5", "qwen3", "gemma2", "gemma3", "phi3", "phi4-mini", "olmo2", "smollm3", "granite"]
UNSUPPORTED_NAME = "gpt-neox"
ONLY_SLIDING = {"phi3"}  # every layer over a sliding window: the eviction commands refuse it
COMMANDS = ["pair-info", "calibrate", "rate", "distil", "fit-student", "train-policy", "finetune", "bench scd",
            "bench evict", "bench cost"]
EVICTION = {"fit-student", "train-policy", "bench evict", "bench cost"}
PROMPT, CONT = 48, 8  # SCD prompt tokens (3x the window of 16), then continuation tokens
CONTEXT = 64  # eviction context tokens


@dataclasses.dataclass
class Ran:
    """One in-process run of ``cli.main``: its exit code (None: it raised), what it printed, the traceback."""

    rc: int | None
    out: str
    err: str
    crash: str | None = None


def run_cli(argv: list[str], capsys) -> Ran:
    capsys.readouterr()  # what came before is not this command's
    try:
        rc = cli.main(argv)
    except Exception:  # noqa: BLE001 - a crash is a cell of the table, reported with its traceback
        out, err = capsys.readouterr()
        return Ran(None, out, err, traceback.format_exc())
    out, err = capsys.readouterr()
    return Ran(rc, out, err)


class Cells:
    """The families' folders (test_families' World), the text, and each family's calibration run (made once)."""

    def __init__(self, root: Path):
        self.root = root
        (root / "folders").mkdir()
        self.world = World(root / "folders")
        self.texts = str(self.world.texts)
        self._calibrations: dict[str, tuple[Ran, Path]] = {}

    def producer(self, family: str) -> str:
        if family == UNSUPPORTED_NAME:
            return self.world.unsupported_folder(family)
        return self.world.producer_folder(family)

    def consumer(self, family: str) -> str:
        if family == UNSUPPORTED_NAME:
            return self.world.unsupported_folder(family)
        return self.world.consumer_folder(family)

    def out(self, family: str, what: str) -> Path:
        return self.root / "out" / family / what.replace(" ", "-")

    def calibration(self, family: str, capsys) -> tuple[Ran, Path]:
        """The ``calibrate`` command's run on the family's pair and its output folder, once per family."""
        if family not in self._calibrations:
            folder = self.out(family, "calibration")
            ran = run_cli(["calibrate", "--producer", self.producer(family), "--consumer", self.consumer(family),
                           "--texts", self.texts, "--n-fit", "4", "--n-select", "2", "--prompt-len", str(PROMPT),
                           "--cont-len", str(CONT), "--n-candidates", "2", "--patch-k", "1", "--op-patch-k", "1",
                           "--rate-windows", "0", "--out", str(folder)], capsys)
            self._calibrations[family] = (ran, folder)
        return self._calibrations[family]

    def needs_calibration(self, family: str, capsys) -> Path:
        """The family's calibration folder; a supported family whose calibrate cell failed skips the cell that
        needs it (that failure is the calibrate cell's); the unsupported family's (never made) folder is refused
        before it is read."""
        ran, folder = self.calibration(family, capsys)
        if family != UNSUPPORTED_NAME and not (folder / "calibration.safetensors").is_file():
            pytest.skip(f"no calibration of {family}: see its calibrate cell (exit {ran.rc})")
        return folder


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_families")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SCDVIZ_WORK", str(root / "work"))  # anything written without --out lands here
        mp.setenv("SCDVIZ_THREADS", "1")  # choose_threads would otherwise set torch's threads for the session
        yield Cells(root)


# ----------------------------------------------------------------------------- each command, smallest settings


def _argv(command: str, family: str, cells: Cells, capsys) -> tuple[list[str], Path]:
    """The command line of one cell and the path it must write when it exits 0."""
    p, c, texts, out = cells.producer(family), cells.consumer(family), cells.texts, cells.out(family, command)
    if command == "pair-info":
        return (["pair-info", "--producer", p, "--consumer", c, "--eval", "--texts", texts, "--limit", "2",
                 "--prompt-len", str(PROMPT), "--cont-len", str(CONT), "--out", str(out / "drift.json")],
                out / "drift.json")
    if command == "calibrate":
        return [], cells.out(family, "calibration") / "calibration.safetensors"  # run by cells.calibration
    if command == "rate":
        calib = cells.needs_calibration(family, capsys)
        if calib.is_dir():  # rate writes into the calibration it measures: a copy, so distil / bench scd keep theirs
            shutil.copytree(calib, out, dirs_exist_ok=True)
        return (["rate", "--producer", p, "--consumer", c, "--calib", str(out), "--windows", "1"],
                out / "calibration.safetensors")
    if command == "distil":
        calib = cells.needs_calibration(family, capsys)
        return (["distil", "--producer", p, "--consumer", c, "--calib", str(calib), "--out", str(out), "--rank", "4",
                 "--budgets", "--epochs", "1", "--train-windows", "2", "--val-windows", "1", "--prompt-len",
                 str(PROMPT), "--cont-len", str(CONT)], out / "calibration.safetensors")
    if command == "bench scd":
        calib = cells.needs_calibration(family, capsys)
        return (["bench", "scd", "--producer", p, "--consumers", c, "--calibs", str(calib), "--texts", texts,
                 "--limit", "2", "--prompt-len", str(PROMPT), "--cont-len", str(CONT), "--gen-tokens", "4",
                 "--qa-answer-len", "4", "--out", str(out / "record.json")], out / "record.json")
    if command == "fit-student":
        return (["fit-student", "--model", p, "--out", str(out), "--corpora", "austen", "--contexts", "2",
                 "--val-contexts", "1", "--context-len", "40", "--teacher-len", "8", "--cont-len", "4",
                 "--question-len", "2", "--keeps", "0.25", "--ridges", "10", "--decode-len", "0", "--val-decode",
                 "0", "--listwise"], out / "best.safetensors")
    if command == "train-policy":
        return (["train-policy", "--model", p, "--out", str(out), "--corpora", "--texts", texts, "--contexts", "2",
                 "--context-len", str(CONTEXT), "--cont-len", "8", "--question-len", "4", "--keeps", "0.25",
                 "--samples", "2", "--steps", "2", "--warm-steps", "1", "--checkpoint-every", "2",
                 "--val-contexts", "1", "--hidden", "8", "--window", "16"], out / "policy.safetensors")
    if command == "finetune":
        return (["finetune", "--base", p, "--texts", texts, "--out", str(out), "--steps", "2", "--batch", "2",
                 "--seq-len", str(CONTEXT), "--rank", "4", "--warmup", "1"], out / "adapter_model.safetensors")
    if command == "bench evict":
        return (["bench", "evict", "--models", p, "--texts", texts, "--limit", "2", "--context-len", str(CONTEXT),
                 "--cont-len", "8", "--question-len", "4", "--keeps", "0.25", "--token-budgets", "--no-natives",
                 "--out", str(out / "record.json")], out / "record.json")
    if command == "bench cost":
        return (["bench", "cost", "--model", p, "--corpus", "austen", "--context-lens", str(CONTEXT), "--keep",
                 "0.25", "--decode-steps", "3", "--rounds", "1", "--warmup", "0", "--no-natives",
                 "--out", str(out / "record.json")], out / "record.json")
    raise AssertionError(command)


def _one_line_refusal(ran: Ran) -> str:
    """The refusal's message; fails unless stderr is exactly one non-empty line, ``error: ...``."""
    lines = [line for line in ran.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), f"not a one-line refusal; stderr:\n{ran.err}"
    return lines[0]


def _produced(command: str, made: Path, ran: Ran) -> None:
    """What a command that exited 0 must have made."""
    assert made.is_file(), f"{command} exited 0 without writing {made}"
    if command.startswith("bench"):
        record = records.read(made)
        assert record.kind == command.split()[1] and len(record.rows) > 0, (record.kind, len(record.rows))
    if command == "pair-info":
        assert "loaded in" in ran.out  # the facts table, then the evaluation's
    if command == "rate":
        from scdviz.scd import calibration

        assert calibration.Calibration.load(made.parent).rate is not None  # the curves were saved into it


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("family", [*FAMILY_NAMES, UNSUPPORTED_NAME])
def test_the_command_runs_on_the_family_or_refuses_in_one_line(cells, family, command, capsys, record_property):
    argv, made = _argv(command, family, cells, capsys)
    ran = cells.calibration(family, capsys)[0] if command == "calibrate" else run_cli(argv, capsys)
    if ran.crash is not None:
        tail = "\n".join(ran.crash.strip().splitlines()[-6:])
        record_property("cell", "CRASH: " + tail.splitlines()[-1])
        pytest.fail(f"CRASH: python -m scdviz {' '.join(argv or [command])}\n{tail}")
    assert "Traceback" not in ran.out + ran.err, ran.out + ran.err
    assert ran.rc in (0, 2), (ran.rc, ran.err)
    must_refuse = family == UNSUPPORTED_NAME or (family in ONLY_SLIDING and command in EVICTION)
    if ran.rc == 2:
        message = _one_line_refusal(ran)
        record_property("cell", "refused: " + message)
        if family == UNSUPPORTED_NAME:
            assert MODEL_TYPES[family] in message, message
        elif family in ONLY_SLIDING and command in EVICTION:
            assert "sliding" in message.lower(), message
        return
    assert not must_refuse, f"{command} on {family} exited 0; it must refuse\n{ran.out[-2000:]}"
    _produced(command, made, ran)
    record_property("cell", "pass")
