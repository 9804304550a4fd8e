"""The training check's reference file, result rows, table and JSON report.

JSON: ``results[]`` (one per layout and mode: ``layout``, ``vanilla``, ``steps[]`` with ``loss``,
``loss_bitwise_equal``, ``logprobs_bitwise_equal`` (step 1; null after), ``grads_bitwise_equal``,
``params_bitwise_equal``, ``optimizer_state_bitwise_equal`` (each: every element of every parameter's
full logical tensor, the same raw bits as the one-device run), the max |diff| of each and the names of
the parameters that differ, ``grad_norm`` and its |diff|), ``reference`` (the one-device run's loss
and gradient norm per step), ``bitwise_training`` and ``all_bitwise_equal``: the verdict this check
promises, judged on mindspeed-tp's rows (vanilla's only when it runs alone) -- the step-1 loss and
in-step logprobs bitwise equal to one device in every layout; with ``--bitwise-training`` (or the
profile's ``bitwise_training``) also every step's loss, gradients, parameters and optimizer state.

``grads`` are the gradients the optimizer steps on (after the data-parallel reduction, before
clipping), ``params`` and ``optimizer_state`` (Adam's two moments and the fp32 main parameter) are
taken after each step.
"""
from __future__ import annotations

from typing import Dict, List

from ..metrics import same_bits
from .snapshots import OPTIMIZER_STATE_KEYS
from ..reference import load_reference, save_reference
from ..report import fmt_diff, write_json_atomic


def mode_key(vanilla: bool) -> str:
    return "vanilla" if vanilla else "consistent"


def mode_name(vanilla: bool) -> str:
    return "vanilla" if vanilla else "mindspeed-tp"


# Per-step full tensors by parameter name that the one-device run records.
TENSOR_FIELDS = ("params", "grads") + tuple(f"optimizer_state/{k}" for k in OPTIMIZER_STATE_KEYS)
SCALAR_FIELDS = ("loss", "logprobs", "grad_norm", "scored")


def save_reference_run(path: str, reference: Dict[str, Dict], meta: Dict[str, str]) -> None:
    tensors = {}
    for key, run in reference.items():
        for field in SCALAR_FIELDS:
            tensors[f"{key}/{field}"] = run[field]
        for field in TENSOR_FIELDS:
            for step, values in enumerate(run[field]):
                tensors.update({f"{key}/{field}/{step}/{name}": t.contiguous() for name, t in values.items()})
    save_reference(path, tensors, meta)


def load_reference_run(path: str, meta: Dict[str, str], modes: List[bool], steps: int) -> Dict[str, Dict]:
    flat = load_reference(path, meta)  # refuses a file made for other inputs, naming the field
    out = {}
    for vanilla in modes:
        key = mode_key(vanilla)
        run = {field: flat[f"{key}/{field}"] for field in SCALAR_FIELDS}
        for field in TENSOR_FIELDS:
            run[field] = [{} for _ in range(steps)]
            prefix = f"{key}/{field}/"
            for name, t in flat.items():
                if name.startswith(prefix):
                    step, _, param = name[len(prefix):].partition("/")
                    run[field][int(step)][param] = t
        out[key] = run
    return out


def result_row(layout, vanilla: bool, out: Dict, ref: Dict, pl, dtype: str) -> Dict:
    from ...compat import megatron_version

    scored = ref["scored"]
    steps = []
    for k in range(pl.settings.steps):
        loss, ref_loss = out["loss"][k], ref["loss"][k]
        gn, ref_gn = out["grad_norm"][k], ref["grad_norm"][k]
        grad_diff, grads_differ = out["grads_diff"][k]
        param_diff, params_differ = out["params_diff"][k]
        state = [out[f"optimizer_state/{key}_diff"][k] for key in OPTIMIZER_STATE_KEYS]
        state_differ = sorted({f"{key}:{name}" for key, (_, names) in zip(OPTIMIZER_STATE_KEYS, state) for name in names})
        steps.append(dict(
            step=k + 1,
            loss=float(loss),
            loss_bitwise_equal=same_bits(loss.reshape(-1), ref_loss.reshape(-1)),
            logprobs_bitwise_equal=same_bits(out["logprobs"][scored], ref["logprobs"][scored]) if k == 0 else None,
            grads_bitwise_equal=not grads_differ,
            params_bitwise_equal=not params_differ,
            optimizer_state_bitwise_equal=not state_differ,
            grad_norm=float(gn),
            grad_norm_bitwise_equal=same_bits(gn.reshape(-1), ref_gn.reshape(-1)),
            grad_norm_max_abs_diff=float((gn.double() - ref_gn.double()).abs()),
            grad_max_abs_diff=grad_diff,
            param_max_abs_diff=param_diff,
            optimizer_state_max_abs_diff=max(d for d, _ in state),
            grads_differ=grads_differ,
            params_differ=params_differ,
            optimizer_state_differ=state_differ,
        ))
    return dict(layout=layout.to_dict(), vanilla=vanilla, model=pl.spec.name, dtype=dtype,
                megatron_core_version=megatron_version(), profile=pl.profile.name,
                settings=pl.settings.to_dict(), steps=steps)


def reference_summary(reference: Dict[str, Dict]) -> Dict[str, Dict]:
    return {key: {"loss": [float(x) for x in run["loss"]], "grad_norm": [float(x) for x in run["grad_norm"]]}
            for key, run in reference.items()}


def write_part(path: str, rows: List[Dict], reference: Dict[str, Dict]) -> None:
    write_json_atomic(path, {"results": rows, "reference": reference_summary(reference)})


TRAINING_VERDICT_KEYS = ("loss_bitwise_equal", "grads_bitwise_equal", "params_bitwise_equal",
                         "optimizer_state_bitwise_equal")


def verdict(results: List[Dict], bitwise_training: bool = False) -> bool:
    """Step-1 loss and logprobs in every judged row; with bitwise_training also every step's loss,
    gradients, parameters and optimizer state."""
    judged = [r for r in results if not r["vanilla"]] or results
    first = all(r["steps"][0]["loss_bitwise_equal"] and r["steps"][0]["logprobs_bitwise_equal"] for r in judged)
    every = all(s[key] for r in judged for s in r["steps"] for key in TRAINING_VERDICT_KEYS)
    return bool(judged) and first and (every or not bitwise_training)


def _yes(flag) -> str:
    return "-" if flag is None else ("yes" if flag else "NO")


def format_table(results: List[Dict], reference: Dict[str, Dict]) -> str:
    w = max([18] + [len(r["layout"]["name"]) + 2 for r in results])  # the layout column fits its longest name
    head = (f"{'layout':<{w}}{'mode':<14}{'step':>5}{'loss':>12}{'loss=':>7}{'logp=':>7}{'grads=':>8}"
            f"{'params=':>9}{'optim=':>8}{'|dgrad|':>11}{'|dparam|':>11}")
    lines = [head, "-" * len(head)]
    for key, run in reference.items():
        for k, loss in enumerate(run["loss"]):
            lines.append(f"{'tp1 (one device)':<{w}}{mode_name(key == 'vanilla'):<14}{k + 1:>5}{loss:>12.7f}")
    for r in results:
        for s in r["steps"]:
            lines.append(
                f"{r['layout']['name']:<{w}}{mode_name(r['vanilla']):<14}{s['step']:>5}{s['loss']:>12.7f}"
                f"{_yes(s['loss_bitwise_equal']):>7}{_yes(s['logprobs_bitwise_equal']):>7}"
                f"{_yes(s['grads_bitwise_equal']):>8}{_yes(s['params_bitwise_equal']):>9}"
                f"{_yes(s['optimizer_state_bitwise_equal']):>8}{fmt_diff(s['grad_max_abs_diff']):>11}"
                f"{fmt_diff(s['param_max_abs_diff']):>11}")
    return "\n".join(lines)


def finish(parts: List[List[Dict]], reference: Dict[str, Dict], pl, ns, show: bool = True) -> int:
    """Merge the worlds' rows, print the table, write --json; the exit code (0: the verdict holds)."""
    from ...compat import megatron_version

    results = [r for rows in parts for r in rows]
    results.sort(key=lambda r: r["vanilla"], reverse=True)  # vanilla rows first, then ours
    training = bool(pl.profile.bitwise_training)
    ok = verdict(results, training)
    promise = ("every step's loss, gradients, parameters and optimizer state" if training
               else "step-1 loss and in-step logprobs")
    if show:
        print(f"mindspeed-tp train-check: model={pl.spec.name} dtype={ns.dtype} device={ns.device} profile={pl.profile.name} "
              f"megatron-core={megatron_version()} steps={pl.settings.steps} micro-batch={pl.settings.micro_batch_size} "
              f"global-batch={pl.settings.global_batch_size} distributed-optimizer={pl.settings.distributed_optimizer} "
              f"overlap={pl.settings.overlap} recompute={pl.settings.recompute} "
              f"bitwise-training={training}")
        print(format_table(results, reference))
        print("RESULT:", ("" if ok else "NOT ") + f"bitwise equal to the one-device run ({promise})")
        if ns.json:
            write_json_atomic(ns.json, {"results": results, "reference": reference, "bitwise_training": training,
                                        "all_bitwise_equal": ok, "device": ns.device})
    return 0 if ok else 1
