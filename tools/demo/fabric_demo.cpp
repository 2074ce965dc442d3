// fabric-demo: the main job on an embedded default. Two engine processes on this machine (a
// "prefill" sender and a "decode" receiver) exchange addresses, the sender pushes rounds of paged
// WRITEs with immediates into random pages of the receiver's buffer, the receiver counts the
// immediates, verifies every byte and reports back with a two-sided message.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "fabric/fabric.h"
#include "paged_rounds.h"
#include "process_pair.h"

using fabric::tools::pattern;
using fabric::tools::round_permutation;

using namespace fabric;
using tools::Channel;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string provider = "tcp;ofi_rxm";
  std::vector<std::string> nics = {"127.0.0.1"};
  uint64_t page_kib = 64;
  uint32_t pages = 512;   // per half of the destination
  uint32_t rounds = 32;
  bool busy = false;
  bool host_ipc = false;
  size_t window = 64;
};

constexpr uint32_t kImm = 0xFAB00001;

EngineConfig engine_config(const Options& o) {
  EngineConfig c;
  c.provider = o.provider;
  c.nics.clear();
  for (auto& n : o.nics) c.nics.push_back(NicConfig{"", n});
  c.worker_poll = o.busy ? PollMode::kBusy : PollMode::kAdaptive;
  c.callback_poll = PollMode::kAdaptive;
  c.max_in_flight_per_nic = o.window;
  c.host_ipc = o.host_ipc;
  return c;
}

int run_receiver(const Options& o, Channel& ch) {
  TransferEngine engine(engine_config(o));
  const uint64_t page = o.page_kib * 1024;
  tools::WorkloadBuffer dst(2 * o.pages * page);
  auto [handle, desc] = engine.reg_mr(dst.data(), dst.size());
  std::atomic<int> reply_sent{kDonePending};
  ch.send(engine.main_address().to_bytes());
  ch.send(desc.to_bytes());
  NetAddr sender = NetAddr::from_bytes(ch.recv_bytes());

  std::atomic<int> all_arrived{kDonePending};
  uint64_t expected = uint64_t{o.rounds} * o.pages;  // one immediate per page WRITE
  engine.expect_imm_count(kImm, expected, OnDone::flag(&all_arrived));
  auto deadline = Clock::now() + std::chrono::seconds(120);
  while (all_arrived.load(std::memory_order_acquire) == kDonePending && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // not timed: stay off the cores
  bool arrived = all_arrived.load() == kDoneSucceeded;

  // The last two rounds cover both halves: every destination byte has a known value.
  uint64_t bad = 0;
  for (uint32_t r = o.rounds >= 2 ? o.rounds - 2 : 0; r < o.rounds && arrived; r++) {
    auto perm = round_permutation(r, o.pages);
    for (uint32_t i = 0; i < o.pages; i++)
      for (uint64_t b = 0; b < page; b++)
        if (dst[perm[i] * page + b] != pattern(i * page + b)) bad++;
  }
  std::string verdict = fmt::format("receiver counted {} immediates; verified {} bytes: {}",
                                    arrived ? expected : engine.imm_count(kImm),
                                    o.rounds >= 2 ? dst.size() : o.pages * page,
                                    arrived && bad == 0 ? "OK" : fmt::format("FAILED ({} bad bytes)", bad));
  engine.submit_send(sender, std::as_bytes(std::span(verdict)), OnDone::flag(&reply_sent));
  while (reply_sent.load() == kDonePending) std::this_thread::sleep_for(std::chrono::microseconds(100));
  ch.recv();  // the sender has the verdict: safe to close
  engine.dereg_mr(handle);
  return arrived && bad == 0 && reply_sent.load() == kDoneSucceeded ? 0 : 1;
}

int run_sender(const Options& o, Channel& ch) {
  TransferEngine engine(engine_config(o));
  const uint64_t page = o.page_kib * 1024;
  tools::WorkloadBuffer src(o.pages * page);
  for (uint64_t b = 0; b < src.size(); b++) src[b] = pattern(b);
  auto [handle, desc] = engine.reg_mr(src.data(), src.size());
  NetAddr receiver = NetAddr::from_bytes(ch.recv_bytes());
  MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
  ch.send(engine.main_address().to_bytes());

  std::string verdict;
  std::atomic<int> got_verdict{0};
  engine.submit_recvs(4096, 4, [&](std::span<const std::byte> msg) {
    verdict.assign(reinterpret_cast<const char*>(msg.data()), msg.size());
    got_verdict.store(1, std::memory_order_release);
  });

  std::vector<uint32_t> src_idx(o.pages);
  for (uint32_t i = 0; i < o.pages; i++) src_idx[i] = i;
  Pages src_pages{src_idx, page, 0};
  const RemoteMr dst_remote = engine.add_remote(dst);
  std::vector<std::atomic<int>> round_done(o.rounds);
  for (auto& f : round_done) f.store(kDonePending);

  auto wait_round = [&](uint32_t r) {
    round_done[r].wait(kDonePending, std::memory_order_acquire);  // the engine notifies flags
    return round_done[r].load() == kDoneSucceeded;
  };
  bool ok = true;
  auto t0 = Clock::now();
  for (uint32_t r = 0; r < o.rounds && ok; r++) {
    if (r >= 2) ok = wait_round(r - 2);  // same half of the destination: let it land first
    const std::vector<uint32_t> dst_idx = round_permutation(r, o.pages);
    engine.submit(PagedWrites{.page_len = page, .src = handle, .src_pages = src_pages, .dst = dst_remote,
                              .dst_pages = {dst_idx, page, 0}, .imm = kImm},
                  OnDone::flag(&round_done[r]));
  }
  for (uint32_t r = o.rounds >= 2 ? o.rounds - 2 : 0; r < o.rounds && ok; r++) ok = wait_round(r);
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();

  uint64_t ops = uint64_t{o.rounds} * o.pages, bytes = ops * page;
  fmt::print("fabric-demo: provider {}, {} NIC(s) per side{}, {} KiB pages, two processes\n",
             engine.main_address().provider(), engine.nic_count(), o.host_ipc ? " and host_ipc" : "", o.page_kib);
  fmt::print("moved {:.1f} MiB in {} paged WRITEs ({} rounds x {} pages) in {:.3f} s: {:.2f} GB/s, "
             "{:.3f} M ops/s\n",
             bytes / 1048576.0, ops, o.rounds, o.pages, secs, bytes / secs / 1e9, ops / secs / 1e6);
  auto deadline = Clock::now() + std::chrono::seconds(120);
  while (!got_verdict.load(std::memory_order_acquire) && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  fmt::print("{}\n", got_verdict.load() ? verdict : "no verdict from the receiver");
  ch.send("bye");
  engine.dereg_mr(handle);
  return ok && got_verdict.load() && verdict.ends_with(": OK") ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fabric-demo: paged WRITEs with immediates between two engine processes"};
  app.add_option("--provider", o.provider, "libfabric provider (tcp;ofi_rxm, shm, efa)");
  app.add_option("--nics", o.nics, "one source address per NIC (tcp), e.g. 127.0.0.2 127.0.0.3")
      ->expected(1, 4);
  app.add_option("--page-kib", o.page_kib, "page size in KiB")->check(CLI::Range(1, 65536));
  app.add_option("--pages", o.pages, "pages per round")->check(CLI::Range(1, 65536));
  app.add_option("--rounds", o.rounds, "rounds of paged writes")->check(CLI::Range(1, 100000));
  app.add_flag("--busy", o.busy, "busy-poll the workers (default: adaptive)");
  app.add_flag("--host-ipc", o.host_ipc,
               "the bytes go through the host_ipc local domain (the sender's process_vm_writev into the "
               "receiver's pages); the provider carries the rest");
  app.add_option("--window", o.window, "WRITEs in flight per NIC")->check(CLI::Range(1, 65536));
  CLI11_PARSE(app, argc, argv);
  if (o.provider == "shm") o.nics.assign(o.nics.size(), "");

  auto result = tools::run_process_pair([&](Channel& ch) { return run_sender(o, ch); },
                                        [&](Channel& ch) { return run_receiver(o, ch); });
  if (!result.ok()) {
    fmt::print(stderr, "fabric-demo FAILED (sender rc {}, receiver status {})\n", result.parent_rc,
               result.child_status);
    return 1;
  }
  return 0;
}
