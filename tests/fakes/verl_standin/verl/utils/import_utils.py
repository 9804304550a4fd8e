import importlib


def import_external_libs(external_libs=None):
    if external_libs is None:
        return
    if not isinstance(external_libs, list):
        external_libs = [external_libs]
    for external_lib in external_libs:
        importlib.import_module(external_lib)
