"""Kept for existing imports: the module is :mod:`mixedprec.compat.amp_C` (Apex's API)."""

import sys

from .compat import amp_C as _face

sys.modules[__name__] = _face
