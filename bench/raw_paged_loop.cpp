// raw-paged-loop: the fabric-demo workload (rounds of paged WRITEs with immediates) on bare
// libfabric, one endpoint per process, no engine: the baseline for the engine's numbers.
#include <fmt/format.h>
#include <poll.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "paged_rounds.h"
#include "process_pair.h"

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
  uint32_t window = 64;  // WRITEs outstanding at most
};

constexpr uint64_t kImm = 0xFAB00001;

void check(const char* call, long rc) {
  if (rc != 0)
    throw std::runtime_error(
        fmt::format("{} failed: {} ({})", call, fi_strerror(static_cast<int>(-rc)), rc));
}

// What the receiver tells the sender about its destination buffer.
struct RemoteRegion {
  uint64_t key;
  uint64_t base;  // added to byte offsets: the virtual address with FI_MR_VIRT_ADDR, else 0
};

// The fids of an Endpoint, closed in reverse order of opening. A base class so that they are
// closed also when the Endpoint constructor throws half-way (shm leaves files in /dev/shm
// otherwise).
struct EndpointFids {
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  fid_mr* mr_ = nullptr;
  EndpointFids() = default;
  EndpointFids(const EndpointFids&) = delete;
  EndpointFids& operator=(const EndpointFids&) = delete;
  ~EndpointFids() {
    if (ep_) fi_close(&ep_->fid);
    if (mr_) fi_close(&mr_->fid);
    if (av_) fi_close(&av_->fid);
    if (cq_) fi_close(&cq_->fid);
    if (domain_) fi_close(&domain_->fid);
    if (fabric_) fi_close(&fabric_->fid);
    if (info_) fi_freeinfo(info_);
  }
};

// One RDM endpoint with its CQ and AV, opened with the hints and mr_mode handling of
// src/providers/libfabric/libfabric_domain.cpp.
class Endpoint : EndpointFids {
 public:
  Endpoint(const std::string& provider, const std::string& node) {
    fi_info* hints = fi_allocinfo();
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->cq_data_size = 4;
    hints->fabric_attr->prov_name = strdup(provider.c_str());
    if (!node.empty()) hints->addr_format = FI_SOCKADDR_IN;  // tcp: bind to this source address
    const char* n = node.empty() ? nullptr : node.c_str();
    int rc = fi_getinfo(FI_VERSION(1, 17), n, nullptr, n ? FI_SOURCE : 0, hints, &info_);
    fi_freeinfo(hints);
    check("fi_getinfo", rc);
    if (info_->mode & FI_RX_CQ_DATA) throw std::runtime_error("provider requires FI_RX_CQ_DATA");
    check("fi_fabric", fi_fabric(info_->fabric_attr, &fabric_, nullptr));
    check("fi_domain", fi_domain(fabric_, info_, &domain_, nullptr));
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = 16384;
    cq_attr.wait_obj = FI_WAIT_NONE;
    check("fi_cq_open", fi_cq_open(domain_, &cq_attr, &cq_, nullptr));
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    check("fi_av_open", fi_av_open(domain_, &av_attr, &av_, nullptr));
    check("fi_endpoint", fi_endpoint(domain_, info_, &ep_, nullptr));
    check("fi_ep_bind(cq)", fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV));
    check("fi_ep_bind(av)", fi_ep_bind(ep_, &av_->fid, 0));
    check("fi_enable", fi_enable(ep_));
  }

  std::string name() const {
    char buf[512];
    size_t len = sizeof buf;
    check("fi_getname", fi_getname(&ep_->fid, buf, &len));
    return {buf, len};
  }
  const char* provider() const { return info_->fabric_attr->prov_name; }

  // Registers the one buffer of this endpoint.
  RemoteRegion register_buffer(void* ptr, size_t len) {
    uint64_t mr_mode = info_->domain_attr->mr_mode;
    uint64_t access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    uint64_t key = (mr_mode & FI_MR_PROV_KEY) ? 0 : 1;  // without PROV_KEY the application picks
    check("fi_mr_reg", fi_mr_reg(domain_, ptr, len, access, 0, key, 0, &mr_, nullptr));
    if (mr_mode & FI_MR_ENDPOINT) {
      check("fi_mr_bind", fi_mr_bind(mr_, &ep_->fid, 0));
      check("fi_mr_enable", fi_mr_enable(mr_));
    }
    return {fi_mr_key(mr_), (mr_mode & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(ptr) : 0};
  }
  void* desc() const { return fi_mr_desc(mr_); }

  fi_addr_t insert_peer(const std::string& name) {
    fi_addr_t addr = FI_ADDR_UNSPEC;
    if (fi_av_insert(av_, name.data(), 1, &addr, 0, nullptr) != 1)
      throw std::runtime_error("fi_av_insert failed");
    return addr;
  }

  // Reads up to 64 completions into `out`; a completion error throws.
  size_t poll(fi_cq_data_entry (&out)[64]) {
    ssize_t n = fi_cq_read(cq_, out, 64);
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      fi_cq_readerr(cq_, &err, 0);
      throw std::runtime_error(
          fmt::format("completion error: {} (provider: {})", fi_strerror(err.err),
                      fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0)));
    }
    if (n < 0) check("fi_cq_read", n);
    return static_cast<size_t>(n);
  }

  fid_ep* ep() const { return ep_; }
};

bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

// Manual progress: keep driving the CQ while waiting on the out-of-band channel, in case the peer
// still needs this side's progress to finish.
std::string recv_progressing(Channel& ch, Endpoint& ep) {
  fi_cq_data_entry entries[64];
  while (!readable(ch.fd())) ep.poll(entries);
  return ch.recv();
}

int run_receiver(const Options& o, Channel& ch) {
  Endpoint ep(o.provider, o.node);
  const uint64_t page = o.page_kib * 1024;
  std::vector<uint8_t> dst(2 * o.pages * page, 0);
  RemoteRegion region = ep.register_buffer(dst.data(), dst.size());
  ch.send(ep.name());
  ch.send(std::string(reinterpret_cast<const char*>(&region), sizeof region));
  ep.insert_peer(ch.recv());  // as the engine does; rxm/shm also accept writes from unknown peers

  // Count immediates until every page WRITE has landed; give up on a deadline or if the sender
  // closed the channel (it failed).
  const uint64_t expected = uint64_t{o.rounds} * o.pages;
  uint64_t imms = 0, wrong_imm = 0, idle = 0;
  auto deadline = Clock::now() + std::chrono::seconds(120);
  fi_cq_data_entry entries[64];
  while (imms < expected) {
    size_t n = ep.poll(entries);
    for (size_t i = 0; i < n; i++)
      if (entries[i].flags & FI_REMOTE_CQ_DATA) {
        imms++;
        if (static_cast<uint32_t>(entries[i].data) != static_cast<uint32_t>(kImm)) wrong_imm++;
      }
    if (n == 0 && ++idle % 4096 == 0 && (Clock::now() > deadline || readable(ch.fd()))) break;
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
  recv_progressing(ch, ep);  // the sender is done with its endpoint: safe to close ours
  return ok ? 0 : 1;
}

int run_sender(const Options& o, Channel& ch) {
  Endpoint ep(o.provider, o.node);
  const uint64_t page = o.page_kib * 1024;
  std::vector<uint8_t> src(o.pages * page);
  for (uint64_t b = 0; b < src.size(); b++) src[b] = pattern(b);
  ep.register_buffer(src.data(), src.size());
  fi_addr_t peer = ep.insert_peer(ch.recv());
  RemoteRegion dst{};
  std::string region = ch.recv();
  if (region.size() != sizeof dst) throw std::runtime_error("bad region message");
  std::memcpy(&dst, region.data(), sizeof dst);
  ch.send(ep.name());

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
  auto progress = [&] {
    size_t n = ep.poll(entries);
    for (size_t i = 0; i < n; i++) {
      auto* s = reinterpret_cast<Slot*>(entries[i].op_context);  // ctx is the first member
      left[s->round]--;
      free_slots.push_back(s);
    }
    completed += n;
  };

  auto t0 = Clock::now();
  for (uint32_t r = 0; r < o.rounds; r++) {
    if (r >= 2)
      while (left[r - 2] > 0) progress();  // same half of the destination: let it land first
    auto perm = round_permutation(r, o.pages);
    for (uint32_t i = 0; i < o.pages; i++) {
      while (free_slots.empty()) progress();
      Slot* s = free_slots.back();
      s->round = r;
      for (;;) {
        ssize_t rc = fi_writedata(ep.ep(), src.data() + i * page, page, ep.desc(), kImm, peer,
                                  dst.base + perm[i] * page, dst.key, &s->ctx);
        if (rc == 0) break;
        if (rc != -FI_EAGAIN) check("fi_writedata", rc);
        progress();  // the provider's queue is full: drain it
      }
      free_slots.pop_back();
    }
  }
  const uint64_t ops = uint64_t{o.rounds} * o.pages;
  while (completed < ops) progress();
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();

  uint64_t bytes = ops * page;
  fmt::print("raw-libfabric: provider {}, {} KiB pages, window {}, two processes\n", ep.provider(),
             o.page_kib, o.window);
  fmt::print(
      "moved {:.1f} MiB in {} paged WRITEs ({} rounds x {} pages) in {:.3f} s: {:.2f} GB/s, "
      "{:.3f} M ops/s\n",
      bytes / 1048576.0, ops, o.rounds, o.pages, secs, bytes / secs / 1e9, ops / secs / 1e6);
  std::string verdict = recv_progressing(ch, ep);
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
  CLI11_PARSE(app, argc, argv);
  if (o.provider == "shm") o.node.clear();

  auto result = fabric::tools::run_process_pair([&](Channel& ch) { return run_sender(o, ch); },
                                                [&](Channel& ch) { return run_receiver(o, ch); });
  if (!result.ok()) {
    fmt::print(stderr, "raw-paged-loop FAILED (sender rc {}, receiver status {})\n",
               result.parent_rc, result.child_status);
    return 1;
  }
  return 0;
}
