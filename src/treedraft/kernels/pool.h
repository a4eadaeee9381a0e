// Small work-sharing thread pool for the quantized GEMM (no OpenMP).
//
// Why not OpenMP: an OpenMP team ends in a barrier that needs every thread to arrive, so one
// worker descheduled by another process on a busy machine stalls the whole call for a time
// slice (the 10-20x stalls of issue 11). Here the caller works too and claims units from one
// atomic counter; a worker that has not woken up simply claims nothing, so the caller only ever
// waits for units a worker has actually started. Idle workers spin briefly (pause), then keep
// polling with sched_yield() for a while (yield_us: the Python work between two decode forwards,
// drafting and acceptance, takes 0.1-1.5 ms), then sleep on a condition variable (passive waiting),
// so they do not keep a core busy between requests. Why the yielding phase: on session 43's KVM
// Xeon a worker that had gone to sleep between two forwards made the next forward ~0.45 ms slower
// (a 1-row step 3.56 vs 3.06 ms; waking the thread and its halted vCPU); polling with sched_yield
// keeps the vCPU running yet gives the core away at once to any other runnable thread (another
// process on a busy machine, the server's own threads), which a pause loop would not.
// The caller, once no unit is left, waits for the units in flight the same way: it spins for
// kDoneSpinUs, then sleeps until the last one finishes. A worker preempted in the middle of a unit
// (another process took its core) then finds the caller's core idle and the kernel moves it
// there, instead of both waiting for the other process's time slice to end.
//
// Units are split into one contiguous region per thread (thread i starts at the front of region
// i), so each thread streams adjacent weight tiles (one hardware-prefetch stream, and the kernels'
// software prefetch lands in the thread's own next unit); a thread whose region is exhausted
// claims from the others' (work stealing), so nobody waits for a slow or descheduled thread's
// unclaimed units. Which thread computes a unit never changes its bits.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <sched.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TD_PAUSE() _mm_pause()
#else
#define TD_PAUSE() ((void)0)
#endif

namespace td {

struct Job {
  std::function<void(int)> fn;  // fn(unit): one work unit; units are independent
  int total = 0;
};

class Pool {
 public:
  explicit Pool(int nthreads, int spin_us, int yield_us = 0)
      : spin_us_(spin_us), yield_us_(yield_us), pid_(getpid()), regions_(std::max(1, nthreads)) {
    for (int i = 1; i < nthreads; ++i) th_.emplace_back([this, i] { worker(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : th_) t.join();
  }
  int size() const { return 1 + (int)th_.size(); }
  int asleep() const { return sleeping_.load(std::memory_order_seq_cst); }  // workers asleep now (tests)
  pid_t pid() const { return pid_; }

  // Run fn(0..total-1) on the caller plus the workers; returns when every unit is done.
  void run(const std::function<void(int)>& fn, int total) {
    if (total <= 0) return;
    if (th_.empty() || total == 1) {
      for (int u = 0; u < total; ++u) fn(u);
      return;
    }
    const uint64_t g = (++gen_) & kGenMask;
    Job& j = slot_[g % kSlots];
    j.fn = fn;
    j.total = total;
    done_.store(0, std::memory_order_relaxed);
    // publish generation g: region r = units [total * r / R, total * (r + 1) / R) as gen:24 | end:20 |
    // next:20; region 0 last, since workers watch it for a new generation (its store releases the rest)
    const uint64_t R = regions_.size();
    for (uint64_t r = R; r-- > 0;) {
      const uint64_t lo = (uint64_t)total * r / R, hi = (uint64_t)total * (r + 1) / R;
      regions_[r].s.store((g << 40) | (hi << 20) | lo, std::memory_order_seq_cst);
    }
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work(g, 0);
    wait_done(total);
  }

 private:
  static constexpr int kSlots = 4;
  static constexpr uint64_t kGenMask = (1ull << 24) - 1;  // region state = gen:24 | end:20 | next:20

 public:
  static constexpr int kMaxUnits = (1 << 20) - 1;

 private:

  static constexpr int kDoneSpinUs = 20;  // the caller's spin for units in flight before it sleeps

  // Caller: until every unit of the current generation is done (spin, then sleep on done_cv_).
  void wait_done(int total) {
    if (done_.load(std::memory_order_acquire) >= total) return;
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 1;; ++it) {
      if (done_.load(std::memory_order_acquire) >= total) return;
      TD_PAUSE();
      if ((it & 63) == 0 && std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(kDoneSpinUs)) break;
    }
    std::unique_lock<std::mutex> lk(done_mu_);
    caller_waiting_.store(true, std::memory_order_seq_cst);
    done_cv_.wait(lk, [&] { return done_.load(std::memory_order_seq_cst) >= total; });
    caller_waiting_.store(false, std::memory_order_relaxed);
  }

  // Worker side of wait_done: the unit just finished was the last one and the caller sleeps.
  void unit_done() {
    done_.fetch_add(1, std::memory_order_seq_cst);
    if (caller_waiting_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lk(done_mu_);  // the caller is in wait() or about to re-check done_
      done_cv_.notify_one();
    }
  }

  // Claim and run units of generation g, own region (self) first, then the others' in turn, until
  // none is left or the generation moved on.
  void work(uint64_t g, int self) {
    const int R = (int)regions_.size();
    for (int k = 0; k < R; ++k) {
      std::atomic<uint64_t>& st = regions_[(self + k) % R].s;
      for (;;) {
        uint64_t s = st.load(std::memory_order_acquire);
        if ((s >> 40) != g) return;
        const uint64_t u = s & 0xFFFFF, end = (s >> 20) & 0xFFFFF;
        if (u >= end) break;
        // A successful claim of unit u < end of generation g means g cannot finish before this
        // unit does, so slot g % kSlots stays valid while it runs.
        if (!st.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
        slot_[g % kSlots].fn((int)u);
        unit_done();
      }
    }
  }

  void worker(int self) {
    uint64_t seen = 0;
    std::atomic<uint64_t>& state0 = regions_[0].s;
    for (;;) {
      uint64_t g = state0.load(std::memory_order_acquire) >> 40;
      if (g == seen) {
        // spin for spin_us_, poll with sched_yield for yield_us_ more, then sleep until a new generation is published
        auto t0 = std::chrono::steady_clock::now();
        const auto hot = std::chrono::microseconds(spin_us_);
        const auto limit = std::chrono::microseconds(spin_us_ + yield_us_);
        bool yielding = false;
        int it = 0;
        while ((state0.load(std::memory_order_acquire) >> 40) == seen && !stop_.load()) {
          if (yielding) {
            sched_yield();
          } else {
            TD_PAUSE();
          }
          if (yielding || (++it & 63) == 0) {
            const auto waited = std::chrono::steady_clock::now() - t0;
            yielding = waited > hot;
            if (waited > limit) {
              sleeping_.fetch_add(1, std::memory_order_seq_cst);
              std::unique_lock<std::mutex> lk(mu_);
              cv_.wait(lk, [&] {
                return stop_.load() || (state0.load(std::memory_order_seq_cst) >> 40) != seen;
              });
              sleeping_.fetch_sub(1, std::memory_order_seq_cst);
              break;
            }
          }
        }
        if (stop_.load()) return;
        continue;
      }
      work(g, self);
      seen = g;
    }
  }

  int spin_us_;
  int yield_us_;
  pid_t pid_;
  std::vector<std::thread> th_;
  struct alignas(64) Region {
    std::atomic<uint64_t> s{0};
  };
  std::vector<Region> regions_;  // one per thread, each on its own cache line
  std::atomic<int> done_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> caller_waiting_{false};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  uint64_t gen_ = 0;
  Job slot_[kSlots];
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace td
