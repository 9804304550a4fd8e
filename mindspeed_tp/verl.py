"""verl entry point: ``VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl`` (see ``integrations/verl.py``).

verl imports this module when it imports ``verl``, in the driver and every worker; it enables the
patches (profile from ``MINDSPEED_TP_PROFILE``). The verl-side patches are integration registry
entries, applied as verl's modules are imported.
"""
import os

from .switch import enable

enable(os.environ.get("MINDSPEED_TP_PROFILE") or None)
