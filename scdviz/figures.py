"""Figures out of the app and the CLI: PNG and SVG (kaleido, driving the Chromium already
installed) and standalone HTML (plotly.js embedded, opens offline).

``export`` writes one file per figure and format (``bench ... --figures DIR``); ``bundle`` writes
what the app's download buttons offer: one HTML page holding every figure with plotly.js once
(about 4.7 MB however many figures), and on request one zip per static format. Names become
file stems; nothing is written outside ``folder``.
"""

from __future__ import annotations

import html
import re
import shutil
import zipfile
from pathlib import Path

FORMATS = ("png", "svg", "html")
_STEM = re.compile(r"[^A-Za-z0-9_.-]+")


def stem(name: str) -> str:
    """A figure name as a safe file stem (``payload vs KL`` -> ``payload_vs_KL``)."""
    out = _STEM.sub("_", name).strip("._")
    return out or "figure"


def export(figs: dict, folder: str | Path, formats: tuple[str, ...] = FORMATS, scale: float = 2.0) -> list[Path]:
    """Write every figure in every format into ``folder``; returns the paths written.

    Static formats need kaleido and a Chromium; when either is missing this raises
    ValueError saying so (the HTML files are written first, so they are there either way).
    """
    import plotly.io as pio

    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ValueError(f"unknown figure format {', '.join(unknown)}; use {', '.join(FORMATS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    figs = {stem(name): fig for name, fig in figs.items() if fig is not None}
    written: list[Path] = []
    if "html" in formats:
        for name, fig in figs.items():
            path = folder / f"{name}.html"
            fig.write_html(path, include_plotlyjs=True, full_html=True)
            written.append(path)
    static = [f for f in formats if f != "html"]
    if static and figs:
        paths = [folder / f"{name}.{fmt}" for fmt in static for name in figs]
        batch = [fig for _ in static for fig in figs.values()]
        try:  # one browser for the whole batch (kaleido starts Chromium once per call); a batch ignores
            # each figure's own size unless given, so tall legends would be cut at kaleido's 700 x 500
            pio.write_images(batch, paths, scale=scale, width=[f.layout.width or 1100 for f in batch],
                             height=[f.layout.height or 500 for f in batch])
        except Exception as err:  # noqa: BLE001 - kaleido missing, or no Chromium it can start
            raise ValueError(f"could not write {'/'.join(static).upper()} ({type(err).__name__}: "
                             f"{str(err).splitlines()[0][:200] if str(err) else ''}); PNG and SVG need the kaleido "
                             "package and Chromium (Debian: apt-get install chromium); the HTML figures are in "
                             f"{folder}") from None
        written += paths
    return written


def page(figs: dict, title: str) -> str:
    """One standalone HTML page with every figure (in order, each under its name) and plotly.js once."""
    from plotly.offline import get_plotlyjs

    parts = [f"<h2>{html.escape(str(name))}</h2>" + fig.to_html(include_plotlyjs=False, full_html=False)
             for name, fig in figs.items() if fig is not None]
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>" + html.escape(title) + "</title>"
            "<script type='text/javascript'>" + get_plotlyjs() + "</script></head><body style='font-family:sans-serif'>"
            f"<h1>{html.escape(title)}</h1>" + "".join(parts) + "</body></html>")


def bundle(figs: dict, folder: str | Path, name: str, static: tuple[str, ...] = (), scale: float = 2.0) -> list[Path]:
    """``<name>.html`` (``page``) and, for each of ``static`` ("png", "svg"), ``<name>-<fmt>.zip`` of one
    image per figure, in ``folder``; returns the paths written. Static formats as in ``export``."""
    unknown = sorted(set(static) - (set(FORMATS) - {"html"}))
    if unknown:
        raise ValueError(f"unknown static figure format {', '.join(unknown)}; use png or svg")
    folder, name = Path(folder), stem(name)
    folder.mkdir(parents=True, exist_ok=True)
    figs = {key: fig for key, fig in figs.items() if fig is not None}
    out = folder / f"{name}.html"
    out.write_text(page(figs, name), encoding="utf-8")
    written = [out]
    if static and figs:
        images = folder / f".{name}-images"
        try:
            paths = export(figs, images, tuple(static), scale)
            for fmt in static:
                archive = folder / f"{name}-{fmt}.zip"
                with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
                    for p in paths:
                        if p.suffix == f".{fmt}":
                            z.write(p, p.name)
                written.append(archive)
        finally:
            shutil.rmtree(images, ignore_errors=True)
    return written
