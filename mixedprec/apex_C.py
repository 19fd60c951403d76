"""Kept for existing imports: Apex's API is in :mod:`mixedprec.compat.apex_C`."""

import sys

from .compat import apex_C as _face

sys.modules[__name__] = _face
