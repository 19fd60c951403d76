"""An alias that makes legacy Apex imports resolve to mixedprec.

NVIDIA Apex deleted ``apex.amp``, ``apex.fp16_utils`` and ``apex.parallel`` in May
2025. Two ways to run a script written against them, unmodified:

* ``python -m mixedprec.apex train.py --its --args`` (or ``python -m mixedprec.apex
  -m some.module --args``; under torchrun: ``torchrun --nproc_per_node=8 -m
  mixedprec.apex train.py --args``). Child processes (``torch.multiprocessing.spawn``,
  ``torch.distributed.launch``, ``subprocess`` of Python) get the alias too.
* In code: ``import mixedprec.apex  # noqa: F401`` before the first ``import apex``.

Importing this package installs an import hook (a :data:`sys.meta_path` finder,
placed first). What it supplies depends on whether a real Apex is installed:

* **No Apex installed**: mixedprec supplies everything listed in :data:`MODULES`:
  ``apex`` and the Apex modules ``apex.amp``, ``apex.fp16_utils``,
  ``apex.optimizers``, ``apex.parallel``, ``apex.multi_tensor_apply``,
  ``apex.normalization``, ``apex.contrib.optimizers`` with every submodule of Apex's
  file layout at its last release with amp (``apex.fp16_utils.fp16_optimizer``,
  ``apex.parallel.LARC``, ``apex.amp.handle``, ...), ``apex.optimizers.fp16_optimizer``
  of Apex's releases before late 2019, and the top-level extension
  modules ``amp_C`` (:mod:`mixedprec.amp_C`), ``apex_C`` (:mod:`mixedprec.apex_C`)
  and ``fused_adam_cuda`` (:mod:`mixedprec.compat.fused_adam_cuda`, the FusedAdam
  kernel of Apex's releases before late 2019; an installed one, built by Apex's
  ``--deprecated_fused_adam`` or by another project, is used instead, Apex or not).
  Other Apex packages (``apex.transformer``,
  ``apex.mlp``, ...) raise ``ModuleNotFoundError`` saying so.
* **A real Apex installed** (one that ``import apex`` finds on :data:`sys.path`):
  the alias supplies only what Apex removed, :data:`REMOVED` (``apex.amp``,
  ``apex.fp16_utils``, ``apex.parallel`` and their submodules,
  ``apex.optimizers.fp16_optimizer``). ``apex`` itself, ``apex.optimizers``,
  ``apex.normalization``, ``apex.contrib``, every other ``apex.*``, ``amp_C`` and
  ``apex_C`` are the real Apex's.

Each Apex module of the table is a module object of its own (``apex.amp`` is not
:mod:`mixedprec.amp`) whose names are looked up in the mixedprec module that holds
them: the public names the Apex file defined that mixedprec provides (under the same
name, or another one: ``apex.optimizers.fp16_optimizer.FP16_Optimizer`` is
:class:`mixedprec.fp16_utils.LegacyFP16_Optimizer`). So
``import apex.fp16_utils.fp16_optimizer as m; m.FP16_Optimizer``, ``from apex.amp
import handle``, ``from apex.parallel.LARC import LARC`` all work, and a name resolves
to mixedprec's object itself (``apex.parallel.LARC.LARC is mixedprec.parallel.LARC``).
As in Apex, a package's attribute of a submodule's name is the submodule unless the
package's ``__init__`` defined that name (``apex.parallel.LARC`` is the module,
``apex.amp._amp_state`` is the state object). ``amp_C`` and ``apex_C`` are
mixedprec's modules themselves.

``python -m mixedprec.apex -m apex.parallel.multiproc script.py ...`` runs Apex's
one-process-per-GPU launcher (:func:`mixedprec.parallel.multiproc`).

This is the one place where mixedprec changes how other code is imported;
:func:`uninstall` restores normal imports.
"""

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import warnings
from typing import Dict, NamedTuple, Optional, Tuple

__all__ = ["MODULES", "REMOVED", "UNLESS_INSTALLED", "Entry", "install", "uninstall",
           "is_installed"]


class Entry(NamedTuple):
    """What an Apex module is made of."""

    #: The mixedprec module that holds its names.
    target: str
    #: The names it exposes: public names the Apex file defined that mixedprec provides
    #: (for a package, those its ``__init__`` imported).
    names: Tuple[str, ...] = ()
    #: Also every other public name of ``target`` (a package aliasing a whole module).
    whole: bool = False
    #: ``python -m`` runs ``target.<run>()``.
    run: Optional[str] = None
    #: Names of ``names`` that ``target`` holds under another name: (Apex's name,
    #: ``target``'s name) pairs.
    renamed: Tuple[Tuple[str, str], ...] = ()

    def source(self, name: str) -> str:
        """The name in ``target`` of the Apex name ``name``."""
        return dict(self.renamed).get(name, name)


_FACES = "mixedprec.compat."  # the package of Apex's faces
_AMP, _FP16, _OPT = _FACES + "amp", _FACES + "fp16_utils", _FACES + "optimizers"
_PAR, _MTA, _NORM = _FACES + "parallel", _FACES + "multi_tensor_apply", _FACES + "normalization"
_AMP_NAMES = ("init", "half_function", "float_function", "promote_function",
              "register_half_function", "register_float_function", "register_promote_function")
_FP16UTIL = ("BN_convert_float", "network_to_half", "prep_param_lists",
             "model_grads_to_master_grads", "master_params_to_model_params", "tofp16",
             "to_python_float", "clip_grad_norm", "convert_module", "convert_network",
             "FP16Model")
_SYNCBN = ("SyncBatchNorm",)
_DISTRIBUTED = ("flatten", "unflatten", "apply_flat_dist_call", "split_half_float_double",
                "split_by_type", "flat_dist_call", "extract_tensors", "Reducer",
                "DistributedDataParallel")
_NORM_FILE = ("fused_layer_norm_affine", "fused_layer_norm", "mixed_dtype_fused_layer_norm_affine",
              "fused_rms_norm_affine", "fused_rms_norm", "mixed_dtype_fused_rms_norm_affine",
              "manual_rms_norm", "FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm",
              "MixedFusedRMSNorm")

def _lists(prefix: str, *more: str) -> Entry:
    """An ``apex.amp.lists`` module: Apex's names of the lists in compat.amp_lists."""
    names = ("MODULE", "FP16_FUNCS", "FP32_FUNCS") + more
    return Entry(_FACES + "amp_lists", names, renamed=tuple((n, f"{prefix}_{n}") for n in names))


#: Apex module -> what it is made of, for every module of Apex's file layout (at its
#: last release with amp) under the packages mixedprec provides.
MODULES: Dict[str, Entry] = {
    "apex": Entry("mixedprec"),
    # apex.amp
    "apex.amp": Entry(_AMP, _AMP_NAMES + (
        "scale_loss", "disable_casts", "initialize", "state_dict", "load_state_dict",
        "master_params", "_amp_state"), whole=True),
    "apex.amp.__version__": Entry(_AMP),
    "apex.amp._amp_state": Entry(_AMP, ("master_params", "_amp_state")),
    "apex.amp._initialize": Entry(_AMP),
    "apex.amp._process_optimizer": Entry(_AMP),
    "apex.amp.amp": Entry(_AMP, _AMP_NAMES + ("AmpHandle", "NoOpHandle")),
    "apex.amp.compat": Entry(_AMP),
    "apex.amp.frontend": Entry(_AMP, ("Properties", "initialize", "state_dict",
                                      "load_state_dict")),
    "apex.amp.handle": Entry(_AMP, ("scale_loss", "disable_casts", "AmpHandle",
                                    "NoOpHandle")),
    "apex.amp.lists": Entry(_AMP),
    "apex.amp.lists.functional_overrides": _lists("FUNCTIONAL", "BANNED_FUNCS"),
    "apex.amp.lists.tensor_overrides": _lists("TENSOR", "CASTS", "SEQUENCE_CASTS"),
    "apex.amp.lists.torch_overrides": _lists("TORCH", "CASTS", "SEQUENCE_CASTS"),
    "apex.amp.opt": Entry(_AMP),
    "apex.amp.rnn_compat": Entry(_AMP),
    "apex.amp.scaler": Entry(_AMP, ("LossScaler",)),
    "apex.amp.utils": Entry(_AMP),
    "apex.amp.wrap": Entry(_AMP, ("disable_casts",)),
    # apex.fp16_utils
    "apex.fp16_utils": Entry(_FP16, _FP16UTIL + (
        "FP16_Optimizer", "LossScaler", "DynamicLossScaler"), whole=True),
    "apex.fp16_utils.fp16_optimizer": Entry(_FP16, ("FP16_Optimizer",)),
    "apex.fp16_utils.fp16util": Entry(_FP16, _FP16UTIL),
    "apex.fp16_utils.loss_scaler": Entry(_FP16, ("to_python_float", "LossScaler",
                                                 "DynamicLossScaler")),
    # apex.optimizers
    "apex.optimizers": Entry(_OPT, (
        "FusedSGD", "FusedAdam", "FusedNovoGrad", "FusedLAMB", "FusedAdagrad",
        "FusedMixedPrecisionLamb"), whole=True),
    "apex.optimizers.fused_adagrad": Entry(_OPT, ("FusedAdagrad",)),
    "apex.optimizers.fused_adam": Entry(_OPT, ("FusedAdam",)),
    "apex.optimizers.fused_lamb": Entry(_OPT, ("FusedLAMB",)),
    "apex.optimizers.fused_mixed_precision_lamb": Entry(_OPT, ("FusedMixedPrecisionLamb",)),
    "apex.optimizers.fused_novograd": Entry(_OPT, ("FusedNovoGrad",)),
    "apex.optimizers.fused_sgd": Entry(_OPT, ("FusedSGD",)),
    # Apex's releases before late 2019 (pytorch-pretrained-BERT's examples): the 2019
    # FP16_Optimizer, later apex.contrib.optimizers.fp16_optimizer.
    "apex.optimizers.fp16_optimizer": Entry(_FP16, ("FP16_Optimizer",), renamed=(
        ("FP16_Optimizer", "LegacyFP16_Optimizer"),)),
    # apex.parallel
    "apex.parallel": Entry(_PAR, (
        "ReduceOp", "DistributedDataParallel", "Reducer", "SyncBatchNorm",
        "convert_syncbn_model", "create_syncbn_process_group"), whole=True),
    "apex.parallel.LARC": Entry(_PAR, ("LARC",)),
    "apex.parallel.distributed": Entry(_PAR, _DISTRIBUTED),
    "apex.parallel.multiproc": Entry(_PAR, run="multiproc"),
    "apex.parallel.optimized_sync_batchnorm": Entry(_PAR, _SYNCBN),
    "apex.parallel.optimized_sync_batchnorm_kernel": Entry(_PAR),
    "apex.parallel.sync_batchnorm": Entry(_PAR, _SYNCBN),
    "apex.parallel.sync_batchnorm_kernel": Entry(_PAR),
    # apex.multi_tensor_apply
    "apex.multi_tensor_apply": Entry(_MTA, ("MultiTensorApply", "multi_tensor_applier"),
                                     whole=True),
    "apex.multi_tensor_apply.multi_tensor_apply": Entry(_MTA, ("MultiTensorApply",)),
    # apex.normalization
    "apex.normalization": Entry(_NORM, (
        "FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm"),
        whole=True),
    "apex.normalization.fused_layer_norm": Entry(_NORM, _NORM_FILE),
    # apex.contrib.optimizers (FP16_Optimizer, FusedAdam, FusedLAMB, FusedSGD)
    "apex.contrib": Entry(_OPT),
    "apex.contrib.optimizers": Entry(_OPT, ("FP16_Optimizer", "FusedAdam", "FusedLAMB")),
    "apex.contrib.optimizers.distributed_fused_adam": Entry(_OPT),
    "apex.contrib.optimizers.distributed_fused_lamb": Entry(_OPT),
    "apex.contrib.optimizers.fp16_optimizer": Entry(_OPT, ("FP16_Optimizer",)),
    "apex.contrib.optimizers.fused_adam": Entry(_OPT, ("FusedAdam",)),
    "apex.contrib.optimizers.fused_lamb": Entry(_OPT, ("FusedLAMB",)),
    "apex.contrib.optimizers.fused_sgd": Entry(_OPT, ("FusedSGD",)),
    # Apex's top-level extension modules: mixedprec's modules themselves.
    "amp_C": Entry(_FACES + "amp_C", whole=True),
    "apex_C": Entry(_FACES + "apex_C", whole=True),
    # Apex's FusedAdam before late 2019, kept in their own trees by OpenNMT-py and fairseq
    "fused_adam_cuda": Entry(_FACES + "fused_adam_cuda", whole=True),
}

#: The Apex packages and modules Apex deleted: the alias supplies them (and their
#: submodules) even when a real Apex is installed.
REMOVED = ("apex.amp", "apex.fp16_utils", "apex.parallel", "apex.optimizers.fp16_optimizer")
#: Top-level modules the alias supplies only where none is installed, with or without a
#: real Apex (Apex builds ``fused_adam_cuda`` only with ``--deprecated_fused_adam``).
UNLESS_INSTALLED = ("fused_adam_cuda",)

_APEX = "apex"
_TOP = (_APEX, "amp_C", "apex_C", "fused_adam_cuda")
_MARK = "__mixedprec_alias__"  # set on the module objects the alias makes


def _is_package(name: str) -> bool:
    return any(other.startswith(name + ".") for other in MODULES)


def _children(name: str) -> Tuple[str, ...]:
    depth = name.count(".") + 1
    return tuple(other.rsplit(".", 1)[1] for other in MODULES
                 if other.startswith(name + ".") and other.count(".") == depth)


class _ApexModule(types.ModuleType):
    """An Apex module of the alias: its names are those of :data:`MODULES`. The names an
    Apex file defined (``Entry.names``) are in its ``__dict__`` from the start, as they
    were in Apex's module (scripts test ``'state_dict' in amp.__dict__``); the others
    (``whole`` entries' further names, the ``__all__`` of ``import *``) are looked up in
    the mixedprec module that holds them when asked for."""

    def __getattr__(self, name: str):
        alias = self.__dict__["__name__"]
        entry = MODULES[alias]
        target = sys.modules.get(entry.target) or importlib.import_module(entry.target)
        if name == "__all__":  # for `from apex.x import *`: the public names
            public = [n for n in self._visible(entry, target)
                      if not n.startswith("_") and hasattr(target, entry.source(n))]
            return public + list(_children(alias) if alias == _APEX else ())
        if name.startswith("__"):
            raise AttributeError(name)
        if name in entry.names:
            try:
                return getattr(target, entry.source(name))
            except AttributeError:
                raise AttributeError(
                    f"{alias}.{name}: Apex defined it here, but {entry.target} does not "
                    f"provide it (yet)") from None
        if name in _children(alias):
            return importlib.import_module(f"{alias}.{name}")
        if entry.whole and not name.startswith("_") and hasattr(target, name):
            return getattr(target, name)
        raise AttributeError(f"module {alias!r} (mixedprec's Apex alias, names from "
                             f"{entry.target}) has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        # The import system sets a submodule as its package's attribute; where Apex's
        # package __init__ defined a name of the same name (apex.amp._amp_state), that
        # name won in Apex, and it does here.
        entry = MODULES.get(self.__dict__.get("__name__", ""))
        if (entry is not None and name in entry.names and isinstance(value, types.ModuleType)
                and value.__name__ == f"{self.__name__}.{name}"):
            return
        super().__setattr__(name, value)

    def __dir__(self):
        entry = MODULES[self.__name__]
        names = set(self._visible(entry, importlib.import_module(entry.target)))
        return sorted(names | set(_children(self.__name__)) | set(self.__dict__))

    @staticmethod
    def _visible(entry: Entry, target: types.ModuleType) -> Tuple[str, ...]:
        extra = tuple(getattr(target, "__all__", ())) if entry.whole else ()
        return entry.names + tuple(n for n in extra if n not in entry.names)


def _make_module(name: str) -> types.ModuleType:
    entry = MODULES[name]
    if name == _APEX:
        doc = ("Apex's namespace, provided by mixedprec (see mixedprec.apex): "
               + ", ".join(f"apex.{c}" for c in _children(_APEX)))
    else:
        doc = f"Apex's {name}, provided by mixedprec (see mixedprec.apex): names of {entry.target}."
    module = _ApexModule(name, doc)
    setattr(module, _MARK, True)
    target = importlib.import_module(entry.target)
    for apex_name in entry.names:  # (a name mixedprec lacks stays out: __getattr__ says so)
        if hasattr(target, entry.source(apex_name)):
            vars(module)[apex_name] = getattr(target, entry.source(apex_name))
    return module


class _AliasLoader(importlib.abc.Loader):
    """Makes the Apex modules of :data:`MODULES` (or hands out mixedprec's module itself,
    for ``amp_C`` and ``apex_C``)."""

    def __init__(self):
        self._own_specs: Dict[str, importlib.machinery.ModuleSpec] = {}

    def create_module(self, spec):
        entry = MODULES[spec.name]
        try:
            target = importlib.import_module(entry.target)
        except ImportError as err:
            raise ImportError(f"{spec.name} is provided by {entry.target}, which failed to "
                              f"import: {err}", name=spec.name) from err
        if spec.name in _TOP and spec.name != _APEX:
            self._own_specs[spec.name] = target.__spec__
            return target
        return _make_module(spec.name)

    def exec_module(self, module):
        name = module.__spec__.name
        if name in self._own_specs:
            # The import system stamps the alias's spec on the module; give the
            # mixedprec module its own back (reload, pickling and -m rely on it).
            module.__spec__ = self._own_specs.pop(name)

    def get_code(self, fullname):
        """For ``python -m apex.parallel.multiproc``: code that calls the launcher."""
        entry = MODULES.get(fullname)
        if entry is None or entry.run is None:
            return None
        source = f"import sys, {entry.target}\nsys.exit({entry.target}.{entry.run}())\n"
        return compile(source, f"<{fullname}: {entry.target}.{entry.run}>", "exec")


def _in_shim(path: Optional[str]) -> bool:
    """Whether ``path`` lies in the shim directory of ``python -m mixedprec.apex``."""
    shim = os.environ.get("MIXEDPREC_APEX_SHIM")
    if not (shim and path):
        return False
    path = os.path.abspath(path)
    return path == shim or path.startswith(shim + os.sep)


def _real_spec(name: str) -> Optional[importlib.machinery.ModuleSpec]:
    """The spec of a real (non-alias) top-level module ``name``, if one is installed."""
    paths = [p for p in sys.path if not _in_shim(p or ".")]
    spec = importlib.machinery.PathFinder.find_spec(name, paths)
    if spec is None or spec.origin is None:  # none, or a bare namespace directory
        return None
    return spec


def _is_alias(module: object) -> bool:
    """Whether ``module`` came from the alias (or from a shim file handing over to it)."""
    name = getattr(module, "__name__", "")
    return (getattr(module, _MARK, False) or name.startswith("mixedprec.")
            or _in_shim(getattr(module, "__file__", None)))


def _removed(name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in REMOVED)


def _real_apex_installed() -> bool:
    loaded = sys.modules.get(_APEX)
    if loaded is not None and not _in_shim(getattr(loaded, "__file__", None)):
        return not _is_alias(loaded)
    return _real_spec(_APEX) is not None


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the names the alias supplies (and only those) before any other finder."""

    def __init__(self):
        self.loader = _AliasLoader()

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top not in _TOP:
            return None
        if fullname in UNLESS_INSTALLED:
            spec = _real_spec(fullname)
            if spec is not None:
                return spec
        elif not _removed(fullname) and _real_apex_installed():
            if fullname != top:
                return None  # the real Apex's own submodule
            spec = _real_spec(fullname)  # past the shim of `python -m mixedprec.apex`
            if spec is None:
                raise ModuleNotFoundError(
                    f"No module named {fullname!r}: the installed Apex was built without it",
                    name=fullname)
            return spec
        if fullname not in MODULES:
            if fullname.startswith(_APEX + "."):
                raise ModuleNotFoundError(
                    f"No module named {fullname!r}: mixedprec's Apex alias provides "
                    f"{', '.join(c for c in MODULES if c.count('.') == 1)} "
                    f"(see mixedprec.apex)", name=fullname)
            return None
        return importlib.machinery.ModuleSpec(
            fullname, self.loader, is_package=_is_package(fullname))


_finder: Optional[_AliasFinder] = None


def is_installed() -> bool:
    """Whether the alias is active in this process."""
    return _finder is not None and _finder in sys.meta_path


def _ours(name: str) -> bool:
    return name.partition(".")[0] in _TOP


def install(warn: bool = True) -> None:
    """Installs the alias (done when :mod:`mixedprec.apex` is imported; idempotent).

    With ``warn``, warns when Apex modules that the alias supplies were imported
    before it (they stay as they are)."""
    global _finder
    if is_installed():
        return
    if warn:
        stale = sorted(name for name, module in list(sys.modules.items())
                       if name in MODULES and not _is_alias(module)
                       and (_removed(name) or not _real_apex_installed()))
        if stale:
            warnings.warn(
                f"mixedprec.apex: already imported before the alias, these stay as they "
                f"are: {', '.join(stale)}; import mixedprec.apex before apex",
                stacklevel=2,
            )
    _finder = _AliasFinder()
    sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Removes the alias and forgets the modules imported under it (``apex``, ``apex.*``,
    ``amp_C``, ``apex_C`` that it supplied); a real Apex's modules and the mixedprec
    modules themselves stay loaded."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    for name, module in list(sys.modules.items()):
        if _ours(name) and _is_alias(module):
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            owner = sys.modules.get(parent)
            if owner is not None and vars(owner).get(child) is module:
                delattr(owner, child)


def _adopt(name: str) -> None:
    """Called by the shim files of ``python -m mixedprec.apex`` in child processes,
    while they are being imported as ``name``: installs the alias and puts the module
    ``name`` resolves to (the alias's or a real Apex's) in their place in
    :data:`sys.modules` (the import then returns it)."""
    install(warn=False)
    if os.environ.get("MIXEDPREC_HALF_DTYPE"):  # the script's --half-dtype
        from mixedprec.compat.fp16_utils import redirect_half_casts

        redirect_half_casts()
    del sys.modules[name]
    importlib.import_module(name)


install()
