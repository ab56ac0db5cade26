"""The HTML report's plot of serving benchmarks (``fitbench serve-bench``'s rows, mode ``serve``):
latency against load. For each server run (the directory, the model and the lengths asked), one line
per figure through its points ordered by the output tokens per second they reached: time to first
token (p50 solid, p99 dotted) on the left, inter-token latency (p50, p99) on the right, so the knee,
where latency climbs while throughput stops growing, shows. Points with failed requests are marked
with an x and say how many in their hover text.
"""

from __future__ import annotations

from collections import defaultdict

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fitbench.results.directories import Sweeps

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
MS = 1e3


def latency_figure(sweeps: Sweeps) -> go.Figure | None:
    """The figure of the module's docstring; None when the rows hold no served point."""
    rows = [row for row in sweeps.rows if row.status == "ok" and row.spec["mode"] == "serve" and row.serving
            and (row.timing or {}).get("ttft")]
    if not rows:
        return None
    groups = defaultdict(list)
    for row in rows:
        spec = row.spec
        groups[f"{sweeps.name(row)}: {spec['model']} {spec.get('prompt_tokens')}+{spec.get('output_tokens')}"].append(row)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token", "inter-token latency"))
    for index, (name, group) in enumerate(sorted(groups.items())):
        group.sort(key=lambda row: row.throughput["decode_tokens_per_s"])
        x = [row.throughput["decode_tokens_per_s"] for row in group]
        text = [f"{row.serving['point']}: {row.serving['completed']} of {row.serving['requests']} completed"
                for row in group]
        marks = ["x" if row.serving.get("failed") else "circle" for row in group]
        colour = _COLOURS[index % len(_COLOURS)]
        for column, figure in ((1, "ttft"), (2, "itl")):
            for quantile, dash in (("p50", "solid"), ("p99", "dot")):
                y = [(row.timing.get(figure) or {}).get(quantile) for row in group]
                fig.add_trace(go.Scatter(x=x, y=[value * MS if value is not None else None for value in y],
                                         mode="lines+markers", name=f"{name} {figure} {quantile}", text=text,
                                         line=dict(color=colour, dash=dash), marker=dict(symbol=marks),
                                         legendgroup=name, showlegend=column == 1 or quantile == "p50"),
                              row=1, col=column)
    fig.update_xaxes(title_text="output tokens/s")
    fig.update_yaxes(title_text="ms", type="log")
    fig.update_layout(height=440, margin=dict(l=60, r=20, t=40, b=50), template="plotly_white",
                      legend=dict(font=dict(size=11)))
    return fig
