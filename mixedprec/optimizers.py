"""Kept for existing imports: Apex's API is in :mod:`mixedprec.compat.optimizers`."""

import sys

from .compat import optimizers as _face

sys.modules[__name__] = _face
