"""The checker (``mindspeed-tp check``, ``train-check``, ``rl-check``) and what its processes share."""
from . import deferred_compile, library_warnings

library_warnings.install_from_env()  # first: megatron-core warns while it is imported
deferred_compile.install()
