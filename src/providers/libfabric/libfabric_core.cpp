// The libfabric objects of one NIC, shared by the libfabric and shm Domains (libfabric_core.h).
// Translates every libfabric return code into fabric::Error, naming the call that failed.
#include "providers/libfabric/libfabric_core.h"

#include <rdma/fi_cm.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "providers/libfabric/fi_compat.h"
#include "providers/libfabric/libfabric_domain.h"
#include "util/log.h"
#ifdef FABRIC_WITH_CUDA
#include "cuda/driver_api.h"
#endif

namespace fabric {
namespace {

constexpr uint64_t kSupportedMrMode =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;

bool delivery_complete(const std::string& provider) { return provider.rfind("tcp", 0) == 0; }

}  // namespace

std::string fi_message(const char* call, long rc) {
  return fmt::format("{} failed: {} ({})", call, fi_strerror(static_cast<int>(-rc)), rc);
}

void fi_check(const char* call, long rc) {
  if (rc != 0) throw Error(ErrorCode::kProvider, fi_message(call, rc));
}

// ---- opening -----------------------------------------------------------------------------------

void LibfabricCore::open(const EngineConfig& config, size_t nic_index, const LibfabricHook* hook) {
  const NicConfig& nic = config.nics.at(nic_index);
  const std::string prov = hook ? hook->underlying : config.provider;
  // An engine that serves a GPU asks for FI_HMEM (GPU memory registration, EFA and verbs-based
  // providers have it); a provider without it still serves host memory.
  if (config.cuda_device) {
    try {
      info_ = pick_info(prov, nic, FI_HMEM);
    } catch (const Error&) {
      log::info("nic {}: provider {} offers no FI_HMEM{}", nic_index, prov,
                hook ? hook->hmem_note : ": host memory only");
    }
  }
  if (!info_) info_ = pick_info(prov, nic, 0);
  attrs_ = ProviderAttrs::of(info_);
  // From here on the domain sees EFA's attributes.
  if (hook) hook->present(attrs_, config.cuda_device.has_value());
  provider_ = hook ? hook->name : attrs_.prov_name;
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
  caps_.max_message = max_msg_;                     // the split size
  caps_.inject_size = attrs_.inject_size;
  caps_.link_gbps = static_cast<double>(attrs_.link_speed) / 1e9;
  caps_.manual_progress = attrs_.data_progress == FI_PROGRESS_MANUAL;
  caps_.max_in_flight = config.max_in_flight_per_nic;
  caps_.max_write_batch = 0;  // one WRITE per post (shm and efa-sim alike)

  fi_check("fi_fabric", fi_fabric(info_->fabric_attr, &fabric_, nullptr));
  fi_check("fi_domain", hook ? hook->open_domain(fabric_, info_, &domain_)
                             : fi_domain(fabric_, info_, &domain_, nullptr));
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = 16384;
  cq_attr.wait_obj = FI_WAIT_NONE;
  fi_check("fi_cq_open", fi_cq_open(domain_, &cq_attr, &cq_, nullptr));
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  fi_check("fi_av_open", fi_av_open(domain_, &av_attr, &av_, nullptr));
  fi_check("fi_endpoint", fi_endpoint(domain_, info_, &ep_, nullptr));
  fi_check("fi_ep_bind(cq)", fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV));
  fi_check("fi_ep_bind(av)", fi_ep_bind(ep_, &av_->fid, 0));
  if (attrs_.prov_name == "efa") set_efa_endpoint_options();
}

void LibfabricCore::enable(size_t nic_index) {
  fi_check("fi_enable", fi_enable(ep_));
  char name[512];
  size_t name_len = sizeof name;
  fi_check("fi_getname", fi_getname(&ep_->fid, name, &name_len));
  address_.assign(name, name_len);
  scratch_ = std::aligned_alloc(64, kScratchLen);
  std::memset(scratch_, 0, kScratchLen);

  char straddr[256];
  size_t straddr_len = sizeof straddr;
  fi_av_straddr(av_, name, straddr, &straddr_len);
  log::info(
      "nic {}: provider={} domain={} addr={} mr_mode=0x{:x} tx_size={} inject={} "
      "max_msg={} cq_data={} api={}.{} hmem={} link={} Gb/s progress={}",
      nic_index, provider_, caps_.nic_name, straddr, attrs_.mr_mode, attrs_.tx_size,
      attrs_.inject_size, attrs_.max_msg_size, attrs_.cq_data_size, FI_MAJOR(attrs_.api_version),
      FI_MINOR(attrs_.api_version), caps_.gpu_memory, caps_.link_gbps,
      caps_.manual_progress ? "manual" : "auto");
}

// EFA, before fi_enable (it reads both when the endpoint is enabled): no shm transport (same-host
// peers go through the NIC as well; cuda_ipc is the engine's own path for them) and no CUDA calls
// from the provider (GPU memory goes NIC-to-GPU, never through a CUDA copy on our worker thread).
void LibfabricCore::set_efa_endpoint_options() {
  set_endpoint_option_false("FI_OPT_SHARED_MEMORY_PERMITTED", fi_compat::kOptSharedMemoryPermitted,
                            /*required=*/true);
  // EFA refuses it where CUDA is not loaded (-FI_EINVAL) or GPU memory is reachable only through
  // CUDA copies (-FI_EOPNOTSUPP). It matters only for GPU memory: required with FI_HMEM only.
  set_endpoint_option_false("FI_OPT_CUDA_API_PERMITTED", fi_compat::kOptCudaApiPermitted,
                            /*required=*/(attrs_.caps & FI_HMEM) != 0);
}

void LibfabricCore::set_endpoint_option_false(const char* name, int option, bool required) {
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

void LibfabricCore::close() {
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

fi_info* LibfabricCore::pick_info(const std::string& provider, const NicConfig& nic,
                                  uint64_t extra_caps) {
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
    throw Error(
        ErrorCode::kProvider,
        fmt::format("fi_getinfo found no provider '{}'{} with FI_EP_RDM, FI_RMA, FI_MSG "
                    "and remote CQ data: {} ({}). Check the provider name "
                    "(efa, tcp;ofi_rxm, shm) and `fi_info -p <name>`",
                    provider, node ? fmt::format(" for node {}", node) : "", fi_strerror(-rc), rc));
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

// ---- memory registration -----------------------------------------------------------------------

DomainRegion LibfabricCore::register_memory(void* ptr, size_t len, Device device,
                                            uint64_t key_tag) {
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
  fid_mr* mr = gpu && dmabuf_ ? register_dmabuf(attr, ptr, len, key_tag) : nullptr;
  if (!mr) {
    iovec iov{ptr, len};
    attr.mr_iov = &iov;
    const int rc = regattr(attr, 0, key_tag, &mr);
    // Some builds advertise FI_HMEM without a CUDA memory interface behind it (Debian's
    // libfabric 1.17 shm says -FI_ENOSYS here): that domain cannot reach CUDA memory, which
    // the DomainGroup then leaves to the domains that can (cuda_ipc), as for no FI_HMEM.
    if (gpu && (rc == -FI_ENOSYS || rc == -FI_EOPNOTSUPP))
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("provider {} offers FI_HMEM but cannot register CUDA memory "
                              "(fi_mr_regattr: {})",
                              provider_, fi_strerror(-rc)));
    fi_check("fi_mr_regattr", rc);
  }
  if (attrs_.mr_mode & FI_MR_ENDPOINT) {
    long rc = fi_mr_bind(mr, &ep_->fid, 0);
    if (rc == 0) rc = fi_mr_enable(mr);
    if (rc != 0) {
      fi_close(&mr->fid);
      fi_check("fi_mr_bind/fi_mr_enable", rc);
    }
  }
  DomainRegion r;
  r.provider = mr;
  r.desc = fi_mr_desc(mr);
  r.remote.rkey = fi_mr_key(mr);
  r.remote.base = (attrs_.mr_mode & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(ptr) : 0;
  return r;
}

void LibfabricCore::deregister_memory(DomainRegion& region) {
  if (region.provider)
    fi_check("fi_close(mr)", fi_close(&static_cast<fid_mr*>(region.provider)->fid));
  region = {};
}

// Without FI_MR_PROV_KEY the application chooses keys; they must be unique per domain. Random
// keys (as wide as the provider allows) are not guessable by a peer that was never given the
// region's MrDesc; a collision (-FI_ENOKEY) draws again. The reserved low bits carry `key_tag`.
int LibfabricCore::regattr(fi_mr_attr& attr, uint64_t flags, uint64_t key_tag, fid_mr** mr) {
  int rc = 0;
  for (int attempt = 0; attempt < 8; attempt++) {
    attr.requested_key = (attrs_.mr_mode & FI_MR_PROV_KEY) ? 0 : random_key();
    attr.requested_key = (attr.requested_key & ~key_mask_) | key_tag;
    rc = fi_mr_regattr(domain_, &attr, flags, mr);
    if (rc != -FI_ENOKEY) break;
  }
  return rc;
}

// GPU memory as a dma-buf (cuMemGetHandleForAddressRange, as the verbs provider does); null
// when there is none or the provider refuses it, and the caller registers the address range.
fid_mr* LibfabricCore::register_dmabuf(fi_mr_attr attr, void* ptr, size_t len, uint64_t key_tag) {
#ifdef FABRIC_WITH_CUDA
  cuda::DmaBuf buf;
  try {
    buf = cuda::dmabuf_of(ptr, len);
  } catch (const Error& e) {
    log::info("{}: no dma-buf for GPU memory ({}); registering the address range", provider_,
              e.what());
    return nullptr;
  }
  fi_compat::fi_mr_dmabuf d{};
  d.fd = buf.fd;
  d.offset = buf.offset;
  d.len = len;
  d.base_addr = static_cast<uint8_t*>(ptr) - buf.offset;  // the region is base_addr + offset
  fi_compat::set_dmabuf(attr, &d);
  fid_mr* mr = nullptr;
  int rc = regattr(attr, FI_MR_DMABUF, key_tag, &mr);
  ::close(buf.fd);  // the registration holds the dma-buf
  if (rc == 0) return mr;
  log::info("{}: fi_mr_regattr(FI_MR_DMABUF) refused ({}); registering the address range",
            provider_, fi_strerror(-rc));
  return nullptr;
#else
  (void)attr;
  (void)ptr;
  (void)len;
  (void)key_tag;
  return nullptr;
#endif
}

uint64_t LibfabricCore::random_key() {
  size_t bytes = std::min<size_t>(attrs_.mr_key_size, 8);
  uint64_t mask = bytes >= 8 ? ~0ull : (1ull << (8 * bytes)) - 1;
  uint64_t key = 0;
  while (key == 0) key = key_rng_() & mask;
  return key;
}

// ---- posting -----------------------------------------------------------------------------------

PostResult LibfabricCore::result(const char* call, ssize_t rc) {
  if (rc == 0) return PostResult::kPosted;
  if (rc == -FI_EAGAIN) return PostResult::kRetry;  // the worker keeps polling: progress
  last_error_ = fi_message(call, rc);
  return PostResult::kFailed;
}

bool LibfabricCore::send_too_long(size_t len) {
  if (len <= max_msg_) return false;
  last_error_ = fmt::format("{}: a SEND of {} bytes exceeds the provider's max_msg_size ({})",
                            provider_, len, max_msg_);
  return true;
}

PostResult LibfabricCore::no_batches() {
  last_error_ = fmt::format("{}: no write batches (caps().max_write_batch is 0)", provider_);
  return PostResult::kFailed;
}

// ---- completions -------------------------------------------------------------------------------

bool LibfabricCore::read_error(Completion& c, uint64_t& flags, int& err_code) {
  fi_cq_err_entry err{};
  ssize_t rc = fi_cq_readerr(cq_, &err, 0);
  if (rc < 0) return false;
  const char* prov_msg = fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0);
  c = Completion{};
  c.kind = Completion::Kind::kError;
  c.context = static_cast<OpContext*>(err.op_context);
  c.error = fmt::format("{} completion error: {} (provider: {})", provider_, fi_strerror(err.err),
                        prov_msg ? prov_msg : "-");
  switch (err.err) {  // the connection is gone (a dead or restarted peer), not one bad operation
    case FI_ECONNRESET:
    case FI_ECONNREFUSED:
    case FI_ECONNABORTED:
    case FI_ENOTCONN:
    case FI_EHOSTUNREACH:
    case FI_ENETUNREACH:
    case FI_ETIMEDOUT:
    case FI_EIO:
    case FI_ESHUTDOWN:
    // tcp (delivery completion): a WRITE still waiting for the target's acknowledgement is
    // cancelled when the connection closes: a dead peer, or a target that dropped it over a
    // WRITE it refused (a deregistered key). Either way the next WRITE must connect afresh.
    case FI_ECANCELED:
      c.peer_lost = true;
      break;
    default:
      break;
  }
  flags = err.flags;
  err_code = err.err;
  return true;
}

}  // namespace fabric
