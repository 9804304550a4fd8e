"""Terminal table and JSON report (written atomically)."""
import json
import math
import os
import tempfile
from contextlib import contextmanager
from typing import Dict, List


def fmt_diff(x: float) -> str:
    """A |difference| for a table: 0 exactly, else 3 significant digits (nan as such)."""
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return "0" if x == 0 else f"{x:.2e}"


def _fmt_fraction(x: float) -> str:
    return f"{'n/a':>10}" if isinstance(x, float) and math.isnan(x) else f"{x * 100:>9.1f}%"


def mode_name(r: Dict) -> str:
    """A row's mode: vanilla, mindspeed-tp, or the profile shown alongside (e.g. canonical)."""
    return r.get("mode") or ("vanilla" if r["vanilla"] else "mindspeed-tp")


def format_table(results: List[Dict]) -> str:
    moe = any("routing_mismatch_fraction" in r for r in results)
    head = f"{'layout':<22}{'mode':<14}{'max|dlogp|':>12}{'mean|dlogp|':>13}{'bitwise':>9}{'max|dp|':>11}{'pearson':>10}{'tokens':>8}" + (f"{'routing!=':>10}" if moe else "")
    lines = [head, "-" * len(head)]
    for r in results:
        mode = mode_name(r)
        if "unsupported" in r:
            lines.append(f"{r['layout']['name']:<22}{mode:<14}n/a: {r['unsupported']}")
            continue
        flag = "" if r["nonfinite_values"] == 0 else (
            f"  ({r['nonfinite_values']} NaN/inf logprobs, first at batch/position {r.get('first_nonfinite')}"
            + (f"; {r['logits_nonfinite']} NaN/inf logits" if r.get("logits_nonfinite") else "") + "!)")
        lines.append(
            f"{r['layout']['name']:<22}{mode:<14}{fmt_diff(r['max_abs_logdiff']):>12}"
            f"{fmt_diff(r['mean_abs_logdiff']):>13}{r['bitwise_equal_fraction'] * 100:>8.1f}%"
            f"{fmt_diff(r['max_abs_probdiff']):>11}{r['pearson']:>10.6f}{r['tokens']:>8}"
            + (_fmt_fraction(r.get("routing_mismatch_fraction", float("nan"))) if moe else "")
            + flag
        )
        if r.get("note"):
            lines.append(f"{'':<22}({r['note']})")
    return "\n".join(lines)


def read_json(path: str) -> Dict:
    with open(path) as f:
        return json.load(f)


@contextmanager
def atomic_path(path: str):
    """A temporary file beside ``path`` (its directory made) to write, moved over ``path`` once
    written: a reader never sees a partial file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json_atomic(path: str, data: Dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text_atomic(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def save_figure(fig, path: str) -> None:
    """A matplotlib figure as PNG, written atomically, then closed."""
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def format_markdown(results: List[Dict], header: Dict, verdict: str) -> str:
    """The same table as the terminal's, a bisect section per checked run, and the run's settings."""
    lines = ["# mindspeed-tp consistency check", ""]
    lines += [f"- **{k}**: `{v}`" for k, v in header.items()]
    lines += ["", f"**Result:** {verdict}", "", "| layout | mode | max\\|dlogp\\| | mean\\|dlogp\\| | bitwise | "
              "max\\|dp\\| | pearson | tokens | NaN/inf |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        mode = mode_name(r)
        if "unsupported" in r:
            lines.append(f"| {r['layout']['name']} | {mode} | n/a: {r['unsupported']} ||||||| |")
            continue
        lines.append(f"| {r['layout']['name']} | {mode} | {fmt_diff(r['max_abs_logdiff'])} | {fmt_diff(r['mean_abs_logdiff'])} | "
                     f"{r['bitwise_equal_fraction'] * 100:.1f}% | {fmt_diff(r['max_abs_probdiff'])} | {r['pearson']:.6f} | "
                     f"{r['tokens']} | {r['nonfinite_values']} |")
    for r in results:
        bis = r.get("bisect")
        if not bis:
            continue
        mode = mode_name(r)
        lines += ["", f"## Bisect: {r['layout']['name']} ({mode})", ""]
        first = bis["first_divergence"]
        if first is None:
            lines.append(f"Every recorded module output is bitwise equal ({len(bis['modules'])} modules).")
            continue
        lines += [f"First divergence: `{first['module']}` — **{first['classification']}** ({first['reason']}); "
                  f"{first['tokens_differing']}/{first['tokens']} tokens differ (first at batch/position "
                  f"{first['first_token']}), max\\|diff\\| {first['max_abs_diff']:.3g}.",
                  f"Layers affected: {bis['layers_affected']}.", "",
                  "| module | tokens differing | max\\|diff\\| | inputs equal | digest | reference digest |",
                  "|---|---:|---:|---|---|---|"]
        for m in bis["modules"]:
            lines.append(f"| `{m['module']}` | {m['tokens_differing']} | {m['max_abs_diff']:.3g} | "
                         f"{'-' if m['inputs_equal'] is None else m['inputs_equal']} | {m['digest']} | "
                         f"{m['reference_digest']} |")
    return "\n".join(lines) + "\n"
