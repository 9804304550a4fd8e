"""Worker (torchrun): what a MindSpeed training script does -- ``import mindspeed.megatron_adaptor``
with MindSpeed's flash attention on -- then ``import mindspeed_tp.megatron_adaptor`` and the
checker with the remaining arguments. Runs with the real MindSpeed (on an Ascend machine) or with
tests/fakes/mindspeed_standin on PYTHONPATH, whose replacements raise if they run, so a
bitwise-equal check there means mindspeed-tp's patches won on every shared target."""
import runpy
import sys

checker_args = sys.argv[1:]
sys.argv = [sys.argv[0], "--use-flash-attn"]  # MindSpeed parses its flags from sys.argv at import
import mindspeed.megatron_adaptor  # noqa: E402,F401

import mindspeed_tp.megatron_adaptor  # noqa: E402,F401

sys.argv = ["mindspeed_tp.check", *checker_args]
runpy.run_module("mindspeed_tp.check", run_name="__main__")
