"""Instructions per element of the multi-tensor kernels' main loops, from their SASS,
against the instructions the copy bandwidth leaves time for (issue 30, part 3).

    python scripts/sass_per_element.py [SO] [--json OUT.json] [--arch sm_90]

runs ``cuobjdump -sass -arch sm_90`` on the extension (default: mixedprec/_C*.so; copy it
elsewhere first when a build may relink it), splits the listing per kernel, demangles
the names (c++filt) to know the op and its storage types, and for every
``pointwise_kernel`` (csrc/cuda/multi_tensor_apply.cuh: every optimizer and list op)
finds the main loop and counts its instructions per element.

**Which kernel runs.** A functor that declares ``FixedModes`` (AdamOp and SgdOp: their
``Mode<Model, Kahan, Remainder, Stochastic, Eight>``, an alias of csrc/pointwise.h's
``LeanMode<Op, ...>``) is also instantiated as ``pointwise_kernel<Fixed<Op,
LeanMode<Op, ...>>, ...>`` per mode and storage types (csrc/pointwise.h, Fixed: the
functor's fields, the mode's flags constant, the lists outside the mode neither loaded
nor stored), and the CUDA engine
launches that kernel whenever the step is in the mode (``in_fixed_mode``: the first of
the FixedModes whose ``fits`` takes the storage types, whose ``holds`` takes the flags,
and whose ``kLists`` are the lists present, per-tensor lists and ``kMaybe`` aside); the
generic kernel otherwise (amsgrad, maximize, other lists). Each mode below is counted
on the kernel the engine launches for it: ``fixed_modes`` reads the FixedModes from the
header, and ``launched_mode`` mirrors that choice (its rules encoded here, and checked
against the source's text, FIXED_SOURCE). The generic kernels are analysed in those
modes too (``not_launched``: for comparison, not gated on their ratio); a mode whose
Fixed kernel is missing from the listing, and a pointwise kernel whose name is not
understood, are gate failures (never skipped).

**The main loop.** The kernel's control-flow graph is built from its branches; a loop
is a back edge u -> h where h dominates u (a natural loop), so that out-of-line blocks
that jump back into the body (the warp-collective fallback of a shuffle's ``BRA.DIV``,
a slow path placed after the loop) are not taken for loops. The main loop is the
first, in code order, of the innermost loops that hold global loads or stores
(``LDG``/``STG``): ``apply_chunk``'s vector loop comes before its element-wise tail
loop, and ``apply_blocks`` (8-bit lists) has only the one.

**Elements per iteration, from csrc/cuda/multi_tensor_block.cuh** (read by
``engine_constants``, not assumed): a pass of ``apply_chunk``'s vector loop takes
``kUnroll`` vectors of ``kILP`` elements per thread (``kUnroll`` = MIXEDPREC_UNROLL, 2,
``kILP`` 4: 8 elements); a pass of ``apply_blocks`` takes ``kUnroll`` warp spans of
``kWarpSpan`` = 32 * ``kILP`` elements per warp, ``kILP`` consecutive ones per lane (a
quant block of ``kQuantBlock`` = 32 elements is ``kLanesPerBlock`` = 8 lanes, so a
span is 4 blocks): again ``kUnroll * kILP`` = 8 elements per thread. setup.py's nvcc
flags must not override MIXEDPREC_UNROLL (checked). The tail loop (elements past the
last whole vector of a slice) is not the main loop.

**What is counted.** ``static``: every instruction of the loop body, over the elements
of an iteration. A generic kernel's body holds every runtime mode of the kernel (kahan,
stochastic, amsgrad, maximize, the 8-bit lists' vector and byte paths, ...: flags and
pointers of the functor, not template arguments), so ``static`` overstates what one
mode executes; a Fixed kernel's holds one mode (and the 8-bit lists' two paths).
``path``: what one iteration issues in one mode. The kernel is run abstractly for
thread 0 of block 0 with that mode's kernel parameters: the functor's flags and
scalars at their offsets in the parameter space (the layout computed from the structs
of csrc/pointwise*.h and csrc/philox.h, and checked: the kernel must read its ``skip``
pointer where the layout puts it), aligned pointers for the lists the mode has and null
for the others, a long tensor, and step, inv_scale and a whole tensor's rounding words
(run 0) behind the pointers the functor reads. The integer, logic, predicate,
constant-bank and float/double compare instructions are evaluated (a register whose
bits are known one by one, as the compiler keeps predicates, is tracked bit by bit),
everything else is unknown. The main loop's first iteration is followed (so the loop
bounds and the element index are known); a branch so decided goes one way, a branch
on data (NaN and infinity checks, the slow paths of IEEE division and square root)
both ways, and ``path`` is the longest path from the loop header to its back edge. A
predicated-off instruction still takes its issue slot, so it counts. Local memory
(spills, at offsets of the stack pointer R1) keeps what is stored to it. ``BRA.DIV`` (a
shuffle reached by a diverged warp) is taken as not taken: the engine's warps are
converged there. The out-of-line subroutines the body calls (the slow paths of IEEE
division and square root, 64-bit division) are not counted; their call sites are.

Per element (``/ elements``): instructions, global memory instructions (LDG + STG; the
JSON has loads and stores apart), and Philox multiplies (``IMAD``, ``IMAD.WIDE``,
``IMAD.HI`` by Philox4x32's constants 0xD2511F53 and 0xCD9E8D57, csrc/philox.h).

**The budget.** Instructions the SMs can issue while the element's bytes move at the
copy bandwidth: SMs x 4 warp schedulers x 1 warp instruction per clock x boost clock x
32 threads, times bytes / bandwidth. The bytes of a mode come from the lists it reads
and writes (the functor's kReads/kWrites over the lists the mode has, at their storage
sizes; an 8-bit list's block scales at 1/32 byte per element), the unscaled-gradient
output and amsgrad off, one-element tensors left out. docs/gpu-validation.md,
"Instructions per element", has the figures used and the table.
"""

import argparse
import functools
import glob
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
ARCH = "sm_90"

# Issue rate: SMs x warp schedulers per SM x 1 warp instruction per clock x boost clock,
# x 32 threads (published figures: docs/gpu-validation.md, "Instructions per element").
# Copy bandwidth: device-to-device copies measured here (H200: 2026-11-27; H100:
# bench/README.md).
DEVICES = {
    "H200": dict(sms=132, schedulers=4, clock_hz=1.98e9, copy_bytes_per_s=4181e9),
    "H100": dict(sms=132, schedulers=4, clock_hz=1.98e9, copy_bytes_per_s=3022e9),
}
# The gate (tests/python/ops/test_sass_budget.py): a mode's main-loop path, per element,
# within this fraction of its H200 budget (issue slots to spare for latency hiding).
GATE_FRACTION = 0.5
PHILOX_CONSTANTS = (0xD2511F53, 0xCD9E8D57)
MASK32 = 0xFFFFFFFF


def thread_instructions_per_second(device: str) -> float:
    d = DEVICES[device]
    return d["sms"] * d["schedulers"] * d["clock_hz"] * 32


def budget(bytes_per_element: float, device: str = "H200") -> float:
    """Thread instructions the device can issue while one element's bytes move."""
    return thread_instructions_per_second(device) * bytes_per_element / DEVICES[device][
        "copy_bytes_per_s"]


# ---------------------------------------------------------------- the engine's source

@functools.lru_cache(maxsize=None)
def engine_constants(repo: Path = REPO) -> Dict[str, int]:
    """kILP, kUnroll, kWarpSize, kQuantBlock and the elements per main-loop iteration
    per thread, read from csrc/cuda/multi_tensor_block.cuh and csrc/lanes.h."""
    block = (repo / "csrc/cuda/multi_tensor_block.cuh").read_text()
    lanes = (repo / "csrc/lanes.h").read_text()

    def grab(pattern, text):
        found = re.search(pattern, text)
        if not found:
            raise ValueError(f"not in the source: {pattern}")
        return int(found.group(1))

    ilp = grab(r"constexpr int kILP = (\d+);", block)
    unroll = grab(r"#define MIXEDPREC_UNROLL (\d+)", block)
    warp = grab(r"constexpr int kWarpSize = (\d+);", block)
    quant = grab(r"constexpr int kQuantBlock = (\d+);", lanes)
    assert re.search(r"constexpr int kUnroll = MIXEDPREC_UNROLL;", block)
    assert re.search(r"constexpr int kWarpSpan = kWarpSize \* kILP;", block)
    setup = (repo / "setup.py").read_text()
    assert "MIXEDPREC_UNROLL" not in setup, "setup.py overrides the unroll: read it from there"
    return dict(ilp=ilp, unroll=unroll, warp=warp, quant_block=quant,
                lanes_per_block=quant // ilp, blocks_per_span=warp * ilp // quant,
                # apply_chunk: kUnroll vectors of kILP per pass; apply_blocks: kUnroll
                # spans per pass, kILP elements of each per lane
                pointwise_elements=unroll * ilp, blocked_elements=unroll * ilp)


@functools.lru_cache(maxsize=None)
def max_tensors_per_launch(depth: int, repo: Path = REPO) -> Tuple[int, int]:
    """(max tensors, max blocks) of a launch of `depth` lists, csrc/multi_tensor_plan.h."""
    text = (repo / "csrc/multi_tensor_plan.h").read_text()
    blocks = int(re.search(r"kMaxBlocksPerLaunch = (\d+);", text).group(1))
    found = re.search(r"const int fit = \((\d+) - kMaxBlocksPerLaunch \* (\d+)\) / "
                      r"\((\d+) \* \(depth \+ 1\)\);\s*return fit < (\d+) \? fit : \d+;", text)
    total, per_block, per_tensor, cap = map(int, found.groups())
    return min((total - blocks * per_block) // (per_tensor * (depth + 1)), cap), blocks


SIZES = {"double": 8, "float": 4, "bool": 1, "uint64_t": 8, "int64_t": 8, "uint32_t": 4,
         "int32_t": 4, "int": 4, "uint16_t": 2, "uint8_t": 1, "unsigned": 4, "pointer": 8}


def struct_bodies(text: str) -> Dict[str, str]:
    """{name: body} of the top-level structs of a header (brace matched)."""
    out = {}
    for found in re.finditer(r"^struct (\w+) \{", text, re.M):
        depth, i = 1, found.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out[found.group(1)] = text[found.end():i - 1]
    return out


def struct_layout(name: str, bodies: Dict[str, str], memo=None) -> Dict:
    """{'size', 'align', 'fields': {field: (offset, type)}} of a struct of data members
    (the C++ layout rules for these plain types), and its static constexpr ints."""
    memo = {} if memo is None else memo
    if name in memo:
        return memo[name]
    fields, constants, offset, align = {}, {}, 0, 1
    # the body's statements at its top level: comments dropped, every brace-enclosed
    # part (member functions, nested structs, initialisers) cut to a ';'
    text = re.sub(r"//[^\n]*", "", bodies[name])
    flat, depth = [], 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                flat.append(";")
        elif depth == 0:
            flat.append(ch)
    for statement in "".join(flat).split(";"):
        code = " ".join(statement.split()) + ";"
        constant = re.match(r"static constexpr (?:unsigned|int|bool) (\w+) = ([\w']+);", code)
        if constant:
            value = constant.group(2).replace("'", "")
            constants[constant.group(1)] = (value == "true" if value in ("true", "false")
                                            else int(value, 0))
            continue
        if code.startswith(("static", "template", "using", "MP_HD", "return", "public",
                            "private")) or "(" in code or code == ";":
            continue
        decl = re.match(r"((?:const )?[\w:]+\s*\*?)\s*(.*);$", code)
        if not decl:
            continue
        ctype = decl.group(1).replace("const", "").strip()
        names = [re.split(r"[\s={]", part.strip())[0] for part in decl.group(2).split(",")]
        if ctype.endswith("*"):
            size = falign = 8
        elif ctype in SIZES:
            size = falign = SIZES[ctype]
        elif ctype in bodies:
            inner = struct_layout(ctype, bodies, memo)
            size, falign = inner["size"], inner["align"]
        else:
            raise ValueError(f"{name}: unknown member type {ctype!r}")
        for field in names:
            offset = (offset + falign - 1) // falign * falign
            fields[field] = (offset, ctype)
            if ctype in bodies:
                for sub, (suboff, subtype) in struct_layout(ctype, bodies, memo)["fields"].items():
                    fields[f"{field}.{sub}"] = (offset + suboff, subtype)
            offset += size
            align = max(align, falign)
    size = max((offset + align - 1) // align * align, 1)  # (an empty struct: 1 byte)
    memo[name] = dict(size=size, align=align, fields=fields, constants=constants)
    return memo[name]


def functor_headers(repo: Path = REPO) -> List[Path]:
    """csrc/pointwise.h and the family headers beside it (pointwise_*.h)."""
    return sorted((repo / "csrc").glob("pointwise*.h"))


@functools.lru_cache(maxsize=None)
def functors(repo: Path = REPO) -> Dict[str, Dict]:
    """The layout and list masks of every functor of csrc/pointwise*.h."""
    bodies = struct_bodies((repo / "csrc/philox.h").read_text())
    for header in functor_headers(repo):
        bodies.update(struct_bodies(header.read_text()))
    memo: Dict = {}
    return {name: struct_layout(name, bodies, memo) for name in bodies
            if name.endswith("Op")}


class FixedMode(NamedTuple):
    """The template arguments of an Op::Mode (csrc/pointwise.h's LeanMode), in its order, and
    whether the kernel is the mode's counting one (Fixed<Op, Mode, true>: a counted call,
    the precision report, where Mode::counts; csrc/pointwise.h's in_counted_mode)."""
    model: bool
    kahan: bool
    remainder: bool
    stochastic: bool
    eight: bool
    counting: bool = False

    def label(self) -> str:
        return ("Mode<" + ",".join("1" if b else "0" for b in self[:5]) + ">"
                + (",true" if self.counting else ""))


# What a FixedMode means, encoded below (fixed_lists, fixed_fits, fixed_holds,
# launched_mode) as the source says it; fixed_modes checks that the source still says
# exactly this (whitespace and comments aside) and refuses it otherwise.
FIXED_SOURCE = {
    # csrc/pointwise.h, LeanMode (each Op::Mode), and the ten modes of LeanModes
    "pointwise.h#LeanMode": (
        "template <typename Op, bool Model, bool Kahan, bool Remainder, bool Stochastic, "
        "bool Eight> struct LeanMode {",
        "static constexpr unsigned kLists = Op::kStateLists | (Model ? 1u << Op::kModelList : 0u) "
        "| (Kahan || Remainder ? 1u << Op::kCompList : 0u) | (Eight ? Op::kEightLists : 0u); "
        "static constexpr unsigned kMaybe = 1u << Op::kUnscaledList;",
        "using Param = std::tuple_element_t<0, std::tuple<Ts...>>; "
        "using Grad = std::tuple_element_t<1, std::tuple<Ts...>>; "
        "using State = std::tuple_element_t<2, std::tuple<Ts...>>; "
        "using Copy = std::tuple_element_t<Op::kModelList, std::tuple<Ts...>>; "
        "using Comp = std::tuple_element_t<Op::kCompList, std::tuple<Ts...>>; "
        "return Model != std::is_same_v<Copy, float> && "
        "(Model ? std::is_same_v<Grad, Copy> || std::is_same_v<Grad, float> "
        ": std::is_same_v<Grad, Param>) && "
        "(!Model || std::is_same_v<Param, float>) && "
        "(!(Kahan || Stochastic) || std::is_same_v<Param, c10::BFloat16>) && "
        "(Remainder == std::is_same_v<Comp, int16_t>) && (Eight == std::is_same_v<State, E4m3>);",
        "return op.kahan == Kahan && op.remainder == Remainder && "
        "op.stochastic == Stochastic && op.state_stochastic == Eight && !op.maximize && "
        "Op::plain(op, Eight);",
        "template <typename... Ts> static constexpr bool counts() { "
        "using Param = std::tuple_element_t<0, std::tuple<Ts...>>; "
        "return !Model && !Remainder && std::is_same_v<Param, c10::BFloat16>; }",
        "using LeanModes = TypeList<Mode<false, false, false, false, false>, "
        "Mode<true, false, false, false, false>, Mode<false, true, false, false, false>, "
        "Mode<false, false, true, false, false>, Mode<false, false, false, true, false>, "
        "Mode<false, false, false, false, true>, Mode<true, false, false, false, true>, "
        "Mode<false, true, false, false, true>, Mode<false, false, true, false, true>, "
        "Mode<false, false, false, true, true>>;"),
    # the functors' own part of holds (Op::plain): AdamOp's 8-bit moments are roots,
    # and none of its modes has amsgrad; SgdOp has nothing more
    "pointwise_adam.h": (
        "MP_HD static bool plain(const AdamOp& op, bool eight) { return op.root == eight && "
        "!op.amsgrad; }",
        "using Mode = LeanMode<AdamOp, Model, Kahan, Remainder, Stochastic, Eight>; "
        "using FixedModes = LeanModes<Mode>;"),
    "pointwise_optimizers.h": (
        "MP_HD static bool plain(const SgdOp&, bool) { return true; }",
        "using Mode = LeanMode<SgdOp, Model, Kahan, Remainder, Stochastic, Eight>; "
        "using FixedModes = LeanModes<Mode>;"),
    # csrc/pointwise.h: Fixed's lists, and in_fixed_mode's choice (the first mode that
    # fits, holds, and has the lists present, per-tensor lists and kMaybe aside)
    "pointwise.h": (
        "static constexpr unsigned kReads = Op::kReads & "
        "(M::kLists | M::kMaybe | per_tensor_mask<Op>());",
        "static constexpr unsigned kPresent = M::kLists & ~per_tensor_mask<Op>();",
        "if constexpr (M::template fits<Ts...>()) { if (M::holds(op) && "
        "(lists & ~M::kMaybe) == Fixed<Op, M>::kPresent) {",
        "lists &= ~per_tensor_mask<Op>(); int bad = 0; "
        "return (try_mode<M, Ts...>(op, lists, f, bad) || ...) ? bad : f(op);"),
    # the lists present: those given not empty; launch_as: in_counted_mode's choice
    "cuda/multi_tensor_block.cuh": (
        "for (size_t k = 0; k < D; ++k) mask |= lists[k].empty() ? 0u : 1u << k;",
        "in_counted_mode<Ts...>(op, present_lists(lists), tallying<Op>(lists), launch);"),
    # in_counted_mode: a Fixed kernel in a fixed mode, and for a counted call the
    # mode's counting kernel where it counts, else the generic kernel
    "pointwise.h#in_counted_mode": (
        "if constexpr (IsFixed<Functor>::value) { using M = typename Functor::Mode; "
        "if (counted) { if constexpr (M::template counts<Ts...>()) "
        "return f(Fixed<Op, M, true>(op)); return f(op); } } return f(functor);",),
}
# csrc/cuda/multi_tensor_apply.cuh: the CUDA engine launches Fixed kernels...
CUDA_LAUNCHES_FIXED = ("launch_as<Ts...>(op, lists, launch);",
                       "pointwise_kernel<F, Ts...><<<")
# ... or (before 2026-11-28) the generic kernel only
CUDA_LAUNCHES_GENERIC = "pointwise_kernel<Op, Ts...><<<"


def source_text(path: Path) -> str:
    """A C++ file without its comments, whitespace runs made one space."""
    text = re.sub(r"//[^\n]*", "", path.read_text())
    return " ".join(text.split())


@functools.lru_cache(maxsize=None)
def fixed_modes(repo: Path = REPO) -> Dict[str, Dict]:
    """{functor: {'modes': its FixedModes in order, 'maybe': Mode::kMaybe}} for the
    functors the CUDA engine launches as Fixed<Op, Mode> in their fixed modes
    (csrc/pointwise.h, in_fixed_mode); {} when it launches the generic kernel only."""
    launch = source_text(repo / "csrc/cuda/multi_tensor_apply.cuh")
    if not all(text in launch for text in CUDA_LAUNCHES_FIXED):
        if CUDA_LAUNCHES_GENERIC in launch:
            return {}
        raise ValueError("csrc/cuda/multi_tensor_apply.cuh: neither the generic launch nor "
                         "in_fixed_mode's: update sass_per_element.CUDA_LAUNCHES_FIXED")
    for header, texts in FIXED_SOURCE.items():
        code = source_text(repo / "csrc" / header.split("#")[0])
        for text in texts:
            if text not in code:
                raise ValueError(f"csrc/{header} no longer has {text!r}: update "
                                 "sass_per_element's fixed modes (FIXED_SOURCE)")
    lean = re.search(r"using LeanModes\s*=\s*TypeList<(.*?)>;",
                     (repo / "csrc/pointwise.h").read_text(), re.S)
    modes = [FixedMode(*(v.strip() == "true" for v in args.split(",")))
             for args in re.findall(r"Mode<([\w, ]+)>", lean.group(1))]
    known = {"AdamOp", "SgdOp"}  # the functors FIXED_SOURCE checks
    out = {}
    layouts = functors(repo)
    for header in functor_headers(repo):
        for name, body in struct_bodies(header.read_text()).items():
            found = re.search(r"using FixedModes\s*=\s*(.*?);", body, re.S)
            if not found:
                continue
            if name not in known or found.group(1).strip() != "LeanModes<Mode>":
                raise ValueError(f"{name} declares FixedModes {found.group(1)!r}: only "
                                 f"LeanModes<Mode> of {sorted(known)} is known to "
                                 "sass_per_element (FIXED_SOURCE)")
            c = layouts[name]["constants"]
            if len(modes) != 10 or not all(k in c for k in ("kStateLists", "kEightLists",
                                                              "kUnscaledList")):
                raise ValueError(f"{name}: its FixedModes or their lists not understood")
            out[name] = dict(modes=modes, maybe=1 << c["kUnscaledList"])
    return out


def fixed_lists(m: FixedMode, c: Dict) -> int:
    """Mode::kLists: params, grads and the state (kStateLists), the model copy with Model,
    the comps with Kahan or Remainder, the block scales with Eight (kEightLists)."""
    return (c["kStateLists"] | (1 << c["kModelList"] if m.model else 0)
            | (1 << c["kCompList"] if m.kahan or m.remainder else 0)
            | (c["kEightLists"] if m.eight else 0))


def autograd_grads(types: List[str], model: bool, c: Dict) -> bool:
    """Whether the gradients are as autograd gives them: of the params' dtype, or with
    fp32 masters (`model`: the model copy given) of the model copy's dtype or fp32
    (master gradients). The fixed modes take only those (Mode::fits); fp32 gradients
    of narrower params run on the generic kernel, by design (`uncommon_grads`), and
    other dtypes are widened to fp32 before any kernel (dispatch.h's kStoredGrad)."""
    grad = types[1]
    return grad in (types[c["kModelList"]], "float") if model else grad == types[0]


def fixed_fits(m: FixedMode, types: List[str], c: Dict) -> bool:
    """Mode::fits<Ts...>(), on the demangled storage types (int16_t is short)."""
    param, state, comp = types[0], types[2], types[c["kCompList"]]
    return (autograd_grads(types, m.model, c) and m.model == (types[c["kModelList"]] != "float")
            and (not m.model or param == "float")
            and (not (m.kahan or m.stochastic) or param == "BFloat16")
            and m.remainder == (comp == "short") and m.eight == (state == "E4m3"))


def fixed_counts(m: FixedMode, types: List[str]) -> bool:
    """Mode::counts<Ts...>(): whether a counted call in mode m runs its counting kernel."""
    return not m.model and not m.remainder and types[0] == "BFloat16"


def fixed_holds(m: FixedMode, op: str, flags: Dict) -> bool:
    """Mode::holds(op), on the functor fields a mode sets (the others false); AdamOp's
    plain: its 8-bit moments are roots, and no mode has amsgrad."""
    def on(name):
        return bool(flags.get(name, False))
    plain = op != "AdamOp" or (on("root") == m.eight and not on("amsgrad"))
    return (on("kahan") == m.kahan and on("remainder") == m.remainder
            and on("stochastic") == m.stochastic and on("state_stochastic") == m.eight
            and not on("maximize") and plain)


def launched_mode(op: str, types: List[str], mode: Dict, layout: Dict,
                  fixed: Dict[str, Dict]) -> Optional[FixedMode]:
    """The fixed mode whose kernel the CUDA engine launches for `mode` on storage
    `types` (in_fixed_mode: the first of Op::FixedModes that fits the types, holds the
    flags and has exactly the lists present, per-tensor lists and kMaybe aside); for a
    counted call (the tally list given) that mode's counting kernel where it counts,
    else None; None when it launches the generic kernel (launch_as)."""
    spec = fixed.get(op)
    c = layout["constants"]
    if spec is None:
        return None
    counted = c.get("kTallyList") in mode["lists"]
    per_tensor = c.get("kPerTensor", 0)
    present = sum(1 << k for k in mode["lists"]) & ~per_tensor
    for m in spec["modes"]:
        if (fixed_fits(m, types, c) and fixed_holds(m, op, mode["flags"])
                and present & ~spec["maybe"] == fixed_lists(m, c) & ~per_tensor):
            if not counted:
                return m
            return m._replace(counting=True) if fixed_counts(m, types) else None
    return None


# ------------------------------------------------------------------- the disassembly

def find_cuobjdump() -> Optional[str]:
    """cuobjdump from PATH, CUDA_HOME, /usr/local/cuda, or the copy the triton wheel
    ships (NVIDIA's binary utilities, found without importing triton)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin",
                               "cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    try:
        import importlib.util
        spec = importlib.util.find_spec("triton")
        for root in (spec.submodule_search_locations or []) if spec else []:
            candidates.append(os.path.join(root, "backends", "nvidia", "bin", "cuobjdump"))
    except (ImportError, ValueError):
        pass
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def disassemble(so_path: str, arch: str = ARCH, tool: Optional[str] = None) -> str:
    """The cuobjdump -sass listing of `arch` in so_path ("" when it has no device code)."""
    tool = tool or find_cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump not found")
    proc = subprocess.run([tool, "-sass", "-arch", arch, so_path], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        if "does not contain device code" in proc.stdout + proc.stderr:
            return ""  # a build without CUDA kernels
        raise RuntimeError(f"cuobjdump failed: {proc.stderr[-2000:]}")
    return proc.stdout


FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$", re.M)
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;", re.M)


def split_functions(listing: str) -> List[Tuple[str, List[Tuple[int, str]]]]:
    """[(mangled name, [(address, instruction text)])] in listing order."""
    heads = list(FUNCTION.finditer(listing))
    out = []
    for head, nxt in zip(heads, heads[1:] + [None]):
        end = nxt.start() if nxt else len(listing)
        body = [(int(a, 16), t) for a, t in INSTRUCTION.findall(listing, head.end(), end)]
        out.append((head.group(1), body))
    return out


def demangle(names: List[str]) -> List[str]:
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not names:
        return names
    proc = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    return lines if proc.returncode == 0 and len(lines) == len(names) else names


# pointwise_kernel<mixedprec::AdamOp, c10::BFloat16, ...>, or, for a functor in one of
# its FixedModes, pointwise_kernel<mixedprec::Fixed<mixedprec::AdamOp,
# mixedprec::LeanMode<mixedprec::AdamOp, false, false, false, true, true>, false>,
# c10::BFloat16, ...> (true: the mode's counting kernel)
KERNEL = re.compile(r"pointwise_kernel<mixedprec::(?:Fixed<mixedprec::(?P<fixed>\w+), "
                    r"mixedprec::LeanMode<mixedprec::(?P=fixed), (?P<mode>[\w, ]+)>"
                    r"(?:, (?P<counting>true|false))?\s*>|(?P<op>\w+)), "
                    r"(?P<types>.*)>\(mixedprec::cuda::TensorListMeta")


def kernel_signature(demangled: str) -> Optional[Tuple[str, List[str], Optional[Tuple]]]:
    """(functor, storage types, fixed mode) of a pointwise_kernel: the mode's template
    arguments (a tuple of bools, FixedMode) for a Fixed<Op, Op::Mode<...>> kernel, None
    for the generic one; None for other kernels."""
    found = KERNEL.search(demangled)
    if not found:
        return None
    types = [t.strip().replace("c10::", "").replace("mixedprec::", "")
             for t in found.group("types").split(",")]
    if found.group("fixed") is None:
        return found.group("op"), types, None
    flags = [v.strip() for v in found.group("mode").split(",")]
    if len(flags) != len(FixedMode._fields) - 1 or not all(v in ("true", "false") for v in flags):
        return None  # not a mode this script knows: analyse() reports it (unrecognised)
    return found.group("fixed"), types, FixedMode(*(v == "true" for v in flags),
                                                  counting=found.group("counting") == "true")


STORAGE_BYTES = {"float": 4, "BFloat16": 2, "Half": 2, "E4m3": 1, "short": 2, "long": 8,
                 "unsigned char": 1}

# ------------------------------------------------------------------ instructions, CFG


class Ins:
    __slots__ = ("addr", "text", "guard", "op", "mods", "args", "base")

    def __init__(self, addr: int, text: str):
        self.addr, self.text = addr, text
        rest = text
        self.guard = None
        if text.startswith("@"):
            self.guard, rest = text[1:].split(None, 1)
        parts = rest.split(None, 1)
        self.op = parts[0]
        self.mods = self.op.split(".")
        self.base = self.mods.pop(0)
        self.args = parts[1].split(", ") if len(parts) > 1 else []

    def target(self) -> Optional[int]:
        if self.base in ("BRA", "CALL") and self.args:
            return int(self.args[-1], 16)
        return None


def is_memory(ins: Ins) -> bool:
    return ins.base in ("LDG", "STG")


class Cfg:
    """Basic blocks of a kernel reachable from its entry (CALLs return: subroutines,
    reached by CALL only, are not part of it), dominators and natural loops."""

    def __init__(self, body: List[Tuple[int, str]]):
        self.ins = [Ins(a, t) for a, t in body]
        self.index = {i.addr: n for n, i in enumerate(self.ins)}
        leaders = {0}
        for n, i in enumerate(self.ins):
            if i.base in ("BRA", "EXIT", "RET", "BRX", "JMP"):
                if i.target() is not None and i.target() in self.index:
                    leaders.add(self.index[i.target()])
                if n + 1 < len(self.ins):
                    leaders.add(n + 1)
        starts = sorted(leaders)
        self.blocks = {}  # first instruction index -> (start, end exclusive)
        for s, e in zip(starts, starts[1:] + [len(self.ins)]):
            self.blocks[s] = (s, e)
        self.succ: Dict[int, List[int]] = {}
        for s, (_, e) in self.blocks.items():
            last = self.ins[e - 1]
            out = []
            unconditional = last.guard is None and not any(
                re.fullmatch(r"!?U?P\w+", a) for a in last.args[:-1])
            if last.base == "BRA":
                tgt = self.index.get(last.target())
                if tgt is not None:
                    out.append(tgt)
                if (not unconditional or "DIV" in last.mods) and e < len(self.ins):
                    out.append(e)
            elif last.base in ("EXIT", "RET"):
                if last.guard is not None and e < len(self.ins):
                    out.append(e)
            elif e < len(self.ins):
                out.append(e)
            self.succ[s] = out
        # reachable blocks, reverse post-order
        self.rpo = topological(self.succ, 0)
        self.reachable = set(self.rpo)
        self.pred: Dict[int, List[int]] = {b: [] for b in self.reachable}
        for b in self.reachable:
            for s in self.succ[b]:
                self.pred[s].append(b)
        self._dominators()

    def _dominators(self):
        pos = {b: n for n, b in enumerate(self.rpo)}
        idom = {self.rpo[0]: self.rpo[0]}
        changed = True
        while changed:
            changed = False
            for b in self.rpo[1:]:
                preds = [p for p in self.pred[b] if p in idom]
                new = preds[0]
                for p in preds[1:]:
                    a, c = p, new
                    while a != c:
                        while pos[a] > pos[c]:
                            a = idom[a]
                        while pos[c] > pos[a]:
                            c = idom[c]
                    new = a
                if idom.get(b) != new:
                    idom[b] = new
                    changed = True
        self.idom = idom

    def dominates(self, a: int, b: int) -> bool:
        while True:
            if a == b:
                return True
            if self.idom[b] == b:
                return False
            b = self.idom[b]

    def loops(self) -> List[Dict]:
        """Natural loops: {'header', 'latches', 'body' (block set)}, merged per header."""
        found: Dict[int, Dict] = {}
        for u in self.reachable:
            for h in self.succ[u]:
                if self.dominates(h, u):
                    loop = found.setdefault(h, dict(header=h, latches=set(), body={h}))
                    loop["latches"].add(u)
                    stack = [u]
                    while stack:
                        n = stack.pop()
                        if n not in loop["body"]:
                            loop["body"].add(n)
                            stack.extend(self.pred[n])
        return sorted(found.values(), key=lambda lp: lp["header"])

    def block_ins(self, b: int) -> List[Ins]:
        s, e = self.blocks[b]
        return self.ins[s:e]

    def main_loop(self) -> Optional[Dict]:
        """The first, in code order, of the innermost loops with global memory access (a
        loop nested in it that touches no global memory, such as a rolled-up loop of
        arithmetic, does not make it an outer loop: its count is kept, `inner_loops`)."""
        inner = self.memory_loops()
        return inner[0] if inner else None

    def memory_loops(self) -> List[Dict]:
        """The innermost loops with global memory access, in code order (main_loop)."""
        loops = self.loops()

        def touches_memory(lp):
            return any(is_memory(i) for b in lp["body"] for i in self.block_ins(b))

        memory = [lp for lp in loops if touches_memory(lp)]
        for lp in memory:
            lp["inner_loops"] = sum(1 for o in loops
                                    if o is not lp and o["header"] in lp["body"])
        return [lp for lp in memory
                if not any(o is not lp and o["header"] in lp["body"] for o in memory)]


# ------------------------------------------------------------- abstract interpretation

def f32_bits(x: float) -> int:
    try:
        return struct.unpack("<I", struct.pack("<f", x))[0]
    except OverflowError:
        return 0x7F800000 if x > 0 else 0xFF800000


def bits_f32(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u & MASK32))[0]


def f64_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def bits_f64(u: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", u & 0xFFFFFFFFFFFFFFFF))[0]


LOCAL_ADDRESS = re.compile(r"\[R1(?:\+(0x[0-9a-f]+))?\]$")
REG = re.compile(r"^(?P<pre>[-~!]?)(?P<abs>\|?)(?P<name>U?R\d+|U?RZ|U?P\d|U?PT|SRZ|PR|UPR)"
                 r"(?P<suf>(?:\.[\w]+)*)\|?$")
CONST = re.compile(r"^(?P<pre>-?)(?P<abs>\|?)c\[0x0\]\["
                   r"(?:(?P<reg>U?R\d+|U?RZ)\+?)?(?P<off>0x[0-9a-f]+)?\]")


class State(dict):
    """Register (and predicate) values known on entry to a block."""


class Bits:
    """A register of which only some bits are known (the compiler keeps predicates as
    bits of a register: set and cleared one by one, tested one by one)."""
    __slots__ = ("value", "known")

    def __init__(self, value: int, known: int):
        self.value, self.known = value & known, known

    def __eq__(self, other):
        return isinstance(other, Bits) and (self.value, self.known) == (other.value,
                                                                        other.known)

    def __hash__(self):
        return hash((self.value, self.known))


def make(value: int, known: int):
    """value with `known` bits known: an int, Bits, or None."""
    known &= MASK32
    if known == MASK32:
        return value & MASK32
    return Bits(value, known) if known else None


def meet(a, b):
    """What two paths' values of a register agree on (None: nothing)."""
    if a is None or b is None:
        return None
    if type(a) is type(b) and a == b:
        return a
    if isinstance(a, bool) or isinstance(b, bool):
        return None
    va, ka = (a.value, a.known) if isinstance(a, Bits) else (a, MASK32)
    vb, kb = (b.value, b.known) if isinstance(b, Bits) else (b, MASK32)
    return make(va, ka & kb & ~(va ^ vb))


def lut(table: int, a: int, b: int, c: int, width: int = 32) -> int:
    m = (1 << width) - 1
    out = 0
    for i in range(8):
        if table >> i & 1:
            out |= ((a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)) & m
    return out


def lop3_bits(table: int, inputs: List[Tuple[int, int]]) -> Tuple[int, int]:
    """LOP3 of three partly known operands: (result, known mask); a result bit is known
    when every value of the unknown input bits gives the same."""
    results = []
    for choice in range(8):
        vals = [(x | (~k & MASK32)) if choice >> j & 1 else x & k
                for j, (x, k) in enumerate(inputs)]
        results.append(lut(table, *vals))
    known = MASK32
    for r in results[1:]:
        known &= ~(r ^ results[0])
    return results[0] & known, known


class Machine:
    """Evaluates a kernel's integer/predicate/constant code for one thread with concrete
    kernel parameters; what it cannot evaluate is unknown (None)."""

    def __init__(self, params: bytes, memory: Dict[int, bytes], specials: Dict[str, int]):
        self.params, self.memory, self.specials = params, memory, specials

    # -- operand reading
    def reg(self, st: State, name: str) -> Optional[int]:
        if name in ("RZ", "URZ", "SRZ"):
            return 0
        if name in ("PT", "UPT"):
            return True
        v = st.get(name)
        return None if isinstance(v, Bits) else v

    def known_bits(self, st: State, text: str) -> Tuple[int, int]:
        """(value, known mask) of a 32-bit operand; (0, 0) when nothing is known."""
        inv = text.startswith("~")
        core = text.lstrip("~").split(".reuse")[0]
        v = st.get(core) if re.fullmatch(r"U?R\d+", core) else None
        if isinstance(v, Bits):
            value, known = v.value, v.known
        else:
            x = self.value(st, core)
            if x is None:
                return 0, 0
            value, known = x, MASK32
        if inv:
            value = ~value & known
        return value, known

    def pair(self, st: State, name: str) -> Optional[int]:
        if name in ("RZ", "URZ", "SRZ"):
            return 0
        lo, hi = self.reg(st, name), self.reg(st, next_reg(name))
        return None if lo is None or hi is None else lo | hi << 32

    def pred(self, st: State, text: str) -> Optional[bool]:
        neg = text.startswith("!")
        v = self.reg(st, text.lstrip("!"))
        return None if v is None else (not v if neg else bool(v))

    def const(self, st: State, text: str, width: int) -> Optional[int]:
        m = CONST.match(text)
        if not m:
            return None
        off = int(m.group("off"), 16) if m.group("off") else 0
        if m.group("reg"):
            r = self.reg(st, m.group("reg"))
            if r is None:
                return None
            off += r
        if off < 0x210 and width <= 4 and off in self.specials:
            return self.specials[off]
        if off < 0x210 or off + width > len(self.params):
            return None
        return int.from_bytes(self.params[off:off + width], "little")

    def value(self, st: State, text: str, width: int = 4, fp: bool = False) -> Optional[int]:
        """An operand's 32-bit value (width 8: a register pair or a 64-bit constant);
        negation, inversion and absolute value applied (fp: as a float's bits)."""
        kind, core, pair, odd, neg, inv, absval = operand(text)
        if kind == "c":
            v = self.const(st, core, width)
        elif kind == "r":
            if pair or width == 8:
                v = self.pair(st, core)
            else:
                v = self.reg(st, core)
                if v is True:
                    v = 1
            if v is not None and odd:
                return None
        else:
            v = immediate(core, fp, width)
        if v is None:
            return None
        mask = (1 << (8 * width)) - 1
        if fp:
            sign = 1 << (8 * width - 1)
            if absval:
                v &= ~sign & mask
            if neg:
                v ^= sign
            return v
        if inv:
            v = ~v & mask
        if neg:
            v = -v & mask
        return v

    # -- state writes
    @staticmethod
    def put(out: Dict, name: str, v: Optional[int], width: int = 4):
        if name in ("RZ", "URZ", "PT", "UPT"):
            return
        if width == 8:
            out[name] = None if v is None else v & MASK32
            out[next_reg(name)] = None if v is None else v >> 32 & MASK32
        else:
            out[name] = v

    def step(self, st: State, ins: Ins) -> None:
        """Applies ins to st (a guard that is unknown merges the results with the old
        values: a value both agree on stays known)."""
        g = True
        if ins.guard:
            g = self.pred(st, ins.guard)
            if g is False:
                return
        out: Dict[str, Optional[int]] = {}
        try:
            self.execute(st, ins, out)
        except (ValueError, IndexError, KeyError, ZeroDivisionError, TypeError,
                struct.error):
            for name in self.dests(ins):
                out[name] = None
        for name, v in out.items():
            if g is None:
                v = meet(st.get(name), v)
            if v is None:
                st.pop(name, None)
            else:
                st[name] = v

    @staticmethod
    def dests(ins: Ins) -> List[str]:
        """Registers an instruction may write (for the unknown case)."""
        out = []
        nargs = {"STG": 0, "STS": 0, "STL": 0, "BRA": 0, "BSSY": 0, "BSYNC": 0, "EXIT": 0,
                 "CALL": 0, "RET": 0, "NOP": 0, "WARPSYNC": 0, "BAR": 0, "RED": 0, "BREAK": 0,
                 "FCHK": 1, "ENDCOLLECTIVE": 0, "YIELD": 0, "BPT": 0}
        n = nargs.get(ins.base, None)
        args = ins.args
        if ins.base in ("ISETP", "FSETP", "DSETP", "UISETP", "PLOP3", "UPLOP3"):
            n = 2
        elif ins.base in ("IADD3", "UIADD3", "LEA", "ULEA"):
            n = 1 + sum(1 for a in args[1:3] if re.fullmatch(r"U?P\d|U?PT", a))
        elif ins.base in ("LOP3", "ULOP3") and args and re.fullmatch(r"U?P\d|U?PT", args[0]):
            n = 2
        elif ins.base == "R2P":
            return [f"P{i}" for i in range(7)]
        elif n is None:
            n = 1
        wide = any(m in ("64", "128", "WIDE") for m in ins.mods) or ins.base in (
            "DADD", "DMUL", "DFMA", "CS2R") or ins.op.startswith((
                "F2F.F64", "F2I.U64", "F2I.S64", "FRND.F64", "F2I.F64"))
        for a in args[:n]:
            name = a.split(".")[0].lstrip("!")
            out.append(name)
            if wide and re.fullmatch(r"U?R\d+", name):
                k = 4 if "128" in ins.mods else 2
                nm = name
                for _ in range(k - 1):
                    nm = next_reg(nm)
                    out.append(nm)
        return out

    def execute(self, st: State, ins: Ins, out: Dict) -> None:
        b, a, mods = ins.base, ins.args, ins.mods
        v = self.value
        if b in ("MOV", "UMOV", "R2UR", "MOV32I"):
            self.put(out, a[0], v(st, a[1]))
        elif b in ("S2R", "S2UR"):
            self.put(out, a[0], self.specials.get(a[1]))
        elif b == "CS2R":
            self.put(out, a[0], 0 if a[1] == "SRZ" else None, 8)
        elif b in ("LDC", "ULDC"):
            width = 8 if "64" in mods else 2 if ("U16" in mods or "S16" in mods) else \
                1 if ("U8" in mods or "S8" in mods) else 4
            x = self.const(st, a[1], width)
            if x is not None and ("S8" in mods or "S16" in mods):
                sign = 1 << (8 * width - 1)
                x = (x ^ sign) - sign & MASK32
            self.put(out, a[0], x, 8 if width == 8 else 4)
        elif b == "LDG":
            width = {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}
            w = next((width[m] for m in mods if m in width), 4)
            addr = self.address(st, a[1])
            data = None if addr is None else self.read(addr, w)
            names = [a[0]]
            for _ in range(max(w // 4, 1) - 1):
                names.append(next_reg(names[-1]))
            for k, name in enumerate(names):
                self.put(out, name, None if data is None else
                         int.from_bytes(data[4 * k:4 * k + min(w, 4)], "little"))
        elif b in ("IMAD", "UIMAD"):
            self.imad(st, ins, out)
        elif b in ("IADD3", "UIADD3"):
            self.iadd3(st, ins, out)
        elif b == "VIADD":
            x, y = v(st, a[1]), v(st, a[2])
            self.put(out, a[0], None if x is None or y is None else (x + y) & MASK32)
        elif b in ("LEA", "ULEA"):
            self.lea(st, ins, out)
        elif b in ("LOP3", "ULOP3"):
            pdest = re.fullmatch(r"U?P\d|U?PT", a[0]) is not None
            srcs = a[2:5] if pdest else a[1:4]
            table = int((a[5] if pdest else a[4]), 16)
            r, known = lop3_bits(table, [self.known_bits(st, t) for t in srcs])
            self.put(out, a[1] if pdest else a[0], make(r, known))
            if pdest:
                tail = self.pred(st, a[6]) if len(a) > 6 else False
                if r & known:
                    nonzero = True
                elif known == MASK32:
                    nonzero = False
                else:
                    nonzero = None
                if tail is True or nonzero is True:
                    self.put(out, a[0], True)
                else:
                    self.put(out, a[0], None if None in (tail, nonzero) else False)
        elif b in ("PLOP3", "UPLOP3"):
            x, y, z = (self.pred(st, t) for t in a[2:5])
            if None in (x, y, z):
                self.put(out, a[0], None)
                self.put(out, a[1], None)
            else:
                self.put(out, a[0], bool(lut(int(a[5], 16), -x, -y, -z) & 1))
                self.put(out, a[1], bool(lut(int(a[6], 16), -x, -y, -z) & 1))
        elif b in ("ISETP", "UISETP"):
            self.isetp(st, ins, out)
        elif b in ("FSETP", "DSETP"):
            self.fsetp(st, ins, out)
        elif b in ("SEL", "USEL", "FSEL"):
            p = self.pred(st, a[3])
            x, y = v(st, a[1]), v(st, a[2])
            self.put(out, a[0], None if p is None else (x if p else y))
        elif b in ("SHF", "USHF"):
            self.shf(st, ins, out)
        elif b in ("PRMT", "UPRMT"):
            x, sel, y = v(st, a[1]), v(st, a[2]), v(st, a[3])
            if None in (x, sel, y) or len(mods):
                self.put(out, a[0], None)
            else:
                word = x | y << 32
                r = 0
                for k in range(4):
                    nib = sel >> (4 * k) & 0xF
                    byte = word >> (8 * (nib & 7)) & 0xFF
                    if nib & 8:
                        byte = 0xFF if byte & 0x80 else 0
                    r |= byte << (8 * k)
                self.put(out, a[0], r)
        elif b == "P2R":
            x, kx = self.known_bits(st, a[2])
            mask = v(st, a[3])
            value, known = x & ~mask, kx & ~mask
            for i in range(7):
                if mask >> i & 1:
                    p = self.reg(st, f"P{i}")
                    if p is not None:
                        known |= 1 << i
                        value |= int(bool(p)) << i
            self.put(out, a[0], make(value, known))
        elif b == "R2P":
            x, kx = self.known_bits(st, a[1])
            mask = v(st, a[2])
            for i in range(7):
                if mask is None or mask >> i & 1:
                    known = mask is not None and kx >> i & 1
                    self.put(out, f"P{i}", bool(x >> i & 1) if known else None)
        elif b == "F2F" and mods[:2] == ["F32", "F64"]:
            x = v(st, a[1], 8)
            self.put(out, a[0], None if x is None else f32_bits(bits_f64(x)))
        elif b == "F2F" and mods[:2] == ["F64", "F32"]:
            x = v(st, a[1])
            self.put(out, a[0], None if x is None else f64_bits(bits_f32(x)), 8)
        elif b in ("DADD", "DMUL") and not mods:
            x, y = v(st, a[1], 8, True), v(st, a[2], 8, True)
            if x is None or y is None:
                self.put(out, a[0], None, 8)
            else:
                fx, fy = bits_f64(x), bits_f64(y)
                self.put(out, a[0], f64_bits(fx + fy if b == "DADD" else fx * fy), 8)
        elif b in ("FADD", "FMUL") and not mods:
            x, y = v(st, a[1], 4, True), v(st, a[2], 4, True)
            if x is None or y is None:
                self.put(out, a[0], None)
            else:
                fx, fy = bits_f32(x), bits_f32(y)
                self.put(out, a[0], f32_bits(fx + fy if b == "FADD" else fx * fy))
        elif b in ("STL", "LDL"):
            self.local(st, ins, out)
        else:
            for name in self.dests(ins):
                out[name] = None

    def local(self, st: State, ins: Ins, out: Dict) -> None:
        """Local memory (the stack: a kernel's spills), kept in the state as words named
        by their offset from the stack pointer R1 (the ABI's, set once on entry); a
        store elsewhere or of part of a word forgets all of it, such a load is unknown."""
        load = ins.base == "LDL"
        width = {"64": 8, "128": 16}
        w = next((width[m] for m in ins.mods if m in width), 4)
        found = LOCAL_ADDRESS.match(ins.args[1] if load else ins.args[0])
        if any(m in ins.mods for m in ("U8", "S8", "U16", "S16")):
            found = None
        names = [ins.args[0] if load else ins.args[1]]
        for _ in range(w // 4 - 1):
            names.append(next_reg(names[-1]))
        base = int(found.group(1) or "0", 16) if found else 0
        slots = [f"local+{base + 4 * k:#x}" for k in range(len(names))]
        if load:
            for name, slot in zip(names, slots):
                self.put(out, name, st.get(slot) if found else None)
        elif found:
            for name, slot in zip(names, slots):
                out[slot] = 0 if name == "RZ" else st.get(name)
        else:
            for key in st:
                if key.startswith("local+"):
                    out[key] = None

    def address(self, st: State, text: str) -> Optional[int]:
        m = re.match(r"desc\[\w+\]\[(U?R\d+)(?:\.64)?(?:\+(0x[0-9a-f]+))?\]$", text)
        if not m:
            return None
        base = self.pair(st, m.group(1))
        return None if base is None else base + int(m.group(2) or "0", 16)

    def read(self, addr: int, width: int) -> Optional[bytes]:
        for start, data in self.memory.items():
            if start <= addr and addr + width <= start + len(data):
                return data[addr - start:addr - start + width]
        return None

    def imad(self, st, ins, out):
        a, mods, v = ins.args, ins.mods, self.value
        wide = "WIDE" in mods
        if "HI" in mods:
            self.put(out, a[0], None)
            return
        if "X" in mods:
            x, y, z = v(st, a[1]), v(st, a[2]), v(st, a[3])
            c = self.pred(st, a[4]) if len(a) > 4 else False
            self.put(out, a[0], None if None in (x, y, z, c) else (x * y + z + int(c)) & MASK32)
            return
        if "MOV" in mods and len(a) == 4:
            z = v(st, a[3])
            self.put(out, a[0], z)
            return
        signed = wide and "U32" not in mods
        x, y = v(st, a[1]), v(st, a[2])
        z = v(st, a[3], 8 if wide else 4)
        if None in (x, y, z):
            self.put(out, a[0], None, 8 if wide else 4)
            return
        if signed:
            x = x - (1 << 32) if x >> 31 else x
            y = y - (1 << 32) if y >> 31 else y
        r = x * y + z
        if wide:
            self.put(out, a[0], r & 0xFFFFFFFFFFFFFFFF, 8)
        else:
            self.put(out, a[0], r & MASK32)

    def iadd3(self, st, ins, out):
        a, v = ins.args, self.value
        dst = a[0]
        rest = a[1:]
        carries_out = []
        while rest and re.fullmatch(r"U?P\d|U?PT", rest[0]):
            carries_out.append(rest.pop(0))
        operands, carries_in = rest[:3], rest[3:]
        total = 0
        for t in operands:
            if t.startswith("-"):
                x = v(st, t[1:])
                if x is None:
                    total = None
                    break
                total += (~x & MASK32) + 1
            else:
                x = v(st, t)
                if x is None:
                    total = None
                    break
                total += x
        if total is not None and "X" in ins.mods:
            for c in carries_in:
                p = self.pred(st, c)
                if p is None:
                    total = None
                    break
                total += int(p)
        self.put(out, dst, None if total is None else total & MASK32)
        carry = None if total is None else total >> 32
        for k, name in enumerate(carries_out):
            self.put(out, name, None if carry is None else carry > k)

    def lea(self, st, ins, out):
        a, mods, v = ins.args, ins.mods, self.value
        dst, rest = a[0], a[1:]
        carry_out = None
        if rest and re.fullmatch(r"U?P\d|U?PT", rest[0]):
            carry_out = rest.pop(0)
        if "HI" in mods:
            lo, add = v(st, rest[0]), v(st, rest[1])
            if "SX32" in mods:
                hi = None if lo is None else (MASK32 if lo >> 31 else 0)
                shift = v(st, rest[2])
                cin = rest[3] if len(rest) > 3 else None
            else:
                hi, shift = v(st, rest[2]), v(st, rest[3])
                cin = rest[4] if len(rest) > 4 else None
            c = self.pred(st, cin) if ("X" in mods and cin) else False
            if None in (lo, add, hi, shift, c):
                self.put(out, dst, None)
            else:
                self.put(out, dst, (add + ((lo | hi << 32) << shift >> 32) + int(c)) & MASK32)
        else:
            x, y, shift = v(st, rest[0]), v(st, rest[1]), v(st, rest[2])
            if None in (x, y, shift):
                self.put(out, dst, None)
                if carry_out:
                    self.put(out, carry_out, None)
            else:
                total = ((x << shift) & MASK32) + y
                self.put(out, dst, total & MASK32)
                if carry_out:
                    self.put(out, carry_out, total >> 32 > 0)

    def isetp(self, st, ins, out):
        a, mods = ins.args, ins.mods
        cmp, unsigned, ext = mods[0], "U32" in mods, "EX" in mods
        bop = next(m for m in mods if m in ("AND", "OR", "XOR"))
        x, y = self.value(st, a[2]), self.value(st, a[3])
        p = self.pred(st, a[4])
        e = self.pred(st, a[5]) if ext else True
        if None in (x, y, p, e):
            self.put(out, a[0], None)
            self.put(out, a[1], None)
            return
        if not unsigned:
            x = x - (1 << 32) if x >> 31 else x
            y = y - (1 << 32) if y >> 31 else y
        if not ext:
            r = {"EQ": x == y, "NE": x != y, "LT": x < y, "LE": x <= y, "GT": x > y,
                 "GE": x >= y}[cmp]
        else:
            r = {"EQ": x == y and e, "NE": x != y or e, "LT": x < y or (x == y and e),
                 "LE": x < y or (x == y and e), "GT": x > y or (x == y and e),
                 "GE": x > y or (x == y and e)}[cmp]
        combine = {"AND": lambda s, t: s and t, "OR": lambda s, t: s or t,
                   "XOR": lambda s, t: s != t}[bop]
        self.put(out, a[0], combine(bool(r), p))
        self.put(out, a[1], combine(not r, p))

    def fsetp(self, st, ins, out):
        a, mods = ins.args, ins.mods
        width = 8 if ins.base == "DSETP" else 4
        cmp = mods[0]
        bop = next(m for m in mods if m in ("AND", "OR", "XOR"))
        x, y = self.value(st, a[2], width, True), self.value(st, a[3], width, True)
        p = self.pred(st, a[4])
        if None in (x, y, p) or "FTZ" in mods:
            self.put(out, a[0], None)
            self.put(out, a[1], None)
            return
        fx, fy = (bits_f64(x), bits_f64(y)) if width == 8 else (bits_f32(x), bits_f32(y))
        nan = math.isnan(fx) or math.isnan(fy)
        base = {"EQ": fx == fy, "NE": fx != fy, "LT": fx < fy, "LE": fx <= fy, "GT": fx > fy,
                "GE": fx >= fy}
        if cmp in base:
            r = base[cmp] and not nan
        elif cmp.endswith("U") and cmp[:-1] in base:
            r = base[cmp[:-1]] or nan
        elif cmp == "NUM":
            r = not nan
        elif cmp == "NAN":
            r = nan
        else:
            self.put(out, a[0], None)
            self.put(out, a[1], None)
            return
        combine = {"AND": lambda s, t: s and t, "OR": lambda s, t: s or t,
                   "XOR": lambda s, t: s != t}[bop]
        self.put(out, a[0], combine(bool(r), p))
        self.put(out, a[1], combine(not r, p))

    def shf(self, st, ins, out):
        a, mods, v = ins.args, ins.mods, self.value
        lo, shift, hi = v(st, a[1]), v(st, a[2]), v(st, a[3])
        if None in (lo, shift, hi):
            self.put(out, a[0], None)
            return
        word = lo | hi << 32
        wide = "U64" in mods or "S64" in mods
        shift = min(shift, 64 if wide else 32) if "W" not in mods else shift & 31
        if "L" in mods:
            r = word << shift
        else:
            if "S32" in mods or "S64" in mods:
                word = word - (1 << 64) if word >> 63 else word
            r = word >> shift
        r &= (1 << 96) - 1
        self.put(out, a[0], (r >> 32 if "HI" in mods else r) & MASK32)


@functools.lru_cache(maxsize=None)
def operand(text: str) -> Tuple[str, str, bool, bool, bool, bool, bool]:
    """(kind: c(onstant), r(egister) or i(mmediate), core text, a register pair?, a
    sub-word selector (.H1, .B1..3: not modelled)?, negated, inverted, absolute)."""
    neg, inv = text.startswith("-"), text.startswith("~")
    core = text.lstrip("-~")
    absval = core.startswith("|")
    core = core.strip("|")
    if core.startswith("c[0x0]"):
        return "c", core, False, False, neg, inv, absval
    m = REG.match(core)
    if m:
        suffix = m.group("suf")
        return ("r", m.group("name"), ".64" in suffix,
                re.search(r"\.(H1|B[123])\b", suffix) is not None, neg, inv, absval)
    return "i", core, False, False, neg, inv, absval


def next_reg(name: str) -> str:
    m = re.fullmatch(r"(U?R)(\d+)", name)
    return f"{m.group(1)}{int(m.group(2)) + 1}" if m else name


@functools.lru_cache(maxsize=None)
def immediate(text: str, fp: bool, width: int) -> Optional[int]:
    t = text.strip()
    try:
        if re.fullmatch(r"-?0x[0-9a-f]+", t):
            x = int(t, 16)
            return x & ((1 << (8 * width)) - 1)
        if fp or re.fullmatch(r"[-+]?(\d+\.\d*|\d*\.\d+|\d+)(e[-+]?\d+)?|[-+]?INF|[-+]?QNAN", t):
            x = float(t.replace("QNAN", "nan").replace("INF", "inf"))
            return f64_bits(x) if width == 8 else f32_bits(x)
        if re.fullmatch(r"-?\d+", t):
            return int(t) & ((1 << (8 * width)) - 1)
    except ValueError:
        return None
    return None


def branch_outcome(machine: Machine, st: State, ins: Ins) -> Optional[bool]:
    """Whether a conditional branch is taken under st (None: unknown)."""
    if "DIV" in ins.mods:
        return False  # a converged warp does not take the collective fallback
    taken: Optional[bool] = True
    if ins.guard:
        taken = machine.pred(st, ins.guard)
    for arg in ins.args[:-1]:
        if re.fullmatch(r"!?U?P\w+", arg):
            p = machine.pred(st, arg)
            taken = None if (taken is None or p is None) else (taken and p)
    return taken


def analyse_mode(cfg: Cfg, loop: Dict, machine: Machine) -> Dict:
    """Runs the kernel abstractly (a worklist over its blocks, states joined where paths
    meet) and returns the main loop's feasible edges and its longest path."""
    states: Dict[int, State] = {cfg.rpo[0]: State()}
    order = {b: n for n, b in enumerate(cfg.rpo)}
    work = {cfg.rpo[0]}
    visits: Dict[int, int] = {}
    edges: Dict[int, List[int]] = {}
    while work:
        b = min(work, key=order.get)
        work.discard(b)
        visits[b] = visits.get(b, 0) + 1
        st = State(states[b])
        for ins in cfg.block_ins(b):
            machine.step(st, ins)
        last = cfg.ins[cfg.blocks[b][1] - 1]
        succ = cfg.succ[b]
        if last.base == "BRA" and len(succ) == 2:
            taken = branch_outcome(machine, st, last)
            succ = [succ[0]] if taken else [succ[1]] if taken is False else succ
        edges[b] = succ
        for s in succ:
            if s == loop["header"] and b in loop["latches"]:
                continue  # the first iteration only: its values stay concrete
            if s not in states:
                states[s] = State(st)
                work.add(s)
            else:
                old = states[s]
                joined = State()
                for k, x in old.items():
                    m = meet(x, st.get(k))
                    if m is not None:
                        joined[k] = m
                if visits.get(s, 0) > 8:  # widen: keep what has not changed by now
                    joined = State({k: x for k, x in joined.items() if old.get(k) == x})
                if joined != old:
                    states[s] = joined
                    work.add(s)
    result = longest_path(cfg, loop, edges)
    result["reached"] = set(edges)
    result["unresolved"] = [cfg.ins[cfg.blocks[b][1] - 1].addr for b in result["blocks"]
                            if len(edges.get(b, [])) == 2]
    return result


def longest_path(cfg: Cfg, loop: Dict, edges: Optional[Dict[int, List[int]]],
                 shortest: bool = False) -> Dict:
    """The most instructions one iteration can issue (the fewest with `shortest`): the
    longest path from the header to a latch over the loop's forward edges (all edges when
    `edges` is None), with its global memory (LDG + STG), Philox multiply, shuffle, load
    and e4m3 decode (is_e4m3_unpack) counts and its blocks; counts None where no
    iteration is feasible."""
    body, header = loop["body"], loop["header"]

    def out_edges(b):
        return cfg.succ[b] if edges is None else edges.get(b, [])

    def better(x, y):
        return y is None or (x < y if shortest else x > y)

    # forward edges only: a loop nested in the body is counted for one trip
    succ = {b: [s for s in out_edges(b) if s in body and s != header
                and not cfg.dominates(s, b)] for b in body}
    best: Dict[int, Optional[Tuple[int, ...]]] = {}
    choice: Dict[int, Optional[int]] = {}
    for b in reversed(topological(succ, header)):
        ins = cfg.block_ins(b)
        here = (len(ins), sum(map(is_memory, ins)), sum(map(is_philox, ins)),
                sum(1 for i in ins if i.base == "SHFL"), sum(1 for i in ins if i.base == "LDG"),
                sum(map(is_e4m3_unpack, ins)))
        top, pick = None, None
        if b in loop["latches"] and header in out_edges(b):
            top = here
        for s in succ[b]:
            tail = best.get(s)
            if tail is not None and better(here[0] + tail[0], None if top is None else top[0]):
                top, pick = tuple(x + y for x, y in zip(here, tail)), s
        best[b], choice[b] = top, pick
    result = best.get(header)
    if result is None:
        return dict(instructions=None, memory=None, philox=None, shuffles=None, loads=None,
                    unpacks=None, blocks=[])
    path, b = [], header
    while b is not None:
        path.append(b)
        b = choice[b]
    return dict(instructions=result[0], memory=result[1], philox=result[2],
                shuffles=result[3], loads=result[4], unpacks=result[5], blocks=path)


def topological(succ: Dict[int, List[int]], start: int) -> List[int]:
    seen, order, stack = {start}, [], [(start, iter(succ[start]))]
    while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            order.append(node)
            stack.pop()
        elif nxt not in seen:
            seen.add(nxt)
            stack.append((nxt, iter(succ[nxt])))
    return order[::-1]


PHILOX_IMMEDIATES = {f"-0x{(1 << 32) - c:x}" for c in PHILOX_CONSTANTS} | {
    f"0x{c:x}" for c in PHILOX_CONSTANTS}


def is_e4m3_unpack(ins: Ins) -> bool:
    """The hardware's decode of two e4m3 codes to two fp16 values (sm_89 on:
    cvt.rn.f16x2.e4m3x2, F2FP.F16.E4M3.UNPACK_B), which the 8-bit lists' loads use
    (multi_tensor_block.cuh's e4m3_lane_values)."""
    return ins.base == "F2FP" and "E4M3" in ins.mods and "UNPACK_B" in ins.mods


def is_philox(ins: Ins) -> bool:
    return ins.base in ("IMAD", "UIMAD") and any(a in PHILOX_IMMEDIATES for a in ins.args)


# ------------------------------------------------------------------------ the modes

def modes_of(op: str, types: List[str], layout: Dict) -> List[Dict]:
    """The runtime modes a kernel instantiation serves: [{'name', 'lists' (present),
    'flags' (functor fields set)}]. Storage types decide some (remainder: int16 comps;
    8-bit state: E4m3; a model copy: params fp32 with a narrower model type); the rest
    are flags of the same kernel."""
    c = layout["constants"]
    depth = c["kDepth"]
    every = set(range(depth))
    if op in ("AdamOp", "SgdOp"):
        model, comp, scale = c["kModelList"], c["kCompList"], c["kScaleList"]
        salts = comp + 1
        param, state = types[0], types[2]
        eight = state == "E4m3"
        # params, grads and the state list(s); 8-bit state adds its block scales and the
        # rounding words (its codes always round stochastically). The precision report's
        # tally list (kTallyList, after the scales) is absent but in the report modes:
        # bf16 params without masters, with `report` on and the tally list given (the
        # engine then launches the mode's counting kernel, or the generic kernel:
        # launched_mode).
        base = set(range(4 if op == "AdamOp" else 3))
        if eight:
            base |= set(range(scale, depth)) - {c.get("kTallyList")} | {salts}
        flags = dict(state_stochastic=eight)
        if op == "AdamOp":
            flags["root"] = eight
        else:
            flags.update(momentum=0.9, first_run=False)
        if types[comp] == "short":
            masters = [("remainder", {comp}, dict(remainder=True))]
        elif param == "float" and types[model] != "float":
            masters = [("fp32 masters", {model}, {})]
        elif param == "float":
            masters = [("fp32 params", set(), {})]
        elif param == "BFloat16":
            masters = [("none", set(), {}), ("kahan", {comp}, dict(kahan=True)),
                       ("stochastic", {salts}, dict(stochastic=True))]
            masters += [(name, more | {c["kTallyList"]}, {**extra, "report": True,
                                                           "rounds_bf16": True})
                        for name, more, extra in masters]
        else:
            masters = [("none", set(), {})]
        state_name = {"float": "fp32", "BFloat16": "bf16", "E4m3": "fp8"}[state]
        return [dict(name=f"{name}, {state_name} state" + (", report" if extra.get("report")
                                                            else ""),
                     lists=sorted(base | more), flags={**flags, **extra})
                for name, more, extra in masters]
    if op in ("AdagradOp", "NovoGradOp"):
        model = c["kModelList"]
        lists = every - {model}
        name = "fp32 params"
        if types[0] == "float" and types[model] != "float":
            lists, name = every, "fp32 masters"
        elif types[0] != "float":
            name = "no masters"
        return [dict(name=name, lists=sorted(lists), flags={})]
    if op == "LambStage2Op":
        lists = every if (types[0] == "float" and types[2] != "float") else every - {2}
        return [dict(name="masters" if 2 in lists else "plain", lists=sorted(lists),
                     flags=dict(adaptive=True))]
    return [dict(name="plain", lists=sorted(every), flags={})]


def mode_bytes(op: str, types: List[str], layout: Dict, lists: List[int]) -> float:
    """Bytes per element the mode moves: each present list in kReads read once, each in
    kWrites written once, at its storage size; per-tensor lists (one value per tensor)
    left out; an 8-bit list's block scales (the lists from kScaleList on, which the
    engine reads and writes itself) at 1 byte per kQuantBlock elements, both ways."""
    c = layout["constants"]
    per_tensor = c.get("kPerTensor", 0)
    scale = c.get("kScaleList")
    tallies = c.get("kTallyList")  # (per tensor, after the scales)
    quant = engine_constants()["quant_block"]
    total = 0.0
    for k in lists:
        if scale is not None and k >= scale and k != tallies:
            total += 2 / quant
        elif not per_tensor >> k & 1:
            total += STORAGE_BYTES[types[k]] * ((c["kReads"] >> k & 1) + (c["kWrites"] >> k & 1))
    return total


FIELD_VALUES = {
    # doubles and floats: a typical step (weight decay on, so its code runs)
    "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01,
    "max_grad_norm": 1.0, "momentum": 0.0, "grad_weight": 1.0, "inv_scale": 1.0,
    # bools
    "decoupled_weight_decay": True, "bias_correction": True, "grad_averaging": True,
    "seed": 0x243F6A8885A308D3, "state_seed": 0x13198A2E03707344,
}
PTR_BASE = 0x7F0000000000


def build_params(op: str, types: List[str], layout: Dict, mode: Dict,
                 repo: Path = REPO) -> Tuple[bytes, Dict[int, bytes], Dict]:
    """The kernel's parameter space (from 0x210 on sm_90: meta, op, skip, found_inf)
    and the global memory the functor reads (step, inv_scale, rounding words)."""
    depth = layout["constants"]["kDepth"]
    tensors, blocks = max_tensors_per_launch(depth, repo)
    meta_size = depth * tensors * 8 + tensors * 8 + blocks * 4 + blocks * 2
    meta_size = (meta_size + 7) // 8 * 8
    base = 0x210
    op_off = base + meta_size
    op_off = (op_off + layout["align"] - 1) // layout["align"] * layout["align"]
    end = op_off + layout["size"]
    end = (end + 7) // 8 * 8
    params = bytearray(end + 16)
    memory: Dict[int, bytes] = {}
    numel = 1 << 24
    for k in mode["lists"]:
        ptr = PTR_BASE + (k + 1) * (1 << 32)
        struct.pack_into("<Q", params, base + (k * tensors) * 8, ptr)
        if k == layout["constants"].get("kCompList", -1) + 1 and op in ("AdamOp", "SgdOp"):
            memory[ptr] = struct.pack("<4q", 3, 0, 0, 0)  # salt 3, whole tensor
    struct.pack_into("<q", params, base + depth * tensors * 8, numel)  # numel[0]
    # block_chunk[0] = 0, block_slot[0] = 0 (zeros already)
    fields = layout["fields"]
    step_ptr, scale_ptr = PTR_BASE - 0x1000, PTR_BASE - 0x2000
    memory[step_ptr] = struct.pack("<f", 10.0)
    memory[scale_ptr] = struct.pack("<f", 1 / 65536)
    values = dict(FIELD_VALUES)
    values.update(mode["flags"])
    for name, (off, ctype) in fields.items():
        if "." in name:
            continue
        at = op_off + off
        if ctype.endswith("*"):
            ptr = {"step_ptr": step_ptr, "inv_scale_ptr": scale_ptr}.get(name, 0)
            struct.pack_into("<Q", params, at, ptr)
        elif ctype == "double":
            struct.pack_into("<d", params, at, float(values.get(name, 0.0)))
        elif ctype == "float":
            struct.pack_into("<f", params, at, float(values.get(name, 0.0)))
        elif ctype == "bool":
            params[at] = 1 if values.get(name, False) else 0
        elif ctype in ("uint64_t", "int64_t"):
            struct.pack_into("<Q", params, at, int(values.get(name, 0)) & (2**64 - 1))
        elif ctype in ("uint32_t", "int32_t", "int", "unsigned"):
            struct.pack_into("<I", params, at, int(values.get(name, 0)) & MASK32)
    # skip = nullptr; found_inf = a pointer
    struct.pack_into("<Q", params, end + 8, PTR_BASE - 0x3000)
    return bytes(params), memory, dict(op_offset=op_off, skip_offset=end,
                                       param_end=end + 16)


SPECIALS = {"SR_TID.X": 0, "SR_TID.Y": 0, "SR_TID.Z": 0, "SR_CTAID.X": 0, "SR_CTAID.Y": 0,
            "SR_CTAID.Z": 0, "SR_LANEID": 0, 0x0: 512, 0x4: 1, 0x8: 1}


# ------------------------------------------------------------------------- analysis

def analyse_kernel(mangled: str, demangled: str, body: List[Tuple[int, str]],
                   layouts: Dict[str, Dict], constants: Dict[str, int],
                   with_modes: bool = True, repo: Path = REPO,
                   fixed: Optional[Dict[str, Dict]] = None,
                   present: Optional[set] = None) -> Dict:
    """The record of one kernel: its op, storage types and fixed mode (None: the generic
    kernel), its main loop (None when none was found) with the static counts, and per
    mode the path's counts per element, the mode's bytes per element, budgets and
    ratios. `modes`: the modes the CUDA engine launches this kernel for (`fixed`, from
    fixed_modes: a generic kernel's modes that are in one of its functor's fixed modes
    run on that mode's Fixed kernel, `present` the (op, types, mode) of the Fixed
    kernels in the listing). `not_launched`: a generic kernel's modes that run on a
    Fixed kernel, analysed on it anyway (for comparison; the gate checks their paths
    are feasible, not their ratios). A mode whose Fixed kernel is not in the listing
    is analysed on the generic kernel, marked `missing_fixed` (a gate failure)."""
    sig = kernel_signature(demangled)
    record = dict(name=mangled, demangled=demangled, instructions=len(body))
    if sig is None:
        return record
    op, types, fixed_mode = sig
    fixed = {} if fixed is None else fixed
    present = set() if present is None else present
    record.update(op=op, types=types,
                  fixed=None if fixed_mode is None else fixed_mode.label(),
                  kernel=kernel_name(op, fixed_mode))
    blocked = "E4m3" in types
    elements = constants["blocked_elements" if blocked else "pointwise_elements"]
    record["path_kind"] = "apply_blocks (8-bit lists)" if blocked else "apply_chunk vectors"
    record["elements_per_iteration"] = elements
    cfg = Cfg(body)
    loop = cfg.main_loop()
    if loop is None:
        record["loop"] = None
        return record
    ins = [i for b in loop["body"] for i in cfg.block_ins(b)]
    record["loop"] = dict(header=cfg.ins[loop["header"]].addr,
                          latches=sorted(cfg.ins[cfg.blocks[u][1] - 1].addr
                                         for u in loop["latches"]),
                          static_instructions=len(ins),
                          static_memory=sum(map(is_memory, ins)),
                          static_philox=sum(map(is_philox, ins)),
                          static_load_bytes=sum(load_bytes(i) for i in ins),
                          inner_loops=loop["inner_loops"])
    record["static_per_element"] = len(ins) / elements
    layout = layouts.get(op)
    record["modes"], record["not_launched"] = [], []
    if layout is None:
        return record
    c = layout["constants"]
    # apply_chunk loads every list it reads once per vector: the loop's load bytes are
    # its elements' bytes of those lists (the elements per iteration, seen in the SASS);
    # a Fixed kernel reads only its mode's lists (Fixed::kReads, csrc/pointwise.h)
    reads = c["kReads"]
    if fixed_mode is not None:
        if (op not in fixed or fixed_mode._replace(counting=False) not in fixed[op]["modes"]
                or fixed_mode.counting and not fixed_counts(fixed_mode, types)):
            record["unknown_fixed"] = True  # not one of the source's FixedModes
            return record
        reads &= (fixed_lists(fixed_mode, c) | fixed[op]["maybe"] | c.get("kPerTensor", 0))
    read_bytes = sum(STORAGE_BYTES[types[k]] for k in range(c["kDepth"])
                     if reads >> k & 1 and not c.get("kPerTensor", 0) >> k & 1)
    record["expected_load_bytes"] = None if blocked else elements * read_bytes
    # the functor's layout is the kernel's: it reads its skip pointer where the layout
    # puts it (Fixed<Op, M> adds no data member to Op)
    where = build_params(op, types, layout, dict(lists=[], flags={}), repo)[2]
    record["layout_ok"] = any(f"c[0x0][{where['skip_offset']:#x}]" in text
                              for _, text in body)
    if not with_modes:
        return record
    for mode in modes_of(op, types, layout):
        runs = launched_mode(op, types, mode, layout, fixed)
        missing = runs is not None and (op, tuple(types), runs) not in present
        if fixed_mode is not None:
            if runs != fixed_mode:
                continue  # the Fixed kernel of another mode, or the generic one
            where_to = record["modes"]
        elif runs is None or missing:
            where_to = record["modes"]
        else:
            where_to = record["not_launched"]
        params, memory, _ = build_params(op, types, layout, mode, repo)
        path = analyse_mode(cfg, loop, Machine(params, memory, SPECIALS))
        if path["instructions"] is None:
            # A mode that runs another copy of the loop (a generic or counting kernel's
            # tallying copy, multi_tensor_block.cuh's unswitched loop): the first main-loop
            # candidate, in code order, that the mode reaches.
            reached = path["reached"]
            other = next((lp for lp in cfg.memory_loops()[1:] if lp["header"] in reached),
                         None)
            if other is not None:
                path = analyse_mode(cfg, other, Machine(params, memory, SPECIALS))
        nbytes = mode_bytes(op, types, layout, mode["lists"])
        entry = dict(mode=mode["name"], lists=mode["lists"], bytes_per_element=nbytes,
                     kernel=record["kernel"])
        if runs is not None and fixed_mode is None:
            entry["runs_on" if not missing else "missing_fixed"] = kernel_name(op, runs)
        elif op in fixed and not autograd_grads(types, c["kModelList"] in mode["lists"], c):
            entry["uncommon_grads"] = True  # (the generic kernel, by design: fixed_fits)
        if path["instructions"] is None:
            entry.update(per_element=None)
        else:
            entry.update(per_element=path["instructions"] / elements,
                         memory_per_element=path["memory"] / elements,
                         loads_per_element=path["loads"] / elements,
                         stores_per_element=(path["memory"] - path["loads"]) / elements,
                         philox_per_element=path["philox"] / elements,
                         shuffles_per_iteration=path["shuffles"],
                         e4m3_unpacks_per_iteration=path["unpacks"],
                         unresolved_branches=len(path["unresolved"]))
            for device in DEVICES:
                entry[f"budget_{device}"] = budget(nbytes, device)
                entry[f"ratio_{device}"] = entry["per_element"] / entry[f"budget_{device}"]
        where_to.append(entry)
    return record


def kernel_name(op: str, fixed_mode: Optional[FixedMode]) -> str:
    """'AdamOp' for a generic kernel, 'Fixed<AdamOp,Mode<0,0,0,1,1>>' for a Fixed one,
    'Fixed<AdamOp,Mode<0,0,0,1,1>,true>' for its counting kernel."""
    return op if fixed_mode is None else f"Fixed<{op},{fixed_mode.label()}>"


def load_bytes(ins: Ins) -> int:
    """Bytes a global load reads (0 for anything else)."""
    if ins.base != "LDG":
        return 0
    width = {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}
    return next((width[m] for m in ins.mods if m in width), 4)


def analyse(listing: str, repo: Path = REPO, with_modes: bool = True,
            only=None) -> List[Dict]:
    """The records of the listing's pointwise_kernels (analyse_kernel), generic and
    Fixed, in listing order; a pointwise_kernel whose name is not understood gets a
    record of its names with `unrecognised` (a gate failure), not silence."""
    functions = split_functions(listing)
    names = demangle([n for n, _ in functions])
    layouts = functors(repo)
    constants = engine_constants(repo)
    fixed = fixed_modes(repo)
    signatures = [kernel_signature(readable) for readable in names]
    present = {(sig[0], tuple(sig[1]), sig[2]) for sig in signatures
               if sig is not None and sig[2] is not None}
    out = []
    for (mangled, body), readable, sig in zip(functions, names, signatures):
        if only is not None and not only(readable):
            continue
        if sig is None:
            if "pointwise_kernel<" in readable:
                out.append(dict(name=mangled, demangled=readable, unrecognised=True))
            continue
        out.append(analyse_kernel(mangled, readable, body, layouts, constants, with_modes,
                                  repo, fixed, present))
    return out


def short_types(types: List[str]) -> str:
    abbrev = {"float": "f32", "BFloat16": "bf16", "Half": "f16", "E4m3": "e4m3",
              "short": "i16", "long": "i64", "unsigned char": "u8"}
    return ",".join(abbrev.get(t, t) for t in types)


def table(records: List[Dict]) -> str:
    """One line per kernel instantiation and mode: the kernel (the generic one, or a
    Fixed one's mode) and, for a generic kernel's modes that run on a Fixed kernel
    (`not_launched`), which one; a Fixed kernel of no mode the script follows has its
    static count only."""
    lines = [f"{'op':<13} {'kernel':<21} {'storage':<50} {'mode':<26} {'static':>6} "
             f"{'path':>6} {'mem':>5} {'philox':>6} {'B':>6} {'H200':>6} {'ratio':>5} "
             f"{'H100':>5}"]
    for r in records:
        if r.get("unrecognised"):
            lines.append(f"UNRECOGNISED pointwise_kernel: {r['demangled']}")
            continue
        if "op" not in r:
            continue
        kernel = f"Fixed {r['fixed']}" if r["fixed"] else "generic"
        where = f"{r['op']:<13} {kernel:<21} {short_types(r['types']):<50}"
        if r.get("loop") is None:
            lines.append(f"{where} NO MAIN LOOP FOUND")
            continue
        entries = r["modes"] + r.get("not_launched", [])
        none = dict(mode="(no mode followed)" if r["fixed"] else "-", per_element=None)
        for m in entries or [none]:
            head = f"{where} {m['mode']:<26} {r['static_per_element']:6.1f}"
            if m.get("per_element") is None:
                lines.append(head + ("" if m is none else "   (no feasible iteration)"))
                continue
            note = ""
            if "runs_on" in m:
                note = f"  (not launched: runs on {m['runs_on']})"
            elif "missing_fixed" in m:
                note = f"  (launched as {m['missing_fixed']}: NOT IN THE LISTING)"
            lines.append(f"{head} {m['per_element']:6.1f} {m['memory_per_element']:5.2f} "
                         f"{m['philox_per_element']:6.2f} {m['bytes_per_element']:6.2f} "
                         f"{m['budget_H200']:6.1f} {m['ratio_H200']:5.2f} "
                         f"{m['ratio_H100']:5.2f}{note}")
    return "\n".join(lines)


def summary(records: List[Dict]) -> List[Dict]:
    """The modes grouped over the storage types of their kernels (op, mode), on the
    kernels the engine launches for them: how many kernels (`fixed` of them Fixed
    kernels), and the range of each figure; worst ratio first."""
    groups: Dict[Tuple[str, str], List[Tuple[Dict, Dict]]] = {}
    for r in records:
        for m in r.get("modes", []):
            if m.get("per_element") is not None and not m.get("uncommon_grads"):
                groups.setdefault((r["op"], m["mode"]), []).append((r, m))
    rows = []
    for (op, mode), members in groups.items():
        def span(key, source="mode"):
            values = [(m if source == "mode" else r)[key] for r, m in members]
            return min(values), max(values)
        rows.append(dict(op=op, mode=mode, kernels=len(members),
                         fixed=sum(1 for r, _ in members if r.get("fixed")),
                         static=span("static_per_element", "record"),
                         per_element=span("per_element"), memory=span("memory_per_element"),
                         philox=span("philox_per_element"), bytes=span("bytes_per_element"),
                         ratio_H200=span("ratio_H200"), ratio_H100=span("ratio_H100")))
    rows.sort(key=lambda row: -row["ratio_H200"][1])
    return rows


def summary_table(rows: List[Dict]) -> str:
    def fmt(pair, digits):
        lo, hi = pair
        return f"{lo:.{digits}f}" if round(lo, digits) == round(hi, digits) else \
            f"{lo:.{digits}f}-{hi:.{digits}f}"
    lines = [f"{'op':<13} {'mode':<26} {'kernel':<7} {'n':>2} {'static':>11} {'path':>11} "
             f"{'mem':>9} {'philox':>9} {'B':>13} {'H200 ratio':>11} {'H100 ratio':>11}"]
    for row in rows:
        kernel = ("Fixed" if row["fixed"] == row["kernels"] else
                  "generic" if not row["fixed"] else f"{row['fixed']} Fixed")
        lines.append(f"{row['op']:<13} {row['mode']:<26} {kernel:<7} {row['kernels']:>2} "
                     f"{fmt(row['static'], 0):>11} {fmt(row['per_element'], 0):>11} "
                     f"{fmt(row['memory'], 2):>9} {fmt(row['philox'], 1):>9} "
                     f"{fmt(row['bytes'], 3):>13} {fmt(row['ratio_H200'], 2):>11} "
                     f"{fmt(row['ratio_H100'], 2):>11}")
    return "\n".join(lines)


def violations(records: List[Dict], fraction: float = GATE_FRACTION) -> List[str]:
    """What the gate refuses: a pointwise_kernel whose name is not understood, or a Fixed
    one whose mode is not among its functor's FixedModes; a kernel without a main loop
    or without a mode analysed (a Fixed kernel of a mode the script does not follow
    aside); a mode without a feasible iteration (also on a generic kernel it does not
    run on); a mode whose Fixed kernel is not in the listing; and every mode whose path
    per element, on the kernel it runs on, is over `fraction` of its H200 budget (but
    a fixed-mode functor's on gradients autograd does not give: `uncommon_grads`)."""
    out = []
    for r in records:
        if r.get("unrecognised"):
            out.append(f"unrecognised pointwise_kernel: {r['demangled']}")
            continue
        if "op" not in r:
            continue
        label = kernel_label(r)
        if r.get("loop") is None:
            out.append(f"{label}: no main loop found")
            continue
        if r.get("unknown_fixed"):
            out.append(f"{label}: not one of {r['op']}'s FixedModes in the source")
            continue
        if not r.get("modes") and not r.get("not_launched") and not r.get("fixed"):
            out.append(f"{label}: no mode analysed")
        for m in r.get("modes", []) + r.get("not_launched", []):
            if m.get("per_element") is None:
                out.append(f"{label} [{m['mode']}]: no feasible iteration")
        for m in r.get("modes", []):
            if "missing_fixed" in m:
                out.append(f"{label} [{m['mode']}]: the engine launches "
                           f"{m['missing_fixed']}, which is not in the listing")
            if m.get("per_element") is not None and m["ratio_H200"] > fraction and \
                    not m.get("uncommon_grads"):
                out.append(f"{label} [{m['mode']}]: {m['per_element']:.1f} instructions per "
                           f"element, {m['ratio_H200']:.2f} of the H200 budget "
                           f"({m['budget_H200']:.1f} for {m['bytes_per_element']:g} B)")
    return out


def kernel_label(r: Dict) -> str:
    """'AdamOp<bf16,...>', or 'Fixed<AdamOp,Mode<0,0,0,1,1>><bf16,...>'."""
    return f"{r['kernel']}<{short_types(r['types'])}>"


def default_so() -> Optional[str]:
    found = sorted(glob.glob(str(REPO / "mixedprec" / "_C*.so")))
    return found[0] if found else None


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("so", nargs="?", default=None, help="the extension (default: "
                        "mixedprec/_C*.so)")
    parser.add_argument("--arch", default=ARCH)
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--sass", help="read this cuobjdump -sass listing instead")
    parser.add_argument("--kernels", action="store_true",
                        help="one line per kernel and mode (default: per op and mode)")
    args = parser.parse_args(argv[1:])
    if args.sass:
        listing = Path(args.sass).read_text()
    else:
        so = args.so or default_so()
        if so is None:
            print("sass_per_element: no mixedprec/_C*.so", file=sys.stderr)
            return 2
        listing = disassemble(so, args.arch)
    records = analyse(listing)
    if args.json:
        Path(args.json).write_text(json.dumps(
            dict(devices=DEVICES, gate_fraction=GATE_FRACTION, constants=engine_constants(),
                 summary=summary(records), kernels=records), indent=1))
    constants = engine_constants()
    print(f"elements per main-loop iteration per thread: {constants['pointwise_elements']} "
          f"(apply_chunk: kUnroll {constants['unroll']} x kILP {constants['ilp']}), "
          f"{constants['blocked_elements']} (apply_blocks: kUnroll spans x kILP per lane)")
    for device in DEVICES:
        rate = thread_instructions_per_second(device)
        print(f"{device}: {rate / 1e12:.1f} T thread-instructions/s, "
              f"{rate / DEVICES[device]['copy_bytes_per_s']:.2f} per byte at "
              f"{DEVICES[device]['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    print(table(records) if args.kernels else summary_table(summary(records)))
    found = violations(records)
    fixed = sum(1 for r in records if r.get("fixed"))
    print(f"{len(records)} multi-tensor kernels ({fixed} of them Fixed<Op, Mode> kernels, "
          f"in whose modes the generic ones do not run); the gate (path <= {GATE_FRACTION} "
          f"of the H200 budget): " + (f"{len(found)} findings" if found else "passes"))
    for line in found if args.kernels else []:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
