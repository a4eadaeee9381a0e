// treedraft quantized CPU GEMM: y (M, N) = x (M, K) @ W^T for Q4_1 / Q8_0 weights packed by
// treedraft.kernels. Algorithm after llama.cpp's ggml-cpu (quantize activations to int8 per
// 32-block, integer dot products, one fp32 scale update per block); code and layout are our own.
// Built JIT by treedraft/kernels/__init__.py with torch.utils.cpp_extension.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "attn.h"
#include "common.h"
#include "kern_avx2.h"
#include "kern_avx512.h"
#include "kern_scalar.h"
#include "pool.h"

namespace td {
namespace {

enum Kind { kQ4_1 = 0, kQ8_0 = 1 };

struct Path {
  const char* name;
  TileFn q4_1;
  TileFn q8_0;
  int row_block;
};

std::vector<Path> compiled_paths() {
  std::vector<Path> p;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  p.push_back({"avx512", tile_q4_1_avx512, tile_q8_0_avx512, kRowBlockAvx512});
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  p.push_back({"avx2", tile_q4_1_avx2, tile_q8_0_avx2, kRowBlockAvx2});
#endif
  p.push_back({"scalar", tile_q4_1_scalar, tile_q8_0_scalar, 4});
  return p;
}

int g_threads = 1;
int g_spin_us = 100;
std::unique_ptr<Pool> g_pool;

Pool& pool() {
  if (g_pool && g_pool->pid() != getpid()) {
    (void)g_pool.release();  // forked child: the parent's threads do not exist here; leak it
  }
  if (!g_pool || g_pool->size() != g_threads) {
    g_pool.reset();
    g_pool = std::make_unique<Pool>(g_threads, g_spin_us);
  }
  return *g_pool;
}

// Quantize one row's block of 32 floats. Identical arithmetic on every path (IEEE division,
// multiply, round-to-nearest-even), so a row's codes never depend on the path or the batch.
inline void quantize_block(const float* x, int8_t* q, float* d_out, float* s_out) {
#if defined(__AVX512F__)
  const __m512 a0 = _mm512_loadu_ps(x), a1 = _mm512_loadu_ps(x + 16);
  const float amax =
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m512 vid = _mm512_set1_ps(id), lim = _mm512_set1_ps(127.f);
  const __m512 r0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(a0, vid),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
  const __m512 r1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(a1, vid),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
  const __m512i i0 = _mm512_cvtps_epi32(r0), i1 = _mm512_cvtps_epi32(r1);
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(i0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(i1));
  const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
  float amax = 0.f;
  for (int k = 0; k < kQK; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int k = 0; k < kQK; ++k) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[k] * id)));
    q[k] = (int8_t)v;
    sum += (int)v;
  }
#endif
  *d_out = d;
  *s_out = d * (float)sum;
}

struct ActBuf {
  std::vector<int8_t> q;
  std::vector<int16_t> q16;
  std::vector<float> d, s;
};

// Validate the call; returns the tile function of the requested path.
const Path& pick_path(const std::string& name) {
  static const std::vector<Path> paths = compiled_paths();
  if (name.empty()) return paths.front();
  for (const auto& p : paths)
    if (name == p.name) return p;
  TORCH_CHECK(false, "treedraft qgemm: unknown or uncompiled path '", name, "'");
}

}  // namespace

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

  thread_local ActBuf buf;
  buf.q.resize(M * K);
  buf.d.resize(M * B);
  buf.s.resize(M * B);
  const float* xp = x.data_ptr<float>();
  // block-major (B, M, 32) codes so a kernel finds the rows of one block at constant offsets
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b)
      quantize_block(xp + m * K + b * kQK, buf.q.data() + (b * M + m) * kQK,
                     buf.d.data() + b * M + m, buf.s.data() + b * M + m);
  Act a;
  a.M = (int)M;
  a.K = (int)K;
  a.B = (int)B;
  a.q = buf.q.data();
  a.d = buf.d.data();
  a.s = buf.s.data();
  if (kind == kQ8_0) {
    buf.q16.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) buf.q16[i] = buf.q[i];
    a.q16 = buf.q16.data();
  }

  const TileFn fn = kind == kQ4_1 ? path.q4_1 : path.q8_0;
  const int rbmax = path.row_block;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  Pool& pl = pool();
  // ~8 units per thread so a descheduled worker holds up little; at least one tile per unit
  const int64_t units = std::min<int64_t>({T, (int64_t)pl.size() * 8, Pool::kMaxUnits});
  const int64_t per = (T + units - 1) / units;
  const int64_t nunits = (T + per - 1) / per;
  auto work = [&](int u) {
    const int64_t t1 = std::min(T, (u + 1) * per);
    for (int64_t t = u * per; t < t1; ++t) {
      const uint8_t* w = wp + t * B * blk;
      const int ncols = (int)std::min<int64_t>(kTile, N - t * kTile);
      for (int64_t r = 0; r < M; r += rbmax)
        fn(w, a, (int)r, (int)std::min<int64_t>(rbmax, M - r), yp + t * kTile, (int)N, ncols);
    }
  };
  pl.run(work, (int)nunits);
  return y;
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
  TORCH_CHECK(us >= 0, "qgemm.set_spin_us: need us >= 0");
  g_spin_us = (int)us;
  g_pool.reset();  // re-created with the new setting at the next call
}

// Row-invariant decode attention (see attn.h): q (T, nh, hd), k/v (nkv, L, hd) float32 with unit
// last stride, allowed bool (T, L) or empty for "all L keys" -> (T, nh, hd).
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor allowed,
                     double scale, const std::string& path_name) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q must be (T, nh, hd), k and v (nkv, L, hd)");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32, "attend: q, k and v must be float32");
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
  } else if (path_name == "avx512") {
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
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = nh / nkv;
  const float sc = (float)scale;
  auto work = [&](int u) {
    const int64_t t = u / nh, h = u % nh, g = h / group;
    const int32_t* ix = all ? nullptr : idx.data() + off[t];
    const int n = all ? (int)L : (int)(off[t + 1] - off[t]);
    const float* qr = qp + t * q.stride(0) + h * q.stride(1);
    const float* kr = kp + g * k.stride(0);
    const float* vr = vp + g * v.stride(0);
    float* o = op + (t * nh + h) * hd;
    if (isa == attn::kAvx512) attn::attend_one<attn::kAvx512>(qr, kr, k.stride(1), vr, v.stride(1), ix, n, hd, sc, o);
    else if (isa == attn::kAvx2) attn::attend_one<attn::kAvx2>(qr, kr, k.stride(1), vr, v.stride(1), ix, n, hd, sc, o);
    else attn::attend_one<attn::kScalar>(qr, kr, k.stride(1), vr, v.stride(1), ix, n, hd, sc, o);
  };
  TORCH_CHECK(T * nh <= Pool::kMaxUnits, "attend: too many (row, head) pairs");
  pool().run(work, (int)(T * nh));
  return out;
}

}  // namespace td

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "treedraft quantized (Q4_1 / Q8_0) CPU GEMM";
  m.def("mm", &td::mm, "y = x @ W^T for a packed weight", py::arg("x"), py::arg("packed"),
        py::arg("N"), py::arg("kind"), py::arg("path") = "");
  m.def("attend", &td::attend, "row-invariant decode attention", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("allowed"), py::arg("scale"), py::arg("path") = "");
  m.def("paths", &td::paths, "compiled code paths, fastest first");
  m.def("set_num_threads", &td::set_num_threads, "threads used by mm (caller included)");
  m.def("get_num_threads", &td::get_num_threads, "threads used by mm");
  m.def("set_spin_us", &td::set_spin_us, "how long idle workers spin before sleeping");
}
