// The decoder's attention and LSTM steps, each in one pass over its tensors (issue #20).
//
// ``sat_model/model/native.py`` compiles this file with the machine's C++ compiler the first time
// it is needed and calls it through ctypes on float32 CPU tensors; ``fused.py`` and
// ``decoder.py`` fall back to their PyTorch code where there is no compiler. Dimensions as in
// docs/METHOD.md: B images, k rows per image (beams; 1 in training), A attention size, L
// locations, D annotation size, n LSTM size. Arrays are contiguous unless a stride is passed.
//
// projected (B, A, L) holds 2(W_a a_i + b), query (B*k, A) 2 W_h h, weight2 (A) 2 w_att, so
// that 2 w_att^T tanh(u) = 2 w_att^T (2σ(2u) - 1) is Σ_a weight2_a σ(projected + query) up to a
// constant that the softmax removes (SoftAttention.scores). Where PyTorch's eager path streams
// the (B*k, A, L) tensor through memory five to seven times per step (add, σ, product, sums,
// gradient), this reads it once per direction and never stores it.
//
// Compiled with -ffast-math (vectorised expf from glibc's libmvec) and linked without it, so
// that loading the library does not switch the process to flush-to-zero.

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// σ(x) for any finite x. Under -ffast-math the compiler may assume exp never overflows, and
// 1 / (1 + inf) then comes out NaN rather than 0; below -80, σ is under 2e-35 and 1 / (1 + e^80)
// is as good a zero as any.
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-std::fmax(x, -80.0f))); }

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

// One row's share of the scores' backward for its ∂/∂scores g (L): with s = σ(p + q) and
// u = s (1 - s) g, adds (or, when ``write``, writes) weight2 u into gp_image (A, L), and writes
// grad_q (A) = weight2 Σ_l u and weight_row (A) = Σ_l s g.
void row_scores_backward(const float* g, const float* p_image, const float* q_row,
                         const float* weight2, float* gp_image, float* grad_q, float* weight_row,
                         int64_t A, int64_t L, bool write) {
  for (int64_t a = 0; a < A; ++a) {
    const float* p = p_image + a * L;
    float* gp = gp_image + a * L;
    const float q = q_row[a], w = weight2[a];
    float sum_sg = 0.0f, sum_u = 0.0f;
    if (write) {
#pragma omp simd reduction(+ : sum_sg, sum_u)
      for (int64_t l = 0; l < L; ++l) {
        const float s = sigmoid(p[l] + q), sg = s * g[l], u = sg - sg * s;
        sum_sg += sg;
        sum_u += u;
        gp[l] = w * u;
      }
    } else {
#pragma omp simd reduction(+ : sum_sg, sum_u)
      for (int64_t l = 0; l < L; ++l) {
        const float s = sigmoid(p[l] + q), sg = s * g[l], u = sg - sg * s;
        sum_sg += sg;
        sum_u += u;
        gp[l] += w * u;
      }
    }
    grad_q[a] = w * sum_u;
    weight_row[a] = sum_sg;
  }
}

}  // namespace

extern "C" {

// scores (B*k, L) = Σ_a weight2_a σ(projected[b, a, :] + query[r, a]), b = r / k.
void sat_scores_forward(const float* projected, const float* query, const float* weight2,
                        float* scores, int64_t B, int64_t k, int64_t A, int64_t L,
                        int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < B * k; ++r)
    row_scores(projected + (r / k) * A * L, query + r * A, weight2, scores + r * L, A, L);
}

// From ∂/∂scores (B*k, L): with s = σ(projected + query), u = s (1 - s) ∂scores,
//   grad_projected (B, A, L) = weight2 Σ_{k rows} u    (written, or added to when accumulate),
//   grad_query (B*k, A)      = weight2 Σ_l u,
//   weight_rows (B*k, A)     = Σ_l s ∂scores           (the caller sums the rows: ∂/∂weight2).
// One image per thread at a time, so its k rows add into grad_projected without a race.
void sat_scores_backward(const float* grad, const float* projected, const float* query,
                         const float* weight2, float* grad_projected, float* grad_query,
                         float* weight_rows, int64_t B, int64_t k, int64_t A, int64_t L,
                         int64_t threads, int64_t accumulate) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = b * k + j;
      row_scores_backward(grad + r * L, projected + b * A * L, query + r * A, weight2,
                          grad_projected + b * A * L, grad_query + r * A, weight_rows + r * A, A,
                          L, j == 0 && !accumulate);
    }
}

// Soft attention's step (Eq. 4-5 and the expected context of Sec. 4.2): the scores of the k
// rows of each image, α = softmax over the L locations into ``alpha`` (B*k, L), and
// φ = Σ_l α_l a_l into ``context`` (B*k, D) with rows ``context_stride`` apart. The k rows
// of an image read its annotations (B, L, D) together, once.
void sat_attend_forward(const float* projected, const float* query, const float* weight2,
                        const float* annotations, float* alpha, float* context,
                        int64_t context_stride, int64_t B, int64_t k, int64_t A, int64_t L,
                        int64_t D, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = b * k + j;
      float* al = alpha + r * L;
      row_scores(projected + b * A * L, query + r * A, weight2, al, A, L);
      float top = al[0];
      for (int64_t l = 1; l < L; ++l) top = al[l] > top ? al[l] : top;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t l = 0; l < L; ++l) {
        al[l] = std::exp(al[l] - top);
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
// softmax's backward to ∂/∂scores, then the scores' backward as in sat_scores_backward
// (grad_projected written or, with accumulate, added to; grad_query and weight_rows written).
void sat_attend_backward(const float* grad_context, const float* grad_alpha, const float* alpha,
                         const float* annotations, const float* projected, const float* query,
                         const float* weight2, float* grad_projected, float* grad_query,
                         float* weight_rows, int64_t B, int64_t A, int64_t L, int64_t D,
                         int64_t threads, int64_t accumulate) {
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
      row_scores_backward(gs, projected + b * A * L, query + b * A, weight2,
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
      const float i = sigmoid(gi[j]), f = sigmoid(gf[j]), g = std::tanh(gg[j]);
      const float o = sigmoid(go[j]);
      gi[j] = i, gf[j] = f, gg[j] = g, go[j] = o;
      c[j] = f * cp[j] + i * g;
      h[j] = o * std::tanh(c[j]);
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
      const float tanh_c = std::tanh(c[j]);
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
