"""Kept for existing imports: Apex's API is in :mod:`mixedprec.compat.amp`."""

import sys

from .compat import amp as _face

sys.modules[__name__] = _face
