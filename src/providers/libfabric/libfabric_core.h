// What the two libfabric Domains share (libfabric_domain.cpp: efa, tcp, efa-sim; shm_domain.cpp):
// one fi_fabric + fi_domain + CQ + AV + RDM endpoint of one NIC, its caps, memory registration and
// the CQ read into Completions. Each Domain composes one and adds its own posting and peers.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <random>
#include <span>
#include <string>

#include "domain/domain.h"
#include "providers/libfabric/provider_attrs.h"

namespace fabric {

struct LibfabricHook;

static_assert(sizeof(OpContext::provider_space) >= sizeof(fi_context2),
              "OpContext::provider_space is the operation's fi_context2");

// "<call> failed: <libfabric's words> (<rc>)".
std::string fi_message(const char* call, long rc);
// Throws kProvider with fi_message where rc is not 0.
void fi_check(const char* call, long rc);

class LibfabricCore {
 public:
  static constexpr size_t kScratchLen = 64;

  LibfabricCore() = default;
  ~LibfabricCore() { close(); }
  LibfabricCore(const LibfabricCore&) = delete;
  LibfabricCore& operator=(const LibfabricCore&) = delete;

  // Opening, in three steps so that the Domain can name the endpoint before it is enabled (shm):
  // open() picks the fi_info and opens everything up to the bound endpoint (EFA's endpoint
  // options set); enable() enables it, reads its address and logs the NIC; the Domain then
  // registers scratch_buffer() through its own register_memory and hands the region to
  // set_scratch() (LibfabricCoreDomain::register_scratch). A step that throws leaves what it
  // opened to close() (the destructor).
  void open(const EngineConfig& config, size_t nic_index, const LibfabricHook* hook);
  void enable(size_t nic_index);
  void set_scratch(const DomainRegion& region) { scratch_region_ = region; }

  const std::string& provider() const { return provider_; }
  const std::string& address() const { return address_; }
  const DomainCaps& caps() const { return caps_; }
  const ProviderAttrs& attrs() const { return attrs_; }
  size_t max_msg() const { return max_msg_; }
  const std::string& last_error() const { return last_error_; }
  std::string& last_error() { return last_error_; }
  void* scratch_buffer() const { return scratch_; }
  void* scratch_desc() const { return scratch_region_.desc; }

  fi_info* info() const { return info_; }
  fid_domain* domain() const { return domain_; }
  fid_cq* cq() const { return cq_; }
  fid_av* av() const { return av_; }
  fid_ep* ep() const { return ep_; }

  // The low bits of every key this domain asks for are the Domain's own (shm: the key board's
  // slot, shm_key_board.h): register_memory puts `key_tag` there. 0 (the default): none.
  void reserve_key_bits(uint64_t mask) { key_mask_ = mask; }
  // Throws kUnsupported for CUDA memory the provider cannot reach, kProvider where it refuses.
  DomainRegion register_memory(void* ptr, size_t len, Device device, uint64_t key_tag = 0);
  void deregister_memory(DomainRegion& region);

  // kPosted for 0, kRetry for -FI_EAGAIN, else kFailed with last_error() naming `call`.
  PostResult result(const char* call, ssize_t rc);
  // True (last_error() set) for a SEND longer than the provider's max_msg_size.
  bool send_too_long(size_t len);
  // post_write_batch's answer: caps().max_write_batch is 0.
  PostResult no_batches();
  PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) {
    return result("fi_recv", fi_recv(ep_, buf, len, desc, FI_ADDR_UNSPEC, ctx));
  }

  // Reads the CQ into `out` (at least one entry). Receives and immediates it reports itself; an
  // operation this domain posted that ended (ok, or an error completion, a receive's included) is
  // passed to `ended(flags, err, c)` with `c` its Completion ready to report (kLocal, or kError
  // with peer_lost from the error code; err 0 where it succeeded), which reports it where it
  // returns true. `cq_empty`, where given, says whether the CQ read empty.
  template <class Ended>
  size_t read_cq(std::span<Completion> out, Ended&& ended, bool* cq_empty = nullptr) {
    fi_cq_data_entry entries[64];
    ssize_t n = fi_cq_read(cq_, entries, std::min(out.size(), std::size(entries)));
    if (cq_empty) *cq_empty = n == -FI_EAGAIN;
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) {
      uint64_t flags = 0;
      int err = 0;
      if (!read_error(out[0], flags, err)) return 0;
      return ended(flags, err, out[0]) ? 1 : 0;
    }
    if (n < 0) {
      out[0] = Completion{Completion::Kind::kError, nullptr, 0, 0, fi_message("fi_cq_read", n)};
      return 1;
    }
    size_t written = 0;
    for (ssize_t i = 0; i < n; i++) {
      const fi_cq_data_entry& e = entries[i];
      Completion& c = out[written];
      c = Completion{};
      if (e.flags & FI_RECV) {
        c.kind = Completion::Kind::kRecv;
        c.context = static_cast<OpContext*>(e.op_context);
        c.len = e.len;
      } else if (e.flags & FI_REMOTE_CQ_DATA) {
        c.kind = Completion::Kind::kRemoteImm;
        c.imm = static_cast<uint32_t>(e.data & UINT32_MAX);  // 8 bytes on tcp/shm, 4 on EFA
      } else {
        c.kind = Completion::Kind::kLocal;
        c.context = static_cast<OpContext*>(e.op_context);
        if (!ended(e.flags, 0, c)) continue;
      }
      written++;
    }
    return written;
  }

 private:
  static fi_info* pick_info(const std::string& provider, const NicConfig& nic, uint64_t extra_caps);
  void set_efa_endpoint_options();
  void set_endpoint_option_false(const char* name, int option, bool required);
  int regattr(fi_mr_attr& attr, uint64_t flags, uint64_t key_tag, fid_mr** mr);
  fid_mr* register_dmabuf(fi_mr_attr attr, void* ptr, size_t len, uint64_t key_tag);
  uint64_t random_key();
  bool read_error(Completion& c, uint64_t& flags, int& err);
  void close();

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
  uint64_t key_mask_ = 0;
  std::mt19937_64 key_rng_{std::random_device{}()};
  std::string last_error_;
  void* scratch_ = nullptr;
  DomainRegion scratch_region_;
};

// The contract calls both libfabric Domains answer alike, from their LibfabricCore; each derived
// Domain adds its memory, peers, posting and poll.
class LibfabricCoreDomain : public Domain {
 public:
  const std::string& provider_name() const final { return core_.provider(); }
  const std::string& address() const final { return core_.address(); }
  const DomainCaps& caps() const final { return core_.caps(); }
  PostResult post_write_batch(std::span<const WriteOp>, OpContext*) final {  // caps: never called
    return core_.no_batches();
  }
  PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) final {
    return core_.post_recv(buf, len, desc, ctx);
  }
  const std::string& last_error() const final { return core_.last_error(); }
  void* scratch_desc() const final { return core_.scratch_desc(); }
  void* scratch_buffer() const final { return core_.scratch_buffer(); }

 protected:
  // The last step of opening, after core_.enable(): the scratch buffer, registered through the
  // derived Domain's register_memory (so called from its constructor's body).
  void register_scratch() {
    core_.set_scratch(
        register_memory(core_.scratch_buffer(), LibfabricCore::kScratchLen, Device::host()));
  }

  LibfabricCore core_;
};

}  // namespace fabric
