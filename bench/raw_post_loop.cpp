// raw-post-loop: the baseline for the engine's posting figures (`fabric-bench local --only post`):
// a bare libfabric loop that posts one 64-byte fi_write to each of N peers, timed from before the
// first call to after the last one returned, on the endpoint setup the engine uses. The N peers are
// N endpoints of a second process that only drives their completion queues (shm needs the target
// to progress). No engine, no queue, no worker: what is left of the engine's "all posted" above this
// is the engine's own cost.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "process_pair.h"
#include "raw_endpoint.h"

using fabric::bench::check;
using fabric::bench::Endpoint;
using fabric::bench::RemoteRegion;
using fabric::tools::Channel;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string provider = "shm";
  std::string node = "127.0.0.1";
  uint32_t peers = 64;
  uint32_t iters = 1000;
  uint32_t warmup = 100;
};

constexpr size_t kLen = 64;

// The targets: one endpoint and one buffer per peer, driven until the sender says it is done.
int run_targets(const Options& o, Channel& ch) {
  std::vector<std::unique_ptr<Endpoint>> eps;
  std::vector<std::vector<uint8_t>> bufs(o.peers, std::vector<uint8_t>(4096));
  for (uint32_t i = 0; i < o.peers; i++) {
    eps.push_back(std::make_unique<Endpoint>(o.provider, o.node));
    RemoteRegion r = eps.back()->register_buffer(bufs[i].data(), bufs[i].size());
    ch.send(eps.back()->name());
    ch.send(std::string(reinterpret_cast<const char*>(&r), sizeof r));
  }
  std::string sender = ch.recv();
  for (auto& ep : eps) ep->insert_peer(sender);  // as the engine does
  fi_cq_data_entry entries[64];
  uint64_t rounds = 0;
  while (++rounds % 256 != 0 || !ch.readable())
    for (auto& ep : eps) ep->poll(entries);
  ch.recv();
  return 0;
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

int run_sender(const Options& o, Channel& ch) {
  Endpoint ep(o.provider, o.node);
  std::vector<uint8_t> src(kLen, 0xAB);
  ep.register_buffer(src.data(), src.size());
  std::vector<fi_addr_t> peers;
  std::vector<RemoteRegion> regions(o.peers);
  for (uint32_t i = 0; i < o.peers; i++) {
    peers.push_back(ep.insert_peer(ch.recv()));
    std::string r = ch.recv();
    if (r.size() != sizeof(RemoteRegion)) throw std::runtime_error("bad region message");
    std::memcpy(&regions[i], r.data(), sizeof(RemoteRegion));
  }
  ch.send(ep.name());

  std::vector<fi_context2> ctx(o.peers);
  fi_cq_data_entry entries[64];
  std::vector<double> first_us, all_us;
  uint64_t completed = 0;  // every completion counts, also those read while retrying a post
  for (uint32_t it = 0; it < o.warmup + o.iters; it++) {
    auto t0 = Clock::now();
    Clock::time_point t_first;
    for (uint32_t i = 0; i < o.peers; i++) {
      for (;;) {
        ssize_t rc = fi_write(ep.ep(), src.data(), kLen, ep.desc(), peers[i], regions[i].base,
                              regions[i].key, &ctx[i]);
        if (rc == 0) break;
        if (rc != -FI_EAGAIN) check("fi_write", rc);
        completed += ep.poll(entries);  // the provider's queue is full: drive it (timed, as in the engine)
      }
      if (i == 0) t_first = Clock::now();
    }
    auto t_all = Clock::now();
    while (completed < uint64_t{it + 1} * o.peers) completed += ep.poll(entries);
    if (it < o.warmup) continue;
    first_us.push_back(std::chrono::duration<double, std::micro>(t_first - t0).count());
    all_us.push_back(std::chrono::duration<double, std::micro>(t_all - t0).count());
  }
  fmt::print("raw-libfabric: provider {}, one 64-byte fi_write to each of {} peers, {} iterations\n",
             ep.provider(), o.peers, o.iters);
  fmt::print("raw post {}x64B first post p50 {:.2f} us p99 {:.2f} us\n", o.peers,
             percentile(first_us, 0.5), percentile(first_us, 0.99));
  fmt::print("raw post {}x64B all posted p50 {:.2f} us p99 {:.2f} us\n", o.peers,
             percentile(all_us, 0.5), percentile(all_us, 0.99));
  ch.send("done");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"raw-post-loop: N WRITEs to N peers on raw libfabric (baseline for --only post)"};
  app.add_option("--provider", o.provider, "libfabric provider (tcp;ofi_rxm, shm)");
  app.add_option("--node", o.node, "source address to bind (ignored for shm)");
  app.add_option("--peers", o.peers, "peers, one WRITE each")->check(CLI::Range(1, 1024));
  app.add_option("--iters", o.iters, "timed iterations")->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", o.warmup, "untimed iterations first")->check(CLI::Range(0, 1000000));
  CLI11_PARSE(app, argc, argv);
  if (o.provider == "shm") o.node.clear();

  auto result = fabric::tools::run_process_pair([&](Channel& ch) { return run_sender(o, ch); },
                                                [&](Channel& ch) { return run_targets(o, ch); });
  if (!result.ok()) {
    fmt::print(stderr, "raw-post-loop FAILED (sender rc {}, targets status {})\n", result.parent_rc,
               result.child_status);
    return 1;
  }
  return 0;
}
