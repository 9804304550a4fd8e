"""The checker (``mindspeed-tp check``, ``train-check``, ``rl-check``) and what its processes share."""
from . import deferred_compile

deferred_compile.install()
