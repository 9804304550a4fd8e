"""``--plot FILE.png``: |dlogp| per token position and the largest |diff| of each transformer layer's
output, one line per checked run (matplotlib: the optional ``plot`` extra)."""
import math
from typing import Dict, List

from ..errors import ConfigError
from .report import save_figure

INSTALL_HINT = "pip install mindspeed-tp[plot]"


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from exc


def write_plot(path: str, curves: List[Dict]) -> None:
    """curves: [{label, per_position: [float], per_layer: {layer: float}}]; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_pos, ax_layer) = plt.subplots(2, 1, figsize=(10, 7))
    for c in curves:
        xs = [i for i, v in enumerate(c["per_position"]) if not math.isnan(v)]
        ax_pos.plot(xs, [c["per_position"][i] for i in xs], label=c["label"], linewidth=1)
        if c.get("per_layer"):
            layers = sorted(c["per_layer"])
            ax_layer.plot(layers, [c["per_layer"][l] for l in layers], marker="o", label=c["label"])
    for ax, xlabel, ylabel in ((ax_pos, "token position", "max |dlogp| over the batch"),
                               (ax_layer, "transformer layer", "max |diff| of the layer output")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_yscale("symlog", linthresh=1e-9)  # 0 (bitwise equal) stays on the axis
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    from matplotlib.ticker import MaxNLocator

    ax_layer.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not any(c.get("per_layer") for c in curves):
        ax_layer.text(0.5, 0.5, "no per-layer data", ha="center", va="center", transform=ax_layer.transAxes)
    fig.suptitle("mindspeed-tp check: distance to the reference (0 = bitwise equal)")
    fig.tight_layout()
    save_figure(fig, path)
