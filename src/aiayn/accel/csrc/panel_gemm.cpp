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
// From 16 rows on, the threads take the panels a chunk at a time (the kernels below their rows
// or tasks), and each block of rows prefetches a share of the panels' next block.
// Built on the machine, with the compiled decoder step (aiayn.accel.compiled).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t NR = 16;        // output columns of a panel: two vectors of 8
constexpr int64_t MR = 6;         // input rows of a block
constexpr int64_t KC = 256;       // the block of K a panel is walked in
constexpr int64_t X_BYTES = 131072;      // the rows of x a block of rows holds at most
constexpr int64_t PANEL_BYTES = 262144;  // the panels a group holds at most
// From this many output columns x is copied into blocks of MR rows first, so that the
// kernel's broadcasts read memory in order; at fewer columns the copy costs what it saves
// (docs/performance.md).
constexpr int64_t PACK_X_COLUMNS = 2048;
// From this many rows the panels' products hand their work out in chunks (below), and
// prefetch the panels' next block: at fewer (one sentence's rows) both cost more than they
// save (docs/performance.md).
constexpr int64_t MANY_ROWS = 16;

// Work of n items handed out in chunks, one at a time: each thread takes the next chunk when
// done with one, not a share fixed beforehand, so that where one core runs slower for a
// while (a busy host's), the other does more of the work.
class Chunks {
 public:
  Chunks(int64_t n, int64_t size) : n_(n), size_(std::max<int64_t>(1, size)) {}
  int64_t count() const { return (n_ + size_ - 1) / size_; }
  // The calling thread's next chunk [begin, end); false when none is left.
  bool next(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(size_, std::memory_order_relaxed);
    if (begin >= n_) return false;
    end = std::min(n_, begin + size_);
    return true;
  }

 private:
  const int64_t n_, size_;
  std::atomic<int64_t> next_{0};
};

// per_thread(chunks) on each of the threads (one where called inside a parallel region).
template <class F>
void parallel_chunks(int64_t n, int64_t size, const F& per_thread) {
  Chunks chunks(n, size);
  at::parallel_for(0, chunks.count(), 1, [&](int64_t, int64_t) { per_thread(chunks); });
}

// Chunks of n items: eight a thread from `many` items on, else one a thread (the split of
// at::parallel_for).
int64_t chunk_size(int64_t n, bool many) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return many ? std::max<int64_t>(1, n / (threads * 8)) : (n + threads - 1) / threads;
}

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
  const bool many = M >= MANY_ROWS;
  // Over many rows chunks of at most a group; over few one share a thread (at::parallel_for's).
  const int64_t chunk = many ? std::min(group, chunk_size(P, true)) : chunk_size(P, false);
  parallel_chunks(P, chunk, [&](Chunks& chunks) {
    std::vector<float> tile, tile_bias;  // the last panel, where N is no multiple of 16
    for (int64_t p_begin, p_end; chunks.next(p_begin, p_end);) {
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
            const int64_t row_blocks = (m_end - m0 + MR - 1) / MR;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
              const int64_t kc = std::min(KC, K - k0);
              const float* Bp = B + (p * K + k0) * NR;
              const bool accumulate = k0 > 0, last = k0 + kc >= K;
              // The block of panels after this one (the next k block, else the next panel), a
              // share of it per block of rows: ready in L1 when its turn comes.
              const bool prefetch = many && (k0 + kc < K || p + 1 < P);
              const char* ahead = reinterpret_cast<const char*>(Bp + kc * NR);
              const int64_t lines = prefetch ? kc * NR * 4 / 64 : 0;
              const int64_t share = (lines + row_blocks - 1) / row_blocks;
              for (int64_t m = m0, r = 0; m < m_end; m += MR, ++r) {
                const int64_t rows = std::min(MR, m_end - m);
                for (int64_t l = r * share, l_end = std::min(lines, l + share); l < l_end; ++l)
                  _mm_prefetch(ahead + l * 64, _MM_HINT_T0);
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
    }
  });
  return y;
}

// exp of 8 floats: 2^n exp(r) with n = round(x log2 e) and r = x - n ln 2 (ln 2 in two
// parts), exp(r) by Cephes' degree-7 polynomial for expf (within 1-2 ulp of the true value).
// x is first clamped to [-87, 88]: below, the true value is under float's smallest normal
// number, and the callers only sum it with numbers of 1 or more; -inf gives 0.
inline __m256 exp8(__m256 x) {
  const __m256 none = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                    _CMP_EQ_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(none, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float hmax(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float best = lanes[0];
  for (int i = 1; i < 8; ++i) best = std::max(best, lanes[i]);
  return best;
}

inline float hsum(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
}

// The maximum of a row of V floats (-inf for none), and whether it holds a NaN (the maximum
// then means nothing): two vectors of 8 at a time, the rest one by one.
inline float row_max(const float* x, int64_t V, bool& has_nan) {
  const float lowest = -std::numeric_limits<float>::infinity();
  __m256 m0 = _mm256_set1_ps(lowest), m1 = m0, nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= V; j += 16) {
    const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
  }
  float top = hmax(_mm256_max_ps(m0, m1));
  has_nan = _mm256_movemask_ps(nan) != 0;
  for (; j < V; ++j) {
    has_nan = has_nan || std::isnan(x[j]);
    top = std::max(top, x[j]);
  }
  return top;
}

// log_softmax over each row of float32 logits (rows, V), in place: x - max - log(sum of
// exp(x - max)), the terms PyTorch's CPU kernel takes (its exp and sums round differently).
// A row holding NaN or +inf becomes NaN, as there; a row of -inf NaN too.
at::Tensor log_softmax_(at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "log_softmax_: float32 (rows, V) with contiguous rows");
  const int64_t rows = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  float* base = logits.data_ptr<float>();
  parallel_chunks(rows, chunk_size(rows, rows >= MANY_ROWS), [&](Chunks& chunks) {
    for (int64_t r0, r1; chunks.next(r0, r1);)
      for (int64_t r = r0; r < r1; ++r) {
        float* x = base + r * ld;
        bool has_nan = false;
        const float top = row_max(x, V, has_nan);
        if (has_nan || std::isinf(top)) {  // NaN throughout, as x - max gives it there
          std::fill(x, x + V, std::numeric_limits<float>::quiet_NaN());
          continue;
        }
        const __m256 vtop = _mm256_set1_ps(top);
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t j = 0;
        for (; j + 32 <= V; j += 32) {
          s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vtop)));
          s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), vtop)));
          s2 = _mm256_add_ps(s2, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 16), vtop)));
          s3 = _mm256_add_ps(s3, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 24), vtop)));
        }
        for (; j + 8 <= V; j += 8)
          s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vtop)));
        float sum = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        for (; j < V; ++j) sum += std::exp(x[j] - top);
        const float log_sum = std::log(sum);
        const __m256 vlog = _mm256_set1_ps(log_sum);
        j = 0;
        for (; j + 8 <= V; j += 8)
          _mm256_storeu_ps(x + j, _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vtop), vlog));
        for (; j < V; ++j) x[j] = x[j] - top - log_sum;
      }
  });
  return logits;
}

// softmax(q kᵀ · scale + mask) v for each (b, h) of q (B, H, T, Dk), k (B, H, S, Dk) and
// v (B, H, S, Dv), each of any strides with its last dimension contiguous; mask broadcast to
// (B, H, T, S), boolean (true: attend) or float32 (added). Out (B, H, T, Dv), a view of
// (B, T, H, Dv): the heads then merge by a view. A position masked out (false, or -inf
// added) weighs exactly 0, and neither its key nor its value enters the result; a query with
// nothing to attend, or a NaN score, gives NaN. k and v may also be (B, H, P, G, D): P × G
// keys, key p G + g at (p, g) (a beam cache kept positions first). One task per (b, h).
// Up to FEW_QUERIES queries (decoding's steps, aiayn.accel.compiled.OneQueryAttention): each
// over the keys it attends, read in place (attend_each). More (the encoder's short sentences,
// aiayn.accel.attention.PanelAttention): the keys copied transposed, the values and queries
// side by side (rows of a fused product lie a few KiB apart, on few sets of L1), then four
// queries at a time: their scores over sixteen keys in registers, their softmax, their
// weighted sums of sixteen columns of values in registers.
constexpr int QT = 4;  // queries a block

// Rows r[0..7] (8 floats each) written as the 8 columns c[0..7]: c[j][i] = r[i][j].
inline void transpose8(const __m256 r[8], __m256 c[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  c[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  c[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  c[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  c[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  c[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  c[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  c[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  c[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Four queries' weighted sums of sixteen columns of the values: acc[2 r + j] = sum over s of
// w[r ld_w + s] v[s ld_v + 8 j : + 8]; with `skip`, a position all four weigh 0 is not read.
inline void weighted4(const float* w, int64_t ld_w, const float* v, int64_t ld_v, int64_t S,
                      bool skip, __m256 acc[8]) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t s = 0; s < S; ++s) {
    const float w0 = w[s], w1 = w[ld_w + s], w2 = w[2 * ld_w + s], w3 = w[3 * ld_w + s];
    if (skip && w0 == 0.f && w1 == 0.f && w2 == 0.f && w3 == 0.f) continue;
    const __m256 v0 = _mm256_loadu_ps(v + s * ld_v), v1 = _mm256_loadu_ps(v + s * ld_v + 8);
    __m256 x = _mm256_set1_ps(w0);
    a0 = _mm256_fmadd_ps(x, v0, a0);
    a1 = _mm256_fmadd_ps(x, v1, a1);
    x = _mm256_set1_ps(w1);
    a2 = _mm256_fmadd_ps(x, v0, a2);
    a3 = _mm256_fmadd_ps(x, v1, a3);
    x = _mm256_set1_ps(w2);
    a4 = _mm256_fmadd_ps(x, v0, a4);
    a5 = _mm256_fmadd_ps(x, v1, a5);
    x = _mm256_set1_ps(w3);
    a6 = _mm256_fmadd_ps(x, v0, a6);
    a7 = _mm256_fmadd_ps(x, v1, a7);
  }
  acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
  acc[4] = a4, acc[5] = a5, acc[6] = a6, acc[7] = a7;
}

// out[r][0:8 W] = sum over d of q_r[d] kt[d][0:8 W], for the four query rows q0..q3 and W
// vectors of keys; out's rows ld apart.
template <int W>
inline void scores4(const float* q0, const float* q1, const float* q2, const float* q3,
                    const float* kt, int64_t ld_kt, int64_t Dk, float* out, int64_t ld) {
  __m256 a0[W], a1[W], a2[W], a3[W];
  for (int w = 0; w < W; ++w) a0[w] = a1[w] = a2[w] = a3[w] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dk; ++d) {
    const float* row = kt + d * ld_kt;
    const __m256 x0 = _mm256_broadcast_ss(q0 + d), x1 = _mm256_broadcast_ss(q1 + d);
    const __m256 x2 = _mm256_broadcast_ss(q2 + d), x3 = _mm256_broadcast_ss(q3 + d);
    for (int w = 0; w < W; ++w) {
      const __m256 k = _mm256_loadu_ps(row + 8 * w);
      a0[w] = _mm256_fmadd_ps(x0, k, a0[w]);
      a1[w] = _mm256_fmadd_ps(x1, k, a1[w]);
      a2[w] = _mm256_fmadd_ps(x2, k, a2[w]);
      a3[w] = _mm256_fmadd_ps(x3, k, a3[w]);
    }
  }
  for (int w = 0; w < W; ++w) {
    _mm256_storeu_ps(out + 8 * w, a0[w]);
    _mm256_storeu_ps(out + ld + 8 * w, a1[w]);
    _mm256_storeu_ps(out + 2 * ld + 8 * w, a2[w]);
    _mm256_storeu_ps(out + 3 * ld + 8 * w, a3[w]);
  }
}

// Up to this many queries a (b, h) attend one at a time, each over only the keys it may
// attend, with nothing copied: decoding's steps, one query a row, or a sentence's beams each
// over its own lineage (a fourth of the keys at beam 4). More, the keys are copied
// transposed once and shared by four queries at a time.
constexpr int64_t FEW_QUERIES = 8;

// Lane i the sum of the eight lanes of a[i].
inline __m256 sums8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// What attend reads and writes, for attend_each.
struct Heads {
  const float *Q, *K, *V;
  float* O;
  const bool* MB;   // the boolean mask (true: attend), or null
  const float* MF;  // the additive mask, or null
  int64_t ms[4], qs[3], ks[4], vs[4];  // ks, vs: (b, h, p, g) of key p G + g
  int64_t B, H, T, S, G, Dk, Dv;
  float scale;
};

// attend for few queries (FEW_QUERIES): for each query, the keys it attends listed, their
// scores eight keys at a time (each key's products in a vector of its own, the eight then
// summed across at once), the softmax, and the weighted sum of their values, sixty-four
// columns at a time in registers.
void attend_each(const Heads& a) {
  const float none = -std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t n = a.B * a.H;
  parallel_chunks(n, chunk_size(n, n >= MANY_ROWS), [&](Chunks& chunks) {
    std::vector<int64_t> keys(a.S + 8), kat(a.S + 8), vat(a.S + 8);  // key, its k and v
    std::vector<float> sc(a.S + 8);
    for (int64_t p0, p1; chunks.next(p0, p1);)
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / a.H, h = p % a.H;
        const float* kb = a.K + b * a.ks[0] + h * a.ks[1];
        const float* vb = a.V + b * a.vs[0] + h * a.vs[1];
        for (int64_t t = 0; t < a.T; ++t) {
          const float* q = a.Q + b * a.qs[0] + h * a.qs[1] + t * a.qs[2];
          const int64_t m0 = b * a.ms[0] + h * a.ms[1] + t * a.ms[2];
          float* o = a.O + ((b * a.T + t) * a.H + h) * a.Dv;
          int64_t count = 0;
          for (int64_t s = 0, pos = 0; pos < a.S / a.G; ++pos)
            for (int64_t g = 0; g < a.G; ++g, ++s)
              if (a.MB ? a.MB[m0 + s * a.ms[3]] : !a.MF || a.MF[m0 + s * a.ms[3]] != none) {
                keys[count] = s;
                kat[count] = pos * a.ks[2] + g * a.ks[3];
                vat[count++] = pos * a.vs[2] + g * a.vs[3];
              }
          // scores, eight keys at a time (the last group's missing keys repeat its last)
          const __m256 vscale = _mm256_set1_ps(a.scale);
          __m256 top = _mm256_set1_ps(none), bad = _mm256_setzero_ps();
          for (int64_t j0 = 0; j0 < count; j0 += 8) {
            const float* kr[8];
            for (int i = 0; i < 8; ++i)
              kr[i] = kb + kat[std::min<int64_t>(j0 + i, count - 1)];
            __m256 acc[8];
            for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
            int64_t d = 0;
            for (; d + 8 <= a.Dk; d += 8) {
              const __m256 qd = _mm256_loadu_ps(q + d);
              for (int i = 0; i < 8; ++i)
                acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kr[i] + d), qd, acc[i]);
            }
            __m256 x = sums8(acc);
            if (d < a.Dk) {
              alignas(32) float rest[8];
              for (int i = 0; i < 8; ++i) {
                float r = 0.f;
                for (int64_t e = d; e < a.Dk; ++e) r += q[e] * kr[i][e];
                rest[i] = r;
              }
              x = _mm256_add_ps(x, _mm256_load_ps(rest));
            }
            x = _mm256_mul_ps(x, vscale);
            _mm256_storeu_ps(sc.data() + j0, x);
            const int64_t valid = std::min<int64_t>(8, count - j0);
            if (a.MF)
              for (int64_t i = 0; i < valid; ++i) sc[j0 + i] += a.MF[m0 + keys[j0 + i] * a.ms[3]];
            for (int64_t i = valid; i < 8; ++i) sc[j0 + i] = none;
            x = _mm256_loadu_ps(sc.data() + j0);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, x);
          }
          const float best = hmax(top);
          if (count == 0 || _mm256_movemask_ps(bad) != 0 || best == none) {
            std::fill(o, o + a.Dv, nan);
            continue;
          }
          // softmax, unnormalised (the sum kept)
          const __m256 vtop = _mm256_set1_ps(best);
          __m256 sum = _mm256_setzero_ps();
          for (int64_t j0 = 0; j0 < count; j0 += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc.data() + j0), vtop));
            _mm256_storeu_ps(sc.data() + j0, e);
            sum = _mm256_add_ps(sum, e);
          }
          const __m256 inv = _mm256_set1_ps(1.f / hsum(sum));
          // the weighted sum of the values
          int64_t d0 = 0;
          for (; d0 + 64 <= a.Dv; d0 += 64) {
            __m256 acc[8];
            for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < count; ++j) {
              const __m256 w = _mm256_set1_ps(sc[j]);
              const float* vr = vb + vat[j] + d0;
              for (int i = 0; i < 8; ++i)
                acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * i), acc[i]);
            }
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + d0 + 8 * i, _mm256_mul_ps(acc[i], inv));
          }
          for (; d0 + 8 <= a.Dv; d0 += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < count; ++j)
              acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[j]),
                                    _mm256_loadu_ps(vb + vat[j] + d0), acc);
            _mm256_storeu_ps(o + d0, _mm256_mul_ps(acc, inv));
          }
          const float scalar_inv = _mm256_cvtss_f32(inv);
          for (; d0 < a.Dv; ++d0) {
            float acc = 0.f;
            for (int64_t j = 0; j < count; ++j) acc += sc[j] * vb[vat[j] + d0];
            o[d0] = acc * scalar_inv;
          }
        }
      }
  });
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k5, const at::Tensor& v5,
                  const std::optional<at::Tensor>& mask_opt, double scale) {
  TORCH_CHECK(q.dim() == 4 && k5.dim() == v5.dim() && (k5.dim() == 4 || k5.dim() == 5),
              "attend: 4-d q, and 4-d or 5-d k and v");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k5.scalar_type() == at::kFloat &&
                  v5.scalar_type() == at::kFloat,
              "attend: float32");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3);
  // 5-d keys and values (B, H, P, G, D): P × G keys, key p G + g at (p, g), read in place
  // by few queries (their flattening would be a copy: a beam cache kept positions first)
  const bool grouped = k5.dim() == 5 && T <= FEW_QUERIES;
  const auto k = k5.dim() == 5 && !grouped ? k5.flatten(2, 3) : k5;
  const auto v = v5.dim() == 5 && !grouped ? v5.flatten(2, 3) : v5;
  const int64_t G = grouped ? k.size(3) : 1, S = k.size(2) * G, Dk_at = k.dim() - 1;
  const int64_t Dv = v.size(v.dim() - 1);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(Dk_at) == Dk && v.size(0) == B &&
                  v.size(1) == H && v.size(2) == k.size(2) && (!grouped || v.size(3) == G),
              "attend: shapes");
  const auto qc = q.stride(3) == 1 ? q : q.contiguous();
  const auto kc = k.stride(Dk_at) == 1 ? k : k.contiguous();
  const auto vc = v.stride(Dk_at) == 1 ? v : v.contiguous();
  auto out = at::empty({B, T, H, Dv}, q.options());
  at::Tensor mask;
  bool boolean = false;
  if (mask_opt.has_value() && mask_opt->defined()) {
    boolean = mask_opt->scalar_type() == at::kBool;
    TORCH_CHECK(boolean || mask_opt->scalar_type() == at::kFloat,
                "attend: a boolean or float32 mask");
    mask = mask_opt->expand({B, H, T, S});
  }
  if (out.numel() == 0) return out.transpose(1, 2);
  const float* Q = qc.data_ptr<float>();
  const float* K = kc.data_ptr<float>();
  const float* Vp = vc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const bool* MB = mask.defined() && boolean ? mask.data_ptr<bool>() : nullptr;
  const float* MF = mask.defined() && !boolean ? mask.data_ptr<float>() : nullptr;
  int64_t ms[4] = {0, 0, 0, 0};
  if (mask.defined())
    for (int i = 0; i < 4; ++i) ms[i] = mask.stride(i);
  const int64_t qs0 = qc.stride(0), qs1 = qc.stride(1), qs2 = qc.stride(2);
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  if (T <= FEW_QUERIES) {
    const int64_t kg = grouped ? kc.stride(3) : 0, vg = grouped ? vc.stride(3) : 0;
    attend_each(Heads{Q, K, Vp, O, MB, MF, {ms[0], ms[1], ms[2], ms[3]}, {qs0, qs1, qs2},
                      {ks0, ks1, ks2, kg}, {vs0, vs1, vs2, vg}, B, H, T, S, G, Dk, Dv,
                      static_cast<float>(scale)});
    return out.transpose(1, 2);
  }
  const int64_t SP = (S + 7) / 8 * 8;  // keys padded to whole vectors
  const float fscale = static_cast<float>(scale);
  const float none = -std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  parallel_chunks(B * H, chunk_size(B * H, B * H >= MANY_ROWS), [&](Chunks& chunks) {
    std::vector<float> kt(Dk * SP), sc(QT * SP), vv(S * Dv), qq(T * Dk);
    for (int64_t p0, p1; chunks.next(p0, p1);)
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / H, h = p % H;
        const float* kb = K + b * ks0 + h * ks1;
        const float* vb = Vp + b * vs0 + h * vs1;
        float* ktp = kt.data();
        for (int64_t s = 0; s < S; ++s)
          std::copy(vb + s * vs2, vb + s * vs2 + Dv, vv.data() + s * Dv);
        const float* qb = Q + b * qs0 + h * qs1;
        for (int64_t t = 0; t < T; ++t)
          std::copy(qb + t * qs2, qb + t * qs2 + Dk, qq.data() + t * Dk);
        for (int64_t s0 = 0; s0 < SP; s0 += 8) {  // eight keys by eight dimensions at a time
          int64_t d0 = 0;
          for (; d0 + 8 <= Dk; d0 += 8) {
            __m256 r[8], c[8];
            for (int i = 0; i < 8; ++i)
              r[i] = s0 + i < S ? _mm256_loadu_ps(kb + (s0 + i) * ks2 + d0) : _mm256_setzero_ps();
            transpose8(r, c);
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(ktp + (d0 + j) * SP + s0, c[j]);
          }
          for (int64_t d = d0; d < Dk; ++d)
            for (int64_t s = s0; s < s0 + 8; ++s) ktp[d * SP + s] = s < S ? kb[s * ks2 + d] : 0.f;
        }
        for (int64_t i0 = 0; i0 < T; i0 += QT) {
          const int64_t rows = std::min<int64_t>(QT, T - i0);
          const float* qr[QT];
          for (int r = 0; r < QT; ++r)
            qr[r] = qq.data() + (i0 + std::min<int64_t>(r, rows - 1)) * Dk;
          // scores, sixteen (or eight) keys by four queries at a time
          int64_t s0 = 0;
          for (; s0 + 16 <= SP; s0 += 16)
            scores4<2>(qr[0], qr[1], qr[2], qr[3], ktp + s0, SP, Dk, sc.data() + s0, SP);
          if (s0 < SP) scores4<1>(qr[0], qr[1], qr[2], qr[3], ktp + s0, SP, Dk, sc.data() + s0, SP);
          // scale, mask, softmax (unnormalised: each row's sum kept)
          float inv[QT];
          bool empty[QT];
          const __m256 vscale = _mm256_set1_ps(fscale), vnone = _mm256_set1_ps(none);
          // the padding keys of the last vector
          const __m256 pad = _mm256_cmp_ps(
              _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f),
              _mm256_set1_ps(static_cast<float>(S - (SP - 8))), _CMP_GE_OQ);
          for (int r = 0; r < QT; ++r) {
            float* row = sc.data() + r * SP;
            if (mask.defined()) {
              const int64_t m0 =
                  b * ms[0] + h * ms[1] + (i0 + std::min<int64_t>(r, rows - 1)) * ms[2];
              for (int64_t s = 0; s < S; ++s) {
                if (MB && !MB[m0 + s * ms[3]]) {
                  row[s] = none;
                } else if (MF) {
                  const float add = MF[m0 + s * ms[3]];
                  row[s] = add == none ? none : row[s] * fscale + add;
                }
              }
            }
            __m256 top = vnone, bad = _mm256_setzero_ps();
            for (int64_t s = 0; s < SP; s += 8) {
              __m256 x = _mm256_loadu_ps(row + s);
              if (!MF) x = _mm256_mul_ps(x, vscale);  // (-inf stays -inf)
              if (s + 8 == SP) x = _mm256_blendv_ps(x, vnone, pad);
              bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
              top = _mm256_max_ps(top, x);
              _mm256_storeu_ps(row + s, x);
            }
            const float best = hmax(top);
            empty[r] = _mm256_movemask_ps(bad) != 0 || best == none;
            if (empty[r]) {
              std::fill(row, row + SP, 0.f);
              inv[r] = 0.f;
              continue;
            }
            const __m256 vtop = _mm256_set1_ps(best);
            __m256 sum = _mm256_setzero_ps();
            for (int64_t s = 0; s < SP; s += 8) {
              const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + s), vtop));
              _mm256_storeu_ps(row + s, e);
              sum = _mm256_add_ps(sum, e);
            }
            inv[r] = 1.f / hsum(sum);
          }
          // weighted sums of the values, sixteen columns by four queries at a time
          float* orow[QT];
          for (int r = 0; r < QT; ++r) orow[r] = O + ((b * T + i0 + r) * H + h) * Dv;
          int64_t d0 = 0;
          for (; d0 + 16 <= Dv; d0 += 16) {
            __m256 a[8];
            weighted4(sc.data(), SP, vv.data() + d0, Dv, S, mask.defined(), a);
            for (int r = 0; r < rows; ++r) {
              const __m256 vi = _mm256_set1_ps(inv[r]);
              _mm256_storeu_ps(orow[r] + d0, _mm256_mul_ps(a[2 * r], vi));
              _mm256_storeu_ps(orow[r] + d0 + 8, _mm256_mul_ps(a[2 * r + 1], vi));
            }
          }
          for (int r = 0; r < rows; ++r) {
            for (int64_t d = d0; d < Dv; ++d) {
              float acc = 0.f;
              for (int64_t s = 0; s < S; ++s) {
                const float w = sc[r * SP + s];
                if (w != 0.f) acc += w * vv[s * Dv + d];
              }
              orow[r][d] = acc * inv[r];
            }
            if (empty[r]) std::fill(orow[r], orow[r] + Dv, nan);
          }
        }
      }
  });
  return out.transpose(1, 2);
}

// The index of the first maximum of each row of float32 scores (rows, V), a NaN counting as
// the maximum (the first NaN): what scores.max(-1).indices gives. One pass finds the row's
// maximum (and whether it holds a NaN), a second the first place it occurs; a row of 8,000
// (32 KiB) is still in L1 for the second.
at::Tensor first_argmax(const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.size(1) > 0,
              "first_argmax: float32 (rows, V) with V > 0");
  const auto s = scores.stride(1) == 1 ? scores : scores.contiguous();
  const int64_t rows = s.size(0), V = s.size(1), ld = s.stride(0);
  auto out = at::empty({rows}, s.options().dtype(at::kLong));
  const float* base = s.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  parallel_chunks(rows, chunk_size(rows, rows >= MANY_ROWS), [&](Chunks& chunks) {
    for (int64_t r0, r1; chunks.next(r0, r1);)
      for (int64_t r = r0; r < r1; ++r) {
        const float* x = base + r * ld;
        bool has_nan = false;
        const float best = row_max(x, V, has_nan);
        int64_t found = 0;
        if (has_nan) {
          while (!std::isnan(x[found])) ++found;
        } else {
          const __m256 target = _mm256_set1_ps(best);
          int64_t k = 0;
          for (; k + 8 <= V; k += 8) {
            const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + k), target,
                                                              _CMP_EQ_OQ));
            if (mask != 0) break;
          }
          while (x[k] != best) ++k;
          found = k;
        }
        index[r] = found;
      }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(aiayn_panels, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor input, Tensor panels, int out_features, Tensor? bias, bool relu) -> Tensor");
  m.def("first_argmax(Tensor scores) -> Tensor");
  m.def("log_softmax_(Tensor(a!) logits) -> Tensor(a!)");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiayn_panels, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
  m.impl("first_argmax", &first_argmax);
  m.impl("log_softmax_", &log_softmax_);
  m.impl("attend", &attend);
}
