// One native call per decode forward of a Llama-family decoder (treedraft.models.fused): embedding,
// then per layer RMSNorm -> qkv mm -> RoPE -> k/v cache write -> row-invariant attention -> wo mm ->
// residual -> RMSNorm -> w13 mm -> silu(gate) * up -> w2 mm -> residual, then the final RMSNorm and
// optionally the lm_head mm for chosen rows. Removes the ~400 small aten ops of a Python step.
//
// Rows are packed segments (one per request, see notes/segments.md): the linears run over all M rows
// at once, attention runs per segment over that segment's own per-layer k/v cache.
//
// Row invariance (exact speculative decoding): every per-row operation below computes a row from
// that row alone with a fixed operation order, and mm_into / the attention of attn.h + attn_sched.h are row-invariant, so a
// row's bits do not depend on M, on the other rows or on the segment it sits in:
//   RMSNorm:  ss = attn::dot(x, x, H) (16 fma lanes + fixed tree); r = 1 / sqrt(ss / H + eps);
//             y[i] = w[i] * (x[i] * r)
//   RoPE:     angle = (float)pos * inv_freq[i]; c, s = (float)cos/sin((double)angle);
//             y[i] = x[i] * c - x[i + hd/2] * s, y[i + hd/2] = x[i + hd/2] * c + x[i] * s (HF rotate-half)
//   silu*up:  g / (1 + exp_fixed(-g)) * u (attn::exp_fixed: the same bits on every ISA path)
//   residual: x[i] + y[i]
// KV caches may be float32 or float16 (attn_kv.h: written rounded to nearest even, read widened exactly).
//
// The per-row elementwise work runs as row passes over the thread pool (rows(): one unit per row), each
// fused with its neighbours so a row is read once: residual + RMSNorm + the next linear's activation
// quantization (ActBuf::quantize_row; the normed floats never reach memory), RoPE + the row's cache write,
// silu*up + quantization, the attention output's quantization. Which thread runs a row changes no bit.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <new>
#include <tuple>
#include <vector>

#include "attn.h"
#include "attn_sched.h"
#include "f32mm.h"
#include "fused_ops.h"
#include "mm_core.h"

namespace td {

// One packed linear: weight bytes, output features, kind (kQ4_1 / kQ8_0), optional float32 bias (N,).
struct Lin {
  torch::Tensor data, bias;
  int64_t N = 0, K = 0;
  int kind = 0;
};

struct LayerW {
  torch::Tensor attn_norm, ffn_norm;  // (H,) float32
  Lin wqkv, wo, w13, w2;
};

class FusedDecoder {
 public:
  // layers: per layer [attn_norm, ffn_norm, wqkv, wqkv_bias, wo, wo_bias, w13, w13_bias, w2, w2_bias]
  // (10 tensors; a missing bias is an empty tensor); kinds: per layer the 4 linears' kinds.
  // lm_head: packed bytes or an empty tensor (then forward returns no logits).
  FusedDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
               double eps, double attn_scale, torch::Tensor embed, torch::Tensor inv_freq,
               std::vector<torch::Tensor> layers, std::vector<int64_t> kinds, torch::Tensor final_norm,
               torch::Tensor lm_head, torch::Tensor lm_head_bias, int64_t lm_head_kind,
               int64_t vocab)
      : H_(hidden), nh_(heads), nkv_(kv_heads), hd_(head_dim), I_(inter), eps_((float)eps),
        scale_((float)attn_scale), embed_(embed), inv_freq_(inv_freq), final_norm_(final_norm) {
    TORCH_CHECK(nh_ > 0 && nkv_ > 0 && nh_ % nkv_ == 0, "FusedDecoder: heads=", nh_,
                " must be a multiple of kv_heads=", nkv_);
    TORCH_CHECK(hd_ % 2 == 0, "FusedDecoder: head_dim must be even");
    TORCH_CHECK(layers.size() % 10 == 0 && kinds.size() * 10 == layers.size() * 4,
                "FusedDecoder: need 10 tensors and 4 kinds per layer");
    check_f32(embed_, "embed", 2);
    TORCH_CHECK(embed_.size(1) == H_, "FusedDecoder: embed must be (V, ", H_, ")");
    check_f32(inv_freq_, "inv_freq", 1);
    TORCH_CHECK(inv_freq_.size(0) == hd_ / 2, "FusedDecoder: inv_freq must have head_dim/2 entries");
    if (final_norm_.numel() > 0) check_vec(final_norm_, "final norm", H_);  // empty: hidden = pre-norm x
    const int64_t qkv = (nh_ + 2 * nkv_) * hd_;
    for (size_t l = 0; l < layers.size() / 10; ++l) {
      const torch::Tensor* t = &layers[l * 10];
      const int64_t* k = &kinds[l * 4];
      LayerW w;
      w.attn_norm = t[0];
      w.ffn_norm = t[1];
      check_vec(w.attn_norm, "attn_norm", H_);
      check_vec(w.ffn_norm, "ffn_norm", H_);
      w.wqkv = make_lin(t[2], t[3], k[0], qkv, H_, "wqkv");
      w.wo = make_lin(t[4], t[5], k[1], H_, nh_ * hd_, "wo");
      w.w13 = make_lin(t[6], t[7], k[2], 2 * I_, H_, "w13");
      w.w2 = make_lin(t[8], t[9], k[3], H_, I_, "w2");
      layers_.push_back(std::move(w));
    }
    if (lm_head.numel() > 0) {
      lm_ = make_lin(lm_head, lm_head_bias, lm_head_kind, vocab, H_, "lm_head");
      has_lm_ = true;
    }
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

  // EAGLE input (drafters/eagle.py, EagleNet.forward): with it set, forward takes the features f (M, H)
  // and a row's input is fc([emb_norm(embed(tok)) ; feat_norm(f)]) instead of embed(tok).
  void set_eagle_input(torch::Tensor emb_norm, torch::Tensor feat_norm, torch::Tensor fc, torch::Tensor fc_bias,
                       int64_t fc_kind) {
    check_vec(emb_norm, "emb_norm", H_);
    check_vec(feat_norm, "feat_norm", H_);
    emb_norm_ = emb_norm;
    feat_norm_ = feat_norm;
    fc_ = make_lin(fc, fc_bias, fc_kind, H_, 2 * H_, "fc");
    has_fc_ = true;
  }

  // Layer options beyond Llama's (models/llama.py), each independent: embeddings times embed_scale (> 0; Gemma);
  // qk_norms, per layer [q_norm (hd), k_norm (hd)] or none: RMSNorm on each head's q and k before RoPE (Gemma 3,
  // Qwen3); post_norms, per layer [post_attn (H), post_ffn (H)] or none: RMSNorm on the attention and FFN outputs
  // before each residual add (Gemma's sandwich); a GELU (tanh) gate when `gelu`; the layers in `local` see only keys
  // at positions > p - window (window 0: all) and take their RoPE angles from inv_freq_local (Gemma 3). Cache slot
  // j < a segment's start holds position j (every cache is filled from slot 0 in order).
  void set_variant(double embed_scale, std::vector<torch::Tensor> qk_norms, std::vector<torch::Tensor> post_norms,
                   torch::Tensor inv_freq_local, std::vector<int64_t> local, int64_t window, bool gelu) {
    const int64_t L = num_layers();
    TORCH_CHECK(qk_norms.empty() || (int64_t)qk_norms.size() == 2 * L,
                "FusedDecoder.set_variant: need 2 q/k norms per layer, or none");
    TORCH_CHECK(post_norms.empty() || (int64_t)post_norms.size() == 2 * L,
                "FusedDecoder.set_variant: need 2 post norms per layer, or none");
    TORCH_CHECK(window >= 0, "FusedDecoder.set_variant: window must be >= 0");
    for (size_t i = 0; i < qk_norms.size(); ++i) check_vec(qk_norms[i], i % 2 ? "k_norm" : "q_norm", hd_);
    for (size_t i = 0; i < post_norms.size(); ++i)
      check_vec(post_norms[i], i % 2 ? "post_ffn_norm" : "post_attn_norm", H_);
    local_.assign(L, 0);
    for (int64_t l : local) {
      TORCH_CHECK(l >= 0 && l < L, "FusedDecoder.set_variant: local layer ", l, " out of range");
      local_[l] = 1;
    }
    if (!local.empty()) {
      check_f32(inv_freq_local, "inv_freq_local", 1);
      TORCH_CHECK(inv_freq_local.size(0) == hd_ / 2, "FusedDecoder: inv_freq_local must have head_dim/2 entries");
    }
    qk_norms_ = std::move(qk_norms);
    post_norms_ = std::move(post_norms);
    inv_local_ = local.empty() ? torch::Tensor() : inv_freq_local;
    window_ = local.empty() ? 0 : window;
    embed_scale_ = embed_scale > 0 ? (float)embed_scale : 0.f;
    gelu_ = gelu;
  }

  // Per-phase wall time of the forwards since the last call (ms), when profiling is on:
  // [other (norms, RoPE, cache writes, silu, residuals), qkv, attention, wo, w13, w2, lm_head]
  void set_profile(bool on) { profile_ = g_time_quant = on; }
  // attention scores in bf16 (attn.h dotb) where head_dim % 32 == 0; needs attn::bf16_scores_supported() on AVX-512
  void set_bf16_scores(bool on) {
    TORCH_CHECK(!on || attn::bf16_scores_supported() || default_isa() != attn::kAvx512,
                "FusedDecoder: bf16 scores need a kernel build with AVX512-BF16");
    bf16_scores_ = on;
  }
  // Of the linear phases above: ms spent quantizing their activations since the last call (profiling only).
  double take_quant_timing() {
    const double ms = g_quant_ns * 1e-6;
    g_quant_ns = 0;
    return ms;
  }
  std::vector<double> take_timings() {
    std::vector<double> out(prof_.size());
    for (size_t i = 0; i < prof_.size(); ++i) out[i] = prof_[i] * 1e-6;
    prof_.fill(0);
    return out;
  }

  // tokens, positions: (M,) int64. Segment i owns the next seg_rows[i] rows, writes its keys/values
  // at slots [seg_start[i], seg_start[i] + rows) of seg_k[i][l] / seg_v[i][l] ((1, nkv, max_len, hd)
  // float32 contiguous per layer l) and attends under seg_mask[i]: bool (rows, start + rows), True =
  // may attend, or an empty tensor for causal. logit_rows: row indices (int64) that get logits, or
  // None for all rows. Returns (logits (R, V) float32 or an empty tensor, final-norm hidden (M, H)).
  std::tuple<torch::Tensor, torch::Tensor> forward(
      torch::Tensor tokens, torch::Tensor positions, std::vector<int64_t> seg_rows,
      std::vector<int64_t> seg_start, std::vector<std::vector<torch::Tensor>> seg_k,
      std::vector<std::vector<torch::Tensor>> seg_v, std::vector<torch::Tensor> seg_mask,
      std::optional<torch::Tensor> logit_rows, bool want_logits,
      std::optional<torch::Tensor> features = std::nullopt) {
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous(),
                "FusedDecoder.forward: tokens must be a contiguous int64 (M,) tensor");
    TORCH_CHECK(positions.sizes() == tokens.sizes() && positions.scalar_type() == torch::kInt64 &&
                    positions.is_contiguous(),
                "FusedDecoder.forward: positions must be a contiguous int64 tensor shaped like tokens");
    const int64_t M = tokens.size(0), S = (int64_t)seg_rows.size();
    TORCH_CHECK(seg_start.size() == (size_t)S && seg_k.size() == (size_t)S && seg_v.size() == (size_t)S &&
                    seg_mask.size() == (size_t)S,
                "FusedDecoder.forward: one start, k list, v list and mask per segment");
    const int64_t L = num_layers(), V = embed_.size(0);
    std::vector<int64_t> row0(S + 1, 0);
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK(seg_rows[s] >= 0 && seg_start[s] >= 0, "FusedDecoder.forward: bad segment ", s);
      row0[s + 1] = row0[s] + seg_rows[s];
      TORCH_CHECK(seg_k[s].size() >= (size_t)L && seg_v[s].size() >= (size_t)L,
                  "FusedDecoder.forward: segment ", s, " needs a k and a v tensor per layer (", L, ")");
      for (int64_t l = 0; l < L; ++l) {
        check_cache(seg_k[s][l], seg_start[s] + seg_rows[s]);
        check_cache(seg_v[s][l], seg_start[s] + seg_rows[s]);
        TORCH_CHECK(seg_k[s][l].size(2) == seg_v[s][l].size(2) &&
                        seg_k[s][l].scalar_type() == seg_v[s][l].scalar_type(),
                    "FusedDecoder.forward: k/v caches differ in length or dtype");
      }
    }
    TORCH_CHECK(row0[S] == M, "FusedDecoder.forward: segments cover ", row0[S], " rows, tokens has ", M);
    const int64_t* tok = tokens.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m)
      TORCH_CHECK(tok[m] >= 0 && tok[m] < V, "FusedDecoder.forward: token id ", tok[m], " out of range [0, ", V, ")");

    // allowed slots per row, increasing: offsets into idx_; a causal row uses n = start + t + 1, no list
    idx_.clear();
    off_.assign(M + 1, 0);
    cnt_.assign(M, 0);
    contig_.assign(M, 0);
    causal_.assign(M, 0);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t T = seg_rows[s], Lk = seg_start[s] + T;
      const torch::Tensor& mk = seg_mask[s];
      if (mk.numel() == 0) {
        for (int64_t t = 0; t < T; ++t) {
          causal_[row0[s] + t] = 1;
          cnt_[row0[s] + t] = seg_start[s] + t + 1;
          contig_[row0[s] + t] = seg_start[s] + t + 1;
        }
        continue;
      }
      TORCH_CHECK(mk.dim() == 2 && mk.size(0) == T && mk.size(1) == Lk && mk.scalar_type() == torch::kBool,
                  "FusedDecoder.forward: mask of segment ", s, " must be bool (", T, ", ", Lk, ")");
      auto mc = mk.contiguous();
      const bool* ap = mc.data_ptr<bool>();
      for (int64_t t = 0; t < T; ++t) {
        const int64_t r = row0[s] + t;
        off_[r] = (int64_t)idx_.size();
        for (int64_t j = 0; j < Lk; ++j)
          if (ap[t * Lk + j]) idx_.push_back((int32_t)j);
        cnt_[r] = (int64_t)idx_.size() - off_[r];
        int64_t c = 0;  // leading ranks that are the slots 0, 1, ... (shared with other rows)
        while (c < cnt_[r] && idx_[off_[r] + c] == c) ++c;
        contig_[r] = c;
      }
    }
    const int64_t qkvN = (nh_ + 2 * nkv_) * hd_, half = hd_ / 2;
    x_.resize(M * H_);
    h_.resize(M * H_);
    qkv_.resize(M * qkvN);
    att_.resize(M * nh_ * hd_);
    ff_.resize(M * 2 * I_);
    af_.resize(M * std::max(H_, I_));  // float inputs of kF32 linears (emit)
    cs_.resize(M * hd_);  // per row: cos[0..half), sin[0..half)
    const float* emb = embed_.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) std::memcpy(&x_[m * H_], emb + tok[m] * H_, H_ * sizeof(float));
    if (embed_scale_ > 0.f)
      for (int64_t i = 0; i < M * H_; ++i) x_[i] = x_[i] * embed_scale_;
    TORCH_CHECK(has_fc_ == features.has_value(), "FusedDecoder.forward: features must be given exactly when ",
                "set_eagle_input was called");
    if (has_fc_) {
      const torch::Tensor& f = *features;
      TORCH_CHECK(f.dim() == 2 && f.size(0) == M && f.size(1) == H_ && f.scalar_type() == torch::kFloat32 &&
                      f.is_contiguous(),
                  "FusedDecoder.forward: features must be contiguous float32 (", M, ", ", H_, ")");
      cat_.resize(M * 2 * H_);
      const int isa0 = default_isa();
      for (int64_t m = 0; m < M; ++m) {
        rmsnorm(&x_[m * H_], emb_norm_.data_ptr<float>(), &cat_[m * 2 * H_], 1, isa0);
        rmsnorm(f.data_ptr<float>() + m * H_, feat_norm_.data_ptr<float>(), &cat_[m * 2 * H_ + H_], 1, isa0);
      }
      linear(fc_, cat_.data(), M, x_.data(), pick_path(""));
    }
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float* inv = inv_freq_.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < half; ++i) {
        const float a = (float)pos[m] * inv[i];
        cs_[m * hd_ + i] = (float)std::cos((double)a);
        cs_[m * hd_ + half + i] = (float)std::sin((double)a);
      }

    const bool two_ropes = inv_local_.defined() && inv_local_.numel() > 0;
    if (two_ropes) {  // the local layers' angles
      cs_local_.resize(M * hd_);
      const float* il = inv_local_.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < half; ++i) {
          const float a = (float)pos[m] * il[i];
          cs_local_[m * hd_ + i] = (float)std::cos((double)a);
          cs_local_[m * hd_ + half + i] = (float)std::sin((double)a);
        }
    }
    windowed_ = window_ > 0 && window_lists(S, row0, seg_start, pos);

    const Path& path = pick_path("");
    last_ = std::chrono::steady_clock::now();
    const int isa = default_isa();
    seg_of_.resize(M);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t r = row0[s]; r < row0[s + 1]; ++r) seg_of_[r] = s;
    const int64_t A = nh_ * hd_;
    for (int64_t l = 0; l < L; ++l) {
      const LayerW& w = layers_[l];
      // (the previous layer's w2 residual) -> RMSNorm -> codes of the qkv input
      const bool loc = !local_.empty() && local_[l];
      const bool post = !post_norms_.empty();
      const float* prev_post = post && l > 0 ? post_norms_[2 * (l - 1) + 1].data_ptr<float>() : nullptr;
      act_q_.prepare(M, H_);
      rows(M, H_, [&](int64_t m) {
        residual_norm_quant(m, l > 0, w.attn_norm.data_ptr<float>(), isa, w.wqkv.kind, prev_post);
      });
      tick(0);
      linear_q(w.wqkv, M, qkv_.data(), path, af_.data());
      tick(1);
      const float* rope_cs = loc && two_ropes ? cs_local_.data() : cs_.data();
      rows(M, qkvN, [&](int64_t m) {  // (Gemma: q/k head norms,) RoPE on the row's q and k heads, its k/v to the cache
        const float* c = rope_cs + m * hd_;
        if (!qk_norms_.empty())
          for (int64_t hh = 0; hh < nh_ + nkv_; ++hh) {
            float* hp = &qkv_[m * qkvN + hh * hd_];
            rmsnorm_n(hp, qk_norms_[2 * l + (hh < nh_ ? 0 : 1)].data_ptr<float>(), hp, hd_, isa);
          }
        for (int64_t hh = 0; hh < nh_ + nkv_; ++hh) rope(&qkv_[m * qkvN + hh * hd_], c, c + half, half);
        const int64_t s = seg_of_[m];
        write_kv(&qkv_[m * qkvN + nh_ * hd_], seg_k[s][l], seg_v[s][l], seg_start[s] + m - row0[s], nkv_, hd_);
      });
      tick(0);
      attention(l, S, row0, seg_k, seg_v, isa, loc && windowed_);
      tick(2);
      act_q_.prepare(M, A);
      if (w.wo.kind != kF32) rows(M, A, [&](int64_t m) { act_q_.quantize_row(&att_[m * A], m); });
      linear_q(w.wo, M, h_.data(), path, att_.data());
      tick(3);
      act_q_.prepare(M, H_);
      const float* attn_post = post ? post_norms_[2 * l].data_ptr<float>() : nullptr;
      rows(M, H_, [&](int64_t m) {
        residual_norm_quant(m, true, w.ffn_norm.data_ptr<float>(), isa, w.w13.kind, attn_post);
      });
      tick(0);
      linear_q(w.w13, M, ff_.data(), path, af_.data());
      tick(4);
      act_q_.prepare(M, I_);
      rows(M, I_, [&](int64_t m) {  // silu(gate) * up (Gemma: gelu_tanh) -> codes of the w2 input
        float* t = row_scratch(I_);
        if (gelu_)
          gelu_tanh_mul(&ff_[m * 2 * I_], &ff_[m * 2 * I_ + I_], t, I_, isa);
        else
          silu_mul(&ff_[m * 2 * I_], &ff_[m * 2 * I_ + I_], t, I_, isa);
        emit(w.w2.kind, t, m, I_);
      });
      tick(0);
      linear_q(w.w2, M, h_.data(), path, af_.data());
      tick(5);
    }
    auto hidden = torch::empty({M, H_}, torch::kFloat32);
    float* hp = hidden.data_ptr<float>();
    const float* last_post = !post_norms_.empty() && L > 0 ? post_norms_[2 * (L - 1) + 1].data_ptr<float>() : nullptr;
    rows(M, H_, [&](int64_t m) {  // the last w2 residual (Gemma: its output norm first), then the final norm
      float* xr = &x_[m * H_];
      float* hr = &h_[m * H_];
      if (last_post != nullptr) rmsnorm_n(hr, last_post, hr, H_, isa);
      if (L > 0)
        for (int64_t i = 0; i < H_; ++i) xr[i] = xr[i] + hr[i];
      if (final_norm_.numel() > 0)
        rmsnorm(xr, final_norm_.data_ptr<float>(), hp + m * H_, 1, isa);
      else
        std::memcpy(hp + m * H_, xr, H_ * sizeof(float));
    });
    tick(0);
    if (!want_logits || !has_lm_) return {torch::empty({0}, torch::kFloat32), hidden};
    torch::Tensor hl = hidden;
    if (logit_rows.has_value()) {
      TORCH_CHECK(logit_rows->scalar_type() == torch::kInt64 && logit_rows->dim() == 1,
                  "FusedDecoder.forward: logit_rows must be an int64 (R,) tensor");
      hl = hidden.index_select(0, *logit_rows).contiguous();
    }
    auto logits = torch::empty({hl.size(0), lm_.N}, torch::kFloat32);
    tick(0);
    linear(lm_, hl.data_ptr<float>(), hl.size(0), logits.data_ptr<float>(), path);
    tick(6);
    return {logits, hidden};
  }

 private:
  // adds the time since the previous tick to phase i (profiling only)
  void tick(int i) {
    if (!profile_) return;
    const auto now = std::chrono::steady_clock::now();
    prof_[i] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count();
    last_ = now;
  }

  static void check_f32(const torch::Tensor& t, const char* name, int64_t dim) {
    TORCH_CHECK(t.dim() == dim && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(),
                "FusedDecoder: ", name, " must be a contiguous float32 CPU tensor with ", dim, " dims");
  }
  static void check_vec(const torch::Tensor& t, const char* name, int64_t n) {
    check_f32(t, name, 1);
    TORCH_CHECK(t.size(0) == n, "FusedDecoder: ", name, " must have ", n, " entries, has ", t.size(0));
  }
  static Lin make_lin(const torch::Tensor& data, const torch::Tensor& bias, int64_t kind, int64_t N, int64_t K,
                      const char* name) {
    TORCH_CHECK(kind == kQ4_1 || kind == kQ8_0 || kind == kF32, "FusedDecoder: ", name,
                " kind must be 0 (Q4_1), 1 (Q8_0) or 2 (float32)");
    if (kind == kF32) {  // the fp32 path's weights as they are, (N, K): f32mm.h, every row computed alike
      TORCH_CHECK(data.scalar_type() == torch::kFloat32 && data.is_contiguous() && data.dim() == 2 &&
                      data.size(0) == N && data.size(1) == K,
                  "FusedDecoder: ", name, " (float32) must be a contiguous (", N, ", ", K, ") tensor");
      if (bias.numel() > 0) check_vec(bias, name, N);
      return Lin{data, bias, N, K, (int)kind};
    }
    TORCH_CHECK(data.scalar_type() == torch::kUInt8 && data.is_contiguous(), "FusedDecoder: ", name,
                " must be contiguous uint8 packed bytes");
    TORCH_CHECK(K % kQK == 0, "FusedDecoder: ", name, " K=", K, " is not a multiple of 32");
    const int64_t blk = kind == kQ4_1 ? kQ41Bytes : kQ80Bytes;
    const int64_t want = (N + kTile - 1) / kTile * (K / kQK) * blk;
    TORCH_CHECK(data.numel() == want, "FusedDecoder: ", name, " has ", data.numel(), " bytes, expected ", want,
                " for N=", N, ", K=", K);
    if (bias.numel() > 0) check_vec(bias, name, N);
    return Lin{data, bias, N, K, (int)kind};
  }
  void check_cache(const torch::Tensor& c, int64_t end) const {
    TORCH_CHECK(c.dim() == 4 && c.size(0) == 1 && c.size(1) == nkv_ && c.size(3) == hd_ &&
                    (c.scalar_type() == torch::kFloat32 || c.scalar_type() == torch::kHalf) && c.is_contiguous(),
                "FusedDecoder.forward: cache tensors must be contiguous float32 or float16 (1, ", nkv_, ", max_len, ",
                hd_, ")");
    TORCH_CHECK(end <= c.size(2), "KV cache overflow: writing up to ", end, " > max_len ", c.size(2));
  }

  void linear(const Lin& w, const float* x, int64_t M, float* y, const Path& path) {
    if (w.kind == kF32)
      f32mm::mm(x, M, w.K, w.data.data_ptr<float>(), w.N, y, default_isa(), pool());
    else
      mm_into(x, M, w.K, w.data.data_ptr<uint8_t>(), w.N, w.kind, path, y);
    add_bias(w, M, y);
  }

  // Linear on its prepared input, plus the bias: the codes in act_q_ (its M rows already quantized), or for a
  // float32 weight the float rows xf (M, K) (what the row passes wrote through emit()).
  void linear_q(const Lin& w, int64_t M, float* y, const Path& path, const float* xf = nullptr) {
    if (w.kind == kF32) return linear(w, xf, M, y, path);
    mm_act(act_q_.view(), w.data.data_ptr<uint8_t>(), w.N, w.kind, path, y);
    add_bias(w, M, y);
  }

  // Row m of the next linear's input (n floats at t): quantized into act_q_, or kept as floats in af_ (kF32).
  void emit(int kind, const float* t, int64_t m, int64_t n) {
    if (kind == kF32)
      std::memcpy(&af_[m * n], t, n * sizeof(float));
    else
      act_q_.quantize_row(t, m);
  }

  static void add_bias(const Lin& w, int64_t M, float* y) {
    if (w.bias.numel() == 0) return;
    const float* b = w.bias.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < w.N; ++n) y[m * w.N + n] = y[m * w.N + n] + b[n];
  }

  // Row m: optionally x += h (the residual of the linear before), then RMSNorm with weight w, handed to the next
  // linear (of kind `kind`) through emit(): quantized into act_q_ (prepared for (M, H)), or as floats into af_.
  // post (Gemma's sandwich norm): the weights of an RMSNorm applied to h's row (in place) before it is added.
  void residual_norm_quant(int64_t m, bool residual, const float* w, int isa, int kind, const float* post = nullptr) {
    float* xr = &x_[m * H_];
    if (residual) {
      float* hr = &h_[m * H_];
      if (post != nullptr) rmsnorm_n(hr, post, hr, H_, isa);
      for (int64_t i = 0; i < H_; ++i) xr[i] = xr[i] + hr[i];
    }
    float* t = row_scratch(H_);
    rmsnorm(xr, w, t, 1, isa);
    emit(kind, t, m, H_);
  }

  void rmsnorm(const float* x, const float* w, float* y, int64_t M, int isa) const {
    for (int64_t m = 0; m < M; ++m) rmsnorm_n(x + m * H_, w, y + m * H_, H_, isa);
  }
  // One n-float row (y may be x: every element is read before it is written).
  void rmsnorm_n(const float* x, const float* w, float* y, int64_t n, int isa) const {
    const float ss = dot_isa(isa, x, x, (int)n);
    const float r = 1.f / std::sqrt(ss / (float)n + eps_);
    for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
  }

  // The local layers' allowed slots (Gemma's sliding window): each row's allowed list (causal or its mask's)
  // without the keys at positions <= p - window. Returns false (nothing built) when every row's window covers
  // position 0, so the local layers attend like the others.
  bool window_lists(int64_t S, const std::vector<int64_t>& row0, const std::vector<int64_t>& seg_start,
                    const int64_t* pos) {
    const int64_t M = row0[S];
    bool any = false;
    for (int64_t m = 0; m < M && !any; ++m) any = pos[m] >= window_;
    if (!any) return false;
    widx_.clear();
    woff_.assign(M + 1, 0);
    wcnt_.assign(M, 0);
    wcontig_.assign(M, 0);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t st = seg_start[s];
      for (int64_t r = row0[s]; r < row0[s + 1]; ++r) {
        const int64_t lo = pos[r] - window_;  // keys at positions <= lo are out of the window
        woff_[r] = (int64_t)widx_.size();
        auto keep = [&](int64_t j) {
          const int64_t kp = j < st ? j : pos[row0[s] + (j - st)];
          if (kp > lo) widx_.push_back((int32_t)j);
        };
        if (causal_[r])  // prefix slots hold their own positions: the window starts at slot lo + 1
          for (int64_t j = std::clamp<int64_t>(lo + 1, 0, st); j < cnt_[r]; ++j) keep(j);
        else
          for (int64_t i = 0; i < cnt_[r]; ++i) keep(idx_[off_[r] + i]);
        wcnt_[r] = (int64_t)widx_.size() - woff_[r];
        int64_t c = 0;  // leading ranks that are the slots 0, 1, ... (only when the window still covers slot 0)
        while (c < wcnt_[r] && widx_[woff_[r] + c] == c) ++c;
        wcontig_[r] = c;
      }
    }
    return true;
  }

  // Queries ordered (segment, kv head, row, head of the group); one attn::Group per (segment, kv head),
  // so a kv head's keys/values are read once for all its queries (see attn_sched.h).
  void attention(int64_t l, int64_t S, const std::vector<int64_t>& row0,
                 const std::vector<std::vector<torch::Tensor>>& seg_k,
                 const std::vector<std::vector<torch::Tensor>>& seg_v, int isa, bool windowed = false) {
    const int64_t qkvN = (nh_ + 2 * nkv_) * hd_, group = nh_ / nkv_;
    aq_.clear();
    ag_.clear();
    for (int64_t s = 0; s < S; ++s) {
      const bool half = seg_k[s][l].scalar_type() == torch::kHalf;
      const int64_t es = half ? 2 : 4;  // element bytes
      const char* kc = (const char*)seg_k[s][l].data_ptr();
      const char* vc = (const char*)seg_v[s][l].data_ptr();
      const int64_t cap = seg_k[s][l].size(2);
      for (int64_t g = 0; g < nkv_; ++g) {
        const int q0 = (int)aq_.size();
        for (int64_t r = row0[s]; r < row0[s + 1]; ++r)
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            if (windowed)  // explicit lists, also for causal rows
              aq_.push_back({&qkv_[r * qkvN + h * hd_], widx_.data() + woff_[r], (int)wcnt_[r], (int)wcontig_[r],
                             &att_[(r * nh_ + h) * hd_]});
            else
              aq_.push_back({&qkv_[r * qkvN + h * hd_], causal_[r] ? nullptr : idx_.data() + off_[r],
                             (int)cnt_[r], (int)contig_[r], &att_[(r * nh_ + h) * hd_]});
          }
        ag_.push_back({kc + g * cap * hd_ * es, vc + g * cap * hd_ * es, hd_, hd_, q0, (int)aq_.size(), half});
      }
    }
    runner_.run(isa, ag_, aq_, (int)hd_, scale_, pool(), bf16_scores_);
  }

  int64_t H_, nh_, nkv_, hd_, I_;
  float eps_, scale_;
  torch::Tensor embed_, inv_freq_, final_norm_;
  std::vector<LayerW> layers_;
  Lin lm_, fc_;
  bool has_lm_ = false, has_fc_ = false;
  torch::Tensor emb_norm_, feat_norm_;
  // layer options (set_variant)
  bool gelu_ = false, windowed_ = false;
  float embed_scale_ = 0.f;  // 0: none
  int64_t window_ = 0;
  std::vector<torch::Tensor> qk_norms_, post_norms_;
  torch::Tensor inv_local_;
  std::vector<char> local_;
  // scratch, reused across calls (one forward at a time per decoder), on 64-byte lines: the fp32 linears read their
  // input rows (af_, att_) with 64-byte loads, which malloc's 16-byte alignment may split across two cache lines
  // (kernels/f32mm.h alone with its input 16 bytes off a line: 8 / 16 rows 18 -> 22 / 31 -> 40 ms, Zen 4). The
  // model's step measured the same both ways in session 33 (its buffers may have landed on lines by chance); this
  // makes it so.
  template <class T>
  struct Lines {  // std::allocator on 64-byte boundaries
    using value_type = T;
    Lines() = default;
    template <class U>
    Lines(const Lines<U>&) {}
    T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
    void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <class U>
    bool operator==(const Lines<U>&) const { return true; }
    template <class U>
    bool operator!=(const Lines<U>&) const { return false; }
  };
  std::vector<float, Lines<float>> x_, h_, qkv_, att_, ff_, cs_, cs_local_, cat_, af_;
  std::vector<int32_t> idx_, widx_;
  std::vector<int64_t> off_, cnt_, contig_, seg_of_, woff_, wcnt_, wcontig_;
  ActBuf act_q_;  // the codes of the next linear's input (block-major, see mm_core.h)
  std::vector<attn::Query> aq_;
  std::vector<attn::Group> ag_;
  attn::Runner runner_;
  bool profile_ = false;
  bool bf16_scores_ = false;
  std::array<int64_t, 7> prof_{};
  std::chrono::steady_clock::time_point last_;
  std::vector<char> causal_;
};

}  // namespace td
