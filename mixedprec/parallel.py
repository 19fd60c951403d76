"""Kept for existing imports: Apex's API is in :mod:`mixedprec.compat.parallel`.
``python -m mixedprec.parallel`` runs its launcher (Apex's ``multiproc``)."""

import sys

from .compat import parallel as _face

if __name__ == "__main__":
    sys.exit(_face.multiproc())
else:
    sys.modules[__name__] = _face
