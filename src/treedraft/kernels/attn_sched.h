// Scheduling of the row-invariant decode attention (attn.h) over the work-sharing pool (pool.h).
//
// A query's bits are fixed by attn.h alone: its allowed keys in rank order, cut into blocks of
// attn::kBlock ranks, each block reduced from a fresh state (attend_block), the block states folded
// in block order (fold). How the work is cut into units, which thread runs a unit and how many
// other queries share it change nothing in that arithmetic, so tree rows equal 1-token rows bitwise
// whatever the row count, segment or thread count.
//
// Units are (group of queries that share one kv head's keys, block). All queries of a unit walk the
// block's shared chunks together, so a kv head's keys/values are streamed from memory once per step
// for all its queries (GQA heads and tree rows), and the blocks of one query are spread over the
// threads (split-K: a 1-row step has only nkv groups). The unit that finishes a group's last block
// folds that group's queries: no second pass, no barrier besides the pool's own completion.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "attn.h"
#include "pool.h"

namespace td {
namespace attn {

// One (row, head): query vector q (hd floats); keys are slots idx[0..n) (or 0..n-1 when idx is
// null), the first `shared` of which are the slots 0, 1, ...; output to out (hd floats).
struct Query {
  const float* q;
  const int32_t* idx;
  int n, shared;
  float* out;
};

// Queries [q0, q1) (indices into the query list) attending to the same keys/values: key of slot s
// at k + s * ks, value at v + s * vs.
struct Group {
  const void* k;  // float, or half_t when half
  const void* v;
  int64_t ks, vs;
  int q0, q1;
  bool half = false;
};

class Runner {
 public:
  // Every query's out; groups may hold any number of queries (split here for the pool).
  // bf16: scores in bf16 (attn.h dotb) where hd % 32 == 0; requires bf16_scores_supported() on the AVX-512 path
  void run(int isa, const std::vector<Group>& groups, const std::vector<Query>& qs, int hd, float scale,
           Pool& pool, bool bf16 = false) {
    if (bf16 && isa == kAvx512 && !bf16_scores_supported())
      throw std::runtime_error("attention: bf16 scores need a build with AVX512-BF16 on the AVX-512 path");
    struct Mode {  // the mode for this call's pool work, back to fp32 scores however it ends
      explicit Mode(bool on) { g_bf16_scores = on; }
      ~Mode() { g_bf16_scores = false; }
    } mode(bf16);
    // state offsets per query (in floats)
    const int ss = state_size(hd);
    off_.resize(qs.size() + 1);
    off_[0] = 0;
    for (size_t i = 0; i < qs.size(); ++i) off_[i + 1] = off_[i] + (int64_t)num_blocks(qs[i].n) * ss;
    if ((int64_t)part_.size() < off_.back()) part_.resize(off_.back());
    // sub-groups of at most gs queries: halve gs until the biggest unit (gs queries over one full
    // block) is at most 1/(3 threads) of the step's key-query pairs, so the units balance over the
    // pool (a 1-row step at a short context gets one unit per query, at longer ones one per kv head
    // and block, reading the keys once)
    int64_t pairs = 0, longest = 0;
    for (const Query& x : qs) {
      pairs += std::max(x.n, 0);
      longest = std::max<int64_t>(longest, x.n);
    }
    const int64_t want = pool.size() > 1 ? 3 * pool.size() : 1, unit = std::min<int64_t>(kBlock, longest);
    int gs = kGroupCap;
    while (gs > 1 && gs * unit * want > pairs) gs = (gs + 1) / 2;
    sub_.clear();
    for (const Group& g : groups)
      for (int q0 = g.q0; q0 < g.q1; q0 += gs) {
        Group s = g;
        s.q0 = q0;
        s.q1 = std::min(g.q1, q0 + gs);
        for (int i = s.q0; i < s.q1; ++i)
          if (qs[i].n <= 0)
            for (int d = 0; d < hd; ++d) qs[i].out[d] = 0.f;
        if (nblocks(s, qs) > 0) sub_.push_back(s);
      }
    if (left_cap_ < sub_.size()) {
      left_.reset(new std::atomic<int>[sub_.size()]);
      left_cap_ = sub_.size();
    }
    units_.clear();
    for (size_t g = 0; g < sub_.size(); ++g) {
      const int nb = nblocks(sub_[g], qs);
      left_[g].store(nb, std::memory_order_relaxed);
      for (int b = 0; b < nb; ++b) units_.push_back({(int)g, b});
    }
    if (units_.empty()) return;
    float* part = part_.data();
    auto work = [&](int u) {
      const int g = units_[u].g, b = units_[u].b;
      const Group& s = sub_[g];
      const float* q[kGroupCap];
      const int32_t* ix[kGroupCap];
      int n[kGroupCap], sh[kGroupCap];
      float* st[kGroupCap];
      const int nq = s.q1 - s.q0;
      for (int i = 0; i < nq; ++i) {
        const Query& x = qs[s.q0 + i];
        q[i] = x.q, ix[i] = x.idx, n[i] = x.n, sh[i] = x.shared;
        st[i] = part + off_[s.q0 + i] + (int64_t)b * ss;
      }
      if (s.half) block(isa, nq, q, ix, n, sh, (const half_t*)s.k, s.ks, (const half_t*)s.v, s.vs, hd, scale, b, st);
      else block(isa, nq, q, ix, n, sh, (const float*)s.k, s.ks, (const float*)s.v, s.vs, hd, scale, b, st);
      if (left_[g].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      for (int i = s.q0; i < s.q1; ++i) {  // last block of this group done: fold its queries
        const int nb = num_blocks(qs[i].n);
        if (nb == 0) continue;
        if (isa == kAvx512) fold<kAvx512>(nb, part + off_[i], hd, qs[i].out);
        else if (isa == kAvx2) fold<kAvx2>(nb, part + off_[i], hd, qs[i].out);
        else fold<kScalar>(nb, part + off_[i], hd, qs[i].out);
      }
    };
    if (units_.size() > (size_t)Pool::kMaxUnits) throw std::runtime_error("attention: too many work units");
    pool.run(work, (int)units_.size());
  }

 private:
  static constexpr int kGroupCap = kMaxGroup;
  struct Unit {
    int g, b;
  };

  template <class T>
  static void block(int isa, int nq, const float* const* q, const int32_t* const* ix, const int* n, const int* sh,
                    const T* k, int64_t ks, const T* v, int64_t vs, int hd, float scale, int b, float* const* st) {
    if (isa == kAvx512) attend_block<kAvx512>(nq, q, ix, n, sh, k, ks, v, vs, hd, scale, b, st);
    else if (isa == kAvx2) attend_block<kAvx2>(nq, q, ix, n, sh, k, ks, v, vs, hd, scale, b, st);
    else attend_block<kScalar>(nq, q, ix, n, sh, k, ks, v, vs, hd, scale, b, st);
  }

  static int nblocks(const Group& g, const std::vector<Query>& qs) {
    int nb = 0;
    for (int i = g.q0; i < g.q1; ++i) nb = std::max(nb, num_blocks(qs[i].n));
    return nb;
  }

  std::vector<int64_t> off_;
  std::vector<float> part_;
  std::vector<Group> sub_;
  std::vector<Unit> units_;
  std::unique_ptr<std::atomic<int>[]> left_;
  size_t left_cap_ = 0;
};

}  // namespace attn
}  // namespace td
