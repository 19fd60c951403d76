"""Kept for existing imports: the module is :mod:`mixedprec.compat.fp16_utils` (Apex's API)."""

import sys

from .compat import fp16_utils as _face

sys.modules[__name__] = _face
