"""A stand-in ``torchaudio`` for the current-ComfyUI test host (scripts/current_host.sh copies it into that
venv as ``torchaudio/__init__.py``). Current ComfyUI imports torchaudio in core, and no torchaudio wheel matches
torch 2.14.1. Any ``torchaudio.*`` module imports; any attribute is a placeholder that raises when used, so
only audio features fail. The same stub as ``../shared/tools/torchaudio_stub.py``, kept here so a machine
without ``../shared`` builds the host the same way.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0-stub"


class _Missing:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchaudio stub: {self._name} unavailable")

    def __getattr__(self, item):
        return _Missing(f"{self._name}.{item}")

    def __mro_entries__(self, bases):
        return (object,)


def _getattr(module_name):
    def get(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{module_name}.{name}")

    return get


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchaudio."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _getattr("torchaudio")
