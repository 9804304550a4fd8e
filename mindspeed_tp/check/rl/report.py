"""The RL check's table, JSON and plot.

JSON: ``arms[]`` (``mode``: mindspeed-tp | vanilla; ``iterations[]``: ``iteration``, ``reward_mean``,
``loss`` (verl's global token-mean policy loss of the step), ``max_abs_logdiff``, ``mismatch_kl``
(k3), ``max_abs_ratio_minus_1``, ``bitwise_fraction`` -- the forward-only pass against the
rollout's logprobs over every response token -- and ``step_bitwise_fraction`` (the training step's
own forward against them), ``response_lengths``, ``prompt_lengths``, ``rewards``, ``tokens_digest``
(of the sampled batch)), ``all_bitwise_equal`` (mindspeed-tp's arm, every iteration), ``engine``,
``layout`` (``A->B@N`` when resharded) and ``settings``.
"""
from __future__ import annotations

from typing import Dict, List

from ..report import save_figure, write_json_atomic

COLUMNS = (("iteration", "iter", "{:>5}"), ("reward_mean", "reward", "{:>9.4f}"), ("loss", "loss", "{:>11.4g}"),
           ("max_abs_logdiff", "max|dlogp|", "{:>12.3g}"), ("mismatch_kl", "k3 KL", "{:>11.3g}"),
           ("max_abs_ratio_minus_1", "max|r-1|", "{:>11.3g}"), ("bitwise_fraction", "bitwise", "{:>9.4f}"),
           ("step_bitwise_fraction", "step bitw", "{:>10.4f}"))


def write_part(path: str, part: Dict) -> None:
    write_json_atomic(path, part)


def merge(parts: List[Dict]) -> Dict:
    """Worlds of a resharded run (in iteration order) -> one report body."""
    arms: Dict[str, List] = {}
    for part in parts:
        for arm in part["arms"]:
            arms.setdefault(arm["mode"], []).extend(arm["iterations"])
    layouts = [p["layout"] for p in parts]
    return {"arms": [{"mode": m, "iterations": rows} for m, rows in arms.items()],
            "engine": parts[-1]["engine"], "layouts": layouts}


def row_ok(r: Dict) -> bool:
    """One iteration keeps the contract: tokens were scored, and both the forward-only pass and the
    training step's own forward (the logprobs its GRPO loss uses) have the rollout's bits."""
    return (r["tokens"] > 0 and r["max_abs_logdiff"] == 0.0 and r["bitwise_fraction"] == 1.0
            and r["step_max_abs_logdiff"] == 0.0 and r["step_bitwise_fraction"] == 1.0)


def ours_ok(arms: List[Dict]) -> bool:
    rows = [r for a in arms if a["mode"] == "mindspeed-tp" for r in a["iterations"]]
    return bool(rows) and all(row_ok(r) for r in rows)


def format_table(arms: List[Dict]) -> str:
    head = (f"{'mode':<14}{'iter':>5}{'reward':>9}{'loss':>11}{'max|dlogp|':>12}{'k3 KL':>11}{'max|r-1|':>11}"
            f"{'bitwise':>9}{'step bitw':>10}")
    lines = [head, "-" * len(head)]
    for arm in arms:
        for r in arm["iterations"]:
            lines.append(f"{arm['mode']:<14}" + "".join(fmt.format(r[key]) for key, _, fmt in COLUMNS))
    return "\n".join(lines)


def write_plot(path: str, arms: List[Dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mis, ax_rew) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for arm in arms:
        xs = [r["iteration"] for r in arm["iterations"]]
        ax_mis.plot(xs, [r["max_abs_logdiff"] for r in arm["iterations"]], marker="o", label=f"{arm['mode']} max|dlogp|")
        ax_mis.plot(xs, [r["max_abs_ratio_minus_1"] for r in arm["iterations"]], marker="x", linestyle="--",
                    label=f"{arm['mode']} max|r-1|")
        ax_rew.plot(xs, [r["reward_mean"] for r in arm["iterations"]], marker="o", label=arm["mode"])
    ax_mis.set_ylabel("train vs rollout (response tokens)")
    ax_mis.set_title("train-vs-rollout mismatch per iteration")
    ax_mis.legend()
    ax_rew.set_ylabel("reward mean")
    ax_rew.set_xlabel("iteration")
    ax_rew.legend()
    fig.tight_layout()
    save_figure(fig, path)


def finish(parts: List[Dict], pl, ns) -> int:
    body = merge(parts)
    ok = ours_ok(body["arms"])
    layout = body["layouts"][0] if len(body["layouts"]) == 1 else \
        f"{body['layouts'][0]}->{body['layouts'][1]}@{ns.reshard_at}"
    engine = body["engine"] or {}
    print(f"mindspeed-tp rl-check: model={pl.spec.name} dtype={ns.dtype} profile={pl.profile.name} "
          f"engine={engine.get('name')} (tp={engine.get('tp')}) layout={layout} prompts={pl.settings.prompts}x"
          f"{pl.settings.group_size} reward={ns.reward}")
    print(f"compared: {pl.settings.sampling.describe()}")
    print(format_table(body["arms"]))
    for arm in body["arms"]:
        rows = arm["iterations"]
        print(f"{arm['mode']}: reward {rows[0]['reward_mean']:.4f} at iteration {rows[0]['iteration']} -> "
              f"{rows[-1]['reward_mean']:.4f} at iteration {rows[-1]['iteration']}")
    verdict = "every iteration bitwise equal" if ok else "NOT bitwise equal"
    for arm in body["arms"]:
        for r in arm["iterations"]:
            if arm["mode"] == "mindspeed-tp" and not r["tokens"]:
                print(f"iteration {r['iteration']}: no response token was scored: nothing was compared")
    # The ratio the GRPO loss computes is of the training step's logprobs: exactly 1 only when those
    # (not only the forward-only pass) have the rollout's bits.
    print(f"RESULT: training logprobs (forward-only pass and the training step's) vs the rollout engine's: "
          f"{verdict} (importance ratio {'exactly 1' if ok else 'not 1'})")
    if ns.json:
        write_json_atomic(ns.json, {"arms": body["arms"], "all_bitwise_equal": ok, "engine": body["engine"],
                                    "layout": layout, "model": pl.spec.name, "profile": pl.profile.name,
                                    "dtype": ns.dtype, "device": ns.device, "reward": ns.reward,
                                    "settings": pl.settings.to_dict(), "sampling": pl.settings.sampling.to_dict()})
    if ns.plot:
        write_plot(ns.plot, body["arms"])
    return 0 if ok else 1
