"""mixedprec: mixed-precision training for PyTorch.

Fused C++/CUDA operators (``torch.ops.mixedprec``, typed wrappers in
:mod:`mixedprec.ops`) for master weights, sync-free loss scaling and fp32-accumulated
reductions; fused optimizers with fp32 master weights (:class:`FusedSGD`,
:class:`FusedAdam`) and a :class:`GradScaler` without host synchronisation.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import ops
from .optimizers import FusedAdam, FusedSGD
from .scaler import GradScaler

__version__ = "0.1.0"
__all__ = ["ops", "FusedAdam", "FusedSGD", "GradScaler", "__version__"]
