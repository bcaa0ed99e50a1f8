#include "tandem/kernels/cpu/amx_gemm.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tandem/core/cpu_features.h"
#include "tandem/core/error.h"
#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/bf16_products.h"
#include "tandem/kernels/cpu/kernel_timing.h"
#include "tandem/kernels/cpu/transpose16.h"

// GCC 12's avx512fintrin.h seeds masked intrinsics with an "undefined" register and then warns
// about it in every caller (see row_math.cc).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace tandem::kernels {
namespace {

#define TANDEM_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// Layouts (all in bf16 units, u16):
//   packed A: rows of Kp values (K rounded up to 32, zero-padded), 32 rows per block; an A tile
//     is 16 rows x 32 k (64 bytes per row). A row-major A with K % 32 == 0 is read in place.
//   packed B: panels of 32 columns of C; panel row p (p < Kp / 2) holds, for its 32 columns j,
//     the pair (B(2p, j), B(2p + 1, j)) -- the "VNNI" pairing the tile product wants -- so one
//     B tile is 16 rows p x 16 columns j (64 bytes per row, row stride 128 bytes).
constexpr int64_t kBlock = 32;     // rows and columns of C per block (2 x 2 tiles)
constexpr int64_t kTileK = 32;     // k values per tile product
constexpr int64_t kPanelRow = 64;  // u16 per packed-B panel row (32 columns x 2)
// amx_gemm_bf16 swaps the operands for at most kSwapMaxM rows of C against a B of at least
// kSwapMinB values (1 MiB of bf16); see swap_operands.
constexpr int64_t kSwapMaxM = 128;
constexpr int64_t kSwapMinB = int64_t{1} << 19;
// run_gemm packs A whole before the products when it is stored transposed with K >= kPackAllMinK,
// or row-major on a stride of a multiple of 1 KiB against N >= kCopyMinN columns.
constexpr int64_t kPackAllMinK = 256;
constexpr int64_t kCopyMinN = 512;

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: the f32 accumulators of a 32 x 32 block of C (0 = rows 0-15 x cols 0-15, 1 = rows
// 0-15 x cols 16-31, 2 and 3 the same for rows 16-31); 4, 5: the two 16-row slices of A; 6, 7:
// the two 16-column slices of B. Every tile is 16 rows x 64 bytes.
constexpr TileConfig kTileConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

bool request_tile_state() {
  const CpuFeatures& f = cpu_features();
  if (!f.amx_bf16 || !f.avx512_bf16 || !f.avx512bw || !f.avx512vl) return false;
  // Linux (5.16+) hands out the 8 KiB tile data state only on request.
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline __mmask16 mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}
inline __mmask32 mask32(int64_t n) {
  return n >= 32 ? 0xffffffffu : n <= 0 ? 0 : static_cast<__mmask32>((1u << n) - 1);
}

// 16 lanes of (lo[i], hi[i]) pairs as 32-bit values; a null row reads as zeros, and so do the
// lanes outside `m`.
TANDEM_AMX inline __m512i pairs16(const uint16_t* lo, const uint16_t* hi, __mmask16 m) {
  const __m512i l = lo != nullptr ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, lo)) : _mm512_setzero_si512();
  const __m512i h = hi != nullptr ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, hi)) : _mm512_setzero_si512();
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

// Row pairs p_lo..p_hi-1 of B row-major (K x N, row stride ldb) into every panel (panel stride
// Kp * 32): B's rows are read front to back, two at a time, which the hardware prefetchers follow
// (walking one panel's column strip over all K rows instead stalls on every row).
TANDEM_AMX void pack_b_rowmajor(const uint16_t* b, int64_t ldb, int64_t K, int64_t N, int64_t p_lo, int64_t p_hi,
                                int64_t Kp, uint16_t* dst) {
  const int64_t panels = (N + kBlock - 1) / kBlock;
  for (int64_t p = p_lo; p < p_hi; ++p) {
    const uint16_t* r0 = 2 * p < K ? b + 2 * p * ldb : nullptr;
    const uint16_t* r1 = 2 * p + 1 < K ? b + (2 * p + 1) * ldb : nullptr;
    for (int64_t j = 0; j < panels; ++j) {
      uint16_t* row = dst + j * Kp * kBlock + p * kPanelRow;
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t n = j * kBlock + 16 * h;
        const __mmask16 m = mask16(N - n);
        const __m512i v = m != 0 ? pairs16(r0 != nullptr ? r0 + n : nullptr, r1 != nullptr ? r1 + n : nullptr, m)
                                 : _mm512_setzero_si512();
        _mm512_storeu_si512(row + 32 * h, v);
      }
    }
  }
}

// One panel of B stored transposed (bt: N x K, row stride ldb): a pair (B(2p, j), B(2p+1, j)) is
// one 32-bit word of bt's row j, so packing is a 16 x 16 transpose of 32-bit words.
TANDEM_AMX void pack_b_transposed(const uint16_t* bt, int64_t ldb, int64_t K, int64_t n0, int64_t ncols, int64_t Kp,
                                  uint16_t* dst) {
  __m512i r[16];
  for (int64_t k0 = 0; k0 < Kp; k0 += kTileK) {
    const __mmask32 mk = mask32(K - k0);
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t j = 16 * h + i;
        r[i] = j < ncols ? _mm512_maskz_loadu_epi16(mk, bt + (n0 + j) * ldb + k0) : _mm512_setzero_si512();
      }
      transpose16x16_epi32(r);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(dst + (k0 / 2 + p) * kPanelRow + 32 * h, r[p]);
    }
  }
}

// Rows m0..m0+nrows-1 of a row-major A into packed rows (stride Kp); rows at or past M are zeros.
TANDEM_AMX void pack_a_rowmajor(const uint16_t* a, int64_t lda, int64_t M, int64_t K, int64_t m0, int64_t nrows,
                                int64_t Kp, uint16_t* dst) {
  for (int64_t r = 0; r < nrows; ++r) {
    const bool valid = m0 + r < M;
    for (int64_t k0 = 0; k0 < Kp; k0 += kTileK) {
      const __m512i v =
          valid ? _mm512_maskz_loadu_epi16(mask32(K - k0), a + (m0 + r) * lda + k0) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + r * Kp + k0, v);
    }
  }
}

// Rows m0..m0+31, k values k0..k0+31 of A stored transposed (at: K x M, row stride lda) into
// rows of a packed block (row stride Kp, starting at column k0); rows at or past M are zeros. Each
// of at's 32 rows is read once, 32 values (one cache line), and each pair of rows 2p, 2p+1 is
// interleaved into 32-bit words (A(i, 2p), A(i, 2p+1)): unpacklo gives the words of columns
// 8l..8l+3 of each 128-bit lane l, unpackhi those of 8l+4..8l+7. Sixteen such registers
// transposed 16 x 16 are 16 rows of A, each stored to the row it belongs to.
TANDEM_AMX void pack_a_transposed_tile(const uint16_t* at, int64_t lda, int64_t M, int64_t K, int64_t m0, int64_t k0,
                                       int64_t Kp, uint16_t* dst) {
  const __mmask32 cols = mask32(M - m0);
  __m512i lo[16], hi[16];
  for (int64_t p = 0; p < 16; ++p) {
    const int64_t k = k0 + 2 * p;
    const __m512i r0 = k < K ? _mm512_maskz_loadu_epi16(cols, at + k * lda + m0) : _mm512_setzero_si512();
    const __m512i r1 = k + 1 < K ? _mm512_maskz_loadu_epi16(cols, at + (k + 1) * lda + m0) : _mm512_setzero_si512();
    lo[p] = _mm512_unpacklo_epi16(r0, r1);
    hi[p] = _mm512_unpackhi_epi16(r0, r1);
  }
  transpose16x16_epi32(lo);
  transpose16x16_epi32(hi);
  for (int64_t q = 0; q < 16; ++q) {
    const int64_t i = 8 * (q / 4) + q % 4;  // the column of at (row of A) in 32-bit lane q of unpacklo
    _mm512_storeu_si512(dst + i * Kp + k0, lo[q]);
    _mm512_storeu_si512(dst + (i + 4) * Kp + k0, hi[q]);
  }
}

// One block (rows m0..m0+31 of A, all of K) from at, packed just before its products, so the
// block is written into L1 and read from there (its 32 columns of at are prefetched during the
// previous block). Used for short K; longer ones are packed whole first (pack_a_transposed_all).
TANDEM_AMX void pack_a_transposed(const uint16_t* at, int64_t lda, int64_t M, int64_t K, int64_t m0, int64_t Kp,
                                  uint16_t* dst) {
  for (int64_t k0 = 0; k0 < Kp; k0 += kTileK) pack_a_transposed_tile(at, lda, M, K, m0, k0, Kp, dst);
}

// K tiles kt_lo..kt_hi-1 of every block of A from at into `dst` (Mp x Kp, block after block): at's
// rows are read front to back, 32 at a time, each across its whole width, which the hardware
// prefetchers follow. Walking one block's 32 columns down all of K instead reads one cache line
// per row of at; with rows 2 or 4 KiB apart those lines share a few cache sets, evict each other
// and the packing stalls on memory (a 1024 x 1024 A, rows 2 KiB apart: ~310 us per product,
// ~180 us packed whole).
TANDEM_AMX void pack_a_transposed_all(const uint16_t* at, int64_t lda, int64_t M, int64_t K, int64_t kt_lo,
                                      int64_t kt_hi, int64_t ldd, uint16_t* dst) {
  const int64_t Mp = round_up(M, kBlock);
  for (int64_t kt = kt_lo; kt < kt_hi; ++kt) {
    for (int64_t m0 = 0; m0 < Mp; m0 += kBlock) pack_a_transposed_tile(at, lda, M, K, m0, kt * kTileK, ldd, dst + m0 * ldd);
  }
}

// Software prefetch of the next block of A's rows, spread over the current block's tile loop:
// tile loads from cold memory are not followed by the hardware prefetchers, and a block's rows
// sit `stride` bytes apart (one stream per row).
struct Prefetch {
  const char* base = nullptr;  // row 0 of the next block, or null
  int64_t stride = 0;          // bytes between its rows
  int64_t lines_per_row = 0;
  int64_t total = 0;  // lines to fetch
  int64_t next = 0;
  int64_t per_step = 0;
  inline void step() {
    for (int64_t q = 0; q < per_step && next < total; ++q, ++next) {
      const int64_t row = next / lines_per_row, col = next % lines_per_row;
      _mm_prefetch(base + row * stride + col * 64, _MM_HINT_T0);
    }
  }
};

// The accumulator tiles 0-3 as the 32 x 32 f32 block at c (row stride ld floats).
TANDEM_AMX inline void load_accumulators(const float* c, int64_t ld) {
  _tile_loadd(0, c, ld * 4);
  _tile_loadd(1, c + 16, ld * 4);
  _tile_loadd(2, c + 16 * ld, ld * 4);
  _tile_loadd(3, c + 16 * ld + 16, ld * 4);
}
TANDEM_AMX inline void store_accumulators(float* c, int64_t ld) {
  _tile_stored(0, c, ld * 4);
  _tile_stored(1, c + 16, ld * 4);
  _tile_stored(2, c + 16 * ld, ld * 4);
  _tile_stored(3, c + 16 * ld + 16, ld * 4);
}
TANDEM_AMX inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// The 32 x 32 block: tiles 0-3 += A(rows of a0, a1) @ B(panel) over kblocks steps of 32 k.
TANDEM_AMX inline void block_product(const uint16_t* a0, const uint16_t* a1, int64_t a_stride_bytes,
                                     const uint16_t* panel, int64_t kblocks, Prefetch& pf) {
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    pf.step();
    const uint16_t* bk = panel + kb * 16 * kPanelRow;
    _tile_loadd(4, a0 + kb * kTileK, a_stride_bytes);
    _tile_loadd(6, bk, kPanelRow * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, bk + 32, kPanelRow * 2);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + kb * kTileK, a_stride_bytes);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

TANDEM_AMX inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// Round to nearest-even into bf16, as core/convert does: the BF16 instruction, except for
// subnormal inputs, which it flushes to zero and which are rounded by integer arithmetic instead.
TANDEM_AMX inline __m256i to_bf16(__m512 x) {
  __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
  const __m512i xi = _mm512_castps_si512(x);
  const __mmask16 subnormal =
      _mm512_cmpeq_epi32_mask(_mm512_and_si512(xi, _mm512_set1_epi32(0x7f800000)), _mm512_setzero_si512()) &
      _mm512_cmpneq_epi32_mask(_mm512_and_si512(xi, _mm512_set1_epi32(0x7fffffff)), _mm512_setzero_si512());
  if (subnormal != 0) [[unlikely]] {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(xi, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(xi, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm256_mask_blend_epi16(subnormal, r, _mm512_cvtepi32_epi16(rounded));
  }
  return r;
}

// Writes rows x cols of the f32 block s (row stride 32) to c: + bias, + old c, rounded once.
// `round_bf16` (f32 c only): the result is rounded to bf16 as above and stored widened back to
// f32, bit for bit what a bf16 c converted to f32 afterwards holds.
TANDEM_AMX void write_block(const float* s, int64_t rows, int64_t cols, const float* bias, bool accumulate, void* c,
                            bool c_bf16, bool round_bf16, int64_t ldc) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < 2 && 16 * h < cols; ++h) {
      const __mmask16 m = mask16(cols - 16 * h);
      __m512 v = _mm512_loadu_ps(s + r * kBlock + 16 * h);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + 16 * h));
      if (c_bf16) {
        uint16_t* p = static_cast<uint16_t*>(c) + r * ldc + 16 * h;
        if (accumulate) v = _mm512_add_ps(v, load_bf16(p, m));
        _mm256_mask_storeu_epi16(p, m, to_bf16(v));
      } else {
        float* p = static_cast<float*>(c) + r * ldc + 16 * h;
        if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, p));
        if (round_bf16) v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
        _mm512_mask_storeu_ps(p, m, v);
      }
    }
  }
}

// dst(j, i) = src(i, j) for i < rows, j < cols (each rounded up to 16; up to 32), in 16 x 16
// quarters; src has row stride ld, dst row stride 32 (64-byte aligned).
TANDEM_AMX void transpose_block(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  __m512i r[16];
  for (int64_t bi = 0; bi < rows; bi += 16) {
    for (int64_t bj = 0; bj < cols; bj += 16) {
      for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (bi + i) * ld + bj);
      transpose16x16_epi32(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_store_si512(dst + (bj + j) * kBlock + bi, r[j]);
    }
  }
}

// The block s (rows x cols, row stride 32) written transposed: s(r, j) goes to c[j * ldc + r].
// Transposed into a second scratch, then written by write_block, whose per-column bias is then
// the caller's per-row one.
TANDEM_AMX void write_block_transposed(const float* s, int64_t rows, int64_t cols, const float* bias, bool accumulate,
                                       void* c, bool c_bf16, bool round_bf16, int64_t ldc) {
  alignas(64) float t[kBlock * kBlock];
  transpose_block(s, kBlock, rows, cols, t);
  write_block(t, cols, rows, bias, accumulate, c, c_bf16, round_bf16, ldc);
}

// One product, or one chunk of B's columns of it (N, b_packed, bias and c then start at the
// chunk's first column).
struct Problem {
  int64_t M, N, K, Kp;
  char transa;
  const uint16_t* a;  // A as given (lda)
  int64_t lda;
  bool in_place;  // 'N' with K % 32 == 0: whole blocks of 32 rows are read where they are
  const uint16_t* b_packed;
  const float* bias;
  bool accumulate;
  void* c;
  bool c_bf16;
  bool round_bf16;  // f32 c holding bf16-rounded values (write_block)
  int64_t ldc;
  // This product is C^T of the caller's (amx_gemm_bf16 swapped the operands): element (i, j)
  // goes to c[j * ldc + i], and the bias is indexed by i.
  bool c_trans = false;
};

// Packing buffers, kept per calling thread and grown as needed (a few MiB for model shapes).
// 64-byte aligned: a tile row split over two cache lines costs two loads.
struct Buffer {
  std::vector<uint16_t> v;
  uint16_t* get(int64_t n) {
    if (v.size() < static_cast<size_t>(n + 32)) v.resize(static_cast<size_t>(n + 32));
    const auto addr = reinterpret_cast<uintptr_t>(v.data());
    return v.data() + ((64 - addr % 64) % 64) / 2;
  }
};
struct Buffers {
  Buffer a, b, block;
};

Buffers& buffers() {
  thread_local Buffers buf;
  return buf;
}

// Blocks of 32 rows mb_lo..mb_hi-1, each against every panel of B: the block's A rows (<= 32 x
// Kp) stay in L1/L2 while the packed B (K x N, a few hundred KiB) streams from L2.
TANDEM_AMX void compute_blocks(const Problem& pr, int64_t mb_lo, int64_t mb_hi) {
  _tile_loadconfig(&kTileConfig);
  alignas(64) float scratch[kBlock * kBlock];
  const int64_t kblocks = pr.Kp / kTileK, panels = (pr.N + kBlock - 1) / kBlock;
  const size_t esize = pr.c_bf16 ? 2 : 4;
  uint16_t* block = buffers().block.get(kBlock * pr.Kp);
  // Where block m0's A values are in memory: rows of A, or (stored transposed) 32 columns of at.
  auto source = [&](int64_t m0) { return pr.transa == 'T' ? pr.a + m0 : pr.a + m0 * pr.lda; };
  for (int64_t mb = mb_lo; mb < mb_hi; ++mb) {
    const int64_t m0 = mb * kBlock, rows = std::min(kBlock, pr.M - m0);
    int64_t a_stride = pr.Kp;
    const uint16_t* a0 = block;
    if (pr.in_place && rows == kBlock) {
      a0 = source(m0);
      a_stride = pr.lda;
    } else if (pr.transa == 'T') {
      pack_a_transposed(pr.a, pr.lda, pr.M, pr.K, m0, pr.Kp, block);
    } else {
      pack_a_rowmajor(pr.a, pr.lda, pr.M, pr.K, m0, kBlock, pr.Kp, block);
    }
    // The block's packing stores stay before the tile loads that read them (GCC's tile-load
    // intrinsic declares no memory read; each block ends with tile stores, which do).
    __asm__ __volatile__("" ::: "memory");
    Prefetch pf;
    if (mb + 1 < mb_hi && kblocks > 0 && panels > 0) {
      pf.base = reinterpret_cast<const char*>(source(m0 + kBlock));
      pf.stride = pr.lda * 2;
      const int64_t skew = reinterpret_cast<uintptr_t>(pf.base) % 64;
      if (pr.transa == 'T') {  // K rows of at, 32 values (one or two lines) each
        pf.lines_per_row = skew == 0 ? 1 : 2;
        pf.total = pr.K * pf.lines_per_row;
      } else {
        pf.lines_per_row = (skew + pr.K * 2 + 63) / 64;
        pf.total = std::min(kBlock, pr.M - m0 - kBlock) * pf.lines_per_row;
      }
      pf.per_step = (pf.total + panels * kblocks - 1) / (panels * kblocks);
    }
    for (int64_t j = 0; j < panels; ++j) {
      const int64_t n0 = j * kBlock, cols = std::min(kBlock, pr.N - n0);
      const uint16_t* panel = pr.b_packed + j * pr.Kp * kBlock;
      char* cblock = static_cast<char*>(pr.c) + (pr.c_trans ? n0 * pr.ldc + m0 : m0 * pr.ldc + n0) * esize;
      // Full f32 blocks without bias go straight between the tiles and c. An accumulating one
      // starts the tiles from c's old values (the sum runs on from them), also when C is written
      // transposed, so that both operand orders give the same bits.
      const bool full_f32 = !pr.c_bf16 && !pr.round_bf16 && pr.bias == nullptr && rows == kBlock && cols == kBlock;
      const bool direct = full_f32 && !pr.c_trans;
      const bool preload = full_f32 && pr.accumulate;
      float* target = direct ? reinterpret_cast<float*>(cblock) : scratch;
      const int64_t ld = direct ? pr.ldc : kBlock;
      // The full block of c (rows of c are its columns here), transposed into the scratch.
      if (preload && !direct) transpose_block(reinterpret_cast<const float*>(cblock), pr.ldc, kBlock, kBlock, scratch);
      if (preload) load_accumulators(target, ld);
      else zero_accumulators();
      block_product(a0, a0 + 16 * a_stride, a_stride * 2, panel, kblocks, pf);
      store_accumulators(target, ld);
      if (pr.c_trans) {
        write_block_transposed(scratch, rows, cols, pr.bias != nullptr ? pr.bias + m0 : nullptr,
                               pr.accumulate && !preload, cblock, pr.c_bf16, pr.round_bf16, pr.ldc);
      } else if (!direct) {
        write_block(scratch, rows, cols, pr.bias != nullptr ? pr.bias + n0 : nullptr, pr.accumulate, cblock, pr.c_bf16,
                    pr.round_bf16, pr.ldc);
      }
    }
  }
  // Hands the tile state back: a thread that keeps it live carries 8 KiB more into every context
  // switch and signal frame.
  _tile_release();
}

}  // namespace

bool amx_bf16_usable() {
  static const bool ok = request_tile_state();
  return ok;
}

namespace {

void run_gemm(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda,
              const uint16_t* b, int64_t ldb, const float* bias, bool accumulate, void* c, bool c_bf16, bool round_bf16,
              int64_t ldc, bool threaded, bool c_trans = false) {
  TANDEM_CHECK(amx_bf16_usable(), Error, "amx_gemm_bf16: this CPU or kernel offers no AMX-BF16 tiles");
  TANDEM_CHECK((transa == 'N' || transa == 'T') && (transb == 'N' || transb == 'T'), ValueError,
               "amx_gemm_bf16: transa/transb must be 'N' or 'T', got '{}' '{}'", transa, transb);
  if (M <= 0 || N <= 0) return;
  auto parallel_for = [threaded](int64_t begin, int64_t end, int64_t grain,
                                 const std::function<void(int64_t, int64_t)>& fn) {
    if (threaded) tandem::parallel_for(begin, end, grain, fn);
    else if (begin < end) fn(begin, end);
  };
  const int64_t Kp = round_up(K, kTileK), Mp = round_up(M, kBlock);
  // A is packed whole into rows 64 bytes longer than Kp before the products, then read in place,
  // in two cases. Stored transposed with a long K (pack_a_transposed_all says why): 1024 x 256 x
  // 1024 857 -> 575 us, 256 x 1024 x 1024 826 -> 577, 1024^3 2880 -> 2036 (one core, c f32).
  // Row-major with a row stride that is a multiple of 1 KiB, against many panels of B: every
  // tile load of 16 rows then falls into a few L1 sets, once per panel; a copy with a padded
  // stride costs less from 512 columns of C on (1024^3 2330 -> 2039 us, 256 x 1024 x 1024 674 ->
  // 550; with 128 columns, a swapped Linear forward, the copy would cost more than it saves).
  // The padding keeps the packed rows off power-of-two strides too.
  bool a_packed = false;
  const int64_t ld_packed = Kp + kTileK;
  if (transa == 'T' && K >= kPackAllMinK) {
    uint16_t* ap = buffers().a.get(Mp * ld_packed);
    parallel_for(0, Kp / kTileK, 1,
                 [&](int64_t lo, int64_t hi) { pack_a_transposed_all(a, lda, M, K, lo, hi, ld_packed, ap); });
    a_packed = true;
    transa = 'N';
    a = ap;
    lda = ld_packed;
  } else if (transa == 'N' && K % kTileK == 0 && (lda * 2) % 1024 == 0 && M >= 2 * kBlock && N >= kCopyMinN) {
    uint16_t* ap = buffers().a.get(Mp * ld_packed);
    const uint16_t* src = a;
    const int64_t ld_src = lda;
    parallel_for(0, M, kBlock, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) std::memcpy(ap + r * ld_packed, src + r * ld_src, static_cast<size_t>(K) * 2);
    });
    a_packed = true;
    a = ap;
    lda = ld_packed;
  }
  // B is packed in chunks of columns. When A's blocks are read in place (row-major, K % 32 == 0)
  // a chunk is at most 512 KiB, so that it stays in L2 while every block of rows runs against it
  // (1024 x 1024 x 1024: 2604 -> 2269 us; 128 x 1024 x 1024: 452 -> 381 us on one core). A packed
  // per block is packed again for every chunk, so there chunks are ~4 MiB: only a huge product
  // (a vocabulary projection) takes several, which keeps the buffer bounded.
  const bool in_place = a_packed || (transa == 'N' && K % kTileK == 0);
  const int64_t chunk_bytes = in_place ? int64_t{1} << 19 : int64_t{4} << 20;
  const int64_t chunk = Kp == 0 ? round_up(N, kBlock)
                                : std::max<int64_t>(kBlock, chunk_bytes / (Kp * 2) / kBlock * kBlock);
  uint16_t* bp = buffers().b.get(std::min(round_up(N, kBlock), chunk) * Kp);
  const size_t esize = c_bf16 ? 2 : 4;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t nc = std::min(chunk, N - n0), panels = (nc + kBlock - 1) / kBlock;
    if (transb == 'N') {
      parallel_for(0, Kp / 2, 16, [&](int64_t lo, int64_t hi) { pack_b_rowmajor(b + n0, ldb, K, nc, lo, hi, Kp, bp); });
    } else {
      parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
          const int64_t j0 = j * kBlock;
          pack_b_transposed(b + n0 * ldb, ldb, K, j0, std::min(kBlock, nc - j0), Kp, bp + j * Kp * kBlock);
        }
      });
    }
    // A chunk of columns of C starts n0 columns in, or (C transposed in c) n0 rows in.
    const Problem pr{M,
                     nc,
                     K,
                     Kp,
                     transa,
                     a,
                     lda,
                     in_place,
                     bp,
                     bias != nullptr && !c_trans ? bias + n0 : bias,
                     accumulate,
                     static_cast<char*>(c) + (c_trans ? n0 * ldc : n0) * esize,
                     c_bf16,
                     round_bf16 && !c_bf16,
                     ldc,
                     c_trans};
    // Keeps the compiler from moving the packing stores past the tile loads (the tile intrinsics
    // are asm statements that do not declare the memory they read).
    __asm__ __volatile__("" ::: "memory");
    parallel_for(0, Mp / kBlock, 1, [&](int64_t lo, int64_t hi) { compute_blocks(pr, lo, hi); });
    __asm__ __volatile__("" ::: "memory");
  }
}

bool swap_operands(char transb, int64_t M, int64_t N, int64_t K, AmxOperandOrder order) {
  if (order != AmxOperandOrder::automatic) return order == AmxOperandOrder::swapped;
  // A few rows of C against a large B stored transposed (a Linear's forward, x W^T, on a small
  // batch): as given, the whole of B (MiBs) is packed for at most four blocks of 32 rows;
  // swapped, B's rows are the blocks (read in place when K % 32 == 0, each once) and the small A
  // is packed into L2. Measured on one core (f32 c, as given -> swapped): 128 x 1024 x 1024
  // 388 -> 314 us, 128 x 1024 x 784 299 -> 236, 64 x 1024 x 1024 197 -> 159; losses: 256 rows
  // (514 -> 595), a B of 256 KiB (128 x 256 x 256: 16 -> 18). Not for B row-major: its rows as A'
  // would be packed transposed per block, which costs more than it saves.
  return transb == 'T' && M <= kSwapMaxM && N >= 2 * M && N * K >= kSwapMinB && K >= kTileK;
}

}  // namespace

bool amx_bf16_enabled() { return bf16_products() == Bf16Products::amx; }

void amx_gemm_bf16(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda,
                   const uint16_t* b, int64_t ldb, const float* bias, bool accumulate, void* c, bool c_bf16,
                   int64_t ldc, bool round_bf16, AmxOperandOrder order) {
  const KernelTimer timer(KernelKind::gemm, 2.0 * static_cast<double>(std::max<int64_t>(M, 0)) *
                                                static_cast<double>(std::max<int64_t>(N, 0) * K));
  if (swap_operands(transb, M, N, K, order)) {
    // C^T = op(B)^T op(A)^T: B's rows are the blocks of A' (read in place or packed per block,
    // once), A is the packed B' (small), and C^T is written transposed into c.
    run_gemm(transb == 'T' ? 'N' : 'T', transa == 'N' ? 'T' : 'N', N, M, K, b, ldb, a, lda, bias, accumulate, c, c_bf16,
             round_bf16, ldc, true, /*c_trans=*/true);
    return;
  }
  run_gemm(transa, transb, M, N, K, a, lda, b, ldb, bias, accumulate, c, c_bf16, round_bf16, ldc, true);
}

void amx_tile_gemm_bf16(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda,
                        const uint16_t* b, int64_t ldb, bool accumulate, void* c, bool c_bf16, int64_t ldc) {
  run_gemm(transa, transb, M, N, K, a, lda, b, ldb, nullptr, accumulate, c, c_bf16, false, ldc, false);
}

}  // namespace tandem::kernels
