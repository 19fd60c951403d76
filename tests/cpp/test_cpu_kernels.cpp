// The CPU kernels called directly (the entries of csrc/ops/ on the CPU engine, as
// registered for the CPU key), their validation, and the registration of every
// schema with the dispatcher.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/engine.h"
#include "cpu_entries.h"
#include "multi_tensor_plan.h"
#include "ops/all.h"

namespace mixedprec {
namespace cpu {
namespace {

constexpr auto multi_tensor_unscale_ = &entry::multi_tensor_unscale_<CpuEngine>;
constexpr auto multi_tensor_unscale_to_ = &entry::multi_tensor_unscale_to_<CpuEngine>;
constexpr auto multi_tensor_check_finite_ = &entry::multi_tensor_check_finite_<CpuEngine>;
constexpr auto multi_tensor_copy_ = &entry::multi_tensor_copy_<CpuEngine>;
constexpr auto multi_tensor_l2norm = &entry::multi_tensor_l2norm<CpuEngine>;
// (Functions, not pointers, so that the trailing defaults, as the schemas', apply.)
void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList model_params, double lr, double momentum, double dampening,
                double weight_decay, bool nesterov, bool first_run,
                const std::optional<at::Tensor>& inv_scale,
                const std::optional<at::Tensor>& found_inf, bool wd_after_momentum,
                std::optional<at::TensorList> kahan_comps = std::nullopt) {
  entry::fused_sgd_<CpuEngine>(params, grads, momentum_buffers, model_params, lr, momentum,
                               dampening, weight_decay, nesterov, first_run, inv_scale, found_inf,
                               wd_after_momentum, kahan_comps);
}
void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList model_params, const at::Tensor& step,
                 double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                 bool bias_correction, const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& lr_tensor,
                 std::optional<at::TensorList> kahan_comps = std::nullopt) {
  entry::fused_adam_<CpuEngine>(params, grads, exp_avgs, exp_avg_sqs, model_params, step, lr, beta1,
                                beta2, eps, weight_decay, adamw, bias_correction, inv_scale,
                                found_inf, lr_tensor, kahan_comps);
}
constexpr auto fused_lamb_ = &entry::fused_lamb_<CpuEngine>;
constexpr auto sum_fp32 = &entry::sum_fp32<CpuEngine>;
constexpr auto update_loss_scale_ = &entry::update_loss_scale_<CpuEngine>;
constexpr auto fused_adagrad_ = &entry::fused_adagrad_<CpuEngine>;
constexpr auto fused_novograd_ = &entry::fused_novograd_<CpuEngine>;

}  // namespace
}  // namespace cpu

namespace {

using at::Tensor;

const float kInf = std::numeric_limits<float>::infinity();

Tensor scalar(float v) { return at::full({1}, v, at::kFloat); }
// Stochastic rounding's words of one tensor (pointwise.h's RoundingWords).
Tensor words(int64_t salt, int64_t offset = 0, int64_t run = 0, int64_t stride = 0) {
  return at::tensor({salt, offset, run, stride}, at::kLong);
}
Tensor counter(int32_t v) { return at::full({1}, v, at::kInt); }
float value(const Tensor& t) { return t.item<float>(); }

std::vector<Tensor> clones(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}

void expect_same(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << "tensor " << i << " changed";
  }
}

void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol,
                  const std::string& what = "") {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  EXPECT_TRUE(at::allclose(g, w, rtol, atol))
      << what << ": max abs error " << (g - w).abs().max().item<double>() << ", max relative error "
      << ((g - w).abs() / w.abs()).max().item<double>();
}

// Runs f, which must throw a c10::Error whose message names `name`.
template <class F>
void expect_error_naming(F&& f, const std::string& name) {
  try {
    f();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find(name), std::string::npos) << "message does not name " << name << ": " << msg;
    return;
  }
  ADD_FAILURE() << "expected a c10::Error naming " << name;
}

// ---------------------------------------------------------------- registration

TEST(Registration, EveryOpHasASchemaAndACpuKernel) {
  const char* ops[] = {"multi_tensor_unscale_",
                       "multi_tensor_unscale_to_",
                       "multi_tensor_check_finite_",
                       "multi_tensor_copy_",
                       "multi_tensor_l2norm",
                       "fused_sgd_",
                       "fused_adam_",
                       "fused_lamb_",
                       "sum_fp32",
                       "update_loss_scale_",
                       "fused_adagrad_",
                       "fused_novograd_"};
  for (const char* op : ops) {
    const auto handle =
        c10::Dispatcher::singleton().findSchema({std::string("mixedprec::") + op, ""});
    ASSERT_TRUE(handle.has_value()) << op;
    EXPECT_TRUE(handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) << op;
  }
}

// ------------------------------------------------------------ multi-tensor ops

TEST(MultiTensorUnscale, MultipliesInPlace) {
  std::vector<Tensor> ts = {at::arange(10, at::kFloat), at::full({kChunkSize + 3}, 8.f),
                            at::empty({0})};
  const auto want = clones(ts);
  const Tensor found_inf = scalar(0.f);
  cpu::multi_tensor_unscale_(ts, found_inf, scalar(0.125f));
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(at::equal(ts[i], want[i] * 0.125f));
  EXPECT_EQ(value(found_inf), 0.f);
}

TEST(MultiTensorUnscale, NonFiniteSetsFoundInfAndNeverClearsIt) {
  for (int64_t where : {int64_t{0}, kChunkSize, 2 * kChunkSize}) {
    std::vector<Tensor> ts = {at::ones({7}), at::ones({2 * kChunkSize + 1})};
    ts[1][where] = where == kChunkSize ? std::nanf("") : kInf;
    const Tensor found_inf = scalar(0.f);
    cpu::multi_tensor_unscale_(ts, found_inf, scalar(0.5f));
    EXPECT_EQ(value(found_inf), 1.f) << "non-finite at " << where;
  }
  std::vector<Tensor> finite = {at::ones({3})};
  const Tensor found_inf = scalar(1.f);
  cpu::multi_tensor_unscale_(finite, found_inf, scalar(0.5f));
  EXPECT_EQ(value(found_inf), 1.f);
}

TEST(MultiTensorUnscale, HalfAndMixedLists) {
  std::vector<Tensor> ts = {at::full({100}, 1024.f, at::kHalf), at::full({5}, 3.f, at::kBFloat16),
                            at::full({5}, 2.f)};
  const Tensor found_inf = scalar(0.f);
  cpu::multi_tensor_unscale_(ts, found_inf, scalar(0.125f));
  EXPECT_TRUE(at::equal(ts[0], at::full({100}, 128.f, at::kHalf)));
  EXPECT_TRUE(at::equal(ts[1], at::full({5}, 0.375f, at::kBFloat16)));
  EXPECT_TRUE(at::equal(ts[2], at::full({5}, 0.25f)));
  EXPECT_EQ(value(found_inf), 0.f);
}

TEST(MultiTensorUnscaleTo, HalfIntoFloat) {
  const std::vector<Tensor> src = {at::randn({kChunkSize + 1}).to(at::kHalf),
                                   at::randn({33}).to(at::kHalf)};
  const auto src_before = clones(src);
  std::vector<Tensor> dst = {at::empty({kChunkSize + 1}), at::empty({33})};
  const Tensor found_inf = scalar(0.f);
  cpu::multi_tensor_unscale_to_(src, dst, found_inf, scalar(0.25f));
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_TRUE(at::equal(dst[i], src[i].to(at::kFloat) * 0.25f));
  }
  expect_same(src, src_before);
  EXPECT_EQ(value(found_inf), 0.f);

  src[1][32] = kInf;
  cpu::multi_tensor_unscale_to_(src, dst, found_inf, scalar(0.25f));
  EXPECT_EQ(value(found_inf), 1.f);
}

TEST(MultiTensorCheckFinite, ReportsNonFiniteAndWritesNothingElse) {
  const std::vector<Tensor> ts = {at::randn({9}), at::randn({2 * kChunkSize + 1}).to(at::kHalf),
                                  at::randn({4}).to(at::kBFloat16)};
  const auto before = clones(ts);
  const Tensor found_inf = scalar(0.f);
  cpu::multi_tensor_check_finite_(ts, found_inf);
  EXPECT_EQ(value(found_inf), 0.f);
  expect_same(ts, before);

  ts[1][2 * kChunkSize] = std::nanf("");
  cpu::multi_tensor_check_finite_(ts, found_inf);
  EXPECT_EQ(value(found_inf), 1.f);
  ts[1][2 * kChunkSize] = 0.f;
  cpu::multi_tensor_check_finite_(ts, found_inf);
  EXPECT_EQ(value(found_inf), 1.f) << "found_inf must never be cleared";
}

TEST(MultiTensorCopy, CastsLikeTo) {
  const std::vector<Tensor> src = {at::randn({kChunkSize + 5}), at::randn({17}),
                                   at::randn({4}).to(at::kBFloat16)};
  std::vector<Tensor> dst = {at::empty({kChunkSize + 5}, at::kBFloat16), at::empty({17}, at::kHalf),
                             at::empty({4})};
  cpu::multi_tensor_copy_(src, dst);
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_TRUE(at::equal(dst[i], src[i].to(dst[i].scalar_type()))) << "pair " << i;
  }
}

TEST(MultiTensorL2Norm, MatchesDoubleReference) {
  const std::vector<Tensor> ts = {at::randn({kChunkSize + 7}), at::empty({0}),
                                  at::randn({1000}).to(at::kHalf),
                                  at::randn({3 * kChunkSize}).to(at::kBFloat16)};
  for (const std::optional<Tensor>& inv_scale :
       {std::optional<Tensor>(), std::optional<Tensor>(scalar(0.5f))}) {
    const double s = inv_scale.has_value() ? 0.5 : 1.0;
    const auto [norm, per] = cpu::multi_tensor_l2norm(ts, inv_scale, /*per_tensor=*/true);
    EXPECT_EQ(norm.scalar_type(), at::kFloat);
    EXPECT_EQ(per.scalar_type(), at::kFloat);
    ASSERT_EQ(norm.sizes(), at::IntArrayRef({1}));
    ASSERT_EQ(per.sizes(), at::IntArrayRef({4}));
    std::vector<Tensor> want_per;
    for (const auto& t : ts) want_per.push_back(at::linalg_vector_norm(t.to(at::kDouble) * s));
    expect_close(per, at::stack(want_per), 1e-6, 0);
    expect_close(norm, at::linalg_vector_norm(at::stack(want_per)).reshape({1}), 1e-6, 0);
  }
  const auto [norm, per] = cpu::multi_tensor_l2norm(ts, std::nullopt, /*per_tensor=*/false);
  EXPECT_EQ(per.numel(), 0);
  EXPECT_GT(value(norm), 0.f);
}

// ------------------------------------------------------------ per-tensor lists

// x[0] = x[0] * scale + shift, copied into list 1, with scale and shift per tensor
// (lists 2 and 3); reports a non-finite scale.
struct AffinePerTensorOp {
  static constexpr int kDepth = 4;  // data, out, scale, shift
  static constexpr unsigned kReads = 0b1101;
  static constexpr unsigned kWrites = 0b0011;
  static constexpr unsigned kPerTensor = 0b1100;
  void resolve() {}
  template <typename V>
  typename Lanes<V>::Flag apply(V* x) const {
    x[0] = x[0] * x[2] + x[3];
    x[1] = x[0];
    return Lanes<V>::not_finite(x[2]);
  }
};
static_assert(per_tensor_mask<AffinePerTensorOp>() == 0b1100);
static_assert(per_tensor_mask<AdagradOp>() == 0, "functors without the member have none");

template <typename T>
void expect_affine_per_tensor() {
  const std::vector<int64_t> sizes = {2 * kChunkSize + 37, 1, 0, 100, kChunkSize};
  std::vector<Tensor> data, out, want;
  const Tensor scales = at::randn({static_cast<int64_t>(sizes.size())});
  const Tensor shifts = at::randn({static_cast<int64_t>(sizes.size())});
  for (size_t i = 0; i < sizes.size(); ++i) {
    data.push_back(at::randn({sizes[i]}).to(c10::CppTypeToScalarType<T>::value));
    out.push_back(at::empty({sizes[i]}, at::kFloat));
    want.push_back(data.back().to(at::kFloat) * scales[i] + shifts[i]);  // in fp32
  }
  const std::vector<Tensor> scale_list = scales.unbind(0), shift_list = shifts.unbind(0);
  const Lists<4> lists{data, out, scale_list, shift_list};
  const Tensor found_inf = scalar(0.f);
  using Engine = cpu::CpuEngine;
  Engine::run<AffinePerTensorOp, T, float, float, float>(lists, AffinePerTensorOp{}, nullptr,
                                                         found_inf.data_ptr<float>());
  EXPECT_EQ(value(found_inf), 0.f);
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_TRUE(at::equal(data[i], want[i].to(data[i].dtype()))) << "tensor " << i;
    EXPECT_TRUE(at::equal(out[i], want[i])) << "tensor " << i;
  }
  EXPECT_TRUE(at::equal(scales.unbind(0)[0], lists[2][0])) << "a per-tensor list was written";
  // A non-finite per-tensor value is reported like any input; a skip writes nothing.
  lists[2][3].fill_(kInf);
  const auto before = clones(data);
  Engine::run<AffinePerTensorOp, T, float, float, float>(
      lists, AffinePerTensorOp{}, scalar(1.f).data_ptr<float>(), found_inf.data_ptr<float>());
  expect_same(data, before);
  EXPECT_EQ(value(found_inf), 0.f);
  Engine::run<AffinePerTensorOp, T, float, float, float>(lists, AffinePerTensorOp{}, nullptr,
                                                         found_inf.data_ptr<float>());
  EXPECT_EQ(value(found_inf), 1.f);
}

TEST(PerTensorLists, BroadcastOverEveryElementOfTheirTensor) {
  expect_affine_per_tensor<float>();
  expect_affine_per_tensor<c10::Half>();
  expect_affine_per_tensor<c10::BFloat16>();
}

TEST(PerTensorLists, CheckerWantsOneFloatScalarPerTensor) {
  const std::vector<Tensor> params = {at::ones({4}), at::ones({3})};
  const auto check = [&](const std::vector<Tensor>& values) {
    Checker c("test_op");
    c.list(params, "params", kFloats);
    c.per_tensor(values, "norms", params, "params");
  };
  check({scalar(1.f), scalar(2.f)});
  check(at::ones({2}).unbind(0));
  expect_error_naming([&] { check({scalar(1.f)}); }, "norms");
  expect_error_naming([&] { check({scalar(1.f), at::ones({2})}); }, "norms[1]");
  expect_error_naming([&] { check({at::ones({1}, at::kHalf), scalar(1.f)}); }, "norms[0]");
  expect_error_naming([&] { check({scalar(1.f), at::ones({1}, at::kMeta)}); }, "norms[1]");
}

// --------------------------------------------------------------- optimizers

TEST(FusedSgd, OneStepMatchesTheFormula) {
  const float lr = 0.1f, momentum = 0.9f, dampening = 0.1f, weight_decay = 0.01f;
  const float inv_scale = 0.5f;
  for (bool nesterov : {false, true}) {
    const float damp = nesterov ? 0.f : dampening;
    std::vector<Tensor> params = {at::randn({kChunkSize + 2}), at::randn({9})};
    std::vector<Tensor> grads = {at::randn({kChunkSize + 2}).to(at::kHalf),
                                 at::randn({9}).to(at::kHalf)};
    std::vector<Tensor> bufs = {at::randn({kChunkSize + 2}), at::randn({9})};
    std::vector<Tensor> model = {at::empty({kChunkSize + 2}, at::kHalf), at::empty({9}, at::kHalf)};
    const auto p0 = clones(params), b0 = clones(bufs);
    cpu::fused_sgd_(params, grads, bufs, model, lr, momentum, damp, weight_decay, nesterov,
                    /*first_run=*/false, scalar(inv_scale), scalar(0.f), false);
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor g = grads[i].to(at::kDouble) * inv_scale + weight_decay * p0[i].to(at::kDouble);
      const Tensor buf = b0[i].to(at::kDouble) * momentum + (1 - damp) * g;
      const Tensor step = nesterov ? g + momentum * buf : buf;
      const Tensor p = p0[i].to(at::kDouble) - lr * step;
      expect_close(bufs[i], buf, 1e-5, 1e-6, "momentum_buffers");
      expect_close(params[i], p, 1e-5, 1e-6, "params");
      EXPECT_TRUE(at::equal(model[i], params[i].to(at::kHalf)));
    }
  }
}

TEST(FusedSgd, FirstRunStartsTheBufferAtTheGradient) {
  std::vector<Tensor> params = {at::randn({50})};
  std::vector<Tensor> grads = {at::randn({50})};
  std::vector<Tensor> bufs = {at::full({50}, 123.f)};
  const Tensor p0 = params[0].clone();
  cpu::fused_sgd_(params, grads, bufs, {}, 0.1, 0.9, 0.0, 0.0, false, /*first_run=*/true,
                  std::nullopt, std::nullopt, false);
  EXPECT_TRUE(at::equal(bufs[0], grads[0]));
  expect_close(params[0], p0.to(at::kDouble) - 0.1 * grads[0].to(at::kDouble), 1e-6, 1e-7);
}

TEST(FusedSgd, FoundInfSkipsEverything) {
  std::vector<Tensor> params = {at::randn({20})}, grads = {at::randn({20})},
                      bufs = {at::randn({20})}, model = {at::zeros({20}, at::kHalf)};
  const auto p0 = clones(params), b0 = clones(bufs), m0 = clones(model);
  cpu::fused_sgd_(params, grads, bufs, model, 0.1, 0.9, 0.0, 0.0, false, false, scalar(1.f),
                  scalar(1.f), false);
  expect_same(params, p0);
  expect_same(bufs, b0);
  expect_same(model, m0);
}

struct AdamCase {
  std::vector<Tensor> params, grads, exp_avgs, exp_avg_sqs, model;
  Tensor step;
};

AdamCase adam_case(float step) {
  AdamCase c;
  for (int64_t n : {kChunkSize + 1, int64_t{31}}) {
    c.params.push_back(at::randn({n}));
    c.grads.push_back(at::randn({n}).to(at::kBFloat16));
    c.exp_avgs.push_back(at::randn({n}) * 0.1);
    c.exp_avg_sqs.push_back(at::rand({n}) * 0.01);
    c.model.push_back(at::empty({n}, at::kBFloat16));
  }
  c.step = scalar(step);
  return c;
}

TEST(FusedAdam, OneStepMatchesTheFormula) {
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0.01, inv_scale = 0.25;
  for (bool adamw : {false, true}) {
    AdamCase c = adam_case(4.f);
    const auto p0 = clones(c.params), m0 = clones(c.exp_avgs), v0 = clones(c.exp_avg_sqs);
    cpu::fused_adam_(c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.model, c.step, lr, beta1,
                     beta2, eps, wd, adamw, /*bias_correction=*/true, scalar(inv_scale),
                     scalar(0.f), std::nullopt);
    EXPECT_EQ(value(c.step), 5.f);
    const double step = 5, bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
    for (size_t i = 0; i < c.params.size(); ++i) {
      Tensor p = p0[i].to(at::kDouble);
      Tensor g = c.grads[i].to(at::kDouble) * inv_scale;
      if (adamw) {
        p = p * (1 - lr * wd);
      } else {
        g = g + wd * p;
      }
      const Tensor m = m0[i].to(at::kDouble) * beta1 + (1 - beta1) * g;
      const Tensor v = v0[i].to(at::kDouble) * beta2 + (1 - beta2) * g * g;
      p = p - (lr / bc1) * m / (v.sqrt() / std::sqrt(bc2) + eps);
      expect_close(c.exp_avgs[i], m, 1e-5, 1e-7, "exp_avgs");
      expect_close(c.exp_avg_sqs[i], v, 1e-5, 1e-9, "exp_avg_sqs");
      expect_close(c.params[i], p, 1e-5, 1e-6, "params");
      EXPECT_TRUE(at::equal(c.model[i], c.params[i].to(at::kBFloat16)));
    }
  }
}

TEST(FusedAdam, FoundInfLeavesEverythingIdentical) {
  AdamCase c = adam_case(7.f);
  const auto p0 = clones(c.params), m0 = clones(c.exp_avgs), v0 = clones(c.exp_avg_sqs),
             model0 = clones(c.model);
  cpu::fused_adam_(c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.model, c.step, 1e-3, 0.9, 0.999,
                   1e-8, 0.0, true, true, scalar(1.f), scalar(1.f), std::nullopt);
  EXPECT_EQ(value(c.step), 7.f);
  expect_same(c.params, p0);
  expect_same(c.exp_avgs, m0);
  expect_same(c.exp_avg_sqs, v0);
  for (size_t i = 0; i < c.model.size(); ++i) {
    // bitwise: uninitialised bf16 memory may hold NaNs, which at::equal treats as unequal
    EXPECT_EQ(std::memcmp(c.model[i].data_ptr(), model0[i].data_ptr(), c.model[i].nbytes()), 0);
  }
}

// LAMB in double, from the math (Apex's multi_tensor_lamb): returns p, m, v.
std::vector<Tensor> lamb_reference(const Tensor& p32, const Tensor& g16, const Tensor& m32,
                                   const Tensor& v32, double step, double lr, double wd, bool adamw,
                                   bool nvlamb, double inv_scale, double clip) {
  const double beta1 = 0.9, beta2 = 0.999, eps = 1e-6;
  const Tensor p = p32.to(at::kDouble);
  Tensor g = g16.to(at::kDouble) * inv_scale / clip;
  if (!adamw) g = g + wd * p;
  const Tensor m = m32.to(at::kDouble) * beta1 + (1 - beta1) * g;
  const Tensor v = v32.to(at::kDouble) * beta2 + (1 - beta2) * g * g;
  Tensor u = (m / (1 - std::pow(beta1, step))) / ((v / (1 - std::pow(beta2, step))).sqrt() + eps);
  if (adamw) u = u + wd * p;
  double ratio = lr;
  const double pn = p.norm().item<double>(), un = u.norm().item<double>();
  if ((nvlamb || wd != 0) && pn != 0 && un != 0) ratio = lr * pn / un;
  return {p - ratio * u, m, v};
}

TEST(FusedLamb, OneStepMatchesTheFormula) {
  const double lr = 1e-2, inv_scale = 0.25, max_grad_norm = 1.0;
  for (const auto& [wd, adamw, nvlamb] :
       {std::tuple{0.01, true, false}, std::tuple{0.01, false, false}, std::tuple{0.0, true, true},
        std::tuple{0.0, true, false}}) {
    AdamCase c = adam_case(2.f);
    const auto p0 = clones(c.params), m0 = clones(c.exp_avgs), v0 = clones(c.exp_avg_sqs);
    // A global norm above max_grad_norm: gradients are divided by it.
    const Tensor grad_norm = scalar(3.f);
    cpu::fused_lamb_(c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.model, c.step, lr, 0.9, 0.999,
                     1e-6, wd, adamw, /*bias_correction=*/true, /*grad_averaging=*/true, nvlamb,
                     grad_norm, max_grad_norm, scalar(inv_scale), scalar(0.f));
    EXPECT_EQ(value(c.step), 3.f);
    for (size_t i = 0; i < c.params.size(); ++i) {
      const auto want =
          lamb_reference(p0[i], c.grads[i], m0[i], v0[i], 3, lr, wd, adamw, nvlamb, inv_scale, 3.0);
      expect_close(c.exp_avgs[i], want[1], 1e-5, 1e-7, "exp_avgs");
      expect_close(c.exp_avg_sqs[i], want[2], 1e-5, 1e-9, "exp_avg_sqs");
      expect_close(c.params[i], want[0], 1e-5, 1e-6, "params");
      EXPECT_TRUE(at::equal(c.model[i], c.params[i].to(at::kBFloat16)));
    }
  }
}

TEST(FusedLamb, FoundInfLeavesEverythingIdentical) {
  AdamCase c = adam_case(7.f);
  const auto p0 = clones(c.params), m0 = clones(c.exp_avgs), v0 = clones(c.exp_avg_sqs);
  const auto model0 = clones(c.model);
  cpu::fused_lamb_(c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.model, c.step, 1e-3, 0.9, 0.999,
                   1e-6, 0.01, true, true, true, false, scalar(kInf), 1.0, scalar(1.f),
                   scalar(1.f));
  EXPECT_EQ(value(c.step), 7.f);
  expect_same(c.params, p0);
  expect_same(c.exp_avgs, m0);
  expect_same(c.exp_avg_sqs, v0);
  for (size_t i = 0; i < c.model.size(); ++i) {
    EXPECT_EQ(std::memcmp(c.model[i].data_ptr(), model0[i].data_ptr(), c.model[i].nbytes()), 0);
  }
}

// -------------------------------------------------------- reduction, loss scale

TEST(SumFp32, HalfSumIsExact) {
  // The same sum in fp16 rounds to 16384: the reason for the op.
  const Tensor x = at::full({4095}, 4.f, at::kHalf);
  const Tensor s = cpu::sum_fp32(x, std::nullopt, false);
  EXPECT_EQ(s.scalar_type(), at::kFloat);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item<float>(), 16380.f);
  EXPECT_EQ(x.sum().item<float>(), 16384.f);
}

TEST(SumFp32, DimAndKeepdim) {
  const Tensor x = at::randn({3, 5, 7}).to(at::kBFloat16);
  const std::vector<int64_t> dims = {0, 2};
  const Tensor s = cpu::sum_fp32(x, dims, true);
  EXPECT_EQ(s.sizes(), at::IntArrayRef({1, 5, 1}));
  expect_close(s, x.to(at::kDouble).sum(dims, true), 1e-5, 1e-5);
  EXPECT_EQ(cpu::sum_fp32(at::ones({4}, at::kDouble), std::nullopt, false).scalar_type(),
            at::kDouble);
}

struct LossScale {
  Tensor scale = scalar(1024.f), growth = counter(0), hysteresis = counter(1);
  void update(float found_inf, int64_t interval = 3, int64_t hyst = 1, double min = 0,
              double max = kInf) {
    cpu::update_loss_scale_(scale, growth, hysteresis, scalar(found_inf), 2.0, 0.5, interval, hyst,
                            min, max);
  }
};

TEST(UpdateLossScale, BackoffOnOverflow) {
  LossScale s;
  s.growth.fill_(2);
  s.update(1.f);
  EXPECT_EQ(value(s.scale), 512.f);
  EXPECT_EQ(s.growth.item<int32_t>(), 0);
}

TEST(UpdateLossScale, GrowthAfterInterval) {
  LossScale s;
  s.update(0.f);
  s.update(0.f);
  EXPECT_EQ(value(s.scale), 1024.f);
  EXPECT_EQ(s.growth.item<int32_t>(), 2);
  s.update(0.f);
  EXPECT_EQ(value(s.scale), 2048.f);
  EXPECT_EQ(s.growth.item<int32_t>(), 0);
}

TEST(UpdateLossScale, Hysteresis) {
  LossScale s;
  s.hysteresis.fill_(2);
  s.update(1.f, 3, 2);
  EXPECT_EQ(value(s.scale), 1024.f);
  EXPECT_EQ(s.hysteresis.item<int32_t>(), 1);
  s.update(1.f, 3, 2);
  EXPECT_EQ(value(s.scale), 512.f);
  s.update(0.f, 3, 2);
  EXPECT_EQ(s.hysteresis.item<int32_t>(), 2);
}

TEST(UpdateLossScale, FloorAndCeiling) {
  LossScale s;
  s.update(1.f, 3, 1, /*min=*/800.0);
  EXPECT_EQ(value(s.scale), 800.f);
  s.update(1.f, 3, 1, /*min=*/800.0);
  EXPECT_EQ(value(s.scale), 800.f);
  for (int i = 0; i < 3; ++i) s.update(0.f, 3, 1, 0.0, /*max=*/1000.0);
  EXPECT_EQ(value(s.scale), 1000.f);
  for (int i = 0; i < 3; ++i) s.update(0.f, 3, 1, 0.0, /*max=*/1000.0);
  EXPECT_EQ(value(s.scale), 1000.f);
}

TEST(UpdateLossScale, NoGrowthToInfinity) {
  LossScale s;
  s.scale.fill_(std::numeric_limits<float>::max());
  for (int i = 0; i < 3; ++i) s.update(0.f);
  EXPECT_EQ(value(s.scale), std::numeric_limits<float>::max());
}

// ----------------------------------------------------------------- validation

TEST(Validation, MultiTensorOps) {
  std::vector<Tensor> ts = {at::ones({4}), at::ones({4}, at::kInt)};
  const Tensor found_inf = scalar(0.f);
  expect_error_naming([&] { cpu::multi_tensor_unscale_(ts, found_inf, scalar(0.5f)); },
                      "tensors[1]");
  EXPECT_TRUE(at::equal(ts[0], at::ones({4})));
  EXPECT_EQ(value(found_inf), 0.f);

  expect_error_naming([&] { cpu::multi_tensor_check_finite_(ts, found_inf); }, "tensors[1]");
  expect_error_naming([&] { cpu::multi_tensor_check_finite_({ts[0]}, at::zeros({1}, at::kHalf)); },
                      "found_inf");
  EXPECT_EQ(value(found_inf), 0.f);

  std::vector<Tensor> ok = {at::ones({4})};
  expect_error_naming(
      [&] { cpu::multi_tensor_unscale_(ok, at::zeros({1}, at::kDouble), scalar(0.5f)); },
      "found_inf");
  expect_error_naming([&] { cpu::multi_tensor_unscale_(ok, found_inf, at::ones({2})); },
                      "inv_scale");
  const Tensor strided = at::ones({8}).slice(0, 0, 8, 2);
  expect_error_naming(
      [&] { cpu::multi_tensor_unscale_({ok[0], strided}, found_inf, scalar(0.5f)); }, "tensors[1]");
  EXPECT_TRUE(at::equal(ok[0], at::ones({4})));

  const std::vector<Tensor> src = {at::full({4}, 3.f), at::full({5}, 3.f)};
  std::vector<Tensor> dst = {at::zeros({4}), at::zeros({6})};
  expect_error_naming([&] { cpu::multi_tensor_unscale_to_(src, dst, found_inf, scalar(1.f)); },
                      "dst[1]");
  expect_error_naming([&] { cpu::multi_tensor_unscale_to_(src, {dst[0]}, found_inf, scalar(1.f)); },
                      "dst");
  expect_error_naming([&] { cpu::multi_tensor_copy_(src, dst); }, "dst[1]");
  expect_error_naming([&] { cpu::multi_tensor_copy_(src, {dst[0], at::empty({5}, at::kMeta)}); },
                      "dst[1]");
  EXPECT_TRUE(at::equal(dst[0], at::zeros({4})));

  const Tensor a = at::ones({2, 3}), b = at::zeros({3, 2}).t();  // same numel, other order
  expect_error_naming([&] { cpu::multi_tensor_copy_({a}, {b}); }, "dst[0]");
  EXPECT_TRUE(at::equal(b, at::zeros({2, 3})));

  expect_error_naming([&] { cpu::multi_tensor_l2norm(ok, at::ones({1}, at::kHalf), false); },
                      "inv_scale");
  expect_error_naming([&] { cpu::multi_tensor_l2norm({at::ones({2}, at::kLong)}, {}, false); },
                      "tensors[0]");
}

// --------------------------------------------------------------- lean precision

// Bits of a bf16 tensor (NaN-safe comparison).
bool same_bits(const Tensor& a, const Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.view(at::kShort), b.view(at::kShort));
}

// bf16 moments hold what the fp32 moments hold after the same step, rounded; the
// update itself (fp32 math from the same values) is the same, bit for bit.
TEST(LeanPrecision, Bf16MomentsStoreTheRoundedFp32Moments) {
  AdamCase c = adam_case(2.f);
  for (auto& m : c.exp_avgs) m = m.to(at::kBFloat16).to(at::kFloat);  // bf16 values
  for (auto& v : c.exp_avg_sqs) v = v.to(at::kBFloat16).to(at::kFloat);
  AdamCase lean = c;
  lean.params = clones(c.params);
  lean.model = clones(c.model);
  lean.step = scalar(2.f);
  lean.exp_avgs.clear();
  lean.exp_avg_sqs.clear();
  for (size_t i = 0; i < c.params.size(); ++i) {
    lean.exp_avgs.push_back(c.exp_avgs[i].to(at::kBFloat16));
    lean.exp_avg_sqs.push_back(c.exp_avg_sqs[i].to(at::kBFloat16));
  }
  for (AdamCase* k : {&c, &lean}) {
    cpu::fused_adam_(k->params, k->grads, k->exp_avgs, k->exp_avg_sqs, k->model, k->step, 1e-3, 0.9,
                     0.999, 1e-8, 1e-2, true, true, scalar(0.5f), scalar(0.f), std::nullopt,
                     std::nullopt);
  }
  for (size_t i = 0; i < c.params.size(); ++i) {
    EXPECT_TRUE(at::equal(lean.params[i], c.params[i])) << "params[" << i << "]";
    EXPECT_TRUE(same_bits(lean.exp_avgs[i], c.exp_avgs[i].to(at::kBFloat16)));
    EXPECT_TRUE(same_bits(lean.exp_avg_sqs[i], c.exp_avg_sqs[i].to(at::kBFloat16)));
  }
  // SGD's momentum buffers likewise.
  std::vector<Tensor> params = {at::randn({kChunkSize + 3})}, grads = {at::randn({kChunkSize + 3})};
  std::vector<Tensor> bufs = {at::randn({kChunkSize + 3}).to(at::kBFloat16).to(at::kFloat)};
  std::vector<Tensor> lean_params = clones(params), lean_bufs = {bufs[0].to(at::kBFloat16)};
  cpu::fused_sgd_(params, grads, bufs, {}, 0.1, 0.9, 0.1, 1e-2, false, false, std::nullopt,
                  std::nullopt, false, std::nullopt);
  cpu::fused_sgd_(lean_params, grads, lean_bufs, {}, 0.1, 0.9, 0.1, 1e-2, false, false,
                  std::nullopt, std::nullopt, false, std::nullopt);
  EXPECT_TRUE(at::equal(lean_params[0], params[0]));
  EXPECT_TRUE(same_bits(lean_bufs[0], bufs[0].to(at::kBFloat16)));
}

// A Kahan step is the fp32 step from master = p + comp: p becomes that value rounded to
// bf16 (what the model copy of an fp32 master gets) and comp what the rounding dropped.
TEST(LeanPrecision, KahanStepIsTheFp32StepFromParamPlusCompensation) {
  for (bool adam : {false, true}) {
    const int64_t n = kChunkSize + 5;
    std::vector<Tensor> params = {(at::randn({n}) + 1).to(at::kBFloat16)};
    std::vector<Tensor> comps = {(at::randn({n}) * 1e-3).to(at::kBFloat16)};
    std::vector<Tensor> grads = {at::randn({n}).to(at::kBFloat16)};
    std::vector<Tensor> masters = {params[0].to(at::kFloat) + comps[0].to(at::kFloat)};
    std::vector<Tensor> model = {at::empty({n}, at::kBFloat16)};
    std::vector<Tensor> m = {at::randn({n}) * 0.1}, v = {at::rand({n}) * 0.01};
    std::vector<Tensor> m2 = clones(m), v2 = clones(v), bufs = clones(m), bufs2 = clones(m);
    if (adam) {
      cpu::fused_adam_(params, grads, m, v, {}, scalar(3.f), 1e-2, 0.9, 0.999, 1e-8, 1e-2, true,
                       true, std::nullopt, std::nullopt, std::nullopt, at::TensorList(comps));
      cpu::fused_adam_(masters, grads, m2, v2, model, scalar(3.f), 1e-2, 0.9, 0.999, 1e-8, 1e-2,
                       true, true, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
    } else {
      cpu::fused_sgd_(params, grads, bufs, {}, 0.05, 0.9, 0.0, 1e-2, false, false, std::nullopt,
                      std::nullopt, false, at::TensorList(comps));
      cpu::fused_sgd_(masters, grads, bufs2, model, 0.05, 0.9, 0.0, 1e-2, false, false,
                      std::nullopt, std::nullopt, false, std::nullopt);
    }
    EXPECT_TRUE(same_bits(params[0], model[0])) << (adam ? "adam" : "sgd");
    const Tensor dropped = (masters[0] - params[0].to(at::kFloat)).to(at::kBFloat16);
    EXPECT_TRUE(same_bits(comps[0], dropped)) << (adam ? "adam" : "sgd");
    EXPECT_GT(comps[0].to(at::kFloat).abs().max().item<float>(), 0.f);
  }
}

TEST(LeanPrecision, FoundInfSkipsKahanSteps) {
  std::vector<Tensor> params = {at::randn({40}).to(at::kBFloat16)};
  std::vector<Tensor> comps = {(at::randn({40}) * 1e-3).to(at::kBFloat16)};
  std::vector<Tensor> grads = {at::randn({40})}, bufs = {at::randn({40}).to(at::kBFloat16)};
  const auto p0 = clones(params), c0 = clones(comps), b0 = clones(bufs);
  cpu::fused_sgd_(params, grads, bufs, {}, 0.1, 0.9, 0.0, 0.0, false, false, scalar(1.f),
                  scalar(1.f), false, at::TensorList(comps));
  EXPECT_TRUE(same_bits(params[0], p0[0]) && same_bits(comps[0], c0[0]) &&
              same_bits(bufs[0], b0[0]));
}

TEST(Validation, LeanPrecision) {
  std::vector<Tensor> bf16 = {at::ones({4}, at::kBFloat16)}, grads = {at::ones({4})};
  std::vector<Tensor> comps = {at::zeros({4}, at::kBFloat16)};
  const auto sgd = [&](std::vector<Tensor> params, std::vector<Tensor> model,
                       std::vector<Tensor> c) {
    cpu::fused_sgd_(params, grads, {}, model, 0.1, 0.0, 0.0, 0.0, false, false, std::nullopt,
                    std::nullopt, false, at::TensorList(c));
  };
  expect_error_naming([&] { sgd({at::ones({4})}, {}, comps); }, "params[0]");
  expect_error_naming([&] { sgd({at::ones({4})}, bf16, comps); }, "model_params");
  expect_error_naming([&] { sgd(bf16, {}, {at::zeros({4})}); }, "kahan_comps[0]");
  expect_error_naming([&] { sgd(bf16, {}, {at::zeros({5}, at::kBFloat16)}); }, "kahan_comps[0]");
  expect_error_naming([&] { sgd(bf16, {}, {bf16[0]}); }, "kahan_comps[0]");  // overlap
  EXPECT_TRUE(at::equal(bf16[0], at::ones({4}, at::kBFloat16)));
  // bf16 moments: both of a param in one dtype; LAMB keeps fp32 moments only.
  AdamCase c = adam_case(0.f);
  std::vector<Tensor> m = {c.exp_avgs[0].to(at::kBFloat16), c.exp_avgs[1].to(at::kBFloat16)};
  expect_error_naming(
      [&] {
        cpu::fused_adam_(c.params, c.grads, m, c.exp_avg_sqs, c.model, c.step, 1e-3, 0.9, 0.999,
                         1e-8, 0.0, true, true, std::nullopt, std::nullopt, std::nullopt,
                         std::nullopt);
      },
      "exp_avg_sqs[0]");
  expect_error_naming(
      [&] {
        cpu::fused_lamb_(c.params, c.grads, m, c.exp_avg_sqs, c.model, c.step, 1e-3, 0.9, 0.999,
                         1e-6, 0.0, true, true, true, false, std::nullopt, 1.0, std::nullopt,
                         std::nullopt);
      },
      "exp_avgs[0]");
  EXPECT_EQ(value(c.step), 0.f);
}

TEST(Validation, FusedSgd) {
  std::vector<Tensor> params = {at::ones({4})}, grads = {at::ones({4})}, bufs = {at::zeros({4})},
                      model = {at::zeros({4}, at::kHalf)};
  const auto sgd = [&](double lr, double momentum, double dampening, bool nesterov,
                       std::vector<Tensor> b) {
    cpu::fused_sgd_(params, grads, b, model, lr, momentum, dampening, 0.0, nesterov, false,
                    std::nullopt, std::nullopt, false);
  };
  expect_error_naming([&] { sgd(-0.1, 0.9, 0.0, false, bufs); }, "lr");
  expect_error_naming([&] { sgd(0.1, 0.0, 0.0, false, bufs); }, "momentum_buffers");
  expect_error_naming([&] { sgd(0.1, 0.9, 0.1, true, bufs); }, "dampening");
  expect_error_naming([&] { sgd(0.1, 0.9, 0.0, false, {at::zeros({4}, at::kHalf)}); },
                      "momentum_buffers[0]");
  expect_error_naming([&] { sgd(0.1, 0.9, 0.0, false, {}); }, "momentum_buffers");
  expect_same(params, {at::ones({4})});
  expect_same(bufs, {at::zeros({4})});
  expect_same(model, {at::zeros({4}, at::kHalf)});

  std::vector<Tensor> half_params = {at::ones({4}, at::kHalf)};
  expect_error_naming(
      [&] {
        cpu::fused_sgd_(half_params, grads, {}, model, 0.1, 0.0, 0.0, 0.0, false, false,
                        std::nullopt, std::nullopt, false);
      },
      "params[0]");
  expect_error_naming(
      [&] {
        cpu::fused_sgd_(params, {at::ones({5})}, {}, {}, 0.1, 0.0, 0.0, 0.0, false, false,
                        std::nullopt, std::nullopt, false);
      },
      "grads[0]");
  expect_error_naming(
      [&] {
        cpu::fused_sgd_(params, grads, {}, {}, 0.1, 0.0, 0.0, 0.0, false, false, std::nullopt,
                        at::zeros({1}, at::kInt), false);
      },
      "found_inf");
  EXPECT_TRUE(at::equal(half_params[0], at::ones({4}, at::kHalf)));
  expect_same(params, {at::ones({4})});
}

TEST(Validation, FusedAdam) {
  AdamCase c = adam_case(0.f);
  const auto p0 = clones(c.params), m0 = clones(c.exp_avgs);
  const auto adam = [&](const Tensor& step, double beta1, double eps,
                        const std::vector<Tensor>& exp_avgs) {
    cpu::fused_adam_(c.params, c.grads, exp_avgs, c.exp_avg_sqs, c.model, step, 1e-3, beta1, 0.999,
                     eps, 0.0, true, true, std::nullopt, std::nullopt, std::nullopt);
  };
  expect_error_naming([&] { adam(c.step, 1.0, 1e-8, c.exp_avgs); }, "beta1");
  expect_error_naming([&] { adam(c.step, 0.9, -1.0, c.exp_avgs); }, "eps");
  expect_error_naming([&] { adam(at::zeros({1}, at::kInt), 0.9, 1e-8, c.exp_avgs); }, "step");
  expect_error_naming([&] { adam(at::zeros({2}), 0.9, 1e-8, c.exp_avgs); }, "step");
  expect_error_naming(
      [&] { adam(c.step, 0.9, 1e-8, {c.exp_avgs[0], c.exp_avgs[1].to(at::kHalf)}); },
      "exp_avgs[1]");
  expect_error_naming([&] { adam(c.step, 0.9, 1e-8, c.exp_avg_sqs); },
                      "overlaps exp_avg_sqs[");  // at some index: all are one
  expect_error_naming([&] { adam(c.exp_avgs[1].slice(0, 3, 4), 0.9, 1e-8, c.exp_avgs); },
                      "step overlaps exp_avgs[1]");
  EXPECT_EQ(value(c.step), 0.f);
  expect_same(c.params, p0);
  expect_same(c.exp_avgs, m0);
}

TEST(Validation, FusedLamb) {
  AdamCase c = adam_case(1.f);
  const auto p0 = clones(c.params), m0 = clones(c.exp_avgs);
  const auto lamb = [&](double lr, double max_grad_norm, std::vector<Tensor> exp_avgs,
                        const std::optional<Tensor>& grad_norm) {
    cpu::fused_lamb_(c.params, c.grads, exp_avgs, c.exp_avg_sqs, c.model, c.step, lr, 0.9, 0.999,
                     1e-6, 0.01, true, true, true, false, grad_norm, max_grad_norm, std::nullopt,
                     std::nullopt);
  };
  expect_error_naming([&] { lamb(-1.0, 1.0, c.exp_avgs, std::nullopt); }, "lr");
  expect_error_naming([&] { lamb(1e-3, 0.0, c.exp_avgs, scalar(1.f)); }, "max_grad_norm");
  expect_error_naming([&] { lamb(1e-3, 1.0, c.exp_avgs, at::ones({2})); }, "global_grad_norm");
  expect_error_naming([&] { lamb(1e-3, 1.0, {c.exp_avgs[0]}, std::nullopt); }, "exp_avgs");
  expect_error_naming(
      [&] { lamb(1e-3, 1.0, {c.exp_avgs[0], c.exp_avgs[1].to(at::kHalf)}, std::nullopt); },
      "exp_avgs[1]");
  expect_same(c.params, p0);
  expect_same(c.exp_avgs, m0);
  EXPECT_EQ(value(c.step), 1.f);
}

TEST(Validation, InPlaceUnscaleToIsAllowed) {
  std::vector<Tensor> x = {at::full({5}, 4.f), at::full({5}, 8.f)};
  const Tensor found_inf = scalar(0.f);
  cpu::multi_tensor_unscale_to_(x, x, found_inf, scalar(0.5f));
  EXPECT_TRUE(at::equal(x[0], at::full({5}, 2.f)));
  EXPECT_TRUE(at::equal(x[1], at::full({5}, 4.f)));
  // x[1] read as src[1] while written as dst[0]: not the same index.
  const std::vector<Tensor> dst = {x[1], x[1].clone()};
  expect_error_naming([&] { cpu::multi_tensor_unscale_to_(x, dst, found_inf, scalar(0.5f)); },
                      "src[1] overlaps dst[0]");
  EXPECT_TRUE(at::equal(x[1], at::full({5}, 4.f)));
}

TEST(Validation, SumFp32AndUpdateLossScale) {
  expect_error_naming([&] { cpu::sum_fp32(at::ones({3}, at::kInt), std::nullopt, false); }, "self");

  LossScale s;
  const auto update = [&](const Tensor& growth, double backoff, int64_t interval, double min,
                          double max) {
    cpu::update_loss_scale_(s.scale, growth, s.hysteresis, scalar(1.f), 2.0, backoff, interval, 1,
                            min, max);
  };
  expect_error_naming([&] { update(at::zeros({1}), 0.5, 3, 0, kInf); }, "growth_tracker");
  expect_error_naming([&] { update(s.growth, 0.0, 3, 0, kInf); }, "backoff_factor");
  expect_error_naming([&] { update(s.growth, 0.5, 0, 0, kInf); }, "growth_interval");
  expect_error_naming([&] { update(s.growth, 0.5, 3, 2048, 1024); }, "min_scale");
  EXPECT_EQ(value(s.scale), 1024.f);
  EXPECT_EQ(s.hysteresis.item<int32_t>(), 1);
}

// ------------------------------------------- Apex's Adagrad, SGD and Adam options

TEST(FusedAdagrad, OneStepMatchesTheFormula) {
  const double lr = 0.05, eps = 1e-10, wd = 0.01, inv_scale = 0.5;
  for (bool w_mode : {false, true}) {
    std::vector<Tensor> params = {at::randn({kChunkSize + 3}), at::randn({7})};
    std::vector<Tensor> grads = {at::randn({kChunkSize + 3}).to(at::kHalf),
                                 at::randn({7}).to(at::kHalf)};
    std::vector<Tensor> sums = {at::rand({kChunkSize + 3}), at::rand({7})};
    std::vector<Tensor> model = {at::empty({kChunkSize + 3}, at::kHalf), at::empty({7}, at::kHalf)};
    const auto p0 = clones(params), h0 = clones(sums);
    cpu::fused_adagrad_(params, grads, sums, model, lr, eps, wd, w_mode, scalar(inv_scale),
                        scalar(0.f));
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor p = p0[i].to(at::kDouble);
      Tensor g = grads[i].to(at::kDouble) * inv_scale;
      if (!w_mode) g = g + wd * p;
      const Tensor h = h0[i].to(at::kDouble) + g * g;
      Tensor update = g / (h.sqrt() + eps);
      if (w_mode) update = update + wd * p;
      expect_close(sums[i], h, 1e-5, 1e-6, "state_sums");
      expect_close(params[i], p - lr * update, 1e-5, 1e-6, "params");
      EXPECT_TRUE(at::equal(model[i], params[i].to(at::kHalf)));
    }
  }
}

TEST(FusedAdagrad, FoundInfSkipsAndBadArgumentsWriteNothing) {
  std::vector<Tensor> params = {at::randn({20})}, grads = {at::randn({20})},
                      sums = {at::rand({20})};
  const auto p0 = clones(params), h0 = clones(sums);
  cpu::fused_adagrad_(params, grads, sums, {}, 0.1, 1e-10, 0.0, false, std::nullopt, scalar(1.f));
  expect_same(params, p0);
  expect_same(sums, h0);
  const auto adagrad = [&](double lr, double eps, const std::vector<Tensor>& s) {
    cpu::fused_adagrad_(params, grads, s, {}, lr, eps, 0.0, false, std::nullopt, std::nullopt);
  };
  expect_error_naming([&] { adagrad(-1.0, 1e-10, sums); }, "lr");
  expect_error_naming([&] { adagrad(0.1, -1.0, sums); }, "eps");
  expect_error_naming([&] { adagrad(0.1, 1e-10, {at::zeros({20}, at::kHalf)}); }, "state_sums[0]");
  expect_error_naming([&] { adagrad(0.1, 1e-10, {at::zeros({21})}); }, "state_sums");
  expect_same(params, p0);
  expect_same(sums, h0);
}

TEST(FusedNovoGrad, OneStepMatchesTheFormula) {
  const double lr = 0.01, beta1 = 0.9, beta2 = 0.98, eps = 1e-8, wd = 0.01;
  for (int64_t norm_type : {int64_t{2}, int64_t{0}}) {
    for (bool reg_inside : {false, true}) {
      std::vector<Tensor> params = {at::randn({kChunkSize + 3}), at::randn({7})};
      std::vector<Tensor> grads = {at::randn({kChunkSize + 3}).to(at::kHalf),
                                   at::randn({7}).to(at::kBFloat16)};
      std::vector<Tensor> m = {at::randn({kChunkSize + 3}) * 0.1, at::randn({7}) * 0.1};
      std::vector<Tensor> model = {at::empty({kChunkSize + 3}, at::kHalf),
                                   at::empty({7}, at::kHalf)};
      const Tensor v = at::rand({2}) + 0.5, step = scalar(2.f);
      const auto p0 = clones(params), m0 = clones(m);
      const Tensor v0 = v.clone();
      cpu::fused_novograd_(params, grads, m, model, v, step, lr, beta1, beta2, eps, wd, true, true,
                           reg_inside, norm_type, false, std::nullopt, scalar(0.f));
      EXPECT_EQ(value(step), 3.f);
      const double bc1 = 1 - std::pow(beta1, 3), bc2 = std::sqrt(1 - std::pow(beta2, 3));
      for (size_t i = 0; i < params.size(); ++i) {
        const Tensor g = grads[i].to(at::kDouble), p = p0[i].to(at::kDouble);
        const Tensor n = norm_type == 2 ? g.norm() : g.abs().max();
        const Tensor old = v0[i].to(at::kDouble);
        const Tensor vi = norm_type == 2 ? (beta2 * old * old + (1 - beta2) * n * n).sqrt()
                                         : beta2 * old + (1 - beta2) * n;
        const Tensor denom = vi / bc2 + eps;
        Tensor mi, pi;
        if (reg_inside) {
          mi = beta1 * m0[i].to(at::kDouble) + (1 - beta1) * (g / denom + wd * p);
          pi = p - lr * mi / bc1;
        } else {
          mi = beta1 * m0[i].to(at::kDouble) + (1 - beta1) * g;
          pi = p - lr * (mi / bc1 / denom + wd * p);
        }
        expect_close(v[i], vi, 1e-5, 1e-6, "exp_avg_sq");
        expect_close(m[i], mi, 1e-5, 1e-6, "exp_avgs");
        expect_close(params[i], pi, 1e-5, 1e-6, "params");
        EXPECT_TRUE(at::equal(model[i], params[i].to(at::kHalf)));
      }
    }
  }
}

TEST(FusedNovoGrad, FirstStepStartsFromTheNormsAndFoundInfSkipsEverything) {
  std::vector<Tensor> params = {at::randn({30}), at::randn({5})};
  std::vector<Tensor> grads = {at::randn({30}), at::randn({5})};
  std::vector<Tensor> m = {at::zeros({30}), at::zeros({5})};
  const Tensor v = at::zeros({2}), step = scalar(0.f);
  const auto p0 = clones(params);
  cpu::fused_novograd_(params, grads, m, {}, v, step, 0.1, 0.9, 0.999, 1e-8, 0.0, true, true, false,
                       2, /*init_zero=*/false, std::nullopt, scalar(1.f));
  expect_same(params, p0);
  EXPECT_TRUE(at::equal(v, at::zeros({2})));
  EXPECT_EQ(value(step), 0.f);
  cpu::fused_novograd_(params, grads, m, {}, v, step, 0.1, 0.9, 0.999, 1e-8, 0.0, true, true, false,
                       2, /*init_zero=*/false, std::nullopt, scalar(0.f));
  expect_close(v, at::stack({grads[0].to(at::kDouble).norm(), grads[1].to(at::kDouble).norm()}),
               1e-6, 1e-7, "exp_avg_sq");
  EXPECT_EQ(value(step), 1.f);
  const auto novograd = [&](const Tensor& sq, int64_t norm_type) {
    cpu::fused_novograd_(params, grads, m, {}, sq, step, 0.1, 0.9, 0.999, 1e-8, 0.0, true, true,
                         false, norm_type, false, std::nullopt, std::nullopt);
  };
  const auto p1 = clones(params);
  expect_error_naming([&] { novograd(at::zeros({3}), 2); }, "exp_avg_sq");
  expect_error_naming([&] { novograd(at::zeros({2}, at::kHalf), 2); }, "exp_avg_sq");
  expect_error_naming([&] { novograd(v, 1); }, "norm_type");
  expect_same(params, p1);
}

TEST(FusedSgd, WeightDecayAfterMomentum) {
  const double lr = 0.1, momentum = 0.9, dampening = 0.2, wd = 0.05;
  const int64_t n = kChunkSize + 5;
  std::vector<Tensor> params = {at::randn({n})}, grads = {at::randn({n})}, bufs = {at::randn({n})};
  const auto p0 = clones(params), b0 = clones(bufs);
  cpu::fused_sgd_(params, grads, bufs, {}, lr, momentum, dampening, wd, false, false, std::nullopt,
                  std::nullopt, /*wd_after_momentum=*/true);
  const Tensor p = p0[0].to(at::kDouble);
  const Tensor buf = b0[0].to(at::kDouble) * momentum + (1 - dampening) * grads[0].to(at::kDouble);
  expect_close(bufs[0], buf, 1e-5, 1e-6, "momentum_buffers");
  expect_close(params[0], p - lr * (buf + wd * p), 1e-5, 1e-6, "params");
}

TEST(FusedAdam, LearningRateFromATensor) {
  AdamCase c = adam_case(0.f), d = adam_case(0.f);
  d.params = clones(c.params);
  d.grads = clones(c.grads);
  d.exp_avgs = clones(c.exp_avgs);
  d.exp_avg_sqs = clones(c.exp_avg_sqs);
  // lr_tensor replaces lr: a wrong float lr beside it changes nothing.
  cpu::fused_adam_(c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.model, c.step, 0.0, 0.9, 0.999,
                   1e-8, 0.01, true, true, std::nullopt, std::nullopt, scalar(2e-3f));
  cpu::fused_adam_(d.params, d.grads, d.exp_avgs, d.exp_avg_sqs, d.model, d.step,
                   static_cast<double>(2e-3f), 0.9, 0.999, 1e-8, 0.01, true, true, std::nullopt,
                   std::nullopt, std::nullopt);
  expect_same(c.params, d.params);
  expect_same(c.exp_avgs, d.exp_avgs);
  expect_error_naming(
      [&] {
        cpu::fused_adam_(c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.model, c.step, 0.0, 0.9,
                         0.999, 1e-8, 0.0, true, true, std::nullopt, std::nullopt, at::zeros({2}));
      },
      "lr_tensor");
}

// torch.optim's options (pointwise.h): maximize negates the unscaled gradient, amsgrad
// keeps the running maximum of exp_avg_sq for the denominator (NaN where either is),
// unscale_grads leaves grad * inv_scale (fp32 math, not negated) in the grads.
TEST(FusedAdam, AmsgradMaximizeAndUnscaleGradsMatchTheFormula) {
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.99, eps = 1e-8, wd = 0.01;
  const float inv_scale = 1.f / 3;
  for (bool adamw : {false, true}) {
    AdamCase c = adam_case(4.f);
    std::vector<Tensor> vmax;
    for (const auto& v : c.exp_avg_sqs) vmax.push_back(v * at::rand(v.sizes()) * 2);
    vmax[1].view(-1)[3] = std::numeric_limits<float>::quiet_NaN();
    const auto p0 = clones(c.params), m0 = clones(c.exp_avgs), v0 = clones(c.exp_avg_sqs),
               max0 = clones(vmax), g0 = clones(c.grads);
    entry::fused_adam_<cpu::CpuEngine>(
        c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.model, c.step, lr, beta1, beta2, eps, wd,
        adamw, true, scalar(inv_scale), scalar(0.f), std::nullopt, std::nullopt, std::nullopt,
        std::nullopt, /*maximize=*/true, at::TensorList(vmax), /*unscale_grads=*/true);
    EXPECT_EQ(value(c.step), 5.f);
    const double bc1 = 1 - std::pow(beta1, 5.0), bc2 = 1 - std::pow(beta2, 5.0);
    for (size_t i = 0; i < c.params.size(); ++i) {
      // bf16 grads: (grad * inv_scale in fp32) rounded to bf16, as torch's unscale_.
      EXPECT_TRUE(at::equal(c.grads[i], (g0[i].to(at::kFloat) * inv_scale).to(at::kBFloat16)));
      Tensor p = p0[i].to(at::kDouble);
      Tensor g = -(g0[i].to(at::kDouble) * inv_scale);
      if (adamw) {
        p = p * (1 - lr * wd);
      } else {
        g = g + wd * p;
      }
      const Tensor m = m0[i].to(at::kDouble) * beta1 + (1 - beta1) * g;
      const Tensor v = v0[i].to(at::kDouble) * beta2 + (1 - beta2) * g * g;
      const Tensor vm = at::maximum(max0[i].to(at::kDouble), v);
      p = p - (lr / bc1) * m / (vm.sqrt() / std::sqrt(bc2) + eps);
      expect_close(c.exp_avgs[i], m, 1e-5, 1e-7, "exp_avgs");
      expect_close(c.exp_avg_sqs[i], v, 1e-5, 1e-9, "exp_avg_sqs");
      const Tensor finite = vm.isfinite();
      EXPECT_EQ(vm.isnan().sum().item<int64_t>(), i == 1 ? 1 : 0);
      EXPECT_TRUE(at::equal(vmax[i].isnan(), vm.isnan())) << "max_exp_avg_sqs: NaN stays NaN";
      expect_close(vmax[i].masked_select(finite), vm.masked_select(finite), 1e-5, 1e-9,
                   "max_exp_avg_sqs");
      expect_close(c.params[i].masked_select(finite), p.masked_select(finite), 1e-5, 1e-6,
                   "params");
    }
    EXPECT_GT((vmax[0] > c.exp_avg_sqs[0]).sum().item<int64_t>(), 0) << "the maximum mattered";
  }
}

TEST(FusedAdam, OptionsWriteNothingWhenSkipped) {
  AdamCase c = adam_case(2.f);
  std::vector<Tensor> vmax = clones(c.exp_avg_sqs);
  const auto g0 = clones(c.grads), max0 = clones(vmax), p0 = clones(c.params);
  entry::fused_adam_<cpu::CpuEngine>(c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.model, c.step,
                                     1e-3, 0.9, 0.999, 1e-8, 0.0, true, true, scalar(0.5f),
                                     scalar(1.f), std::nullopt, std::nullopt, std::nullopt,
                                     std::nullopt, true, at::TensorList(vmax), true);
  expect_same(c.grads, g0);
  expect_same(vmax, max0);
  expect_same(c.params, p0);
  EXPECT_EQ(value(c.step), 2.f);
}

TEST(FusedSgd, MaximizeLrTensorAndUnscaleGradsMatchTheFormula) {
  const float lr = 0.05f, momentum = 0.9f, wd = 0.01f, inv_scale = 0.125f;
  const int64_t n = kChunkSize + 7;
  std::vector<Tensor> params = {at::randn({n}), at::randn({9})};
  std::vector<Tensor> grads = {(at::randn({n}) * 8).to(at::kHalf), at::randn({9}) * 8};
  std::vector<Tensor> bufs = {at::randn({n}), at::randn({9})};
  const auto p0 = clones(params), b0 = clones(bufs), g0 = clones(grads);
  entry::fused_sgd_<cpu::CpuEngine>(params, grads, bufs, {}, /*lr=*/7.0, momentum, 0.0, wd,
                                    /*nesterov=*/true, false, scalar(inv_scale), scalar(0.f), false,
                                    std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                                    /*maximize=*/true, scalar(lr), /*unscale_grads=*/true);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::equal(grads[i], (g0[i].to(at::kFloat) * inv_scale).to(g0[i].scalar_type())));
    const Tensor p = p0[i].to(at::kDouble);
    const Tensor g = -(g0[i].to(at::kDouble) * inv_scale) + wd * p;
    const Tensor buf = b0[i].to(at::kDouble) * momentum + g;
    expect_close(bufs[i], buf, 1e-5, 1e-6, "momentum_buffers");
    expect_close(params[i], p - lr * (g + momentum * buf), 1e-5, 1e-6, "params");
  }
}

TEST(Validation, OptimizerOptions) {
  AdamCase c = adam_case(0.f);
  const auto p0 = clones(c.params), g0 = clones(c.grads);
  const auto adam = [&](std::vector<Tensor> vmax, bool unscale_grads, std::vector<Tensor> grads) {
    entry::fused_adam_<cpu::CpuEngine>(c.params, grads, c.exp_avgs, c.exp_avg_sqs, c.model, c.step,
                                       1e-3, 0.9, 0.999, 1e-8, 0.0, true, true, scalar(0.5f),
                                       std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                                       std::nullopt, false, at::TensorList(vmax), unscale_grads);
  };
  expect_error_naming([&] { adam({c.exp_avg_sqs[0].clone()}, false, c.grads); }, "max_exp_avg_sqs");
  expect_error_naming([&] { adam({}, false, c.grads); }, "max_exp_avg_sqs");
  expect_error_naming(
      [&] { adam({c.exp_avg_sqs[0].clone(), at::zeros({31}, at::kBFloat16)}, false, c.grads); },
      "max_exp_avg_sqs[1]");
  expect_error_naming([&] { adam({c.exp_avg_sqs[0].clone(), at::zeros({30})}, false, c.grads); },
                      "max_exp_avg_sqs[1]");
  expect_error_naming([&] { adam({c.exp_avg_sqs[0], c.exp_avg_sqs[1].clone()}, false, c.grads); },
                      "overlaps max_exp_avg_sqs[0]");
  // The grads are written with unscale_grads only: then they may share no memory.
  const std::vector<Tensor> vmax = {c.exp_avg_sqs[0].clone(), c.exp_avg_sqs[1].clone()};
  std::vector<Tensor> overlapping = {c.grads[0], c.grads[0].narrow(0, 0, 31)};
  expect_error_naming([&] { adam(vmax, true, overlapping); }, "grads[0] overlaps grads[1]");
  expect_same(c.params, p0);
  expect_same(c.grads, g0);
  EXPECT_EQ(value(c.step), 0.f);
  adam(vmax, false, overlapping);  // read only: allowed
  EXPECT_EQ(value(c.step), 1.f);

  std::vector<Tensor> params = {at::ones({4})}, grads = {at::ones({4})};
  expect_error_naming(
      [&] {
        entry::fused_sgd_<cpu::CpuEngine>(params, grads, {}, {}, 0.1, 0.0, 0.0, 0.0, false, false,
                                          std::nullopt, std::nullopt, false, std::nullopt,
                                          std::nullopt, std::nullopt, std::nullopt, true,
                                          at::ones({1}, at::kHalf), false);
      },
      "lr_tensor");
  expect_same(params, {at::ones({4})});
}

// Philox4x32-10's published known answers (Random123's kat_vectors).
// 8-bit state's codec (lanes.h) against c10's float8 types: every code decodes to
// c10's value, and values within e4m3's range encode as c10's cast (to nearest even),
// subnormal codes, ties and both signs included; a block's scale byte brings its
// largest magnitude into (224, 448].
TEST(EightBitState, CodecMatchesC10sFloat8) {
  for (uint32_t code = 0; code < 256; ++code) {
    const float want = static_cast<float>(
        c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
    const float got = e4m3_value(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << code;
    } else {
      EXPECT_EQ(got, want) << code;
    }
  }
  std::vector<float> values = {0.f,           -0.f,           448.f,     -448.f,
                               0.0009765625f, 0.00146484375f, 0.015625f, 0.0146484375f,
                               1.0625f,       1.1875f,        3.f};
  const at::Tensor random = at::randn({20000}, at::kDouble) * at::exp(at::randn({20000}) * 4);
  for (int64_t i = 0; i < random.numel(); ++i) {
    const float v = static_cast<float>(random[i].item<double>());
    if (std::abs(v) <= 448.f) values.push_back(v);
  }
  for (const float v : values) {
    const uint8_t want = c10::Float8_e4m3fn(v).x;
    EXPECT_EQ(e4m3_code(v), want) << v;
  }
  for (const float a : {1e-30f, 3e-5f, 0.5f, 1.f, 1.75f, 1.7500001f, 224.f, 448.f, 449.f, 3e30f}) {
    const uint32_t bits = e8m0_scale_bits(a);
    const float y = a * e8m0_inverse(bits);
    EXPECT_GT(y, 224.f) << a;
    EXPECT_LE(y, 448.f) << a;
    EXPECT_EQ(e8m0_value(bits) * e8m0_inverse(bits), 1.f) << a;
  }
  EXPECT_EQ(e8m0_scale_bits(0.f), 127u);
  EXPECT_EQ(e8m0_scale_bits(NAN), 127u);
}

#if defined(MP_X86_ISA)
// The AVX2 codec (through fp16, vec_pair.h) against lanes.h's: every code decoded, and
// the codes of every 251st float bit pattern (with 16 neighbours each) whose magnitude
// is at most 448, of inf and of NaN.
__attribute__((target(MP_AVX2_TARGET))) void avx2_decode(const E4m3* p, float* out) {
  const VecF8x2 v = cpu::avx2x2::load(p);
  memcpy(out, &v, sizeof(v));
}
__attribute__((target(MP_AVX2_TARGET))) void avx2_encode(const float* y, E4m3* out) {
  VecF8x2 v;
  memcpy(&v, y, sizeof(v));
  cpu::avx2x2::store(out, v);
}
TEST(EightBitState, Avx2CodecMatchesTheScalarOne) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) GTEST_SKIP();
  E4m3 codes[256];
  float values[256];
  for (int i = 0; i < 256; ++i) codes[i].bits = static_cast<uint8_t>(i);
  for (int i = 0; i < 256; i += 16) avx2_decode(codes + i, values + i);
  for (int i = 0; i < 256; ++i) {
    const float want = e4m3_value(static_cast<uint32_t>(i));
    if (want != want) {
      EXPECT_NE(values[i], values[i]) << i;
    } else {
      EXPECT_EQ(values[i], want) << i;
      EXPECT_EQ(std::signbit(values[i]), std::signbit(want)) << i;
    }
  }
  int64_t checked = 0;
  float y[16];
  E4m3 out[16];
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 251 * 16) {
    for (int j = 0; j < 16; ++j) {
      const float f = bits_float(static_cast<uint32_t>(b + 251 * j));
      y[j] = std::abs(f) <= 448.f || f != f || std::isinf(f) ? f : std::copysign(448.f, f);
    }
    avx2_encode(y, out);
    for (int j = 0; j < 16; ++j) ASSERT_EQ(out[j].bits, e4m3_code(y[j])) << y[j];
    checked += 16;
  }
  EXPECT_GT(checked, 1000000);
}
#endif

#if defined(MP_X86_ISA)
// The AVX-512 codec (vec.h) against lanes.h's: every code decoded, also with MXCSR's
// DAZ and FTZ set (torch.set_flush_denormal(True): the decode through fp16 must not
// flush the subnormal codes), and the stochastic codes of every 251st float bit
// pattern (with 16 neighbours each) of magnitude at most 448, of inf and NaN, with
// random bits (the byte-swapped bits of a second list: VectorPassesMatchTheScalarPass).
__attribute__((target(MP_AVX512_TARGET))) void avx512_decode(const E4m3* p, float* out) {
  const VecF16 v = cpu::avx512::load(p);
  memcpy(out, &v, sizeof(v));
}
__attribute__((target(MP_AVX512_TARGET))) void avx512_encode(const float* y, const uint32_t* r,
                                                             E4m3* out) {
  VecF16 v;
  memcpy(&v, y, sizeof(v));
  cpu::avx512::store_codes(out, cpu::avx512::stochastic_codes(v, _mm512_loadu_si512(r)));
}
TEST(EightBitState, Avx512CodecMatchesTheScalarOne) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq")) {
    GTEST_SKIP();
  }
  E4m3 codes[256];
  for (int i = 0; i < 256; ++i) codes[i].bits = static_cast<uint8_t>(i);
  const unsigned csr = _mm_getcsr();
  for (const unsigned flush : {0u, 0x8040u}) {  // (FTZ | DAZ)
    float values[256];
    _mm_setcsr(csr | flush);
    for (int i = 0; i < 256; i += 16) avx512_decode(codes + i, values + i);
    _mm_setcsr(csr);
    for (int i = 0; i < 256; ++i) {
      const float want = e4m3_value(static_cast<uint32_t>(i));
      if (want != want) {
        EXPECT_NE(values[i], values[i]) << i;
      } else {
        EXPECT_EQ(values[i], want) << i << " " << flush;
        EXPECT_EQ(std::signbit(values[i]), std::signbit(want)) << i;
      }
    }
  }
  std::mt19937 gen(5);
  int64_t checked = 0;
  float y[16];
  uint32_t r[16];
  E4m3 out[16];
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 251 * 16) {
    for (int j = 0; j < 16; ++j) {
      const float f = bits_float(static_cast<uint32_t>(b + 251 * j));
      y[j] = std::abs(f) <= 448.f || f != f || std::isinf(f) ? f : std::copysign(448.f, f);
      r[j] = gen() & 0xffffu;
    }
    avx512_encode(y, r, out);
    for (int j = 0; j < 16; ++j) ASSERT_EQ(out[j].bits, e4m3_code_stochastic(y[j], r[j])) << y[j];
    checked += 16;
  }
  EXPECT_GT(checked, 1000000);
  // The normal codes' rounding edges, where one bit of the bits added decides the code:
  // magnitudes 1 below, at and 1 above bits((code + 960) << 20) - (r << 4) - 8.
  for (int i = 0; i < 200000; ++i) {
    for (int j = 0; j < 16; ++j) {
      r[j] = gen() & 0xffffu;
      const uint32_t code = 8 + gen() % 118;  // (the normal codes, 0x08-0x7d)
      const uint32_t edge = ((code + 961u) << 20) - (r[j] << 4) - 8u + (j % 3) - 1u;
      y[j] = bits_float(edge | (j & 1u) << 31);
    }
    avx512_encode(y, r, out);
    for (int j = 0; j < 16; ++j) ASSERT_EQ(out[j].bits, e4m3_code_stochastic(y[j], r[j])) << y[j];
  }
}
#endif

#if defined(MP_X86_ISA)
// The VBMI decode (byte tables: vec.h's e4m3_values_vbmi) against the AVX-512 one, bit
// for bit (NaNs' payloads and signs included), every code in both halves of a block,
// also with MXCSR's DAZ and FTZ set; and the 32 codes of two vectors stored as bytes
// (store_codes' VBMI permutation where the CPU has it, else its narrowing stores).
__attribute__((target(MP_AVX512_TARGET))) void vbmi_decode(const E4m3* p, uint32_t* out) {
  VecF16 lo, hi;
  cpu::avx512::e4m3_values_vbmi(p, lo, hi);
  memcpy(out, &lo, sizeof(lo));
  memcpy(out + 16, &hi, sizeof(hi));
}
__attribute__((target(MP_AVX512_TARGET))) void avx512_decode_bits(const E4m3* p, uint32_t* out) {
  const VecF16 v = cpu::avx512::load(p);
  memcpy(out, &v, sizeof(v));
}
__attribute__((target(MP_AVX512_TARGET))) void avx512_store_32_codes(const uint32_t* codes,
                                                                     E4m3* out) {
  cpu::avx512::store_codes(out, _mm512_loadu_si512(codes), _mm512_loadu_si512(codes + 16));
}
TEST(EightBitState, VbmiDecodeAndCodeStoresMatchTheAvx512Ones) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq")) {
    GTEST_SKIP();
  }
  std::mt19937 gen(11);
  uint32_t codes[32];
  E4m3 out[32 + 8];
  for (int round = 0; round < 1000; ++round) {
    for (auto& c : codes) c = gen() & 0xffu;
    for (auto& o : out) o.bits = 0x55;
    avx512_store_32_codes(codes, out);
    for (int i = 0; i < 32; ++i) ASSERT_EQ(out[i].bits, codes[i]) << round << " " << i;
    for (int i = 32; i < 40; ++i) ASSERT_EQ(out[i].bits, 0x55) << "stored past the block";
  }
  if (!__builtin_cpu_supports("avx512vbmi")) GTEST_SKIP() << "no AVX512_VBMI: its decode untested";
  const unsigned csr = _mm_getcsr();
  for (const unsigned flush : {0u, 0x8040u}) {  // (FTZ | DAZ)
    for (int first = 0; first < 256;
         first += 16) {  // codes first.. in one half, the rest in the other
      E4m3 block[32];
      for (int i = 0; i < 32; ++i)
        block[i].bits = static_cast<uint8_t>(first + i * 7 + (i >= 16) * 9);
      uint32_t got[32], want[32];
      _mm_setcsr(csr | flush);
      vbmi_decode(block, got);
      avx512_decode_bits(block, want);
      avx512_decode_bits(block + 16, want + 16);
      _mm_setcsr(csr);
      for (int i = 0; i < 32; ++i) {
        ASSERT_EQ(got[i], want[i]) << "code " << int{block[i].bits} << " flush " << flush;
      }
    }
  }
  E4m3 every[256];
  for (int i = 0; i < 256; ++i) every[i].bits = static_cast<uint8_t>(i);
  for (int i = 0; i < 256; i += 32) {
    uint32_t got[32], want[32];
    vbmi_decode(every + i, got);
    avx512_decode_bits(every + i, want);
    avx512_decode_bits(every + i + 16, want + 16);
    for (int j = 0; j < 32; ++j) ASSERT_EQ(got[j], want[j]) << "code " << i + j;
  }
}
#endif

#if defined(MP_X86_ISA)
// A group of blocks' codes and scales (vec_pair.h's store_blocks: the group's scales
// found together, and the codes of the blocks whose largest magnitude is finite without
// saturation or NaN codes) against lanes.h's store_block_of, block by block: n of the
// group filled, list k of two, nearest or stochastic codes, the second list's bits
// byte-swapped. values[q * 32 + j]: element j of block q.
__attribute__((target(MP_AVX512_TARGET))) void avx512_group_store(const float* values, int n, int k,
                                                                  const uint32_t* random,
                                                                  E4m3* codes, uint8_t* scales) {
  VecF32 x[cpu::avx512x2::kGroup][1][2] = {};
  for (int q = 0; q < n; ++q) {
    memcpy(&x[q][0][k].a, values + q * kQuantBlock, 64);
    memcpy(&x[q][0][k].b, values + q * kQuantBlock + 16, 64);
  }
  cpu::avx512x2::store_blocks<cpu::avx512x2::kGroup, 1, 2>(codes, scales, x, k, random, k != 0, n);
}
__attribute__((target(MP_AVX2_TARGET))) void avx2_group_store(const float* values, int n, int k,
                                                              const uint32_t* random, E4m3* codes,
                                                              uint8_t* scales) {
  constexpr int G = cpu::avx2x2::kGroup;
  VecF8x2 x[G][2][2] = {};
  uint16_t bits[G * kQuantBlock];
  for (int q = 0; q < n; ++q) {
    for (int j = 0; j < 2; ++j) {
      memcpy(&x[q][j][k].a, values + q * kQuantBlock + 16 * j, 32);
      memcpy(&x[q][j][k].b, values + q * kQuantBlock + 16 * j + 8, 32);
    }
  }
  for (int i = 0; random != nullptr && i < G * kQuantBlock; ++i)
    bits[i] = static_cast<uint16_t>(random[i]);
  cpu::avx2x2::store_blocks<G, 2, 2>(codes, scales, x, k, random == nullptr ? nullptr : bits,
                                     k != 0, n);
}
TEST(EightBitState, GroupStoresMatchTheScalarBlockStore) {
  const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                        __builtin_cpu_supports("f16c");
  const bool has_avx512 = has_avx2 && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!has_avx2) GTEST_SKIP();
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> power(-140, 120);
  constexpr int kBlocks = 8;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float values[kBlocks * kQuantBlock];
  uint32_t random[kBlocks * kQuantBlock];
  for (int round = 0; round < 200; ++round) {
    for (int q = 0; q < kBlocks; ++q) {
      const float scale = std::ldexp(1.f, power(gen));
      for (int j = 0; j < kQuantBlock; ++j) values[q * kQuantBlock + j] = normal(gen) * scale;
    }
    // special blocks: a NaN, an inf, zeros, the largest float, a block at 448 times a
    // power of two, subnormal values
    float* v = values + (round % kBlocks) * kQuantBlock;
    switch (round % 7) {
      case 0: v[round % kQuantBlock] = NAN; break;
      case 1: v[round % kQuantBlock] = round % 2 ? kInf : -kInf; break;
      case 2: std::fill(v, v + kQuantBlock, 0.f); break;
      case 3: v[3] = std::numeric_limits<float>::max(); break;
      case 4: v[5] = -448.f * std::ldexp(1.f, round % 40 - 20); break;
      case 5:
        for (int j = 0; j < kQuantBlock; ++j) v[j] = std::ldexp(normal(gen), -140);
        break;
      default: break;
    }
    for (auto& r : random) r = static_cast<uint32_t>(gen()) & 0xffffu;
    for (int k = 0; k < 2; ++k) {
      for (const uint32_t* bits :
           {static_cast<const uint32_t*>(nullptr), static_cast<const uint32_t*>(random)}) {
        E4m3 want[kBlocks * kQuantBlock];
        uint8_t want_scales[kBlocks];
        for (int q = 0; q < kBlocks; ++q) {
          float x[kQuantBlock][2] = {};
          for (int j = 0; j < kQuantBlock; ++j) x[j][k] = values[q * kQuantBlock + j];
          store_block_of<2>(want + q * kQuantBlock, want_scales + q, x, k,
                            bits == nullptr ? nullptr : bits + q * kQuantBlock, k != 0);
        }
        auto check = [&](auto group_store, int group, const char* isa) {
          for (int first = 0; first < kBlocks; first += group) {
            const int n = std::min(group, 1 + round % group);  // a partial group too
            E4m3 got[kBlocks * kQuantBlock] = {};
            uint8_t got_scales[kBlocks] = {};
            group_store(values + first * kQuantBlock, n, k,
                        bits == nullptr ? nullptr : bits + first * kQuantBlock, got, got_scales);
            for (int q = 0; q < n; ++q) {
              ASSERT_EQ(got_scales[q], want_scales[first + q])
                  << isa << " round " << round << " block " << first + q;
              for (int j = 0; j < kQuantBlock; ++j) {
                ASSERT_EQ(got[q * kQuantBlock + j].bits, want[(first + q) * kQuantBlock + j].bits)
                    << isa << " round " << round << " block " << first + q << " element " << j
                    << " value " << values[(first + q) * kQuantBlock + j];
              }
            }
          }
        };
        check(avx2_group_store, cpu::avx2x2::kGroup, "avx2");
        if (has_avx512) check(avx512_group_store, cpu::avx512x2::kGroup, "avx512");
      }
    }
  }
}
#endif

// Every instruction set gives the scalar path's bytes (the engine's block passes).
TEST(EightBitState, VectorPassesMatchTheScalarPass) {
  at::manual_seed(21);
  const int64_t n = 3 * 4096 + 64;
  const at::Tensor p32 = at::randn({n}), g32 = at::randn({n}) * at::exp(at::randn({n}) * 3);
  const at::Tensor m0 = (at::randn({n}) * 50).clamp(-448, 448).to(at::kFloat8_e4m3fn);
  const at::Tensor s0 = at::randint(110, 125, {n / kQuantBlock}, at::kByte);
  AdamOp op;
  op.lr = 1e-3;
  op.beta1 = 0.9;
  op.beta2 = 0.999;
  op.eps = 1e-8;
  op.weight_decay = 0.0;
  op.decoupled_weight_decay = true;
  op.bias_correction = true;
  op.root = true;
  const at::Tensor step = at::full({1}, 3.f);
  op.step_ptr = step.data_ptr<float>();
  op.resolve();
  auto check = [&](auto param_tag) {
    using P = decltype(param_tag);
    const at::ScalarType dtype = std::is_same_v<P, float> ? at::kFloat : at::kBFloat16;
    const at::Tensor p0 = p32.to(dtype), g = g32.to(dtype);
    auto run = [&](auto pass_fn) {
      at::Tensor p = p0.clone(), m = m0.clone(), v = m0.clone(), sm = s0.clone(), sv = s0.clone();
      void* data[12] = {p.data_ptr(), g.data_ptr(),  m.data_ptr(),  v.data_ptr(),
                        nullptr,      nullptr,       nullptr,       nullptr,
                        nullptr,      sm.data_ptr(), sv.data_ptr(), nullptr};
      pass_fn(data);
      return std::vector<at::Tensor>{p, m.view(at::kByte), v.view(at::kByte), sm, sv};
    };
    const auto seq = std::make_index_sequence<12>{};
    const auto want = run([&](void* const* data) {
      cpu::block_pass_scalar<AdamOp, P, P, E4m3, E4m3, float, float, int64_t, float, P, uint8_t,
                             uint8_t, double>(op, data, 0, n, seq);
    });
#if defined(MP_X86_ISA)
    // Each pass where the CPU has its instruction sets (vec.h's MP_AVX2_TARGET and
    // MP_AVX512_TARGET), as vec.cpp picks them.
    const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
    if (has_avx2) {
      const auto avx2 = run([&](void* const* data) {
        cpu::block_pass_avx2x2<AdamOp, P, P, E4m3, E4m3, float, float, int64_t, float, P, uint8_t,
                               uint8_t, double>(op, data, 0, n, seq);
      });
      for (size_t k = 0; k < want.size(); ++k) EXPECT_TRUE(at::equal(avx2[k], want[k])) << k;
    }
    if (has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
      // (a block one pair of vectors, its bf16 params rounded by vcvtne2ps2bf16 where
      // the CPU has AVX512_BF16)
      const auto avx512x2 = run([&](void* const* data) {
        cpu::block_pass_avx512x2<AdamOp, P, P, E4m3, E4m3, float, float, int64_t, float, P, uint8_t,
                                 uint8_t, double>(op, data, 0, n, seq);
      });
      for (size_t k = 0; k < want.size(); ++k) EXPECT_TRUE(at::equal(avx512x2[k], want[k])) << k;
    }
#endif
    EXPECT_FALSE(at::equal(want[1], m0.view(at::kByte)));
  };
  check(float{});
  check(c10::BFloat16{});
  // Stochastic rounding of the codes (lanes.h), keyed by a RoundingKey.
  op.state_stochastic = true;
  op.state_key.seed = 99;
  op.state_key.salt = 3;
  op.state_key.step = 7;
  check(float{});
  // A shard's elements (RoundingKey's runs): blocks off a multiple of 8 in the whole
  // tensor, and groups of blocks (vec_pair.h's kGroup) across the end of a run, whose
  // bits are drawn a block at a time; then a multiple of 8 off the full tensor's start.
  op.state_key.offset = 3;
  op.state_key.run = 1000;
  op.state_key.stride = 4096;
  check(float{});
  op.state_key.offset = 8 * 5;
  op.state_key.run = 0;
  check(c10::BFloat16{});
}

// 8-bit moments: scales come with 8-bit states only, both of Adam's together, one
// per block; amsgrad is refused with them; nothing is written by a refused call.
TEST(EightBitState, ChecksItsArguments) {
  const Tensor p = at::randn({64}), g = at::randn({64});
  const Tensor codes = at::zeros({64}, at::kFloat8_e4m3fn);
  const Tensor fp32 = at::zeros({64});
  const Tensor sc = at::full({2}, 127, at::kByte).view(at::kFloat8_e8m0fnu);
  const Tensor bad_sc = at::full({3}, 127, at::kByte).view(at::kFloat8_e8m0fnu);
  const Tensor step = at::zeros({1});
  auto adam = [&](const Tensor& m, const Tensor& v, std::optional<at::TensorList> sm,
                  std::optional<at::TensorList> sv, std::optional<at::TensorList> maxes) {
    entry::fused_adam_<cpu::CpuEngine>({p}, {g}, {m}, {v}, {}, step, 1e-3, 0.9, 0.999, 1e-8, 0.0,
                                       true, true, std::nullopt, std::nullopt, std::nullopt,
                                       std::nullopt, std::nullopt, std::nullopt, false, maxes,
                                       false, std::nullopt, sm, sv);
  };
  const Tensor before = p.clone();
  expect_error_naming([&] { adam(codes, codes, std::nullopt, std::nullopt, std::nullopt); },
                      "exp_avgs");
  expect_error_naming(
      [&] { adam(fp32, fp32, at::TensorList{sc}, at::TensorList{sc}, std::nullopt); }, "exp_avgs");
  expect_error_naming([&] { adam(codes, codes, at::TensorList{sc}, std::nullopt, std::nullopt); },
                      "exp_avg_sq_scales");
  expect_error_naming(
      [&] { adam(codes, codes, at::TensorList{sc}, at::TensorList{bad_sc}, std::nullopt); },
      "exp_avg_sq_scales[0]");
  expect_error_naming(
      [&] { adam(codes, codes, at::TensorList{sc}, at::TensorList{sc}, at::TensorList{fp32}); },
      "max_exp_avg_sqs");
  const Tensor odd = at::zeros({48}, at::kFloat8_e4m3fn);
  expect_error_naming(
      [&] {
        entry::fused_sgd_<cpu::CpuEngine>(
            {at::randn({48})}, {at::randn({48})}, {odd}, {}, 0.1, 0.9, 0.0, 0.0, false, false,
            std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, std::nullopt,
            std::nullopt, false, std::nullopt, false, std::nullopt, at::TensorList{sc});
      },
      "momentum_buffers[0]");
  EXPECT_TRUE(at::equal(p, before));
  EXPECT_EQ(step.item<float>(), 0.f);
}

TEST(Philox, KnownAnswers) {
  const Philox4x32 zero = philox4x32_10(Philox4x32{{0, 0, 0, 0}}, 0, 0);
  const uint32_t zero_want[4] = {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u};
  const Philox4x32 ones = philox4x32_10(
      Philox4x32{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  const uint32_t ones_want[4] = {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu};
  const Philox4x32 pi = philox4x32_10(
      Philox4x32{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  const uint32_t pi_want[4] = {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(zero.v[i], zero_want[i]) << i;
    EXPECT_EQ(ones.v[i], ones_want[i]) << i;
    EXPECT_EQ(pi.v[i], pi_want[i]) << i;
  }
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Over all 2^16 values of the random bits, the rounded values average to x exactly
// (unbiased), each is one of x's two bf16 neighbours, and bf16 values never move.
TEST(StochasticRounding, AveragesToTheValueOverAllBits) {
  for (const uint32_t u :
       {0x3f800001u, 0x3f808000u, 0x3f80ffffu, 0xbf80abcdu, 0x00001234u, 0x7f7e8001u}) {
    const double x = from_bits(u);
    const double down = from_bits(u & 0xffff0000u);
    const double up = from_bits((u & 0xffff0000u) + 0x10000u);
    double sum = 0.0;
    for (uint32_t r = 0; r < 0x10000u; ++r) {
      const double y = round_bf16_stochastic(static_cast<float>(x), r);
      ASSERT_TRUE(y == down || y == up) << std::hex << u << " " << r;
      sum += y;
    }
    EXPECT_EQ(sum / 65536.0, x) << std::hex << u;
  }
  for (const float exact : {1.f, -1.5f, 0.f, 65536.f}) {
    EXPECT_EQ(round_bf16_stochastic(exact, 0xffffu), exact);
  }
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(round_bf16_stochastic(inf, 0xffffu), inf);
  EXPECT_EQ(round_bf16_stochastic(-inf, 0xffffu), -inf);
  EXPECT_TRUE(std::isnan(round_bf16_stochastic(from_bits(0x7f800001u), 0xffffu)));
  EXPECT_TRUE(std::isnan(round_bf16_stochastic(std::nanf(""), 0xffffu)));
}

// fused_sgd_ with stochastic rounding (vector lanes and the scalar tail): every element
// is the scalar rounding of p - lr * g with the bits of its own global index (a whole
// tensor, one at an offset off a multiple of 8, one of runs), salt and step.
TEST(StochasticRounding, SgdElementsUseTheirOwnBits) {
  at::manual_seed(21);
  std::vector<Tensor> params, grads, salts;
  for (const int64_t n : {1, 37, 1000}) {
    params.push_back(at::randn({n}).to(at::kBFloat16));
    grads.push_back(at::randn({n}));
  }
  salts = {words(4), words(0, 13), words(9, 5, 7, 20)};
  const auto before = clones(params);
  const int64_t seed = -5;  // all 64 bits: 0xffff...fb
  entry::fused_sgd_<cpu::CpuEngine>(params, grads, {}, {}, 0.03, 0.0, 0.0, 0.0, false, false,
                                    std::nullopt, std::nullopt, false, std::nullopt, salts, seed,
                                    scalar(6.f));
  int up = 0, total = 0;
  for (size_t t = 0; t < params.size(); ++t) {
    const auto w = salts[t].data_ptr<int64_t>();
    const RoundingKey key{
        static_cast<uint64_t>(seed), static_cast<uint32_t>(w[0]), 6u, w[1], w[2], w[3]};
    for (int64_t i = 0; i < params[t].numel(); ++i) {
      const float p = static_cast<float>(before[t][i].item<at::BFloat16>());
      const float exact = p - 0.03f * grads[t][i].item<float>();
      const int64_t g = w[2] == 0 ? w[1] + i : w[1] + (i / w[2]) * w[3] + i % w[2];
      const float want = round_bf16_stochastic(exact, rounding_bits(key, g));
      ASSERT_EQ(static_cast<float>(params[t][i].item<at::BFloat16>()), want) << t << " " << i;
      up += want != static_cast<float>(c10::BFloat16(exact));
      ++total;
    }
  }
  EXPECT_GT(up, total / 20) << "some elements must not round to nearest";
}

// The bit mapping, restated: element i takes 16-bit half i % 8 of the Philox output
// for counter (i / 8 low word, high word, salt, step), key = the seed.
uint32_t mapped_bits(const RoundingKey& key, uint64_t i) {
  const uint64_t b = i / 8;
  const Philox4x32 out = philox4x32_10(
      Philox4x32{{static_cast<uint32_t>(b), static_cast<uint32_t>(b >> 32), key.salt, key.step}},
      static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32));
  return (out.v[(i % 8) / 2] >> (16 * (i % 2))) & 0xffffu;
}

// vector_bits (the CUDA engine's draw per vector: one Philox call where the N elements
// lie in one block of 8, else element_bits or a call per element) gives each element the
// mapping's bits, whatever the key's offset, runs and stride and the index.
template <bool kByElement, int N>
void expect_vector_bits(const RoundingKey& key, int64_t index) {
  uint32_t bits[N];
  vector_bits<kByElement>(key, index, bits);
  for (int j = 0; j < N; ++j) {
    const auto g = static_cast<uint64_t>(key.global(index + j));
    ASSERT_EQ(bits[j], mapped_bits(key, g))
        << "by element " << kByElement << " N " << N << " index " << index << " lane " << j
        << " offset " << key.offset << " run " << key.run;
  }
}

TEST(StochasticRounding, VectorBitsAreEachElementsBits) {
  const int64_t far = (int64_t{1} << 35) - 20;  // block index past 32 bits
  for (const int64_t offset : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{4}, int64_t{6}, far}) {
    for (const int64_t run : {0, 3, 4, 5, 8, 13}) {
      RoundingKey key{0xfedcba9876543210u, 7, 3};
      key.offset = offset;
      key.run = run;
      key.stride = run == 0 ? 0 : 2 * run + 7;
      for (int64_t index = 0; index < 64; index += 2) {
        if (index % 4 == 0) {
          expect_vector_bits<true, 4>(key, index);
          expect_vector_bits<false, 4>(key, index);
        }
        if (index % 8 == 0) expect_vector_bits<false, 8>(key, index);
        expect_vector_bits<true, 2>(key, index);
      }
    }
  }
}

#if defined(MP_X86_ISA)
// One vector of the engine's stochastic rounding, x[0..W) from `index` on.
#define MP_ROUND_VEC(NAME, TARGET, V)                                                          \
  __attribute__((target(TARGET))) void NAME(float* x, const RoundingKey& key, int64_t index) { \
    V v;                                                                                       \
    std::memcpy(&v, x, sizeof(v));                                                             \
    v = Lanes<V>::round_bf16_stochastic(v, key, index);                                        \
    std::memcpy(x, &v, sizeof(v));                                                             \
  }
MP_ROUND_VEC(round_vec8, MP_AVX2_TARGET, VecF8)
MP_ROUND_VEC(round_vec16, MP_AVX512_TARGET, VecF16)
#undef MP_ROUND_VEC
#endif

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// rounding_bits is the mapping, the scalar rounding (Lanes<float>) uses it, and the
// vector rounding (one Philox call per 8 lanes from global multiples of 8, a window of
// three blocks from other starts, lane by lane across the end of a run) gives every
// lane the scalar path's bits, NaN and inf lanes included.
TEST(StochasticRounding, VectorLanesMatchTheScalarPath) {
  const uint64_t far = (uint64_t{1} << 35) - 20;  // block index past 32 bits
  for (const RoundingKey key : {RoundingKey{0, 0, 1}, RoundingKey{0xfedcba9876543210u, 7, 3}}) {
    for (uint64_t i = 0; i < 300; ++i) {
      ASSERT_EQ(rounding_bits(key, static_cast<int64_t>(i)), mapped_bits(key, i)) << i;
      ASSERT_EQ(rounding_bits(key, static_cast<int64_t>(far + i)), mapped_bits(key, far + i));
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {inf,
                            -inf,
                            std::nanf(""),
                            from_bits(0x7f800001u),
                            from_bits(0xffc12345u),
                            from_bits(0x7f7fffffu),
                            -0.f,
                            from_bits(0x00001234u)};
  std::vector<float> values(400);
  uint32_t state = 12345;
  for (size_t i = 0; i < values.size(); ++i) {
    state = state * 1664525u + 1013904223u;
    values[i] = i % 11 == 3 ? specials[(i / 11) % 8] : from_bits(state & 0xbfffffffu);
  }
  const RoundingKey keys[] = {RoundingKey{0x0123456789abcdefu, 5, 9},
                              RoundingKey{0x0123456789abcdefu, 5, 9, 3},
                              RoundingKey{0x0123456789abcdefu, 5, 9, 2, 5, 11},
                              RoundingKey{0x0123456789abcdefu, 5, 9, 1000, 37, 100}};
  const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                        __builtin_cpu_supports("f16c");
  const bool has_avx512 = has_avx2 && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  int vector_checks = 0;
  for (const RoundingKey& key : keys) {
    for (const uint64_t base : {uint64_t{0}, far}) {
      for (int64_t start = 0; start + 16 <= static_cast<int64_t>(values.size()); ++start) {
        const int64_t index = static_cast<int64_t>(base) + start;
        float want[16];
        for (int j = 0; j < 16; ++j) {
          want[j] = Lanes<float>::round_bf16_stochastic(values[start + j], key, index + j);
          const int64_t i = index + j;
          const int64_t g =
              key.run == 0 ? key.offset + i : key.offset + (i / key.run) * key.stride + i % key.run;
          const float direct = round_bf16_stochastic(values[start + j], mapped_bits(key, g));
          ASSERT_EQ(bits_of(want[j]), bits_of(direct)) << index + j;
        }
#if defined(MP_X86_ISA)
        float x8[8], x16[16];
        std::memcpy(x8, &values[start], sizeof(x8));
        std::memcpy(x16, &values[start], sizeof(x16));
        if (has_avx2) round_vec8(x8, key, index);
        if (has_avx512) round_vec16(x16, key, index);
        for (int j = 0; j < 16; ++j) {
          if (has_avx2 && j < 8) ASSERT_EQ(bits_of(x8[j]), bits_of(want[j])) << index << " " << j;
          if (has_avx512) ASSERT_EQ(bits_of(x16[j]), bits_of(want[j])) << index << " " << j;
        }
        vector_checks += has_avx2;
#endif
      }
    }
  }
  if (vector_checks == 0) GTEST_SKIP() << "no AVX2: only the scalar path checked";
}

TEST(StochasticRounding, ChecksItsArguments) {
  const std::vector<Tensor> bf16 = {at::zeros({3}, at::kBFloat16)};
  const std::vector<Tensor> grads = {at::zeros({3})};
  const std::vector<Tensor> salts = {words(0)};
  expect_error_naming(
      [&] {
        entry::fused_sgd_<cpu::CpuEngine>(bf16, grads, {}, {}, 0.1, 0.0, 0.0, 0.0, false, false,
                                          std::nullopt, std::nullopt, false, std::nullopt,
                                          std::vector<Tensor>{scalar(0.f)}, 1, scalar(1.f));
      },
      "sr_salts[0]");
  expect_error_naming(
      [&] {
        entry::fused_sgd_<cpu::CpuEngine>({at::zeros({3})}, grads, {}, {}, 0.1, 0.0, 0.0, 0.0,
                                          false, false, std::nullopt, std::nullopt, false,
                                          std::nullopt, salts, 1, scalar(1.f));
      },
      "bfloat16 params");
  expect_error_naming(
      [&] {
        entry::fused_sgd_<cpu::CpuEngine>(bf16, grads, {}, {}, 0.1, 0.0, 0.0, 0.0, false, false,
                                          std::nullopt, std::nullopt, false, std::nullopt,
                                          std::vector<Tensor>{}, 1, scalar(1.f));
      },
      "sr_salts");
  expect_error_naming(
      [&] {
        entry::fused_sgd_<cpu::CpuEngine>(bf16, grads, {}, {}, 0.1, 0.0, 0.0, 0.0, false, false,
                                          std::nullopt, std::nullopt, false, std::nullopt, salts,
                                          1);
      },
      "step");
  expect_error_naming(
      [&] {
        entry::fused_adam_<cpu::CpuEngine>(
            bf16, grads, {at::zeros({3})}, {at::zeros({3})}, {}, scalar(0.f), 1e-3, 0.9, 0.999,
            1e-8, 0.0, true, true, std::nullopt, std::nullopt, std::nullopt, std::nullopt, salts);
      },
      "sr_salts");
}

}  // namespace
}  // namespace mixedprec
