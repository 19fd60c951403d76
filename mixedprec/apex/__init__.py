"""An alias that makes legacy Apex imports resolve to mixedprec.

NVIDIA Apex deleted ``apex.amp``, ``apex.fp16_utils`` and ``apex.parallel`` in May
2025. Two ways to run a script written against them, unmodified:

* ``python -m mixedprec.apex train.py --its --args`` (or ``python -m mixedprec.apex
  -m some.module --args``; under torchrun: ``torchrun --nproc_per_node=8 -m
  mixedprec.apex train.py --args``). Child processes (``torch.multiprocessing.spawn``,
  ``torch.distributed.launch``, ``subprocess`` of Python) get the alias too.
* In code: ``import mixedprec.apex  # noqa: F401`` before the first ``import apex``.

Importing this package installs an import hook (a :data:`sys.meta_path` finder,
placed first) under which:

===============================  ======================================
``apex``                         a package whose attributes below load lazily
``apex.amp``                     :mod:`mixedprec.amp`
``apex.fp16_utils``              :mod:`mixedprec.fp16_utils`
``apex.optimizers``              :mod:`mixedprec.optimizers`
``apex.parallel``                :mod:`mixedprec.parallel`
``apex.multi_tensor_apply``      :mod:`mixedprec.multi_tensor_apply`
``amp_C``                        :mod:`mixedprec.amp_C`
===============================  ======================================

The aliases are the mixedprec modules themselves (``apex.amp is mixedprec.amp``);
where one is a package, its submodules map alike (``apex.x.y`` is
``mixedprec.x.y``). Modules of Apex's own file layout that scripts import from
(:data:`LEGACY_SUBMODULES`: ``apex.parallel.LARC``, ``apex.parallel.distributed``,
``apex.fp16_utils.fp16_optimizer``, ``apex.optimizers.fused_adam``, ...) resolve to
the mixedprec module that holds their contents, for ``from apex.parallel.LARC import
LARC``; ``import apex.parallel.LARC as m`` is not supported (the attribute
``LARC`` is the class). Other Apex packages (``apex.normalization``,
``apex.contrib``, ``apex.transformer``, ...) are not provided: importing one raises
``ModuleNotFoundError`` saying so.

This is the one place where mixedprec changes how other code is imported. If a
real Apex is installed, the alias still takes precedence (running legacy scripts on
mixedprec is its purpose) and a warning says that it does; :func:`uninstall`
restores normal imports.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from typing import Dict, Optional, Tuple

__all__ = ["ALIASES", "LEGACY_SUBMODULES", "install", "uninstall", "is_installed"]

#: Apex module name -> the mixedprec module it resolves to.
ALIASES: Dict[str, str] = {
    "apex.amp": "mixedprec.amp",
    "apex.fp16_utils": "mixedprec.fp16_utils",
    "apex.optimizers": "mixedprec.optimizers",
    "apex.parallel": "mixedprec.parallel",
    "apex.multi_tensor_apply": "mixedprec.multi_tensor_apply",
    "amp_C": "mixedprec.amp_C",
}

#: Submodules of Apex's file layout that legacy scripts import from, by alias. Each
#: resolves to the mixedprec module of its alias, unless that is a package with a
#: submodule of the same name.
LEGACY_SUBMODULES: Dict[str, Tuple[str, ...]] = {
    "apex.amp": ("_amp_state", "handle", "frontend"),
    "apex.parallel": ("distributed", "LARC", "sync_batchnorm", "optimized_sync_batchnorm"),
    "apex.fp16_utils": ("fp16_optimizer", "fp16util", "loss_scaler"),
    "apex.optimizers": ("fused_adam", "fused_sgd"),
    "apex.multi_tensor_apply": ("multi_tensor_apply",),
}

_APEX = "apex"
_APEX_DOC = (
    "Apex's namespace, provided by mixedprec (see mixedprec.apex): amp, fp16_utils, "
    "optimizers, parallel and multi_tensor_apply are mixedprec's modules."
)


def _target(fullname: str) -> Optional[str]:
    """The mixedprec module behind an aliased name, ``_APEX`` for ``apex`` itself,
    or None when ``fullname`` is not ours."""
    if fullname == _APEX:
        return _APEX
    if fullname in ALIASES:
        return ALIASES[fullname]
    for alias, target in ALIASES.items():
        if fullname.startswith(alias + "."):
            return target + fullname[len(alias):]
    if fullname.startswith(_APEX + "."):
        provided = ", ".join(sorted(ALIASES))
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: mixedprec's Apex alias provides {provided} "
            f"(see mixedprec.apex)",
            name=fullname,
        )
    return None


def _make_apex_package() -> types.ModuleType:
    apex = types.ModuleType(_APEX, _APEX_DOC)
    apex.__path__ = []  # a package, so that `import apex.amp` is looked up

    def __getattr__(name: str):
        if f"{_APEX}.{name}" in ALIASES:
            try:
                return importlib.import_module(f"{_APEX}.{name}")
            except ImportError as err:  # hasattr() must see an AttributeError
                raise AttributeError(str(err)) from err
        raise AttributeError(
            f"module 'apex' (mixedprec's Apex alias) has no attribute {name!r}"
        )

    apex.__getattr__ = __getattr__
    return apex


class _AliasLoader(importlib.abc.Loader):
    """Hands out the mixedprec module itself under the Apex name."""

    def __init__(self):
        self._own_specs: Dict[str, importlib.machinery.ModuleSpec] = {}

    def create_module(self, spec):
        target = _target(spec.name)
        if target == _APEX:
            return _make_apex_package()
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ImportError(
                f"{spec.name} is an alias of {target}, which failed to import: {err}",
                name=spec.name,
            ) from err
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        name = module.__spec__.name
        if name in self._own_specs:
            # The import system stamps the alias's spec on the module; give the
            # mixedprec module its own back (reload, pickling and -m rely on it).
            module.__spec__ = self._own_specs.pop(name)
            _register_legacy_submodules(name, module)


def _register_legacy_submodules(alias: str, module: types.ModuleType) -> None:
    for child in LEGACY_SUBMODULES.get(alias, ()):
        if hasattr(module, "__path__"):
            if importlib.util.find_spec(f"{module.__name__}.{child}") is not None:
                continue  # the package has it: the prefix mapping finds it
        # Found by the import system right after the parent is imported, before it
        # asks whether the parent is a package.
        sys.modules.setdefault(f"{alias}.{child}", module)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the aliased names (and only those) before any other finder does."""

    def __init__(self):
        self.loader = _AliasLoader()

    def find_spec(self, fullname, path=None, target=None):
        if _target(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, self.loader, is_package=fullname == _APEX
        )


_finder: Optional[_AliasFinder] = None


def is_installed() -> bool:
    """Whether the alias is active in this process."""
    return _finder is not None and _finder in sys.meta_path


def _in_shim(path: Optional[str]) -> bool:
    """Whether ``path`` lies in the shim directory of ``python -m mixedprec.apex``."""
    shim = os.environ.get("MIXEDPREC_APEX_SHIM")
    if not (shim and path):
        return False
    path = os.path.abspath(path)
    return path == shim or path.startswith(shim + os.sep)


def _real_apex() -> Optional[str]:
    """Where a real (non-alias) Apex would be imported from, if anywhere."""
    paths = [p for p in sys.path if not _in_shim(p or ".")]
    for name in (_APEX, "amp_C"):
        spec = importlib.machinery.PathFinder.find_spec(name, paths)
        if spec is not None and spec.origin is not None:  # not a bare namespace dir
            return spec.origin
    return None


def _is_alias(module: object) -> bool:
    """Whether ``module`` came from the alias (or from a shim file handing over to it)."""
    name = getattr(module, "__name__", "")
    return (getattr(module, "__doc__", None) == _APEX_DOC or name.startswith("mixedprec.")
            or _in_shim(getattr(module, "__file__", None)))


def install(warn: bool = True) -> None:
    """Installs the alias (done when :mod:`mixedprec.apex` is imported; idempotent).

    With ``warn``, warns when a real Apex is importable (the alias takes precedence)
    and when Apex modules were imported before the alias (they stay as they are)."""
    global _finder
    if is_installed():
        return
    if warn:
        # A child of `python -m mixedprec.apex` leaves that warning to its parent.
        real = None if os.environ.get("MIXEDPREC_APEX_SHIM") else _real_apex()
        if real is not None:
            warnings.warn(
                f"mixedprec.apex: a real Apex is installed ({real}); `import apex` and "
                "`import amp_C` now resolve to mixedprec instead "
                "(mixedprec.apex.uninstall() undoes this)",
                stacklevel=2,
            )
        stale = sorted(
            name for name, module in list(sys.modules.items())
            if (name == _APEX or name.startswith(_APEX + ".") or name == "amp_C")
            and not _is_alias(module)
        )
        if stale:
            warnings.warn(
                f"mixedprec.apex: already imported before the alias, these stay Apex's "
                f"modules: {', '.join(stale)}; import mixedprec.apex before apex",
                stacklevel=2,
            )
    _finder = _AliasFinder()
    sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Removes the alias and forgets the aliased modules (``apex``, ``apex.*``,
    ``amp_C``) imported under it; the mixedprec modules themselves stay loaded."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    for name, module in list(sys.modules.items()):
        if (name == _APEX or name.startswith(_APEX + ".") or name == "amp_C") and _is_alias(module):
            del sys.modules[name]


def _adopt(name: str) -> None:
    """Called by the shim files of ``python -m mixedprec.apex`` in child processes,
    while they are being imported as ``name``: installs the alias and puts the
    aliased module in their place in :data:`sys.modules` (the import then returns
    it)."""
    install(warn=False)
    del sys.modules[name]
    importlib.import_module(name)


install()
