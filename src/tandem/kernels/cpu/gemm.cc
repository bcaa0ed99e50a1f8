#include "tandem/kernels/cpu/gemm.h"

#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

#include "tandem/kernels/cpu/amx_gemm.h"
#include "tandem/kernels/cpu/bf16_products.h"
#include "tandem/kernels/cpu/dnnl_common.h"
#include "tandem/kernels/cpu/kernel_timing.h"
#include "tandem/kernels/cpu/tile_gemm.h"

#include "tandem/core/convert.h"
#include "tandem/core/cpu_features.h"
#include "tandem/core/parallel.h"

namespace tandem::kernels {
namespace {

struct Runtime {
  dnnl::engine& engine = dnnl_engine();
  std::mutex mu;
  std::unordered_map<std::string, dnnl::matmul> cache;
};

Runtime& runtime() {
  static Runtime* r = new Runtime;  // leaked: primitives may be used during static teardown
  return *r;
}

// oneDNN's plain memory descriptors accept arbitrary strides, but its fast kernels want one
// unit-stride matrix dim; anything else is copied first.
Tensor matrix_operand(const Tensor& t) {
  if (t.stride(-1) == 1 || t.stride(-2) == 1) return t;
  return t.contiguous();
}

void gemm_f64(const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& c) {
  const int64_t B = c.size(0), M = c.size(1), N = c.size(2), K = a.size(2);
  const double* pa = a.data_ptr<double>();
  const double* pb = b.data_ptr<double>();
  double* pc = c.data_ptr<double>();
  const int64_t sab = a.size(0) == 1 ? 0 : a.stride(0), sam = a.stride(1), sak = a.stride(2);
  const int64_t sbb = b.size(0) == 1 ? 0 : b.stride(0), sbk = b.stride(1), sbn = b.stride(2);
  const double* pbias = bias.defined() ? bias.data_ptr<double>() : nullptr;
  const int64_t sbias = bias.defined() ? bias.stride(0) : 0;
  const KernelTimer timer(KernelKind::gemm, 2.0 * static_cast<double>(B * M) * static_cast<double>(N * K));
  parallel_for(0, B * M, std::max<int64_t>(1, 4096 / std::max<int64_t>(N * K, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t bi = r / M, i = r % M;
      double* crow = pc + r * N;
      for (int64_t j = 0; j < N; ++j) crow[j] = pbias ? pbias[j * sbias] : 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double aik = pa[bi * sab + i * sam + k * sak];
        const double* brow = pb + bi * sbb + k * sbk;
        for (int64_t j = 0; j < N; ++j) crow[j] += aik * brow[j * sbn];
      }
    }
  });
}

void gemm_dnnl(const Tensor& a0, const Tensor& b0, const Tensor& bias, Tensor& c) {
  const Tensor a = matrix_operand(a0), b = matrix_operand(b0);
  const int64_t B = c.size(0), M = c.size(1), N = c.size(2), K = a.size(2);
  using dims = dnnl::memory::dims;
  const dims a_dims{a.size(0), M, K}, b_dims{b.size(0), K, N}, c_dims{B, M, N};
  const dims a_str{a.size(0) == 1 ? M * K : a.stride(0), a.stride(1), a.stride(2)};
  const dims b_str{b.size(0) == 1 ? K * N : b.stride(0), b.stride(1), b.stride(2)};
  const dims c_str{M * N, N, 1};
  // oneDNN fixes a primitive's thread count when it is made: make it with this thread's share
  // (get_num_threads()) and key it by that, so set_num_threads() takes effect.
  dnnl_sync_threads();
  const std::string key = fmt::format("{},{},{}|{},{},{}|{},{},{}|{},{},{}|{}{}{}|{}|t{}", a_dims[0], M, K, b_dims[0], N,
                                      B, a_str[0], a_str[1], a_str[2], b_str[0], b_str[1], b_str[2],
                                      static_cast<int>(a.dtype()), static_cast<int>(c.dtype()),
                                      bias.defined() ? static_cast<int>(bias.dtype()) : -1, 0, get_num_threads());
  Runtime& rt = runtime();
  const dnnl::memory::desc a_md(a_dims, dnnl_type(a.dtype(), "matmul"), a_str);
  const dnnl::memory::desc b_md(b_dims, dnnl_type(b.dtype(), "matmul"), b_str);
  const dnnl::memory::desc c_md(c_dims, dnnl_type(c.dtype(), "matmul"), c_str);
  dnnl::memory::desc bias_md;
  Tensor bias_c;
  if (bias.defined()) {
    bias_c = bias.contiguous();
    bias_md = dnnl::memory::desc({1, 1, N}, dnnl_type(bias_c.dtype(), "matmul"), dims{N, N, 1});
  }
  dnnl::matmul prim;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    auto it = rt.cache.find(key);
    if (it == rt.cache.end()) {
      dnnl::matmul::desc desc = bias.defined() ? dnnl::matmul::desc(a_md, b_md, bias_md, c_md)
                                               : dnnl::matmul::desc(a_md, b_md, c_md);
      dnnl::matmul::primitive_desc pd(desc, rt.engine);
      it = rt.cache.emplace(key, dnnl::matmul(pd)).first;
    }
    prim = it->second;
  }
  dnnl_sync_threads();
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, dnnl::memory(a_md, rt.engine, a.data_ptr())},
      {DNNL_ARG_WEIGHTS, dnnl::memory(b_md, rt.engine, b.data_ptr())},
      {DNNL_ARG_DST, dnnl::memory(c_md, rt.engine, c.data_ptr())}};
  if (bias.defined()) args.emplace(DNNL_ARG_BIAS, dnnl::memory(bias_md, rt.engine, bias_c.data_ptr()));
  dnnl::stream& stream = dnnl_stream();
  const KernelTimer timer(KernelKind::gemm, 2.0 * static_cast<double>(B * M) * static_cast<double>(N * K));
  prim.execute(stream, args);
  stream.wait();
}

// How a (rows x cols) matrix operand with strides (rs, cs) reads as a row-major BLAS operand:
// 'N' with leading dimension rs, 'T' (its transpose is row-major) with leading dimension cs, or
// 0 when neither dimension has unit stride.
struct BlasOperand {
  char trans = 0;
  int64_t ld = 0;
};

BlasOperand blas_operand(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  if (cs == 1 || cols == 1) {
    const int64_t ld = rows == 1 ? cols : rs;
    if (ld >= std::max<int64_t>(cols, 1)) return {'N', ld};
  }
  if (rs == 1 || rows == 1) {
    const int64_t ld = cols == 1 ? rows : cs;
    if (ld >= std::max<int64_t>(rows, 1)) return {'T', ld};
  }
  return {};
}

enum class F32Gemm { sgemm, matmul };

// TANDEM_F32_GEMM picks the oneDNN entry point for f32: "sgemm" (dnnl_sgemm, its JIT GEMM; the
// default: 5-15% faster than the matmul primitive on our 1-thread model shapes) or "matmul" (the
// brgemm matmul primitive, which fuses the bias). Read once.
F32Gemm f32_gemm_choice() {
  static const F32Gemm choice = [] {
    const char* env = std::getenv("TANDEM_F32_GEMM");
    const std::string v = env != nullptr ? env : "";
    if (v.empty() || v == "sgemm") return F32Gemm::sgemm;
    if (v == "matmul") return F32Gemm::matmul;
    throw ValueError(fmt::format("TANDEM_F32_GEMM=\"{}\" is not a known f32 GEMM; use \"sgemm\" (oneDNN's JIT GEMM, "
                                 "the default) or \"matmul\" (oneDNN's matmul primitive)",
                                 v));
  }();
  return choice;
}

// f32 operands and result through dnnl_sgemm, one call per batch entry; the bias is written into
// c first and accumulated onto (beta = 1). Operands without a unit-stride dim take gemm_dnnl.
void gemm_f32(const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& c) {
  const int64_t B = c.size(0), M = c.size(1), N = c.size(2), K = a.size(2);
  const BlasOperand oa = blas_operand(M, K, a.stride(1), a.stride(2));
  const BlasOperand ob = blas_operand(K, N, b.stride(1), b.stride(2));
  if (f32_gemm_choice() == F32Gemm::matmul || oa.trans == 0 || ob.trans == 0) return gemm_dnnl(a, b, bias, c);
  const int64_t sab = a.size(0) == 1 ? 0 : a.stride(0), sbb = b.size(0) == 1 ? 0 : b.stride(0);
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  float* pc = c.data_ptr<float>();
  float beta = 0.0f;
  if (bias.defined()) {
    const Tensor bias_c = bias.contiguous();
    const float* pbias = bias_c.data_ptr<float>();
    for (int64_t r = 0; r < B * M; ++r) std::copy(pbias, pbias + N, pc + r * N);
    beta = 1.0f;
  }
  for (int64_t i = 0; i < B; ++i) {
    sgemm(oa.trans, ob.trans, M, N, K, pa + i * sab, oa.ld, pb + i * sbb, ob.ld, beta, pc + i * M * N, N);
  }
}

// bf16 operands on AMX tiles, one call per batch entry; f32 or bf16 c (an f32 c rounded through
// bf16 when `round_bf16`). Operands without a unit-stride dim take gemm_dnnl (never with
// round_bf16: gemm_into_rounded_bf16 only comes here with unit-stride operands).
void gemm_bf16_amx(const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& c, bool round_bf16 = false) {
  const int64_t B = c.size(0), M = c.size(1), N = c.size(2), K = a.size(2);
  const BlasOperand oa = blas_operand(M, K, a.stride(1), a.stride(2));
  const BlasOperand ob = blas_operand(K, N, b.stride(1), b.stride(2));
  if (oa.trans == 0 || ob.trans == 0) return gemm_dnnl(a, b, bias, c);
  const int64_t sab = a.size(0) == 1 ? 0 : a.stride(0), sbb = b.size(0) == 1 ? 0 : b.stride(0);
  const auto* pa = static_cast<const uint16_t*>(a.data_ptr());
  const auto* pb = static_cast<const uint16_t*>(b.data_ptr());
  const Tensor bias32 = bias.defined() ? bias.to(kFloat32).contiguous() : Tensor();
  const float* pbias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const bool c_bf16 = c.dtype() == kBFloat16;
  char* pc = static_cast<char*>(c.data_ptr());
  for (int64_t i = 0; i < B; ++i) {
    amx_gemm_bf16(oa.trans, ob.trans, M, N, K, pa + i * sab, oa.ld, pb + i * sbb, ob.ld, pbias, false,
                  pc + i * M * N * (c_bf16 ? 2 : 4), c_bf16, N, round_bf16);
  }
}

void check_operands(const Tensor& a, const Tensor& b, const Tensor& bias, const Tensor& c) {
  TANDEM_CHECK(a.dim() == 3 && b.dim() == 3, ShapeError, "gemm: expected 3-d operands, got {} and {}",
               shape_str(a.shape()), shape_str(b.shape()));
  TANDEM_CHECK(a.size(2) == b.size(1), ShapeError, "gemm: inner dimensions differ: {} @ {}", shape_str(a.shape()),
               shape_str(b.shape()));
  TANDEM_CHECK(a.dtype() == b.dtype(), DTypeError, "gemm: operand dtypes differ ({} vs {})", dtype_name(a.dtype()),
               dtype_name(b.dtype()));
  if (bias.defined()) {
    TANDEM_CHECK(bias.dim() == 1 && bias.size(0) == b.size(2), ShapeError, "gemm: bias of shape {} for {} outputs",
                 shape_str(bias.shape()), b.size(2));
  }
  (void)c;
}

// bf16 or f16 operands widened to f32 (exact), multiplied by the f32 GEMM, the result rounded
// once into c (f32 c: no rounding).
void gemm_widened(const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& c) {
  Tensor c32 = c.dtype() == kFloat32 ? c : empty(c.shape(), kFloat32);
  gemm_f32(widened_to_f32(a), widened_to_f32(b), bias.defined() && bias.dtype() != kFloat32 ? bias.to(kFloat32) : bias, c32);
  if (!c32.is_same(c)) c.copy_(c32);
}

}  // namespace

void gemm_into(const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& c) {
  check_operands(a, b, bias, c);
  if (c.numel() == 0) return;
  if (a.size(2) == 0) {
    // Empty inner dimension: the product is zero (plus bias).
    c.zero_();
    if (bias.defined()) c.add_(bias);
    return;
  }
  switch (a.dtype()) {
    case DType::f64: {
      const Tensor bb = bias.defined() ? bias.to(kFloat64) : bias;
      return gemm_f64(a, b, bb, c);
    }
    case DType::f32: {
      const Tensor bb = bias.defined() && bias.dtype() != kFloat32 ? bias.to(kFloat32) : bias;
      return gemm_f32(a, b, bb, c);
    }
    case DType::bf16: {
      const Bf16Products how = bf16_products();
      if (how == Bf16Products::amx) return gemm_bf16_amx(a, b, bias, c);
      if (how == Bf16Products::widened) return gemm_widened(a, b, bias, c);
      // An f32 bias stays f32 (added to the f32 sum before the one rounding, as on the AMX
      // kernel); other dtypes are widened to f32.
      const Tensor bb = bias.defined() && bias.dtype() != kFloat32 && bias.dtype() != kBFloat16 ? bias.to(kFloat32) : bias;
      return gemm_dnnl(a, b, bb, c);
    }
    case DType::f16:  // this CPU's oneDNN has no f16 GEMM
      return gemm_widened(a, b, bias, c);
    default:
      throw DTypeError(fmt::format("matmul: expected a floating-point dtype, got {}", dtype_name(a.dtype())));
  }
}

Tensor widened_to_f32(const Tensor& t) {
  if (t.dtype() == kFloat32) return t;
  if (!t.is_non_overlapping_and_dense()) return t.to(kFloat32);
  Tensor w = empty_strided(t.shape(), t.strides(), kFloat32);
  convert(t.data_ptr(), t.dtype(), w.data_ptr(), kFloat32, t.numel());
  return w;
}

void gemm_into_rounded_bf16(const Tensor& a, const Tensor& b, Tensor& c) {
  check_operands(a, b, Tensor(), c);
  TANDEM_CHECK(a.dtype() == kBFloat16 && c.dtype() == kFloat32 && c.is_contiguous() && c.dim() == 3 &&
                   c.size(0) == std::max(a.size(0), b.size(0)) && c.size(1) == a.size(1) && c.size(2) == b.size(2),
               DTypeError,
               "gemm_into_rounded_bf16: expected bf16 operands and a contiguous f32 (B, M, N) output, got {} operands "
               "and a {} {} output",
               dtype_name(a.dtype()), dtype_name(c.dtype()), shape_str(c.shape()));
  if (c.numel() == 0) return;
  const bool unit = blas_operand(a.size(1), a.size(2), a.stride(1), a.stride(2)).trans != 0 &&
                    blas_operand(b.size(1), b.size(2), b.stride(1), b.stride(2)).trans != 0;
  if (a.size(2) > 0 && amx_bf16_enabled() && unit) return gemm_bf16_amx(a, b, Tensor(), c, true);
  if (a.size(2) > 0 && bf16_products() == Bf16Products::widened) {
    // The f32 product straight into c, then rounded to bf16 in place, a block at a time through
    // an L1-sized buffer: no bf16 result in memory and no second f32 copy.
    gemm_widened(a, b, Tensor(), c);
    float* pc = c.data_ptr<float>();
    constexpr int64_t kBlock = 4096;
    uint16_t rounded[kBlock];
    for (int64_t i = 0; i < c.numel(); i += kBlock) {
      const int64_t n = std::min(kBlock, c.numel() - i);
      convert(pc + i, kFloat32, rounded, kBFloat16, n);
      convert(rounded, kBFloat16, pc + i, kFloat32, n);
    }
    return;
  }
  Tensor r = gemm(a, b, Tensor(), kBFloat16);
  // c is a parameter's gradient (its rounded destination), read next by the optimizer or DDP.
  convert_for_later(r.data_ptr(), kBFloat16, c.data_ptr(), kFloat32, c.numel());
}

namespace {

void dnnl_sgemm_checked(char transa, char transb, int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
                        const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const dnnl_status_t st = dnnl_sgemm(transa, transb, M, N, K, 1.0f, a, lda, b, ldb, beta, c, ldc);
  TANDEM_CHECK(st == dnnl_success, Error, "sgemm: dnnl_sgemm failed (status {}) for {}{} {} x {} x {}",
               static_cast<int>(st), transa, transb, M, K, N);
}

}  // namespace

void sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc) {
  if (M == 0 || N == 0) return;
  // On C = A B^T with B's rows a multiple of 4 KiB apart (a Linear weight with in_features a
  // multiple of 1024) and 2..128 rows of A, dnnl_sgemm is 10-110% slower than on the same product
  // with the operands swapped (one Zen 4 core, oneDNN 2.6, 1 thread: 88 vs 102 GFLOP/s for
  // 128 x 1024 x 1024, 35 vs 74 for 16 x 1024 x 1024; from 256 rows on the swap gains nothing,
  // -3..+5%, and one row is a matrix-vector product either way). There C^T = B A^T is computed into
  // scratch (the old C transposed in first when beta != 0) and transposed into C: the same
  // products, each element's sum possibly in another order, as between any two GEMM kernels.
  // Whatever the stride, 8..64 rows of A against 128 or more columns gain from the swap too (one
  // Intel Xeon core with AMX, the same oneDNN, transposes included: 8 x 1024 x 784 333 vs 234 us,
  // 32 x 300 x 1000 148 vs 117, 64 x 1024 x 784 622 vs 553; 2 rows lose, 106 vs 237; 64 x 256 x
  // 256 and smaller are even). On that Intel core the 4 KiB case only gains from 8 rows on, and
  // past 64 rows only against fewer than 128 columns (transposes included, cold caches: 2 x 1024 x
  // 1024 167 vs 404 us, 4 x 1024 x 1024 325 vs 411, 16 x 1024 x 1024 693 vs 398; in W1's f32 step
  // 128 x 1024 x 1024 2018 vs 2174 us but 128 x 10 x 1024 106 vs 48), so there it keeps to those.
  //
  // C = A^T B (a weight gradient dY^T X) with A's rows a multiple of 4 KiB apart and C at least
  // twice as tall as wide is likewise 15-35% slower than C^T = B^T A when K (the batch) is large
  // (one Intel Xeon core with AMX, oneDNN 2.6, cold caches, transposes not included: 1024 x 256 x
  // 1024 105 vs 134 GFLOP/s, 2048 x 256 x 1024 109 vs 145, 1024 x 64 x 1024 89 vs 114; transposes
  // included: 600 x 300 x 1024 3.8 vs 3.2 ms, 256 x 64 x 1024 350 vs 327 us). It loses with A's rows
  // 4160 bytes apart (137 vs 128 GFLOP/s), for a square C (too little gain for the transposes),
  // below 256 rows (64 x 32 x 1024 83 vs 99 us) and for small K (1024 x 256 x 128 581 vs 727 us,
  // 2048 x 256 x 512 4.2 vs 4.2-4.4 ms), hence K >= 768.
  const bool aliased =
      ldb % 1024 == 0 && M <= 128 && (cpu_features().intel ? M >= 8 && (M <= 64 || N < 128) : M >= 2);
  const bool few_rows = M >= 8 && M <= 64 && N >= 128;
  const bool nt_swap = transa == 'N' && transb == 'T' && (aliased || few_rows);
  const bool tn_swap = transa == 'T' && transb == 'N' && lda % 1024 == 0 && M >= 256 && 2 * N <= M && K >= 768;
  const bool swap = (nt_swap || tn_swap) && N >= 2 && ldc == N && K > 0;
  dnnl_sync_threads();
  const KernelTimer timer(KernelKind::gemm, 2.0 * static_cast<double>(M) * static_cast<double>(N * K));
  if (swap) {
    Tensor scratch = empty({N * M}, kFloat32);
    float* ct = scratch.data_ptr<float>();
    if (beta != 0.0f) transpose_f32(c, M, N, ldc, ct);
    // C^T = op(B)^T op(A)^T: each operand's transposition flips.
    dnnl_sgemm_checked(transb == 'N' ? 'T' : 'N', transa == 'N' ? 'T' : 'N', N, M, K, b, ldb, a, lda, beta, ct, M);
    transpose_f32(ct, N, M, M, c);
    return;
  }
  dnnl_sgemm_checked(transa, transb, M, N, K, a, lda, b, ldb, beta, c, ldc);
}

Tensor gemm(const Tensor& a, const Tensor& b, const Tensor& bias, DType out_dtype) {
  check_operands(a, b, bias, Tensor());
  TANDEM_CHECK(out_dtype == a.dtype() || (is_reduced_float(a.dtype()) && out_dtype == kFloat32), DTypeError,
               "gemm: output dtype {} for {} inputs", dtype_name(out_dtype), dtype_name(a.dtype()));
  Tensor c = empty({std::max(a.size(0), b.size(0)), a.size(1), b.size(2)}, out_dtype);
  gemm_into(a, b, bias, c);
  return c;
}

}  // namespace tandem::kernels
