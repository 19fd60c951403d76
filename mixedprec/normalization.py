"""Kept for existing imports: Apex's API is in :mod:`mixedprec.compat.normalization`."""

import sys

from .compat import normalization as _face

sys.modules[__name__] = _face
