// The calling thread's CPU time in seconds, for the standalone C++ benchmarks' A/Bs: other processes on a shared
// machine do not count (included as "thread_clock.h" from benchmarks/*.cpp).
#pragma once
#include <time.h>

static inline double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
