"""The CPU engine's vector passes (csrc/cpu/engine.h: pass_avx2*, pass_avx512*,
block_pass_*) stay vector code: none works lane by lane.

GCC 12 lowers some operations on GCC vector types element by element, with no warning:
an `&` of two 512-bit comparisons, or a select nested in another (it folds the two into
such an `&`), becomes a compare, a `setcc` and a branch or `vpinsrd` per lane. The
precision report's count (pointwise.h's tally_update) was written that way until
2026-11-29 and made an AVX-512 step with the report 17 times slower than without it.
The disassembly (objdump) shows it: a vector pass has a handful of scalar compares at
most (its tail and its flags), a lowered one a hundred or more.
"""

import platform
import re
import shutil
import subprocess
from collections import Counter

import pytest
from helpers import load_script

spe = load_script("scripts/sass_per_element.py")
OBJDUMP = shutil.which("objdump")
X86 = platform.machine() in ("x86_64", "AMD64")

# What a lane-by-lane lowering of float lanes leaves behind: a flag per lane (sete,
# setne, and setp/setnp for the unordered part of a comparison) or a 32-bit lane at a
# time put into or taken out of a vector. (vpinsrq/vpextrq are the Philox counters'
# 64-bit words, not lanes of the math.)
LANE_BY_LANE = re.compile(r"\t(set(?:n?e|n?p)|vpinsrd|vpextrd)\s")
FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
PASS = re.compile(r"^(?:int )?mixedprec::cpu::((?:block_)?pass_avx\w*)<")  # its kind
# The most any vector pass has (2 at 2026-11-29: the flags of the tail); a pass lowered
# lane by lane had 113-339.
LIMIT = 8


def lane_by_lane_counts(listing: str) -> Counter:
    """The lane-by-lane instructions of each vector pass in an objdump -d -C listing,
    by the pass's full name."""
    counts: Counter = Counter()
    current = None
    for line in listing.splitlines():
        function = FUNCTION.match(line)
        if function:
            current = function.group(1) if PASS.match(function.group(1)) else None
            if current is not None:
                counts[current] += 0
            continue
        if current is not None and LANE_BY_LANE.search(line):
            counts[current] += 1
    return counts


def disassemble(path: str) -> str:
    return subprocess.run([OBJDUMP, "-d", "--no-show-raw-insn", "-C", path],
                          check=True, capture_output=True, text=True).stdout


needs_tools = pytest.mark.skipif(not (X86 and OBJDUMP), reason="x86-64 with objdump only")


@needs_tools
def test_no_vector_pass_works_lane_by_lane():
    so = spe.default_so()
    if so is None:
        pytest.skip("no built extension (mixedprec/_C*.so)")
    counts = lane_by_lane_counts(disassemble(so))
    kinds = {PASS.match(name).group(1) for name in counts}
    assert {"pass_avx2", "pass_avx512", "block_pass_avx512x2"} <= kinds, kinds
    over = {name: n for name, n in counts.items() if n > LIMIT}
    assert not over, (f"{len(over)} vector passes work lane by lane (more than {LIMIT} "
                      f"sete/setne/setp/vpinsrd/vpextrd each), e.g. " +
                      "; ".join(f"{n}: {name[:160]}" for name, n in list(over.items())[:3]))


PLANTED = r"""
typedef float F16 __attribute__((vector_size(64)));
typedef int I16 __attribute__((vector_size(64)));
namespace mixedprec::cpu {
template <class V> inline V lost(V a, V b) {
  const I16 both = (a == V{}) & (b != V{});  // what tally_update did
  return (V)(both & (I16)(V{} + 1.f));
}
template <class V> inline V counted(V a, V b) {  // what it does
  return (V)((a == V{}) & (I16)(V{} + 1.f)) * (V)((b != V{}) & (I16)(V{} + 1.f));
}
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw"), flatten))
template <class V> AVX512 int pass_avx512(V* x, long n) {
  for (long i = 0; i < n; ++i) x[i] = lost(x[i], x[i + 1]);
  return 0;
}
template <class V> AVX512 int pass_avx512x2(V* x, long n) {
  for (long i = 0; i < n; ++i) x[i] = counted(x[i], x[i + 1]);
  return 0;
}
template int pass_avx512<F16>(F16*, long);
template int pass_avx512x2<F16>(F16*, long);
}
"""


@needs_tools
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_gate_catches_a_planted_lane_by_lane_pass(tmp_path):
    """The gate on a planted pair: an `&` of two 512-bit comparisons (the report's count
    before the fix) is caught; the product of their ones (after it) passes."""
    source = tmp_path / "planted.cpp"
    source.write_text(PLANTED)
    obj = tmp_path / "planted.o"
    subprocess.run(["g++", "-O3", "-Wno-psabi", "-c", str(source), "-o", str(obj)], check=True)
    listing = disassemble(str(obj))
    counts = {PASS.match(name).group(1): n for name, n in lane_by_lane_counts(listing).items()}
    assert counts["pass_avx512"] > LIMIT, counts
    assert counts["pass_avx512x2"] <= LIMIT, counts
