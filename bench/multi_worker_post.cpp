// multi-worker-post: does a worker of a multi-worker engine post as fast as the only worker of a
// one-worker engine? One sender engine and one receiver engine with W workers each (W = 1, then
// the given count, in the same run); one application thread per worker submits from a region on
// its worker to a region on the receiver's worker of the same index, all at once:
//   post:  1,000 single 64-byte WRITEs, one in flight per thread: submit call to WRITE posted, p50
//   paged: rounds of 64 KiB pages with immediates, two rounds in flight per thread: GB/s per worker
// The last round's bytes are checked on every worker. Busy polling (--adaptive to change).
// The same paged rounds on bare libfabric follow in the same run (bench/raw_endpoint.h, as the
// engine opens its endpoints): W lanes of one sending and one receiving endpoint, a thread each
// (as the engines' workers), all in this process, 1 lane then W: whether the provider itself
// loses per-lane throughput when several pairs copy at once, against the engine's per-worker ratio.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "fabric/fabric.h"
#include "raw_endpoint.h"

using namespace fabric;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string provider = "shm";
  size_t workers = 2;
  uint32_t pages = 256;  // per round
  uint32_t rounds = 64;
  uint64_t page_kib = 64;
  bool adaptive = false;
  bool raw = true;
};

std::string lane_node(const Options& o, int ip) {
  return o.provider == "shm" ? std::string() : fmt::format("127.0.0.{}", ip);
}

EngineConfig config(const Options& o, size_t workers, int first_ip) {
  EngineConfig c;
  c.provider = o.provider;
  c.worker_poll = o.adaptive ? PollMode::kAdaptive : PollMode::kBusy;
  c.record_post_timings = true;
  for (size_t w = 0; w < workers; w++) {
    WorkerConfig wc;
    wc.nics = {NicConfig{"", lane_node(o, first_ip + static_cast<int>(w))}};
    c.workers.push_back(wc);
  }
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Result {
  double post_p50_us = 0;
  double paged_gb_per_s_per_worker = 0;  // the slowest worker's
  bool verified = true;
};

Result run(const Options& o, size_t workers) {
  TransferEngine tx(config(o, workers, 2)), rx(config(o, workers, 20));
  const uint64_t page = o.page_kib * 1024, half = uint64_t{o.pages} * page;
  struct Lane {
    std::vector<uint8_t> src, dst;
    MrHandle src_h;
    RemoteMr dst_r;
  };
  std::vector<Lane> lanes(workers);
  for (size_t w = 0; w < workers; w++) {
    Lane& l = lanes[w];
    l.src.resize(half);
    for (uint64_t b = 0; b < half; b++) l.src[b] = static_cast<uint8_t>(b * 131 + w * 7 + b / 4093);
    l.dst.assign(2 * half, 0);  // two rounds in flight: alternate halves
    l.src_h = tx.reg_mr(l.src.data(), l.src.size(), Device::host_for_worker(static_cast<int>(w))).first;
    l.dst_r = tx.add_remote(rx.reg_mr(l.dst.data(), l.dst.size(), Device::host_for_worker(static_cast<int>(w))).second);
  }

  // Post cost: every thread at once, one WRITE in flight each.
  tx.take_post_timings();
  auto post_lane = [&](size_t w) {
    for (int i = 0; i < 1100; i++) {
      std::atomic<int> f{kDonePending};
      tx.submit(SingleWrite{.len = 64, .src = {lanes[w].src_h, 0}, .dst = {lanes[w].dst_r, 0}}, OnDone::flag(&f));
      f.wait(kDonePending);
    }
  };
  std::vector<std::thread> threads;
  for (size_t w = 0; w < workers; w++) threads.emplace_back(post_lane, w);
  for (auto& t : threads) t.join();
  threads.clear();
  std::vector<double> post_us;
  for (const PostTiming& t : tx.take_post_timings()) post_us.push_back(t.first_post_ns / 1000.0);
  Result r;
  r.post_p50_us = median(post_us);

  // Paged rounds: imm = 1000 * worker + round; two rounds in flight, into alternating halves.
  std::vector<double> gb_per_s(workers);
  std::vector<uint32_t> idx(o.pages);
  for (uint32_t i = 0; i < o.pages; i++) idx[i] = i;
  auto paged_lane = [&](size_t w) {
    Lane& l = lanes[w];
    std::vector<std::unique_ptr<std::atomic<int>>> landed;
    for (uint32_t k = 0; k < o.rounds; k++) landed.push_back(std::make_unique<std::atomic<int>>(kDonePending));
    auto t0 = Clock::now();
    for (uint32_t k = 0; k < o.rounds; k++) {
      if (k >= 2) landed[k - 2]->wait(kDonePending);
      const uint32_t imm = static_cast<uint32_t>(1000 * w + k);
      rx.expect_imm_count(imm, o.pages, OnDone::flag(landed[k].get()),
                          {.timeout = std::chrono::seconds(60), .device = Device::host_for_worker(static_cast<int>(w))});
      tx.submit(PagedWrites{.page_len = page,
                            .src = l.src_h,
                            .src_pages = {.indices = idx, .stride = page},
                            .dst = l.dst_r,
                            .dst_pages = {.indices = idx, .stride = page, .offset = (k % 2) * half},
                            .imm = imm},
                OnDone::callback([](const Status&) {}));
    }
    for (auto& f : landed) f->wait(kDonePending);
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    gb_per_s[w] = static_cast<double>(half) * o.rounds / secs / 1e9;
    for (auto& f : landed) r.verified &= f->load() == kDoneSucceeded;
  };
  for (size_t w = 0; w < workers; w++) threads.emplace_back(paged_lane, w);
  for (auto& t : threads) t.join();
  for (auto& l : lanes) r.verified &= std::memcmp(l.dst.data(), l.src.data(), half) == 0 &&
                                      std::memcmp(l.dst.data() + half, l.src.data(), half) == 0;
  r.paged_gb_per_s_per_worker = *std::min_element(gb_per_s.begin(), gb_per_s.end());
  fmt::print("workers={} post single 64B first post p50 {:.2f} us; paged {} x {} KiB x {} rounds: "
             "per worker {:.2f} GB/s; verified {}\n",
             workers, r.post_p50_us, o.pages, o.page_kib, o.rounds,
             fmt::join(gb_per_s.begin(), gb_per_s.end(), " / "), r.verified ? "OK" : "FAILED");
  return r;
}

// The paged rounds of run() on bare libfabric: lane w sends from its own endpoint to its own
// receiving endpoint, with immediate `round`; a receiving thread per lane counts them, and the
// sender keeps two rounds in flight (round r waits until round r - 2 has landed, as run() does).
// Returns the slowest lane's GB/s; checks the last two rounds' bytes.
double raw_paged(const Options& o, size_t lanes, bool& verified) {
  using bench::Endpoint;
  const uint64_t page = o.page_kib * 1024, half = uint64_t{o.pages} * page;
  struct Lane {
    std::unique_ptr<Endpoint> tx, rx;
    std::vector<uint8_t> src, dst;
    bench::RemoteRegion dst_region{};
    fi_addr_t peer = FI_ADDR_UNSPEC;
    std::vector<std::atomic<uint32_t>> landed;  // immediates counted per round
    std::atomic<bool> failed{false};
    double gb_per_s = 0;
  };
  std::vector<Lane> ls(lanes);
  for (size_t w = 0; w < lanes; w++) {
    Lane& l = ls[w];
    l.tx = std::make_unique<Endpoint>(o.provider, lane_node(o, 2 + static_cast<int>(w)));
    l.rx = std::make_unique<Endpoint>(o.provider, lane_node(o, 20 + static_cast<int>(w)));
    l.src.resize(half);
    for (uint64_t b = 0; b < half; b++) l.src[b] = static_cast<uint8_t>(b * 131 + w * 7 + b / 4093);
    l.dst.assign(2 * half, 0);
    l.tx->register_buffer(l.src.data(), l.src.size());
    l.dst_region = l.rx->register_buffer(l.dst.data(), l.dst.size());
    l.peer = l.tx->insert_peer(l.rx->name());
    l.rx->insert_peer(l.tx->name());  // as the engine does
    l.landed = std::vector<std::atomic<uint32_t>>(o.rounds);
  }
  auto receiver = [&](Lane& l) {
    fi_cq_data_entry entries[64];
    uint64_t left = uint64_t{o.rounds} * o.pages;
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    try {
      while (left > 0 && !l.failed.load(std::memory_order_relaxed)) {
        const size_t n = l.rx->poll(entries);
        for (size_t i = 0; i < n; i++)
          if (entries[i].flags & FI_REMOTE_CQ_DATA) {
            const uint32_t round = static_cast<uint32_t>(entries[i].data);
            if (round >= o.rounds) throw std::runtime_error("an immediate of no round");
            l.landed[round].fetch_add(1, std::memory_order_release);
            left--;
          }
        if (n == 0 && Clock::now() > deadline) throw std::runtime_error("immediates missing after 120 s");
      }
    } catch (const std::exception& e) {
      fmt::print(stderr, "raw receiver: {}\n", e.what());
      l.failed.store(true);
    }
  };
  auto sender = [&](Lane& l) {
    struct Slot {
      fi_context2 ctx;
    };
    std::vector<Slot> slots(64);
    std::vector<Slot*> free_slots;
    for (auto& sl : slots) free_slots.push_back(&sl);
    fi_cq_data_entry entries[64];
    auto progress = [&] {
      const size_t n = l.tx->poll(entries);
      for (size_t i = 0; i < n; i++) free_slots.push_back(reinterpret_cast<Slot*>(entries[i].op_context));
    };
    try {
      const auto t0 = Clock::now();
      for (uint32_t r = 0; r < o.rounds && !l.failed.load(std::memory_order_relaxed); r++) {
        if (r >= 2)
          while (l.landed[r - 2].load(std::memory_order_acquire) < o.pages && !l.failed.load()) progress();
        for (uint32_t i = 0; i < o.pages; i++) {
          while (free_slots.empty()) progress();
          Slot* sl = free_slots.back();
          const uint64_t at = l.dst_region.base + (r % 2) * half + i * page;
          for (;;) {
            const ssize_t rc = fi_writedata(l.tx->ep(), l.src.data() + i * page, page, l.tx->desc(), r, l.peer,
                                            at, l.dst_region.key, &sl->ctx);
            if (rc == 0) break;
            if (rc != -FI_EAGAIN) bench::check("fi_writedata", rc);
            progress();
          }
          free_slots.pop_back();
        }
      }
      while (l.landed[o.rounds - 1].load(std::memory_order_acquire) < o.pages && !l.failed.load()) progress();
      while (free_slots.size() < slots.size()) progress();
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      l.gb_per_s = static_cast<double>(half) * o.rounds / secs / 1e9;
    } catch (const std::exception& e) {
      fmt::print(stderr, "raw sender: {}\n", e.what());
      l.failed.store(true);
    }
  };
  std::vector<std::thread> threads;
  for (Lane& l : ls) threads.emplace_back(receiver, std::ref(l));
  for (Lane& l : ls) threads.emplace_back(sender, std::ref(l));
  for (auto& t : threads) t.join();
  std::vector<double> gb_per_s;
  for (Lane& l : ls) {
    verified &= !l.failed && std::memcmp(l.dst.data(), l.src.data(), half) == 0 &&
                std::memcmp(l.dst.data() + half, l.src.data(), half) == 0;
    gb_per_s.push_back(l.gb_per_s);
  }
  fmt::print("raw lanes={} paged {} x {} KiB x {} rounds: per lane {:.2f} GB/s; verified {}\n", lanes, o.pages,
             o.page_kib, o.rounds, fmt::join(gb_per_s.begin(), gb_per_s.end(), " / "), verified ? "OK" : "FAILED");
  return *std::min_element(gb_per_s.begin(), gb_per_s.end());
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"multi-worker-post: a worker's posting cost and paged throughput, 1 worker vs N at once"};
  app.add_option("--provider", o.provider, "shm or tcp;ofi_rxm (worker w binds 127.0.0.(2+w))");
  app.add_option("--workers", o.workers, "workers in the second run")->check(CLI::Range(1, 8));
  app.add_option("--pages", o.pages, "pages per round")->check(CLI::Range(1, 65536));
  app.add_option("--rounds", o.rounds, "paged rounds per worker")->check(CLI::Range(2, 100000));
  app.add_option("--page-kib", o.page_kib)->check(CLI::Range(1, 4096));
  app.add_flag("--adaptive", o.adaptive, "adaptive polling instead of busy (few cores)");
  app.add_flag("!--no-raw", o.raw, "skip the bare-libfabric lanes");
  CLI11_PARSE(app, argc, argv);
  try {
    Result one = run(o, 1), many = run(o, o.workers);
    const double paged_ratio = many.paged_gb_per_s_per_worker / one.paged_gb_per_s_per_worker;
    fmt::print("ratio workers={} post_p50_vs_one={:.2f} paged_per_worker_vs_one={:.2f}\n", o.workers,
               many.post_p50_us / one.post_p50_us, paged_ratio);
    bool raw_ok = true;
    if (o.raw) {
      const double raw_one = raw_paged(o, 1, raw_ok), raw_many = raw_paged(o, o.workers, raw_ok);
      fmt::print("raw-ratio lanes={} paged_per_lane_vs_one={:.2f} engine_ratio_over_raw_ratio={:.2f}\n", o.workers,
                 raw_many / raw_one, paged_ratio / (raw_many / raw_one));
    }
    return one.verified && many.verified && raw_ok ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "multi-worker-post: {}\n", e.what());
    return 1;
  }
}
