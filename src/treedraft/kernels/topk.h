// Each row's k best draft candidates with their log-softmax value, in one native call.
//
// The EAGLE drafter's tree search needs, for every drafted row, the k largest logits and logit -
// logsumexp(row). In NumPy that is ~14 array calls per draft depth; right after a native forward (which
// streams megabytes of weights through the caches) each of those first calls runs cold, and the
// measured cost was 100-230 us per depth against ~5 us for this loop (benchmarks/results/session12.md).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace td {

// e^x for x <= 0 (x - max of a row), float32: x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2, and
// e^r by its degree-7 Taylor polynomial (relative error < 1e-8 on that interval, below float rounding);
// written as plain arithmetic so that -O3 -march=native vectorizes the loop around it.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;  // e^-87 ~ 1.6e-38: still a normal float; smaller terms do not count
  // round to nearest by the 1.5 * 2^23 trick (|x / ln2| < 2^22): plain adds, which vectorize where nearbyint does not
  const float n = (x * 1.4426950408889634f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln2 split: exact n * hi
  float p = 1.9841269841269841e-4f;
  p = p * r + 1.3888888888888889e-3f;
  p = p * r + 8.3333333333333333e-3f;
  p = p * r + 4.1666666666666667e-2f;
  p = p * r + 1.6666666666666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// best (k) <- the k largest entries of row (V), descending, and io (k) their columns (equal entries: the lower
// column first). One pass: a value enters only when strictly larger than the k-th so far. k <= V.
inline void best_k(const float* row, int64_t V, int64_t k, float* best, int64_t* io) {
  int64_t n = 0;  // kept so far, sorted: best[0] largest
  for (int64_t j = 0; j < V; ++j) {
    const float v = row[j];
    if (n == k && !(v > best[k - 1])) continue;
    int64_t p = n < k ? n++ : k - 1;
    while (p > 0 && v > best[p - 1]) {
      best[p] = best[p - 1];
      io[p] = io[p - 1];
      --p;
    }
    best[p] = v;
    io[p] = j;
  }
}

// x (R, V) row-major -> ids (R, k) column indices of each row's k largest entries, best first (equal
// entries: the lower column first), and vals (R, k) float64: their log-softmax values when `normalize`,
// else the entries themselves. k <= V.
inline void topk_rows(const float* x, int64_t R, int64_t V, int64_t k, bool normalize, double* vals, int64_t* ids) {
  std::vector<float> e(normalize ? V : 0);
  std::vector<float> best(k);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x + r * V;
    double* vo = vals + r * k;
    int64_t* io = ids + r * k;
    best_k(row, V, k, best.data(), io);
    if (!normalize) {
      for (int64_t i = 0; i < k; ++i) vo[i] = (double)best[i];
      continue;
    }
    const float m = best[0];
    float* ep = e.data();
    for (int64_t j = 0; j < V; ++j) ep[j] = exp_nonpos(row[j] - m);
    // the sum in double over 32 independent lanes (a single chain of 4096 dependent adds costs ~6 us)
    double acc[32] = {0.0};
    int64_t j = 0;
    for (; j + 32 <= V; j += 32)
      for (int l = 0; l < 32; ++l) acc[l] += (double)ep[j + l];
    double s = 0.0;
    for (; j < V; ++j) s += ep[j];
    for (int l = 0; l < 32; ++l) s += acc[l];
    const double lse = (double)m + std::log(s);
    for (int64_t i = 0; i < k; ++i) vo[i] = (double)best[i] - lse;
  }
}

}  // namespace td
