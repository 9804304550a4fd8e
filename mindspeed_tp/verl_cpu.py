"""verl on a CPU-only machine: ``VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl_cpu`` (see
``integrations/verl_cpu.py``). It makes verl's own trainer run there and enables no patch: list
``mindspeed_tp.verl`` after it for mindspeed-tp (``VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl_cpu,mindspeed_tp.verl``).
"""
from .integrations.verl_cpu import install

install()
