// fabric-soak: mixed traffic (single, paged, scatter, barrier, send/recv) from one driver engine to
// 4 peer processes for SOAK_MINUTES, with injected faults on every engine and one peer killed
// (SIGKILL) and restarted at a new address half way through. Every byte of every transfer reported
// successful is checked by its peer; resident memory is sampled. Ends with
//   soak transfers=<n> bytes=<n> faults=<n> lost=<n> leaked_kib=<n>
// and a non-zero exit if anything was lost or memory grew beyond --max-leak-kib.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <map>
#include <mutex>
#include <thread>

#include "process_pair.h"
#include "soak_plan.h"

using namespace fabric;
using namespace fabric::soak;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  double minutes = 10;
  double seconds = 0;  // overrides minutes when set
  uint32_t peers = 4;
  std::string provider = "tcp;ofi_rxm";
  std::vector<std::string> nics;
  uint64_t seed = 1;
  uint64_t max_leak_kib = 16384;
  bool no_faults = false;  // for comparison runs
  // peer role
  int fd = -1;
  uint32_t index = 0;
};

EngineConfig engine_config(const Options& o, bool driver, uint32_t index) {
  EngineConfig c;
  c.provider = o.provider;
  c.nics.clear();
  std::vector<std::string> nics = o.nics;
  if (nics.empty()) nics = {o.provider == "shm" || o.provider == "verbs" ? "" : "127.0.0.1"};
  for (auto& n : nics) c.nics.push_back(o.provider == "verbs" ? NicConfig{n, ""} : NicConfig{"", n});
  c.worker_poll = c.callback_poll = PollMode::kAdaptive;  // five processes on few cores
  // Short, so that a stuck operation holds its round up only briefly; long enough for a busy
  // 2-core machine (a timed-out transfer is a failure, never counted as lost).
  c.transfer_timeout = std::chrono::milliseconds(1500);
  c.faults.enabled = !o.no_faults;
  c.faults.seed = o.seed * 100 + (driver ? 0 : 1 + index);
  if (driver) {
    c.faults.post_failure = 0.002;
    c.faults.completion_error = 0.002;
    c.faults.stuck = 0.0002;
  } else {
    c.faults.duplicate_imm = 0.002;
    c.faults.delay_imm = 0.01;
    c.faults.max_delay_polls = 64;
  }
  return c;
}

template <class T>
std::string encode(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof v);
}
template <class T>
T decode(const std::string& s) {
  T v{};
  if (s.size() != sizeof v) throw std::runtime_error("soak: bad control message");
  std::memcpy(&v, s.data(), sizeof v);
  return v;
}

bool wait_for(const std::function<bool()>& done, std::chrono::milliseconds limit) {
  auto end = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// ---- peer ----------------------------------------------------------------------------------

int run_peer(const Options& o) {
  tools::Channel ch(o.fd);
  const size_t nics = std::max<size_t>(1, o.nics.size());
  TransferEngine engine(engine_config(o, false, o.index));
  std::vector<uint8_t> region(kPeerLen, 0);
  auto [h, desc] = engine.reg_mr(region.data(), region.size());

  std::mutex mu;
  std::map<uint32_t, std::vector<uint32_t>> seen;  // round -> times each message arrived
  uint64_t corrupt = 0;
  engine.submit_recvs(kMaxMessage, 64, [&](std::span<const std::byte> bytes) {
    std::string m(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    uint32_t header[2] = {};
    if (m.size() >= sizeof header) std::memcpy(header, m.data(), sizeof header);
    uint32_t round = header[0], i = header[1] & 0xFFFF;
    std::lock_guard lock(mu);
    if ((header[1] >> 16) != o.index || i >= kMessagesPerRound || m != message(round, o.index, i)) {
      corrupt++;
      return;
    }
    auto& v = seen[round];
    v.resize(kMessagesPerRound);
    v[i]++;
  });
  ch.send(desc.to_bytes());

  const uint32_t imms[4] = {kImmSingle, kImmPaged, kImmScatter, kImmBarrier};
  uint64_t base[4] = {};
  for (;;) {
    std::string cmd = ch.recv();
    if (cmd == "bye") break;
    RoundReport rep = decode<RoundReport>(cmd);
    RoundPlan plan(o.seed, rep.round, o.index);
    PeerReply reply;
    const uint8_t ok[4] = {rep.single_ok, rep.paged_ok, rep.scatter_ok, rep.barrier_ok};
    const uint64_t expected[4] = {single_write_imm_count(plan.single_len, nics, false), kPagesPerRound, 1, 1};
    // Bytes of one kind, checked against the round's source pattern.
    auto check = [&](int kind) -> uint64_t {
      uint64_t bytes = 0;
      bool good = true;
      auto same = [&](uint64_t dst, uint64_t src, uint64_t len) {
        for (uint64_t k = 0; k < len && good; k++) good = region[dst + k] == source_byte(rep.round, src + k);
        bytes += len;
      };
      if (kind == 0) same(plan.single_dst, plan.single_src, plan.single_len);
      if (kind == 1)
        for (uint32_t i = 0; i < kPagesPerRound; i++)
          same(plan.dst_pages().offset + plan.dst_pages().stride * plan.dst_idx[i],
               plan.src_pages().offset + plan.src_pages().stride * plan.src_idx[i], kPageLen);
      if (kind == 2) same(kScatterArea, plan.slice_src, kSliceLen);
      return good ? bytes : UINT64_MAX;
    };
    for (int kind = 0; kind < 4; kind++) {
      if (!ok[kind]) continue;
      // The immediates say the data landed; a duplicated immediate may say so early, so a
      // mismatch is looked at again for a while before it counts as lost.
      bool arrived = wait_for([&] { return engine.imm_count(imms[kind]) - base[kind] >= expected[kind]; },
                              std::chrono::seconds(10));
      uint64_t bytes = UINT64_MAX;
      if (arrived) wait_for([&] { return (bytes = check(kind)) != UINT64_MAX; }, std::chrono::seconds(2));
      if (!arrived || bytes == UINT64_MAX) {
        reply.lost++;
        std::fprintf(stderr, "soak peer %u: round %u kind %d lost (%s)\n", o.index, rep.round, kind,
                     arrived ? "bytes differ" : "immediates missing");
      } else {
        reply.verified_bytes += bytes;
      }
    }
    for (uint32_t i = 0; i < kMessagesPerRound; i++) {
      if (!(rep.messages_ok >> i & 1)) continue;
      auto count = [&] {
        std::lock_guard lock(mu);
        auto it = seen.find(rep.round);
        return it == seen.end() ? 0u : it->second[i];
      };
      if (!wait_for([&] { return count() > 0; }, std::chrono::seconds(10))) {
        reply.lost++;
        std::fprintf(stderr, "soak peer %u: round %u message %u lost\n", o.index, rep.round, i);
      } else {
        reply.verified_bytes += message(rep.round, o.index, i).size();
      }
    }
    // Delayed immediates of failed transfers land within a few polls: let them, then re-base.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int kind = 0; kind < 4; kind++) base[kind] = engine.imm_count(imms[kind]);
    {
      std::lock_guard lock(mu);
      for (auto& [round, counts] : seen)
        if (round + 2 < rep.round)
          for (uint32_t c : counts) reply.duplicated_messages += c > 1;
      seen.erase(seen.begin(), seen.lower_bound(rep.round > 2 ? rep.round - 2 : 0));
      reply.lost += corrupt;
      corrupt = 0;
    }
    reply.rss_kib = resident_kib();
    for (auto& s : engine.nic_stats()) reply.faults_injected += s.faults_injected;
    ch.send(encode(reply));
  }
  return 0;
}

// ---- driver --------------------------------------------------------------------------------

struct PeerProcess {
  pid_t pid = -1;
  std::unique_ptr<tools::Channel> ch;
  MrDesc desc;
  RemoteMr remote;  // desc, interned by the driver
  uint64_t warm_rss = 0, last_rss = 0, faults = 0;
};

PeerProcess spawn_peer(const Options& o, uint32_t index) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw std::runtime_error("socketpair failed");
  std::vector<std::string> args = {"fabric-soak", "peer", "--fd", std::to_string(sv[1]), "--index",
                                   std::to_string(index), "--seed", std::to_string(o.seed), "--provider", o.provider};
  if (o.no_faults) args.push_back("--no-faults");
  if (!o.nics.empty()) {
    args.push_back("--nics");
    for (auto& n : o.nics) args.push_back(n);
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid == 0) {  // only async-signal-safe calls until exec: the driver has threads
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    fcntl(sv[1], F_SETFD, 0);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  close(sv[1]);
  PeerProcess p;
  p.pid = pid;
  p.ch = std::make_unique<tools::Channel>(sv[0]);
  p.desc = MrDesc::from_bytes(p.ch->recv_bytes());
  return p;
}

struct Totals {
  uint64_t transfers = 0, bytes = 0, lost = 0, faults_of_dead = 0, leaked_kib = 0;
};

int run_driver(const Options& o) {
  const double seconds = o.seconds > 0 ? o.seconds : o.minutes * 60;
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };

  std::vector<PeerProcess> peers;
  for (uint32_t p = 0; p < o.peers; p++) peers.push_back(spawn_peer(o, p));
  TransferEngine engine(engine_config(o, true, 0));
  std::vector<uint8_t> src(kSrcLen);
  auto [h, my_desc] = engine.reg_mr(src.data(), src.size());
  for (auto& p : peers) p.remote = engine.add_remote(p.desc);
  auto make_group = [&] {
    std::vector<RemoteMr> members;
    for (auto& p : peers) members.push_back(p.remote);
    return engine.add_peer_group(members);
  };
  PeerGroupHandle group = make_group();

  Totals t;
  const uint32_t victim = o.peers - 1;
  bool restarted = false;
  uint64_t warm_rss = 0;
  std::vector<uint64_t> samples;
  double next_sample = seconds * 0.1;
  uint32_t round = 0;
  while (elapsed() < seconds) {
    round++;
    for (uint64_t i = 0; i < kSrcLen; i++) src[i] = source_byte(round, i);  // nothing reads it now

    struct PerPeer {
      std::atomic<int> single{kDonePending}, paged{kDonePending};
      std::atomic<uint32_t> messages_ok{0}, messages_done{0};
    };
    std::vector<PerPeer> st(o.peers);
    std::atomic<int> scatter{kDonePending}, barrier{kDonePending};
    std::vector<GroupSlice> slices;
    for (uint32_t p = 0; p < o.peers; p++) {
      RoundPlan plan(o.seed, round, p);
      engine.submit(SingleWrite{.len = plan.single_len, .src = {h, plan.single_src}, .dst = {peers[p].remote, plan.single_dst}, .imm = kImmSingle},
                    OnDone::flag(&st[p].single));
      engine.submit(PagedWrites{.page_len = kPageLen, .src = h, .src_pages = plan.src_pages(), .dst = peers[p].remote, .dst_pages = plan.dst_pages(), .imm = kImmPaged},
                    OnDone::flag(&st[p].paged));
      slices.push_back({kSliceLen, plan.slice_src, kScatterArea});
      for (uint32_t i = 0; i < kMessagesPerRound; i++) {
        std::string m = message(round, p, i);
        engine.submit_send(peers[p].desc.owner(), std::as_bytes(std::span(m)),
                           OnDone::callback([&st, p, i](const Status& s) {
                             if (s.ok()) st[p].messages_ok.fetch_or(1u << i);
                             st[p].messages_done++;
                           }));
      }
    }
    engine.submit(GroupScatter{.group = group, .src = h, .slices = slices, .imm = kImmScatter},
                  OnDone::flag(&scatter));
    t.transfers += o.peers * (2 + kMessagesPerRound) + 2;
    bool kill_now = !restarted && elapsed() >= seconds / 2;
    if (kill_now) {
      kill(peers[victim].pid, SIGKILL);  // mid-round: its transfers are in flight
      std::fprintf(stderr, "soak: round %u: peer %u killed\n", round, victim);
    }
    auto ended = [](const std::atomic<int>& f) { return f.load() != kDonePending; };
    bool finished = wait_for([&] {
      for (auto& s : st)
        if (!ended(s.single) || !ended(s.paged)) return false;
      return ended(scatter);
    }, std::chrono::seconds(60));
    engine.submit(GroupBarrier{.group = group, .imm = kImmBarrier}, OnDone::flag(&barrier));  // follows the data
    finished = finished && wait_for([&] {
      for (auto& s : st)
        if (s.messages_done.load() < kMessagesPerRound) return false;
      return ended(barrier);
    }, std::chrono::seconds(60));
    if (!finished) {
      std::fprintf(stderr, "soak: round %u: transfers did not end within 60 s (a hang)\n", round);
      t.lost++;
      break;
    }

    for (uint32_t p = 0; p < o.peers; p++) {  // all peers check at once
      if (kill_now && p == victim) continue;
      RoundReport rep{round, static_cast<uint8_t>(st[p].single.load() == kDoneSucceeded),
                      static_cast<uint8_t>(st[p].paged.load() == kDoneSucceeded),
                      static_cast<uint8_t>(scatter.load() == kDoneSucceeded),
                      static_cast<uint8_t>(barrier.load() == kDoneSucceeded), st[p].messages_ok.load()};
      peers[p].ch->send(encode(rep));
    }
    for (uint32_t p = 0; p < o.peers; p++) {
      if (kill_now && p == victim) continue;
      PeerReply r = decode<PeerReply>(peers[p].ch->recv());
      t.bytes += r.verified_bytes;
      t.lost += r.lost + r.duplicated_messages;
      peers[p].faults = r.faults_injected;
      peers[p].last_rss = r.rss_kib;
      // Growth is measured over the last quarter of the run (the restarted peer: the last tenth),
      // once pools, queues and provider buffers have reached their working size (tcp;ofi_rxm's
      // buffer pools take a few thousand rounds to; on shm memory is flat from the start).
      double warm_at = p == victim && restarted ? 0.9 : 0.75;
      if (!peers[p].warm_rss && elapsed() >= seconds * warm_at) peers[p].warm_rss = r.rss_kib;
    }
    if (kill_now) {
      tools::reap(peers[victim].pid);
      t.faults_of_dead += peers[victim].faults;
      close(peers[victim].ch->fd());
      engine.remove_remote(peers[victim].remote);
      peers[victim] = spawn_peer(o, victim);
      peers[victim].remote = engine.add_remote(peers[victim].desc);
      group = make_group();  // the new incarnation's region
      restarted = true;
      std::fprintf(stderr, "soak: round %u: peer %u restarted at a new address\n", round, victim);
    }
    if (elapsed() >= next_sample) {
      uint64_t rss = resident_kib();
      if (!warm_rss && elapsed() >= seconds * 0.75) warm_rss = rss;
      samples.push_back(rss);
      uint64_t faults = t.faults_of_dead;
      for (auto& s : engine.nic_stats()) faults += s.faults_injected;
      for (auto& p : peers) faults += p.faults;
      std::string peer_rss;
      for (auto& p : peers) peer_rss += fmt::format("{}{}", peer_rss.empty() ? "" : ",", p.last_rss);
      std::printf("soak t=%.0fs rounds=%u transfers=%lu faults=%lu lost=%lu rss_kib=%lu peers_rss_kib=%s\n",
                  elapsed(), round, static_cast<unsigned long>(t.transfers), static_cast<unsigned long>(faults),
                  static_cast<unsigned long>(t.lost), static_cast<unsigned long>(rss), peer_rss.c_str());
      std::fflush(stdout);
      next_sample += seconds * 0.1;
    }
  }

  for (auto& p : peers) {
    p.ch->send(std::string("bye"));
    int status = tools::reap(p.pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "soak: a peer exited abnormally (status %d)\n", status);
      t.lost++;
    }
    if (p.warm_rss) t.leaked_kib += p.last_rss - std::min(p.last_rss, p.warm_rss);
  }
  uint64_t faults = t.faults_of_dead;
  for (auto& s : engine.nic_stats()) faults += s.faults_injected;
  for (auto& p : peers) faults += p.faults;
  uint64_t end_rss = resident_kib();
  if (warm_rss) t.leaked_kib += end_rss - std::min(end_rss, warm_rss);
  std::string series;
  for (uint64_t s : samples) series += fmt::format(" {}", s);
  std::printf("soak driver rss_kib samples:%s (end %lu); restarts=%d rounds=%u\n", series.c_str(),
              static_cast<unsigned long>(end_rss), restarted ? 1 : 0, round);
  std::printf("soak transfers=%lu bytes=%lu faults=%lu lost=%lu leaked_kib=%lu\n",
              static_cast<unsigned long>(t.transfers), static_cast<unsigned long>(t.bytes),
              static_cast<unsigned long>(faults), static_cast<unsigned long>(t.lost),
              static_cast<unsigned long>(t.leaked_kib));
  std::fflush(stdout);
  bool ok = t.lost == 0 && t.leaked_kib <= o.max_leak_kib && (faults > 0 || o.no_faults) && restarted;
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fabric-soak: mixed traffic with injected faults and a peer restart, every byte checked"};
  app.add_option("--minutes", o.minutes, "duration (SOAK_MINUTES)");
  app.add_option("--seconds", o.seconds, "duration in seconds (overrides --minutes)");
  app.add_option("--peers", o.peers, "peer processes (at least 2)")->check(CLI::Range(2, 16));
  app.add_option("--provider", o.provider);
  app.add_option("--nics", o.nics, "per NIC: source address (tcp) or device (verbs)")->expected(1, 4);
  app.add_option("--seed", o.seed, "fault and traffic seed (a failing run replays with it)");
  app.add_option("--max-leak-kib", o.max_leak_kib, "fail if resident memory grows more than this");
  app.add_flag("--no-faults", o.no_faults, "inject nothing (a comparison run)");
  auto* peer = app.add_subcommand("peer", "(internal) one peer process");
  peer->add_option("--fd", o.fd)->required();
  peer->add_option("--index", o.index)->required();
  peer->add_option("--seed", o.seed);
  peer->add_option("--provider", o.provider);
  peer->add_option("--nics", o.nics)->expected(1, 4);
  peer->add_flag("--no-faults", o.no_faults);
  CLI11_PARSE(app, argc, argv);
  try {
    return peer->parsed() ? run_peer(o) : run_driver(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fabric-soak: %s\n", e.what());
    return 1;
  }
}
