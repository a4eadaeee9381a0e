// AMX-INT8 cost probe (session 41, Sapphire-Rapids-class Xeon, 2 vCPUs): ldtilecfg, tile store + vector load,
// one (load A, load B, zero, TDPBSSD, store C) chain, and TDPBSSD latency / throughput at 16 rows x 64 bytes.
// Build and run: gcc -O2 -march=native benchmarks/amx_micro.c -o /tmp/amx_micro && /tmp/amx_micro
// (needs a CPU with amx_tile / amx_int8 and Linux >= 5.16, which hands out the tile state on request).
// Session 41 read: ldtilecfg ~125 ns, a TDPBSSD ~14 ns whether chained or independent (about 2-3x what Intel
// documents), so the tile path of a Q4_1 / Q8_0 block costs ~55 ns at 16 rows: see benchmarks/results/session41.md.
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
struct __attribute__((aligned(64))) cfg { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  volatile struct cfg c; memset((void*)&c, 0, sizeof c); c.palette = 1;
  for (int t=0;t<6;t++){c.colsb[t]=64;c.rows[t]=16;}
  int N=1000000; double t0=now();
  for (int i=0;i<N;i++){ c.rows[0]=16-(i&1); _tile_loadconfig((const void*)&c);}
  printf("ldtilecfg %.1f ns\n",(now()-t0)/N*1e9); c.rows[0]=16; _tile_loadconfig((const void*)&c);
  static int32_t C[16*16] __attribute__((aligned(64))); static int8_t A[16*64] __attribute__((aligned(64)));
  t0=now(); __m512i s=_mm512_setzero_si512();
  for (int i=0;i<N;i++){ _tile_zero(2); _tile_stored(2, C, 64); s=_mm512_add_epi32(s,_mm512_load_si512(C+ (i&15)*16)); }
  printf("zero+store+load chain %.1f ns (%d)\n",(now()-t0)/N*1e9,_mm512_reduce_add_epi32(s));
  t0=now();
  for (int i=0;i<N;i++){ _tile_loadd(0, A, 64); _tile_loadd(1, A, 64); _tile_zero(2); _tile_dpbssd(2,0,1); _tile_stored(2, C, 64);}
  printf("load2+zero+dp+store %.1f ns\n",(now()-t0)/N*1e9);
  t0=now();
  for (int i=0;i<N;i++){ _tile_zero(2); _tile_dpbssd(2,0,1); _tile_zero(5); _tile_dpbssd(5,0,1);_tile_stored(2, C, 64);_tile_stored(5, C, 64);}
  printf("2x(zero+dp+store) %.1f ns\n",(now()-t0)/N*1e9);
  t0=now();
  for (int i=0;i<N;i++){ _tile_dpbssd(2,0,1); }
  printf("dp chain %.1f ns\n",(now()-t0)/N*1e9);
  t0=now();
  for (int i=0;i<N;i++){ _tile_dpbssd(2,0,1); _tile_dpbssd(3,0,1);_tile_dpbssd(4,0,1);_tile_dpbssd(5,0,1);}
  printf("4 dp indep %.1f ns\n",(now()-t0)/N*1e9);
  _tile_release();
}
