"""Kept for existing imports: Apex's API is in :mod:`mixedprec.compat.multi_tensor_apply`."""

import sys

from .compat import multi_tensor_apply as _face

sys.modules[__name__] = _face
