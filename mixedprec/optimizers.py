"""Kept for existing imports: the module is :mod:`mixedprec.compat.optimizers` (Apex's API)."""

import sys

from .compat import optimizers as _face

sys.modules[__name__] = _face
