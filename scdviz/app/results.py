"""The Results tab's work: shipped and local records, opening and comparing them, exporting figures.

Paths a visitor names are checked by ``scdviz.app.hosting``; what is written (the rows as CSV,
figure files) goes to the visitor's session folder. No models here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from scdviz import records, settings
from scdviz.app import hosting
from scdviz.app.inputs import UserError
from scdviz.app.session import Session


def shipped_results() -> list[Path]:
    """Benchmark records shipped in assets/ (read-only)."""
    assets = settings.ASSETS_DIR
    return sorted(p for pattern in ("scd/*/*", "policy/bench/*") for p in assets.glob(pattern)
                  if records.is_record_name(p.name))


def shipped_records() -> dict[str, Path]:
    """Shipped records by the name the Results tab lists (``assets/scd/jargon/bench.json``)."""
    return {f"assets/{p.relative_to(settings.ASSETS_DIR)}": p for p in shipped_results()}


def local_records() -> dict[str, Path]:
    """Bench records in the local runs folder by run name, newest first; none in hosted mode
    (visitors never see the machine's runs)."""
    from scdviz import runs

    return {} if settings.hosted() else {p.parent.name: p for p in runs.bench_records()}


MAX_RECORDS = 12  # records the Results tab opens at once
MAX_ROWS = 20_000  # rows one file may hold (the largest shipped record has about 700)
MAX_COLUMNS = 300  # columns (distinct row fields) one file may hold
MAX_SHOWN = 1_000  # rows the table shows (the CSV export keeps all)


def _bench_file(path, roots: tuple[Path, ...]) -> Path:
    """A benchmark file a user named: allowed (hosted mode: under ``roots`` only), a record (.json, .json.gz) or
    .csv, not too big."""
    p = hosting.user_file(path, "benchmark file", roots=roots)
    if not (records.is_record_name(p.name) or p.suffix.lower() == ".csv"):
        raise UserError(f"{p.name}: open a .json, .json.gz or .csv file from `python -m scdviz bench ... --out`")
    if p.stat().st_size > settings.max_upload_mb() * 2**20:
        raise UserError(f"{p.name} is larger than {settings.max_upload_mb()} MB (SCDVIZ_MAX_UPLOAD_MB)")
    return p


def _sized(name: str, n_rows: int, n_columns: int) -> None:
    """Refuse a file with more rows or columns than the tab opens (checked before any table is built)."""
    if n_rows > MAX_ROWS:
        raise UserError(f"{name} holds more than {MAX_ROWS:,} rows; the Results tab opens at most {MAX_ROWS:,} per "
                        "file (a benchmark record holds hundreds)")
    if n_columns > MAX_COLUMNS:
        raise UserError(f"{name} has {n_columns:,} columns; the Results tab opens at most {MAX_COLUMNS:,}")


def _read_json(p: Path):
    try:
        rec = records.read(p)
    except ValueError as err:
        raise UserError(str(err)) from None
    keys = set()
    for row in rec.rows[: MAX_ROWS + 1]:
        keys |= set(row) if isinstance(row, dict) else set()
    _sized(p.name, len(rec.rows), len(keys))
    return rec


def _read_csv(p: Path):
    """A CSV export: every row has a known ``bench_kind``."""
    import pandas as pd

    try:
        _sized(p.name, 0, len(pd.read_csv(p, nrows=0).columns))  # the header first
        df = pd.read_csv(p, nrows=MAX_ROWS + 1)  # never more than one row past the cap
        _sized(p.name, len(df), len(df.columns))
    except pd.errors.EmptyDataError:
        raise UserError(f"{p.name} is an empty CSV file") from None
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError) as err:
        raise UserError(f"{p.name} is not a readable CSV file: {str(err).splitlines()[0][:200]}") from None
    kinds = df["bench_kind"] if "bench_kind" in df.columns else None
    if kinds is None or df.empty or kinds.isna().any() or not set(kinds) <= set(records.KINDS):
        raise UserError(f"{p.name}: a CSV needs one bench_kind ({' or '.join(records.KINDS)}) on every row, in a "
                        "bench_kind column, as the Results tab's export writes it")
    return df


def load_results(path, upload_roots: tuple[Path, ...] = ()):
    """A benchmark record (JSON from ``bench ... --out``) or its CSV export as (DataFrame, kind).

    The kind ('scd', 'evict' or 'ttft') is the record's own ``kind`` field (a CSV export carries it
    as a ``bench_kind`` column; a CSV of several kinds is refused here, ``read_records`` splits
    it). ``path`` must be a shipped record or, in hosted mode, lie under ``upload_roots``.
    """
    import pandas as pd

    p = _bench_file(path, (settings.ASSETS_DIR, *upload_roots))
    if records.is_record_name(p.name):
        record = _read_json(p)
        return pd.DataFrame(record.rows), record.kind
    df = _read_csv(p)
    kinds = set(df["bench_kind"])
    if len(kinds) != 1:
        raise UserError(f"{p.name}: a CSV needs one bench_kind ({' or '.join(records.KINDS)}) here; this one holds "
                        f"{', '.join(sorted(kinds))} (open it in the Results tab, which splits it)")
    return df.drop(columns="bench_kind"), kinds.pop()


def read_records(path, upload_roots: tuple[Path, ...] = (), label: str | None = None,
                 roots: tuple[Path, ...] = ()) -> list[tuple[str, object]]:
    """(label, ``BenchRecord``) pairs from one file: a JSON record is one, a CSV export one per
    record and kind in it (its ``record`` and ``bench_kind`` columns; a CSV keeps no settings).

    Paths are checked as in ``load_results``; ``roots`` adds allowed folders (the runs folder).
    """
    p = _bench_file(path, (settings.ASSETS_DIR, *upload_roots, *roots))
    name = label or records.stem(p)
    if records.is_record_name(p.name):
        return [(name, _read_json(p))]
    df = _read_csv(p)
    keys = ["record", "bench_kind"] if "record" in df.columns else ["bench_kind"]
    out = []
    for key, part in df.groupby(keys, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        kind = key[-1]
        sub = f"{key[0]}" if len(key) == 2 else (kind if df["bench_kind"].nunique() > 1 else "")
        rows = part.drop(columns=keys).to_dict("records")
        note = f"rows read back from the CSV export {p.name}; a CSV keeps no settings"
        out.append((f"{name}:{sub}" if sub else name, records.BenchRecord(kind, {}, None, rows, note=note)))
    return out


def _names(value, what: str) -> list[str]:
    """A multi-select's value (a list of names; one name or None also accepted) as a list of str."""
    if value is None:
        return []
    values = [value] if isinstance(value, str | Path) else value
    if not isinstance(values, list | tuple) or not all(isinstance(v, str | Path) for v in values):
        raise UserError(f"{what}: expected a list of names, got {type(value).__name__}")
    return [str(v) for v in values]


def open_records(shipped=None, uploads=None, local=None,
                 upload_roots: tuple[Path, ...] = ()) -> list[tuple[str, object]]:
    """The records a visitor chose in the Results tab, as unique (label, ``BenchRecord``) pairs:
    ``shipped`` names (``shipped_records``), uploaded files (under ``upload_roots``) and run names
    of the local runs folder (``local_records``; refused in hosted mode)."""
    from scdviz import plots

    shipped, uploads, local = (_names(shipped, "Shipped records"), _names(uploads, "Uploaded records"),
                               _names(local, "Your runs"))
    if len(shipped) + len(uploads) + len(local) > MAX_RECORDS:
        raise UserError(f"open at most {MAX_RECORDS} records at once; {len(shipped) + len(uploads) + len(local)} "
                        "are chosen")
    if local and settings.hosted():
        raise UserError("this hosted demo does not read the runs folder; upload the record instead")
    known, mine = shipped_records(), local_records() if local else {}
    out: list[tuple[str, object]] = []
    for name in shipped:
        if name not in known:
            raise UserError(f"{name!r} is not a shipped record; choose one of the list")
        out += read_records(known[name], label=records.without_suffix(name.removeprefix("assets/")))
    for name in local:
        if name not in mine:
            raise UserError(f"no bench run named {name!r} in {runs_root_shown()}; press ↻ to list the runs again")
        out += read_records(mine[name], label=name, roots=(mine[name].parent,))
    for path in uploads:
        out += read_records(path, upload_roots)
    if len(out) > MAX_RECORDS:
        raise UserError(f"open at most {MAX_RECORDS} records at once; these files hold {len(out)}")
    labels = plots.unique_labels([label for label, _ in out])
    return [(label, rec) for label, (_, rec) in zip(labels, out)]


def runs_root_shown() -> str:
    """Where local bench runs are looked for, as shown to a person."""
    from scdviz import runs

    return f"{runs.root() / 'bench'}"


def compare_results(shipped, uploads, local, session: Session, upload_roots: tuple[Path, ...] = ()) -> dict:
    """The Results tab's view of the chosen records: figures overlaid per kind, the settings that
    differ, every row (rounded for display) and the unrounded rows as a CSV in the visitor's scratch folder."""
    from scdviz import plots

    labelled = open_records(shipped, uploads, local, upload_roots)
    if not labelled:
        return {"info": "Choose one or more records above.", "figures": {}, "settings": None, "table": None,
                "csv": None}
    table = plots.records_table(labelled)
    csv = session.scratch() / "results.csv"  # one file per session, removed with it
    table.to_csv(csv, index=False)
    listed = [c for c in table if table[c].map(lambda v: isinstance(v, list)).any()]  # per-context lists: CSV only
    figs = plots.record_figures(labelled)
    diff = plots.settings_diff(labelled)
    kinds = sorted({rec.kind for _, rec in labelled})
    lines = [f"{len(labelled)} record{'s' if len(labelled) > 1 else ''} ({', '.join(kinds)}): "
             + "; ".join(f"`{label}` ({rec.kind}, {len(rec.rows)} rows)" for label, rec in labelled) + "."]
    if len(labelled) > 1:
        lines.append(f"{len(diff)} settings differ between them (table below)." if len(diff) else
                     "Their settings are the same.")
    if len(kinds) > 1:
        lines.append("Records of different kinds are plotted separately, one plot per kind.")
    missing = [label for label, rec in labelled
               if not any(label in {t.legendgroup for t in f.data} for f in figs.values())]
    if missing:
        lines.append(f"Nothing to plot from {', '.join(f'`{m}`' for m in missing)} (no rows with the plotted values).")
    lines += [f"**Note on `{label}`**: {rec.note}" for label, rec in labelled if rec.note]
    if len(table) > MAX_SHOWN:
        lines.append(f"The table shows the first {MAX_SHOWN:,} of {len(table):,} rows; the CSV export holds them all.")
    return {"info": "\n\n".join(lines), "figures": figs, "settings": diff,
            "table": plots.rounded(table.drop(columns=listed).head(MAX_SHOWN)), "csv": str(csv)}


def export_figures(figs, session: Session, tab: str, static: bool = False) -> list[str]:
    """Write a tab's current figures into the visitor's scratch folder (the previous export of that tab
    replaced): one HTML page of every figure (``figures.bundle``) and, with ``static``, zips of PNG and
    SVG images (kaleido starts Chromium: seconds more; never in hosted mode). Returns the files for a gr.File."""
    from scdviz import figures

    if not isinstance(figs, dict) or not figs:
        raise UserError("no figures to download yet: run this tab first")
    if not str(tab).isidentifier():
        raise UserError(f"unknown tab {tab!r}")
    if static and settings.hosted():
        raise UserError("this hosted demo offers the figures as one HTML page (each plot's camera button saves a "
                        "PNG); PNG and SVG files are written by a local install")
    folder = session.scratch() / f"figures-{tab}"
    shutil.rmtree(folder, ignore_errors=True)
    named = {f"{tab}_{name}": fig for name, fig in figs.items()}
    return [str(p) for p in figures.bundle(named, folder, f"scdviz-{tab}", ("png", "svg") if static else ())]
