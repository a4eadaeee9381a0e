// Q8_0 tile A/B: an older kern_avx512.h (old packed layout, int16-widened activations in Act.q16) against this
// tree's, on the same random bytes (timing only; layouts differ), interleaved, min of 60, one thread,
// cache-resident. Cycles assume a 2.0 GHz TSC. Build and run from the repo root, OLD = a directory holding the
// older kern_avx512.h and common.h (e.g. git show 2952897:src/treedraft/kernels/kern_avx512.h > /tmp/old/...):
//   mkdir -p /tmp/old && for f in kern_avx512.h common.h; do git show 2952897:src/treedraft/kernels/$f > /tmp/old/$f; done
//   g++ -O3 -march=native -ffp-contract=off -std=c++17 -Isrc -I/tmp benchmarks/tile_q8_ab.cpp -o /tmp/tile_q8_ab
//   /tmp/tile_q8_ab 16          # 16 tiles (256 columns), K = 576
#include <cstdio>
#include <vector>
#include <chrono>
#include <random>
#include <algorithm>
#include <cstring>
#include <cstdint>
#include <immintrin.h>
namespace oldk {
#include "old/kern_avx512.h"  // found through -I/tmp
}
#include "treedraft/kernels/kern_avx512.h"
int main(int argc,char**argv){
  using namespace td;
  int K=argc>2?atoi(argv[2]):576,T=argc>1?atoi(argv[1]):16,B=K/32; std::mt19937 g(1);
  std::vector<uint8_t> w(T*B*kQ80Bytes+8192); for(auto&v:w) v=g();
  for(int t=0;t<T*B;t++){uint16_t* e=(uint16_t*)(w.data()+t*kQ80Bytes+512); for(int i=0;i<16;i++) e[i]=0x2000+(g()&0xff);}
  for(int M:{1,2,4,8,16}){
    std::vector<int8_t> q(M*K); std::vector<int16_t> q16(M*K); std::vector<float> d(M*B,0.01f), s(M*B,0.1f), o1(M*T*16), o2(M*T*16);
    for(int i=0;i<M*K;i++){q[i]=(int8_t)((int)(g()%255)-127); q16[i]=q[i];}
    Act a; a.M=M;a.K=K;a.B=B;a.q=q.data();a.d=d.data();a.s=s.data();
    oldk::td::Act ao; ao.M=M;ao.K=K;ao.B=B;ao.q=q.data();ao.q16=q16.data();ao.d=d.data();ao.s=s.data();
    double best[2]={1e9,1e9};
    for(int rep=0;rep<60;rep++) for(int kind=0;kind<2;kind++){
      auto t0=std::chrono::steady_clock::now();
      for(int it=0;it<10;it++) for(int t=0;t<T;t++) for(int r=0;r<M;r+=8){
        if(kind==0) oldk::td::tile_q8_0_avx512(w.data()+t*B*kQ80Bytes,ao,r,std::min(8,M-r),o1.data()+t*16,T*16,16);
        else tile_q8_0_avx512(w.data()+t*B*kQ80Bytes,a,r,std::min(8,M-r),o2.data()+t*16,T*16,16);}
      best[kind]=std::min(best[kind],std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count());
    }
    double c0=best[0]*2e9/(10.0*T*B*M), c1=best[1]*2e9/(10.0*T*B*M);
    printf("M=%2d old %.1f new %.1f cyc/row-block  new/old %.2f\n",M,c0,c1,c1/c0);
  }
}
