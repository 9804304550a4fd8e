"""Every Python process the tests start (conftest._env puts this directory on PYTHONPATH) imports
megatron-core with torch.compile deferred to each fused function's first call, as the checker's own
processes do (mindspeed_tp/check/deferred_compile.py): about 4 s of CPU less per process, nothing
else changed. The module is loaded from its file, so the package itself is not imported here (the
switch tests start from processes where it is not)."""
import importlib.util
import os

_path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "mindspeed_tp", "check", "deferred_compile.py")
_spec = importlib.util.spec_from_file_location("_mindspeed_tp_tests_deferred_compile", _path)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_module.install()
