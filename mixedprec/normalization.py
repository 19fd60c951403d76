"""Kept for existing imports: the module is :mod:`mixedprec.compat.normalization` (Apex's API)."""

import sys

from .compat import normalization as _face

sys.modules[__name__] = _face
