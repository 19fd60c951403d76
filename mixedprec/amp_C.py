"""Kept for existing imports: Apex's API is in :mod:`mixedprec.compat.amp_C`."""

import sys

from .compat import amp_C as _face

sys.modules[__name__] = _face
