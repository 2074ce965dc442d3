// The posting path allocates nothing: after a warm-up, 10,000 submits of every kind (and their
// completions, immediates and expectations) make no heap allocation on any thread. Counted by
// interposing malloc and friends for this whole process (so the provider's own allocations count
// too); its own binary because of that, and not built under sanitizers (they own malloc).
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <execinfo.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <vector>

#include "fabric/fabric.h"

extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
void __libc_free(void*);
}

namespace {
std::atomic<bool> g_counting{false};
std::atomic<uint64_t> g_allocations{0};
// Out of line so that a debugger can stop on it: `break counted_allocation` shows who allocated.
// The first few are kept as backtraces, printed when the test fails.
constexpr int kKept = 8, kDepth = 16;
void* g_traces[kKept][kDepth];
int g_depths[kKept];
extern "C" __attribute__((noinline)) void counted_allocation() {
  uint64_t n = g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (n < kKept) g_depths[n] = backtrace(g_traces[n], kDepth);  // warmed up: allocates nothing
}
void print_kept_traces() {
  for (uint64_t i = 0; i < std::min<uint64_t>(kKept, g_allocations.load()); i++) {
    std::fprintf(stderr, "allocation %lu:\n", static_cast<unsigned long>(i));
    backtrace_symbols_fd(g_traces[i], g_depths[i], STDERR_FILENO);
  }
}
inline void count() {
  if (g_counting.load(std::memory_order_relaxed)) counted_allocation();
}
}  // namespace

extern "C" {
void* malloc(size_t n) {
  count();
  return __libc_malloc(n);
}
void* calloc(size_t n, size_t m) {
  count();
  return __libc_calloc(n, m);
}
void* realloc(void* p, size_t n) {
  count();
  return __libc_realloc(p, n);
}
void* memalign(size_t a, size_t n) {
  count();
  return __libc_memalign(a, n);
}
void* aligned_alloc(size_t a, size_t n) {
  count();
  return __libc_memalign(a, n);
}
int posix_memalign(void** out, size_t a, size_t n) {
  count();
  *out = __libc_memalign(a, n);
  return *out ? 0 : ENOMEM;
}
void free(void* p) { __libc_free(p); }
}

namespace fabric {
namespace {

struct Counted {
  std::atomic<uint64_t> done{0}, failed{0};
  uint64_t expected = 0;
  OnDone on_done() {
    expected++;
    return OnDone::counter(&done, &failed);
  }
  // Polls (a failure does not change `done`, so waiting on it alone could sleep for ever).
  bool wait() {
    auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (done.load() + failed.load() < expected) {
      if (std::chrono::steady_clock::now() > give_up) {
        ADD_FAILURE() << done.load() << " done and " << failed.load() << " failed of " << expected;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    return true;
  }
};

// One round of every kind of submit to `peer` (this engine itself: loopback), each awaited.
struct Workload {
  TransferEngine& engine;
  MrHandle src;
  RemoteMr dst;
  PeerGroupHandle group;
  NetAddr self;
  std::vector<uint32_t> pages;
  std::vector<ScatterSlice> slices;
  std::vector<GroupSlice> group_slices;
  std::vector<RemoteMr> barrier;
  std::vector<std::byte> message;
  std::atomic<uint64_t> received{0};

  void round(Counted& c, uint32_t i) {
    const uint32_t imm = i % 16;  // a few distinct immediates, each expected again and again
    engine.submit(SingleWrite{.len = 64, .src = {src, 0}, .dst = {dst, 64}, .imm = imm}, c.on_done());
    engine.submit(SingleWrite{.len = 4096, .src = {src, 0}, .dst = {dst, 0}, .num_shards = 3}, c.on_done());
    engine.submit(PagedWrites{.page_len = 256, .src = src, .src_pages = {pages, 256, 0}, .dst = dst,
                              .dst_pages = {pages, 512, 0}, .imm = imm},
                  c.on_done());
    engine.submit(Scatter{.src = src, .slices = slices, .imm = imm}, c.on_done());
    engine.submit(GroupScatter{.group = group, .src = src, .slices = group_slices, .imm = imm}, c.on_done());
    engine.submit(Barrier{.dsts = barrier, .imm = imm}, c.on_done());
    engine.submit(GroupBarrier{.group = group, .imm = imm}, c.on_done());
    engine.submit_send(self, message, c.on_done());
    // 1 + 8 pages + 4 slices + 4 members + 4 + 4 per round carry `imm`.
    engine.expect_imm_count(imm, 1 + 8 + 4 + 4 + 4 + 4, c.on_done());
  }
};

TEST(SubmitAllocations, TenThousandSubmitsOfEveryKindAllocateNothing) {
  std::vector<uint8_t> src(1 << 16, 7), dst(1 << 20, 0);  // outlive the engine
  EngineConfig cfg;
  cfg.provider = "tcp;ofi_rxm";
  cfg.nics = {{"", "127.0.0.1"}};
  TransferEngine engine(cfg);
  auto [hs, ds] = engine.reg_mr(src.data(), src.size());
  auto [hd, dd] = engine.reg_mr(dst.data(), dst.size());
  const RemoteMr rd = engine.add_remote(dd);
  std::vector<RemoteMr> members(4, rd);
  Workload w{engine, hs, rd, engine.add_peer_group(members), engine.main_address(), {}, {}, {}, members, {}, {}};
  for (uint32_t p = 0; p < 8; p++) w.pages.push_back(p * 3);
  for (uint64_t k = 0; k < 4; k++) {
    w.slices.push_back({128, k * 128, {rd, 65536 + k * 4096}});
    w.group_slices.push_back({128, k * 128, 131072 + k * 4096});
  }
  w.message.assign(48, std::byte{0x5a});
  engine.submit_recvs(64, 64, [&](std::span<const std::byte>) { w.received++; });

  constexpr uint32_t kRounds = 10000;
  uint64_t sent = 0;
  auto wait_received = [&] {  // every message so far went through its callback
    auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (w.received.load() < sent) {
      if (std::chrono::steady_clock::now() > give_up) {
        ADD_FAILURE() << w.received.load() << " of " << sent << " messages received";
        return false;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    return true;
  };
  auto run = [&](uint32_t rounds) {
    Counted c;
    for (uint32_t i = 0; i < rounds; i++) {
      w.round(c, i);
      sent++;
      // A bounded number in flight (below the pools' first chunk).
      if (i % 16 == 15 && !(c.wait() && wait_received())) return false;
    }
    bool ok = c.wait();
    EXPECT_EQ(c.failed.load(), 0u);
    return ok;
  };
  // Warm-up: pools, queues and the provider's buffers reach their working size.
  ASSERT_TRUE(run(2000) && wait_received());
  void* warm[4];
  backtrace(warm, 4);  // loads what backtrace() needs before counting starts
  g_allocations = 0;
  g_counting = true;
  const bool ok = run(kRounds) && wait_received();
  g_counting = false;
  ASSERT_TRUE(ok);
  const uint64_t n = g_allocations.load();
  EXPECT_EQ(n, 0u) << n << " heap allocations in " << kRounds << " rounds of 8 submits, 1 "
                   << "expectation and 1 message each";
  if (n > 0) print_kept_traces();
  RecordProperty("allocations", static_cast<int>(n));
}

}  // namespace
}  // namespace fabric
