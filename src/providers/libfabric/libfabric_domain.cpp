// libfabric Domain. Translates every libfabric return code into fabric::Error at this boundary,
// naming the call that failed.
#include "providers/libfabric/libfabric_domain.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "providers/libfabric/fi_compat.h"
#include "providers/libfabric/provider_attrs.h"
#include "providers/libfabric/shm_key_board.h"
#include "providers/libfabric/shm_names.h"
#include "providers/libfabric/shm_senders.h"
#include "util/log.h"
#ifdef FABRIC_WITH_CUDA
#include "cuda/driver_api.h"
#endif

namespace fabric {
namespace {

static_assert(sizeof(OpContext::provider_space) >= sizeof(fi_context2),
              "OpContext::provider_space is the operation's fi_context2");

constexpr uint64_t kSupportedMrMode =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;
constexpr size_t kScratchLen = 64;
// WRITEs longer than the provider's max_msg_size in progress at once, and their pieces with the
// provider at once (each piece needs its own operation context). Beyond either, post_write
// answers kRetry / the pieces wait for earlier ones to complete.
constexpr size_t kMaxSplits = 256;
constexpr size_t kMaxPieces = 1024;


std::string fi_message(const char* call, long rc) {
  return fmt::format("{} failed: {} ({})", call, fi_strerror(static_cast<int>(-rc)), rc);
}

void check(const char* call, long rc) {
  if (rc != 0) throw Error(ErrorCode::kProvider, fi_message(call, rc));
}

class LibfabricDomain final : public Domain {
 public:
  LibfabricDomain(const EngineConfig& config, size_t nic_index, const LibfabricHook* hook)
      : hook_(hook) {
    try {
      open(config, nic_index);
    } catch (...) {
      close_all();
      throw;
    }
  }

  ~LibfabricDomain() override { close_all(); }

  const std::string& provider_name() const override { return provider_; }
  const std::string& address() const override { return address_; }
  const DomainCaps& caps() const override { return caps_; }

  DomainRegion register_memory(void* ptr, size_t len, Device device) override {
    const bool gpu = device.kind == Device::Kind::kCuda;
    if (gpu && !(attrs_.caps & FI_HMEM))
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("provider {} cannot register CUDA memory (no FI_HMEM; set "
                              "EngineConfig::cuda_device so it is asked for, or use efa/verbs)",
                              provider_));
    // Least privilege: the engine only WRITEs and SENDs. No FI_REMOTE_READ: a peer cannot read
    // a registered region, only write it.
    const uint64_t access = FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    fi_mr_attr attr{};
    attr.access = access;
    attr.iov_count = 1;
    if (gpu) {
      attr.iface = FI_HMEM_CUDA;
      attr.device.cuda = device.index;
    }
    fid_mr* mr = gpu && dmabuf_ ? register_dmabuf(attr, ptr, len) : nullptr;
    if (!mr) {
      iovec iov{ptr, len};
      attr.mr_iov = &iov;
      const int rc = regattr(attr, 0, &mr);
      // Some builds advertise FI_HMEM without a CUDA memory interface behind it (Debian's
      // libfabric 1.17 shm says -FI_ENOSYS here): that domain cannot reach CUDA memory, which
      // the DomainGroup then leaves to the domains that can (cuda_ipc), as for no FI_HMEM.
      if (gpu && (rc == -FI_ENOSYS || rc == -FI_EOPNOTSUPP))
        throw Error(ErrorCode::kUnsupported,
                    fmt::format("provider {} offers FI_HMEM but cannot register CUDA memory (fi_mr_regattr: {})",
                                provider_, fi_strerror(-rc)));
      check("fi_mr_regattr", rc);
    }
    if (attrs_.mr_mode & FI_MR_ENDPOINT) {
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
    r.remote.base = (attrs_.mr_mode & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(ptr) : 0;
    return r;
  }

  void deregister_memory(DomainRegion& region) override {
    // A split WRITE from the region posts no more pieces (its descriptor is about to go stale);
    // it fails once those posted have completed.
    for (size_t i = 0; splits_ && region.desc && i < kMaxSplits; i++) {
      Split& s = splits_[i];
      if (s.parent && s.op.desc == region.desc && !s.failed && s.posted < s.op.len) {
        fail_split(s, "its source region was deregistered while the WRITE was being posted");
        enqueue(s);
      }
    }
    // Peers refuse the key before the registration goes (shm_key_board.h).
    if (key_board_ && region.provider) key_board_->revoke(region.remote.rkey);
    if (region.provider) check("fi_close(mr)", fi_close(&static_cast<fid_mr*>(region.provider)->fid));
    region = {};
  }

  PeerId insert_peer(const std::string& address) override {
    if (shm_) return shm_->insert_peer(address);
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
  // A split WRITE to it posts no more pieces and fails once those posted have completed.
  void remove_peer(PeerId peer) override {
    if (shm_) return shm_->remove_peer(peer);
    for (size_t i = 0; splits_ && i < kMaxSplits; i++) {
      Split& s = splits_[i];
      if (s.parent && s.op.peer == peer && !s.failed && s.posted < s.op.len) {
        fail_split(s, "the peer was removed while the WRITE was being posted");
        enqueue(s);  // the next poll reports it once nothing of it is with the provider
      }
    }
    for (auto it = peers_.begin(); it != peers_.end(); ++it) {
      if (it->second != peer) continue;
      fi_addr_t a = peer;
      int rc = fi_av_remove(av_, &a, 1, 0);
      if (rc != 0) log::warn("fi_av_remove failed: {}", fi_strerror(-rc));
      peers_.erase(it);
      return;
    }
  }

  // One provider operation, or (longer than max_msg_size) several: see post_split.
  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    if (shm_) return shm_->write(op, ctx, last_error_);  // shm: max_msg_size is unbounded
    if (op.len > max_msg_) return post_split(op, ctx);
    ssize_t rc = write_op(op.src, op.len, op.desc, op.peer, op.remote_addr, op.rkey, op.has_imm,
                          op.imm, ctx);
    return result(op.has_imm ? "fi_writedata" : "fi_write", rc);
  }

  PostResult post_write_batch(std::span<const WriteOp>, OpContext*) override {  // caps_: never called
    last_error_ = fmt::format("{}: no write batches (caps().max_write_batch is 0)", provider_);
    return PostResult::kFailed;
  }

  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc,
                       OpContext* ctx) override {
    if (len > max_msg_) {
      last_error_ = fmt::format("{}: a SEND of {} bytes exceeds the provider's max_msg_size ({})",
                                provider_, len, max_msg_);
      return PostResult::kFailed;
    }
    if (shm_) return shm_->send(peer, buf, len, desc, ctx, last_error_);
    return result("fi_send", fi_send(ep_, buf, len, desc, peer, ctx));
  }

  PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) override {
    return result("fi_recv", fi_recv(ep_, buf, len, desc, FI_ADDR_UNSPEC, ctx));
  }

  const std::string& last_error() const override { return last_error_; }

  size_t poll(std::span<Completion> out) override {
    size_t written = pending_.empty() ? 0 : pump(out);
    if (shm_) written += shm_->maintain(out.subspan(written));
    if (written == out.size()) return written;
    fi_cq_data_entry entries[64];
    size_t want = std::min(out.size() - written, std::size(entries));
    ssize_t n = fi_cq_read(cq_, entries, want);
    if (n == -FI_EAGAIN) {
      if (shm_) shm_->cq_drained();
      return written;
    }
    if (n == -FI_EAVAIL) return written + read_error(out.subspan(written));
    if (n < 0) {
      out[written] = Completion{Completion::Kind::kError, nullptr, 0, 0, fi_message("fi_cq_read", n)};
      return written + 1;
    }
    for (ssize_t i = 0; i < n; i++) {
      const fi_cq_data_entry& e = entries[i];
      Completion& c = out[written];
      if (e.flags & FI_RECV) {
        c = Completion{};
        c.kind = Completion::Kind::kRecv;
        c.context = static_cast<OpContext*>(e.op_context);
        c.len = e.len;
      } else if (e.flags & FI_REMOTE_CQ_DATA) {
        c = Completion{};
        c.kind = Completion::Kind::kRemoteImm;
        c.imm = static_cast<uint32_t>(e.data & UINT32_MAX);  // 8 bytes on tcp/shm, 4 on EFA
      } else if (Piece* p = piece_of(e.op_context)) {
        if (!piece_done(*p, nullptr, c)) continue;  // the WRITE has pieces left
      } else {
        c = Completion{};
        c.kind = Completion::Kind::kLocal;
        c.context = static_cast<OpContext*>(e.op_context);
        if (shm_) shm_->completed(c.context);
      }
      written++;
    }
    return written;
  }

  void* scratch_desc() const override { return scratch_region_.desc; }
  void* scratch_buffer() const override { return scratch_; }

 private:
  // ---- opening -------------------------------------------------------------------------------

  void open(const EngineConfig& config, size_t nic_index) {
    const NicConfig& nic = config.nics.at(nic_index);
    const std::string prov = hook_ ? hook_->underlying : config.provider;
    // An engine that serves a GPU asks for FI_HMEM (GPU memory registration, EFA and verbs-based
    // providers have it); a provider without it still serves host memory.
    if (config.cuda_device) {
      try {
        info_ = pick_info(prov, nic, FI_HMEM);
      } catch (const Error&) {
        log::info("nic {}: provider {} offers no FI_HMEM{}", nic_index, prov,
                  hook_ ? hook_->hmem_note : ": host memory only");
      }
    }
    if (!info_) info_ = pick_info(prov, nic, 0);
    attrs_ = ProviderAttrs::of(info_);
    // From here on the domain sees EFA's attributes.
    if (hook_) hook_->present(attrs_, config.cuda_device.has_value());
    provider_ = hook_ ? hook_->name : attrs_.prov_name;
    const bool efa = attrs_.prov_name == "efa";
    if (attrs_.mode & FI_RX_CQ_DATA)
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("provider {} requires FI_RX_CQ_DATA (immediates consuming receive "
                              "buffers), which fabric-lib does not support",
                              provider_));
    if (attrs_.cq_data_size < 4)
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("provider {} carries {} bytes of remote CQ data; immediates need 4",
                              provider_, attrs_.cq_data_size));
    max_msg_ = attrs_.max_msg_size ? attrs_.max_msg_size : SIZE_MAX;
    // GPU memory goes in as a dma-buf where the provider takes one (FI_HMEM, API 1.20): no
    // nvidia-peermem needed. Elsewhere, or if it is refused, as an FI_HMEM_CUDA address range.
    dmabuf_ = (attrs_.caps & FI_HMEM) && attrs_.api_version >= fi_compat::kDmabufApi;
    // What the code above decided, as the Domain contract reports it (efa-sim: EFA's values).
    caps_.nic_name = attrs_.domain_name;
    caps_.gpu_memory = (attrs_.caps & FI_HMEM) != 0;  // register_memory's test
    caps_.max_message = max_msg_;                       // the split size
    caps_.inject_size = attrs_.inject_size;
    caps_.link_gbps = static_cast<double>(attrs_.link_speed) / 1e9;
    caps_.manual_progress = attrs_.data_progress == FI_PROGRESS_MANUAL;
    caps_.max_in_flight = config.max_in_flight_per_nic;
    caps_.max_write_batch = 0;  // one WRITE per post (shm and efa-sim alike)

    check("fi_fabric", fi_fabric(info_->fabric_attr, &fabric_, nullptr));
    check("fi_domain", hook_ ? hook_->open_domain(fabric_, info_, &domain_)
                             : fi_domain(fabric_, info_, &domain_, nullptr));
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
    if (efa) set_efa_endpoint_options();
    if (attrs_.prov_name == "shm") {
      // The key board's descriptor is part of the name peers find it by (shm_key_board.h).
      key_board_ = ShmKeyBoard::create();
      // Before fi_enable, which creates the endpoint's /dev/shm file (see shm_names.h for why).
      const std::string shm_name = shm_names::next_endpoint_name(key_board_->fd());
      check("fi_setname", fi_setname(&ep_->fid, const_cast<char*>(shm_name.c_str()), shm_name.size() + 1));
    }
    check("fi_enable", fi_enable(ep_));
    // shm: this endpoint (the address peers write to) only receives; WRITEs and SENDs go through
    // a sending endpoint that is replaced when a dead peer blocks it (shm_senders.h).
    if (attrs_.prov_name == "shm") shm_ = std::make_unique<ShmSenders>(domain_, cq_, info_);

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
    log::info("nic {}: provider={} domain={} addr={} mr_mode=0x{:x} tx_size={} inject={} "
              "max_msg={} cq_data={} api={}.{} hmem={} link={} Gb/s progress={}",
              nic_index, provider_, caps_.nic_name, straddr, attrs_.mr_mode, attrs_.tx_size,
              attrs_.inject_size, attrs_.max_msg_size, attrs_.cq_data_size,
              FI_MAJOR(attrs_.api_version), FI_MINOR(attrs_.api_version), caps_.gpu_memory,
              caps_.link_gbps, caps_.manual_progress ? "manual" : "auto");
  }

  // EFA, before fi_enable (it reads both when the endpoint is enabled): no shm transport (same-host
  // peers go through the NIC as well; cuda_ipc is the engine's own path for them) and no CUDA calls
  // from the provider (GPU memory goes NIC-to-GPU, never through a CUDA copy on our worker thread).
  void set_efa_endpoint_options() {
    set_endpoint_option_false("FI_OPT_SHARED_MEMORY_PERMITTED", fi_compat::kOptSharedMemoryPermitted,
                              /*required=*/true);
    // EFA refuses it where CUDA is not loaded (-FI_EINVAL) or GPU memory is reachable only through
    // CUDA copies (-FI_EOPNOTSUPP). It matters only for GPU memory: required with FI_HMEM only.
    set_endpoint_option_false("FI_OPT_CUDA_API_PERMITTED", fi_compat::kOptCudaApiPermitted,
                              /*required=*/(attrs_.caps & FI_HMEM) != 0);
  }

  void set_endpoint_option_false(const char* name, int option, bool required) {
    bool value = false;
    int rc = static_cast<int>(fi_setopt(&ep_->fid, FI_OPT_ENDPOINT, option, &value, sizeof value));
    if (rc == 0) {
      log::debug("{}: {} = false", provider_, name);
    } else if (rc == -FI_ENOPROTOOPT || rc == -FI_ENOSYS) {
      log::info("{}: this libfabric does not know {} (older than the option): left as it is",
                provider_, name);
    } else if (!required) {
      log::info("{}: fi_setopt({} = false) refused ({}); this domain serves host memory only",
                provider_, name, fi_strerror(-rc));
    } else {
      throw Error(ErrorCode::kProvider,
                  fmt::format("fi_setopt({} = false) on provider {} failed: {} ({}). For GPU "
                              "memory without CUDA calls EFA needs GPUDirect RDMA",
                              name, provider_, fi_strerror(-rc), rc));
    }
  }

  void close_all() {
    shm_.reset();  // its endpoints and address vectors go before the CQ they are bound to
    if (ep_) fi_close(&ep_->fid);
    if (scratch_region_.provider) fi_close(&static_cast<fid_mr*>(scratch_region_.provider)->fid);
    if (av_) fi_close(&av_->fid);
    if (cq_) fi_close(&cq_->fid);
    if (domain_) fi_close(&domain_->fid);
    if (fabric_) fi_close(&fabric_->fid);
    if (info_) fi_freeinfo(info_);
    std::free(scratch_);
    ep_ = nullptr;
    scratch_region_ = {};
    av_ = nullptr;
    cq_ = nullptr;
    domain_ = nullptr;
    fabric_ = nullptr;
    info_ = nullptr;
    scratch_ = nullptr;
  }

  static bool delivery_complete(const std::string& provider) { return provider.rfind("tcp", 0) == 0; }

  static fi_info* pick_info(const std::string& provider, const NicConfig& nic, uint64_t extra_caps) {
    fi_info* hints = fi_allocinfo();
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA | extra_caps;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = kSupportedMrMode;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;  // one worker thread owns the domain
    hints->domain_attr->cq_data_size = 4;
    // tcp: a WRITE completes once the target has placed it (FI_DELIVERY_COMPLETE), so a WRITE the
    // target refuses (a key its owner deregistered) ends in an error instead of a silent ok; on
    // loopback it cost no bandwidth (docs/benchmarks.md). shm's zero-byte WRITEs never complete
    // with it, so shm keeps transmit completion.
    if (delivery_complete(provider)) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    hints->fabric_attr->prov_name = strdup(provider.c_str());
    if (!nic.node.empty()) hints->addr_format = FI_SOCKADDR_IN;
    fi_info* list = nullptr;
    const char* node = nic.node.empty() ? nullptr : nic.node.c_str();
    const uint32_t api = std::min(fi_compat::kWantedApi, fi_version());
    int rc = fi_getinfo(api, node, nullptr, node ? FI_SOURCE : 0, hints, &list);
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

  // ---- memory registration -------------------------------------------------------------------

  // Without FI_MR_PROV_KEY the application chooses keys; they must be unique per domain. Random
  // keys (as wide as the provider allows) are not guessable by a peer that was never given the
  // region's MrDesc; a collision (-FI_ENOKEY) draws again.
  // shm: the key also names the region's slot on the key board, published once registered.
  int regattr(fi_mr_attr& attr, uint64_t flags, fid_mr** mr) {
    const uint32_t slot = key_board_ ? key_board_->take_slot() : ShmKeyBoard::kUnboarded;
    int rc = 0;
    for (int attempt = 0; attempt < 8; attempt++) {
      attr.requested_key = (attrs_.mr_mode & FI_MR_PROV_KEY) ? 0 : random_key();
      if (key_board_) attr.requested_key = ShmKeyBoard::key_for(attr.requested_key, slot);
      rc = fi_mr_regattr(domain_, &attr, flags, mr);
      if (rc != -FI_ENOKEY) break;
    }
    if (key_board_ && rc == 0) key_board_->publish(fi_mr_key(*mr));
    if (key_board_ && rc != 0) key_board_->release(slot);
    return rc;
  }

  // GPU memory as a dma-buf (cuMemGetHandleForAddressRange, as the verbs provider does); null
  // when there is none or the provider refuses it, and the caller registers the address range.
  fid_mr* register_dmabuf(fi_mr_attr attr, void* ptr, size_t len) {
#ifdef FABRIC_WITH_CUDA
    cuda::DmaBuf buf;
    try {
      buf = cuda::dmabuf_of(ptr, len);
    } catch (const Error& e) {
      log::info("{}: no dma-buf for GPU memory ({}); registering the address range", provider_, e.what());
      return nullptr;
    }
    fi_compat::fi_mr_dmabuf d{};
    d.fd = buf.fd;
    d.offset = buf.offset;
    d.len = len;
    d.base_addr = static_cast<uint8_t*>(ptr) - buf.offset;  // the region is base_addr + offset
    fi_compat::set_dmabuf(attr, &d);
    fid_mr* mr = nullptr;
    int rc = regattr(attr, FI_MR_DMABUF, &mr);
    close(buf.fd);  // the registration holds the dma-buf
    if (rc == 0) return mr;
    log::info("{}: fi_mr_regattr(FI_MR_DMABUF) refused ({}); registering the address range", provider_,
              fi_strerror(-rc));
    return nullptr;
#else
    (void)attr;
    (void)ptr;
    (void)len;
    return nullptr;
#endif
  }

  uint64_t random_key() {
    size_t bytes = std::min<size_t>(attrs_.mr_key_size, 8);
    uint64_t mask = bytes >= 8 ? ~0ull : (1ull << (8 * bytes)) - 1;
    uint64_t key = 0;
    while (key == 0) key = key_rng_() & mask;
    return key;
  }

  // ---- posting -------------------------------------------------------------------------------

  ssize_t write_op(const void* src, size_t len, void* desc, PeerId peer, uint64_t remote_addr,
                   uint64_t rkey, bool has_imm, uint32_t imm, void* context) {
    return has_imm ? fi_writedata(ep_, src, len, desc, imm, peer, remote_addr, rkey, context)
                   : fi_write(ep_, src, len, desc, peer, remote_addr, rkey, context);
  }

  PostResult result(const char* call, ssize_t rc) {
    if (rc == 0) return PostResult::kPosted;
    if (rc == -FI_EAGAIN) return PostResult::kRetry;  // the worker keeps polling: progress
    last_error_ = fi_message(call, rc);
    return PostResult::kFailed;
  }

  // ---- WRITEs longer than max_msg_size -------------------------------------------------------
  //
  // Cut into pieces of at most max_msg_size, each a provider operation with a context of its own
  // (Piece: the OpContext's provider_space is the fi_context2 of one operation only). The engine
  // sees one operation: its OpContext completes once, after every posted piece has, with the first
  // error if any. Only the last piece carries the immediate, so the receiver counts one, as for an
  // unsplit WRITE. Unordered providers (EFA's SRD) may land a later operation before an earlier
  // one, so the last piece is posted only once all others have completed: the immediate never
  // arrives before the data it announces. Pieces the provider cannot take now (-FI_EAGAIN, or no
  // free Piece) are posted by later polls.

  struct Split {
    OpContext* parent = nullptr;  // null: free
    WriteOp op;
    uint64_t posted = 0;          // bytes handed to the provider
    uint32_t outstanding = 0;     // pieces with the provider
    bool queued = false;          // in pending_: has pieces to post
    bool failed = false;          // no more pieces are posted; reported with first_error
    Completion first_error;
    Split* next_free = nullptr;
  };
  struct Piece {
    fi_context2 fi_ctx;  // first: the context pointer handed to libfabric is the Piece's address
    Split* split = nullptr;
    Piece* next_free = nullptr;
  };

  PostResult post_split(const WriteOp& op, OpContext* ctx) {
    if (!splits_) allocate_split_pools();
    Split* s = split_free_;
    if (!s) return PostResult::kRetry;
    split_free_ = s->next_free;
    s->parent = ctx;
    s->op = op;
    s->posted = 0;
    s->outstanding = 0;
    s->queued = false;
    s->failed = false;
    s->first_error = Completion{};
    PostResult r = advance(*s);
    if (s->outstanding == 0) {  // nothing was posted: the engine keeps the WRITE (retry or failure)
      release(*s);
      return r == PostResult::kPosted ? PostResult::kRetry : r;
    }
    if (r == PostResult::kRetry) enqueue(*s);  // the provider is full: later polls post the rest
    return PostResult::kPosted;  // a failure after some pieces is reported once they complete
  }

  // Posts the split's next pieces while the provider takes them. kRetry: the provider (or the
  // piece pool) is full and pieces are left; kPosted: all posted, or the immediate's piece waits for
  // the others' completions; kFailed: the split failed.
  PostResult advance(Split& s) {
    while (!s.failed && s.posted < s.op.len) {
      const uint64_t len = std::min<uint64_t>(s.op.len - s.posted, max_msg_);
      const bool imm = s.op.has_imm && s.posted + len == s.op.len;
      if (imm && s.outstanding > 0) return PostResult::kPosted;  // the immediate's piece waits
      Piece* p = piece_free_;
      if (!p) return PostResult::kRetry;
      ssize_t rc = write_op(static_cast<const uint8_t*>(s.op.src) + s.posted, len, s.op.desc, s.op.peer,
                            s.op.remote_addr + s.posted, s.op.rkey, imm, s.op.imm, p);
      if (rc == -FI_EAGAIN) return PostResult::kRetry;
      if (rc != 0) {
        last_error_ = fi_message(imm ? "fi_writedata" : "fi_write", rc);
        fail_split(s, last_error_);
        return PostResult::kFailed;
      }
      piece_free_ = p->next_free;
      p->split = &s;
      s.outstanding++;
      s.posted += len;
    }
    return PostResult::kPosted;
  }

  void fail_split(Split& s, const std::string& message) {
    if (s.failed) return;
    s.failed = true;
    s.first_error = Completion{};
    s.first_error.kind = Completion::Kind::kError;
    s.first_error.error = message;
  }

  void enqueue(Split& s) {
    if (s.queued) return;
    s.queued = true;
    pending_.push_back(&s);
  }

  bool finished(const Split& s) const {
    return s.outstanding == 0 && (s.failed || s.posted == s.op.len);
  }

  // The split's one completion, for its OpContext; frees the split.
  Completion finish(Split& s) {
    Completion c = s.failed ? std::move(s.first_error) : Completion{};
    if (!s.failed) c.kind = Completion::Kind::kLocal;
    c.context = s.parent;
    if (s.queued) std::erase(pending_, &s);
    release(s);
    return c;
  }

  void release(Split& s) {
    s.parent = nullptr;
    s.queued = false;
    s.next_free = split_free_;
    split_free_ = &s;
  }

  // Posts the pieces that the provider could not take before, and reports splits that ended
  // here (failed with nothing left with the provider). Returns how many completions it wrote.
  size_t pump(std::span<Completion> out) {
    size_t written = 0;
    for (size_t i = 0; i < pending_.size();) {
      Split& s = *pending_[i];
      PostResult r = advance(s);
      if (finished(s)) {
        if (written == out.size()) break;  // reported at the next poll
        out[written++] = finish(s);         // erases pending_[i]
      } else if (r != PostResult::kRetry) {  // the rest is up to completions (piece_done)
        s.queued = false;
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        i++;
      }
    }
    return written;
  }

  Piece* piece_of(void* context) const {
    auto a = reinterpret_cast<uintptr_t>(context), lo = reinterpret_cast<uintptr_t>(pieces_.get());
    if (!pieces_ || a < lo || a >= lo + kMaxPieces * sizeof(Piece)) return nullptr;
    return static_cast<Piece*>(context);
  }

  // A piece completed (error: its error completion). True when that ends its split: `out` then
  // holds the split's completion.
  bool piece_done(Piece& p, const Completion* error, Completion& out) {
    Split& s = *p.split;
    p.split = nullptr;
    p.next_free = piece_free_;
    piece_free_ = &p;
    s.outstanding--;
    if (error && !s.failed) {
      s.failed = true;
      s.first_error = *error;
    }
    // More pieces, or the immediate's now that the others are done.
    if (!s.failed && s.posted < s.op.len && advance(s) == PostResult::kRetry) enqueue(s);
    if (!finished(s)) return false;
    out = finish(s);
    return true;
  }

  void allocate_split_pools() {
    splits_ = std::make_unique<Split[]>(kMaxSplits);
    for (size_t i = kMaxSplits; i-- > 0;) release(splits_[i]);
    pieces_ = std::make_unique<Piece[]>(kMaxPieces);
    for (size_t i = kMaxPieces; i-- > 0;) {
      pieces_[i].next_free = piece_free_;
      piece_free_ = &pieces_[i];
    }
    pending_.reserve(kMaxSplits);
  }

  // ---- completions ---------------------------------------------------------------------------

  size_t read_error(std::span<Completion> out) {
    fi_cq_err_entry err{};
    ssize_t rc = fi_cq_readerr(cq_, &err, 0);
    if (rc < 0) return 0;
    const char* prov_msg = fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0);
    Completion& c = out[0];
    c = Completion{};
    c.kind = Completion::Kind::kError;
    c.context = static_cast<OpContext*>(err.op_context);
    c.error = fmt::format("{} completion error: {} (provider: {})", provider_,
                          fi_strerror(err.err), prov_msg ? prov_msg : "-");
    switch (err.err) {  // the connection is gone (a dead or restarted peer), not one bad operation
      case FI_ECONNRESET: case FI_ECONNREFUSED: case FI_ECONNABORTED: case FI_ENOTCONN:
      case FI_EHOSTUNREACH: case FI_ENETUNREACH: case FI_ETIMEDOUT: case FI_EIO:
      case FI_ESHUTDOWN:
        c.peer_lost = true;
        break;
      case FI_ECANCELED:
        // tcp (delivery completion): a WRITE still waiting for the target's acknowledgement is
        // cancelled when the connection closes: a dead peer, or a target that dropped it over a
        // WRITE it refused (a deregistered key). Either way the next WRITE must connect afresh.
        c.peer_lost = !shm_;
        break;
      default:
        break;
    }
    if (shm_ && !(err.flags & FI_RECV)) shm_->completed(c.context);
    if (Piece* p = piece_of(err.op_context)) {
      Completion piece_error = std::move(c);
      return piece_done(*p, &piece_error, c) ? 1 : 0;
    }
    return 1;
  }

  const LibfabricHook* const hook_;  // efa-sim's shim, or null
  fi_info* info_ = nullptr;
  ProviderAttrs attrs_;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  std::string provider_;
  std::string address_;
  DomainCaps caps_;
  size_t max_msg_ = SIZE_MAX;
  bool dmabuf_ = false;
  std::mt19937_64 key_rng_{std::random_device{}()};
  std::unordered_map<std::string, fi_addr_t> peers_;
  std::string last_error_;
  void* scratch_ = nullptr;
  DomainRegion scratch_region_;
  std::unique_ptr<Split[]> splits_;
  std::unique_ptr<Piece[]> pieces_;
  Split* split_free_ = nullptr;
  Piece* piece_free_ = nullptr;
  std::vector<Split*> pending_;
  std::unique_ptr<ShmSenders> shm_;
  std::unique_ptr<ShmKeyBoard> key_board_;  // shm only: which of our keys are live
};

}  // namespace

std::unique_ptr<Domain> open_libfabric_domain(const EngineConfig& config, size_t nic_index,
                                              const LibfabricHook* hook) {
  return std::make_unique<LibfabricDomain>(config, nic_index, hook);
}

}  // namespace fabric
