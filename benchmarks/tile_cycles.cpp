// Cycles per (row, 16-column x 32-k block) of the AVX-512 tile kernels on cache-resident data, one
// thread, min over 30 repetitions (robust on a shared machine): the in-kernel cost that multi-row
// (tree) steps pay, without the thread pool, activation quantization or memory streaming.
// "cycles" assume a 2.0 GHz TSC (steady_clock seconds * 2e9). Build and run from the repo root:
//   g++ -O3 -march=native -ffp-contract=off -std=c++17 -Isrc -DKERN='"treedraft/kernels/kern_avx512.h"' \
//       -DFN41=tile_q4_1_avx512 -DFN80=tile_q8_0_avx512 -DRBMAX=16 benchmarks/tile_cycles.cpp -o /tmp/tile_cycles
//   /tmp/tile_cycles 16        # 16 tiles (256 columns), K = 576
// Point KERN at an older copy of the header to compare (same packed layout), run both interleaved.

#include <cstdio>
#include <vector>
#include <chrono>
#include <random>
#include <cmath>
#include <algorithm>
#include KERN
using namespace td;
int main(int argc, char** argv){
  int K = 576, T = argc>1? atoi(argv[1]) : 8; // tiles
  int B = K/32;
  std::mt19937 g(1);
  std::vector<uint8_t> w41(T*B*kQ41Bytes), w80(T*B*kQ80Bytes);
  for(auto& v: w41) v=g(); for(auto& v: w80) v=g();
  // sane fp16 scales
  for(int t=0;t<T*B;t++){ uint16_t* d=(uint16_t*)(w41.data()+t*kQ41Bytes+256); for(int i=0;i<32;i++) d[i]=0x2000+(g()&0xff);
    uint16_t* e=(uint16_t*)(w80.data()+t*kQ80Bytes+512); for(int i=0;i<16;i++) e[i]=0x2000+(g()&0xff);}
  for(int M: {1,2,4,8,12,16}){
    std::vector<int8_t> q(M*K); std::vector<float> d(M*B), s(M*B), out(M*T*16);
    for(int i=0;i<M*K;i++){ q[i]=(int8_t)((int)(g()%255)-127); }
    for(auto& v: d) v=0.01f; for(auto& v: s) v=0.1f;
    Act a; a.M=M; a.K=K; a.B=B; a.q=q.data(); a.d=d.data(); a.s=s.data();
    for(int kind=0;kind<2;kind++){
      double best=1e9;
      for(int rep=0;rep<30;rep++){
        auto t0=std::chrono::steady_clock::now();
        for(int it=0;it<20;it++) for(int t=0;t<T;t++){
          if(kind==0) for(int r=0;r<M;r+=RBMAX) FN41(w41.data()+t*B*kQ41Bytes, a, r, std::min(RBMAX,M-r), out.data()+t*16, T*16, 16);
          else for(int r=0;r<M;r+=RBMAX) FN80(w80.data()+t*B*kQ80Bytes, a, r, std::min(RBMAX,M-r), out.data()+t*16, T*16, 16);
        }
        best=std::min(best,std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count());
      }
      double cyc = best*2e9/(20.0*T*B);
      printf("%s M=%2d: %6.1f cycles/tile-block, %5.2f per row-block  (sum %g)\n", kind?"q8_0":"q4_1", M, cyc, cyc/M, out[0]);
    }
  }
}
