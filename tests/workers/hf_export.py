"""Worker (torchrun): load a Hugging Face checkpoint into a Megatron model in LAYOUT, export it
back to Hugging Face format in OUT_DIR.  Usage: hf_export.py HF_DIR LAYOUT DTYPE OUT_DIR"""
import sys


import mindspeed_tp
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.driver import setup_parallel_state, init_distributed
from mindspeed_tp.hf import export_hf_checkpoint, open_hf_model, read_hf_config
from mindspeed_tp.check.builder import DTYPES, build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.weights import load_weights
from mindspeed_tp.contract.profile import load_profile
from worker_exit import finish_worker

hf_dir, layout_name, dtype_name, out_dir = sys.argv[1:5]
init_distributed()
install_cpu_shims()
profile, layout = load_profile(), Layout.parse(layout_name)
mindspeed_tp.enable(profile)
spec, weights = open_hf_model(hf_dir, profile)
setup_parallel_state(layout, 0)
model = build_gpt_stage(spec, layout, DTYPES[dtype_name], profile)
load_weights(model, spec, layout, weights)
export_hf_checkpoint(model, spec, layout, spec.padded_vocab(profile), out_dir, hf_config=read_hf_config(hf_dir),
                     copy_from=hf_dir, max_shard_bytes=int(sys.argv[5]) if len(sys.argv) > 5 else 5 * 1024 ** 3)
finish_worker()
