"""mixedprec.apex: legacy Apex imports resolve to mixedprec, in process (import hook)
and through ``python -m mixedprec.apex`` (script and -m module, argv, sys.path, exit
status, child processes)."""

import importlib
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import mixedprec

REPO = Path(__file__).resolve().parents[2]
MARKER = "LEGACY-APEX-SCRIPT-OK"

# Apex name -> mixedprec module, for the modules other parts of mixedprec provide.
OTHERS = {"apex.amp": "mixedprec.amp", "apex.fp16_utils": "mixedprec.fp16_utils",
          "apex.optimizers": "mixedprec.optimizers"}


def available(module_name):
    """Whether a mixedprec module imports (parts of mixedprec are written in parallel)."""
    try:
        importlib.import_module(module_name)
    except ImportError:
        return False
    return True


@pytest.fixture
def alias():
    """The alias installed for one test, and removed after it."""
    import mixedprec.apex as alias

    alias.install()
    yield alias
    alias.uninstall()


# --- in process ----------------------------------------------------------------------

def test_own_modules_resolve(alias):
    import amp_C
    import apex
    from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier
    from apex.parallel import LARC, DistributedDataParallel, SyncBatchNorm, convert_syncbn_model

    import mixedprec.amp_C
    import mixedprec.multi_tensor_apply
    import mixedprec.parallel

    assert amp_C is mixedprec.amp_C
    assert apex.parallel is mixedprec.parallel
    assert apex.multi_tensor_apply is mixedprec.multi_tensor_apply
    assert multi_tensor_applier is mixedprec.multi_tensor_apply.multi_tensor_applier
    assert MultiTensorApply is mixedprec.multi_tensor_apply.MultiTensorApply
    assert DistributedDataParallel is mixedprec.parallel.DistributedDataParallel
    assert LARC is mixedprec.parallel.LARC
    assert SyncBatchNorm is torch.nn.SyncBatchNorm
    assert convert_syncbn_model is mixedprec.parallel.convert_syncbn_model
    # The mixedprec modules keep their own identity under the alias.
    assert mixedprec.parallel.__spec__.name == "mixedprec.parallel"
    assert mixedprec.amp_C.__name__ == "mixedprec.amp_C"


def test_legacy_file_layout_resolves(alias):
    from apex.multi_tensor_apply.multi_tensor_apply import MultiTensorApply
    from apex.parallel.distributed import DistributedDataParallel
    from apex.parallel.LARC import LARC

    import mixedprec.parallel

    assert LARC is mixedprec.parallel.LARC
    assert DistributedDataParallel is mixedprec.parallel.DistributedDataParallel
    assert MultiTensorApply is mixedprec.multi_tensor_apply.MultiTensorApply
    assert isinstance(mixedprec.parallel.LARC, type)  # not replaced by a module


@pytest.mark.parametrize("apex_name", sorted(OTHERS))
def test_other_modules_resolve(alias, apex_name):
    target = OTHERS[apex_name]
    if not available(target):
        pytest.skip(f"{target} is not importable yet")
    assert importlib.import_module(apex_name) is sys.modules[target]
    import apex

    assert getattr(apex, apex_name.split(".")[1]) is sys.modules[target]


def test_fp16_utils_and_optimizers_star_and_legacy_paths(alias):
    if available("mixedprec.fp16_utils"):
        namespace = {}
        exec("from apex.fp16_utils import *", namespace)
        assert set(mixedprec.fp16_utils.__all__) <= set(namespace)
    if available("mixedprec.optimizers"):
        from apex.optimizers import FusedAdam, FusedSGD
        from apex.optimizers.fused_adam import FusedAdam as legacy_adam
        from apex.optimizers.fused_sgd import FusedSGD as legacy_sgd

        assert legacy_adam is FusedAdam and legacy_sgd is FusedSGD
    if not (available("mixedprec.fp16_utils") or available("mixedprec.optimizers")):
        pytest.skip("neither mixedprec.fp16_utils nor mixedprec.optimizers is importable yet")


def test_unknown_apex_module_is_explained(alias):
    with pytest.raises(ModuleNotFoundError, match="mixedprec's Apex alias provides"):
        importlib.import_module("apex.normalization")
    import apex

    with pytest.raises(AttributeError, match="no attribute 'contrib'"):
        getattr(apex, "contrib")  # noqa: B009  (the lookup is the test)


def test_uninstall_restores_normal_imports(alias):
    import apex  # noqa: F401

    alias.uninstall()
    assert not alias.is_installed()
    assert "apex" not in sys.modules and "apex.parallel" not in sys.modules
    assert "mixedprec.parallel" in sys.modules  # only the aliases are forgotten
    alias.install()
    assert alias.is_installed()


def test_real_apex_is_shadowed_with_a_warning(alias, tmp_path, monkeypatch):
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    alias.uninstall()
    with pytest.warns(UserWarning, match="a real Apex is installed"):
        alias.install()
    import apex

    assert not hasattr(apex, "REAL")
    assert apex.parallel is sys.modules["mixedprec.parallel"]


def test_apex_imported_before_the_alias_is_reported(alias, monkeypatch):
    alias.uninstall()
    earlier = types.ModuleType("apex")
    monkeypatch.setitem(sys.modules, "apex", earlier)
    with pytest.warns(UserWarning, match="import mixedprec.apex before apex"):
        alias.install()
    import apex

    assert apex is earlier


# --- python -m mixedprec.apex --------------------------------------------------------

LEGACY_SCRIPT = """\
import os
import subprocess
import sys

import torch
import torch.multiprocessing as mp

import amp_C
import apex
from apex.multi_tensor_apply import multi_tensor_applier
from apex.parallel import DistributedDataParallel, LARC, SyncBatchNorm, convert_syncbn_model
from apex.parallel.LARC import LARC as LegacyLARC
import helper_next_to_the_script  # found as with `python script.py`

assert LegacyLARC is LARC and apex.parallel.__name__ == "mixedprec.parallel"
flag = torch.cuda.IntTensor([0]) if torch.cuda.is_available() else torch.IntTensor([0])
src = [torch.ones(3, device=flag.device)]
dst = [torch.empty(3, device=flag.device)]
multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 4.0)
assert dst[0].tolist() == [4.0, 4.0, 4.0] and flag.item() == 0
norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [dst], False)
assert abs(norm.item() - 48 ** 0.5) < 1e-5
{extra}

def child(index):
    import amp_C
    import apex.parallel
    assert amp_C.__name__ == "mixedprec.amp_C" and apex.parallel.__name__ == "mixedprec.parallel"


if __name__ == "__main__":
    print("argv", sys.argv[1:])
    print("shim", os.environ["MIXEDPREC_APEX_SHIM"])
    mp.spawn(child, nprocs=1)
    out = subprocess.run(
        [sys.executable, "-c", "import apex.multi_tensor_apply, amp_C; print(amp_C.__name__)"],
        check=True, capture_output=True, text=True).stdout
    assert out.strip() == "mixedprec.amp_C", out
    print("{marker}")
    sys.exit(3)
"""

EXTRAS = {
    "mixedprec.fp16_utils": """
from apex.fp16_utils import *
import apex.fp16_utils
assert apex.fp16_utils.__name__ == "mixedprec.fp16_utils"
""",
    "mixedprec.optimizers": """
from apex.optimizers import FusedAdam, FusedSGD
param = torch.nn.Parameter(torch.ones(4))
param.grad = torch.full((4,), 0.5)
FusedSGD([param], lr=0.1).step()
assert torch.allclose(param.detach(), torch.full((4,), 0.95))
""",
    "mixedprec.amp": """
from apex import amp
assert amp.__name__ == "mixedprec.amp"
""",
}


def run_alias(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "mixedprec.apex", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_runs_a_legacy_script(tmp_path):
    extra = "".join(code for module, code in EXTRAS.items() if available(module))
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "train.py"
    script.write_text(LEGACY_SCRIPT.format(extra=extra, marker=MARKER))
    (tmp_path / "scripts" / "helper_next_to_the_script.py").write_text("")

    result = run_alias([str(script), "--epochs", "2", "-m"], cwd=tmp_path)

    assert result.returncode == 3, result.stdout + result.stderr
    assert "argv ['--epochs', '2', '-m']" in result.stdout
    assert MARKER in result.stdout, result.stdout + result.stderr
    shim = next(line.split(" ", 1)[1] for line in result.stdout.splitlines()
                if line.startswith("shim "))
    assert not os.path.exists(shim), "the shim directory was not removed"


def test_runs_a_module(tmp_path):
    (tmp_path / "legacy_module.py").write_text(textwrap.dedent("""\
        import sys
        import amp_C
        from apex.parallel import LARC
        print(__name__, sys.argv[1:], amp_C.__name__)
    """))
    result = run_alias(["-m", "legacy_module", "a", "b"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "__main__ ['a', 'b'] mixedprec.amp_C" in result.stdout


def test_usage_without_a_script(alias, capsys):
    from mixedprec.apex.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2 and "usage" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "usage" in capsys.readouterr().out


def test_mixedprec_is_importable_without_the_alias():
    """Importing mixedprec does not install the alias: only mixedprec.apex does."""
    code = "import sys, mixedprec; assert 'mixedprec.apex' not in sys.modules; import apex"
    result = subprocess.run([sys.executable, "-c", code],
                            env=dict(os.environ, PYTHONPATH=str(REPO)),
                            capture_output=True, text=True, timeout=120)
    if result.returncode == 0:
        pytest.skip("a real apex is installed in this environment")
    assert "No module named 'apex'" in result.stderr
    assert mixedprec.__name__ == "mixedprec"
