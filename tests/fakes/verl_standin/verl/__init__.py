"""Stand-in for the verl package's import-time behaviour (verl/__init__.py): every module named in
VERL_USE_EXTERNAL_MODULES (comma-separated) is imported through import_external_libs."""
import os

from .utils.import_utils import import_external_libs

modules = os.getenv("VERL_USE_EXTERNAL_MODULES", "")
if modules:
    import_external_libs(modules.split(","))
