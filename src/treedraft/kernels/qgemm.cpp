// treedraft quantized CPU GEMM: y (M, N) = x (M, K) @ W^T for Q4_1 / Q8_0 weights packed by
// treedraft.kernels. Algorithm after llama.cpp's ggml-cpu (quantize activations to int8 per
// 32-block, integer dot products, one fp32 scale update per block); code and layout are our own.
// Built JIT by treedraft/kernels/__init__.py with torch.utils.cpp_extension.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attn.h"
#include "attn_sched.h"
#include "f32mm.h"
#include "fused.h"
#include "mm_core.h"
#include "sample.h"
#include "topk.h"

namespace td {

// One native call at a time per process: the thread pool (g_pool), its settings and each FusedDecoder's
// scratch serve one caller. The calls below release the GIL while they compute (so the server's event
// loop, HTTP streaming and detokenizing run meanwhile) and take this lock instead, after the release: a
// thread waiting for it never holds the GIL, so a forward in flight never blocks Python code.
std::mutex& native_mutex() {
  static std::mutex mu;
  return mu;
}

// Run f() without the GIL, under native_mutex(); the GIL is back before the result reaches Python.
template <class F>
auto serialized(F&& f) -> decltype(f()) {
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lk(native_mutex());
  return f();
}

torch::Tensor mm(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t kind,
                 const std::string& path_name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "qgemm.mm: x must be a contiguous float32 (M, K) tensor");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "qgemm.mm: packed weight must be contiguous uint8");
  TORCH_CHECK(kind == kQ4_1 || kind == kQ8_0, "qgemm.mm: kind must be 0 (Q4_1) or 1 (Q8_0)");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kQK == 0, "qgemm.mm: K=", K, " is not a multiple of 32");
  const int64_t T = (N + kTile - 1) / kTile, B = K / kQK;
  const int64_t blk = kind == kQ4_1 ? kQ41Bytes : kQ80Bytes;
  TORCH_CHECK(packed.numel() == T * B * blk, "qgemm.mm: packed weight has ", packed.numel(),
              " bytes, expected ", T * B * blk, " for N=", N, ", K=", K,
              " (was it packed for another K?)");
  const Path& path = pick_path(path_name);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  mm_into(x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), N, (int)kind, path,
          y.data_ptr<float>());
  return y;
}

// y (M, N) = x (M, K) @ w (N, K)^T in float32, every row computed the same way whatever M (f32mm.h).
// path: "" = the best compiled ISA, or "avx512" / "avx2" / "scalar" (tests: every path gives the same bits).
torch::Tensor mm_f32(torch::Tensor x, torch::Tensor w, const std::string& path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "qgemm.mm_f32: x must be a contiguous float32 CPU (M, K) tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.device().is_cpu(),
              "qgemm.mm_f32: w must be a contiguous float32 CPU (N, K) tensor");
  TORCH_CHECK(x.size(1) == w.size(1), "qgemm.mm_f32: x has K=", x.size(1), ", w has K=", w.size(1));
  int isa = default_isa();
  if (path == "scalar") isa = attn::kScalar;
  else if (path == "avx2") isa = std::min(isa, (int)attn::kAvx2);
  else TORCH_CHECK(path.empty() || path == "avx512", "qgemm.mm_f32: unknown path ", path);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  f32mm::mm(x.data_ptr<float>(), M, K, w.data_ptr<float>(), N, y.data_ptr<float>(), isa, pool());
  return y;
}

// The GEMM's activation quantization of x (M, K) float32 (K a multiple of 32), as the kernels see it:
// codes (B, M, 32) int8, scales d (B, M) and s = d * sum(codes) (B, M) float32, B = K / 32.
std::vector<torch::Tensor> quantize_act(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "qgemm.quantize: x must be a contiguous float32 (M, K) tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kQK == 0, "qgemm.quantize: K=", K, " is not a multiple of 32");
  ActBuf buf;
  quantize_rows(x.data_ptr<float>(), M, K, buf);
  const int64_t B = K / kQK;
  auto q = torch::empty({B, M, kQK}, torch::kInt8);
  auto d = torch::empty({B, M}, torch::kFloat32), s = torch::empty({B, M}, torch::kFloat32);
  std::memcpy(q.data_ptr<int8_t>(), buf.q.data(), M * K);
  std::memcpy(d.data_ptr<float>(), buf.d.data(), M * B * sizeof(float));
  std::memcpy(s.data_ptr<float>(), buf.s.data(), M * B * sizeof(float));
  return {q, d, s};
}

// Read bandwidth (GB/s) of the GEMM's thread pool streaming `buf` (see read_probe), best of reps.
double read_bandwidth(torch::Tensor buf, int64_t reps) {
  TORCH_CHECK(buf.scalar_type() == torch::kUInt8 && buf.is_contiguous() && buf.numel() > 0,
              "read_bandwidth: buf must be a non-empty contiguous uint8 tensor");
  TORCH_CHECK(reps >= 1, "read_bandwidth: reps must be >= 1");
  int64_t sink = 0;
  const double s = read_probe(buf.data_ptr<uint8_t>(), buf.numel(), (int)reps, &sink);
  volatile int64_t keep = sink;
  (void)keep;
  return (double)buf.numel() / s / 1e9;
}

// Matmul tunables that change no result bit (common.h): prefetch distance (bytes, 0 = none) and the
// smallest work unit (weight bytes); a negative argument keeps the current value. Returns both.
std::vector<int64_t> set_tuning(int64_t prefetch_bytes, int64_t unit_bytes) {
  TORCH_CHECK(prefetch_bytes <= (1 << 20) && unit_bytes <= (int64_t)1 << 30,
              "qgemm.set_tuning: prefetch_bytes <= 1 MB and unit_bytes <= 1 GB");
  if (prefetch_bytes >= 0) g_prefetch_ahead = (int)(prefetch_bytes / 64 * 64);
  if (unit_bytes >= 0) g_unit_bytes = std::max<int64_t>(1, unit_bytes);
  return {g_prefetch_ahead, g_unit_bytes};
}

std::vector<std::string> paths() {
  std::vector<std::string> out;
  for (const auto& p : compiled_paths()) out.push_back(p.name);
  return out;
}

void set_num_threads(int64_t n) {
  TORCH_CHECK(n >= 1, "qgemm.set_num_threads: need n >= 1, got ", n);
  g_threads = (int)n;
}

int64_t get_num_threads() { return g_threads; }

void set_spin_us(int64_t us) {
  TORCH_CHECK(us >= 0 && us <= 10000000, "qgemm.set_spin_us: need 0 <= us <= 10^7");
  g_spin_us = (int)us;
  g_pool.reset();  // re-created with the new setting at the next call
}

int64_t pool_asleep() { return g_pool ? g_pool->asleep() : -1; }

void set_yield_us(int64_t us) {
  TORCH_CHECK(us >= 0 && us <= 10000000, "qgemm.set_yield_us: need 0 <= us <= 10^7");
  g_yield_us = (int)us;
  g_pool.reset();
}

// Row-invariant decode attention (see attn.h): q (T, nh, hd) float32, k/v (nkv, L, hd) float32 or float16 with unit
// last stride, allowed bool (T, L) or empty for "all L keys" -> (T, nh, hd).
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor allowed,
                     double scale, const std::string& path_name, bool bf16_scores) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q must be (T, nh, hd), k and v (nkv, L, hd)");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kHalf),
              "attend: q must be float32 and k, v both float32 or both float16");
  const bool half = k.scalar_type() == torch::kHalf;
  const int64_t es = half ? 2 : 4;  // bytes per k/v element
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "attend: the last dimension of q, k and v must be contiguous");
  const int64_t T = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k.size(0), L = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == hd, "attend: k and v must both be (nkv, L, ", hd, ")");
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "attend: nh=", nh, " is not a multiple of nkv=", nkv);
  const bool all = allowed.numel() == 0;
  if (!all)
    TORCH_CHECK(allowed.dim() == 2 && allowed.size(0) == T && allowed.size(1) == L &&
                    allowed.scalar_type() == torch::kBool,
                "attend: allowed must be a bool (T, L) = (", T, ", ", L, ") tensor or None");
  int isa = attn::kScalar;
  if (path_name.empty()) {
#if defined(__AVX512F__)
    isa = attn::kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
    isa = attn::kAvx2;
#endif
  } else if (path_name == "avx512" || path_name == "avx512vnni") {  // attention has no VNNI variant
#if defined(__AVX512F__)
    isa = attn::kAvx512;
#else
    TORCH_CHECK(false, "attend: path 'avx512' is not compiled");
#endif
  } else if (path_name == "avx2") {
#if defined(__AVX2__) && defined(__FMA__)
    isa = attn::kAvx2;
#else
    TORCH_CHECK(false, "attend: path 'avx2' is not compiled");
#endif
  } else {
    TORCH_CHECK(path_name == "scalar", "attend: unknown path '", path_name, "'");
  }
  auto out = torch::empty({T, nh, hd}, q.options());
  if (T == 0 || nh == 0) return out;
  // each row's allowed slots in increasing order
  std::vector<int32_t> idx;
  std::vector<int64_t> off(T + 1, 0);
  if (!all) {
    auto am = allowed.contiguous();
    const bool* ap = am.data_ptr<bool>();
    idx.reserve(T * L);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t s = 0; s < L; ++s)
        if (ap[t * L + s]) idx.push_back((int32_t)s);
      off[t + 1] = (int64_t)idx.size();
    }
  }
  const float* qp = q.data_ptr<float>();
  const char* kp = (const char*)k.data_ptr();
  const char* vp = (const char*)v.data_ptr();
  float* op = out.data_ptr<float>();
  const int64_t group = nh / nkv;
  // queries ordered (kv head, row, head of the group): one attn::Group per kv head (attn_sched.h)
  thread_local std::vector<attn::Query> qs;
  thread_local std::vector<attn::Group> gs;
  thread_local attn::Runner runner;
  qs.clear();
  gs.clear();
  std::vector<int> shared(T, (int)L);
  for (int64_t t = 0; t < T && !all; ++t) {
    int c = 0;
    while (off[t] + c < off[t + 1] && idx[off[t] + c] == c) ++c;
    shared[t] = c;
  }
  for (int64_t g = 0; g < nkv; ++g) {
    const int q0 = (int)qs.size();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        qs.push_back({qp + t * q.stride(0) + h * q.stride(1), all ? nullptr : idx.data() + off[t],
                      all ? (int)L : (int)(off[t + 1] - off[t]), shared[t], op + (t * nh + h) * hd});
    gs.push_back({kp + g * k.stride(0) * es, vp + g * v.stride(0) * es, k.stride(1), v.stride(1), q0, (int)qs.size(),
                  half});
  }
  runner.run(isa, gs, qs, (int)hd, (float)scale, pool(), bf16_scores);
  return out;
}

}  // namespace td

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "treedraft quantized (Q4_1 / Q8_0) CPU GEMM";
  // every entry point that touches the pool, its settings or a decoder's scratch runs td::serialized
  m.def(
      "mm",
      [](torch::Tensor x, torch::Tensor packed, int64_t N, int64_t kind, const std::string& path) {
        return td::serialized([&] { return td::mm(x, packed, N, kind, path); });
      },
      "y = x @ W^T for a packed weight (GIL released)", py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("kind"),
      py::arg("path") = "");
  m.def(
      "mm_f32",
      [](torch::Tensor x, torch::Tensor w, const std::string& path) {
        return td::serialized([&] { return td::mm_f32(x, w, path); });
      },
      "y = x @ w^T in float32, rows computed alike whatever M (GIL released)", py::arg("x"), py::arg("w"),
      py::arg("path") = "");
  m.def(
      "attend",
      [](torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor allowed, double scale,
         const std::string& path, bool bf16_scores) {
        return td::serialized([&] { return td::attend(q, k, v, allowed, scale, path, bf16_scores); });
      },
      "row-invariant decode attention (GIL released); bf16_scores: q.k in bf16 (see bf16_scores_supported)",
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("allowed"), py::arg("scale"), py::arg("path") = "",
      py::arg("bf16_scores") = false);
  m.def(
      "bf16_scores_supported", [] { return td::attn::bf16_scores_supported(); },
      "Whether this build's AVX-512 attention has the bf16 score kernels (AVX512-BF16)");
  m.def(
      "quantize", [](torch::Tensor x) { return td::serialized([&] { return td::quantize_act(x); }); },
      "activation quantization of x (M, K): codes (K/32, M, 32) int8, d and s (K/32, M)", py::arg("x"));
  m.def(
      "read_bandwidth",
      [](torch::Tensor buf, int64_t reps) { return td::serialized([&] { return td::read_bandwidth(buf, reps); }); },
      "GB/s of the pool streaming a uint8 buffer (best of reps)", py::arg("buf"), py::arg("reps") = 5);
  m.def(
      "topk_rows",
      [](torch::Tensor x, int64_t k, bool normalize) {
        TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                    "qgemm.topk_rows: x must be a contiguous float32 (R, V) tensor");
        TORCH_CHECK(k >= 1 && k <= x.size(1), "qgemm.topk_rows: need 1 <= k <= V, got k=", k);
        auto vals = torch::empty({x.size(0), k}, x.options().dtype(torch::kFloat64));
        auto ids = torch::empty({x.size(0), k}, x.options().dtype(torch::kInt64));
        td::topk_rows(x.data_ptr<float>(), x.size(0), x.size(1), k, normalize, vals.data_ptr<double>(),
                      ids.data_ptr<int64_t>());
        return std::make_tuple(vals, ids);
      },
      "each row's k largest entries (ties: lower column first) as (value or its log-softmax in float64, column)",
      py::arg("x"), py::arg("k"), py::arg("normalize"));
  m.def(
      "sample_probs",
      [](torch::Tensor x, double temperature, int64_t top_k, double top_p, double min_p) -> py::object {
        TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                    "qgemm.sample_probs: x must be a contiguous float32 (R, V) tensor");
        TORCH_CHECK(temperature > 0.0, "qgemm.sample_probs: temperature must be > 0");
        auto probs = torch::empty_like(x);
        const bool ok = td::sample_probs_rows(x.data_ptr<float>(), x.size(0), x.size(1), (float)temperature, top_k,
                                              top_p, (float)min_p, probs.data_ptr<float>());
        if (!ok) return py::none();
        return py::cast(probs);
      },
      "each row's sampling distribution (temperature, top-k, top-p, min-p), or None when a row has no finite maximum",
      py::arg("x"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p") = 0.0);
  m.def(
      "sample_draw",
      [](torch::Tensor x, double temperature, int64_t top_k, double top_p, double u, double min_p) {
        TORCH_CHECK(x.dim() == 1 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                    "qgemm.sample_draw: x must be a contiguous float32 (V,) tensor");
        TORCH_CHECK(temperature > 0.0, "qgemm.sample_draw: temperature must be > 0");
        return td::sample_draw_row(x.data_ptr<float>(), x.size(0), (float)temperature, top_k, top_p, (float)min_p, u);
      },
      "the inverse-CDF draw of u from the row's sampling distribution, or -1 when it has no finite maximum",
      py::arg("x"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("u"), py::arg("min_p") = 0.0);
  m.def(
      "gumbel_topk",
      [](torch::Tensor x, double temperature, int64_t top_k, double top_p, double min_p, uint64_t key, int64_t k,
         c10::optional<torch::Tensor> cols) -> py::object {
        TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                    "qgemm.gumbel_topk: x must be a contiguous float32 (V,) CPU tensor");
        TORCH_CHECK(temperature > 0.0, "qgemm.gumbel_topk: temperature must be > 0");
        TORCH_CHECK(k >= 1 && k <= x.size(0), "qgemm.gumbel_topk: need 1 <= k <= V, got k=", k);
        const int64_t* cp = nullptr;
        if (cols.has_value()) {
          TORCH_CHECK(cols->device().is_cpu() && cols->dim() == 1 && cols->scalar_type() == torch::kInt64 &&
                          cols->is_contiguous() && cols->size(0) == x.size(0),
                      "qgemm.gumbel_topk: cols must be a contiguous int64 CPU tensor of x's length");
          cp = cols->data_ptr<int64_t>();
        }
        auto ids = torch::empty({k}, torch::kInt64);
        auto scores = torch::empty({k}, torch::kFloat64);
        const int64_t n = td::gumbel_topk_row(x.data_ptr<float>(), x.size(0), cp, (float)temperature, top_k, top_p,
                                              (float)min_p, key, k, ids.data_ptr<int64_t>(), scores.data_ptr<double>());
        if (n < 0) return py::none();
        return py::cast(std::make_tuple(ids.narrow(0, 0, n), scores.narrow(0, 0, n)));
      },
      "the k kept tokens with the largest (z - max z) + Gumbel noise keyed by (key, token id), best first, as "
      "(columns, scores); None when the row has no finite maximum",
      py::arg("x"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("key"),
      py::arg("k"), py::arg("cols") = py::none());
  m.def("paths", &td::paths, "compiled code paths, fastest first");
  m.def(
      "set_tuning",
      [](int64_t pf, int64_t unit) { return td::serialized([&] { return td::set_tuning(pf, unit); }); },
      "prefetch distance and smallest work unit in bytes (-1: keep); both now", py::arg("prefetch_bytes") = -1,
      py::arg("unit_bytes") = -1);
  m.def(
      "set_num_threads", [](int64_t n) { td::serialized([&] { td::set_num_threads(n); }); },
      "threads used by mm (caller included)");
  m.def("get_num_threads", &td::get_num_threads, "threads used by mm");
  // module_local: two builds of this extension (e.g. benchmarks/mm_ab.py's baseline) can share a process
  py::class_<td::FusedDecoder>(m, "FusedDecoder", py::module_local(), "one native call per decode forward (fused.h)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor,
                    std::vector<torch::Tensor>, std::vector<int64_t>, torch::Tensor, torch::Tensor, torch::Tensor,
                    int64_t, int64_t>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("inter"),
           py::arg("eps"), py::arg("attn_scale"), py::arg("embed"), py::arg("inv_freq"), py::arg("layers"),
           py::arg("kinds"), py::arg("final_norm"), py::arg("lm_head"), py::arg("lm_head_bias"),
           py::arg("lm_head_kind"), py::arg("vocab"))
      .def("num_layers", &td::FusedDecoder::num_layers)
      .def(
          "set_profile", [](td::FusedDecoder& self, bool on) { td::serialized([&] { self.set_profile(on); }); },
          "time the phases of each forward")
      .def(
          "set_bf16_scores",
          [](td::FusedDecoder& self, bool on) { td::serialized([&] { self.set_bf16_scores(on); }); },
          "attention scores in bf16 (exact across row counts, not equal to float32 scores)")
      .def(
          "take_timings", [](td::FusedDecoder& self) { return td::serialized([&] { return self.take_timings(); }); },
          "ms per phase since the last call: other, qkv, attention, wo, w13, w2, lm_head")
      .def(
          "take_quant_timing",
          [](td::FusedDecoder& self) { return td::serialized([&] { return self.take_quant_timing(); }); },
          "ms of the linear phases spent quantizing activations since the last call")
      // releases the GIL while it computes; td::native_mutex() keeps the pool and the scratch to one caller
      .def(
          "forward",
          [](td::FusedDecoder& self, torch::Tensor tokens, torch::Tensor positions, std::vector<int64_t> seg_rows,
             std::vector<int64_t> seg_start, std::vector<std::vector<torch::Tensor>> seg_k,
             std::vector<std::vector<torch::Tensor>> seg_v, std::vector<torch::Tensor> seg_mask,
             std::optional<torch::Tensor> logit_rows, bool want_logits, std::optional<torch::Tensor> features) {
            return td::serialized([&] {
              return self.forward(tokens, positions, std::move(seg_rows), std::move(seg_start), std::move(seg_k),
                                  std::move(seg_v), std::move(seg_mask), logit_rows, want_logits, features);
            });
          },
          py::arg("tokens"), py::arg("positions"), py::arg("seg_rows"), py::arg("seg_start"), py::arg("seg_k"),
          py::arg("seg_v"), py::arg("seg_mask"), py::arg("logit_rows"), py::arg("want_logits"),
          py::arg("features") = py::none())
      .def(
          "set_eagle_input",
          [](td::FusedDecoder& self, torch::Tensor emb_norm, torch::Tensor feat_norm, torch::Tensor fc,
             torch::Tensor fc_bias, int64_t fc_kind) {
            td::serialized([&] { self.set_eagle_input(emb_norm, feat_norm, fc, fc_bias, fc_kind); });
          },
          "EAGLE draft layer input: forward(features=f) feeds fc([emb_norm(embed(tok)); feat_norm(f)])",
          py::arg("emb_norm"), py::arg("feat_norm"), py::arg("fc"), py::arg("fc_bias"), py::arg("fc_kind"))
      .def(
          "set_variant",
          [](td::FusedDecoder& self, double embed_scale, std::vector<torch::Tensor> qk_norms,
             std::vector<torch::Tensor> post_norms, torch::Tensor inv_freq_local, std::vector<int64_t> local,
             int64_t window, bool gelu) {
            td::serialized(
                [&] { self.set_variant(embed_scale, qk_norms, post_norms, inv_freq_local, local, window, gelu); });
          },
          "layer options beyond Llama's: embedding scale, q/k head norms, sandwich norms, GELU gate, local layers' "
          "window and RoPE (Gemma 3, Qwen3)",
          py::arg("embed_scale"), py::arg("qk_norms"), py::arg("post_norms"), py::arg("inv_freq_local"),
          py::arg("local"), py::arg("window"), py::arg("gelu"));
  m.def(
      "set_attn_block_gemm", [](bool on) { td::serialized([&] { td::attn::g_block_gemm = on; }); },
      "AVX-512 attention: shared key chunks as per-block GEMMs (True) or chunk by chunk (same bits; for timing)");
  m.def(
      "set_attn_widen_keys", [](bool on) { td::serialized([&] { td::attn::g_widen_keys = on; }); },
      "AVX-512 attention: widen an fp16 block's keys once per chunk before the score pass from 36 queries on (True) "
      "or once per query pair (same bits; for timing)");
  m.def(
      "q4_pair_supported", [] { return td::pick_path("").q4_1_pair != nullptr; },
      "Whether the default code path has the 32-column Q4_1 kernel (AVX-512 VNNI builds)");
  m.def(
      "set_q4_pair", [](bool on) { td::serialized([&] { td::g_q4_pair = on; }); },
      "Q4_1 GEMM: full tiles in pairs through the path's 32-column kernel where it has one (True) or one by one "
      "(same bits; for timing)");
  m.def(
      "set_row_pass_blocks",
      [](int64_t n) {
        return td::serialized([&] {
          TORCH_CHECK(n >= 0, "qgemm.set_row_pass_blocks: need n >= 0");
          const int64_t old = td::g_par_blocks;
          td::g_par_blocks = n;
          return old;
        });
      },
      "smallest row pass (in 32-blocks of all rows) run over the pool; returns the previous value (same bits)");
  m.def(
      "set_spin_us", [](int64_t us) { td::serialized([&] { td::set_spin_us(us); }); },
      "how long idle workers spin (pause) before polling with sched_yield");
  m.def(
      "set_yield_us", [](int64_t us) { td::serialized([&] { td::set_yield_us(us); }); },
      "how long idle workers then poll with sched_yield before sleeping");
  m.def("pool_asleep", &td::pool_asleep, "workers of the pool asleep now (-1: no pool yet)");
}
