// shm Domain (shm_domain.h). The published endpoint (the address peers write to) only receives;
// WRITEs and SENDs go through ShmSenders' sending endpoint, and every registration's key carries
// its slot on the key board, cleared before the registration goes.
#include "providers/libfabric/shm_domain.h"

#include <rdma/fi_cm.h>

#include <memory>
#include <string>

#include "providers/libfabric/libfabric_core.h"
#include "providers/libfabric/shm_key_board.h"
#include "providers/libfabric/shm_names.h"
#include "providers/libfabric/shm_senders.h"

namespace fabric {
namespace {

class ShmDomain final : public LibfabricCoreDomain {
 public:
  ShmDomain(const EngineConfig& config, size_t nic_index) {
    core_.open(config, nic_index, /*hook=*/nullptr);
    // The key board's descriptor is part of the name peers find it by (shm_key_board.h).
    board_ = ShmKeyBoard::create();
    core_.reserve_key_bits(ShmKeyBoard::kSlotMask);
    // Before fi_enable, which creates the endpoint's /dev/shm file (see shm_names.h for why).
    const std::string name = shm_names::next_endpoint_name(board_->fd());
    fi_check("fi_setname",
             fi_setname(&core_.ep()->fid, const_cast<char*>(name.c_str()), name.size() + 1));
    core_.enable(nic_index);
    senders_ = std::make_unique<ShmSenders>(core_.domain(), core_.cq(), core_.info());
    register_scratch();
  }

  // The region takes a slot on the board, and its key names the slot; published once registered.
  DomainRegion register_memory(void* ptr, size_t len, Device device) override {
    const uint32_t slot = board_->take_slot();
    DomainRegion r;
    try {
      r = core_.register_memory(ptr, len, device, slot);
    } catch (...) {
      board_->release(slot);
      throw;
    }
    board_->publish(r.remote.rkey);
    return r;
  }

  // Peers refuse the key before the registration goes (shm_key_board.h).
  void deregister_memory(DomainRegion& region) override {
    if (region.provider) board_->revoke(region.remote.rkey);
    core_.deregister_memory(region);
  }

  PeerId insert_peer(const std::string& address) override { return senders_->insert_peer(address); }
  void remove_peer(PeerId peer) override { senders_->remove_peer(peer); }

  // One operation whatever its length: shm's max_msg_size is unbounded.
  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    return senders_->write(op, ctx, core_.last_error());
  }

  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc,
                       OpContext* ctx) override {
    if (core_.send_too_long(len)) return PostResult::kFailed;
    return senders_->send(peer, buf, len, desc, ctx, core_.last_error());
  }

  // Stall checks and endpoint replacement first (ShmSenders::maintain), then the CQ; every
  // WRITE or SEND that ended leaves the sending endpoint's books.
  size_t poll(std::span<Completion> out) override {
    size_t written = senders_->maintain(out);
    if (written == out.size()) return written;
    bool cq_empty = false;
    written += core_.read_cq(
        out.subspan(written),
        [this](uint64_t flags, int err, Completion& c) {
          // Cancelled is tcp's sign of a closed connection (libfabric_core.cpp), not shm's: shm
          // finds dead peers by their pid (shm_senders.h).
          if (err == FI_ECANCELED) c.peer_lost = false;
          if (!(flags & FI_RECV)) senders_->completed(c.context);
          return true;
        },
        &cq_empty);
    // Nothing of a closed sending endpoint can still be in the CQ.
    if (cq_empty) senders_->cq_drained();
    return written;
  }

 private:
  // Both go before core_ (the base's): the sending endpoints before the CQ they are bound to.
  std::unique_ptr<ShmKeyBoard> board_;  // which of our keys are live
  std::unique_ptr<ShmSenders> senders_;
};

}  // namespace

std::unique_ptr<Domain> open_shm_domain(const EngineConfig& config, size_t nic_index) {
  return std::make_unique<ShmDomain>(config, nic_index);
}

}  // namespace fabric
