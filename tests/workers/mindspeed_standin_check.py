"""Worker (torchrun): what a MindSpeed training script does -- ``import mindspeed.megatron_adaptor``
(the stand-in in tests/fakes/mindspeed_standin, with MindSpeed's flash attention on) -- then
``import mindspeed_tp.megatron_adaptor`` and the checker with the remaining arguments. Every
stand-in replacement raises if it runs, so a bitwise-equal check means mindspeed-tp's patches won
on every shared target."""
import runpy
import sys

checker_args = sys.argv[1:]
sys.argv = [sys.argv[0], "--use-flash-attn"]  # MindSpeed parses its flags from sys.argv at import
import mindspeed.megatron_adaptor  # noqa: E402,F401

import mindspeed_tp.megatron_adaptor  # noqa: E402,F401

sys.argv = ["mindspeed_tp.check", *checker_args]
runpy.run_module("mindspeed_tp.check", run_name="__main__")
