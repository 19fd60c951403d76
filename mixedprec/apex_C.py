"""Kept for existing imports: the module is :mod:`mixedprec.compat.apex_C` (Apex's API)."""

import sys

from .compat import apex_C as _face

sys.modules[__name__] = _face
