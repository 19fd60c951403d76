"""mixedprec.apex: legacy Apex imports resolve to mixedprec, in process (import hook)
and through ``python -m mixedprec.apex`` (script and -m module, argv, sys.path, exit
status, child processes): every module of Apex's file layout in every import form,
beside a (fake) installed Apex that keeps all but what Apex removed, and
``python -m apex.parallel.multiproc``."""

import importlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from forked import run_python

import mixedprec

REPO = Path(__file__).resolve().parents[3]
MARKER = "LEGACY-APEX-SCRIPT-OK"

# Every Python module of Apex's amp, fp16_utils, parallel, optimizers,
# multi_tensor_apply, normalization and contrib.optimizers at its last release with amp
# (`git ls-tree -r --name-only cb65b8ed^ apex/` in Apex's repository).
APEX_FILES = """
apex.amp apex.amp.__version__ apex.amp._amp_state apex.amp._initialize
apex.amp._process_optimizer apex.amp.amp apex.amp.compat apex.amp.frontend apex.amp.handle
apex.amp.lists apex.amp.lists.functional_overrides apex.amp.lists.tensor_overrides
apex.amp.lists.torch_overrides apex.amp.opt apex.amp.rnn_compat apex.amp.scaler apex.amp.utils
apex.amp.wrap apex.contrib.optimizers apex.contrib.optimizers.distributed_fused_adam
apex.contrib.optimizers.distributed_fused_lamb apex.contrib.optimizers.fp16_optimizer
apex.contrib.optimizers.fused_adam apex.contrib.optimizers.fused_lamb
apex.contrib.optimizers.fused_sgd apex.fp16_utils apex.fp16_utils.fp16_optimizer
apex.fp16_utils.fp16util apex.fp16_utils.loss_scaler apex.multi_tensor_apply
apex.multi_tensor_apply.multi_tensor_apply apex.normalization
apex.normalization.fused_layer_norm apex.optimizers apex.optimizers.fused_adagrad
apex.optimizers.fused_adam apex.optimizers.fused_lamb apex.optimizers.fused_mixed_precision_lamb
apex.optimizers.fused_novograd apex.optimizers.fused_sgd apex.parallel.LARC apex.parallel
apex.parallel.distributed apex.parallel.multiproc apex.parallel.optimized_sync_batchnorm
apex.parallel.optimized_sync_batchnorm_kernel apex.parallel.sync_batchnorm
apex.parallel.sync_batchnorm_kernel
""".split()
# Modules of Apex's earlier releases that legacy scripts import: apex.optimizers held the
# 2019 FP16_Optimizer until late 2019 (pytorch-pretrained-BERT's examples).
OLDER_APEX_FILES = ["apex.optimizers.fp16_optimizer"]

# Names the table lists that other parts of mixedprec are adding (in parallel with the
# alias): until they land, looking one up says so.
PENDING = {"AmpHandle", "NoOpHandle", "init", "FusedLAMB", "FusedNovoGrad", "FusedAdagrad",
           "FusedMixedPrecisionLamb", "FP16_Optimizer"}


@pytest.fixture
def alias():
    """The alias installed for one test, and removed after it."""
    import mixedprec.apex as alias

    alias.install()
    yield alias
    alias.uninstall()


def fresh(alias):
    """Forget the modules imported under the alias, so that the next import runs anew."""
    alias.uninstall()
    alias.install()


# --- in process ----------------------------------------------------------------------

def test_own_modules_resolve(alias):
    import amp_C
    import apex
    import apex_C
    from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier
    from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model

    import mixedprec.amp_C
    import mixedprec.apex_C
    import mixedprec.multi_tensor_apply
    import mixedprec.parallel

    assert amp_C is mixedprec.amp_C and apex_C is mixedprec.apex_C
    assert apex.parallel.__name__ == "apex.parallel"
    assert multi_tensor_applier is mixedprec.multi_tensor_apply.multi_tensor_applier
    assert MultiTensorApply is mixedprec.multi_tensor_apply.MultiTensorApply
    assert DistributedDataParallel is mixedprec.parallel.DistributedDataParallel
    assert SyncBatchNorm is mixedprec.parallel.SyncBatchNorm
    assert convert_syncbn_model is mixedprec.parallel.convert_syncbn_model
    assert apex.parallel.LARC.LARC is mixedprec.parallel.LARC
    # The mixedprec modules keep their own identity under the alias.
    assert mixedprec.parallel.__spec__.name == "mixedprec.compat.parallel"
    assert mixedprec.amp_C.__spec__.name == "mixedprec.compat.amp_C"


def test_table_covers_apex_file_layout(alias):
    provided = {name for name in alias.MODULES if name.startswith("apex.")}
    assert set(APEX_FILES) | set(OLDER_APEX_FILES) <= provided
    # the parent of contrib.optimizers
    assert provided - set(APEX_FILES) - set(OLDER_APEX_FILES) == {"apex.contrib"}


def expected_names(alias, module_name):
    """The table's names for ``module_name``, split into those mixedprec provides (with
    its object) and those it lacks."""
    entry = alias.MODULES[module_name]
    target = importlib.import_module(entry.target)
    found = {n: getattr(target, entry.source(n)) for n in entry.names
             if hasattr(target, entry.source(n))}
    return found, set(entry.names) - set(found)


@pytest.mark.parametrize("module_name", APEX_FILES + OLDER_APEX_FILES)
def test_every_import_form(alias, module_name):
    parent, _, child = module_name.rpartition(".")
    found, missing = expected_names(alias, module_name)
    assert missing <= PENDING, f"{module_name}: the target lacks {missing - PENDING}"

    fresh(alias)
    namespace = {}
    exec(f"import {module_name}", namespace)
    assert namespace["apex"] is sys.modules["apex"]
    assert sys.modules[module_name].__name__ == module_name

    fresh(alias)
    exec(f"import {module_name} as m", namespace)
    # As in Python (and Apex), `import a.b.c as m` is the attribute c of a.b: a name
    # the package's __init__ defined wins over the submodule of that name.
    parent_names = alias.MODULES[parent].names if parent in alias.MODULES else ()
    if child in parent_names:
        assert namespace["m"] is getattr(importlib.import_module(alias.MODULES[parent].target),
                                         child)
    else:
        assert namespace["m"] is sys.modules[module_name]

    fresh(alias)
    exec(f"from {parent} import {child} as c", namespace)
    if child not in parent_names:
        assert namespace["c"] is sys.modules[module_name]

    fresh(alias)
    for name, value in found.items():
        exec(f"from {module_name} import {name} as n", namespace)
        assert namespace["n"] is value, f"{module_name}.{name}"
    for name in missing:
        with pytest.raises(ImportError, match=f"cannot import name '{name}'"):
            exec(f"from {module_name} import {name}", namespace)
        with pytest.raises(AttributeError, match="does not provide it"):
            getattr(sys.modules[module_name], name)
    star = {}
    exec(f"from {module_name} import *", star)
    assert {n for n in found if not n.startswith("_")} <= set(star)  # public names
    # In the module's __dict__, as in Apex's modules: timm's ApexScaler saves amp's state
    # only if `'state_dict' in amp.__dict__` (else its checkpoints lose the loss scale).
    module = sys.modules[module_name]
    if isinstance(module, alias._ApexModule):
        held = vars(module)
        absent = sorted(n for n, value in found.items() if held.get(n) is not value)
        assert not absent, f"{module_name}.__dict__ lacks {absent}"


def test_legacy_import_forms(alias):
    """The forms that legacy scripts use, among them Delaunay/MixedPrecision's."""
    import apex.amp.scaler
    import apex.fp16_utils.fp16_optimizer as m
    import apex.parallel.LARC as larc_module
    from apex.amp import _amp_state, handle

    import mixedprec.amp
    import mixedprec.fp16_utils
    import mixedprec.parallel

    assert m.FP16_Optimizer is mixedprec.fp16_utils.FP16_Optimizer
    assert handle.scale_loss is mixedprec.amp.scale_loss
    assert apex.amp.scaler.LossScaler is mixedprec.amp.LossScaler
    assert larc_module.LARC is mixedprec.parallel.LARC
    assert _amp_state is mixedprec.amp._amp_state  # the state object, as in Apex
    from apex.parallel import LARC

    assert LARC is larc_module  # Apex's apex.parallel did not import the class


def test_amp_lists_hold_apexs_lists_and_take_edits(alias):
    """apex.amp.lists.*_overrides hold Apex's lists, each module its own, which scripts
    edit before initialize (NVIDIA's Tacotron2 moves 'softmax' between them)."""
    import torch
    from apex.amp.lists import functional_overrides as functional
    from apex.amp.lists import tensor_overrides, torch_overrides

    assert functional.MODULE is torch.nn.functional and torch_overrides.MODULE is torch
    assert tensor_overrides.MODULE is torch.Tensor
    assert "softmax" in functional.FP32_FUNCS and "linear" in functional.FP16_FUNCS
    assert functional.BANNED_FUNCS[0][0] == "binary_cross_entropy"
    assert "cat" in torch_overrides.SEQUENCE_CASTS and "__add__" in tensor_overrides.CASTS
    assert torch_overrides.FP32_FUNCS is not functional.FP32_FUNCS
    for module in (functional, torch_overrides, tensor_overrides):
        for name in ("FP16_FUNCS", "FP32_FUNCS") + (
                ("BANNED_FUNCS",) if module is functional else ("CASTS", "SEQUENCE_CASTS")):
            lists = getattr(module, name)
            assert lists or name == "SEQUENCE_CASTS" and module is tensor_overrides
            assert all(hasattr(module.MODULE, n if isinstance(n, str) else n[0])
                                 for n in lists), name  # (names of that module)
    functional.FP32_FUNCS.remove("softmax")
    functional.FP16_FUNCS.append("softmax")
    try:
        import apex.amp.lists.functional_overrides as again

        assert "softmax" in again.FP16_FUNCS  # the same lists, wherever imported
    finally:
        functional.FP16_FUNCS.remove("softmax")
        functional.FP32_FUNCS.append("softmax")


def test_2019_apex_optimizers_fp16_optimizer(alias):
    """Apex's apex/optimizers/fp16_optimizer.py (releases before late 2019) is the 2019
    FP16_Optimizer, fp16_utils' LegacyFP16_Optimizer, in every import form."""
    import apex.optimizers.fp16_optimizer as m
    from apex.optimizers.fp16_optimizer import FP16_Optimizer

    from mixedprec.compat.fp16_utils import LegacyFP16_Optimizer

    assert FP16_Optimizer is m.FP16_Optimizer is LegacyFP16_Optimizer
    import apex.optimizers

    assert apex.optimizers.fp16_optimizer is m
    assert "FP16_Optimizer" in dir(m)
    star = {}
    exec("from apex.optimizers.fp16_optimizer import *", star)
    assert star["FP16_Optimizer"] is LegacyFP16_Optimizer
    # Apex's 2019 defaults: a static scale of 1.0, gradients set to None by zero_grad.
    import torch

    model = torch.nn.Linear(2, 1).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    assert not opt.dynamic_loss_scale and opt.loss_scale == 1.0


@pytest.mark.parametrize("apex_name", ["apex.amp", "apex.fp16_utils", "apex.optimizers",
                                       "apex.normalization"])
def test_packages_forward_their_module(alias, apex_name):
    module = importlib.import_module(apex_name)
    target = importlib.import_module(alias.MODULES[apex_name].target)
    submodules = {n.rsplit(".", 1)[1] for n in alias.MODULES if n.startswith(apex_name + ".")}
    for name in target.__all__:
        if name in submodules:  # as in Apex: apex.normalization.fused_layer_norm is a module
            assert getattr(module, name) is sys.modules[f"{apex_name}.{name}"]
        else:
            assert getattr(module, name) is getattr(target, name)
    import apex

    assert getattr(apex, apex_name.split(".")[1]) is module


def test_unknown_apex_module_is_explained(alias):
    with pytest.raises(ModuleNotFoundError, match="mixedprec's Apex alias provides"):
        importlib.import_module("apex.transformer")
    import apex

    with pytest.raises(AttributeError, match="no attribute 'mlp'"):
        getattr(apex, "mlp")  # noqa: B009  (the lookup is the test)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        getattr(apex.parallel, "not_a_name")  # noqa: B009


def test_uninstall_restores_normal_imports(alias):
    import apex.parallel.LARC  # noqa: F401

    alias.uninstall()
    assert not alias.is_installed()
    assert "apex" not in sys.modules and "apex.parallel" not in sys.modules
    assert "apex.parallel.LARC" not in sys.modules
    # only the aliases are forgotten: the face they named stays imported
    assert "mixedprec.compat.parallel" in sys.modules
    alias.install()
    assert alias.is_installed()


def write_fake_apex(root):
    """A stand-in for today's Apex: apex with optimizers and normalization, no amp,
    fp16_utils or parallel; amp_C and apex_C extension modules."""
    (root / "apex" / "optimizers").mkdir(parents=True)
    (root / "apex" / "normalization").mkdir()
    (root / "apex" / "__init__.py").write_text("REAL = True\n")
    (root / "apex" / "optimizers" / "__init__.py").write_text("class FusedAdam:\n    REAL = True\n")
    (root / "apex" / "normalization" / "__init__.py").write_text("REAL = True\n")
    (root / "amp_C.py").write_text("REAL = True\n")
    (root / "apex_C.py").write_text("REAL = True\n")


@pytest.fixture
def fake_apex(alias, tmp_path, monkeypatch):
    """A fake installed Apex on sys.path for one test; its modules are forgotten after."""
    write_fake_apex(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    alias.uninstall()
    for name in list(sys.modules):
        if name.partition(".")[0] in ("apex", "amp_C", "apex_C", "fused_adam_cuda"):
            del sys.modules[name]
    alias.install()


@pytest.mark.parametrize("with_apex", [True, False], ids=["beside-apex", "alone"])
def test_an_installed_fused_adam_cuda_is_used_and_else_mixedprecs(alias, fake_apex,
                                                                   with_apex):
    """fused_adam_cuda (Apex's --deprecated_fused_adam builds it, other projects too): an
    installed one is imported, with or without a real Apex; where there is none (today's
    Apex builds none), mixedprec's."""
    import mixedprec.compat.fused_adam_cuda as ours

    if not with_apex:
        shutil.rmtree(fake_apex / "apex")
    fresh(alias)
    import fused_adam_cuda

    assert fused_adam_cuda is ours
    (fake_apex / "fused_adam_cuda.py").write_text("REAL = True\n")
    del sys.modules["fused_adam_cuda"]
    fresh(alias)
    import fused_adam_cuda

    assert fused_adam_cuda.REAL


def test_real_apex_supplies_all_but_what_it_removed(alias, fake_apex):
    fresh(alias)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # coexisting is not worth a warning
        import amp_C
        import apex
        import apex.normalization
        import apex_C
        from apex.optimizers import FusedAdam
    assert apex.REAL and amp_C.REAL and apex_C.REAL and apex.normalization.REAL
    assert FusedAdam.REAL
    # What Apex removed comes from mixedprec, in every form.
    import apex.fp16_utils.fp16_optimizer as m
    import apex.parallel.LARC
    from apex.amp import scale_loss

    import mixedprec.amp
    import mixedprec.fp16_utils
    import mixedprec.parallel

    assert scale_loss is mixedprec.amp.scale_loss
    assert m.FP16_Optimizer is mixedprec.fp16_utils.FP16_Optimizer
    assert apex.parallel.LARC.LARC is mixedprec.parallel.LARC
    # Apex removed apex.optimizers.fp16_optimizer in 2019: mixedprec's, in the real package.
    from apex.optimizers.fp16_optimizer import FP16_Optimizer

    assert FP16_Optimizer is mixedprec.fp16_utils.LegacyFP16_Optimizer
    assert apex.optimizers.FusedAdam.REAL
    assert apex.amp.__name__ == "apex.amp" and not hasattr(apex.amp, "REAL")
    # Other Apex packages are the real Apex's business: it has no apex.transformer.
    with pytest.raises(ModuleNotFoundError) as err:
        importlib.import_module("apex.transformer")
    assert "mixedprec" not in str(err.value)
    alias.uninstall()
    assert sys.modules["apex"] is apex and "apex.amp" not in sys.modules
    assert not hasattr(apex, "amp") and "apex.optimizers" in sys.modules


def test_real_apex_imported_before_the_alias(alias, fake_apex):
    """`import apex` first, `import mixedprec.apex` after: no warning, and apex.amp
    then comes from mixedprec."""
    alias.uninstall()
    for name in [n for n in sys.modules if n.partition(".")[0] == "apex"]:
        del sys.modules[name]
    import apex

    assert apex.REAL
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alias.install()
    from apex.fp16_utils import FP16_Optimizer

    import mixedprec.fp16_utils

    assert FP16_Optimizer is mixedprec.fp16_utils.FP16_Optimizer
    assert sys.modules["apex"] is apex


def test_apex_imported_before_the_alias_is_reported(alias, monkeypatch):
    alias.uninstall()
    earlier = types.ModuleType("apex.amp")
    monkeypatch.setitem(sys.modules, "apex.amp", earlier)
    with pytest.warns(UserWarning, match="import mixedprec.apex before apex"):
        alias.install()

    assert sys.modules["apex.amp"] is earlier


# --- python -m mixedprec.apex --------------------------------------------------------

LEGACY_SCRIPT = """\
import os
import subprocess
import sys

import torch
import torch.multiprocessing as mp

import amp_C
import apex
import apex_C
from apex import amp
from apex.fp16_utils import *
from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import FusedAdam, FusedSGD
from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model
from apex.parallel.LARC import LARC
import helper_next_to_the_script  # found as with `python script.py`

import mixedprec

assert LARC is mixedprec.parallel.LARC and FP16_Optimizer is mixedprec.fp16_utils.FP16_Optimizer
assert amp.scale_loss is mixedprec.amp.scale_loss and apex_C.__name__ == "mixedprec.compat.apex_C"
flag = torch.cuda.IntTensor([0]) if torch.cuda.is_available() else torch.IntTensor([0])
src = [torch.ones(3, device=flag.device)]
dst = [torch.empty(3, device=flag.device)]
multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 4.0)
assert dst[0].tolist() == [4.0, 4.0, 4.0] and flag.item() == 0
norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [dst], False)
assert abs(norm.item() - 48 ** 0.5) < 1e-5
param = torch.nn.Parameter(torch.ones(4))
param.grad = torch.full((4,), 0.5)
FusedSGD([param], lr=0.1).step()
assert torch.allclose(param.detach(), torch.full((4,), 0.95))


def child(index):
    import amp_C
    import apex.parallel.LARC
    assert amp_C.__name__ == "mixedprec.compat.amp_C"
    assert apex.parallel.LARC.LARC.__module__ == "mixedprec.compat.parallel"


if __name__ == "__main__":
    print("argv", sys.argv[1:])
    print("shim", os.environ["MIXEDPREC_APEX_SHIM"])
    mp.spawn(child, nprocs=1)
    out = subprocess.run(
        [sys.executable, "-c", "import apex.multi_tensor_apply, amp_C; print(amp_C.__name__)"],
        check=True, capture_output=True, text=True).stdout
    assert out.strip() == "mixedprec.compat.amp_C", out
    print("{marker}")
    sys.exit(3)
"""


def run_alias(args, cwd, pythonpath=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*pythonpath, str(REPO)]))
    return run_python(["-m", "mixedprec.apex", *args], cwd=cwd, env=env, timeout=120)


def test_runs_a_legacy_script(tmp_path):
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "train.py"
    script.write_text(LEGACY_SCRIPT.replace("{marker}", MARKER))
    (tmp_path / "scripts" / "helper_next_to_the_script.py").write_text("")

    result = run_alias([str(script), "--epochs", "2", "-m"], cwd=tmp_path)

    assert result.returncode == 3, result.stdout + result.stderr
    assert "argv ['--epochs', '2', '-m']" in result.stdout
    assert MARKER in result.stdout, result.stdout + result.stderr
    shim = next(line.split(" ", 1)[1] for line in result.stdout.splitlines()
                if line.startswith("shim "))
    assert not os.path.exists(shim), "the shim directory was not removed"


@pytest.mark.parametrize("args, message", [
    (["missing.py"], "can't open file .*missing.py.*No such file or directory"),
    (["-u", "train.py"], "unknown option '-u'")])
def test_a_missing_script_or_an_option_of_pythons_is_named_with_exit_2(tmp_path, args,
                                                                      message):
    """As python itself: a missing script is one line and exit code 2. Before: a
    FileNotFoundError traceback and exit code 1, and '-u' taken for the script's path."""
    result = run_alias(args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(message, result.stderr), result.stderr
    assert "Traceback" not in result.stderr


def test_runs_a_module(tmp_path):
    (tmp_path / "legacy_module.py").write_text(textwrap.dedent("""\
        import sys
        import amp_C
        from apex.parallel import LARC
        print(__name__, sys.argv[1:], amp_C.__name__)
    """))
    result = run_alias(["-m", "legacy_module", "a", "b"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "__main__ ['a', 'b'] mixedprec.compat.amp_C" in result.stdout


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


HALF_DTYPE_SCRIPT = """\
import os
import subprocess
import sys

import torch
from apex import amp
from apex.fp16_utils import network_to_half

model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
with amp.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), optimizer) as scaled:
    scaled.backward()
optimizer.step()
print("amp", model[0].weight.dtype, model[1].weight.dtype,
      amp._amp_state.loss_scalers[0].loss_scale())
print("network_to_half", network_to_half(torch.nn.Linear(4, 4))[1].weight.dtype)
from apex.fp16_utils import FP16_Optimizer
net = torch.nn.Linear(4, 2).half()  # torch's own casts, as FP16_Optimizer's examples do
opt = FP16_Optimizer(torch.optim.SGD(net.parameters(), lr=0.1), dynamic_loss_scale=True)
opt.backward(net(torch.randn(8, 4).half()).float().pow(2).mean())
opt.step()
print("half()", net.weight.dtype, opt.fp32_from_fp16_groups[0][0].dtype)
code = ("import torch; from apex.fp16_utils import network_to_half; "
        "print(network_to_half(torch.nn.Linear(2, 2))[1].weight.dtype)")
child = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                       text=True).stdout.strip()
print("child", child, os.environ.get("MIXEDPREC_HALF_DTYPE"))
print("argv", sys.argv[1:])
"""


def run_half_dtype_script(tmp_path, *options, args=()):
    script = tmp_path / "fp16_script.py"
    script.write_text(HALF_DTYPE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MIXEDPREC_HALF_DTYPE"}
    env["PYTHONPATH"] = str(REPO)
    return run_python(["-m", "mixedprec.apex", *options, script, *args], cwd=tmp_path,
                      env=env, timeout=120)


@pytest.mark.parametrize("options", [("--half-dtype", "bfloat16"), ("--half-dtype=bf16",)],
                         ids=["separate", "equals"])
def test_half_dtype_option_runs_an_fp16_script_in_bf16(tmp_path, options):
    """`python -m mixedprec.apex --half-dtype bfloat16 script.py`: amp O2's weights and
    network_to_half's are bf16, in the script and in its child processes; the loss
    scale stays O2's dynamic one; the script's own arguments are its own."""
    result = run_half_dtype_script(tmp_path, *options, args=("--half-dtype", "x"))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "amp torch.bfloat16 torch.float32 65536.0" in out, out
    assert "network_to_half torch.bfloat16" in out
    assert "half() torch.bfloat16 torch.float32" in out
    assert "FP16_Optimizer" not in result.stderr  # no warning: the model is bf16
    assert f"child torch.bfloat16 {options[-1].rpartition('=')[2]}" in out
    assert "argv ['--half-dtype', 'x']" in out


def test_without_the_half_dtype_option_the_script_stays_fp16(tmp_path):
    result = run_half_dtype_script(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "amp torch.float16 torch.float32 65536.0" in result.stdout
    assert "half() torch.float16 torch.float32" in result.stdout
    assert "child torch.float16 None" in result.stdout


@pytest.mark.parametrize("options,match", [
    (("--half-dtype", "bfloat"), "--half-dtype 'bfloat': MIXEDPREC_HALF_DTYPE='bfloat'"),
    (("--half-dtype=fp32",), "--half-dtype 'fp32'"),
    (("--half-dtype",), "--half-dtype expects a value"),
])
def test_bad_half_dtype_option_is_a_usage_error(tmp_path, options, match):
    script = tmp_path / "never_run.py"
    script.write_text("print('RAN')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = [sys.executable, "-m", "mixedprec.apex", *options]
    if len(options) > 1 or "=" in options[0]:
        args.append(str(script))
    result = run_python(args[1:], cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert match in result.stderr and "usage" in result.stderr
    assert "RAN" not in result.stdout


REAL_APEX_SCRIPT = """\
import subprocess
import sys

import amp_C
import apex
from apex.amp import scale_loss
from apex.optimizers import FusedAdam
import apex.fp16_utils.fp16_optimizer as m

assert apex.REAL and amp_C.REAL and FusedAdam.REAL
assert scale_loss.__module__ == "mixedprec.compat.amp"
assert m.FP16_Optimizer.__module__ == "mixedprec.compat.fp16_utils"
code = ("import apex, amp_C, apex_C; from apex.parallel import DistributedDataParallel as D; "
        "print(apex.REAL, amp_C.REAL, apex_C.REAL, D.__module__)")
out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                     text=True).stdout
assert out.split() == ["True", "True", "True", "mixedprec.compat.parallel"], out
print("REAL-APEX-OK")
"""


def test_runs_a_script_beside_a_real_apex(tmp_path):
    """With Apex installed, the script and its children get the real apex, amp_C and
    apex_C, and mixedprec's apex.amp, apex.fp16_utils and apex.parallel."""
    (tmp_path / "site").mkdir()
    write_fake_apex(tmp_path / "site")
    (tmp_path / "train.py").write_text(REAL_APEX_SCRIPT)
    result = run_alias([str(tmp_path / "train.py")], cwd=tmp_path,
                       pythonpath=[str(tmp_path / "site")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "REAL-APEX-OK" in result.stdout


def test_multiproc_launches_one_process_per_rank(tmp_path):
    """`python -m apex.parallel.multiproc script.py --world-size 2` under the alias:
    two processes with --rank 0 and 1; rank 1's output goes to GPU_1.log."""
    (tmp_path / "worker.py").write_text(textwrap.dedent("""\
        import argparse
        import apex.parallel
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr")
        parser.add_argument("--rank", type=int)
        parser.add_argument("--world-size", type=int)
        args = parser.parse_args()
        print("worker", args.rank, args.world_size, args.lr)
        with open(f"rank{args.rank}.txt", "w") as f:
            f.write(f"{args.rank}/{args.world_size}")
    """))
    result = run_alias(["-m", "apex.parallel.multiproc", "worker.py", "--lr", "0.1",
                        "--world-size", "2"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "rank0.txt").read_text() == "0/2"
    assert (tmp_path / "rank1.txt").read_text() == "1/2"
    assert "worker 0 2 0.1" in result.stdout
    assert "worker 1 2 0.1" in (tmp_path / "GPU_1.log").read_text()

    (tmp_path / "fails.py").write_text("import sys\nsys.exit(5)\n")
    result = run_alias(["-m", "apex.parallel.multiproc", "fails.py", "--world-size", "1"],
                       cwd=tmp_path)
    assert result.returncode == 5, result.stdout + result.stderr
    # The same launcher without the alias: python -m mixedprec.parallel.
    result = subprocess.run([sys.executable, "-m", "mixedprec.parallel", "fails.py",
                             "--world-size", "1"], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert result.returncode == 5, result.stdout + result.stderr


def test_redirect_half_casts_follows_the_variable(monkeypatch):
    """Under MIXEDPREC_HALF_DTYPE=bfloat16, torch's Tensor.half and Module.half cast to
    bfloat16; back under float16 they are torch's own again."""
    import torch

    from mixedprec.compat.fp16_utils import redirect_half_casts

    own = torch.Tensor.half, torch.nn.Module.half
    monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", "bfloat16")
    try:
        assert redirect_half_casts() and redirect_half_casts()  # twice: idempotent
        assert torch.ones(2, dtype=torch.float64).half().dtype == torch.bfloat16
        model = torch.nn.Linear(2, 2).half()
        assert model.weight.dtype == torch.bfloat16
        assert torch.arange(3).half().dtype == torch.bfloat16  # as torch's: any dtype
    finally:
        monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", "float16")
        assert not redirect_half_casts()
    assert (torch.Tensor.half, torch.nn.Module.half) == own
    assert torch.ones(2).half().dtype == torch.float16
