// The decoder's attention and LSTM steps, each in one pass over its tensors.
//
// ``sat_model/model/kernels/native.py`` builds this file (torch.utils.cpp_extension) the first
// time it is needed and calls the training recurrence (``recurrence.py``) through ctypes on
// float32 CPU tensors. Dimensions as in docs/METHOD.md: B images, k rows per image (1 in the
// recurrences), A attention size, L
// locations, D annotation size, n LSTM size. Arrays are contiguous unless a stride is passed.
//
// projected (B, A, L) holds 2(W_a a_i + b), query (B*k, A) 2 W_h h, weight2 (A) 2 w_att, so
// that 2 w_att^T tanh(u) = 2 w_att^T (2σ(2u) - 1) is Σ_a weight2_a σ(projected + query) up to a
// constant that the softmax removes (docs/METHOD.md). Where PyTorch's eager path
// streams the (B*k, A, L) tensor through memory five to seven times per step (add, σ, product,
// sums, gradient), this reads it once per direction and never stores it.
//
// Compiled with -ffast-math, so that the loops below vectorise, and linked without it, so that
// loading the library does not switch the process to flush-to-zero.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// e^x in float32 for x in [-87, 88] (clamped there): x = n ln2 + r with |r| <= ln2 / 2, e^r by
// Cephes' degree-6 polynomial and 2^n built in the exponent bits; within 0.95 ulp of the exact
// value over that range in steps of 3e-4. Written so that the compiler vectorises it inside the
// ``omp simd`` loops below, where it beat glibc's vector expf (libmvec), which also leaves
// scalar calls in the loops' tails.
inline float fast_exp(float x) {
  x = std::fmin(std::fmax(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// σ(x) for any finite x (0 below -87, 1 above 88 up to rounding).
inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

// tanh(x) = 2 σ(2x) - 1, within 2e-7 of the exact value.
inline float fast_tanh(float x) { return 2.0f * sigmoid(2.0f * x) - 1.0f; }

// Σ_a weight2_a σ(p_image[a, :] + q_row[a]) into out (L): one row's scores.
void row_scores(const float* p_image, const float* q_row, const float* weight2, float* out,
                int64_t A, int64_t L) {
  for (int64_t l = 0; l < L; ++l) out[l] = 0.0f;
  for (int64_t a = 0; a < A; ++a) {
    const float q = q_row[a], w = weight2[a];
    const float* p = p_image + a * L;
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) out[l] += w * sigmoid(p[l] + q);
  }
}

// σ(p + q) = 1 / (1 + e^{-p} e^{-q}): with e^{-p} computed once per image, a step needs one
// exponential per (row, a) instead of one per (row, a, l). e^{-p} is taken of p clamped to
// ±kProjectedClamp, and a row takes this form only when every |q| <= kQueryBound: the product
// then stays within e^{±86} (finite: no inf in the fast-math loops), and the clamp changes
// nothing that float can tell: beyond +52, p + q >= 18 and σ rounds to 1 either way; below -52,
// σ(p + q) <= σ(-18) = 1.5e-8 either way (absolute error under 1.5e-8, against scores of order
// 1). Trained models have |p| up to ~200 and |q| mostly under 34.
constexpr float kProjectedClamp = 52.0f;
constexpr float kQueryBound = 34.0f;

bool within_bound(const float* q_row, int64_t A) {
  for (int64_t a = 0; a < A; ++a)
    if (!(std::fabs(q_row[a]) <= kQueryBound)) return false;
  return true;
}

// row_scores for the k rows of one image at once, from e_image = e^{-p_image} (A, L): the
// same scores without an exponential in the inner loop, each row of e_image read once for the
// k rows; for rows whose queries (k, A) are ``within_bound``. out: (k, L).
void rows_scores_exp(const float* e_image, const float* queries, const float* weight2,
                     float* out, int64_t k, int64_t A, int64_t L) {
  for (int64_t i = 0; i < k * L; ++i) out[i] = 0.0f;
  for (int64_t a = 0; a < A; ++a) {
    const float* e = e_image + a * L;
    const float w = weight2[a];
    for (int64_t j = 0; j < k; ++j) {
      const float eq = fast_exp(-queries[j * A + a]);
      float* o = out + j * L;
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) o[l] += w / (1.0f + e[l] * eq);
    }
  }
}

// σ(p + q) for the scores' loops: from p and q, or (``kExp``) from e = e^{-p} and qp = e^{-q}.
template <bool kExp>
inline float sigma_of(float p_or_e, float q_or_qp) {
  if constexpr (kExp) return 1.0f / (1.0f + p_or_e * q_or_qp);
  return sigmoid(p_or_e + q_or_qp);
}

// One row's share of the scores' backward for its ∂/∂scores g (L): with s = σ(p + q) and
// u = s (1 - s) g, adds (or, when ``write``, writes) weight2 u into gp_image (A, L), and writes
// grad_q (A) = weight2 Σ_l u and weight_row (A) = Σ_l s g. With ``kExp``, src_image holds
// e^{-p} (A, L) and the row's query is ``within_bound``.
template <bool kExp>
void row_scores_backward_from(const float* g, const float* src_image, const float* q_row,
                              const float* weight2, float* gp_image, float* grad_q,
                              float* weight_row, int64_t A, int64_t L, bool write) {
  for (int64_t a = 0; a < A; ++a) {
    const float* p = src_image + a * L;
    float* gp = gp_image + a * L;
    const float q = kExp ? fast_exp(-q_row[a]) : q_row[a], w = weight2[a];
    float sum_sg = 0.0f, sum_u = 0.0f;
    if (write) {
#pragma omp simd reduction(+ : sum_sg, sum_u)
      for (int64_t l = 0; l < L; ++l) {
        const float s = sigma_of<kExp>(p[l], q), sg = s * g[l], u = sg - sg * s;
        sum_sg += sg;
        sum_u += u;
        gp[l] = w * u;
      }
    } else {
#pragma omp simd reduction(+ : sum_sg, sum_u)
      for (int64_t l = 0; l < L; ++l) {
        const float s = sigma_of<kExp>(p[l], q), sg = s * g[l], u = sg - sg * s;
        sum_sg += sg;
        sum_u += u;
        gp[l] += w * u;
      }
    }
    grad_q[a] = w * sum_u;
    weight_row[a] = sum_sg;
  }
}

// row_scores_backward_from, from e^{-p} where the image has one (``exp_image`` not null) and
// the row's query is within the bound, else from p.
void row_scores_backward(const float* g, const float* p_image, const float* exp_image,
                         const float* q_row, const float* weight2, float* gp_image,
                         float* grad_q, float* weight_row, int64_t A, int64_t L, bool write) {
  if (exp_image != nullptr && within_bound(q_row, A))
    row_scores_backward_from<true>(g, exp_image, q_row, weight2, gp_image, grad_q, weight_row,
                                   A, L, write);
  else
    row_scores_backward_from<false>(g, p_image, q_row, weight2, gp_image, grad_q, weight_row, A,
                                    L, write);
}

}  // namespace

extern "C" {

// e^{-clamp(projected, ±kProjectedClamp)} into out (count values), as the scores' fast form
// reads it: once per image for all the steps of a training recurrence.
void sat_exp_of_projected(const float* projected, float* out, int64_t count, int64_t threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < count; ++i)
    out[i] = fast_exp(-std::fmin(std::fmax(projected[i], -kProjectedClamp), kProjectedClamp));
}

// scores (B*k, L) = Σ_a weight2_a σ(projected[b, a, :] + query[r, a]), b = r / k.
// With ``exp_projected`` (``exp_of_projected``'s, or null), the rows whose query is within the
// bound take rows_scores_exp.
void sat_scores_forward_from(const float* projected, const float* exp_projected,
                             const float* query, const float* weight2, float* scores, int64_t B,
                             int64_t k, int64_t A, int64_t L, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < B * k; ++r) {
    const int64_t image = (r / k) * A * L;
    if (exp_projected != nullptr && within_bound(query + r * A, A))
      rows_scores_exp(exp_projected + image, query + r * A, weight2, scores + r * L, 1, A, L);
    else
      row_scores(projected + image, query + r * A, weight2, scores + r * L, A, L);
  }
}

// From ∂/∂scores (B*k, L): with s = σ(projected + query), u = s (1 - s) ∂scores,
//   grad_projected (B, A, L) = weight2 Σ_{k rows} u    (written, or added to when accumulate),
//   grad_query (B*k, A)      = weight2 Σ_l u,
//   weight_rows (B*k, A)     = Σ_l s ∂scores           (the caller sums the rows: ∂/∂weight2).
// One image per thread at a time, so its k rows add into grad_projected without a race.
void sat_scores_backward_from(const float* grad, const float* projected,
                              const float* exp_projected, const float* query,
                              const float* weight2, float* grad_projected, float* grad_query,
                              float* weight_rows, int64_t B, int64_t k, int64_t A, int64_t L,
                              int64_t threads, int64_t accumulate) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = b * k + j;
      const float* exp_image = exp_projected == nullptr ? nullptr : exp_projected + b * A * L;
      row_scores_backward(grad + r * L, projected + b * A * L, exp_image, query + r * A, weight2,
                          grad_projected + b * A * L, grad_query + r * A, weight_rows + r * A, A,
                          L, j == 0 && !accumulate);
    }
}

// Soft attention's step (Eq. 4-5 and the expected context of Sec. 4.2): the scores of the k
// rows of each image, α = softmax over the L locations into ``alpha`` (B*k, L), and
// φ = Σ_l α_l a_l into ``context`` (B*k, D) with rows ``context_stride`` apart. The k rows
// of an image read its annotations (B, L, D) together, once. ``exp_projected`` (B, A, L), when
// not null, is ``exp_of_projected``'s e^{-projected}: the images whose queries are within the
// bound take rows_scores_exp.
void sat_attend_forward(const float* projected, const float* exp_projected, const float* query,
                        const float* weight2, const float* annotations, float* alpha,
                        float* context, int64_t context_stride, int64_t B, int64_t k, int64_t A,
                        int64_t L, int64_t D, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < B; ++b) {
    const bool exp_form = exp_projected != nullptr && within_bound(query + b * k * A, k * A);
    if (exp_form)
      rows_scores_exp(exp_projected + b * A * L, query + b * k * A, weight2, alpha + b * k * L, k,
                      A, L);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = b * k + j;
      float* al = alpha + r * L;
      if (!exp_form) row_scores(projected + b * A * L, query + r * A, weight2, al, A, L);
      float top = al[0];
      for (int64_t l = 1; l < L; ++l) top = al[l] > top ? al[l] : top;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t l = 0; l < L; ++l) {
        al[l] = fast_exp(al[l] - top);
        total += al[l];
      }
      const float scale = 1.0f / total;
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) al[l] *= scale;
      float* ctx = context + r * context_stride;
      for (int64_t d = 0; d < D; ++d) ctx[d] = 0.0f;
    }
    for (int64_t l = 0; l < L; ++l) {
      const float* a = annotations + (b * L + l) * D;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = b * k + j;
        const float weight = alpha[r * L + l];
        float* ctx = context + r * context_stride;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ctx[d] += weight * a[d];
      }
    }
  }
}

// sat_attend_forward backwards for one row per image (training), the annotations held fixed:
// from ∂/∂φ (B, D) and the loss's own ∂/∂α (B, L; null when none), ∂/∂α = ∂φ · a + ∂α, the
// softmax's backward to ∂/∂scores, then the scores' backward as in sat_scores_backward_from
// (grad_projected written or, with accumulate, added to; grad_query and weight_rows written).
void sat_attend_backward_from(const float* grad_context, const float* grad_alpha,
                              const float* alpha, const float* annotations,
                              const float* projected, const float* exp_projected,
                              const float* query, const float* weight2, float* grad_projected,
                              float* grad_query, float* weight_rows, int64_t B, int64_t A,
                              int64_t L, int64_t D, int64_t threads, int64_t accumulate) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> grad_scores(L);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      const float* gphi = grad_context + b * D;
      const float* al = alpha + b * L;
      float* gs = grad_scores.data();
      float weighted = 0.0f;  // Σ_l α_l ∂α_l
      for (int64_t l = 0; l < L; ++l) {
        const float* a = annotations + (b * L + l) * D;
        float dot = grad_alpha != nullptr ? grad_alpha[b * L + l] : 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += gphi[d] * a[d];
        gs[l] = dot;
        weighted += al[l] * dot;
      }
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) gs[l] = al[l] * (gs[l] - weighted);
      const float* exp_image = exp_projected == nullptr ? nullptr : exp_projected + b * A * L;
      row_scores_backward(gs, projected + b * A * L, exp_image, query + b * A, weight2,
                          grad_projected + b * A * L, grad_query + b * A, weight_rows + b * A, A,
                          L, !accumulate);
    }
  }
}

// Eq. 1-3 after the gates' product, step t of the training recurrence: ``gates`` (B, 4n) holds
// the pre-activations in nn.LSTMCell's order (i, f, g, o) and is activated in place (σ, σ,
// tanh, σ); c (B, n) = f c_prev + i g; h (B, n) = o tanh(c), written to ``hidden`` and, when
// ``next_input`` is given, also to its rows of stride ``next_stride`` (the next step's h_{t-1}).
void sat_lstm_forward(float* gates, const float* cell_prev, float* cell, float* hidden,
                      float* next_input, int64_t next_stride, int64_t B, int64_t n,
                      int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < B; ++b) {
    float* gi = gates + b * 4 * n;
    float *gf = gi + n, *gg = gi + 2 * n, *go = gi + 3 * n;
    const float* cp = cell_prev + b * n;
    float* c = cell + b * n;
    float* h = hidden + b * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const float i = sigmoid(gi[j]), f = sigmoid(gf[j]), g = fast_tanh(gg[j]);
      const float o = sigmoid(go[j]);
      gi[j] = i, gf[j] = f, gg[j] = g, go[j] = o;
      c[j] = f * cp[j] + i * g;
      h[j] = o * fast_tanh(c[j]);
    }
    if (next_input != nullptr) {
      float* dst = next_input + b * next_stride;
      for (int64_t j = 0; j < n; ++j) dst[j] = h[j];
    }
  }
}

// Eq. 1-3 backwards at step t: from ∂/∂h_t (``grad_hidden``, from the later steps, plus
// ``grad_output``, from the output layer) and ∂/∂c_t (``grad_cell``, updated in place to
// ∂/∂c_{t-1}), the gradient of the gates' pre-activations into ``grad_gates`` (B, 4n).
// ``gates`` are the activated ones that sat_lstm_forward left.
void sat_lstm_backward(const float* gates, const float* cell_prev, const float* cell,
                       const float* grad_hidden, const float* grad_output, float* grad_cell,
                       float* grad_gates, int64_t B, int64_t n, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < B; ++b) {
    const float* gi = gates + b * 4 * n;
    const float *gf = gi + n, *gg = gi + 2 * n, *go = gi + 3 * n;
    const float *cp = cell_prev + b * n, *c = cell + b * n;
    const float *dh_in = grad_hidden + b * n, *dh_out = grad_output + b * n;
    float* dc_io = grad_cell + b * n;
    float* di = grad_gates + b * 4 * n;
    float *df = di + n, *dg = di + 2 * n, *do_ = di + 3 * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const float i = gi[j], f = gf[j], g = gg[j], o = go[j];
      const float tanh_c = fast_tanh(c[j]);
      const float dh = dh_in[j] + dh_out[j];
      const float dc = dc_io[j] + dh * o * (1.0f - tanh_c * tanh_c);
      do_[j] = dh * tanh_c * o * (1.0f - o);
      di[j] = dc * g * i * (1.0f - i);
      df[j] = dc * cp[j] * f * (1.0f - f);
      dg[j] = dc * i * (1.0f - g * g);
      dc_io[j] = dc * f;
    }
  }
}

}  // extern "C"

// BLAS's sgemm (column-major, 32-bit sizes), as torch's own MKL exports it; native.py passes
// its address, so that this file needs no BLAS headers or link flags of its own.
typedef void (*sgemm_fn)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const float*, const int*, const float*, const int*,
                         const float*, float*, const int*);

namespace {

// Row-major C (M, N) = op(X) op(Y) + beta C, with the leading dimensions of the row-major
// arrays: column-major BLAS computes C^T = op(Y)^T op(X)^T on the same memory.
void gemm(sgemm_fn sgemm, bool trans_x, bool trans_y, int64_t M, int64_t N, int64_t K,
          const float* x, int64_t ldx, const float* y, int64_t ldy, float beta, float* c,
          int64_t ldc) {
  const char tx = trans_x ? 'T' : 'N', ty = trans_y ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int lx = static_cast<int>(ldx), ly = static_cast<int>(ldy), lc = static_cast<int>(ldc);
  const float one = 1.0f;
  sgemm(&ty, &tx, &m, &n, &k, &one, y, &ly, x, &lx, &beta, c, &lc);
}

// What one step of the training recurrence shares between soft and hard attention. Arrays as
// in recurrence._Sequence, each at step t; ``input`` (B, D + n) is [ẑ_t; h_{t-1}] per image.
struct Step {
  sgemm_fn sgemm;
  int64_t B, A, L, D, n, threads;
  int64_t row() const { return D + n; }

  // q_t = 2 W_h h_{t-1} into query (B, A).
  void query(const float* input, const float* hidden2, float* query) const {
    gemm(sgemm, false, true, B, A, n, input + D, row(), hidden2, n, 0.0f, query, A);
  }

  // β_t = σ(f_β(h_{t-1})) (1 without the gate) into betas (B), ẑ_t = β_t φ_t into input.
  void gate(const float* gate_weight, const float* gate_bias, const float* context, float* input,
            float* betas) const {
    for (int64_t b = 0; b < B; ++b) {
      const float* h = input + b * row() + D;
      float beta = 1.0f;
      if (gate_weight != nullptr) {
        float pre = gate_bias[0];
        for (int64_t j = 0; j < n; ++j) pre += h[j] * gate_weight[j];
        beta = 1.0f / (1.0f + std::exp(-pre));
      }
      betas[b] = beta;
      for (int64_t d = 0; d < D; ++d) input[b * row() + d] = beta * context[b * D + d];
    }
  }

  // Eq. 1-3: the gates (B, 4n) from the embedding's share and [ẑ_t; h_{t-1}], then c_t, h_t,
  // and h_t again into ``next`` (the next step's input row, null at the last step).
  void lstm(const float* input_gates, const float* weight, const float* input, float* gates,
            const float* cell_prev, float* cell, float* hidden, float* next) const {
    std::memcpy(gates, input_gates, sizeof(float) * B * 4 * n);
    gemm(sgemm, false, true, B, 4 * n, row(), input, row(), weight, row(), 1.0f, gates, 4 * n);
    sat_lstm_forward(gates, cell_prev, cell, hidden, next, row(), B, n, threads);
  }

  // Eq. 1-3 backwards, then the gate's: from ∂/∂h_t (grad_h, from the later steps, plus
  // d_hidden) and ∂/∂c_t (grad_c), ∂/∂ the gates into grad_gates, ∂/∂c_{t-1} into grad_c,
  // ∂/∂φ_t into dphi (B, D), f_β's pre-activation's gradient into gate_pre (B), and into
  // grad_h ∂/∂h_{t-1} through Eq. 1 and the gate (the attention's share is added after).
  void lstm_and_gate_backward(const float* gates, const float* cell_prev, const float* cell,
                              const float* d_hidden, const float* weight, const float* d_context,
                              const float* contexts, const float* betas, const float* d_betas,
                              const float* gate_weight, float* grad_h, float* grad_c,
                              float* grad_gates, float* gate_pre, float* dz, float* dphi) const {
    sat_lstm_backward(gates, cell_prev, cell, grad_h, d_hidden, grad_c, grad_gates, B, n,
                      threads);
    gemm(sgemm, false, false, B, row(), 4 * n, grad_gates, 4 * n, weight, row(), 0.0f, dz, row());
    for (int64_t b = 0; b < B; ++b) {
      const float* dz_row = dz + b * row();
      const float* dc = d_context + b * D;
      const float* phi = contexts + b * D;
      float* dp = dphi + b * D;
      float* dh = grad_h + b * n;
      for (int64_t d = 0; d < D; ++d) dp[d] = dz_row[d] + dc[d];  // ∂/∂ẑ_t
      for (int64_t j = 0; j < n; ++j) dh[j] = dz_row[D + j];      // Eq. 1's share of ∂/∂h_{t-1}
      if (gate_weight != nullptr) {
        const float beta = betas[b];
        float d_beta = d_betas[b];
        for (int64_t d = 0; d < D; ++d) d_beta += dp[d] * phi[d];
        const float pre = d_beta * beta * (1.0f - beta);
        gate_pre[b] = pre;
        for (int64_t j = 0; j < n; ++j) dh[j] += pre * gate_weight[j];
        for (int64_t d = 0; d < D; ++d) dp[d] *= beta;  // ∂/∂φ_t
      }
    }
  }

  // W_h's share of ∂/∂h_{t-1}: grad_h += ∂q_t 2 W_h.
  void query_backward(const float* grad_query, const float* hidden2, float* grad_h) const {
    gemm(sgemm, false, false, B, n, A, grad_query, A, hidden2, n, 1.0f, grad_h, n);
  }
};

// sat_exp_of_projected's values, once for a training recurrence's T steps.
std::vector<float> exp_of_projected(const float* projected, int64_t count, int64_t threads) {
  std::vector<float> out(count);
  sat_exp_of_projected(projected, out.data(), count, threads);
  return out;
}

}  // namespace

extern "C" {

// The teacher-forced soft recurrence of recurrence._Recurrence (Eq. 1-6 with β of Sec. 4.2.1), all
// T steps in one call: the per-step work is the kernels above and four small matrix products,
// so that Python's dispatch of ~20 small ops a step is not paid T times.
// The caller sets inputs[0, :, D:] = h_0 and cells[0] = c_0; ``gate_weight`` (n) and
// ``gate_bias`` (1) are null without the gate. Fills what recurrence._Sequence names: inputs (T, B,
// D + n) = [β φ; h_{t-1}], cells (T + 1, B, n), gates (T, B, 4n, activated), queries (T, B, A)
// = 2 W_h h_{t-1}, alphas (T, B, L), contexts (T, B, D) = φ, betas (T, B), hidden (T, B, n).
void sat_soft_recurrence_forward(sgemm_fn sgemm, const float* projected,
                                 const float* annotations, const float* input_gates,
                                 const float* hidden2, const float* weight2,
                                 const float* gate_weight, const float* gate_bias,
                                 const float* lstm, float* inputs, float* cells, float* gates,
                                 float* queries, float* alphas, float* contexts, float* betas,
                                 float* hidden, int64_t T, int64_t B, int64_t A, int64_t L,
                                 int64_t D, int64_t n, int64_t threads) {
  const Step step{sgemm, B, A, L, D, n, threads};
  const std::vector<float> exp_projected = exp_of_projected(projected, B * A * L, threads);
  for (int64_t t = 0; t < T; ++t) {
    float* input = inputs + t * B * step.row();
    float* query = queries + t * B * A;
    float* context = contexts + t * B * D;
    step.query(input, hidden2, query);
    sat_attend_forward(projected, exp_projected.data(), query, weight2, annotations,
                       alphas + t * B * L, context, D, B, 1, A, L, D, threads);
    step.gate(gate_weight, gate_bias, context, input, betas + t * B);
    float* next = t + 1 < T ? inputs + (t + 1) * B * step.row() + D : nullptr;
    step.lstm(input_gates + t * B * 4 * n, lstm, input, gates + t * B * 4 * n, cells + t * B * n,
              cells + (t + 1) * B * n, hidden + t * B * n, next);
  }
}

// sat_soft_recurrence_forward backwards through time, the annotations held fixed; the weight
// gradients, which read the inputs [ẑ_t; h_{t-1}], are one product over all steps each, left
// to torch. From the outputs' gradients d_hidden (T, B, n), d_context (T, B, D; the gated
// ẑ_t's), d_alpha (T, B, L) and d_betas (T, B): grad_h, grad_c (B, n; zeros in, ∂/∂h_0 and
// ∂/∂c_0 out), grad_gates (T, B, 4n), grad_queries (T, B, A), gate_pre (T, B; ∂/∂ f_β's
// pre-activation), weight_rows (T, B, A; their sum over T and B, times 2, is ∂/∂w_att) and
// grad_projected (B, A, L). dz (B, D + n) and dphi (B, D) are scratch.
void sat_soft_recurrence_backward(
    sgemm_fn sgemm, const float* projected, const float* annotations, const float* hidden2,
    const float* weight2, const float* gate_weight, const float* lstm, const float* cells,
    const float* gates, const float* queries, const float* alphas, const float* contexts,
    const float* betas, const float* d_hidden, const float* d_context,
    const float* d_alpha, const float* d_betas, float* grad_h, float* grad_c, float* grad_gates,
    float* grad_queries, float* gate_pre, float* weight_rows, float* grad_projected, float* dz,
    float* dphi, int64_t T, int64_t B, int64_t A, int64_t L, int64_t D, int64_t n,
    int64_t threads) {
  const Step step{sgemm, B, A, L, D, n, threads};
  const std::vector<float> exp_projected = exp_of_projected(projected, B * A * L, threads);
  for (int64_t t = T - 1; t >= 0; --t) {
    float* grad_query = grad_queries + t * B * A;
    step.lstm_and_gate_backward(gates + t * B * 4 * n, cells + t * B * n, cells + (t + 1) * B * n,
                                d_hidden + t * B * n, lstm, d_context + t * B * D,
                                contexts + t * B * D, betas + t * B, d_betas + t * B,
                                gate_weight, grad_h, grad_c, grad_gates + t * B * 4 * n,
                                gate_pre + t * B, dz, dphi);
    sat_attend_backward_from(dphi, d_alpha + t * B * L, alphas + t * B * L, annotations,
                             projected, exp_projected.data(), queries + t * B * A, weight2,
                             grad_projected, grad_query, weight_rows + t * B * A, B, A, L, D,
                             threads, t != T - 1);
    step.query_backward(grad_query, hidden2, grad_h);
  }
}

// Hard attention's training recurrence (Eq. 8-9 with the semi-sampling of Sec. 4.1, then the
// gate and Eq. 1-3), all T steps in one call, as decoder.HardAttention and
// ShowAttendTell.advance compute them.
// ``use_expected`` (B) marks the images whose context is the expected one (α's), the others
// take the annotation at s̃_t. With ``uniforms`` (T, B), s̃_t is drawn here by the inverse CDF of
// α_t as decoder.pick_location does (the cumulative sum in double, each partial rounded to
// float, the first location whose partial exceeds u times the total) and written to
// ``locations`` (T, B); without them ``locations`` holds the forced path. Also fills log_alphas
// (T, B, L), log_probs (T, B) = log α_{t,s̃_t} and entropy (T, B) = H[α_t]; the rest as in
// sat_soft_recurrence_forward.
void sat_hard_recurrence_forward(
    sgemm_fn sgemm, const float* projected, const float* annotations, const float* input_gates,
    const float* hidden2, const float* weight2, const float* gate_weight, const float* gate_bias,
    const float* lstm, const bool* use_expected, const float* uniforms, int64_t* locations,
    float* inputs, float* cells, float* gates, float* queries, float* alphas, float* contexts,
    float* betas, float* hidden, float* log_alphas, float* log_probs, float* entropy, int64_t T,
    int64_t B, int64_t A, int64_t L, int64_t D, int64_t n, int64_t threads) {
  const Step step{sgemm, B, A, L, D, n, threads};
  const std::vector<float> exp_projected = exp_of_projected(projected, B * A * L, threads);
  for (int64_t t = 0; t < T; ++t) {
    float* input = inputs + t * B * step.row();
    float* query = queries + t * B * A;
    float* context = contexts + t * B * D;
    float* alpha = alphas + t * B * L;
    float* log_alpha = log_alphas + t * B * L;
    step.query(input, hidden2, query);
    sat_scores_forward_from(projected, exp_projected.data(), query, weight2, log_alpha, B, 1, A, L,
                            threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; ++b) {
      float* la = log_alpha + b * L;
      float* al = alpha + b * L;
      float top = la[0];
      for (int64_t l = 1; l < L; ++l) top = la[l] > top ? la[l] : top;
      float total = 0.0f;
      for (int64_t l = 0; l < L; ++l) total += std::exp(la[l] - top);
      const float log_total = std::log(total);
      float h = 0.0f;
      for (int64_t l = 0; l < L; ++l) {
        la[l] = (la[l] - top) - log_total;  // torch.log_softmax's order of operations
        al[l] = std::exp(la[l]);
        h -= al[l] * la[l];
      }
      entropy[t * B + b] = h;
      int64_t& location = locations[t * B + b];
      if (uniforms != nullptr) {
        double partial = 0.0;
        for (int64_t l = 0; l < L; ++l) partial += al[l];
        const float threshold = uniforms[t * B + b] * static_cast<float>(partial);
        partial = 0.0;
        location = L - 1;
        for (int64_t l = 0; l < L; ++l) {
          partial += al[l];
          if (static_cast<float>(partial) > threshold) {
            location = l;
            break;
          }
        }
      }
      log_probs[t * B + b] = la[location];
      float* ctx = context + b * D;
      if (use_expected[b]) {
        for (int64_t d = 0; d < D; ++d) ctx[d] = 0.0f;
        for (int64_t l = 0; l < L; ++l) {
          const float* a = annotations + (b * L + l) * D;
          const float weight = al[l];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ctx[d] += weight * a[d];
        }
      } else {
        std::memcpy(ctx, annotations + (b * L + location) * D, sizeof(float) * D);
      }
    }
    step.gate(gate_weight, gate_bias, context, input, betas + t * B);
    float* next = t + 1 < T ? inputs + (t + 1) * B * step.row() + D : nullptr;
    step.lstm(input_gates + t * B * 4 * n, lstm, input, gates + t * B * 4 * n, cells + t * B * n,
              cells + (t + 1) * B * n, hidden + t * B * n, next);
  }
}

// sat_hard_recurrence_forward backwards through time, the annotations held fixed (so the
// sampled images' ∂/∂φ goes nowhere: Eq. 9 passes no gradient to α). Beside the soft backward's
// gradients it takes those of log α_{t,s̃_t} (d_log_probs) and of H[α_t] (d_entropy), both
// (T, B): ∂H/∂e = -α (log α + H) and ∂ log α_s̃ / ∂e = onehot(s̃) - α. ``grad_scores`` (B, L) is
// scratch.
void sat_hard_recurrence_backward(
    sgemm_fn sgemm, const float* projected, const float* annotations, const float* hidden2,
    const float* weight2, const float* gate_weight, const float* lstm, const bool* use_expected,
    const int64_t* locations, const float* cells, const float* gates,
    const float* queries, const float* alphas, const float* contexts, const float* betas,
    const float* log_alphas, const float* entropy, const float* d_hidden, const float* d_context,
    const float* d_alpha, const float* d_betas, const float* d_log_probs, const float* d_entropy,
    float* grad_h, float* grad_c, float* grad_gates, float* grad_queries, float* gate_pre,
    float* weight_rows, float* grad_projected, float* dz, float* dphi, float* grad_scores,
    int64_t T, int64_t B, int64_t A, int64_t L, int64_t D, int64_t n, int64_t threads) {
  const Step step{sgemm, B, A, L, D, n, threads};
  const std::vector<float> exp_projected = exp_of_projected(projected, B * A * L, threads);
  for (int64_t t = T - 1; t >= 0; --t) {
    float* grad_query = grad_queries + t * B * A;
    step.lstm_and_gate_backward(gates + t * B * 4 * n, cells + t * B * n, cells + (t + 1) * B * n,
                                d_hidden + t * B * n, lstm, d_context + t * B * D,
                                contexts + t * B * D, betas + t * B, d_betas + t * B,
                                gate_weight, grad_h, grad_c, grad_gates + t * B * 4 * n,
                                gate_pre + t * B, dz, dphi);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; ++b) {
      const float* al = alphas + (t * B + b) * L;
      const float* la = log_alphas + (t * B + b) * L;
      const float* da = d_alpha + (t * B + b) * L;
      const float* dp = dphi + b * D;
      float* gs = grad_scores + b * L;
      float weighted = 0.0f;  // Σ_l α_l ∂α_l
      for (int64_t l = 0; l < L; ++l) {
        float dot = da[l];
        if (use_expected[b]) {
          const float* a = annotations + (b * L + l) * D;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += dp[d] * a[d];
        }
        gs[l] = dot;
        weighted += al[l] * dot;
      }
      const float d_lp = d_log_probs[t * B + b], d_h = d_entropy[t * B + b];
      const float h = entropy[t * B + b];
      for (int64_t l = 0; l < L; ++l)
        gs[l] = al[l] * (gs[l] - weighted) - d_h * al[l] * (la[l] + h) - d_lp * al[l];
      gs[locations[t * B + b]] += d_lp;
    }
    sat_scores_backward_from(grad_scores, projected, exp_projected.data(), queries + t * B * A,
                             weight2, grad_projected, grad_query, weight_rows + t * B * A, B, 1,
                             A, L, threads, t != T - 1);
    step.query_backward(grad_query, hidden2, grad_h);
  }
}

}  // extern "C"
