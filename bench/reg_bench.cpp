// fabric-reg-bench: what registering host memory costs, split where the time goes: allocation,
// first touch (the page faults of fresh memory), the registration call, and the first WRITE into
// the fresh region against a later one; and many regions in one reg_mrs call against one reg_mr
// each. Two engines in one process (tx writes, rx owns the measured region). Prints a table, writes
// JSON with --json. GPU regions are not measured here (docs/benchmarks.md says so).
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fabric/fabric.h"

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// How the fresh region is prepared before the WRITEs: not at all (the first WRITE faults its
// pages in), touched by the application (memset), or by the engine (MrRequest::prefault).
enum class Mode { kCold, kTouched, kPrefault };
const char* name_of(Mode m) { return m == Mode::kCold ? "cold" : m == Mode::kTouched ? "touched" : "prefault"; }

struct Row {
  std::string provider, mode;
  double gib = 0, alloc_s = 0, touch_s = 0, reg_s = 0, first_s = 0, later_s = 0, dereg_s = 0;
};

fabric::EngineConfig config(const std::string& provider) {
  fabric::EngineConfig cfg;
  cfg.provider = provider;
  cfg.nics = {provider == "shm" ? fabric::NicConfig{} : fabric::NicConfig{"", "127.0.0.1"}};
  cfg.worker_poll = fabric::PollMode::kAdaptive;  // two engines on a 2-core machine
  cfg.callback_poll = fabric::PollMode::kAdaptive;
  cfg.transfer_timeout = std::chrono::minutes(5);
  return cfg;
}

// Anonymous memory, untouched: what a fresh allocation of this size is before first use.
uint8_t* map(size_t len) {
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error(fmt::format("mmap of {} bytes: {}", len, std::strerror(errno)));
  return static_cast<uint8_t*>(p);
}

// Writes all of `dst` (len bytes) from the warm `src` (chunk bytes) in chunk-sized WRITEs, a
// window of them in flight, and returns once rx has counted every immediate (the data landed).
double write_all(fabric::TransferEngine& tx, fabric::TransferEngine& rx, const fabric::MrHandle& src,
                 size_t chunk, fabric::RemoteMr dst, size_t len, uint32_t imm) {
  const size_t writes = (len + chunk - 1) / chunk;
  std::atomic<int> landed{fabric::kDonePending};
  std::atomic<uint64_t> sent{0}, failed{0};
  rx.expect_imm_count(imm, writes, fabric::OnDone::flag(&landed));
  constexpr size_t kWindow = 8;
  const auto t = Clock::now();
  for (size_t i = 0; i < writes; i++) {
    while (i - sent.load() >= kWindow) std::this_thread::sleep_for(std::chrono::microseconds(20));
    const size_t off = i * chunk, n = std::min(chunk, len - off);
    tx.submit(fabric::SingleWrite{.len = n, .src = {src, 0}, .dst = {dst, off}, .imm = imm},
              fabric::OnDone::counter(&sent, &failed));
  }
  while (landed.load() == fabric::kDonePending) std::this_thread::sleep_for(std::chrono::microseconds(20));
  const double s = since(t);
  while (sent.load() + failed.load() < writes) std::this_thread::sleep_for(std::chrono::microseconds(20));
  if (failed.load() || landed.load() != fabric::kDoneSucceeded) throw std::runtime_error("a WRITE failed");
  return s;
}

Row one_region(const std::string& provider, size_t len, size_t chunk, Mode mode) {
  fabric::TransferEngine tx(config(provider)), rx(config(provider));
  std::vector<uint8_t> src(chunk, 0x5a);  // warm: written here, registered before the clock starts
  auto [sh, sd] = tx.reg_mr(src.data(), src.size());
  Row r{provider, name_of(mode), static_cast<double>(len) / (1 << 30)};
  auto t = Clock::now();
  uint8_t* dst = map(len);
  r.alloc_s = since(t);
  if (mode == Mode::kTouched) {
    t = Clock::now();
    std::memset(dst, 0, len);
    r.touch_s = since(t);
  }
  const fabric::MrRequest req{.ptr = dst, .len = len, .prefault = mode == Mode::kPrefault};
  t = Clock::now();
  auto regs = rx.reg_mrs(std::span(&req, 1));
  r.reg_s = since(t);
  const fabric::RemoteMr remote = tx.add_remote(regs[0].second);
  tx.connect(remote);  // the connection's set-up is not the region's cost (bench/first_transfer.py)
  r.first_s = write_all(tx, rx, sh, chunk, remote, len, 1);
  r.later_s = write_all(tx, rx, sh, chunk, remote, len, 2);
  if (dst[len - 1] != 0x5a) throw std::runtime_error("the last byte did not land");
  t = Clock::now();
  rx.dereg_mr(regs[0].first);
  r.dereg_s = since(t);
  munmap(dst, len);
  tx.dereg_mr(sh);
  return r;
}

// `count` regions of `len` bytes: one reg_mr each against all in one reg_mrs, alternating over
// `rounds` rounds on one engine (its first registration's set-up is out of both). Medians, seconds.
std::pair<double, double> many_regions(const std::string& provider, size_t count, size_t len, int rounds) {
  fabric::EngineConfig cfg = config(provider);
  cfg.max_regions = std::max<size_t>(cfg.max_regions, count + 8);
  fabric::TransferEngine rx(cfg);
  std::vector<std::vector<uint8_t>> bufs(count, std::vector<uint8_t>(len, 1));
  std::vector<fabric::MrRequest> reqs;
  for (auto& b : bufs) reqs.push_back({.ptr = b.data(), .len = b.size()});
  rx.dereg_mr(rx.reg_mr(bufs[0].data(), len).first);
  std::vector<double> each, batched;
  for (int r = 0; r < rounds; r++) {
    std::vector<fabric::MrHandle> hs;
    auto t = Clock::now();
    for (auto& b : bufs) hs.push_back(rx.reg_mr(b.data(), b.size()).first);
    each.push_back(since(t));
    for (auto& h : hs) rx.dereg_mr(h);
    t = Clock::now();
    auto all = rx.reg_mrs(reqs);
    batched.push_back(since(t));
    for (auto& [h, d] : all) rx.dereg_mr(h);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return {median(each), median(batched)};
}

// Memory the kernel says it could give without swapping (MemAvailable), in bytes.
size_t available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  size_t kb = 0;
  while (in >> key >> kb) {
    if (key == "MemAvailable:") return kb * 1024;
    in.ignore(256, '\n');
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> providers = {"tcp;ofi_rxm", "shm"};
  std::vector<double> sizes_gib = {1, 4, 16};
  std::vector<std::string> modes = {"cold", "touched", "prefault"};
  size_t chunk_mib = 64, many = 256, many_kib = 1024;
  std::string json;
  CLI::App app{"fabric-reg-bench: the cost of registering host memory, and of the first WRITE into it"};
  app.add_option("--providers", providers);
  app.add_option("--sizes-gib", sizes_gib, "region sizes; sizes above 80% of MemAvailable are capped to it");
  app.add_option("--modes", modes, "cold, touched (memset before reg), prefault (MrRequest::prefault)");
  app.add_option("--chunk-mib", chunk_mib, "size of each WRITE (and of the warm source buffer)");
  app.add_option("--many", many, "regions for the reg_mr-each against one reg_mrs comparison (0: skip)");
  app.add_option("--many-kib", many_kib, "size of each of those regions");
  app.add_option("--json", json, "write the rows here");
  CLI11_PARSE(app, argc, argv);

  const size_t chunk = chunk_mib << 20;
  std::vector<Row> rows;
  std::vector<std::string> notes;
  fmt::print("{:<12} {:<9} {:>7} {:>8} {:>8} {:>8} {:>10} {:>10} {:>8}\n", "provider", "mode", "GiB", "alloc_s",
             "touch_s", "reg_s", "1st_wr_s", "later_wr_s", "dereg_s");
  for (double gib : sizes_gib) {
    size_t len = static_cast<size_t>(gib * (1 << 30));
    // Each run holds the region and a chunk-sized source; the cap leaves the rest to the system.
    const size_t cap = (available_bytes() / 10 * 8 - chunk) & ~size_t{(1 << 30) - 1};
    if (len > cap) {
      notes.push_back(fmt::format("{} GiB capped to {} GiB (80% of MemAvailable)", gib, cap >> 30));
      len = cap;
    }
    for (const auto& p : providers)
      for (const auto& m : modes) {
        const Mode mode = m == "cold" ? Mode::kCold : m == "touched" ? Mode::kTouched : Mode::kPrefault;
        Row r = one_region(p, len, chunk, mode);
        fmt::print("{:<12} {:<9} {:>7.2f} {:>8.4f} {:>8.3f} {:>8.4f} {:>10.3f} {:>10.3f} {:>8.4f}\n", r.provider,
                   r.mode, r.gib, r.alloc_s, r.touch_s, r.reg_s, r.first_s, r.later_s, r.dereg_s);
        std::fflush(stdout);
        rows.push_back(r);
      }
  }
  std::vector<std::tuple<std::string, double, double>> batches;
  if (many > 0)
    for (const auto& p : providers) {
      auto [each, batched] = many_regions(p, many, many_kib << 10, 7);
      fmt::print("{:<12} {} regions of {} KiB: reg_mr each {:.5f} s, one reg_mrs {:.5f} s ({:.1f}x; medians of 7)\n", p, many,
                 many_kib, each, batched, each / batched);
      batches.emplace_back(p, each, batched);
    }
  for (const auto& n : notes) fmt::print("note: {}\n", n);
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\"regions\": [";
    for (size_t i = 0; i < rows.size(); i++) {
      const Row& r = rows[i];
      out << (i ? ", " : "")
          << fmt::format("{{\"provider\": \"{}\", \"mode\": \"{}\", \"gib\": {}, \"alloc_s\": {}, \"touch_s\": {}, "
                         "\"reg_s\": {}, \"first_write_s\": {}, \"later_write_s\": {}, \"dereg_s\": {}}}",
                         r.provider, r.mode, r.gib, r.alloc_s, r.touch_s, r.reg_s, r.first_s, r.later_s, r.dereg_s);
    }
    out << "], \"many\": [";
    for (size_t i = 0; i < batches.size(); i++)
      out << (i ? ", " : "")
          << fmt::format("{{\"provider\": \"{}\", \"regions\": {}, \"kib\": {}, \"reg_mr_each_s\": {}, \"reg_mrs_s\": {}}}",
                         std::get<0>(batches[i]), many, many_kib, std::get<1>(batches[i]), std::get<2>(batches[i]));
    out << "]}\n";
  }
  return 0;
}
