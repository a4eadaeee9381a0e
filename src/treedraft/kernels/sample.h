// A sampled step's distribution from one logits row, and a draw from it, in one native call.
//
// Python's version (treedraft.sampling) takes ~10 tensor ops per emitted token, and top-p used to sort the
// whole 49k-token row (4-5 ms on a 2-core Xeon, more than half a decode step). Here a row costs a few passes
// over V floats: temperature, top-k by selection, exp, and top-p over the candidates above a threshold only.
//
// The distribution (the same one treedraft.sampling.target_probs defines; only float rounding differs):
//   z_j = x_j / T; top-k (0 < k < V) keeps z_j >= the k-th largest z (equal values are all kept);
//   e_j = exp(z_j - max z) for kept tokens, else 0; min-p (> 0) also drops e_j < min_p (p_j < min_p x the best p,
//   applied with top-k, before top-p, as vLLM orders them);
//   top-p (< 1) orders the kept tokens by e descending (equal e: lower id first) and drops each token once the
//   mass before it reaches top_p * sum(e); p_j = e_j / sum of what is left.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "topk.h"  // exp_nonpos, best_k

namespace td {

struct RowDist {
  double total = 0.0;        // sum of the kept e (p_j = e_j / total); < 0: the row has no finite maximum
  std::vector<int32_t> ids;  // top-p only: the kept ids (else every j with e_j > 0 is kept)
  bool sparse = false;
  float max = 0.0f;  // max z (z = x / T): a kept token's weight is e_j = exp(z_j - max)
};

// e (V floats) <- the kept tokens' unnormalised weights, zeros elsewhere (see the header comment).
inline RowDist row_dist(const float* x, int64_t V, float temperature, int64_t top_k, double top_p, float min_p,
                        float* e) {
  RowDist r;
  // z = x / T and its maximum, in 16 lanes (plain loops -O3 vectorizes); NaN counted apart (a NaN z fails z == z)
  constexpr int L = 16;
  float mx[L];
  int32_t bad[L];
  for (int l = 0; l < L; ++l) mx[l] = -INFINITY, bad[l] = 0;
  int64_t j = 0;
  for (j = 0; j < V; ++j) e[j] = x[j] / temperature;
  for (j = 0; j + L <= V; j += L)
    for (int l = 0; l < L; ++l) {
      mx[l] = std::max(mx[l], e[j + l]);  // NaN: counted apart, so the max may skip it
      bad[l] |= (int32_t)(e[j + l] != e[j + l]);
    }
  float m = -INFINITY;
  int32_t nbad = 0;
  for (; j < V; ++j) {
    m = std::max(m, e[j]);
    nbad |= (int32_t)(e[j] != e[j]);
  }
  for (int l = 0; l < L; ++l) m = std::max(m, mx[l]), nbad |= bad[l];
  if (nbad || !std::isfinite(m)) {  // NaN anywhere, +inf, or every token at -inf: the caller's fallback decides
    r.total = -1.0;
    return r;
  }
  r.max = m;
  float kth = -INFINITY;
  if (top_k > 0 && top_k < V) {
    thread_local std::vector<float> buf;
    if (top_k <= 256) {  // topk.h's one-pass insertion: most values fail the first compare (~4x nth_element)
      thread_local std::vector<int64_t> cols;
      buf.resize(top_k);
      cols.resize(top_k);
      best_k(e, V, top_k, buf.data(), cols.data());
      kth = buf[top_k - 1];
    } else {
      buf.assign(e, e + V);
      std::nth_element(buf.begin(), buf.begin() + (top_k - 1), buf.end(), std::greater<float>());
      kth = buf[top_k - 1];
    }
  }
  for (j = 0; j < V; ++j) {  // below e^-87 (~1e-38 of the best) a weight is 0, as for -inf logits
    const float d = e[j] - m;
    const float w = exp_nonpos(d);
    e[j] = (e[j] >= kth && d >= -87.0f && w >= min_p) ? w : 0.0f;
  }
  double acc[32] = {0.0};  // 32 independent lanes (a single chain of V dependent adds is ~5x slower)
  for (j = 0; j + 32 <= V; j += 32)
    for (int l = 0; l < 32; ++l) acc[l] += (double)e[j + l];
  double s = 0.0;
  for (; j < V; ++j) s += e[j];
  for (int l = 0; l < 32; ++l) s += acc[l];
  r.total = s;
  if (!(top_p < 1.0)) return r;
  // top-p: candidates are the tokens with e >= tau (the best has e = 1). Every other token comes after all of
  // them in descending order, so once the candidates' mass reaches top_p * s each of those is dropped too:
  // sorting the candidates alone decides. Otherwise tau shrinks and the candidates are taken again.
  const double want = top_p * s;
  thread_local std::vector<std::pair<float, int32_t>> cand;
  for (float tau = 0x1p-8f;; tau *= 0x1p-8f) {
    const bool all = tau < 0x1p-126f;  // every nonzero weight is >= e^-87 > 2^-126
    cand.clear();
    for (int64_t i = 0; i < V; ++i)
      if (e[i] > 0.0f && (all || e[i] >= tau)) cand.emplace_back(e[i], (int32_t)i);
    double c = 0.0;
    for (const auto& p : cand) c += p.first;
    if (!all && c < want) continue;
    std::sort(cand.begin(), cand.end(), [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    double before = 0.0;
    size_t n = 0;
    while (n < cand.size() && (n == 0 || before < want)) before += cand[n++].first;
    if (!all && before < want) continue;  // the sum in id order above reached it, this one fell short by rounding
    r.ids.resize(n);
    for (size_t i = 0; i < n; ++i) r.ids[i] = cand[i].second;
    std::sort(r.ids.begin(), r.ids.end());
    std::memset(e, 0, sizeof(float) * V);
    double kept = 0.0;
    for (size_t i = 0; i < n; ++i) {
      e[cand[i].second] = cand[i].first;
      kept += cand[i].first;
    }
    r.total = kept;
    r.sparse = true;
    return r;
  }
}

// The token x with C(x - 1) <= u * C(V - 1) < C(x), C the running float64 sum of e in id order (taken per block
// of 64 ids, then within the block); when rounding puts u * C(V - 1) past every C(x), the last token with
// weight. Never a token with e = 0.
inline int64_t draw_from(const float* e, int64_t V, const RowDist& r, double u) {
  if (r.sparse) {  // top-p: the kept ids, ascending
    double total = 0.0;
    for (int32_t j : r.ids) total += e[j];
    const double target = u * total;
    double c = 0.0;
    for (int32_t j : r.ids) {
      c += e[j];
      if (c > target) return j;
    }
    return r.ids.empty() ? -1 : r.ids.back();
  }
  constexpr int64_t B = 64;
  const int64_t nb = (V + B - 1) / B;
  thread_local std::vector<double> bs;
  bs.resize(nb);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t j0 = b * B, j1 = std::min(V, j0 + B);
    double a[8] = {0.0};
    int64_t j = j0;
    for (; j + 8 <= j1; j += 8)
      for (int l = 0; l < 8; ++l) a[l] += (double)e[j + l];
    for (; j < j1; ++j) a[0] += e[j];
    bs[b] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    total += bs[b];
  }
  const double target = u * total;
  double c = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    if (c + bs[b] > target) {
      double w = c;
      for (int64_t j = b * B, j1 = std::min(V, j + B); j < j1; ++j) {
        w += e[j];
        if (e[j] > 0.0f && w > target) return j;
      }
    }
    c += bs[b];
  }
  for (int64_t j = V - 1; j >= 0; --j)
    if (e[j] > 0.0f) return j;
  return -1;
}

// probs (R, V) <- each row's distribution; returns false (probs undefined) when a row has no finite maximum.
inline bool sample_probs_rows(const float* x, int64_t R, int64_t V, float temperature, int64_t top_k, double top_p,
                              float min_p, float* probs) {
  for (int64_t r = 0; r < R; ++r) {
    float* p = probs + r * V;
    const RowDist d = row_dist(x + r * V, V, temperature, top_k, top_p, min_p, p);
    if (!(d.total > 0.0)) return false;  // no finite maximum (-1), or no mass
    const double inv = 1.0 / d.total;
    for (int64_t j = 0; j < V; ++j) p[j] = (float)((double)p[j] * inv);
  }
  return true;
}

// One draw by inverse transform of u in [0, 1) from row x (V); -1 when the row has no finite maximum.
inline int64_t sample_draw_row(const float* x, int64_t V, float temperature, int64_t top_k, double top_p, float min_p,
                               double u) {
  thread_local std::vector<float> e;
  e.resize(V);
  const RowDist d = row_dist(x, V, temperature, top_k, top_p, min_p, e.data());
  if (!(d.total > 0.0)) return -1;  // no finite maximum (-1), or no mass
  return draw_from(e.data(), V, d, u);
}

// ---- Gumbel-max coupled draws (treedraft.sampling.coupled_sample) ----------------------------------------
//
// The token at a seeded position is argmax_j (d_j + G_j) over the kept tokens, d_j = z_j - max z (log of the
// weight e_j), G_j = -log(-log1p(-v_j)) a Gumbel(0, 1) noise and v_j in (0, 1] a 53-bit uniform hashed from
// (the position's key, token id j) alone: an exact draw from p (Gumbel 1954; the "Gumbel-max trick"). Each
// token's noise is its own, so a drafter that knows the key can take the top-k of ITS OWN d + G: where its
// distribution is near the target's the perturbed argmaxes agree whatever order the vocabulary is in (the
// inverse CDF's agreement falls with every CDF difference summed before the token, in id order).
//
// Computing 2 logarithms for each of 49k tokens per row would cost ~1 ms; instead, token j can beat a score s
// only if d_j + G_j > s, i.e. -log1p(-v_j) < exp(d_j - s), which needs v_j < e_j * exp(-s) (-log1p(-v) >= v).
// So each token costs one hash and one compare, and the logarithms run for the few that pass.

constexpr uint64_t kGumbelTokenStep = 0xD1B54A32D192ED03ull;  // odd: token j's counter is key + (j + 1) * step

inline uint64_t mix64(uint64_t z) {  // SplitMix64's output function (sampling._mix64)
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// v in (0, 1]: 53 random bits of the token's hash, plus one ulp (never 0)
inline double gumbel_v(uint64_t key, int64_t token) {
  return (double)((mix64(key + (uint64_t)(token + 1) * kGumbelTokenStep) >> 11) + 1) * 0x1p-53;
}

inline double gumbel_of(double v) { return -std::log(-std::log1p(-v)); }  // v = 1: -inf

// The k kept tokens (row_dist's support of x under the sampling parameters) with the largest d_j + G_j, best
// first (equal scores: the lower column first), as columns of x into ids and their scores; cols (nullable): the
// token id of each column (a drafter's reduced vocabulary), which keys the noise. Returns how many were found
// (< k when fewer tokens are kept), or -1 when the row has no finite maximum.
inline int64_t gumbel_topk_row(const float* x, int64_t V, const int64_t* cols, float temperature, int64_t top_k,
                               double top_p, float min_p, uint64_t key, int64_t k, int64_t* ids, double* scores) {
  thread_local std::vector<float> e;
  e.resize(V);
  const RowDist r = row_dist(x, V, temperature, top_k, top_p, min_p, e.data());
  if (!(r.total > 0.0)) return -1;
  int64_t n = 0;  // best-first list ids[0..n), scores[0..n)
  double thr = -INFINITY, c = INFINITY;  // the k-th best score once n == k; c: exp(-thr), with a margin
  auto consider = [&](int64_t j) {
    const double s = (double)(x[j] / temperature - r.max) + gumbel_of(gumbel_v(key, cols ? cols[j] : j));
    if (n == k && !(s > thr)) return;
    int64_t i = n < k ? n++ : k - 1;
    while (i > 0 && (s > scores[i - 1] || (s == scores[i - 1] && j < ids[i - 1]))) {
      scores[i] = scores[i - 1], ids[i] = ids[i - 1];
      --i;
    }
    scores[i] = s, ids[i] = j;
    if (n == k) thr = scores[k - 1], c = std::exp(-thr) * (1.0 + 1e-4) + 1e-300;  // e_j's exp is approximate
  };
  // the heaviest token first (e = 1): a first bound that prunes most of the row when k is 1
  int64_t best = -1;
  for (int64_t j = 0; j < V; ++j)
    if (e[j] == 1.0f) {
      best = j;
      break;
    }
  if (best >= 0) consider(best);
  if (r.sparse) {
    for (int32_t j : r.ids)
      if (j != best && (n < k || gumbel_v(key, cols ? cols[j] : j) < (double)e[j] * c)) consider(j);
    return n;
  }
  // dense rows: the pruning test for a block of tokens in a branch-free loop (the compiler vectorizes the hash),
  // then the exact score for the few that pass; c is taken per block (a later bound only prunes more)
  constexpr int64_t B = 256;
  uint8_t pass[B];
  for (int64_t j0 = 0; j0 < V; j0 += B) {
    const int64_t m = std::min(B, V - j0);
    const double cc = n < k ? INFINITY : c;
    const float* eb = e.data() + j0;
    if (cols) {
      const int64_t* cb = cols + j0;
      for (int64_t i = 0; i < m; ++i) pass[i] = (uint8_t)((eb[i] > 0.0f) & (gumbel_v(key, cb[i]) < (double)eb[i] * cc));
    } else {
      for (int64_t i = 0; i < m; ++i) pass[i] = (uint8_t)((eb[i] > 0.0f) & (gumbel_v(key, j0 + i) < (double)eb[i] * cc));
    }
    for (int64_t i = 0; i < m; ++i)
      if (pass[i] && j0 + i != best) {
        const int64_t j = j0 + i;
        if (n < k || gumbel_v(key, cols ? cols[j] : j) < (double)e[j] * c) consider(j);
      }
  }
  return n;
}

}  // namespace td
