// fabric-bench client: runs the sweeps against a server, prints one row per measurement and
// writes them all as JSON.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <numeric>
#include <thread>

#include "bench_options.h"
#include "control.h"

namespace fabric::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr unsigned kWatchdogSeconds = 600;
double now_us() { return std::chrono::duration<double, std::micro>(Clock::now().time_since_epoch()).count(); }

struct Row {
  std::string test;
  uint64_t bytes = 0;      // per transfer
  uint64_t writes = 0;     // WRITEs per transfer
  uint64_t iters = 0;      // transfers in the bandwidth pass
  double avg_us = 0, p50_us = 0, p99_us = 0;
  double gb_per_s = 0, mops = 0;  // GB/s: 1e9 bytes per second
  std::string verified = "-";
};

void summarize(std::vector<double> lat, Row& r) {
  if (lat.empty()) return;
  std::sort(lat.begin(), lat.end());
  r.avg_us = std::accumulate(lat.begin(), lat.end(), 0.0) / lat.size();
  r.p50_us = lat[lat.size() / 2];
  r.p99_us = lat[std::min(lat.size() - 1, lat.size() * 99 / 100)];
}

class Client {
 public:
  Client(const Options& o, const std::string& server_hex)
      : o_(o), engine_(o.engine_config()), ctl_(engine_), progress_(o.progress) {
    // Without --link-gbps, the % column uses the link speed the NICs report (Gbit/s, as NICs
    // report it; 0 on loopback).
    link_gbps_ = o.link_gbps;
    if (link_gbps_ <= 0) {
      std::vector<NicStats> nics = engine_.nic_stats();
      for (size_t i = 0; i < engine_.nic_count(); i++) link_gbps_ += nics[i].link_gbps;
    }
    ctl_.set_peer(NetAddr::from_hex(server_hex));
    if (o.timeout_ms) ctl_.set_reply_timeout(std::chrono::milliseconds(o.timeout_ms));
    auto w = split(ctl_.call("hello " + engine_.main_address().to_hex(), "descs"));
    for (size_t i = 1; i < w.size(); i++) descs_.push_back(MrDesc::from_hex(w[i]));
    for (auto& d : descs_) remotes_.push_back(engine_.add_remote(d));
    uint64_t src_len = std::max<uint64_t>(descs_[0].len(), descs_.size() * o.scatter_len);
    src_.resize(src_len);
    for (uint64_t i = 0; i < src_.size(); i++) src_[i] = pattern(i);
    src_handle_ = engine_.reg_mr(src_.data(), src_.size()).first;
    pong_buf_.assign(4096, 0);
    pong_desc_ = engine_.reg_mr(pong_buf_.data(), pong_buf_.size()).second;
    group_ = engine_.add_peer_group(remotes_);
    fmt::print("{:<24} {:>10} {:>7} {:>7} {:>10} {:>10} {:>10} {:>9} {:>7} {:>9} {}\n", "test",
               "bytes", "writes", "iters", "avg us", "p50 us", "p99 us", "GB/s", "% link",
               "M ops/s", "verify");
  }

  void run() {
    // The measurements are listed first, so the progress line can say "step 3 of 17".
    std::vector<std::function<void()>> steps;
    if (o_.wants("single"))
      for (uint64_t size : sizes(o_.single_sizes, {1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20,
                                                     4 << 20, 16 << 20, 64 << 20}))
        if (size <= descs_[0].len()) steps.push_back([this, size] { single(size); });
    if (o_.wants("paged"))
      for (uint64_t page : sizes(o_.page_sizes, {1 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10}))
        for (uint64_t n : o_.page_counts)
          if (paged_fits(page, n)) steps.push_back([this, page, n] { paged(page, n); });
    if (o_.wants("scatter")) steps.push_back([this] { scatter(); });
    if (o_.wants("barrier")) steps.push_back([this] { barrier(); });
    if (o_.wants("imm")) steps.push_back([this] { imm_round_trip(); });
    if (o_.wants("msg")) steps.push_back([this] { message_round_trip(); });
    if (o_.wants("post")) steps.push_back([this] { post_cost(); });
    progress_.start(steps.size());
    for (auto& step : steps) {
      progress_.next_step();
      step();
    }
    progress_.finish();
    ctl_.call("bye", "bye");
    if (!o_.json.empty()) write_json();
  }

 private:
  static std::vector<uint64_t> sizes(const std::vector<uint64_t>& given, std::vector<uint64_t> dflt) {
    return given.empty() ? dflt : given;
  }
  uint64_t iters_for(uint64_t bytes) const {
    uint64_t target = o_.target_mib << 20;
    return std::clamp<uint64_t>(bytes ? target / bytes : o_.max_iters, o_.min_iters, o_.max_iters);
  }

  // Latency pass (one transfer in flight, submit to local completion), then bandwidth pass
  // (o_.window in flight; timed from the first submit to the server's "all immediates arrived").
  template <class Submit>
  void measure(Row r, const std::string& expect_scope, uint64_t imms_per_transfer, Submit submit,
               const std::string& verify_cmd) {
    uint32_t imm = next_imm_++;
    alarm(kWatchdogSeconds);  // a stuck measurement ends the program instead of hanging it
    uint64_t lat_iters = std::clamp<uint64_t>((64ull << 20) / std::max<uint64_t>(r.bytes, 1), 3, 200);
    std::vector<double> lat;
    {
      std::atomic<uint64_t> lat_done{0};  // for the progress line, bumped outside the timed span
      auto pass = progress_.pass(label(r) + " latency", r.bytes, o_.warmup + lat_iters, lat_done);
      for (uint64_t i = 0; i < o_.warmup + lat_iters; i++) {
        std::atomic<int> f{kDonePending};
        double t0 = now_us();
        submit(OnDone::flag(&f), std::nullopt);
        f.wait(kDonePending);
        if (f.load() != kDoneSucceeded) throw Error(ErrorCode::kProvider, r.test + ": transfer failed");
        if (i >= o_.warmup) lat.push_back(now_us() - t0);
        lat_done.store(i + 1, std::memory_order_relaxed);
      }
    }
    summarize(lat, r);

    r.iters = iters_for(r.bytes);
    ctl_.call(fmt::format("expect {} {} {}", expect_scope, imm, r.iters * imms_per_transfer), "armed");
    // On the heap, kept alive by every transfer: a failed pass ends before the others complete.
    struct Counters {
      std::atomic<uint64_t> done{0}, failed{0};
    };
    auto counters = std::make_shared<Counters>();
    std::atomic<uint64_t>& done = counters->done;
    std::atomic<uint64_t>& failed = counters->failed;
    // A failure bumps `failed`, which does not wake a wait on `done`: this thread passes it on
    // (by moving `done`, so the wake cannot be lost), and a failed pass ends at once instead of
    // waiting forever. StopRelay ends it however the pass ends (a throw included), before the join.
    std::jthread relay([&] {
      failed.wait(0);
      done.fetch_add(uint64_t{1} << 62);
      done.notify_all();
    });
    struct StopRelay {
      std::atomic<uint64_t>& failed;
      ~StopRelay() {
        failed.fetch_add(uint64_t{1} << 62);
        failed.notify_all();
      }
    } stop_relay{failed};
    auto fail_pass = [&](const std::string& why) {
      uint64_t n = failed.load();
      throw Error(ErrorCode::kProvider, fmt::format("{}: {} ({} transfers failed)", r.test, why, n));
    };
    auto wait_done_while = [&](auto cond) {  // `done` is read before `failed`: no lost wake
      for (uint64_t d = done.load(); !failed.load() && cond(d); d = done.load()) done.wait(d);
    };
    // The engine counts `done` anyway: the progress thread reads it, the loop pays nothing.
    auto pass = progress_.pass(label(r) + " bandwidth", r.bytes, r.iters, done);
    double t0 = now_us();
    for (uint64_t i = 0; i < r.iters; i++) {
      wait_done_while([&](uint64_t d) { return i - d >= o_.window; });
      if (failed.load()) fail_pass("transfer failed");
      submit(OnDone::counter(&done, &failed).keep_alive(counters), imm);
    }
    std::string reached = ctl_.recv();
    double secs = (now_us() - t0) / 1e6;
    wait_done_while([&](uint64_t d) { return d < r.iters; });
    if (failed.load() || reached.find(" ok") == std::string::npos) fail_pass(reached);
    r.gb_per_s = r.iters * r.bytes / secs / 1e9;
    r.mops = r.iters * r.writes / secs / 1e6;
    if (o_.verify && !verify_cmd.empty())
      r.verified = ctl_.call("verify " + verify_cmd, "verified") == "verified ok" ? "ok" : "BAD";
    print(r);
  }

  void single(uint64_t size) {
    Row r{"single", size, single_write_imm_count(size, engine_.nic_count(), false)};
    measure(r, "first", r.writes, [&](OnDone d, std::optional<uint32_t> imm) {
      engine_.submit(SingleWrite{.len = size, .src = {src_handle_, 0}, .dst = {remotes_[0], 0}, .imm = imm},
                     std::move(d));
    }, fmt::format("single {}", size));
  }

  static uint64_t page_stride(uint64_t page) { return page + page / 4; }  // the pages are scattered
  bool paged_fits(uint64_t page, uint64_t n) const {
    return page_stride(page) * n <= descs_[0].len() && page_stride(page) * n <= src_.size();
  }

  void paged(uint64_t page, uint64_t n) {
    uint64_t stride = page_stride(page);
    uint32_t seed = static_cast<uint32_t>(page * 7 + n);
    const std::vector<uint32_t> src_idx = page_order(static_cast<uint32_t>(n), seed);
    const std::vector<uint32_t> dst_idx = page_order(static_cast<uint32_t>(n), seed + 1);
    Pages src{src_idx, stride, 0}, dst{dst_idx, stride, 0};
    Row r{fmt::format("paged {}K x{}", page / 1024, n), page * n, n};
    measure(r, "first", n, [&](OnDone d, std::optional<uint32_t> imm) {
      engine_.submit(PagedWrites{.page_len = page, .src = src_handle_, .src_pages = src,
                                 .dst = remotes_[0], .dst_pages = dst, .imm = imm},
                     std::move(d));
    }, fmt::format("paged {} {} {} {}", page, n, stride, seed));
  }

  void scatter() {
    std::vector<GroupSlice> slices;
    for (size_t p = 0; p < remotes_.size(); p++) slices.push_back({o_.scatter_len, p * o_.scatter_len, 0});
    Row r{fmt::format("scatter to {}", slices.size()), o_.scatter_len * slices.size(), slices.size()};
    measure(r, "all", 1, [&](OnDone d, std::optional<uint32_t> imm) {
      engine_.submit(GroupScatter{.group = group_, .src = src_handle_, .slices = slices, .imm = imm},
                     std::move(d));
    }, fmt::format("scatter {}", o_.scatter_len));
  }

  void barrier() {
    Row r{fmt::format("barrier to {}", descs_.size()), 0, descs_.size()};
    measure(r, "all", 1, [&](OnDone d, std::optional<uint32_t> imm) {
      engine_.submit(GroupBarrier{.group = group_, .imm = imm.value_or(0xFFFFFFFF)}, std::move(d));
    }, "");
  }

  // Client WRITEs 64 B with immediate `in`; the server's callback answers with `out`.
  void imm_round_trip() {
    uint32_t in = next_imm_++, out = next_imm_++;
    uint64_t iters = 1000;
    ctl_.call(fmt::format("pong {} {} {} {}", in, out, iters + o_.warmup, pong_desc_.to_hex()), "armed");
    std::vector<double> lat;
    std::atomic<uint64_t> round_trips{0};
    auto pass = progress_.pass("imm round trip", 64, iters + o_.warmup, round_trips);
    for (uint64_t i = 0; i < iters + o_.warmup; i++) {
      std::atomic<int> back{kDonePending};
      engine_.expect_imm_count(out, 1, OnDone::flag(&back));
      double t0 = now_us();
      engine_.submit(SingleWrite{.len = 64, .src = {src_handle_, 0}, .dst = {remotes_[0], 0}, .imm = in},
                     OnDone::none());
      back.wait(kDonePending);
      if (i >= o_.warmup) lat.push_back(now_us() - t0);
      round_trips.store(i + 1, std::memory_order_relaxed);
    }
    Row r{"imm round trip", 64, 1, iters};
    summarize(lat, r);
    print(r);
  }

  void message_round_trip() {
    std::vector<double> lat;
    std::atomic<uint64_t> round_trips{0};
    // SENDs, not WRITEs: no bytes counted, only the round trips.
    auto pass = progress_.pass("send/recv round trip", 0, 1000 + o_.warmup, round_trips);
    for (uint64_t i = 0; i < 1000 + o_.warmup; i++) {
      double t0 = now_us();
      ctl_.call("ping", "pong");
      if (i >= o_.warmup) lat.push_back(now_us() - t0);
      round_trips.store(i + 1, std::memory_order_relaxed);
    }
    Row r{"send/recv round trip", 4, 1, 1000};
    summarize(lat, r);
    print(r);
  }

  // Application thread to provider: from the submit call to the first (and last) WRITE posted.
  void post_cost() {
    engine_.take_post_timings();
    auto run = [&](const std::string& name, auto submit, size_t writes) {
      std::vector<double> first, last;
      std::atomic<uint64_t> posted{0};
      auto pass = progress_.pass(name, 64 * writes, 1000 + o_.warmup, posted);
      for (int i = 0; i < 1000 + static_cast<int>(o_.warmup); i++) {
        std::atomic<int> f{kDonePending};
        submit(OnDone::flag(&f));
        f.wait(kDonePending);
        if (i < static_cast<int>(o_.warmup)) engine_.take_post_timings();
        posted.store(i + 1, std::memory_order_relaxed);
      }
      for (auto& t : engine_.take_post_timings()) {
        first.push_back(t.first_post_ns / 1000.0);
        last.push_back(t.last_post_ns / 1000.0);
      }
      Row a{name + " first post", 0, writes, first.size()}, b{name + " all posted", 0, writes, last.size()};
      summarize(first, a);
      summarize(last, b);
      print(a);
      print(b);
    };
    run("post single 64B", [&](OnDone d) {
      engine_.submit(SingleWrite{.len = 64, .src = {src_handle_, 0}, .dst = {remotes_[0], 0}}, std::move(d));
    }, 1);
    // To a peer group (prebuilt WRITE templates) and to a plain list of regions.
    std::vector<GroupSlice> slices(remotes_.size(), GroupSlice{64, 0, 0});
    run(fmt::format("post scatter {}x64B", slices.size()), [&](OnDone d) {
      engine_.submit(GroupScatter{.group = group_, .src = src_handle_, .slices = slices}, std::move(d));
    }, slices.size());
    std::vector<ScatterSlice> plain;
    for (auto& r : remotes_) plain.push_back({64, 0, {r, 0}});
    run(fmt::format("post list scatter {}x64B", plain.size()), [&](OnDone d) {
      engine_.submit(Scatter{.src = src_handle_, .slices = plain}, std::move(d));
    }, plain.size());
  }

  // A measurement's name on the progress line: single's table name has no size.
  static std::string label(const Row& r) {
    return r.test == "single" ? fmt::format("single {}", r.bytes) : r.test;
  }

  void print(const Row& r) {
    // The link speed is in Gbit/s (as NICs report it), the figure in GB/s: 8 bits a byte.
    std::string link =
        link_gbps_ > 0 && r.gb_per_s > 0 ? fmt::format("{:.1f}", 100 * r.gb_per_s * 8 / link_gbps_) : "-";
    progress_.row([&] {
      fmt::print("{:<24} {:>10} {:>7} {:>7} {:>10.2f} {:>10.2f} {:>10.2f} {:>9.4f} {:>7} {:>9.4f} {}\n", r.test,
                 r.bytes, r.writes, r.iters, r.avg_us, r.p50_us, r.p99_us, r.gb_per_s, link, r.mops, r.verified);
      std::fflush(stdout);
    });
    rows_.push_back(r);
    if (r.verified == "BAD") failed_verify_ = true;
  }

  void write_json() {
    std::ofstream out(o_.json);
    out << "{\n  \"provider\": \"" << o_.provider << "\",\n  \"nics\": " << engine_.nic_count()
        << ",\n  \"link_gbps\": " << link_gbps_ << ",\n  \"results\": [\n";
    for (size_t i = 0; i < rows_.size(); i++) {
      const Row& r = rows_[i];
      out << fmt::format(
          "    {{\"test\": \"{}\", \"bytes\": {}, \"writes\": {}, \"iters\": {}, \"avg_us\": {:.3f}, "
          "\"p50_us\": {:.3f}, \"p99_us\": {:.3f}, \"gb_per_s\": {:.4f}, \"mops\": {:.5f}, \"verified\": \"{}\"}}{}\n",
          r.test, r.bytes, r.writes, r.iters, r.avg_us, r.p50_us, r.p99_us, r.gb_per_s, r.mops, r.verified,
          i + 1 < rows_.size() ? "," : "");
    }
    out << "  ]\n}\n";
  }

 public:
  bool failed_verify_ = false;

 private:
  const Options& o_;
  TransferEngine engine_;
  double link_gbps_ = 0;  // Gbit/s: --link-gbps, else the sum of the NICs' reported speeds
  Control ctl_;
  std::vector<MrDesc> descs_;
  std::vector<RemoteMr> remotes_;  // descs_, interned
  std::vector<uint8_t> src_, pong_buf_;
  MrHandle src_handle_;
  MrDesc pong_desc_;
  PeerGroupHandle group_;
  uint32_t next_imm_ = 0x1000;
  std::vector<Row> rows_;
  // Last, so it goes first: a run that throws clears its line before the engine closes (and logs).
  Progress progress_;
};

}  // namespace

int run_client(const Options& o, const std::string& server_hex) {
  Client c(o, server_hex);
  c.run();
  return c.failed_verify_ ? 1 : 0;
}

}  // namespace fabric::bench
