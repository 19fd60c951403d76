"""Instructions per element of the multi-tensor kernels' main loops against the time the
copy bandwidth gives them (scripts/sass_per_element.py; docs/gpu-validation.md,
"Instructions per element"). The built extension is disassembled once per session
(cuobjdump -sass -arch sm_90 on a copy of mixedprec/_C*.so); without cuobjdump, or with
a build that has no sm_90 kernels, the tests on the build skip. Each mode is gated on
the kernel the CUDA engine launches for it: AdamOp's and SgdOp's fixed modes on their
Fixed<Op, Mode> kernels (csrc/pointwise.h), the rest on the generic kernel. The gate
refuses a planted kernel whose loop is too long, one without a loop, and a fixed mode
whose Fixed kernel is missing."""

import shutil
from pathlib import Path

import pytest
from helpers import load_script

spe = load_script("scripts/sass_per_element.py")
CUOBJDUMP = spe.find_cuobjdump()

# One xdist worker runs this module (make py-test's --dist loadgroup), so that the
# disassembly and its analysis (about 40 s on a 2-core machine) are done once, not once
# per worker.
pytestmark = pytest.mark.xdist_group("sass")

# The modes over GATE_FRACTION of their H200 budget (the largest ratio over each mode's
# storage types, plus 3%): the 8-bit state, stochastic rounding, and Adam with bf16
# state, which is over its budget without either (see the doc). They may not get worse;
# every other mode must stay within GATE_FRACTION. AdamOp's from the build of 2026-11-28,
# whose modes run on their Fixed kernels (four of the five with fp32 state came within
# GATE_FRACTION there, and left this table); SgdOp's from that of 2026-11-29, whose modes
# run on theirs (its bf16 and fp32 state without stochastic rounding came within it).
# AdamOp's 8-bit modes from the build of 2026-11-30 (night), whose two moments share one
# Philox draw per lane and span and whose block loop is compiled once per alignment
# (multi_tensor_block.cuh, apply_blocks): a fifth or more under the ceilings before them.
CEILINGS = {
    # (the stochastic and 8-bit modes' from the build of 2026-11-30, day, whose Fixed
    # kernels draw Philox bits once per vector of 4 elements, for the params and the 8-bit
    # state: multi_tensor_block.cuh's apply_vector and state_bits)
    ("AdamOp", "stochastic, fp8 state"): 2.88,
    ("SgdOp", "stochastic, fp8 state"): 2.44,
    ("AdamOp", "none, fp8 state"): 2.58,
    ("AdamOp", "remainder, fp8 state"): 2.00,
    ("AdamOp", "kahan, fp8 state"): 2.01,
    ("AdamOp", "fp32 params, fp8 state"): 1.59,
    ("SgdOp", "none, fp8 state"): 1.91,
    ("AdamOp", "fp32 masters, fp8 state"): 1.69,
    ("SgdOp", "stochastic, bf16 state"): 0.95,
    ("AdamOp", "stochastic, bf16 state"): 1.18,
    ("SgdOp", "remainder, fp8 state"): 1.47,
    # (from the build of 2026-12-02, whose sm_90 code ptxas compiles from compute_80 PTX,
    # setup.py's DEFAULT_GENCODE: the Fixed kernel's loop 133.4 -> 139.6 instructions per
    # element, bf16 widened by byte permutes where compute_90's PTX converts; of the 158
    # modes of the Adam and SGD units, 114 got fewer instructions there, 43 as many)
    ("SgdOp", "kahan, fp8 state"): 1.49,
    ("SgdOp", "fp32 params, fp8 state"): 1.10,
    ("SgdOp", "stochastic, fp32 state"): 0.65,
    ("SgdOp", "fp32 masters, fp8 state"): 1.10,
    ("AdamOp", "stochastic, fp32 state"): 0.72,
    ("AdamOp", "none, bf16 state"): 0.84,
    ("AdamOp", "remainder, bf16 state"): 0.80,
    ("AdamOp", "kahan, bf16 state"): 0.72,
    ("AdamOp", "fp32 params, bf16 state"): 0.63,
    ("AdamOp", "fp32 masters, bf16 state"): 0.59,
    ("AdamOp", "remainder, fp32 state"): 0.52,
    ("NovoGradOp", "no masters"): 0.53,
    ("LambStage1Op", "plain"): 0.53,
    # precision_report=True (issue 32): counted steps run their modes' counting kernels
    # (Fixed<Op, Mode, true>; builds of 2026-11-29)
    ("AdamOp", "stochastic, fp8 state, report"): 3.05,
    ("AdamOp", "none, fp8 state, report"): 2.78,
    ("AdamOp", "kahan, fp8 state, report"): 2.08,
    ("AdamOp", "stochastic, bf16 state, report"): 1.22,
    ("AdamOp", "stochastic, fp32 state, report"): 0.87,
    ("AdamOp", "none, bf16 state, report"): 1.00,
    ("AdamOp", "kahan, bf16 state, report"): 0.84,
    ("AdamOp", "none, fp32 state, report"): 0.61,
    ("AdamOp", "kahan, fp32 state, report"): 0.56,
    ("SgdOp", "stochastic, fp8 state, report"): 2.66,
    ("SgdOp", "none, fp8 state, report"): 2.10,
    ("SgdOp", "stochastic, bf16 state, report"): 1.03,
    ("SgdOp", "kahan, fp8 state, report"): 1.52,
    ("SgdOp", "stochastic, fp32 state, report"): 0.98,
    ("SgdOp", "none, bf16 state, report"): 0.67,
    ("SgdOp", "kahan, bf16 state, report"): 0.56,
}


@pytest.fixture(scope="session")
def records(tmp_path_factory):
    """The analysis of the built extension's sm_90 kernels, once per session (the
    disassembly takes about 20 s, the analysis of its kernels about as long)."""
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


def test_one_worker_runs_this_module(request):
    """Under --dist loadgroup (make py-test) the group holds: xdist gives a grouped
    test's id its group's name, which under pytest 9.2.0 it no longer did, and the group
    spread over the workers without a word (pytest-xdist issue 1386)."""
    argv = getattr(request.config, "workerinput", {}).get("mainargv", [])  # (a worker's)
    if "--dist=loadgroup" not in argv and ["--dist", "loadgroup"] not in map(
            list, zip(argv, argv[1:])):
        pytest.skip("not run by pytest-xdist with --dist loadgroup")
    assert request.node.nodeid.endswith("@sass"), request.node.nodeid


def label(record, mode=None):
    return spe.kernel_label(record) + (f" [{mode['mode']}]" if mode else "")


def analysed(record):
    """A kernel's modes analysed on it: those it runs, and a generic kernel's fixed modes
    (which run on their Fixed kernels: analysed for comparison, not gated on ratio)."""
    return record["modes"] + record["not_launched"]


def test_every_kernel_has_its_main_loop_and_every_mode_a_path(records):
    """Not vacuous: every instantiation of every op (Fixed ones too), a main loop in each,
    whose loads show the elements per iteration the source gives, and one path per mode
    (a Fixed kernel of a mode the script does not follow aside)."""
    constants = spe.engine_constants()
    assert constants["pointwise_elements"] == constants["blocked_elements"] == 8
    from mixedprec import _build_info

    # sm_90's code from compute_90 PTX where TORCH_CUDA_ARCH_LIST names 9.0
    arch_list = getattr(_build_info, "CUDA_ARCH_LIST", "")
    compute_90 = any(a.split("+")[0] == "9.0" for a in arch_list.replace(";", " ").split())
    unpacks = 2 * constants["unroll"] if compute_90 else 0
    assert [r["demangled"] for r in records if r.get("unrecognised")] == []
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
        assert not r.get("unknown_fixed"), f"{label(r)}: not one of the source's FixedModes"
        assert analysed(r) or r["fixed"], label(r)
        for m in analysed(r):
            assert m["per_element"] is not None, f"{label(r, m)}: no feasible iteration"
        if "E4m3" in r["types"]:
            # apply_blocks: log2(8 lanes per block) shuffles per 8-bit list and span
            # (AdamOp's amsgrad list, of the state's type, is not one of them)
            lists = r["types"].count("E4m3") - (1 if r["op"] == "AdamOp" else 0)
            assert all(m["shuffles_per_iteration"] == 3 * constants["unroll"] * lists
                       for m in analysed(r)), label(r)
            # and a lane's 4 codes of each such list decoded by the hardware, two at a
            # time, where sm_90's code comes from compute_90 PTX (e4m3_lane_values: 2
            # conversions per list and span, in the vector and the element path alike);
            # from setup.py's default compute_80 PTX, none
            assert all(m["e4m3_unpacks_per_iteration"] == unpacks * lists
                       for m in analysed(r)), label(r)
        else:
            # apply_chunk: one vector load per list read (a Fixed kernel's: its mode's),
            # kUnroll of them
            assert r["loop"]["static_load_bytes"] == r["expected_load_bytes"], label(r)


@pytest.mark.parametrize("op", ["AdamOp", "SgdOp"])
def test_the_fixed_modes_run_on_their_fixed_kernels(records, op):
    """The Fixed<Op, Mode> kernels are found, for every fixed mode the build registers:
    every fixed mode (Op::FixedModes, csrc/pointwise.h's LeanModes) has its kernel beside
    each generic kernel of the op whose storage types it fits, and its counting kernel
    (Fixed<Op, Mode, true>) where it also counts, and nothing else does; and a mode the
    engine runs in a fixed mode is analysed and gated on that mode's Fixed kernel, not
    on the generic one."""
    fixed = spe.fixed_modes()
    assert set(fixed) == {"AdamOp", "SgdOp"}, "the CUDA engine does not launch Fixed kernels"
    modes = fixed[op]["modes"]
    assert len(modes) == len(set(modes)) == 10
    c = spe.functors()[op]["constants"]
    generic = {tuple(r["types"]) for r in records
               if r.get("op") == op and r["fixed"] is None}
    found = {(tuple(r["types"]), r["fixed"]) for r in records
             if r.get("op") == op and r["fixed"] is not None}
    assert len(generic) >= 30
    expected = {(types, m.label()) for types in generic for m in modes
                if spe.fixed_fits(m, list(types), c)}
    counting = {(types, m._replace(counting=True).label()) for types in generic for m in modes
                if spe.fixed_fits(m, list(types), c) and spe.fixed_counts(m, list(types))}
    assert found == expected | counting
    # none, kahan and stochastic, with fp32, bf16 and 8-bit state
    assert len(counting) == 9
    assert {name for _, name in found} == {m.label() for m in modes} | {n for _, n in counting}
    # every mode of the op the script follows on gradients as autograd gives them is a
    # fixed mode (today), the precision report's included (on its mode's counting
    # kernel): none stays on a generic kernel, each is analysed on the Fixed kernel of
    # its storage types; on fp32 gradients of narrower params (written by hand) every
    # mode runs the generic kernel, by design
    by_kernel = {(tuple(r["types"]), r["fixed"]): r for r in records if r.get("op") == op}
    on_fixed = uncommon = 0
    for r in records:
        if r.get("op") != op or r["fixed"] is not None:
            continue
        by_hand = [m for m in r["modes"] if m.get("uncommon_grads")]
        for m in by_hand:
            model = c["kModelList"] in m["lists"]
            assert not spe.autograd_grads(r["types"], model, c), label(r, m)
            assert "runs_on" not in m and "missing_fixed" not in m, label(r, m)
        uncommon += len(by_hand)
        assert r["modes"] == by_hand, f"{label(r)}: {[m['mode'] for m in r['modes']]}"
        assert r["not_launched"] or by_hand, label(r)
        for m in r["not_launched"]:
            runs = m["runs_on"]
            assert runs.startswith(f"Fixed<{op},Mode<"), label(r, m)
            kernel = by_kernel[(tuple(r["types"]), runs[len(f"Fixed<{op},"):-1])]
            assert [f["mode"] for f in kernel["modes"]] == [m["mode"]], label(r, m)
            on_fixed += 1
    assert on_fixed >= 25 and uncommon >= 15, (on_fixed, uncommon)
    # e.g. bf16 params and state, stochastic rounding: its Fixed kernel's path, not the
    # generic one's, and the summary's row made of Fixed kernels only
    bf16 = next(types for types in generic if types[:3] == ("BFloat16",) * 3
                and types[c["kCompList"]] == "BFloat16")
    kernel = by_kernel[(bf16, "Mode<0,0,0,1,0>")]
    (m,) = kernel["modes"]
    assert m["mode"] == "stochastic, bf16 state" and m["kernel"] == kernel["kernel"]
    assert "runs_on" not in m and "missing_fixed" not in m
    (shadow,) = [g for g in by_kernel[(bf16, None)]["not_launched"]
                 if g["mode"] == "stochastic, bf16 state"]
    assert shadow["runs_on"] == f"Fixed<{op},Mode<0,0,0,1,0>>"
    assert m["per_element"] < shadow["per_element"]
    for row in spe.summary(records):
        if row["op"] == op:
            assert row["fixed"] == row["kernels"], row


def test_the_report_modes_run_a_counting_copy_of_their_modes_loop(records):
    """precision_report=True on bf16 params without masters (the tally list given):
    AdamOp's and SgdOp's modes run their mode's counting kernel (Fixed<Op, Mode, true>,
    multi_tensor_block.cuh's launch_as), and on gradients autograd does not give the
    generic kernel, whose loop has a tallying copy
    (unswitched on the tally pointer). Either path is the same mode's without the report
    (on its Fixed kernel, or on the same generic kernel) plus the tally's arithmetic
    (the kept value's rounding, the lost and applied parts, their squares and the
    count: 8 to 30 instructions per element on the same kernel, no memory instruction
    in the loop; a counting kernel is compiled apart from its mode's, and ptxas may
    schedule it otherwise: the stochastic ones, given more registers, take 2-5 more,
    and since the 8-bit decode of 2026-12-03 (sm_90 from compute_90 PTX) the counting kernel of
    stochastic params with 8-bit state 2.5 fewer than its plain one, whose longest path
    takes two more arms the script leaves unresolved; so a counting kernel is held to
    within 3 below its mode's, and each op's counting kernels to 8 more on average)."""
    by_kernel = {(r["op"], tuple(r["types"]), r["fixed"]): r for r in records
                 if r.get("op") in ("AdamOp", "SgdOp")}
    counted = generic = 0
    extras = {}
    for r in records:
        if r.get("op") not in ("AdamOp", "SgdOp"):
            continue
        for m in r["modes"]:
            if not m["mode"].endswith(", report"):
                continue
            assert "runs_on" not in m and "missing_fixed" not in m, label(r, m)
            plain = m["mode"][:-len(", report")]
            if r["fixed"] is None:
                base = {b["mode"]: b for b in analysed(r)}[plain]
                generic += 1
                least = 8
            else:
                assert r["fixed"].endswith(",true"), label(r, m)
                key = (r["op"], tuple(r["types"]), r["fixed"][:-5])
                (base,) = [b for b in by_kernel[key]["modes"]
                           if b["mode"] == plain]
                counted += 1
                least = -3
            extra = m["per_element"] - base["per_element"]
            if r["fixed"] is not None:
                extras.setdefault(r["op"], []).append(extra)
            assert least <= extra <= 60, f"{label(r, m)}: {extra:+.1f} instructions per element"
            assert m["loads_per_element"] == base["loads_per_element"], label(r, m)
            if r["fixed"] is None:
                assert m["memory_per_element"] == base["memory_per_element"], label(r, m)
            # (a counting kernel's longest path may take another arm of the branches
            # the script leaves unresolved, such as the optional unscaled-grads stores:
            # tests/cpp/test_memory_traffic.cpp traces its bytes exactly)
    # each op: none, kahan and stochastic with fp32, bf16 and 8-bit state on their
    # counting kernels; on fp32 gradients of bf16 params, the generic kernels
    assert counted == 18 and generic >= 18, (counted, generic)
    for op, each in extras.items():
        assert sum(each) / len(each) >= 8, (op, each)


def test_the_optimizers_kernels_take_the_stored_gradient_dtypes_only(records):
    """The optimizers' kernels are built for the gradients autograd gives (of the
    params' dtype, or with fp32 masters of the model copy's) and fp32 ones, no other
    (dispatch.h's kStoredGrad: run_optimizer widens the others to fp32 first)."""
    seen = set()
    for r in records:
        op = r.get("op")
        if op not in ("AdamOp", "SgdOp", "AdagradOp", "NovoGradOp"):
            continue
        model = spe.functors()[op]["constants"]["kModelList"]
        types = r["types"]
        own = types[model] if types[0] == "float" else types[0]
        assert types[1] in (own, "float"), f"{label(r)}: {types[1]} gradients"
        seen.add((op, types[0], types[1]))
    # each op on fp16 and bf16 params, with their own and with fp32 gradients
    for op in ("AdamOp", "SgdOp", "AdagradOp", "NovoGradOp"):
        for param in ("Half", "BFloat16"):
            assert {(op, param, param), (op, param, "float")} <= seen, (op, param)


def test_philox_is_on_the_path_of_the_stochastic_modes_only(records):
    """The modes are resolved: Philox's multiplies are on the path where parameters or
    8-bit state round stochastically, and nowhere else. A stochastic mode's kernel draws
    its params' bits once per vector of 4 elements (apply_vector, lanes.h's
    vector_bits: 10 multiplies per element), not once per element (40: the functor's own
    rounding_bits, which the generic kernels keep); where the script cannot tell that a
    vector is aligned (one of the counting kernels' two, ~24 per element) it counts the
    per-element fallback. The 8-bit state draws one call per 4 elements and span."""
    for r in records:
        for m in analysed(r):
            stochastic = m["mode"].startswith("stochastic")
            eight = "fp8 state" in m["mode"]
            if not (stochastic or eight):
                assert m["philox_per_element"] == 0, label(r, m)
            else:
                assert m["philox_per_element"] > 0, label(r, m)
            if stochastic and not eight:
                per_vector = r["fixed"] is not None
                philox = m["philox_per_element"]
                assert (9.5 <= philox < 30) if per_vector else philox >= 30, label(r, m)


def test_no_mode_gets_more_instructions_per_element_than_its_ceiling(records):
    """Every mode, on the kernel the engine launches for it (AdamOp's on the gradients
    autograd gives: other gradient dtypes take the generic kernel), within GATE_FRACTION of its
    H200 budget, or, for the modes that were over it in the build of 2026-11-27, within
    their ceiling then (CEILINGS)."""
    over = []
    for r in records:
        for m in r["modes"]:
            if m.get("uncommon_grads"):
                continue  # (gradients autograd does not give: the generic kernel, by design)
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


# AdamOp over bf16 params and grads, fp32 state (kCompList bf16), generic and as
# Fixed<AdamOp, LeanMode<AdamOp, false, false, false, true, false>, false> (stochastic
# rounding: AdamOp::Mode<false, false, false, true, false>), or with true its counting
# kernel
ADAM = ("_ZN9mixedprec4cuda16pointwise_kernelINS_6AdamOpEJN3c108BFloat16ES4_fffS4_lfS4_hhEEEv"
        "NS0_14TensorListMetaIXsZT0_EEET_PKfPf")
ADAM_FIXED = ("_ZN9mixedprec4cuda16pointwise_kernelINS_5FixedINS_6AdamOpENS_8LeanModeIS3_{}EELb{}"
              "EEEJN3c108BFloat16ES8_fffS8_lfS8_hhEEEvNS0_14TensorListMetaIXsZT0_EEET_PKfPf")


def adam_fixed(*flags, counting=False):
    return ADAM_FIXED.format("".join(f"Lb{int(f)}E" for f in flags), int(counting))


def test_a_fixed_mode_is_gated_on_its_fixed_kernel_and_refused_without_it():
    """A generic AdamOp kernel beside the Fixed kernel of one of its modes: that mode is
    analysed on the Fixed kernel (and on the generic one, not gated); the modes whose
    Fixed kernels are missing are refused, the precision report's whose counting
    kernels are, and so is a Fixed kernel of a mode the script does not understand (not
    ignored)."""
    head = "\tcode for sm_90\n"
    listing = head + loop_kernel(ADAM, 20) + loop_kernel(adam_fixed(0, 0, 0, 1, 0), 10)
    generic, fixed = spe.analyse(listing)
    assert (generic["op"], generic["fixed"]) == ("AdamOp", None)
    assert (fixed["op"], fixed["fixed"]) == ("AdamOp", "Mode<0,0,0,1,0>")
    assert fixed["kernel"] == "Fixed<AdamOp,Mode<0,0,0,1,0>>"
    assert generic["types"] == fixed["types"]
    (m,) = fixed["modes"]
    assert m["mode"] == "stochastic, fp32 state"
    assert m["per_element"] == pytest.approx(15 / 8)
    (shadow,) = generic["not_launched"]
    assert shadow["mode"] == "stochastic, fp32 state"
    assert shadow["runs_on"] == fixed["kernel"]
    assert shadow["per_element"] == pytest.approx(25 / 8)
    # none and kahan run on Fixed kernels that this listing lacks, and the precision
    # report's modes (a counted call) on their modes' counting kernels, lacking too
    assert [(g["mode"], g.get("missing_fixed")) for g in generic["modes"]] == [
        ("none, fp32 state", "Fixed<AdamOp,Mode<0,0,0,0,0>>"),
        ("kahan, fp32 state", "Fixed<AdamOp,Mode<0,1,0,0,0>>"),
        ("none, fp32 state, report", "Fixed<AdamOp,Mode<0,0,0,0,0>,true>"),
        ("kahan, fp32 state, report", "Fixed<AdamOp,Mode<0,1,0,0,0>,true>"),
        ("stochastic, fp32 state, report", "Fixed<AdamOp,Mode<0,0,0,1,0>,true>")]
    assert generic["modes"][2]["per_element"] == pytest.approx(25 / 8)
    found = spe.violations([generic, fixed])
    assert len(found) == 5 and all("which is not in the listing" in line for line in found)
    # with them, the gate passes; the summary has each mode once, on its Fixed kernel
    complete = listing + "".join(
        loop_kernel(adam_fixed(*flags, counting=counting), 10)
        for flags, counting in [((0, 0, 0, 0, 0), False), ((0, 1, 0, 0, 0), False),
                                ((0, 0, 0, 0, 0), True), ((0, 1, 0, 0, 0), True),
                                ((0, 0, 0, 1, 0), True)])
    records = spe.analyse(complete)
    assert spe.violations(records) == []
    assert records[0]["modes"] == [] and len(records[0]["not_launched"]) == 6
    counting = [r for r in records if (r["fixed"] or "").endswith(",true")]
    assert [r["kernel"] for r in counting] == [
        "Fixed<AdamOp,Mode<0,0,0,0,0>,true>", "Fixed<AdamOp,Mode<0,1,0,0,0>,true>",
        "Fixed<AdamOp,Mode<0,0,0,1,0>,true>"]
    assert [[m["mode"] for m in r["modes"]] for r in counting] == [
        ["none, fp32 state, report"], ["kahan, fp32 state, report"],
        ["stochastic, fp32 state, report"]]
    rows = spe.summary(records)
    assert sorted(row["mode"] for row in rows) == [
        "kahan, fp32 state", "kahan, fp32 state, report", "none, fp32 state",
        "none, fp32 state, report", "stochastic, fp32 state", "stochastic, fp32 state, report"]
    assert all(row["fixed"] == row["kernels"] == 1 for row in rows)
    assert "not launched: runs on Fixed<AdamOp,Mode<0,0,0,1,0>>" in spe.table(records)
    # a counting kernel of a mode that does not count (fp32 masters): refused
    masters = spe.analyse(complete + loop_kernel(adam_fixed(1, 0, 0, 0, 0, counting=True), 10))
    assert masters[-1].get("unknown_fixed")
    # a Fixed kernel of a mode with four flags: reported, not skipped
    odd = spe.analyse(complete + loop_kernel(adam_fixed(0, 0, 1, 0), 10))
    assert odd[-1].get("unrecognised")
    assert any(line.startswith("unrecognised pointwise_kernel: void mixedprec::cuda::"
                               "pointwise_kernel<mixedprec::Fixed<mixedprec::AdamOp")
               for line in spe.violations(odd))
