// One libfabric RDM endpoint with its CQ, AV and one registered buffer, opened the way the
// engine's libfabric provider opens it (src/providers/libfabric/libfabric_core.cpp): the raw
// baselines in bench/ share it so that their numbers differ from the engine's only by the engine.
#pragma once

#include <fmt/format.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fabric::bench {

inline void check(const char* call, long rc) {
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

class Endpoint : EndpointFids {
 public:
  // tx_op_flags: the endpoint's default operation flags (the engine asks tcp for
  // FI_DELIVERY_COMPLETE: libfabric_core.cpp's pick_info).
  Endpoint(const std::string& provider, const std::string& node, uint64_t tx_op_flags = 0) {
    fi_info* hints = fi_allocinfo();
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->cq_data_size = 4;
    hints->tx_attr->op_flags = tx_op_flags;
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

}  // namespace fabric::bench
