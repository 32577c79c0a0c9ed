// Fused CPU kernels for the engine's 16-bit decode path (built on first use by engine/fused.py).
//
// Why: at batch 1 a SmolLM2 layer's four matmuls take ~120 us, while the ~25 small ATen ops
// around them (RMSNorm alone is 6 ops, rotary 7, the paged K/V gather and SDPA 8) took
// ~165 us, mostly per-op dispatch. Each function here replaces one such group by one call:
//   add_rms_norm        h += delta; x = rmsnorm(h) * w               (both norms of a layer)
//   rotary_kv_write     rotate q and k in place, write k and v to their cache slots
//   paged_decode_attention  one query row against its paged K/V up to its length, no gather (decodes,
//                       and a short prefill chunk's rows with its table repeated)
//   silu_mul            silu(gate) * up (exp eight floats at a time: exp8)
//   int8_linear         x @ (int8 w * scale).T, x quantized per block of 32: the int8 linears (AVX2 + FMA, VNNI)
//   dequantize_rows_into  out = int8 w * scale[:, None], into a buffer kept between calls: a prefill's dense
//                       product (ATen's to() and mul were two passes into fresh memory, ~20% of a 500-token prefill)
// Arithmetic is in fp32 with one rounding to the model dtype per output, as transformers does
// for RMSNorm; the fp32 engine keeps the ATen ops (its tokens must equal transformers').

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define PARLEY_AVX2 1
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

#ifdef PARLEY_AVX2
// exp of eight floats (Cephes' expf: 2^n times a degree-6 polynomial of the remainder, within 2 ulp of std::exp).
// std::exp was most of silu_mul's time and of a decode's softmax (a scalar call per element). A NaN stays NaN
// (min/max return their second operand on NaN); below -87.3 the result is the smallest normal float, not 0, and
// above 88.37 it is inf: both far outside what a softmax (inputs <= 0) or silu rounded to 16 bits can tell apart.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(_mm256_set1_ps(-87.3365447505531f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// n values of T as floats: eight at a time for bf16 (a shift) and fp16 (F16C) where AVX2 is built.
template <typename T>
inline void to_floats(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef PARLEY_AVX2
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 8 <= n; i += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
  }
#ifdef __F16C__
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
#endif
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}

// out[i] = exp(x[i]) for n floats (in place allowed): eight at a time where AVX2 is built, std::exp elsewhere.
inline void exp_floats(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#ifdef PARLEY_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp8(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) out[i] = std::exp(x[i]);
}

template <typename T>
void add_rms_norm_kernel(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t cols, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(cols);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * cols;
      float ss = 0.f;
      if (delta != nullptr) {
        const T* dr = delta + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          T s = static_cast<T>(to_f(hr[c]) + to_f(dr[c]));  // the residual stream stays in T, like h + delta
          hr[c] = s;
          buf[c] = to_f(s);
        }
      } else {
        for (int64_t c = 0; c < cols; ++c) buf[c] = to_f(hr[c]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < cols; ++c) ss += buf[c] * buf[c];
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(cols) + eps);
      T* o = out + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        T normed = static_cast<T>(buf[c] * rstd);  // transformers: weight * hidden.to(input_dtype)
        o[c] = static_cast<T>(to_f(w[c]) * to_f(normed));
      }
    }
  });
}

template <typename T>
void rotary_kv_kernel(T* qkv, int64_t row_stride, const T* cos, const T* sin, int64_t table_stride,
                      const int64_t* positions, T* cache, const int64_t* slots, int64_t tokens, int64_t H,
                      int64_t KV, int64_t D, int64_t slots_per_head) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * row_stride;
      const T* c = cos + positions[t] * table_stride;
      const T* s = sin + positions[t] * table_stride;
      for (int64_t head = 0; head < H + KV; ++head) {
        T* x = row + head * D;
        for (int64_t i = 0; i < D; ++i) tmp[i] = to_f(x[i]);
        for (int64_t i = 0; i < half; ++i) {
          x[i] = static_cast<T>(tmp[i] * to_f(c[i]) - tmp[i + half] * to_f(s[i]));
          x[i + half] = static_cast<T>(tmp[i + half] * to_f(c[i + half]) + tmp[i] * to_f(s[i + half]));
        }
      }
      const int64_t slot = slots[t];
      for (int64_t kvh = 0; kvh < KV; ++kvh) {
        const T* k = row + (H + kvh) * D;
        const T* v = row + (H + KV + kvh) * D;
        T* kdst = cache + (kvh * slots_per_head + slot) * D;
        T* vdst = cache + ((KV + kvh) * slots_per_head + slot) * D;
        for (int64_t i = 0; i < D; ++i) {
          kdst[i] = k[i];
          vdst[i] = v[i];
        }
      }
    }
  });
}

#ifdef PARLEY_AVX2
// The dots of one query row with four key rows (k: four rows of D floats, D a multiple of 8): four accumulators
// and one horizontal reduction for the four, where a dot at a time paid a whole reduction each.
inline __m128 dots_with_four_keys(const float* q, const float* k, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + D + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * D + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * D + i), a3);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per 128-bit half: 4 sums
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// acc[0 .. 8 * DV) += sum over the count rows v[o] (contiguous, 8 * DV floats each) of p[o] * v[o], the
// accumulators kept in registers for the whole block.
template <int DV>
inline void weighted_rows(const float* p, const float* v, int64_t count, float* acc) {
  __m256 a[DV];
  for (int j = 0; j < DV; ++j) a[j] = _mm256_loadu_ps(acc + 8 * j);
  for (int64_t o = 0; o < count; ++o) {
    const __m256 w = _mm256_set1_ps(p[o]);
    for (int j = 0; j < DV; ++j) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + o * 8 * DV + 8 * j), a[j]);
  }
  for (int j = 0; j < DV; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}
#endif

// Each query row b attends to the first ctx_lens[b] positions of its block table: a decode's one token, or a row
// of a prefill chunk with its table repeated and its own position + 1 as the length (causal, no mask needed).
template <typename T>
void paged_decode_kernel(const T* q, int64_t q_row_stride, const T* cache, const int64_t* tables, int64_t max_blocks,
                         const int64_t* ctx_lens, T* out, int64_t B, int64_t H, int64_t KV, int64_t D,
                         int64_t block_size, int64_t slots_per_head, float scale) {
  const int64_t G = H / KV;
  // one task per (row, kv head): its K/V rows are read once for the G query heads sharing them
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), kf(4 * D), vf(block_size * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, kvh = task % KV;
      const int64_t L = ctx_lens[b];
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < D; ++i) qf[g * D + i] = to_f(q[b * q_row_stride + (kvh * G + g) * D + i]) * scale;
      const int64_t* table = tables + b * max_blocks;
      const T* kbase = cache + kvh * slots_per_head * D;
      const T* vbase = cache + (KV + kvh) * slots_per_head * D;
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {  // a block at a time: its rows are contiguous
        const int64_t count = std::min(block_size, L - t0);
        const T* kblock = kbase + table[t0 / block_size] * block_size * D;
        int64_t o = 0;
#ifdef PARLEY_AVX2
        if (D % 8 == 0) {
          for (; o + 4 <= count; o += 4) {
            to_floats(kblock + o * D, kf.data(), 4 * D);
            for (int64_t g = 0; g < G; ++g)
              _mm_storeu_ps(scores.data() + g * L + t0 + o, dots_with_four_keys(qf.data() + g * D, kf.data(), D));
          }
        }
#endif
        for (; o < count; ++o) {
          to_floats(kblock + o * D, kf.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            float dot = 0.f;
            const float* qg = qf.data() + g * D;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < D; ++i) dot += qg[i] * kf[i];
            scores[g * L + t0 + o] = dot;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * L;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < L; ++t) mx = std::max(mx, sc[t]);
        for (int64_t t = 0; t < L; ++t) sc[t] -= mx;
        exp_floats(sc, sc, L);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) sum += sc[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const int64_t count = std::min(block_size, L - t0);
        to_floats(vbase + table[t0 / block_size] * block_size * D, vf.data(), count * D);
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc.data() + g * D;
          const float* p = scores.data() + g * L + t0;
#ifdef PARLEY_AVX2
          if (D == 64) {
            weighted_rows<8>(p, vf.data(), count, a);
            continue;
          }
          if (D == 128) {
            weighted_rows<16>(p, vf.data(), count, a);
            continue;
          }
#endif
          for (int64_t o = 0; o < count; ++o) {
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) a[i] += p[o] * vf[o * D + i];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < D; ++i) out[(b * H + kvh * G + g) * D + i] = static_cast<T>(acc[g * D + i]);
    }
  });
}

template <typename T>
void silu_mul_kernel(const T* gu, T* out, int64_t rows, int64_t inter) {
  constexpr int64_t kChunk = 256;  // floats of the gate converted, exponentiated, then used: one pass each, in L1
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float x[kChunk], e[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t c0 = 0; c0 < inter; c0 += kChunk) {
        const int64_t n = std::min(kChunk, inter - c0);
        for (int64_t i = 0; i < n; ++i) e[i] = -(x[i] = to_f(g[c0 + i]));
        exp_floats(e, e, n);
        for (int64_t i = 0; i < n; ++i) {
          const T act = static_cast<T>(x[i] / (1.f + e[i]));  // silu rounds to T before the product, as in eager
          o[c0 + i] = static_cast<T>(to_f(act) * to_f(u[c0 + i]));
        }
      }
    }
  });
}

template <typename T>
void dequantize_rows_kernel(const int8_t* w, const float* scale, T* out, int64_t N, int64_t K) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* src = w + n * K;
      T* dst = out + n * K;
      const float s = scale[n];
      for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<T>(static_cast<float>(src[k]) * s);
    }
  });
}

#ifdef PARLEY_AVX2
constexpr int64_t kQBlock = 32;  // activations are quantized per block of 32 inputs, as llama.cpp's Q8_0
constexpr int64_t kTileRows = 8;  // from this many rows of x, tiles of 2 weight rows (tile_dot)

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define PARLEY_VNNI 1
// acc + eight int32 sums of four products u * s, u unsigned and s signed bytes: one vpdpbusd.
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

// MR rows of quantized x against NR int8 weight rows (a tile): each block of x is loaded and its scale broadcast
// once for the NR weight rows, each weight block once for the MR rows. out is [MR][NR]. Each block's dot is an
// exact int32, then scaled by the block's scale (one fp32 fma).
// - With VNNI: the weights as unsigned bytes (w + 128, an xor), one vpdpbusd for 32 products: each block's dot
//   is then sum w x + 128 sum x, and the rows' 128 sum_b d_b sum x_b (xsum, one number per row of x) is taken off
//   the total. Where the offset was the vpdpbusd's accumulator instead (exact integers), its load for every dot
//   made the tiles ~15% slower than the sign instruction; in fp32 the two totals differ by ~1e-6 of the offset.
// - Without: |w| times x carrying w's sign (vpsignb), vpmaddubsw (whose int16 sums of two cannot saturate here:
//   2 * 128 * 127 < 32767) then vpmaddwd. vpdpbusd cannot take that pair.
template <int MR, int NR>
inline void tile_dot(const int8_t* wr, int64_t w_stride, const int8_t* qx, const float* dx, const float* xsum,
                     int64_t K, int64_t B, float* out) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
#ifdef PARLEY_VNNI
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < B; ++b) {
    __m256i uw[NR];
    for (int j = 0; j < NR; ++j)
      uw[j] = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + j * w_stride + b * kQBlock)), flip);
    for (int i = 0; i < MR; ++i) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + i * K + b * kQBlock));
      const __m256 d = _mm256_set1_ps(dx[i * B + b]);
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dpbusd(_mm256_setzero_si256(), uw[j], qv)), acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * NR + j] = hsum8(acc[i][j]) - xsum[i];
#else
  (void)xsum;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < B; ++b) {
    __m256i qw[NR], abs_w[NR];
    for (int j = 0; j < NR; ++j) {
      qw[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + j * w_stride + b * kQBlock));
      abs_w[j] = _mm256_sign_epi8(qw[j], qw[j]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + i * K + b * kQBlock));
      const __m256 d = _mm256_set1_ps(dx[i * B + b]);
      for (int j = 0; j < NR; ++j) {
        const __m256i dots = _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w[j], _mm256_sign_epi8(qv, qw[j])), ones);
        acc[i][j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dots), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * NR + j] = hsum8(acc[i][j]);
#endif
}

// x quantized per block of 32: int8 values, a scale per block, and (for VNNI) each row's 128 sum_b d_b sum x_b.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> xsum;
};

// y = the product, NR weight rows at a time (parallel over those groups), against x in blocks of up to 4 rows.
template <int NR, typename T>
void tiled_product(const int8_t* w, const T* scale, T* y, const QuantizedRows& x, int64_t M, int64_t N, int64_t K,
                   int64_t B, int64_t grain) {
  at::parallel_for(0, N / NR, grain, [&](int64_t begin, int64_t end) {
    float out[4 * NR];
    for (int64_t group = begin; group < end; ++group) {
      const int64_t n = NR * group;
      const int8_t* wr = w + n * K;
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t rows = std::min<int64_t>(4, M - m);
        const int8_t* q = x.q.data() + m * K;
        const float* d = x.d.data() + m * B;
        const float* xsum = x.xsum.data() + m;
        switch (rows) {
          case 4: tile_dot<4, NR>(wr, K, q, d, xsum, K, B, out); break;
          case 3: tile_dot<3, NR>(wr, K, q, d, xsum, K, B, out); break;
          case 2: tile_dot<2, NR>(wr, K, q, d, xsum, K, B, out); break;
          default: tile_dot<1, NR>(wr, K, q, d, xsum, K, B, out);
        }
        for (int j = 0; j < NR; ++j) {
          const float s = to_f(scale[n + j]);
          for (int64_t i = 0; i < rows; ++i) y[(m + i) * N + n + j] = static_cast<T>(out[i * NR + j] * s);
        }
      }
    }
  });
}

// y[m, n] = scale[n] * sum_b d[m, b] * (qx[m, block b] . w[n, block b]): int8 x int8 dots, 32 per
// instruction (VNNI) or three, one fp32 fma per block. Each weight row is read from memory once for all M
// rows; decode is bound by that read.
template <typename T>
void int8_linear_kernel(const T* x, const int8_t* w, const T* scale, T* y, int64_t M, int64_t N, int64_t K) {
  const int64_t B = K / kQBlock;
  QuantizedRows xq{std::vector<int8_t>(M * K), std::vector<float>(M * B), std::vector<float>(M, 0.f)};
  int8_t* qx = xq.q.data();
  float* dx = xq.d.data();
  for (int64_t m = 0; m < M; ++m) {
    [[maybe_unused]] double row_sum = 0.0;  // sum_b d_b sum x_b (VNNI)
    for (int64_t b = 0; b < B; ++b) {
      const T* src = x + m * K + b * kQBlock;
      int8_t* dst = qx + m * K + b * kQBlock;
      float amax = 0.f;
      bool finite = true;
      for (int64_t i = 0; i < kQBlock; ++i) {
        const float v = to_f(src[i]);
        finite = finite && std::isfinite(v);
        amax = std::max(amax, std::fabs(v));
      }
      if (!finite) {  // a NaN or inf stays one in every output it reaches, as in a float product
        dx[m * B + b] = std::numeric_limits<float>::quiet_NaN();
        std::fill(dst, dst + kQBlock, 0);
        continue;
      }
      // below the smallest normal float the block is zero for every purpose (and 127 / amax overflows)
      const bool zero = amax < std::numeric_limits<float>::min();
      const float inv = zero ? 0.f : 127.f / amax;
      dx[m * B + b] = zero ? 0.f : amax / 127.f;
      for (int64_t i = 0; i < kQBlock; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(to_f(src[i]) * inv));
#ifdef PARLEY_VNNI
      int32_t sum = 0;
      for (int64_t i = 0; i < kQBlock; ++i) sum += dst[i];
      row_sum += static_cast<double>(dx[m * B + b]) * sum;
#endif
    }
#ifdef PARLEY_VNNI
    xq.xsum[m] = static_cast<float>(128.0 * row_sum);
#endif
  }
  if (M >= kTileRows && N % 2 == 0) {
    tiled_product<2>(w, scale, y, xq, M, N, K, B, 8);  // a prefill: 4 rows of x by 2 of w
  } else {
    tiled_product<1>(w, scale, y, xq, M, N, K, B, 16);  // each weight row read once for all M
  }
}
#endif

// The index of each row's first maximum, as torch.argmax (a NaN counts as the maximum: its first index). ATen's
// argmax over the default brain's 151,936 logits took ~550 us in bf16 and ~130 in float32 (a value at a time), 3 %
// of a decode step; this is two vector passes, the max then its first index.
template <typename T>
inline float logit_at(const T* row, int64_t i) {
  return static_cast<float>(row[i]);
}

#ifdef PARLEY_AVX2
inline __m256 load8_f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
#ifdef PARLEY_AVX2
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    __m256 vmax = _mm256_set1_ps(best);
    __m256 nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = load8_f(row + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(vmax, v);
    }
    if (_mm256_movemask_ps(nan)) {
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(logit_at(row, j))) return j;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float lane : lanes) best = std::max(best, lane);
  }
#endif
  for (int64_t j = i; j < n; ++j) {  // the vector pass, where it ran, had no NaN: one here is the first
    const float v = logit_at(row, j);
    if (std::isnan(v)) return j;
    best = std::max(best, v);
  }
  int64_t j = 0;
#ifdef PARLEY_AVX2
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    const __m256 target = _mm256_set1_ps(best);
    for (; j + 8 <= n; j += 8) {
      const int mask = _mm256_movemask_ps(_mm256_cmp_ps(load8_f(row + j), target, _CMP_EQ_OQ));
      if (mask) return j + __builtin_ctz(mask);
    }
  }
#endif
  for (; j < n; ++j)
    if (logit_at(row, j) == best) return j;
  return 0;  // a row of -inf only
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

std::vector<at::Tensor> add_rms_norm(at::Tensor h, c10::optional<at::Tensor> delta, at::Tensor w, double eps) {
  check_cpu_contiguous(h, "h");
  check_cpu_contiguous(w, "w");
  TORCH_CHECK(h.dim() == 2 && w.dim() == 1 && w.size(0) == h.size(1), "h must be [T, C] and w [C]");
  at::Tensor d;
  if (delta.has_value()) {
    d = delta.value().contiguous();
    TORCH_CHECK(d.sizes() == h.sizes() && d.scalar_type() == h.scalar_type(), "delta must match h");
  }
  auto out = at::empty_like(h);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(h.data_ptr<scalar_t>(), d.defined() ? d.data_ptr<scalar_t>() : nullptr,
                                  w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), h.size(0), h.size(1),
                                  static_cast<float>(eps));
  });
  return {h, out};
}

void rotary_kv_write(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor positions, at::Tensor cache,
                     at::Tensor slots, int64_t H, int64_t KV, int64_t D) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(cos, "cos");
  check_cpu_contiguous(sin, "sin");
  check_cpu_contiguous(cache, "cache");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * KV) * D, "qkv must be [T, (H + 2 KV) D]");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.size(1) == KV && cache.size(4) == D,
              "cache must be [2, KV, blocks, block_size, D]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && cache.scalar_type() == qkv.scalar_type(), "dtype mismatch");
  auto pos = positions.to(at::kLong).contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == qkv.size(0) && sl.numel() == qkv.size(0), "one position and slot per token");
  const int64_t slot_limit = cache.size(2) * cache.size(3);
  for (int64_t t = 0; t < pos.numel(); ++t) {
    TORCH_CHECK(pos.data_ptr<int64_t>()[t] >= 0 && pos.data_ptr<int64_t>()[t] < cos.size(0), "position out of the rope table");
    TORCH_CHECK(sl.data_ptr<int64_t>()[t] >= 0 && sl.data_ptr<int64_t>()[t] < slot_limit, "slot out of the KV cache");
  }
  const int64_t slots_per_head = cache.size(2) * cache.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_kv_write", [&] {
    rotary_kv_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.size(1), cos.data_ptr<scalar_t>(),
                               sin.data_ptr<scalar_t>(), cos.size(1), pos.data_ptr<int64_t>(),
                               cache.data_ptr<scalar_t>(), sl.data_ptr<int64_t>(), qkv.size(0), H, KV, D,
                               slots_per_head);
  });
}

at::Tensor paged_decode_attention(at::Tensor qkv, at::Tensor cache, at::Tensor block_tables, at::Tensor ctx_lens,
                                  int64_t H, int64_t D, double scale) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(cache, "cache");
  const int64_t KV = cache.size(1);
  TORCH_CHECK(H % KV == 0, "query heads must be a multiple of KV heads");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = ctx_lens.to(at::kLong).contiguous();
  const int64_t B = tables.size(0);
  TORCH_CHECK(qkv.size(0) >= B && lens.numel() == B, "one query row and length per request");
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= tables.size(1) * cache.size(3), "context length out of its block table");
    for (int64_t j = 0; j * cache.size(3) < len_ptr[b]; ++j) {
      const int64_t block = table_ptr[b * tables.size(1) + j];
      TORCH_CHECK(block >= 0 && block < cache.size(2), "block id out of the KV cache");
    }
  }
  auto out = at::empty({B, H, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "paged_decode_attention", [&] {
    paged_decode_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.size(1), cache.data_ptr<scalar_t>(),
                                  tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                                  out.data_ptr<scalar_t>(), B, H, KV, D, cache.size(3),
                                  cache.size(2) * cache.size(3), static_cast<float>(scale));
  });
  return out;
}

at::Tensor silu_mul(at::Tensor gate_up) {
  check_cpu_contiguous(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2 I]");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), inter);
  });
  return out;
}

void dequantize_rows_into(at::Tensor w, at::Tensor scale, at::Tensor out) {
  check_cpu_contiguous(w, "w");
  check_cpu_contiguous(scale, "scale");
  check_cpu_contiguous(out, "out");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "w must be int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "scale must be float32 [N]");
  TORCH_CHECK(out.sizes() == w.sizes(), "out must be [N, K]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_rows_into", [&] {
    dequantize_rows_kernel<scalar_t>(w.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr<scalar_t>(),
                                     w.size(0), w.size(1));
  });
}

bool has_int8_linear() {
#ifdef PARLEY_AVX2
  return true;
#else
  return false;
#endif
}

at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor scale) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(w, "w");
  check_cpu_contiguous(scale, "scale");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x must be [M, K] and w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && scale.scalar_type() == x.scalar_type() && scale.numel() == w.size(0),
              "w must be int8 and scale [N] in x's dtype");
#ifdef PARLEY_AVX2
  TORCH_CHECK(x.size(1) % kQBlock == 0, "in_features must be a multiple of 32");
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    int8_linear_kernel<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<int8_t>(), scale.data_ptr<scalar_t>(),
                                 y.data_ptr<scalar_t>(), x.size(0), w.size(0), x.size(1));
  });
  return y;
#else
  TORCH_CHECK(false, "int8_linear needs AVX2 and FMA (see has_int8_linear)");
  return {};
#endif
}

at::Tensor argmax_rows(at::Tensor logits) {
  check_cpu_contiguous(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab]");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  const int64_t n = logits.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) index[r] = row_argmax(data + r * n, n);
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL, as torch's own ops: the engine steps on its own thread beside the server's Python threads
  // (the event loop among them), and a kernel's parallel region can wait on a core another process holds
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def("add_rms_norm", &add_rms_norm, "h += delta (optional); returns (h, rmsnorm(h) * w)", release_gil());
  m.def("rotary_kv_write", &rotary_kv_write, "rotary on q and k in place; k, v written to their cache slots",
        release_gil());
  m.def("paged_decode_attention", &paged_decode_attention, "one query token per request against its paged K/V",
        release_gil());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up row", release_gil());
  m.def("dequantize_rows_into", &dequantize_rows_into, "out = w * scale[:, None] for int8 w [N, K]", release_gil());
  m.def("argmax_rows", &argmax_rows, "each row's first maximum, as torch.argmax(logits, -1)", release_gil());
  m.def("has_int8_linear", &has_int8_linear, "int8_linear was built (the CPU has AVX2 and FMA)");
  m.def("int8_linear", &int8_linear, "x @ (w * scale[:, None]).T, int8 w, x quantized per block of 32",
        release_gil());
}
