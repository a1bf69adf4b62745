"""An import hook under which ``import fbgemm_gpu`` fails as a release built for another torch does:
found, then an ``OSError`` (an undefined symbol of torch's) while its libraries load."""

import importlib.abc
import importlib.util

MESSAGE = "fbgemm_gpu_tbe_index_select.so: undefined symbol: _ZN5torch8autograd13_wrap_outputs"


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError(MESSAGE)


class BrokenFbgemmFinder(importlib.abc.MetaPathFinder):
    """Put first in ``sys.meta_path`` (with ``fbgemm_gpu`` out of ``sys.modules``)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, _Loader()) if name == "fbgemm_gpu" else None
