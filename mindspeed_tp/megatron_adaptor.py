"""``import mindspeed_tp.megatron_adaptor`` applies the patches (MindSpeed style).

With MindSpeed, import this after ``mindspeed.megatron_adaptor`` so these patches win. The profile
comes from ``MINDSPEED_TP_PROFILE`` (default: the bundled ``default`` profile).
"""
import os

from . import enable

enable(os.environ.get("MINDSPEED_TP_PROFILE") or None)
