"""mixedprec: mixed-precision training for PyTorch.

The optimizers are :mod:`mixedprec.optim`'s (``Adam``, ``AdamW``, ``SGD``, ``Adagrad``
under torch.optim's names and signatures, and ``LAMB`` and ``NovoGrad``), with fp32
master weights for fp16/bf16 models or the lean modes as keyword-only extras, beside a
:class:`GradScaler` (torch.amp.GradScaler's API) without host synchronisation. Under
them, fused C++/CUDA operators (``torch.ops.mixedprec``, typed wrappers in
:mod:`mixedprec.ops`).

Apex's API is a face over them: :class:`FusedSGD`, :class:`FusedAdam`,
:class:`FusedLAMB`, :class:`FusedAdagrad`, :class:`FusedNovoGrad` here, and the rest in
:mod:`mixedprec.amp`, :mod:`mixedprec.fp16_utils`, :mod:`mixedprec.parallel`,
:mod:`mixedprec.amp_C`, :mod:`mixedprec.multi_tensor_apply`,
:mod:`mixedprec.normalization` and :mod:`mixedprec.apex_C` (loaded on first use).
``import mixedprec.apex`` makes ``import apex`` resolve to them; ``python -m
mixedprec.apex script.py`` runs a legacy script that way. :mod:`mixedprec.distributed`
lets the ops take DTensors (FSDP2, tensor parallelism).
"""

import importlib
import re

import torch  # noqa: F401  (loads libtorch before the extension)


def _check_build(built: str, running: str) -> None:
    """The extension links against torch's C++ library, whose ABI changes from one
    minor release to the next: a build for another one fails to load, or crashes."""
    def minor(version: str) -> str:
        return ".".join(re.findall(r"\d+", version)[:2])

    if minor(built) != minor(running):
        raise ImportError(
            f"mixedprec was built against torch {built}, but this is torch {running}: "
            "rebuild it here with `pip install --no-build-isolation .` (or `make build`)")


try:
    from ._build_info import TORCH_VERSION as _BUILT_FOR
except ImportError:  # a build from before the file existed: nothing to compare
    _BUILT_FOR = None
if _BUILT_FOR is not None:
    _check_build(_BUILT_FOR, torch.__version__)

from . import ops, optim  # noqa: E402
from .distributed import register_ops_on_import as _register_dtensor_ops  # noqa: E402
from .optim import SGD, Adam, AdamW  # noqa: E402
from .scaler import GradScaler  # noqa: E402

_register_dtensor_ops()  # the ops take DTensor arguments (see mixedprec.distributed)

__version__ = "0.1.0"
__all__ = ["ops", "optim", "Adam", "AdamW", "SGD", "FusedAdam", "FusedSGD", "FusedLAMB",
           "FusedMixedPrecisionLamb", "FusedAdagrad", "FusedNovoGrad", "GradScaler", "__version__"]

# Apex's faces (mixedprec.compat), loaded on first use: the core never imports them.
_FACES = ("amp", "fp16_utils", "parallel", "amp_C", "multi_tensor_apply", "normalization",
          "apex_C", "optimizers")
_APEX_OPTIMIZERS = ("FusedAdam", "FusedSGD", "FusedLAMB", "FusedMixedPrecisionLamb",
                    "FusedAdagrad", "FusedNovoGrad")


def __getattr__(name: str):
    if name in _FACES:
        return importlib.import_module(f"{__name__}.compat.{name}")
    if name in _APEX_OPTIMIZERS:
        return getattr(importlib.import_module(f"{__name__}.compat.optimizers"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
