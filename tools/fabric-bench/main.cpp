// fabric-bench: server/client benchmark of the TransferEngine. `server` prints its address;
// `client ADDR` runs the sweeps against it; `local` runs both on this machine (two processes);
// `topo` prints the host's topology (fabric::detect_topology).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <csignal>
#include <cstdio>
#include <map>
#include <unistd.h>

#include "bench_options.h"
#include "fabric/topology.h"
#include "process_pair.h"

using namespace fabric::bench;

namespace {
void on_alarm(int) {
  const char msg[] = "fabric-bench: no progress for 600 s, giving up\n";
  (void)!write(2, msg, sizeof msg - 1);
  _exit(2);
}
}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string server_addr;
  CLI::App app{"fabric-bench: TransferEngine benchmarks (single, paged, scatter, barrier, latency)"};
  app.require_subcommand(1);
  auto add_common = [&](CLI::App* c) {
    c->add_option("--provider", o.provider, "verbs, or a libfabric provider (tcp;ofi_rxm, shm, efa)");
    c->add_option("--nics", o.nics, "per NIC: a source address (tcp), a device name (verbs); '' for the default")
        ->expected(1, 4);
    c->add_flag("--busy", o.busy, "busy-poll the client's worker");
    c->add_flag("--server-busy", o.server_busy, "busy-poll the server's first engine");
    c->add_option("--peers", o.peers, "server engines (scatter and barrier destinations)");
    c->add_option("--buffer-mib", o.buffer_mib, "destination region of the first server engine");
    c->add_option("--peer-buffer-mib", o.peer_buffer_mib, "destination region of the other server engines");
    c->add_option("--link-gbps", o.link_gbps, "link speed in Gbit/s (as NICs report it) for the % column, which compares the GB/s column "
                  "with it x 8 (default: the sum of what the NICs report)");
    c->add_option("--target-mib", o.target_mib, "bytes moved per bandwidth measurement");
    c->add_option("--min-iters", o.min_iters);
    c->add_option("--max-iters", o.max_iters);
    c->add_option("--warmup", o.warmup, "untimed transfers before each latency pass");
    c->add_option("--window", o.window, "transfers in flight in bandwidth passes");
    c->add_flag("--verify", o.verify, "check every byte on the server after each bandwidth pass");
    c->add_option("--timeout-ms", o.timeout_ms,
                  "fail a transfer, and the client's wait for a control reply, after this long "
                  "(EngineConfig::transfer_timeout; default 30000 and 300 s)");
    c->add_option("--json", o.json, "write every figure to this file");
    c->add_option("--only", o.only, "single paged scatter barrier imm msg post");
    c->add_option("--single-sizes", o.single_sizes, "bytes");
    c->add_option("--page-sizes", o.page_sizes, "bytes");
    c->add_option("--page-counts", o.page_counts);
    c->add_option("--scatter-len", o.scatter_len, "bytes to each scatter destination");
    c->add_option("--peer-idle-us", o.peer_idle_us, "idle sleep of the server's extra engines");
  };
  auto* server = app.add_subcommand("server", "host the destinations; prints the address to pass to the client");
  auto* client = app.add_subcommand("client", "run the sweeps against a server");
  client->add_option("address", server_addr, "the server's address (hex)")->required();
  auto* local = app.add_subcommand("local", "server and client as two processes on this machine");
  for (auto* c : {server, client, local}) add_common(c);
  for (auto* c : {client, local})
    c->add_option("--progress", o.progress,
                  "a progress line on stderr (rate, bytes moved, ETA): auto (the default) shows it "
                  "on a terminal after 2 s and never when stdout or stderr is not one")
        ->transform(CLI::CheckedTransformer(
            std::map<std::string, ProgressMode>{{"auto", ProgressMode::kAuto},
                                                {"always", ProgressMode::kAlways},
                                                {"never", ProgressMode::kNever}}));
  std::string sysfs_root = "/sys";
  auto* topo = app.add_subcommand("topo", "print this host's GPUs, RDMA NICs and cores as detect_topology assigns them");
  topo->add_option("--sysfs", sysfs_root, "the sysfs root to read (a materialised fixture in tests)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (topo->parsed()) {
    try {
      fmt::print("{}", fabric::detect_topology({.sysfs_root = sysfs_root}).to_table());
      return 0;
    } catch (const std::exception& e) {
      fmt::print(stderr, "fabric-bench topo: {}\n", e.what());
      return 1;
    }
  }
  bool nics_given = false;
  for (auto* c : {server, client, local}) nics_given |= c->count("--nics") > 0;
  if (o.provider == "shm" || (o.provider == "verbs" && !nics_given)) o.nics.assign(o.nics.size(), "");
  std::signal(SIGALRM, on_alarm);

  try {
    if (server->parsed())
      return run_server(o, [](const std::string& hex) {
        fmt::print("fabric-bench server ready: {}\n", hex);
        std::fflush(stdout);
      });
    if (client->parsed()) return run_client(o, server_addr);
    auto r = fabric::tools::run_process_pair(
        [&](fabric::tools::Channel& ch) { return run_client(o, ch.recv()); },
        [&](fabric::tools::Channel& ch) { return run_server(o, [&](const std::string& hex) { ch.send(hex); }); });
    return r.ok() ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "fabric-bench: {}\n", e.what());
    return 1;
  }
}
