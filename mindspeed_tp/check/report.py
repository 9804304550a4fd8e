"""Terminal table and JSON report (written atomically)."""
import json
import math
import os
import tempfile
from typing import Dict, List


def _fmt(x: float) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return "0" if x == 0 else f"{x:.2e}"


def _fmt_fraction(x: float) -> str:
    return f"{'n/a':>10}" if isinstance(x, float) and math.isnan(x) else f"{x * 100:>9.1f}%"


def format_table(results: List[Dict]) -> str:
    moe = any("routing_mismatch_fraction" in r for r in results)
    head = f"{'layout':<22}{'mode':<14}{'max|dlogp|':>12}{'mean|dlogp|':>13}{'bitwise':>9}{'max|dp|':>11}{'pearson':>10}{'tokens':>8}" + (f"{'routing!=':>10}" if moe else "")
    lines = [head, "-" * len(head)]
    for r in results:
        mode = "vanilla" if r["vanilla"] else "mindspeed-tp"
        if "unsupported" in r:
            lines.append(f"{r['layout']['name']:<22}{mode:<14}n/a: {r['unsupported']}")
            continue
        flag = "" if r["nonfinite_values"] == 0 else f"  ({r['nonfinite_values']} NaN/inf!)"
        lines.append(
            f"{r['layout']['name']:<22}{mode:<14}{_fmt(r['max_abs_logdiff']):>12}"
            f"{_fmt(r['mean_abs_logdiff']):>13}{r['bitwise_equal_fraction'] * 100:>8.1f}%"
            f"{_fmt(r['max_abs_probdiff']):>11}{r['pearson']:>10.6f}{r['tokens']:>8}"
            + (_fmt_fraction(r.get("routing_mismatch_fraction", float("nan"))) if moe else "")
            + flag
        )
    return "\n".join(lines)


def write_json_atomic(path: str, data: Dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
