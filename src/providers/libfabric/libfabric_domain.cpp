// libfabric Domain. Translates every libfabric return code into fabric::Error at this boundary,
// naming the call that failed.
#include "providers/libfabric/libfabric_domain.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <unordered_map>

#include "util/log.h"

namespace fabric {
namespace {

constexpr uint64_t kSupportedMrMode =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;
constexpr size_t kScratchLen = 64;

std::string fi_message(const char* call, long rc) {
  return fmt::format("{} failed: {} ({})", call, fi_strerror(static_cast<int>(-rc)), rc);
}

void check(const char* call, long rc) {
  if (rc != 0) throw Error(ErrorCode::kProvider, fi_message(call, rc));
}

class LibfabricDomain final : public Domain {
 public:
  LibfabricDomain(const EngineConfig& config, size_t nic_index) {
    const NicConfig& nic = config.nics.at(nic_index);
    // An engine that serves a GPU asks for FI_HMEM (GPU memory registration, EFA and verbs-based
    // providers have it); a provider without it still serves host memory.
    if (config.cuda_device) {
      try {
        info_ = pick_info(config.provider, nic, FI_HMEM);
      } catch (const Error&) {
        log::info("nic {}: provider {} offers no FI_HMEM: host memory only", nic_index, config.provider);
      }
    }
    if (!info_) info_ = pick_info(config.provider, nic, 0);
    provider_ = info_->fabric_attr->prov_name;
    mr_mode_ = info_->domain_attr->mr_mode;
    if (info_->mode & FI_RX_CQ_DATA)
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("provider {} requires FI_RX_CQ_DATA (immediates consuming receive "
                              "buffers), which fabric-lib does not support",
                              provider_));

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

    char name[512];
    size_t name_len = sizeof name;
    check("fi_getname", fi_getname(&ep_->fid, name, &name_len));
    address_.assign(name, name_len);

    scratch_ = std::aligned_alloc(64, kScratchLen);
    std::memset(scratch_, 0, kScratchLen);
    scratch_region_ = register_memory(scratch_, kScratchLen, Device::host());

    char straddr[256];
    size_t straddr_len = sizeof straddr;
    fi_av_straddr(av_, name, straddr, &straddr_len);
    log::info("nic {}: provider={} domain={} addr={} mr_mode=0x{:x} tx_size={} inject={}",
              nic_index, provider_, info_->domain_attr->name, straddr, mr_mode_,
              info_->tx_attr->size, info_->tx_attr->inject_size);
  }

  ~LibfabricDomain() override {
    if (ep_) fi_close(&ep_->fid);
    if (scratch_region_.provider) fi_close(&static_cast<fid_mr*>(scratch_region_.provider)->fid);
    if (av_) fi_close(&av_->fid);
    if (cq_) fi_close(&cq_->fid);
    if (domain_) fi_close(&domain_->fid);
    if (fabric_) fi_close(&fabric_->fid);
    if (info_) fi_freeinfo(info_);
    std::free(scratch_);
  }

  const std::string& provider_name() const override { return provider_; }
  const std::string& address() const override { return address_; }

  DomainRegion register_memory(void* ptr, size_t len, Device device) override {
    if (device.kind == Device::Kind::kCuda && !(info_->caps & FI_HMEM))
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("provider {} cannot register CUDA memory (no FI_HMEM; set "
                              "EngineConfig::cuda_device so it is asked for, or use efa/verbs)",
                              provider_));
    fid_mr* mr = nullptr;
    // Least privilege: the engine only WRITEs and SENDs. No FI_REMOTE_READ: a peer cannot read
    // a registered region, only write it.
    uint64_t access = FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    iovec iov{ptr, len};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    if (device.kind == Device::Kind::kCuda) {
      attr.iface = FI_HMEM_CUDA;
      attr.device.cuda = device.index;
    }
    // Without FI_MR_PROV_KEY the application chooses keys; they must be unique per domain. Random
    // keys (as wide as the provider allows) are not guessable by a peer that was never given the
    // region's MrDesc; a collision (-FI_ENOKEY) draws again.
    int rc = 0;
    for (int attempt = 0; attempt < 8; attempt++) {
      attr.requested_key = (mr_mode_ & FI_MR_PROV_KEY) ? 0 : random_key();
      rc = fi_mr_regattr(domain_, &attr, 0, &mr);
      if (rc != -FI_ENOKEY) break;
    }
    check("fi_mr_regattr", rc);
    if (mr_mode_ & FI_MR_ENDPOINT) {
      long rc = fi_mr_bind(mr, &ep_->fid, 0);
      if (rc == 0) rc = fi_mr_enable(mr);
      if (rc != 0) {
        fi_close(&mr->fid);
        check("fi_mr_bind/fi_mr_enable", rc);
      }
    }
    DomainRegion r;
    r.provider = mr;
    r.desc = fi_mr_desc(mr);
    r.remote.rkey = fi_mr_key(mr);
    r.remote.base = (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(ptr) : 0;
    return r;
  }

  void deregister_memory(DomainRegion& region) override {
    if (region.provider) check("fi_close(mr)", fi_close(&static_cast<fid_mr*>(region.provider)->fid));
    region = {};
  }

  PeerId insert_peer(const std::string& address) override {
    auto it = peers_.find(address);
    if (it != peers_.end()) return it->second;
    fi_addr_t fi_addr = FI_ADDR_UNSPEC;
    int n = fi_av_insert(av_, address.data(), 1, &fi_addr, 0, nullptr);
    if (n != 1)
      throw Error(ErrorCode::kProvider,
                  fmt::format("fi_av_insert of a peer address ({} bytes) failed ({}): is the peer "
                              "using the same provider ({})?",
                              address.size(), n, provider_));
    peers_.emplace(address, fi_addr);
    return fi_addr;
  }

  // The AV entry goes; completions of operations still posted to it carry only our context.
  void remove_peer(PeerId peer) override {
    for (auto it = peers_.begin(); it != peers_.end(); ++it) {
      if (it->second != peer) continue;
      fi_addr_t a = peer;
      int rc = fi_av_remove(av_, &a, 1, 0);
      if (rc != 0) log::warn("fi_av_remove failed: {}", fi_strerror(-rc));
      peers_.erase(it);
      return;
    }
  }

  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    ssize_t rc = op.has_imm
                     ? fi_writedata(ep_, op.src, op.len, op.desc, op.imm, op.peer, op.remote_addr,
                                    op.rkey, ctx)
                     : fi_write(ep_, op.src, op.len, op.desc, op.peer, op.remote_addr, op.rkey, ctx);
    return result(op.has_imm ? "fi_writedata" : "fi_write", rc);
  }

  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc,
                       OpContext* ctx) override {
    return result("fi_send", fi_send(ep_, buf, len, desc, peer, ctx));
  }

  PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) override {
    return result("fi_recv", fi_recv(ep_, buf, len, desc, FI_ADDR_UNSPEC, ctx));
  }

  const std::string& last_error() const override { return last_error_; }

  size_t poll(std::span<Completion> out) override {
    fi_cq_data_entry entries[64];
    size_t want = std::min(out.size(), std::size(entries));
    ssize_t n = fi_cq_read(cq_, entries, want);
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) return read_error(out);
    if (n < 0) {
      out[0] = Completion{Completion::Kind::kError, nullptr, 0, 0, fi_message("fi_cq_read", n)};
      return 1;
    }
    for (ssize_t i = 0; i < n; i++) {
      const fi_cq_data_entry& e = entries[i];
      Completion& c = out[i];
      c.error.clear();
      if (e.flags & FI_RECV) {
        c.kind = Completion::Kind::kRecv;
        c.context = static_cast<OpContext*>(e.op_context);
        c.len = e.len;
      } else if (e.flags & FI_REMOTE_CQ_DATA) {
        c.kind = Completion::Kind::kRemoteImm;
        c.context = nullptr;
        c.imm = static_cast<uint32_t>(e.data);  // 8 bytes on tcp/shm, 4 on EFA
      } else {
        c.kind = Completion::Kind::kLocal;
        c.context = static_cast<OpContext*>(e.op_context);
      }
    }
    return static_cast<size_t>(n);
  }

  void* scratch_desc() const override { return scratch_region_.desc; }
  void* scratch_buffer() const override { return scratch_; }

 private:
  static fi_info* pick_info(const std::string& provider, const NicConfig& nic, uint64_t extra_caps) {
    fi_info* hints = fi_allocinfo();
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA | extra_caps;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = kSupportedMrMode;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;  // one worker thread owns the domain
    hints->domain_attr->cq_data_size = 4;
    hints->fabric_attr->prov_name = strdup(provider.c_str());
    if (!nic.node.empty()) hints->addr_format = FI_SOCKADDR_IN;
    fi_info* list = nullptr;
    const char* node = nic.node.empty() ? nullptr : nic.node.c_str();
    int rc = fi_getinfo(FI_VERSION(1, 17), node, nullptr, node ? FI_SOURCE : 0, hints, &list);
    fi_freeinfo(hints);
    if (rc != 0)
      throw Error(ErrorCode::kProvider,
                  fmt::format("fi_getinfo found no provider '{}'{} with FI_EP_RDM, FI_RMA, FI_MSG "
                              "and remote CQ data: {} ({}). Check the provider name "
                              "(efa, tcp;ofi_rxm, shm) and `fi_info -p <name>`",
                              provider, node ? fmt::format(" for node {}", node) : "",
                              fi_strerror(-rc), rc));
    // tcp and net ignore the domain-name hint: pick the entry ourselves.
    fi_info* pick = list;
    if (!nic.domain.empty())
      while (pick && std::strcmp(pick->domain_attr->name, nic.domain.c_str()) != 0) pick = pick->next;
    if (!pick) {
      fi_freeinfo(list);
      throw Error(ErrorCode::kNotFound,
                  fmt::format("provider '{}' has no domain named '{}' (see `fi_info -p {}`)",
                              provider, nic.domain, provider));
    }
    fi_info* info = fi_dupinfo(pick);
    fi_freeinfo(list);
    return info;
  }

  uint64_t random_key() {
    size_t bytes = std::min<size_t>(info_->domain_attr->mr_key_size, 8);
    uint64_t mask = bytes >= 8 ? ~0ull : (1ull << (8 * bytes)) - 1;
    uint64_t key = 0;
    while (key == 0) key = key_rng_() & mask;
    return key;
  }

  PostResult result(const char* call, ssize_t rc) {
    if (rc == 0) return PostResult::kPosted;
    if (rc == -FI_EAGAIN) return PostResult::kRetry;  // the worker keeps polling: progress
    last_error_ = fi_message(call, rc);
    return PostResult::kFailed;
  }

  size_t read_error(std::span<Completion> out) {
    fi_cq_err_entry err{};
    ssize_t rc = fi_cq_readerr(cq_, &err, 0);
    if (rc < 0) return 0;
    const char* prov_msg = fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0);
    Completion& c = out[0];
    c.kind = Completion::Kind::kError;
    c.context = static_cast<OpContext*>(err.op_context);
    c.error = fmt::format("{} completion error: {} (provider: {})", provider_,
                          fi_strerror(err.err), prov_msg ? prov_msg : "-");
    return 1;
  }

  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  std::string provider_;
  std::string address_;
  uint64_t mr_mode_ = 0;
  std::mt19937_64 key_rng_{std::random_device{}()};
  std::unordered_map<std::string, fi_addr_t> peers_;
  std::string last_error_;
  void* scratch_ = nullptr;
  DomainRegion scratch_region_;
};

}  // namespace

std::unique_ptr<Domain> open_libfabric_domain(const EngineConfig& config, size_t nic_index) {
  return std::make_unique<LibfabricDomain>(config, nic_index);
}

}  // namespace fabric
