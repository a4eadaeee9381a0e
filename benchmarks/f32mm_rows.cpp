// The fp32 GEMM (kernels/f32mm.h) over SmolLM2-135M's linear shapes, per row count: ms for one forward's worth of
// linears (30 layers of q|k|v 960x576, o 576x576, gate|up 3072x576, down 576x1536, and the 49152x576 lm_head), each
// weight its own buffer so they stream from memory as in the model, 2 pool threads, best of 9. To compare two
// versions of the kernel, build this against each checkout (-I<checkout>/src/treedraft/kernels) and run them in
// alternation; session 34's row groups (benchmarks/results/session34.md) were measured that way.
//
//   g++ -O3 -march=native -ffp-contract=off -std=c++17 -pthread -Isrc/treedraft/kernels \
//       benchmarks/f32mm_rows.cpp -o /tmp/f32mm_rows && /tmp/f32mm_rows [avx512|avx2] [rows...]
// (-march=znver3 builds the AVX2-only kernel that a Zen 3 EPYC compiles for itself.)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "f32mm.h"

using namespace td;

static float* aligned_floats(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, ((n * 4 + 63) / 64) * 64) != 0) std::abort();
  return static_cast<float*>(p);
}

int main(int argc, char** argv) {
  int isa = attn::kAvx512;
  int first = 1;
  if (argc > 1 && std::strcmp(argv[1], "avx2") == 0) isa = attn::kAvx2, first = 2;
  else if (argc > 1 && std::strcmp(argv[1], "avx512") == 0) first = 2;
  std::vector<int> rows;
  for (int i = first; i < argc; ++i) rows.push_back(std::atoi(argv[i]));
  if (rows.empty())
    for (int m = 1; m <= 16; ++m) rows.push_back(m);
  Pool pool(2, 50);
  struct Shape { int N, K, copies; };
  const Shape shapes[] = {{960, 576, 30}, {576, 576, 30}, {3072, 576, 30}, {576, 1536, 30}, {49152, 576, 1}};
  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float*>> ws;
  for (const Shape& s : shapes) {
    ws.emplace_back();
    for (int c = 0; c < s.copies; ++c) {
      const size_t n = (size_t)s.N * s.K;
      float* w = aligned_floats(n);
      for (size_t i = 0; i < n; ++i) w[i] = nd(rng);
      ws.back().push_back(w);
    }
  }
  for (int M : rows) {
    double total = 0;
    for (size_t s = 0; s < ws.size(); ++s) {
      const Shape& sh = shapes[s];
      float* x = aligned_floats((size_t)M * sh.K);
      float* y = aligned_floats((size_t)M * sh.N);
      for (int i = 0; i < M * sh.K; ++i) x[i] = nd(rng);
      double best = 1e9;
      for (int it = 0; it < 9; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        for (float* w : ws[s]) f32mm::mm(x, M, sh.K, w, sh.N, y, isa, pool);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      total += best;
      std::free(x);
      std::free(y);
    }
    std::printf("rows %2d: %.2f ms\n", M, total * 1e3);
  }
}
