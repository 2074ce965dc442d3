// raw-paged-loop: the fabric-demo workload (rounds of paged WRITEs with immediates) on bare
// libfabric, no engine: the baseline for the engine's numbers. One thread per process drives
// `lanes` endpoints (one by default; each its own domain and connection), WRITE i on lane i % lanes.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "paged_rounds.h"
#include "process_pair.h"
#include "raw_endpoint.h"

using fabric::bench::check;
using fabric::bench::Endpoint;
using fabric::bench::RemoteRegion;
using fabric::tools::pattern;
using fabric::tools::round_permutation;

using fabric::tools::Channel;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string provider = "tcp;ofi_rxm";
  std::string node = "127.0.0.1";
  uint64_t page_kib = 64;
  uint32_t pages = 512;  // per half of the destination
  uint32_t rounds = 32;
  uint32_t window = 64;  // WRITEs outstanding at most, over all lanes
  uint32_t lanes = 1;
  std::vector<std::string> lane_nodes;  // one source address per lane; default: `node` for each
  bool delivery_complete = false;
};

using Lanes = std::vector<std::unique_ptr<Endpoint>>;

Lanes open_lanes(const Options& o) {
  Lanes eps;
  for (uint32_t l = 0; l < o.lanes; l++)
    eps.push_back(std::make_unique<Endpoint>(o.provider, o.lane_nodes.empty() ? o.node : o.lane_nodes[l],
                                             o.delivery_complete ? FI_DELIVERY_COMPLETE : 0));
  return eps;
}

constexpr uint64_t kImm = 0xFAB00001;

// Manual progress: keep driving the CQ while waiting on the out-of-band channel, in case the peer
// still needs this side's progress to finish.
std::string recv_progressing(Channel& ch, Lanes& eps) {
  fi_cq_data_entry entries[64];
  while (!ch.readable())
    for (auto& ep : eps) ep->poll(entries);
  return ch.recv();
}

int run_receiver(const Options& o, Channel& ch) {
  Lanes eps = open_lanes(o);
  const uint64_t page = o.page_kib * 1024;
  fabric::tools::WorkloadBuffer dst(2 * o.pages * page);
  for (auto& ep : eps) {  // the same buffer, registered once per lane's domain
    RemoteRegion region = ep->register_buffer(dst.data(), dst.size());
    ch.send(ep->name());
    ch.send(std::string(reinterpret_cast<const char*>(&region), sizeof region));
  }
  for (auto& ep : eps)
    ep->insert_peer(ch.recv());  // as the engine does; rxm/shm also accept writes from unknown peers

  // Count immediates until every page WRITE has landed; give up on a deadline or if the sender
  // closed the channel (it failed).
  const uint64_t expected = uint64_t{o.rounds} * o.pages;
  uint64_t imms = 0, wrong_imm = 0, idle = 0;
  auto deadline = Clock::now() + std::chrono::seconds(120);
  fi_cq_data_entry entries[64];
  while (imms < expected) {
    size_t polled = 0;
    for (auto& ep : eps) {
      size_t n = ep->poll(entries);
      polled += n;
      for (size_t i = 0; i < n; i++)
        if (entries[i].flags & FI_REMOTE_CQ_DATA) {
          imms++;
          if (static_cast<uint32_t>(entries[i].data) != static_cast<uint32_t>(kImm)) wrong_imm++;
        }
    }
    if (polled == 0 && ++idle % 4096 == 0 && (Clock::now() > deadline || ch.readable())) break;
  }

  // The last two rounds cover both halves: every destination byte has a known value.
  uint64_t bad = 0;
  for (uint32_t r = o.rounds >= 2 ? o.rounds - 2 : 0; r < o.rounds && imms == expected; r++) {
    auto perm = round_permutation(r, o.pages);
    for (uint32_t i = 0; i < o.pages; i++)
      for (uint64_t b = 0; b < page; b++)
        if (dst[perm[i] * page + b] != pattern(i * page + b)) bad++;
  }
  bool ok = imms == expected && wrong_imm == 0 && bad == 0;
  ch.send(fmt::format("verified {} bytes: {}", o.rounds >= 2 ? dst.size() : o.pages * page,
                      ok ? "OK"
                         : fmt::format("FAILED ({}/{} immediates, {} wrong, {} bad bytes)", imms,
                                       expected, wrong_imm, bad)));
  recv_progressing(ch, eps);  // the sender is done with its endpoints: safe to close ours
  return ok ? 0 : 1;
}

int run_sender(const Options& o, Channel& ch) {
  Lanes eps = open_lanes(o);
  const uint64_t page = o.page_kib * 1024;
  fabric::tools::WorkloadBuffer src(o.pages * page);
  for (uint64_t b = 0; b < src.size(); b++) src[b] = pattern(b);
  std::vector<fi_addr_t> peer;
  std::vector<RemoteRegion> dst(o.lanes);
  for (uint32_t l = 0; l < o.lanes; l++) {
    eps[l]->register_buffer(src.data(), src.size());
    peer.push_back(eps[l]->insert_peer(ch.recv()));
    std::string region = ch.recv();
    if (region.size() != sizeof dst[l]) throw std::runtime_error("bad region message");
    std::memcpy(&dst[l], region.data(), sizeof dst[l]);
  }
  for (auto& ep : eps) ch.send(ep->name());

  // One fi_context2 per window slot (the provider owns it until the completion), tagged with its
  // round so completions can be counted per round.
  struct Slot {
    fi_context2 ctx;
    uint32_t round;
  };
  std::vector<Slot> slots(o.window);
  std::vector<Slot*> free_slots;
  for (auto& s : slots) free_slots.push_back(&s);
  std::vector<uint32_t> left(o.rounds, o.pages);  // WRITEs of each round not yet completed locally
  uint64_t completed = 0;
  fi_cq_data_entry entries[64];
  // A run that stops completing fails after 60 s instead of spinning forever (scripts run it
  // under a lock other jobs wait for).
  std::vector<uint64_t> posted_on(o.lanes), completed_on(o.lanes);
  uint64_t idle = 0;
  auto last_completion = Clock::now();
  auto progress = [&] {
    size_t got = 0;
    for (uint32_t l = 0; l < o.lanes; l++) {
      size_t n = eps[l]->poll(entries);
      for (size_t i = 0; i < n; i++) {
        auto* s = reinterpret_cast<Slot*>(entries[i].op_context);  // ctx is the first member
        left[s->round]--;
        free_slots.push_back(s);
      }
      completed += n;
      completed_on[l] += n;
      got += n;
    }
    if (got) {
      last_completion = Clock::now();
    } else if (++idle % 4096 == 0 && Clock::now() - last_completion > std::chrono::seconds(60)) {
      std::string lanes;
      for (uint32_t l = 0; l < o.lanes; l++)
        lanes += fmt::format(" lane {}: {}/{}", l, completed_on[l], posted_on[l]);
      throw std::runtime_error(
          fmt::format("no completion for 60 s ({} of {} WRITEs completed;{})", completed,
                      uint64_t{o.rounds} * o.pages, lanes));
    }
  };

  auto t0 = Clock::now();
  for (uint32_t r = 0; r < o.rounds; r++) {
    if (r >= 2)
      while (left[r - 2] > 0) progress();  // same half of the destination: let it land first
    auto perm = round_permutation(r, o.pages);
    for (uint32_t i = 0; i < o.pages; i++) {
      while (free_slots.empty()) progress();
      // Taken off the free list before posting: a retry's progress() pushes completed slots.
      Slot* s = free_slots.back();
      free_slots.pop_back();
      s->round = r;
      const uint32_t l = i % o.lanes;
      Endpoint& ep = *eps[l];
      for (;;) {
        ssize_t rc = fi_writedata(ep.ep(), src.data() + i * page, page, ep.desc(), kImm, peer[l],
                                  dst[l].base + perm[i] * page, dst[l].key, &s->ctx);
        if (rc == 0) break;
        if (rc != -FI_EAGAIN) check("fi_writedata", rc);
        progress();  // the provider's queue is full: drain it
      }
      posted_on[l]++;
    }
  }
  const uint64_t ops = uint64_t{o.rounds} * o.pages;
  while (completed < ops) progress();
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();

  uint64_t bytes = ops * page;
  fmt::print("raw-libfabric: provider {}, {} KiB pages, window {}, {} lane(s){}, two processes\n",
             eps[0]->provider(), o.page_kib, o.window, o.lanes,
             o.delivery_complete ? ", delivery complete" : "");
  fmt::print(
      "moved {:.1f} MiB in {} paged WRITEs ({} rounds x {} pages) in {:.3f} s: {:.2f} GB/s, "
      "{:.3f} M ops/s\n",
      bytes / 1048576.0, ops, o.rounds, o.pages, secs, bytes / secs / 1e9, ops / secs / 1e6);
  std::string verdict = recv_progressing(ch, eps);
  fmt::print("{}\n", verdict);
  ch.send("bye");
  return verdict.ends_with(": OK") ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"raw-paged-loop: the fabric-demo workload on raw libfabric (baseline)"};
  app.add_option("--provider", o.provider, "libfabric provider (tcp;ofi_rxm, shm, efa)");
  app.add_option("--node", o.node, "source address to bind (ignored for shm)");
  app.add_option("--page-kib", o.page_kib, "page size in KiB")->check(CLI::Range(1, 65536));
  app.add_option("--pages", o.pages, "pages per round")->check(CLI::Range(1, 65536));
  app.add_option("--rounds", o.rounds, "rounds of paged writes")->check(CLI::Range(1, 100000));
  app.add_option("--window", o.window, "WRITEs outstanding at most")->check(CLI::Range(1, 8192));
  app.add_option("--lanes", o.lanes, "endpoints (connections) per process, WRITEs round-robin")
      ->check(CLI::Range(1, 16));
  app.add_flag("--delivery-complete", o.delivery_complete,
               "FI_DELIVERY_COMPLETE as the engine asks on tcp (a WRITE completes once placed)");
  app.add_option("--lane-nodes", o.lane_nodes, "one source address per lane (sets --lanes)")
      ->expected(1, 16);
  CLI11_PARSE(app, argc, argv);
  if (!o.lane_nodes.empty()) o.lanes = static_cast<uint32_t>(o.lane_nodes.size());
  if (o.provider == "shm") o.node.clear(), o.lane_nodes.assign(o.lane_nodes.size(), "");

  auto result = fabric::tools::run_process_pair([&](Channel& ch) { return run_sender(o, ch); },
                                                [&](Channel& ch) { return run_receiver(o, ch); });
  if (!result.ok()) {
    fmt::print(stderr, "raw-paged-loop FAILED (sender rc {}, receiver status {})\n",
               result.parent_rc, result.child_status);
    return 1;
  }
  return 0;
}
