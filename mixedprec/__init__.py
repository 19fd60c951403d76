"""mixedprec: mixed-precision training for PyTorch.

Fused C++/CUDA operators (``torch.ops.mixedprec``, typed wrappers in
:mod:`mixedprec.ops`) for master weights, sync-free loss scaling and fp32-accumulated
reductions; fused optimizers with fp32 master weights (:class:`FusedSGD`,
:class:`FusedAdam`) and a :class:`GradScaler` without host synchronisation.

Apex's API lives in :mod:`mixedprec.amp`, :mod:`mixedprec.fp16_utils`,
:mod:`mixedprec.parallel`, :mod:`mixedprec.amp_C` and
:mod:`mixedprec.multi_tensor_apply` (loaded on first use). ``import mixedprec.apex``
makes ``import apex`` resolve to them; ``python -m mixedprec.apex script.py`` runs a
legacy script that way.
"""

import importlib

import torch  # noqa: F401  (loads libtorch before the extension)

from . import ops
from .optimizers import FusedAdam, FusedSGD
from .scaler import GradScaler

__version__ = "0.1.0"
__all__ = ["ops", "FusedAdam", "FusedSGD", "GradScaler", "__version__"]

_SUBMODULES = ("amp", "fp16_utils", "parallel", "amp_C", "multi_tensor_apply")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
