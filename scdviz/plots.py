"""Plotly figures from result dataclasses and tables. Pure functions; no gradio, no models.

SCD figures take ``scdviz.scd.measure.MethodResult`` lists (read by attribute) and the
rank-spectra DataFrame; eviction figures take the eviction records / DataFrames; saved
benchmark records (``scdviz.records.BenchRecord``, one or several) go through
``record_figures``, which the Results tab and ``bench ... --figures`` share. Figure functions
return ``plotly.graph_objects.Figure``; ``records_table``, ``settings_diff`` and ``rounded``
make the Results tab's tables. Where points cluster, names go to the legend and the hover,
never onto the points.
"""

from __future__ import annotations

import json
import math
import numbers
import warnings
import zlib

import pandas as pd
import plotly.graph_objects as go

from scdviz import link as links

PATCH_COLOR = "rgba(230, 120, 20, 0.18)"
PATCH_EDGE = "rgba(230, 120, 20, 0.55)"  # the legend swatch of the patched-layer bands
# 20 colours that stay apart and visible on white, faded or not (``CONTEXT_OPACITY``): plotly's ten with its four
# palest (cyan, light green, light pink, yellow) darkened, then ten darker ones (eviction compares 13 methods); none
# lighter than plotly's orange (tests/test_plots.py checks every painted trace)
COLORS = ("#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#0099C6", "#FF6692", "#66AA00", "#7F7F7F",
          "#8C564B", "#222A2A", "#B68100", "#750D86", "#862A16", "#6C7C32", "#0D2A63", "#FC0080", "#00A08B",
          "#778AAE", "#AF0038")
# filled markers only: an open one is a thin ring that a faded trace without a line (a scatter of points) loses
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "cross", "star", "triangle-down", "pentagon",
           "hexagon", "triangle-left", "triangle-right", "hexagram", "star-diamond")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")


# ----------------------------------------------------------------------------- one look per method

# Every method the benches and tabs name has its own look (colour, marker, dash), the same in every plot
# of every tab; the focus methods first (the strongest colours). A budgeted SCD method is looked up without
# its budget ("SCD RD @3840 B/token" as "SCD RD"). Other names (a visitor's policy, a new press) get a look
# from their name, moved on only where it would repeat one already in the figure.
SCD_METHODS = ("SCD full", "raw KV", "DroidSpeak recompute", "SCD reuse-only", "4-bit KV", "SCD transform-coded",
               "SCD RD", "SCD RD+entropy", "SCD rank-only", "SCD r_K", "token 0")
EVICT_METHODS = ("distilled-scorer", "DistillCache", "DistillCache-per-head", "lookahead-policy", "H2O-no-recent",
                 "ObservedAttention", "SnapKV", "KVzip", "StreamingLLM",
                 "TOVA", "ExpectedAttention", "KeyDiff", "CUR", "LagKV", "Knorm", "Random", "PyramidKV",
                 "AdaKV-SnapKV", "AdaKV-ExpectedAttention", "CriticalKV-SnapKV", "CriticalAdaKV-SnapKV", "FastKVzip",
                 "distilled-scorer-closed-form", "distilled-scorer-per-layer")
KNOWN = SCD_METHODS + EVICT_METHODS  # each family drawn from the start of the palette (they never share a plot)
REFERENCE = ("#000000", "star", "dash")  # the oracle / the full cache: what every method is compared with
# focus methods strong; the rest thinner and lighter, yet every one clearly visible (the test's floor: opacity
# ≥ 0.55 and no near-white colour once faded)
FOCUS_WIDTH, CONTEXT_WIDTH, CONTEXT_OPACITY = 2.6, 1.5, 0.6


def look(method: str) -> tuple[str, str, str]:
    """(colour, marker symbol, line dash) of a method (see ``KNOWN``)."""
    name = str(method)
    if name in ("oracle", "full cache"):
        return REFERENCE
    base = name.split(" @")[0]
    for family in (SCD_METHODS, EVICT_METHODS):
        if base in family:
            i = family.index(base)
            return COLORS[i % len(COLORS)], SYMBOLS[i % len(SYMBOLS)], DASHES[(i // len(COLORS)) % len(DASHES)]
    h = zlib.crc32(name.encode())
    return COLORS[h % len(COLORS)], SYMBOLS[h % len(SYMBOLS)], DASHES[h % 2]


def paint(fig: go.Figure, focus: set[str] | None = None) -> go.Figure:
    """Give every method trace (named after its method) its ``look``; with ``focus``, those methods (and
    the oracle / full cache) are drawn strong and the rest thinner and lighter, each still clearly visible and
    in the legend, where a click hides or shows each."""
    used_colors, used_symbols = set(), set()
    for trace in fig.data:
        name = trace.name
        if not name or getattr(trace, "type", "scatter") != "scatter" or name.startswith(("patched", "oracle (")):
            continue
        color, symbol, dash = look(name)
        if name.split(" @")[0] not in KNOWN and name not in ("oracle", "full cache"):  # keep apart from the rest
            while color in used_colors and len(used_colors) < len(COLORS):
                color = COLORS[(COLORS.index(color) + 1) % len(COLORS)]
            while symbol in used_symbols and len(used_symbols) < len(SYMBOLS):
                symbol = SYMBOLS[(SYMBOLS.index(symbol) + 1) % len(SYMBOLS)]
        used_colors.add(color)
        used_symbols.add(symbol)
        strong = focus is None or name in focus or name in ("oracle", "full cache")
        trace.update(marker=dict(color=color, symbol=symbol),
                     line=dict(color=color, dash=dash, width=FOCUS_WIDTH if strong else CONTEXT_WIDTH),
                     opacity=1.0 if strong else CONTEXT_OPACITY)
    return fig


def best_other(kls: dict[str, float], exclude: set[str]) -> str | None:
    """The method with the lowest KL outside ``exclude`` (the best baseline)."""
    rest = {m: v for m, v in kls.items() if m not in exclude and v == v}
    return min(rest, key=rest.get) if rest else None


def _legend_entries(fig: go.Figure) -> int:
    return sum(1 for t in fig.data if t.showlegend is not False and t.name)


def _layout(fig: go.Figure, title: str, x: str, y: str, log_y: bool = False) -> go.Figure:
    """Title, axes and a legend that never covers the axis title: below the plot, growing downwards
    (the figure grows with it), or at the right when there are many entries."""
    n = _legend_entries(fig)
    rows = -(-n // 3)  # about three entries per row in a half-width plot
    below = n <= 15
    legend = (dict(orientation="h", x=0, xanchor="left", y=-0.2, yanchor="top") if below else
              dict(orientation="v", x=1.02, xanchor="left", y=1, yanchor="top"))
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, template="plotly_white",
                      height=380 + (22 * max(0, rows - 1) if below else 0), colorway=list(COLORS),
                      margin=dict(l=60, r=20, t=50, b=50), legend=legend, hoverlabel=dict(namelength=-1))
    if log_y:  # every tick a whole number ("0.02", not a bare "2" between decades; no SI prefix such as µ)
        fig.update_yaxes(type="log", tickformat=".2~g", dtick="D2")  # labels at 1, 2, 5 per decade: never crowded
    return fig


def _bands(layers: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive layers as (first, last)."""
    out: list[tuple[int, int]] = []
    for layer in sorted(set(layers)):
        if out and layer == out[-1][1] + 1:
            out[-1] = (out[-1][0], layer)
        else:
            out.append((layer, layer))
    return out


def _mark_layers(fig: go.Figure, layers: list[int], label: str) -> None:
    """Shade the given layers (e.g. patch layers) as vertical bands, neighbours merged, with one
    legend entry for all of them (no text on the plot, so nothing overlaps)."""
    if not layers:
        return
    for first, last in _bands(layers):
        fig.add_vrect(x0=first - 0.5, x1=last + 0.5, fillcolor=PATCH_COLOR, line_width=0, layer="below")
    fig.add_scatter(x=[None], y=[None], mode="markers", name=f"{label} ({', '.join(map(str, sorted(set(layers))))})",
                    marker=dict(symbol="square", size=14, color=PATCH_COLOR, line=dict(color=PATCH_EDGE, width=1)),
                    hoverinfo="skip")


def _num(value) -> str:
    """A number for a hover line: 4 significant digits, thousands kept whole (22,953 not 2.295e+04)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if not math.isfinite(value):
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _hover(part: pd.DataFrame, fields: list[tuple[str, str]]) -> list[str]:
    """One hover text per row: ``label: value`` lines for the fields present and not empty."""
    fields = [(label, col) for label, col in fields if col in part]
    out = []
    for _, row in part.iterrows():
        lines = [f"{label}: {_num(row[col])}" for label, col in fields
                 if row[col] is not None and not (isinstance(row[col], float) and math.isnan(row[col]))]
        out.append("<br>".join(lines))
    return out


def _overlay(fig: go.Figure, df: pd.DataFrame, x: str, y: str, series: str, group: str | None = None,
             mode: str = "markers", hover: list[tuple[str, str]] = (), sort_x: bool = False,
             group_style=None) -> None:
    """One trace per (group, series): a colour per series (the same in every group), a marker symbol
    and line dash per group (per series when there is one group; ``group_style`` = (symbol_of(group),
    dash_of(group)) sets them for several groups), a titled legend group per group and the ``hover``
    fields on hover. Points never carry text: where points cluster, labels overlap."""
    symbol_of, dash_of = group_style or (None, None)
    colors = {s: COLORS[i % len(COLORS)] for i, s in enumerate(dict.fromkeys(df[series]))}
    groups = list(dict.fromkeys(df[group])) if group else [None]
    for gi, g in enumerate(groups):
        part_g = df if g is None else df[df[group] == g]
        for si, (s, part) in enumerate(part_g.groupby(series, sort=False)):
            if sort_x:
                part = part.sort_values(x)
            k = si if len(groups) == 1 else gi
            several = len(groups) > 1  # else one record: a symbol per series, solid lines
            symbol = symbol_of(g) if symbol_of and several else SYMBOLS[k % len(SYMBOLS)]
            dash = dash_of(g) if dash_of and several else DASHES[gi % len(DASHES)]
            trace = go.Scatter(x=part[x].tolist(), y=part[y].tolist(), mode=mode, name=str(s),
                               hovertext=_hover(part, hover), hovertemplate="%{hovertext}<extra></extra>",
                               marker=dict(color=colors[s], symbol=symbol, size=9, line=dict(width=0.5, color="white")),
                               line=dict(color=colors[s], dash=dash, width=1.5))
            if g is not None:
                trace.legendgroup = str(g)
                if si == 0:
                    trace.legendgrouptitle = dict(text=str(g))
            fig.add_trace(trace)


def _patched(results) -> list[int]:
    """Layers patched or recomputed by any of the results' plans."""
    return sorted({i for r in results for i, m in enumerate(r.modes) if m in ("patch", "recompute")})


def layer_drift(results, kind: str = "K") -> go.Figure:
    """Per-layer relative error of the consumer cache's keys or values vs the oracle's."""
    fig = go.Figure()
    for r in results:
        series = r.drift_k if kind == "K" else r.drift_v
        if series:
            fig.add_scatter(x=list(range(len(series))), y=series, mode="lines+markers", name=r.method)
    _mark_layers(fig, _patched(results), "patched / recomputed")
    paint(fig)
    return _layout(fig, f"Per-layer {kind} drift vs oracle", "layer", f"‖{kind} − {kind}ᵒʳᵃᶜˡᵉ‖² / ‖{kind}ᵒʳᵃᶜˡᵉ‖²",
                   log_y=True)


def error_accumulation(results) -> go.Figure:
    """Hidden-state divergence of continuation tokens after each layer, patch layers marked."""
    fig = go.Figure()
    for r in results:
        if r.divergence:
            fig.add_scatter(x=list(range(len(r.divergence))), y=r.divergence, mode="lines+markers", name=r.method)
    _mark_layers(fig, _patched(results), "patched / recomputed")
    paint(fig)
    return _layout(fig, "Error accumulation through depth (continuation tokens)", "layer (0 = embeddings)",
                   "‖h − hᵒʳᵃᶜˡᵉ‖ / ‖hᵒʳᵃᶜˡᵉ‖")


def amplification(results) -> go.Figure:
    """Per-layer amplification α_l = divergence after layer l / before it."""
    fig = go.Figure()
    for r in results:
        a = r.amplification() if r.divergence else []
        if a:
            fig.add_scatter(x=list(range(len(a))), y=a, mode="lines+markers", name=r.method)
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    paint(fig)
    return _layout(fig, "Per-layer error amplification α_l", "layer", "α_l")


def patch_placement(sensitivity: list[float], chosen: list[int], label: str = "KL gain of an ideal patch") -> go.Figure:
    """Per-layer sensitivity bars with the chosen patch layers highlighted."""
    colors = ["#e67814" if i in chosen else "#8aa4c8" for i in range(len(sensitivity))]
    fig = go.Figure(go.Bar(x=list(range(len(sensitivity))), y=sensitivity, marker_color=colors, name=label))
    return _layout(fig, "Patch placement (orange = chosen layers)", "layer", label)


def rank_spectra(spectra: pd.DataFrame, kind: str = "K", chosen: list[int] | None = None) -> go.Figure:
    """Energy captured vs rank, one line per layer; chosen ranks marked when given."""
    fig = go.Figure()
    part = spectra[spectra["kind"] == kind]
    for layer, rows in part.groupby("layer"):
        energy = 1.0 - rows["fit_err"].to_numpy()
        fig.add_scatter(x=rows["rank"].tolist(), y=energy.tolist(), mode="lines", name=f"L{layer}",
                        line=dict(width=1), showlegend=False, hovertemplate=f"layer {layer}<br>rank %{{x}}: %{{y:.3f}}")
        if chosen is not None and layer < len(chosen) and chosen[layer] > 0:
            r = int(min(chosen[layer], len(energy) - 1))
            fig.add_scatter(x=[r], y=[float(energy[r])], mode="markers", marker=dict(size=6, color="black"),
                            showlegend=False, hoverinfo="skip")
    return _layout(fig, f"Rank spectra of the {kind} codes (energy captured vs rank, one line per layer)", "rank",
                   "energy captured")


def plan_layers(plan, sent: dict[str, list[float]] | None = None) -> go.Figure:
    """A transfer plan per layer: rank of the key and value codes and the patch layers (orange) on
    top, the bits of every code section (K, V, the patches' H_in) in a strip below; no labels on the bars.

    sent: what the payloads really carried (``MethodResult.sent``): the ranks sent and the bits per
    value spent (headers and scales included) replace the plan's, which a transform-coded plan
    leaves to the data."""
    from plotly.subplots import make_subplots

    n = len(plan.modes)
    layers = list(range(n))
    code = [m == "code" for m in plan.modes]
    coded = [i for i in layers if code[i]]

    def bits_of(i: int, kind: str) -> float:
        if not sent:
            return plan.bits_of(i, kind)
        cols = sent[f"cols_{kind}"][i]
        return round(8 * sent[f"bytes_{kind}"][i] / cols, 2) if cols else 0.0

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.72, 0.28], vertical_spacing=0.06)
    for kind, ranks, color, symbol in (("k", plan.rank_k or [0] * n, "#4c78a8", "diamond"),
                                       ("v", plan.rank_v or [0] * n, "#72b7b2", "circle")):
        ranks = [round(r, 1) for r in sent[f"cols_{kind}"]] if sent else ranks
        bits = [bits_of(i, kind) for i in layers]
        fig.add_bar(x=layers, y=[r if c else 0 for r, c in zip(ranks, code)], name=f"rank {kind.upper()}",
                    marker_color=color, customdata=bits, row=1, col=1,
                    hovertemplate=f"layer %{{x}}: rank {kind.upper()} %{{y}} at %{{customdata}} bits<extra></extra>")
        if coded:
            fig.add_scatter(x=coded, y=[bits[i] for i in coded], mode="markers", name=f"bits {kind.upper()}",
                            marker=dict(symbol=symbol, size=8, color=color, line=dict(color="black", width=1)),
                            row=2, col=1,
                            hovertemplate=f"layer %{{x}}: {kind.upper()} code at %{{y}} bits<extra></extra>")
    top = max([*(plan.rank_k or [0]), *(plan.rank_v or [0]), 1])
    patches = plan.layers_in("patch")
    if patches:
        h_bits = [bits_of(i, "h") for i in patches]
        fig.add_bar(x=patches, y=[top] * len(patches), name="patch (H_in code)", marker_color=PATCH_COLOR,
                    marker_line=dict(color=PATCH_EDGE, width=1), customdata=h_bits, row=1, col=1,
                    hovertemplate="layer %{x}: patch, H_in code at %{customdata} bits<extra></extra>")
        fig.add_scatter(x=patches, y=h_bits, mode="markers", name="bits H_in", row=2, col=1,
                        marker=dict(symbol="square", size=8, color="#e67814", line=dict(color="black", width=1)),
                        hovertemplate="layer %{x}: H_in code at %{y} bits<extra></extra>")
    fig.update_layout(barmode="group")
    _layout(fig, f"Plan per layer{' as sent' if sent else ''}: {plan.name}", "",
            "code rank" + (" sent" if sent else ""))
    fig.update_xaxes(title_text="layer", row=2, col=1)
    shown = sorted({y for t in fig.data if t.type == "scatter" for y in t.y})
    if sent:  # bits per value spent: any real number
        fig.update_yaxes(title_text="bits / value", row=2, col=1, range=[0, 1.25 * max(shown or [16])])
    else:
        fig.update_yaxes(title_text="bits", row=2, col=1, tickvals=shown, range=[0, 1.25 * max(shown or [16])])
    return fig


def pareto(table: pd.DataFrame) -> go.Figure:
    """Payload bytes per token vs KL, one point per method (lower-left is better): colour and marker
    per method, names in the legend and the hover, no labels on the points (they cluster). With
    several specialists (the fan-out) each is a legend group with its own marker."""
    rows = table[pd.to_numeric(table["bytes_per_token"], errors="coerce") > 0]
    fig = go.Figure()
    several = "specialist" in rows and rows["specialist"].nunique() > 1
    _overlay(fig, rows.assign(series=rows["method"]), "bytes_per_token", "kl", "series",
             group="specialist" if several else None,
             hover=[("method", "method"), ("specialist", "specialist"), ("payload (B/token)", "bytes_per_token"),
                    ("KL", "kl"), ("KL s.e.", "kl_se"), ("top-1", "top1")])
    if not several:
        paint(fig)
    return _layout(fig, "Payload vs quality (lower left is better)", "payload bytes per prompt token",
                   "KL(oracle ‖ method), nats/token", log_y=True)


def compute_axis(table: pd.DataFrame) -> go.Figure:
    """The consumer's own compute (the share of its prefill it runs itself: recomputed layers and tokens) vs
    KL, one point per method (lower left is better; the oracle, all compute and no error, left out)."""
    rows = table[table["method"] != "oracle"]
    fig = go.Figure()
    _overlay(fig, rows.assign(series=rows["method"]), "prefill_share", "kl", "series",
             hover=[("method", "method"), ("share of the prefill", "prefill_share"), ("payload (B/token)",
                                                                                      "bytes_per_token"),
                    ("KL", "kl"), ("top-1", "top1")])
    paint(fig)
    fig.update_xaxes(tickformat=".0%")
    return _layout(fig, "Consumer compute vs quality (lower left is better)",
                   "share of its own prefill the consumer computes", "KL(oracle ‖ method), nats/token", log_y=True)


def ttft_vs_bandwidth(results, gbps: list[float] | None = None, latency_s: float = 0.0005) -> go.Figure:
    """Modelled TTFT of every method across link bandwidths; the oracle is flat."""
    gbps = gbps or [0.5, 1, 2, 5, 10, 25, 50, 100]
    fig = go.Figure()
    oracle = sum(r.oracle_seconds for r in results) / max(1, len(results))
    fig.add_scatter(x=gbps, y=[oracle] * len(gbps), mode="lines", name="oracle (consumer prefill)",
                    line=dict(dash="dash", color="black"))
    for r in results:
        if r.payload_bytes_per_token <= 0:
            continue
        n_bytes = r.payload_bytes_per_token * r.prompt_tokens
        ys = [links.ttft(n_bytes, r.consumer_seconds, links.Link(g, latency_s)) for g in gbps]
        fig.add_scatter(x=gbps, y=ys, mode="lines+markers", name=r.method)
    fig.update_xaxes(type="log", tickvals=gbps)
    paint(fig)
    return _layout(fig, "Modelled TTFT vs link bandwidth", "link bandwidth, Gbit/s", "time to first token, s",
                   log_y=True)


# ----------------------------------------------------------------------------- eviction


def kl_per_step(kl_steps: dict[str, list[float]]) -> go.Figure:
    """KL(full ‖ pruned) at every scored decode step, one line per method."""
    fig = go.Figure()
    for i, (method, ys) in enumerate(kl_steps.items()):
        fig.add_scatter(x=list(range(1, len(ys) + 1)), y=ys, mode="lines", name=method,
                        line=dict(dash=DASHES[(i // len(COLORS)) % len(DASHES)], width=1.5))
    paint(fig)
    return _layout(fig, "KL per decode step (teacher-forced on the full cache's continuation)", "decode step",
                   "KL(full ‖ pruned), nats", log_y=True)


def budget_sweep(sweep: dict[str, dict[float, float]]) -> go.Figure:
    """Mean KL vs kept fraction, one line per method (colour and marker per method)."""
    fig = go.Figure()
    for i, (method, points) in enumerate(sweep.items()):
        keeps = sorted(points)
        fig.add_scatter(x=[100 * k for k in keeps], y=[points[k] for k in keeps], mode="lines+markers", name=method,
                        marker=dict(symbol=SYMBOLS[i % len(SYMBOLS)], size=7),
                        hovertemplate=f"{method}<br>%{{x:.3g}} % kept: KL %{{y:.4g}}<extra></extra>")
    paint(fig)
    return _layout(fig, "Budget sweep", "% of context kept", "mean KL(full ‖ pruned), nats/token", log_y=True)


def kept_heatmap(kept_per_layer: list[list[float]], tokens: list[str], method: str) -> go.Figure:
    """(L, T) share of KV heads keeping each token, per layer."""
    fig = go.Figure(go.Heatmap(z=kept_per_layer, x=list(range(len(tokens))), colorscale="Blues", zmin=0, zmax=1,
                               customdata=[tokens] * len(kept_per_layer),
                               hovertemplate="layer %{y}, token %{x} %{customdata}: %{z:.2f}<extra></extra>"))
    fig.update_traces(colorbar={"title": {"text": "share of<br>KV heads", "side": "top"}})
    # the method's name can be long (distilled-scorer-closed-form): on its own line, the plot is half width
    return _layout(fig, f"Tokens kept per layer<br><sub>by {method}</sub>", "context token", "layer")


FEATURE_WORDS = {  # the policy's per-token features (scdviz.evict.features), as a person reads them
    "alpha": ("attention received", "mean attention the window's queries give the token (α)"),
    "vnorm": ("value norm", "L2 norm of the token's value vector ‖v‖"),
    "sigma": ("attention spread", "variance of the received attention across query heads (σ)"),
    "entropy": ("attenders' entropy", "attention-weighted entropy of the queries that attend to the token"),
    "pos": ("position", "position in the context, 0 = first token, 1 = last"),
    "lookahead": ("lookahead attention", "attention from sampled continuations of the context"),
}


def feature_distributions(features: list[list[float]], kept: list[float], names: tuple[str, ...]) -> go.Figure:
    """Box plots of each per-token feature for kept (share ≥ 0.5) vs evicted tokens, each feature named in
    words (``FEATURE_WORDS``; the hover says what it measures)."""
    from plotly.subplots import make_subplots

    words = [FEATURE_WORDS.get(n, (n, n)) for n in names]
    # one word per line: six titles side by side in a half-width plot would run into each other
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=[w[0].replace(" ", "<br>") for w in words])
    for j in range(len(names)):
        for label, color, sel in (("kept", "#1f77b4", True), ("evicted", "#d62728", False)):
            ys = [f[j] for f, k in zip(features, kept) if (k >= 0.5) == sel]
            fig.add_box(y=ys, name=label, marker_color=color, showlegend=j == 0, legendgroup=label, row=1, col=j + 1,
                        hovertemplate=f"{words[j][1]}<br>{label}: %{{y:.3g}}<extra></extra>")
    fig.update_layout(title="Features of kept vs evicted tokens (kept: by at least half the heads)",
                      template="plotly_white", height=380,
                      margin=dict(l=40, r=20, t=100, b=40))
    return fig


# ----------------------------------------------------------------------------- training and saved results


def training_curve(log: dict | None) -> go.Figure:
    """REINFORCE sampled KL per step (and its running mean) plus validation KL at checkpoints."""
    fig = go.Figure()
    steps = (log or {}).get("steps", [])
    if steps:
        xs, kl = [s["step"] for s in steps], [s["kl"] for s in steps]
        run = [sum(kl[max(0, i - 9) : i + 1]) / len(kl[max(0, i - 9) : i + 1]) for i in range(len(kl))]
        fig.add_scatter(x=xs, y=kl, mode="markers", name="sampled KL", marker=dict(size=4, opacity=0.4))
        fig.add_scatter(x=xs, y=run, mode="lines", name="running mean (10)")
    val = (log or {}).get("val", [])
    if val:
        fig.add_scatter(x=[v.get("step", i) for i, v in enumerate(val)], y=[v["kl"] for v in val],
                        mode="lines+markers", name="validation KL (deterministic)")
    return _layout(fig, "Policy training", "REINFORCE step", "KL(full ‖ pruned)")


def fit_candidates(log: dict | None) -> go.Figure:
    """The distilled scorer's fit (scdviz.evict.student_fit): validation KL of every candidate it tried (ridge
    strength, decode-state weight, then the listwise stage), the chosen one marked, H2O's on the same contexts as
    a line."""
    fig = go.Figure()
    val = (log or {}).get("val", [])
    if val:
        names = [("listwise " + f"{v['listwise_penalty']:g}" if "listwise_penalty" in v else f"ridge {v['ridge']:g}")
                 + (f", decode ×{v['decode_weight']:g}" if v.get("decode_weight") is not None else "") for v in val]
        fig.add_bar(x=names, y=[v["kl"] for v in val], name="validation KL (prefill)")
        if log.get("val_heuristic"):
            fig.add_scatter(x=names, y=[log["val_heuristic"]] * len(names), mode="lines", name="H2O, same contexts",
                            line=dict(dash="dash"))
    return _layout(fig, "Distilled scorer: candidates on validation", "candidate", "KL(full ‖ pruned)")


def distil_curve(log: dict | None) -> go.Figure:
    """The correction stage's training (scdviz.scd.distil): validation KL at each validation (step 0 = the closed
    form) at each plan it was trained at, their mean (which chooses the checkpoint kept, marked), and the training
    KL between validations, against training steps."""
    fig = go.Figure()
    log = log or {}
    kl = log.get("val_kl") or []
    at = log.get("val_steps") or list(range(len(kl)))  # a log from before validation by steps: one per epoch
    for name, by in (log.get("val_kl_by_plan") or {}).items():
        fig.add_scatter(x=at, y=by, mode="lines+markers", name=f"validation, {name}")
    if kl:
        fig.add_scatter(x=at, y=kl, mode="lines+markers", name="validation, mean (chooses)", line=dict(width=3))
        best = log.get("best_epoch", 0)
        fig.add_scatter(x=[at[best]], y=[kl[best]], mode="markers", name=f"kept: step {at[best]}",
                        marker=dict(size=14, symbol="star"))
    if log.get("train_kl"):
        fig.add_scatter(x=at[1 : len(log["train_kl"]) + 1], y=log["train_kl"], mode="lines",
                        name="training (mean since the validation before)", line=dict(dash="dot"))
    unit = "step" if log.get("val_steps") else "epoch"
    return _layout(fig, "Correction stage trained through the consumer", f"training {unit} (0 = closed form)",
                   "KL(oracle ‖ SCD), nats/token")


def selection_curve(selection_kl: list[float], order: list[int]) -> go.Figure:
    """Continuation KL after adding each patch layer in selection order (0 = no patch)."""
    labels = ["none"] + [f"+L{layer}" for layer in order[: max(0, len(selection_kl) - 1)]]
    fig = go.Figure(go.Scatter(x=labels, y=selection_kl, mode="lines+markers"))
    return _layout(fig, "Greedy patch selection on calibration data", "patch layers added", "continuation KL")


# ----------------------------------------------------------------------------- several saved records


# ----------------------------------------------------------------------------- words for people

FIGURE_LABELS = {
    "drift_k": "Per-layer key drift", "drift_v": "Per-layer value drift", "accumulation": "Error accumulation",
    "amplification": "Error amplification per layer", "placement": "Where a patch helps",
    "spectra_k": "Key rank spectra", "spectra_v": "Value rank spectra", "pareto": "Payload vs quality",
    "compute": "Consumer compute vs quality",
    "ttft": "Time to first token vs link", "plan": "The transfer plan per layer",
    "kl_steps": "KL per decode step", "sweep": "Budget sweep", "heatmap": "Kept tokens per layer",
    "features": "Token features, kept vs evicted",
}
HEADERS = {
    "method": "method", "bytes_per_token": "payload (B/token)", "compression_vs_fp16": "compression vs fp16 (×)",
    "kl": "KL (nats/token)", "kl_se": "KL std. error", "top1": "top-1 agreement", "ppl": "perplexity",
    "ppl_oracle": "perplexity, oracle", "f1": "F1 vs oracle text", "consumer_ms": "consumer time (ms)",
    "ttft_10gbps_ms": "TTFT at 10 Gbit/s (ms)", "speedup_10gbps": "speed-up vs oracle at 10 Gbit/s (×)",
    "qa_f1": "QA F1", "ttft_your_link_ms": "TTFT on your link (ms)", "tokens_kept": "tokens kept per head",
    "jaccard_vs_h2o": "overlap with ObservedAttention's kept slots (Jaccard)",  # kvpress's H2O score, by the name
    "kept_not_by_h2o": "share of kept slots ObservedAttention drops",  # the eviction tab gives it everywhere
    "role": "role",
    "specialist": "specialist", "prefill_share": "consumer compute (share of its prefill)",
}


def worded(df: pd.DataFrame) -> pd.DataFrame:
    """A tab's table for people: columns that say nothing here (one value for every row, as the group of
    a one-prompt run; or empty) dropped, the rest named in words with units (``HEADERS``)."""
    keep = [c for c in df.columns if c == "method" or not (df[c].isna().all() or
                                                           (c == "group" and df[c].nunique() <= 1) or
                                                           (c == "kl_se" and (df[c].fillna(0) == 0).all()))]
    return df[keep].rename(columns=HEADERS)


def round_sig(value, digits: int = 4):
    """A float rounded to ``digits`` significant digits for display, never dropping digits before the
    point (0.0894391 -> 0.08944, 22952.76 -> 22953.0); anything else (ints, text, NaN) unchanged."""
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value) or value == 0:
        return value
    return round(value, max(0, digits - 1 - math.floor(math.log10(abs(value)))))


def rounded(df: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """A copy of ``df`` for display: every float to ``digits`` significant digits (``round_sig``).
    Exports (CSV) take the unrounded table."""
    out = df.copy()
    for col in out.columns:
        if pd.api.types.is_float_dtype(out[col]) or out[col].dtype == object:
            out[col] = out[col].map(lambda v: round_sig(v, digits))
    return out


def unique_labels(labels: list[str]) -> list[str]:
    """Labels made unique in order: a repeated ``name`` becomes ``name (2)``, ``name (3)``..."""
    out: list[str] = []
    for label in map(str, labels):
        name, n = label, 1
        while name in out:
            n += 1
            name = f"{label} ({n})"
        out.append(name)
    return out


def _concat(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Rows of several records in one frame (records without a column bring it empty, as they should)."""
    with warnings.catch_warnings():  # pandas warns that all-empty columns will keep their dtype; fine here
        warnings.simplefilter("ignore", FutureWarning)
        return pd.concat(parts, ignore_index=True)


def records_table(labelled: list[tuple[str, object]]) -> pd.DataFrame:
    """Every record's rows in one table, with ``record`` (its label) and ``bench_kind`` columns first;
    raw values (what the CSV export writes; ``rounded`` it for display)."""
    labels = unique_labels([label for label, _ in labelled])
    parts = [pd.DataFrame(rec.rows).assign(record=label, bench_kind=rec.kind)
             for label, (_, rec) in zip(labels, labelled)]
    if not parts:
        return pd.DataFrame(columns=["record", "bench_kind"])
    df = _concat(parts)
    return df[["record", "bench_kind", *[c for c in df.columns if c not in ("record", "bench_kind")]]]


def _flat(obj, prefix: str, out: dict) -> dict:
    """Nested settings as dotted keys (``bench.prompt_len``) with values as text (JSON for lists)."""
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            _flat(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif prefix:
        out[prefix] = obj if isinstance(obj, str) else json.dumps(obj)
    return out


def record_settings(record) -> dict[str, str]:
    """A record's settings flattened (``bench.prompt_len``), with its own fields as ``record.*`` and the
    packages and hardware it ran on as ``versions.*``."""
    own = {"kind": record.kind, "seed": record.seed, "created": record.created,
           "seconds": getattr(record, "seconds", None), "note": record.note}
    out = _flat({k: v for k, v in own.items() if v not in (None, "")}, "record", {})
    _flat(record.settings or {}, "", out)
    _flat(record.versions or {}, "versions", out)
    return out


def settings_diff(labelled: list[tuple[str, object]]) -> pd.DataFrame:
    """The settings whose values differ between the records, one column per record (every setting
    when there is one record); ``—`` where a record lacks the setting."""
    labels = unique_labels([label for label, _ in labelled])
    flat = [record_settings(rec) for _, rec in labelled]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    rank = {"record": 0, "versions": 2}  # the records' own fields first, their packages last
    keys.sort(key=lambda k: rank.get(k.split(".")[0], 1))
    if len(flat) > 1:
        keys = [k for k in keys if len({f.get(k, "—") for f in flat}) > 1]
    return pd.DataFrame([[k, *[f.get(k, "—") for f in flat]] for k in keys], columns=["setting", *labels])


def _frames(labelled, kind: str) -> list[tuple[str, pd.DataFrame]]:
    return [(label, pd.DataFrame(rec.rows)) for label, rec in labelled if rec.kind == kind]


def _numeric(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    """``df`` with ``cols`` as numbers (missing columns as NaN)."""
    return df.assign(**{c: pd.to_numeric(df[c], errors="coerce") if c in df else float("nan") for c in cols})


def _records_legend(fig: go.Figure) -> go.Figure:
    """Record figures: a titled legend group per record at the right (clicking an entry hides that
    series alone, clicking a record's title hides the record); tall enough to show every entry, so
    an exported image has the whole legend."""
    groups = len({t.legendgroup for t in fig.data if t.legendgroup})
    height = min(2400, max(480, 22 * _legend_entries(fig) + 40 * groups + 150))
    fig.update_layout(height=height, legend=dict(orientation="v", x=1.02, xanchor="left", y=1, yanchor="top",
                                                 groupclick="toggleitem", tracegroupgap=12),
                      margin=dict(l=70, r=20, t=60, b=60))
    return fig


KL_EXACT = 1e-5  # KL at or below this is the oracle's own (float noise): not drawn on a log axis of KL


def _scd_payload_kl(frames, symbol_of, dash_of) -> go.Figure | None:
    parts = []
    for label, df in frames:
        df = _numeric(df, "payload_bytes_per_token", "kl", "kl_se", "top1")
        if "row" in df:
            df = df[df["row"].fillna("measured") == "measured"]
        df = df[(df["payload_bytes_per_token"] > 0) & (df["kl"] > KL_EXACT)]
        if df.empty:
            continue
        group = df["group"] if "group" in df else pd.Series("method", index=df.index)
        series = df["method"].where(group.isna() | (group == "method"), group)
        parts.append(df.assign(record=label, series=series.astype(str), group=group))
    if not parts:
        return None
    fig = go.Figure()
    _overlay(fig, _concat(parts), "payload_bytes_per_token", "kl", "series", group="record",
             group_style=(symbol_of, dash_of),
             hover=[("record", "record"), ("method", "method"), ("group", "group"), ("specialist", "specialist"),
                    ("domain", "domain"), ("held out", "held_out"), ("payload (B/token)", "payload_bytes_per_token"),
                    ("KL", "kl"), ("KL s.e.", "kl_se"), ("top-1", "top1"), ("prompts", "n_prompts")])
    _layout(fig, "SCD records: payload vs KL (lower left is better)", "payload bytes per prompt token",
            "KL(oracle ‖ method)", log_y=True)
    return _records_legend(fig)


def _evict_kl_budget(frames, symbol_of, dash_of) -> go.Figure | None:
    parts = []
    for label, df in frames:
        df = _numeric(df, "keep", "kl", "kl_se", "top1", "tokens_kept")
        df = df[(df["keep"] > 0) & (df["kl"] > 0)]
        if not df.empty:
            parts.append(df.assign(record=label, kept_pct=100 * df["keep"]))
    if not parts:
        return None
    df = _concat(parts)
    name = df["method"].astype(str)
    for col in ("mode", "model"):  # part of a series' name only where the records hold several
        if col in df and df[col].nunique() > 1:
            name = name + " · " + df[col].astype(str).str.replace("builtin:", "", regex=False)
    fig = go.Figure()
    _overlay(fig, df.assign(series=name), "kept_pct", "kl", "series", group="record", mode="lines+markers",
             sort_x=True, group_style=(symbol_of, dash_of),
             hover=[("record", "record"), ("method", "method"), ("mode", "mode"), ("model", "model"),
                    ("kept (%)", "kept_pct"), ("tokens kept", "tokens_kept"), ("KL", "kl"), ("KL s.e.", "kl_se"),
                    ("top-1", "top1"), ("QA F1", "qa_f1"), ("contexts", "n_contexts")])
    _layout(fig, "Eviction records: KL vs budget", "% of context kept", "KL(full ‖ pruned)", log_y=True)
    return _records_legend(fig)


def _ttft_lines(frames, symbol_of, dash_of) -> go.Figure | None:
    parts, oracles = [], []
    for label, df in frames:
        gbps = [g for g in (1, 10, 100) if f"ttft_{g}gbps_ms" in df]
        if not gbps:
            continue
        df = _numeric(df, "oracle_ms", "bytes_per_token", "break_even_gbps", *[f"ttft_{g}gbps_ms" for g in gbps],
                      *[f"ttft_with_prefill_{g}gbps_ms" for g in gbps])
        methods = df[df["method"] != "oracle"]
        for g in gbps:
            parts.append(methods.assign(record=label, gbps=g, ttft=methods[f"ttft_{g}gbps_ms"],
                                        with_prefill=methods[f"ttft_with_prefill_{g}gbps_ms"]))
        oracle = df["oracle_ms"].dropna()
        if len(oracle):
            oracles.append((label, float(oracle.iloc[0]), gbps))
    df = _concat(parts) if parts else pd.DataFrame()
    if df.empty or df["ttft"].notna().sum() == 0:
        return None
    df = df[df["ttft"] > 0]
    fig = go.Figure()
    _overlay(fig, df.assign(series=df["method"].astype(str)), "gbps", "ttft", "series", group="record",
             mode="lines+markers", sort_x=True, group_style=(symbol_of, dash_of),
             hover=[("record", "record"), ("method", "method"), ("link (Gbit/s)", "gbps"), ("TTFT (ms)", "ttft"),
                    ("with producer prefill (ms)", "with_prefill"), ("payload (B/token)", "bytes_per_token"),
                    ("break-even (Gbit/s)", "break_even_gbps")])
    for label, oracle_ms, gbps in oracles:
        fig.add_scatter(x=[min(gbps), max(gbps)], y=[oracle_ms, oracle_ms], mode="lines", name="oracle prefill",
                        legendgroup=label, line=dict(color="black", dash=dash_of(label), width=1.5),
                        hovertemplate=f"record: {label}<br>oracle (consumer prefill): "
                                      f"{_num(oracle_ms)} ms<extra></extra>")
    fig.update_xaxes(type="log", tickvals=[1, 10, 100])
    _layout(fig, "TTFT records: time to first token vs link bandwidth (medians)", "link Gbit/s", "TTFT (ms)",
            log_y=True)
    return _records_legend(fig)


RECORD_FIGURES = {"scd": ("payload_vs_kl", _scd_payload_kl), "evict": ("kl_vs_budget", _evict_kl_budget),
                  "ttft": ("ttft", _ttft_lines)}


def record_figures(labelled: list[tuple[str, object]]) -> dict[str, go.Figure]:
    """Figures of one or several benchmark records (``scdviz.records.BenchRecord``), overlaid per kind:
    ``payload_vs_kl`` (SCD records), ``kl_vs_budget`` (eviction records), ``ttft`` (TTFT records).

    ``labelled``: (label, record) pairs; labels name the records in legends and hovers (repeated
    labels get a suffix). Each record is a titled legend group with its own marker symbol and line
    dash, the same in every figure; each method keeps one colour across records. Kinds without
    plottable rows give no figure; no records give ``{}``. The app's Results tab and
    ``bench ... --figures`` both draw with this.
    """
    labels = unique_labels([label for label, _ in labelled])
    labelled = [(label, rec) for label, (_, rec) in zip(labels, labelled)]
    out = {}
    for kind, (name, make) in RECORD_FIGURES.items():
        frames = _frames(labelled, kind)
        index = {label: i for i, (label, _) in enumerate(frames)}  # the first record of a kind: circles, solid

        def symbol_of(label, index=index):
            return SYMBOLS[index.get(label, 0) % len(SYMBOLS)]

        def dash_of(label, index=index):
            return DASHES[index.get(label, 0) % len(DASHES)]

        fig = make(frames, symbol_of, dash_of) if frames else None
        if fig is not None:
            out[name] = fig
    return out
