"""Kept for existing imports: Apex's API is in :mod:`mixedprec.compat.fp16_utils`."""

import sys

from .compat import fp16_utils as _face

sys.modules[__name__] = _face
