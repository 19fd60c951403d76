"""Kept for existing imports: the module is :mod:`mixedprec.compat.multi_tensor_apply` (Apex's API)."""

import sys

from .compat import multi_tensor_apply as _face

sys.modules[__name__] = _face
