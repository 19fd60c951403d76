"""Kept for existing imports: the module is :mod:`mixedprec.compat.amp` (Apex's API)."""

import sys

from .compat import amp as _face

sys.modules[__name__] = _face
