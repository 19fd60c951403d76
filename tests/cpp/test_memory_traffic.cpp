// A model of the CUDA kernels' memory traffic, on the host: the block code runs as in
// test_cuda_blocks.cpp (emulated_cuda.h) with its MP_TRACE hook recording every
// global access of the element lists and of the 8-bit lists' scale bytes: which list,
// which lane of which warp, where, how many bytes, load or store. The n-th load (or
// store) of a list by each lane of a warp is one instruction, a warp's request. Per
// request: the 32-byte sectors it touches against the fewest its bytes need (the
// request is coalesced when they are equal). Per list: the bytes it moves per element
// against the minimum, each element's bytes in one request only (a list read once
// and written once; an 8-bit list's scales one byte per block of 32).
//
// Every op and optimizer mode is run over aligned tensors (a tensor misaligned for
// vector accesses takes the element path, which is slower by design) and must pass
// (LAMB, two passes by design, is left out: its scratch update is written by the first
// and read by the second);
// a planted kernel, the 8-bit path as it was before 2026-11-27 (each thread a whole
// block, one element at a time), must fail: the model sees what the H200 measured.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "emulated_cuda.h"

namespace mixedprec::cuda {
namespace {

using at::Tensor;

struct Access {
  int64_t launch, block;
  int warp, lane, list;
  bool store;
  uintptr_t address;
  int bytes;
};
std::vector<Access> g_accesses;

void record(int list, int lane, const void* address, int bytes, bool store) {
  g_accesses.push_back({g_launches, blockIdx.x, static_cast<int>(threadIdx.x / kWarpSize), lane,
                        list, store, reinterpret_cast<uintptr_t>(address), bytes});
}

// What one (list, load or store) moved over the traced calls.
struct ListTraffic {
  int64_t requests = 0, uncoalesced = 0, sectors = 0, ideal_sectors = 0;
  int64_t request_bytes = 0;  // the distinct bytes of each request, summed
  int64_t bytes = 0;          // the distinct bytes over all requests
  std::string worst;          // the first uncoalesced request, described
};

// Bytes covered by a set of [begin, end) intervals.
int64_t union_bytes(std::vector<std::pair<uintptr_t, uintptr_t>> spans) {
  std::sort(spans.begin(), spans.end());
  int64_t total = 0;
  uintptr_t reach = 0;
  for (const auto& [begin, end] : spans) {
    const uintptr_t from = std::max(begin, reach);
    if (end > from) total += static_cast<int64_t>(end - from);
    reach = std::max(reach, end);
  }
  return total;
}

// The traffic of the accesses recorded, by (list, store).
std::map<std::pair<int, bool>, ListTraffic> traffic() {
  // A request: the n-th access of a list (load or store) by the lanes of a warp.
  std::map<std::tuple<int64_t, int64_t, int, int, bool, int>, std::vector<const Access*>> requests;
  std::map<std::tuple<int64_t, int64_t, int, int, int, bool>, int> seq;
  for (const Access& a : g_accesses) {
    const int n = seq[{a.launch, a.block, a.warp, a.lane, a.list, a.store}]++;
    requests[{a.launch, a.block, a.warp, a.list, a.store, n}].push_back(&a);
  }
  std::map<std::pair<int, bool>, ListTraffic> out;
  std::map<std::pair<int, bool>, std::vector<std::pair<uintptr_t, uintptr_t>>> all;
  for (const auto& [key, accesses] : requests) {
    const auto list = std::make_pair(std::get<3>(key), std::get<4>(key));
    ListTraffic& t = out[list];
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;
    std::vector<uintptr_t> sectors;
    for (const Access* a : accesses) {
      spans.emplace_back(a->address, a->address + a->bytes);
      for (uintptr_t s = a->address / 32; s <= (a->address + a->bytes - 1) / 32; ++s) {
        sectors.push_back(s);
      }
    }
    std::sort(sectors.begin(), sectors.end());
    const int64_t touched = std::unique(sectors.begin(), sectors.end()) - sectors.begin();
    const int64_t bytes = union_bytes(spans);
    const uintptr_t lowest = std::min_element(spans.begin(), spans.end())->first;
    const int64_t ideal = (static_cast<int64_t>(lowest % 32) + bytes + 31) / 32;
    t.requests += 1;
    t.sectors += touched;
    t.ideal_sectors += ideal;
    t.request_bytes += bytes;
    if (touched > ideal) {
      if (t.uncoalesced++ == 0) {
        t.worst = std::to_string(accesses.size()) + " lanes, " + std::to_string(bytes) +
                  " bytes in " + std::to_string(touched) + " sectors (" + std::to_string(ideal) +
                  " would do)";
      }
    }
    all[list].insert(all[list].end(), spans.begin(), spans.end());
  }
  for (auto& [list, spans] : all) out[list].bytes = union_bytes(spans);
  return out;
}

// Runs `call` with the trace on and checks the model's two claims for every list,
// the elements being `elements` per list (the sum of the call's tensors' sizes):
// each request coalesced, each byte moved once, and the bytes per element one of
// the storage sizes (1, 2, 4, 8 for the int64 words), one per block for scales.
// `depth` is the op's number of lists (scale lists are traced as depth + k).
// Returns {(list, store): bytes moved per element}; expect_ok false returns without
// asserting (the planted kernel's test reads the traffic itself).
template <typename Call>
std::map<std::pair<int, bool>, ListTraffic> traced(Call call) {
  g_accesses.clear();
  g_trace = record;
  call();
  g_trace = nullptr;
  auto out = traffic();
  g_accesses.clear();
  return out;
}

void expect_minimal(const std::map<std::pair<int, bool>, ListTraffic>& lists, int64_t elements,
                    int depth, const std::string& what) {
  ASSERT_FALSE(lists.empty()) << what << ": nothing traced";
  double per_element = 0;
  for (const auto& [list, t] : lists) {
    const std::string name =
        what + ": list " + std::to_string(list.first) + (list.second ? " store" : " load");
    EXPECT_EQ(t.uncoalesced, 0) << name << ": " << t.uncoalesced << " of " << t.requests
                                << " requests uncoalesced, e.g. " << t.worst;
    EXPECT_EQ(t.request_bytes, t.bytes) << name << ": bytes moved by more than one request";
    if (list.first >= depth) {  // an 8-bit list's scale bytes
      EXPECT_EQ(t.bytes * kQuantBlock, elements) << name << ": not one byte per block";
    } else {
      EXPECT_EQ(t.bytes % elements, 0) << name;
      const int64_t size = t.bytes / elements;
      EXPECT_TRUE(size == 1 || size == 2 || size == 4) << name << ": " << size << " B/element";
    }
    per_element += static_cast<double>(t.bytes) / static_cast<double>(elements);
  }
  std::printf("  %-44s %6.3f B/element\n", what.c_str(), per_element);
}

Tensor scalar(float v) { return at::full({1}, v, at::kFloat); }

// Aligned tensors: a few sizes, the second not a whole number of warp spans.
std::vector<Tensor> tensors(at::ScalarType dtype, double scale = 1.0) {
  std::vector<Tensor> out;
  for (int64_t n : {int64_t{4096}, kChunkSize + 96, int64_t{2048}}) {
    out.push_back((at::randn({n}, at::kFloat) * scale).to(dtype));
  }
  return out;
}
int64_t elements() { return 4096 + kChunkSize + 96 + 2048; }

std::vector<Tensor> codes_like(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const auto& t : ts) {
    out.push_back((at::randn({t.numel()}) * 100).clamp(-448, 448).to(at::kFloat8_e4m3fn));
  }
  return out;
}
std::vector<Tensor> scales_like(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const auto& t : ts) {
    out.push_back(
        at::randint(110, 130, {t.numel() / kQuantBlock}, at::kByte).view(at::kFloat8_e8m0fnu));
  }
  return out;
}
std::vector<Tensor> salts_for(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < ts.size(); ++i) {
    out.push_back(at::tensor({static_cast<int64_t>(i), int64_t{0}, int64_t{0}, int64_t{0}}));
  }
  return out;
}

using MaybeLists = std::optional<at::TensorList>;

TEST(MemoryTraffic, MultiTensorOpsAreCoalescedAndMinimal) {
  at::manual_seed(0);
  std::printf("the multi-tensor ops, aligned tensors:\n");
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const std::string name = c10::toString(dtype);
    auto t = tensors(dtype);
    auto dst = tensors(at::kFloat);
    expect_minimal(traced([&] {
                     entry::multi_tensor_unscale_<EmulatedCudaEngine>(t, scalar(0.f), scalar(0.5f));
                   }),
                   elements(), 2, "unscale_ " + name);
    expect_minimal(traced([&] {
                     entry::multi_tensor_unscale_to_<EmulatedCudaEngine>(t, dst, scalar(0.f),
                                                                         scalar(0.5f));
                   }),
                   elements(), 2, "unscale_to_ " + name + " -> float");
    expect_minimal(
        traced([&] { entry::multi_tensor_check_finite_<EmulatedCudaEngine>(t, scalar(0.f)); }),
        elements(), 1, "check_finite_ " + name);
    expect_minimal(traced([&] { entry::multi_tensor_copy_<EmulatedCudaEngine>(dst, t); }),
                   elements(), 2, "copy_ float -> " + name);
  }
}

// The master modes of the optimizers (python: master=...), with their params' dtype.
enum class Master { kFp32Params, kMasters, kNone, kKahan, kRemainder, kStochastic };
const char* master_name(Master m) {
  switch (m) {
    case Master::kFp32Params: return "fp32 params";
    case Master::kMasters: return "fp32 masters";
    case Master::kNone: return "none";
    case Master::kKahan: return "kahan";
    case Master::kRemainder: return "remainder";
    case Master::kStochastic: return "stochastic";
  }
  return "";
}
enum class State { kFp32, kBf16, kEight };
const char* state_name(State s) {
  return s == State::kFp32 ? "fp32 state" : s == State::kBf16 ? "bf16 state" : "8-bit state";
}

// One optimizer call's lists for a master x state mode.
struct ModeLists {
  std::vector<Tensor> params, grads, model, comps, rems, salts, a, b, sa, sb;
  std::optional<int64_t> seed;

  ModeLists(Master master, State state) {
    const bool bf16 = master != Master::kFp32Params && master != Master::kMasters;
    params = tensors(bf16 ? at::kBFloat16 : at::kFloat);
    grads = tensors(at::kBFloat16);
    if (master == Master::kMasters) model = tensors(at::kBFloat16);
    if (master == Master::kKahan) comps = tensors(at::kBFloat16, 1e-3);
    if (master == Master::kRemainder) {
      for (const auto& p : params)
        rems.push_back(at::randint(-32768, 32768, {p.numel()}, at::kShort));
    }
    if (master == Master::kStochastic || state == State::kEight) {
      salts = salts_for(params);
      seed = 7;
    }
    if (state == State::kEight) {
      a = codes_like(params), b = codes_like(params);
      sa = scales_like(params), sb = scales_like(params);
    } else {
      const auto dtype = state == State::kBf16 ? at::kBFloat16 : at::kFloat;
      a = tensors(dtype, 0.1), b = tensors(dtype, 0.1);
      for (auto& t : b) t = t.abs();
    }
  }
  MaybeLists opt(const std::vector<Tensor>& ts) const {
    return ts.empty() ? MaybeLists{} : MaybeLists(ts);
  }
};

constexpr Master kMasters[] = {Master::kFp32Params, Master::kMasters,   Master::kNone,
                               Master::kKahan,      Master::kRemainder, Master::kStochastic};

TEST(MemoryTraffic, EveryAdamModeIsCoalescedAndMinimal) {
  at::manual_seed(1);
  std::printf("fused_adam_, aligned tensors (grads bf16; with GradScaler's unscale):\n");
  for (const Master master : kMasters) {
    for (const State state : {State::kFp32, State::kBf16, State::kEight}) {
      ModeLists s(master, state);
      const bool eight = state == State::kEight;
      const std::string what =
          std::string("adam ") + master_name(master) + ", " + state_name(state);
      expect_minimal(traced([&] {
                       entry::fused_adam_<EmulatedCudaEngine>(
                           s.params, s.grads, s.a, s.b, s.model, scalar(3.f), 1e-3, 0.9, 0.999,
                           1e-8, 1e-2, true, true, scalar(0.5f), scalar(0.f), std::nullopt,
                           s.opt(s.comps), s.opt(s.salts),
                           master == Master::kStochastic ? s.seed : std::nullopt, false,
                           std::nullopt, false, s.opt(s.rems), eight ? s.opt(s.sa) : MaybeLists{},
                           eight ? s.opt(s.sb) : MaybeLists{}, eight ? s.seed : std::nullopt);
                     }),
                     elements(), AdamOp::kDepth, what);
    }
  }
}

TEST(MemoryTraffic, EverySgdModeIsCoalescedAndMinimal) {
  at::manual_seed(2);
  std::printf("fused_sgd_ with momentum, aligned tensors (grads bf16):\n");
  for (const Master master : kMasters) {
    for (const State state : {State::kFp32, State::kBf16, State::kEight}) {
      ModeLists s(master, state);
      const bool eight = state == State::kEight;
      const std::string what = std::string("sgd ") + master_name(master) + ", " + state_name(state);
      const Tensor step = scalar(3.f);
      expect_minimal(traced([&] {
                       entry::fused_sgd_<EmulatedCudaEngine>(
                           s.params, s.grads, s.a, s.model, 0.01, 0.9, 0.0, 1e-4, false, false,
                           scalar(0.5f), scalar(0.f), false, s.opt(s.comps), s.opt(s.salts),
                           master == Master::kStochastic ? s.seed : std::nullopt,
                           s.salts.empty() ? std::optional<Tensor>{} : std::optional<Tensor>(step),
                           false, std::nullopt, false, s.opt(s.rems),
                           eight ? s.opt(s.sa) : MaybeLists{}, eight ? s.seed : std::nullopt);
                     }),
                     elements(), SgdOp::kDepth, what);
    }
  }
}

// The precision report's tallies (pointwise.h): the kernel a counted call runs (AdamW:
// its mode's counting kernel, Fixed<AdamOp, M, true>; SGD: the generic kernel; both
// launch_as) moves the mode's minimum, coalesced (the sums go to the tensors' words
// once per warp, not per element), and its tallies equal the CPU engine's: the same
// counts, the same sums to fp32 rounding (another order of addition).
TEST(MemoryTraffic, TalliesAddNoTrafficAndMatchTheCpuEngine) {
  at::manual_seed(4);
  std::printf("the precision report's tallies:\n");
  for (const Master master : {Master::kNone, Master::kStochastic, Master::kKahan}) {
    for (const State state : {State::kFp32, State::kBf16, State::kEight}) {
      for (const bool sgd : {false, true}) {
        const bool eight = state == State::kEight;
        const std::string what = std::string(sgd ? "sgd " : "adam ") + master_name(master) + ", " +
                                 state_name(state) + ", precision report";
        std::vector<Tensor> tallies[2];
        std::vector<Tensor> params[2];
        for (int engine = 0; engine < 2; ++engine) {
          at::manual_seed(5);  // (the same lists for both engines)
          ModeLists s(master, state);
          for (size_t i = 0; i < s.params.size(); ++i) {
            tallies[engine].push_back(at::zeros({4}, at::kDouble));
          }
          const Tensor step = scalar(3.f);
          const std::optional<Tensor> sgd_step =
              s.salts.empty() ? std::optional<Tensor>{} : std::optional<Tensor>(step);
          const MaybeLists sa = eight ? s.opt(s.sa) : MaybeLists{};
          const MaybeLists sb = eight ? s.opt(s.sb) : MaybeLists{};
          const std::optional<int64_t> state_seed = eight ? s.seed : std::nullopt;
          auto run = [&](auto engine_tag) {
            using E = decltype(engine_tag);
            if (sgd) {
              entry::fused_sgd_<E>(
                  s.params, s.grads, s.a, s.model, 0.01, 0.9, 0.0, 1e-4, false, false, scalar(0.5f),
                  scalar(0.f), false, s.opt(s.comps), s.opt(s.salts),
                  master == Master::kStochastic ? s.seed : std::nullopt, sgd_step, false,
                  std::nullopt, false, s.opt(s.rems), sa, state_seed, tallies[engine]);
            } else {
              entry::fused_adam_<E>(
                  s.params, s.grads, s.a, s.b, s.model, step, 1e-3, 0.9, 0.999, 1e-8, 1e-2, true,
                  true, scalar(0.5f), scalar(0.f), std::nullopt, s.opt(s.comps), s.opt(s.salts),
                  master == Master::kStochastic ? s.seed : std::nullopt, false, std::nullopt, false,
                  s.opt(s.rems), sa, sb, state_seed, tallies[engine]);
            }
          };
          if (engine == 0) {
            run(mixedprec::cpu::CpuEngine{});
          } else {
            expect_minimal(traced([&] { run(EmulatedCudaEngine{}); }), elements(),
                           sgd ? SgdOp::kDepth : AdamOp::kDepth, what);
          }
          params[engine] = s.params;
        }
        for (size_t i = 0; i < params[0].size(); ++i) {
          EXPECT_TRUE(at::equal(params[0][i], params[1][i])) << what << ", param " << i;
          const Tensor cpu = tallies[0][i], cuda = tallies[1][i];
          EXPECT_EQ(cpu[3].item<double>(), static_cast<double>(params[0][i].numel())) << what;
          EXPECT_EQ(cuda[3].item<double>(), cpu[3].item<double>()) << what;
          EXPECT_EQ(cuda[0].item<double>(), cpu[0].item<double>()) << what << ", param " << i;
          EXPECT_TRUE(at::allclose(cuda.slice(0, 1, 3), cpu.slice(0, 1, 3), 1e-5, 0)) << what;
          EXPECT_GT(cpu[2].item<double>(), 0.0) << what;
        }
        if (master == Master::kNone) {
          EXPECT_GT(tallies[0][0][0].item<double>(), 0.0) << what << ": bf16 loses updates";
        }
      }
    }
  }
}

TEST(MemoryTraffic, AdagradAndNovoGradAreCoalescedAndMinimal) {
  at::manual_seed(3);
  std::printf("fused_adagrad_ and fused_novograd_, aligned tensors (grads bf16):\n");
  for (const bool masters : {false, true}) {
    const auto params = tensors(at::kFloat);
    const auto grads = tensors(at::kBFloat16);
    const auto model = masters ? tensors(at::kBFloat16) : std::vector<Tensor>{};
    auto sums = tensors(at::kFloat);
    for (auto& t : sums) t = t.abs();
    const std::string how = masters ? "fp32 masters" : "fp32 params";
    expect_minimal(traced([&] {
                     entry::fused_adagrad_<EmulatedCudaEngine>(params, grads, sums, model, 0.01,
                                                               1e-10, 0.1, false, scalar(0.5f),
                                                               scalar(0.f));
                   }),
                   elements(), AdagradOp::kDepth, "adagrad " + how);
    const auto exp_avgs = tensors(at::kFloat, 0.1);
    const Tensor exp_avg_sq = at::rand({static_cast<int64_t>(params.size())});
    expect_minimal(traced([&] {
                     entry::fused_novograd_<EmulatedCudaEngine>(
                         params, grads, exp_avgs, model, exp_avg_sq, scalar(3.f), 1e-3, 0.9, 0.999,
                         1e-8, 0.01, true, true, false, 2, false, scalar(0.5f), scalar(0.f));
                   }),
                   elements(), NovoGradOp::kDepth, "novograd " + how);
  }
}

// --- the planted kernel: the 8-bit path as it was ----------------------------------------

// The 8-bit block path before 2026-11-27, reduced to its access pattern: each thread
// takes whole blocks of kQuantBlock elements, one element at a time (here: loads only,
// of list 0 and of the 8-bit list 1, with its scale).
struct PerThreadBlocksEngine : mixedprec::cpu::CpuEngine {
  static void run_planted(const Tensor& values, const Tensor& codes, const Tensor& scales) {
    const Lists<2> lists{at::TensorList(values), at::TensorList(codes)};
    for_each_launch<2>(lists, [&](const TensorListMeta<2>& meta, int num_blocks, int64_t) {
      ++g_launches;
      blockDim.x = kBlockSize;
      for (int64_t b = 0; b < grid_blocks<kBlocksPerChunk>(num_blocks); ++b) {
        blockIdx.x = static_cast<unsigned>(b);
        for (int t = 0; t < kBlockSize; ++t) {
          threadIdx.x = static_cast<unsigned>(t);
          const Chunk c = block_chunk<kBlocksPerChunk>(meta);
          const auto* v = static_cast<const float*>(meta.ptrs[0][c.slot]);
          const auto* q = static_cast<const E4m3*>(meta.ptrs[1][c.slot]);
          const auto* s = static_cast<const uint8_t*>(scales.data_ptr());
          const int lane = t % kWarpSize;
          for (int64_t start = int64_t{t} * kQuantBlock; start < c.size;
               start += int64_t{kBlockSize} * kQuantBlock) {
            const int64_t i0 = c.start + start;
            MP_TRACE(2, lane, s + i0 / kQuantBlock, 1, false);
            for (int j = 0; j < kQuantBlock; ++j) {
              MP_TRACE(0, lane, v + i0 + j, 4, false);
              MP_TRACE(1, lane, q + i0 + j, 1, false);
            }
          }
        }
      }
    });
  }
};

TEST(MemoryTraffic, ThePlantedPerThreadBlockPathFails) {
  const Tensor values = at::randn({kChunkSize});
  const Tensor codes = values.to(at::kFloat8_e4m3fn);
  const Tensor scales = at::full({kChunkSize / kQuantBlock}, 127, at::kByte);
  const auto lists = traced([&] { PerThreadBlocksEngine::run_planted(values, codes, scales); });
  const ListTraffic& fp32 = lists.at({0, false});
  const ListTraffic& eight = lists.at({1, false});
  // Every request of the element lists touches a sector per lane: 32 sectors where 4
  // or 5 (fp32: 128 bytes, depending on the first one's place in its sector) or 1 or 2
  // (8-bit) would do; each byte is still moved once.
  EXPECT_EQ(fp32.uncoalesced, fp32.requests);
  EXPECT_EQ(fp32.sectors, 32 * fp32.requests);
  EXPECT_LE(fp32.ideal_sectors, 5 * fp32.requests);
  EXPECT_EQ(eight.uncoalesced, eight.requests);
  EXPECT_EQ(eight.sectors, 32 * eight.requests);
  EXPECT_EQ(fp32.request_bytes, fp32.bytes);
  std::printf(
      "planted per-thread blocks: fp32 list %.1f sectors per request (ideal %.1f), "
      "8-bit list %.1f (ideal %.1f)\n",
      static_cast<double>(fp32.sectors) / fp32.requests,
      static_cast<double>(fp32.ideal_sectors) / fp32.requests,
      static_cast<double>(eight.sectors) / eight.requests,
      static_cast<double>(eight.ideal_sectors) / eight.requests);
}

}  // namespace
}  // namespace mixedprec::cuda
