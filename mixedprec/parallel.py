"""Kept for existing imports: the module is :mod:`mixedprec.compat.parallel` (Apex's API).
``python -m mixedprec.parallel`` runs its launcher (Apex's ``multiproc``)."""

import sys

from .compat import parallel as _face

if __name__ == "__main__":
    sys.exit(_face.multiproc())
else:
    sys.modules[__name__] = _face
