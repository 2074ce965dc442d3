// libfabric Domain for NICs (efa, tcp;ofi_rxm, efa-sim): the shared libfabric objects
// (libfabric_core.h) plus peers in the endpoint's AV and WRITEs longer than max_msg_size split.
// shm is its own Domain (shm_domain.h).
#include "providers/libfabric/libfabric_domain.h"

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "providers/libfabric/libfabric_core.h"
#include "util/log.h"

namespace fabric {
namespace {

// WRITEs longer than the provider's max_msg_size in progress at once, and their pieces with the
// provider at once (each piece needs its own operation context). Beyond either, post_write
// answers kRetry / the pieces wait for earlier ones to complete.
constexpr size_t kMaxSplits = 256;
constexpr size_t kMaxPieces = 1024;

class LibfabricDomain final : public LibfabricCoreDomain {
 public:
  LibfabricDomain(const EngineConfig& config, size_t nic_index, const LibfabricHook* hook) {
    core_.open(config, nic_index, hook);
    core_.enable(nic_index);
    register_scratch();
  }

  DomainRegion register_memory(void* ptr, size_t len, Device device) override {
    return core_.register_memory(ptr, len, device);
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
    core_.deregister_memory(region);
  }

  PeerId insert_peer(const std::string& address) override {
    auto it = peers_.find(address);
    if (it != peers_.end()) return it->second;
    fi_addr_t fi_addr = FI_ADDR_UNSPEC;
    int n = fi_av_insert(core_.av(), address.data(), 1, &fi_addr, 0, nullptr);
    if (n != 1)
      throw Error(ErrorCode::kProvider,
                  fmt::format("fi_av_insert of a peer address ({} bytes) failed ({}): is the peer "
                              "using the same provider ({})?",
                              address.size(), n, core_.provider()));
    peers_.emplace(address, fi_addr);
    return fi_addr;
  }

  // The AV entry goes; completions of operations still posted to it carry only our context.
  // A split WRITE to it posts no more pieces and fails once those posted have completed.
  void remove_peer(PeerId peer) override {
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
      int rc = fi_av_remove(core_.av(), &a, 1, 0);
      if (rc != 0) log::warn("fi_av_remove failed: {}", fi_strerror(-rc));
      peers_.erase(it);
      return;
    }
  }

  // One provider operation, or (longer than max_msg_size) several: see post_split.
  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    if (op.len > core_.max_msg()) return post_split(op, ctx);
    ssize_t rc = write_op(op.src, op.len, op.desc, op.peer, op.remote_addr, op.rkey, op.has_imm,
                          op.imm, ctx);
    return core_.result(op.has_imm ? "fi_writedata" : "fi_write", rc);
  }

  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc,
                       OpContext* ctx) override {
    if (core_.send_too_long(len)) return PostResult::kFailed;
    return core_.result("fi_send", fi_send(core_.ep(), buf, len, desc, peer, ctx));
  }

  size_t poll(std::span<Completion> out) override {
    size_t written = pending_.empty() ? 0 : pump(out);
    if (written == out.size()) return written;
    // A piece's completion is its split's business: reported once the split ends.
    return written + core_.read_cq(out.subspan(written), [this](uint64_t, int, Completion& c) {
      Piece* p = piece_of(c.context);
      if (!p) return true;
      Completion piece = std::move(c);
      return piece_done(*p, piece.kind == Completion::Kind::kError ? &piece : nullptr, c);
    });
  }

 private:
  ssize_t write_op(const void* src, size_t len, void* desc, PeerId peer, uint64_t remote_addr,
                   uint64_t rkey, bool has_imm, uint32_t imm, void* context) {
    return has_imm ? fi_writedata(core_.ep(), src, len, desc, imm, peer, remote_addr, rkey, context)
                   : fi_write(core_.ep(), src, len, desc, peer, remote_addr, rkey, context);
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
    uint64_t posted = 0;       // bytes handed to the provider
    uint32_t outstanding = 0;  // pieces with the provider
    bool queued = false;       // in pending_: has pieces to post
    bool failed = false;       // no more pieces are posted; reported with first_error
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
  // piece pool) is full and pieces are left; kPosted: all posted, or the immediate's piece waits
  // for the others' completions; kFailed: the split failed.
  PostResult advance(Split& s) {
    while (!s.failed && s.posted < s.op.len) {
      const uint64_t len = std::min<uint64_t>(s.op.len - s.posted, core_.max_msg());
      const bool imm = s.op.has_imm && s.posted + len == s.op.len;
      if (imm && s.outstanding > 0) return PostResult::kPosted;  // the immediate's piece waits
      Piece* p = piece_free_;
      if (!p) return PostResult::kRetry;
      ssize_t rc = write_op(static_cast<const uint8_t*>(s.op.src) + s.posted, len, s.op.desc,
                            s.op.peer, s.op.remote_addr + s.posted, s.op.rkey, imm, s.op.imm, p);
      if (rc == -FI_EAGAIN) return PostResult::kRetry;
      if (rc != 0) {
        core_.last_error() = fi_message(imm ? "fi_writedata" : "fi_write", rc);
        fail_split(s, core_.last_error());
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
        if (written == out.size()) break;    // reported at the next poll
        out[written++] = finish(s);          // erases pending_[i]
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

  std::unordered_map<std::string, fi_addr_t> peers_;
  std::unique_ptr<Split[]> splits_;
  std::unique_ptr<Piece[]> pieces_;
  Split* split_free_ = nullptr;
  Piece* piece_free_ = nullptr;
  std::vector<Split*> pending_;
};

}  // namespace

std::unique_ptr<Domain> open_libfabric_domain(const EngineConfig& config, size_t nic_index,
                                              const LibfabricHook* hook) {
  return std::make_unique<LibfabricDomain>(config, nic_index, hook);
}

}  // namespace fabric
