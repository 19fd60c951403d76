"""mixedprec: mixed-precision training for PyTorch.

Fused C++/CUDA operators (``torch.ops.mixedprec``, typed wrappers in
:mod:`mixedprec.ops`) for master weights, sync-free loss scaling and fp32-accumulated
reductions.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import ops

__version__ = "0.1.0"
__all__ = ["ops", "__version__"]
