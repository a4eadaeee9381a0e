// Small work-sharing thread pool for the quantized GEMM (no OpenMP).
//
// Why not OpenMP: an OpenMP team ends in a barrier that needs every thread to arrive, so one
// worker descheduled by another process on a busy machine stalls the whole call for a time
// slice (the 10-20x stalls of issue 11). Here the caller works too and claims units from one
// atomic counter; a worker that has not woken up simply claims nothing, so the caller only ever
// waits for units a worker has actually started. Idle workers spin briefly, then sleep on a
// condition variable (passive waiting), so they do not keep a core busy between steps.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
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
  explicit Pool(int nthreads, int spin_us) : spin_us_(spin_us), pid_(getpid()) {
    for (int i = 1; i < nthreads; ++i) th_.emplace_back([this] { worker(); });
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
    // publish: generation g, its unit count, next unit 0
    state_.store((g << 40) | ((uint64_t)total << 20), std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work(g);
    while (done_.load(std::memory_order_acquire) < total) TD_PAUSE();
  }

 private:
  static constexpr int kSlots = 4;
  static constexpr uint64_t kGenMask = (1ull << 24) - 1;  // state = gen:24 | total:20 | next:20

 public:
  static constexpr int kMaxUnits = (1 << 20) - 1;

 private:

  // Claim and run units of generation g until none is left or the generation moved on.
  void work(uint64_t g) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if ((s >> 40) != g) return;
      const uint64_t u = s & 0xFFFFF, total = (s >> 20) & 0xFFFFF;
      if (u >= total) return;
      // A successful claim of unit u < total of generation g means g cannot finish before this
      // unit does, so slot g % kSlots stays valid while it runs.
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      slot_[g % kSlots].fn((int)u);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void worker() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = state_.load(std::memory_order_acquire) >> 40;
      if (g == seen) {
        // spin for spin_us_, then sleep until a new generation is published
        auto t0 = std::chrono::steady_clock::now();
        int it = 0;
        while ((state_.load(std::memory_order_acquire) >> 40) == seen && !stop_.load()) {
          TD_PAUSE();
          if ((++it & 63) == 0 &&
              std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us_)) {
            sleeping_.fetch_add(1, std::memory_order_seq_cst);
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [&] {
              return stop_.load() || (state_.load(std::memory_order_seq_cst) >> 40) != seen;
            });
            sleeping_.fetch_sub(1, std::memory_order_seq_cst);
            break;
          }
        }
        if (stop_.load()) return;
        continue;
      }
      work(g);
      seen = g;
    }
  }

  int spin_us_;
  pid_t pid_;
  std::vector<std::thread> th_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  uint64_t gen_ = 0;
  Job slot_[kSlots];
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace td
