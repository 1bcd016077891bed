"""Plotly figures from result dataclasses and tables. Pure functions; no gradio, no models.

SCD figures take ``scdviz.scd.measure.MethodResult`` lists (read by attribute) and the
rank-spectra DataFrame; eviction figures take the eviction records / DataFrames. Every
function returns a ``plotly.graph_objects.Figure``.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from scdviz import link as links

PATCH_COLOR = "rgba(230, 120, 20, 0.18)"


def _layout(fig: go.Figure, title: str, x: str, y: str, log_y: bool = False) -> go.Figure:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, template="plotly_white", height=380,
                      margin=dict(l=60, r=20, t=50, b=50), legend=dict(orientation="h", y=-0.2))
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def _mark_layers(fig: go.Figure, layers: list[int], label: str) -> None:
    """Shade the given layers (e.g. patch layers) as vertical bands."""
    for i, layer in enumerate(layers):
        fig.add_vrect(x0=layer - 0.5, x1=layer + 0.5, fillcolor=PATCH_COLOR, line_width=0,
                      annotation_text=label if i == 0 else None, annotation_position="top left")


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
    return _layout(fig, f"Per-layer {kind} drift vs oracle", "layer", f"‖{kind} − {kind}ᵒʳᵃᶜˡᵉ‖² / ‖{kind}ᵒʳᵃᶜˡᵉ‖²",
                   log_y=True)


def error_accumulation(results) -> go.Figure:
    """Hidden-state divergence of continuation tokens after each layer, patch layers marked."""
    fig = go.Figure()
    for r in results:
        if r.divergence:
            fig.add_scatter(x=list(range(len(r.divergence))), y=r.divergence, mode="lines+markers", name=r.method)
    _mark_layers(fig, _patched(results), "patched / recomputed")
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


def plan_layers(plan) -> go.Figure:
    """A transfer plan per layer: rank of the key and value codes (bars, bits in the hover and
    the label) and the patch layers (orange, the bits of their H_in code)."""
    n = len(plan.modes)
    layers = list(range(n))
    code = [m == "code" for m in plan.modes]
    fig = go.Figure()
    for kind, ranks, color in (("k", plan.rank_k or [0] * n, "#4c78a8"), ("v", plan.rank_v or [0] * n, "#72b7b2")):
        bits = [plan.bits_of(i, kind) for i in layers]
        fig.add_bar(x=layers, y=[r if c else 0 for r, c in zip(ranks, code)], name=f"rank {kind.upper()}",
                    marker_color=color, text=[f"{b}b" if c else "" for b, c in zip(bits, code)], textposition="outside",
                    customdata=bits, hovertemplate=f"layer %{{x}}<br>rank {kind.upper()} %{{y}} at %{{customdata}} bits")
    top = max([*(plan.rank_k or [0]), *(plan.rank_v or [0]), 1])
    patches = plan.layers_in("patch")
    if patches:
        fig.add_bar(x=patches, y=[top] * len(patches), name="patch (H_in code)", marker_color=PATCH_COLOR,
                    text=[f"{plan.bits_of(i, 'h')}b" for i in patches], textposition="outside",
                    hovertemplate="layer %{x}: patch, H_in code at %{text}")
    fig.update_layout(barmode="group")
    return _layout(fig, f"Plan per layer: {plan.name}", "layer", "code rank (label: bits)")


def pareto(table: pd.DataFrame) -> go.Figure:
    """Payload bytes per token vs KL, one point per method (lower-left is better)."""
    rows = table[table["bytes_per_token"] > 0]
    fig = go.Figure()
    for group, part in rows.groupby("group"):
        fig.add_scatter(x=part["bytes_per_token"], y=part["kl"], mode="markers+text", text=part["method"],
                        textposition="top center", name=group, marker=dict(size=10))
    return _layout(fig, "Payload vs quality", "payload bytes per prompt token", "KL(oracle ‖ method)", log_y=True)


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
    fig.update_xaxes(type="log")
    return _layout(fig, "Modelled TTFT vs link bandwidth", "Gbit/s", "seconds", log_y=True)


# ----------------------------------------------------------------------------- eviction


def kl_per_step(kl_steps: dict[str, list[float]]) -> go.Figure:
    """KL(full ‖ pruned) at every scored decode step, one line per method."""
    fig = go.Figure()
    for method, ys in kl_steps.items():
        fig.add_scatter(x=list(range(1, len(ys) + 1)), y=ys, mode="lines", name=method)
    return _layout(fig, "KL per decode step (teacher-forced on the full cache's continuation)", "step",
                   "KL(full ‖ pruned)", log_y=True)


def budget_sweep(sweep: dict[str, dict[float, float]]) -> go.Figure:
    """Mean KL vs kept fraction, one line per method."""
    fig = go.Figure()
    for method, points in sweep.items():
        keeps = sorted(points)
        fig.add_scatter(x=[100 * k for k in keeps], y=[points[k] for k in keeps], mode="lines+markers", name=method)
    return _layout(fig, "Budget sweep", "% of context kept", "mean KL(full ‖ pruned)", log_y=True)


def kept_heatmap(kept_per_layer: list[list[float]], tokens: list[str], method: str) -> go.Figure:
    """(L, T) share of KV heads keeping each token, per layer."""
    fig = go.Figure(go.Heatmap(z=kept_per_layer, x=list(range(len(tokens))), colorscale="Blues", zmin=0, zmax=1,
                               customdata=[tokens] * len(kept_per_layer),
                               hovertemplate="layer %{y}, token %{x} %{customdata}: %{z:.2f}<extra></extra>"))
    return _layout(fig, f"Tokens kept per layer by {method} (share of KV heads)", "context token", "layer")


def feature_distributions(features: list[list[float]], kept: list[float], names: tuple[str, ...]) -> go.Figure:
    """Box plots of each per-token feature for kept (share ≥ 0.5) vs evicted tokens."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names)
    for j in range(len(names)):
        for label, color, sel in (("kept", "#1f77b4", True), ("evicted", "#d62728", False)):
            ys = [f[j] for f, k in zip(features, kept) if (k >= 0.5) == sel]
            fig.add_box(y=ys, name=label, marker_color=color, showlegend=j == 0, legendgroup=label, row=1, col=j + 1)
    fig.update_layout(title="Features of kept vs evicted tokens", template="plotly_white", height=360,
                      margin=dict(l=40, r=20, t=70, b=40))
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


def selection_curve(selection_kl: list[float], order: list[int]) -> go.Figure:
    """Continuation KL after adding each patch layer in selection order (0 = no patch)."""
    labels = ["none"] + [f"+L{layer}" for layer in order[: max(0, len(selection_kl) - 1)]]
    fig = go.Figure(go.Scatter(x=labels, y=selection_kl, mode="lines+markers"))
    return _layout(fig, "Greedy patch selection on calibration data", "patch layers added", "continuation KL")


def results_overview(df: pd.DataFrame, kind: str) -> go.Figure:
    """A saved benchmark: payload vs KL (SCD) or KL vs kept fraction (eviction)."""
    if kind == "scd":
        rows = df[df["row"] == "measured"] if "row" in df else df
        rows = rows[rows["payload_bytes_per_token"] > 0]
        fig = go.Figure()
        keys = [c for c in ("specialist", "domain") if c in rows and rows[c].notna().any()] or ["method"]
        for name, part in rows.groupby(keys):
            label = " / ".join(str(x) for x in (name if isinstance(name, tuple) else (name,)))
            fig.add_scatter(x=part["payload_bytes_per_token"], y=part["kl"], mode="markers+text", text=part["method"],
                            textposition="top center", name=label)
        return _layout(fig, "Saved SCD benchmark: payload vs KL", "payload bytes per prompt token", "KL", log_y=True)
    if kind == "ttft":
        rows = df[df["method"] != "oracle"]
        fig = go.Figure()
        for col, label in (("ttft_10gbps_ms", "without producer prefill"), ("ttft_with_prefill_10gbps_ms", "with it")):
            if col in rows:
                fig.add_bar(x=rows["method"], y=rows[col], name=label)
        if "oracle_ms" in df:
            fig.add_hline(y=float(df["oracle_ms"].iloc[0]), line_dash="dash", annotation_text="oracle prefill")
        return _layout(fig, "Saved TTFT benchmark at 10 Gbit/s (medians)", "method", "TTFT (ms)")
    fig = go.Figure()
    rows = df[pd.to_numeric(df["keep"], errors="coerce").notna() & df["kl"].notna()]
    keys = [c for c in ("model", "mode", "method") if c in rows]
    for name, part in rows.groupby(keys):
        part = part.assign(keep=part["keep"].astype(float)).sort_values("keep")
        label = " / ".join(str(x) for x in (name if isinstance(name, tuple) else (name,)))
        fig.add_scatter(x=100 * part["keep"], y=part["kl"], mode="lines+markers", name=label)
    return _layout(fig, "Saved eviction benchmark: KL vs budget", "% kept", "KL", log_y=True)
