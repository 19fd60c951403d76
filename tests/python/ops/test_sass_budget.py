"""Instructions per element of the multi-tensor kernels' main loops against the time the
copy bandwidth gives them (scripts/sass_per_element.py; docs/gpu-validation.md,
"Instructions per element"). The built extension is disassembled once per session
(cuobjdump -sass -arch sm_90 on a copy of mixedprec/_C*.so); without cuobjdump, or with
a build that has no sm_90 kernels, the tests on the build skip. The gate refuses a
planted kernel whose loop is too long and one without a loop."""

import shutil
from pathlib import Path

import pytest
from helpers import load_script

spe = load_script("scripts/sass_per_element.py")
CUOBJDUMP = spe.find_cuobjdump()

# The modes over GATE_FRACTION of their H200 budget in the build of 2026-11-27 (the
# largest ratio over each mode's storage types, plus 3%): the 8-bit state, stochastic
# rounding, and Adam with bf16 state, which is over its budget without either (see the
# doc). They may not get worse; every other mode must stay within GATE_FRACTION.
CEILINGS = {
    ("AdamOp", "stochastic, fp8 state"): 4.92,
    ("SgdOp", "stochastic, fp8 state"): 3.86,
    ("AdamOp", "none, fp8 state"): 3.81,
    ("AdamOp", "remainder, fp8 state"): 2.87,
    ("AdamOp", "kahan, fp8 state"): 2.79,
    ("AdamOp", "fp32 params, fp8 state"): 2.71,
    ("SgdOp", "none, fp8 state"): 2.57,
    ("AdamOp", "fp32 masters, fp8 state"): 2.39,
    ("SgdOp", "stochastic, bf16 state"): 2.17,
    ("AdamOp", "stochastic, bf16 state"): 2.14,
    ("SgdOp", "remainder, fp8 state"): 1.87,
    ("SgdOp", "kahan, fp8 state"): 1.78,
    ("SgdOp", "fp32 params, fp8 state"): 1.68,
    ("SgdOp", "stochastic, fp32 state"): 1.53,
    ("SgdOp", "fp32 masters, fp8 state"): 1.46,
    ("AdamOp", "stochastic, fp32 state"): 1.33,
    ("AdamOp", "none, bf16 state"): 1.21,
    ("AdamOp", "remainder, bf16 state"): 1.00,
    ("AdamOp", "kahan, bf16 state"): 0.95,
    ("AdamOp", "fp32 params, bf16 state"): 0.94,
    ("AdamOp", "fp32 masters, bf16 state"): 0.84,
    ("SgdOp", "none, bf16 state"): 0.84,
    ("AdamOp", "none, fp32 state"): 0.74,
    ("SgdOp", "remainder, bf16 state"): 0.68,
    ("AdamOp", "remainder, fp32 state"): 0.67,
    ("AdamOp", "kahan, fp32 state"): 0.63,
    ("AdamOp", "fp32 params, fp32 state"): 0.62,
    ("SgdOp", "kahan, bf16 state"): 0.61,
    ("AdamOp", "fp32 masters, fp32 state"): 0.58,
    ("SgdOp", "fp32 params, bf16 state"): 0.58,
    ("SgdOp", "none, fp32 state"): 0.58,
    ("NovoGradOp", "no masters"): 0.53,
    ("LambStage1Op", "plain"): 0.53,
}


@pytest.fixture(scope="session")
def records(tmp_path_factory):
    """The analysis of the built extension's sm_90 kernels, once per session (the
    disassembly takes about 10 s, the analysis about as long)."""
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump is not installed")
    so = spe.default_so()
    if so is None:
        pytest.skip("no built extension (mixedprec/_C*.so)")
    copy = tmp_path_factory.mktemp("sass") / Path(so).name  # a build may relink the .so
    shutil.copyfile(so, copy)
    listing = spe.disassemble(str(copy), tool=CUOBJDUMP)
    if "Function : " not in listing:
        pytest.skip("the build has no sm_90 CUDA kernels")
    return spe.analyse(listing)


def label(record, mode=None):
    types = spe.short_types(record["types"])
    return f"{record['op']}<{types}>" + (f" [{mode['mode']}]" if mode else "")


def test_every_kernel_has_its_main_loop_and_every_mode_a_path(records):
    """Not vacuous: every instantiation of every op, a main loop in each, whose loads
    show the elements per iteration the source gives, and one path per mode."""
    constants = spe.engine_constants()
    assert constants["pointwise_elements"] == constants["blocked_elements"] == 8
    assert len(records) >= 150, f"only {len(records)} multi-tensor kernels"
    ops = {r["op"] for r in records}
    assert {"AdamOp", "SgdOp", "AdagradOp", "NovoGradOp", "LambStage1Op", "LambStage2Op",
            "ScaleOp", "CheckFiniteOp"} <= ops
    modes = {(r["op"], m["mode"]) for r in records for m in r["modes"]}
    for op in ("AdamOp", "SgdOp"):
        for mode in ("stochastic, bf16 state", "stochastic, fp8 state", "none, fp8 state",
                     "remainder, fp8 state", "fp32 masters, fp32 state"):
            assert (op, mode) in modes
    for r in records:
        assert r["loop"] is not None, f"{label(r)}: no main loop found"
        # a loop nested in the main loop would be counted for one trip only
        assert r["loop"]["inner_loops"] == 0, f"{label(r)}: a loop inside the main loop"
        assert r["layout_ok"], f"{label(r)}: the parameter layout is not the kernel's"
        assert r["modes"], label(r)
        for m in r["modes"]:
            assert m["per_element"] is not None, f"{label(r, m)}: no feasible iteration"
        if "E4m3" in r["types"]:
            # apply_blocks: log2(8 lanes per block) shuffles per 8-bit list and span
            lists = r["types"].count("E4m3") - (1 if r["op"] == "AdamOp" else 0)
            assert all(m["shuffles_per_iteration"] == 3 * constants["unroll"] * lists
                       for m in r["modes"]), label(r)
        else:
            # apply_chunk: one vector load per list read, kUnroll of them
            assert r["loop"]["static_load_bytes"] == r["expected_load_bytes"], label(r)


def test_philox_is_on_the_path_of_the_stochastic_modes_only(records):
    """The modes are resolved: Philox's multiplies are on the path where parameters or
    8-bit state round stochastically, and nowhere else; the pointwise path draws one
    Philox call per element, the 8-bit state one per 4 elements and list."""
    for r in records:
        for m in r["modes"]:
            stochastic = m["mode"].startswith("stochastic")
            eight = "fp8 state" in m["mode"]
            if not (stochastic or eight):
                assert m["philox_per_element"] == 0, label(r, m)
            else:
                assert m["philox_per_element"] > 0, label(r, m)
            if stochastic and not eight:
                assert m["philox_per_element"] >= 30, label(r, m)  # 10 rounds, per element


def test_no_mode_gets_more_instructions_per_element_than_its_ceiling(records):
    """Every mode within GATE_FRACTION of its H200 budget, or, for the modes that were
    over it in the build of 2026-11-27, within their ceiling then (CEILINGS)."""
    over = []
    for r in records:
        for m in r["modes"]:
            limit = CEILINGS.get((r["op"], m["mode"]), spe.GATE_FRACTION)
            if m["ratio_H200"] > limit:
                over.append(f"{label(r, m)}: {m['per_element']:.1f} instructions per "
                            f"element, {m['ratio_H200']:.2f} of the H200 budget > {limit}")
    assert over == []


@pytest.mark.xfail(strict=True, reason="issue 30: the 8-bit state, stochastic rounding and "
                   "Adam with bf16 state are over half their H200 budget (CEILINGS; "
                   "docs/gpu-validation.md, 'Instructions per element')")
def test_every_optimizer_kernel_is_within_half_its_budget(records):
    assert spe.violations(records) == []


# --- the gate on a planted listing --------------------------------------------------

SCALE = ("_ZN9mixedprec4cuda16pointwise_kernelINS_7ScaleOpEJffEEEvNS0_14TensorListMeta"
         "IXsZT0_EEET_PKfPf")
CHECK = ("_ZN9mixedprec4cuda16pointwise_kernelINS_13CheckFiniteOpEJfEEEvNS0_14TensorListMeta"
         "IXsZT0_EEET_PKfPf")


def planted(name, body):
    """A cuobjdump -sass listing of one kernel (addresses every 0x10)."""
    lines = [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
    for n, text in enumerate(body):
        lines.append(f"        /*{16 * n:04x}*/                   {text} ;"
                     f"                /* 0x000fe20000000f00 */")
    return "\n".join(lines) + "\n"


def loop_kernel(name, work):
    """Thread 0 loads four floats, multiplies them `work` times, stores them, and loops
    over the tensor: the loop's header is at 0x40."""
    body = ["LDC R1, c[0x0][0x28]", "S2R R0, SR_TID.X", "ISETP.GE.AND P0, PT, R0, 0x100, PT",
            "@P0 EXIT", "LDG.E.128 R4, desc[UR4][R2.64]"]
    body += ["FMUL R4, R4, R5"] * work
    body += ["STG.E.128 desc[UR4][R2.64], R4", "IADD3 R0, R0, 0x200, RZ",
             "ISETP.GE.AND P0, PT, R0, 0x100000, PT", "@!P0 BRA 0x40", "EXIT"]
    return planted(name, body + [f"BRA 0x{16 * len(body):x}"])


def test_the_gate_refuses_a_planted_loop_that_is_too_long_and_a_kernel_without_one():
    listing = ("\nFatbin elf code:\n================\narch = sm_90\n\n\tcode for sm_90\n"
               + loop_kernel(SCALE, 600)
               + planted(CHECK, ["S2R R0, SR_TID.X", "LDG.E R4, desc[UR4][R2.64]",
                                 "STG.E desc[UR4][R2.64], R4", "EXIT", "BRA 0x40"]))
    records = spe.analyse(listing)
    assert [r["op"] for r in records] == ["ScaleOp", "CheckFiniteOp"]
    scale, check = records
    assert scale["loop"]["header"] == 0x40
    (mode,) = scale["modes"]
    # 600 multiplies + load, store, add, compare, branch over 8 elements
    assert mode["per_element"] == pytest.approx(605 / 8)
    # 8 bytes (read 4, write 4) at 8 instructions per byte
    assert mode["bytes_per_element"] == 8
    assert mode["budget_H200"] == pytest.approx(64.0, rel=1e-3)
    assert check["loop"] is None
    found = spe.violations(records)
    assert any(line.startswith("ScaleOp<f32,f32>") and "of the H200 budget" in line
               for line in found), found
    assert any(line.startswith("CheckFiniteOp<f32>") and "no main loop" in line
               for line in found), found
    # and a short loop passes
    short = spe.analyse("\tcode for sm_90\n" + loop_kernel(SCALE, 20))
    assert short[0]["modes"][0]["per_element"] == pytest.approx(25 / 8)
    assert spe.violations(short) == []
