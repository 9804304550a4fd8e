"""The checker's report files besides JSON: Markdown (--report-md) and the plot (--plot)."""
from typing import Dict, List

from .metrics import logdiff_per_position
from .report import format_markdown, write_text_atomic


def write_reports(ns, results: List[Dict], runs: List, batch, verdict: str, header: Dict) -> None:
    """runs: (result, logprobs, reference logprobs) per checked layout and mode (rank 0 only)."""
    if ns.report_md:
        write_text_atomic(ns.report_md, format_markdown(results, header, verdict))
    if ns.plot:
        from .plot import write_plot

        curves = []
        for r, lp, ref in runs:
            per_layer = {}
            for m in (r.get("bisect") or {}).get("modules", []):
                if m["layer"] is not None and m["module"] == f"decoder.layers.{m['layer']}":
                    per_layer[m["layer"]] = m["max_abs_diff"]
            curves.append({"label": f"{r['layout']['name']} ({'vanilla' if r['vanilla'] else 'mindspeed-tp'})",
                           "per_position": logdiff_per_position(lp, ref, batch.scored).tolist(),
                           "per_layer": per_layer})
        write_plot(ns.plot, curves)
