// Float32 products for decoding on x86 CPUs with AVX2 and FMA (aiayn.accel.panels).
//
// A weight (N, K) is packed once into panels of 16 output columns, each K rows of 16
// contiguous floats. A product y = x W^T + b walks the panels (split between the threads),
// and for each panel every block of 6 input rows: 12 accumulators of 8 floats held in
// registers, per k two loads of the panel and six broadcasts of x. K is taken in blocks of
// 256 (a panel's block, 16 KiB, stays in L1 while the row blocks pass over it), the rows in
// blocks whose x fits 128 KiB and the panels in groups whose block fits 256 KiB (L2). Over
// many columns x is first copied into blocks of 6 rows with a k's six values side by side,
// which the broadcasts then read in order.
// Built on the machine, with the compiled decoder step (aiayn.accel.compiled).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t NR = 16;        // output columns of a panel: two vectors of 8
constexpr int64_t MR = 6;         // input rows of a block
constexpr int64_t KC = 256;       // the block of K a panel is walked in
constexpr int64_t X_BYTES = 131072;      // the rows of x a block of rows holds at most
constexpr int64_t PANEL_BYTES = 262144;  // the panels a group holds at most
// From this many output columns x is copied into blocks of MR rows first: 7-15% more
// GFLOP/s at 64 rows × 2,048-37,000 columns; at 256-1,024 columns the copy costs what it
// saves (an AMD EPYC with AVX2, docs/performance.md).
constexpr int64_t PACK_X_COLUMNS = 2048;

// C[0:R, 0:16] (+)= A[0:R, 0:kc] B[0:kc, 0:16]; on the last block of K, + bias and ReLU.
// A's row i at k: A[i * lda + k], or with PACKED (x copied into blocks) A[k * MR + i].
template <int R, bool PACKED>
inline void block(const float* A, int64_t lda, const float* B, int64_t kc, float* C,
                  int64_t ldc, const float* bias, bool relu, bool accumulate, bool last) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if (accumulate) {
#define AIAYN_LOAD(i)                                 \
  if constexpr (R > i) {                              \
    c##i##0 = _mm256_loadu_ps(C + i * ldc);           \
    c##i##1 = _mm256_loadu_ps(C + i * ldc + 8);       \
  }
    AIAYN_LOAD(0) AIAYN_LOAD(1) AIAYN_LOAD(2) AIAYN_LOAD(3) AIAYN_LOAD(4) AIAYN_LOAD(5)
#undef AIAYN_LOAD
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * NR);
    const __m256 b1 = _mm256_loadu_ps(B + k * NR + 8);
    __m256 a;
#define AIAYN_ROW(i)                                                      \
  if constexpr (R > i) {                                                  \
    a = _mm256_broadcast_ss(PACKED ? A + k * MR + i : A + i * lda + k);   \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                            \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                            \
  }
    AIAYN_ROW(0) AIAYN_ROW(1) AIAYN_ROW(2) AIAYN_ROW(3) AIAYN_ROW(4) AIAYN_ROW(5)
#undef AIAYN_ROW
  }
  const __m256 zero = _mm256_setzero_ps();
  const __m256 bias0 = last && bias ? _mm256_loadu_ps(bias) : zero;
  const __m256 bias1 = last && bias ? _mm256_loadu_ps(bias + 8) : zero;
  const bool clamp = last && relu;
#define AIAYN_STORE(i)                                                        \
  if constexpr (R > i) {                                                      \
    __m256 y0 = _mm256_add_ps(c##i##0, bias0), y1 = _mm256_add_ps(c##i##1, bias1); \
    if (clamp) {                                                              \
      y0 = _mm256_max_ps(y0, zero);                                           \
      y1 = _mm256_max_ps(y1, zero);                                           \
    }                                                                         \
    _mm256_storeu_ps(C + i * ldc, y0);                                        \
    _mm256_storeu_ps(C + i * ldc + 8, y1);                                    \
  }
  AIAYN_STORE(0) AIAYN_STORE(1) AIAYN_STORE(2) AIAYN_STORE(3) AIAYN_STORE(4) AIAYN_STORE(5)
#undef AIAYN_STORE
}

using Block = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                       const float*, bool, bool, bool);
constexpr Block BLOCKS[2][MR + 1] = {
    {nullptr, block<1, false>, block<2, false>, block<3, false>, block<4, false>,
     block<5, false>, block<6, false>},
    {nullptr, block<1, true>, block<2, true>, block<3, true>, block<4, true>, block<5, true>,
     block<6, true>}};

// x (M, K) as blocks of MR rows, each K × MR (a k's values side by side; zeros past M).
at::Tensor pack_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), blocks = (M + MR - 1) / MR;
  auto packed = at::empty({blocks, K, MR}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* block_dst = dst + b * K * MR;
      const int64_t rows = std::min(MR, M - b * MR);
      for (int64_t i = 0; i < rows; ++i) {
        const float* row = src + (b * MR + i) * K;
        for (int64_t k = 0; k < K; ++k) block_dst[k * MR + i] = row[k];
      }
      for (int64_t i = rows; i < MR; ++i)
        for (int64_t k = 0; k < K; ++k) block_dst[k * MR + i] = 0.f;
    }
  });
  return packed;
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "panel pack: a float32 (out, in) weight");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  auto panels = at::zeros({P, K, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * NR + j] = src[(p * NR + j) * K + k];
  });
  return panels;
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& panels, int64_t out_features,
                  const std::optional<at::Tensor>& bias_opt, bool relu) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "panel linear: float32");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR && panels.is_contiguous(),
              "panel linear: panels made by pack()");
  const int64_t K = panels.size(1), P = panels.size(0), N = out_features;
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, "panel linear: input width ", K);
  TORCH_CHECK(N > (P - 1) * NR && N <= P * NR, "panel linear: out_features");
  const auto x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  auto y = at::empty(shape, x.options());
  if (M == 0) return y;
  std::optional<at::Tensor> bias;
  if (bias_opt.has_value() && bias_opt->defined()) {
    TORCH_CHECK(bias_opt->numel() == N && bias_opt->scalar_type() == at::kFloat,
                "panel linear: bias");
    bias = bias_opt->contiguous();
  }
  const bool packed_x = N >= PACK_X_COLUMNS;
  const auto xp = packed_x ? pack_rows(x) : x;
  const float* A = xp.data_ptr<float>();
  const auto& blocks = BLOCKS[packed_x ? 1 : 0];
  const float* B = panels.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  float* C = y.data_ptr<float>();
  const int64_t row_block = std::max<int64_t>(MR, X_BYTES / (K * 4) / MR * MR);
  const int64_t group = std::max<int64_t>(1, PANEL_BYTES / (K * NR * 4));
  at::parallel_for(0, P, 1, [&](int64_t p_begin, int64_t p_end) {
    std::vector<float> tile, tile_bias;  // the last panel, where N is no multiple of 16
    for (int64_t g = p_begin; g < p_end; g += group) {
      const int64_t g_end = std::min(p_end, g + group);
      for (int64_t m0 = 0; m0 < M; m0 += row_block) {
        const int64_t m_end = std::min(M, m0 + row_block);
        for (int64_t p = g; p < g_end; ++p) {
          const int64_t n = p * NR, width = std::min(NR, N - n);
          float* out = C + n;
          int64_t ldc = N;
          const float* pb = b ? b + n : nullptr;
          if (width < NR) {
            tile.assign((m_end - m0) * NR, 0.f);
            out = tile.data() - m0 * NR;
            ldc = NR;
            if (b) {
              tile_bias.assign(NR, 0.f);
              std::copy(b + n, b + N, tile_bias.begin());
              pb = tile_bias.data();
            }
          }
          for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = std::min(KC, K - k0);
            const float* Bp = B + (p * K + k0) * NR;
            const bool accumulate = k0 > 0, last = k0 + kc >= K;
            for (int64_t m = m0; m < m_end; m += MR) {
              const int64_t rows = std::min(MR, m_end - m);
              // (a block of packed rows starts where its first row would)
              blocks[rows](A + m * K + (packed_x ? k0 * MR : k0), K, Bp, kc, out + m * ldc,
                           ldc, pb, relu, accumulate, last);
            }
          }
          if (width < NR)
            for (int64_t i = m0; i < m_end; ++i)
              std::copy(out + i * NR, out + i * NR + width, C + i * N + n);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(aiayn_panels, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor input, Tensor panels, int out_features, Tensor? bias, bool relu) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiayn_panels, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
