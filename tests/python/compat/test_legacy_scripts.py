"""Legacy-style Apex scripts (tests/python/compat/legacy_scripts/, written for these tests) run
unmodified through `python -m mixedprec.apex` in a subprocess, on the CPU: a
Megatron-like model on apex.normalization, an NVIDIA-BERT-like prologue (apex_C, amp_C,
apex.parallel's DDP), BERT-like pretraining with FusedLAMB at O2, Delaunay-like `import
apex.fp16_utils.fp16_optimizer as m`, a fairseq-like FusedAdam subclass, amp internals
as NVIDIA's BERT touches them, maskrcnn-benchmark's amp.init handle and
pytorch-pretrained-BERT's 2019 FP16_Optimizer. Each script picks CUDA when it sees a GPU
and prints the device after its marker: the "cpu" run hides the GPUs, the "cuda" run (on a
machine with one) leaves them visible."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from forked import run_python

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).resolve().parent / "legacy_scripts"

# script -> (the line it prints when all its checks passed, whether it needs a scratch dir)
CASES = {
    "megatron_layernorm.py": ("MEGATRON-LIKE-OK", False),
    "bert_prologue_flatten.py": ("BERT-PROLOGUE-OK", True),
    "delaunay_fp16_optimizer.py": ("DELAUNAY-LIKE-OK", False),
    "bert_pretraining_lamb.py": ("LEGACY-SCRIPT-OK", False),
    "fairseq_fused_adam_v2.py": ("LEGACY-SCRIPT-OK", False),
    "amp_internals_bert.py": ("LEGACY-SCRIPT-OK", False),
    "maskrcnn_amp_init.py": ("LEGACY-SCRIPT-OK", False),
    "pretrained_bert_fp16_optimizer.py": ("LEGACY-SCRIPT-OK", False),
}
# scripts that stay on the CPU where there is a GPU -> why (their "cuda" twin skips)
CPU_ONLY = {
    "bert_prologue_flatten.py": "its DDP part runs on a one-process gloo (CPU) group",
}


def test_every_script_is_run():
    assert sorted(CASES) == sorted(p.name for p in SCRIPTS.glob("*.py"))
    assert set(CPU_ONLY) <= set(CASES)


@pytest.mark.parametrize("script", sorted(CASES))
def test_legacy_script_runs_unmodified(script, device, tmp_path):
    """``device`` (conftest's fixture) is "cpu", or "cuda" where a GPU is present."""
    if device == "cuda" and script in CPU_ONLY:
        pytest.skip(f"{script} stays on the CPU: {CPU_ONLY[script]}")
    marker, scratch = CASES[script]
    args = ["-m", "mixedprec.apex", SCRIPTS / script]
    if scratch:
        args.append(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the script sees no GPU and picks the CPU
    # (python -m mixedprec.apex SCRIPT, as a new process runs it: forked.run_python)
    result = run_python(args, cwd=tmp_path, env=env, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    # the marker and the device the script ran on: a "cuda" run that fell back fails here
    assert f"{marker} {device}" in result.stdout, result.stdout + result.stderr


def test_scripts_need_the_alias(tmp_path):
    """Without the alias (and without Apex) the same script fails at its first Apex
    import: the runs above are the alias's doing."""
    code = "import apex"
    check = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=""),
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    if check.returncode == 0:
        pytest.skip("a real apex is installed in this environment")
    result = subprocess.run([sys.executable, str(SCRIPTS / "delaunay_fp16_optimizer.py")],
                            env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "No module named 'apex'" in result.stderr
