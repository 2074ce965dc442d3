// Layout of a local endpoint's shared-memory segment (cuda_ipc's and host_ipc's), read and
// written by several processes: the header, the table of exported regions, the inbox of
// immediates and the inbox of messages. Both inboxes are bounded multi-producer queues (Vyukov) on lock-free atomics, which
// work across processes because they hold no pointers and take no locks. Every field that more
// than one process touches is an atomic; the file needs no CUDA header (the CPU unit tests
// exercise the region protocol below).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>

#if defined(__SANITIZE_THREAD__)
#define FABRIC_IPC_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FABRIC_IPC_TSAN 1
#endif
#endif
#ifdef FABRIC_IPC_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace fabric::ipc {

// ThreadSanitizer tracks synchronisation by address, and a producer in this process pushes
// through its own mapping of the segment while the owner pops through another: the release and
// the acquire never meet, and the bytes copied before a push look racy. Under TSan a push also
// releases, and a pop acquires, a key that both mappings name alike (the endpoint's nonce).
#ifdef FABRIC_IPC_TSAN
inline char* tsan_key(uint64_t nonce) {
  static char keys[256];
  return &keys[nonce % 256];
}
inline void tsan_release_key(uint64_t nonce) { __tsan_release(tsan_key(nonce)); }
inline void tsan_acquire_key(uint64_t nonce) { __tsan_acquire(tsan_key(nonce)); }
#else
inline void tsan_release_key(uint64_t) {}
inline void tsan_acquire_key(uint64_t) {}
#endif

inline constexpr uint64_t kMagic = 0x33764350494246ull;  // "FBIPCv3": nonce, closed flag, holds, kind
inline constexpr uint32_t kMaxRegions = 4096;
inline constexpr uint32_t kImmSlots = 1u << 16;
inline constexpr uint32_t kMsgSlots = 256;
inline constexpr size_t kHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "cross-process queues need address-free atomics");

// Which local domain owns an endpoint: each opens only its own kind (a cuda_ipc engine and a
// host_ipc engine on one host reach each other through their NICs).
enum class EndpointKind : uint32_t { kCuda = 1, kHost = 2 };

// What a writer needs of an exported region.
struct RegionFields {
  int32_t device = 0;  // the CUDA device; -1: host memory (host_ipc)
  uint64_t offset = 0;     // of the region inside its CUDA allocation
  uint64_t len = 0;
  uint64_t owner_ptr = 0;  // the region's address in the owner's process (same-process writers,
                           // and host_ipc's process_vm_writev)
  uint8_t handle[kHandleBytes] = {};  // cudaIpcMemHandle_t of the whole allocation
};

// One exported region: a seqlock (the generation, odd while published) around its fields, and
// the writers' holds that let its owner deregister it safely.
//
// Deregistration against writers in other processes (a copy may be queued on a writer's GPU
// when the owner deregisters, and over CUDA IPC nothing revokes a mapping):
// - a writer takes a hold (writers + 1, then re-reads the generation; both seq_cst) right before
//   it hands copies into the region to its GPU, and gives up if the generation moved; it
//   releases the hold once those copies have completed on the GPU;
// - the owner makes the generation even (seq_cst), then waits until no hold is left.
// By the seq_cst total order either the writer sees the new generation (and issues nothing) or
// the owner sees its hold (and waits for its copies): once deregistration returns, no copy into
// the region runs or will run.
struct RegionEntry {
  std::atomic<uint32_t> generation{0};
  std::atomic<uint32_t> writers{0};
  std::atomic<int64_t> device{0};
  std::atomic<uint64_t> offset{0}, len{0}, owner_ptr{0};
  std::atomic<uint64_t> handle[kHandleBytes / 8] = {};

  // Owner, on a free (even) entry: fills the fields, then publishes them. Returns the generation.
  uint32_t publish(const RegionFields& f) {
    uint32_t g = generation.load(std::memory_order_relaxed);
    // The fields change while the generation is even; this fence keeps a reader that sees one of
    // the new values from also seeing the older generation (the seqlock's writer side).
    std::atomic_thread_fence(std::memory_order_release);
    device.store(f.device, std::memory_order_relaxed);
    offset.store(f.offset, std::memory_order_relaxed);
    len.store(f.len, std::memory_order_relaxed);
    owner_ptr.store(f.owner_ptr, std::memory_order_relaxed);
    for (size_t w = 0; w < kHandleBytes / 8; w++) {
      uint64_t v;
      std::memcpy(&v, f.handle + 8 * w, 8);
      handle[w].store(v, std::memory_order_relaxed);
    }
    generation.store(g + 1, std::memory_order_release);
    return g + 1;
  }

  // Owner: no new copies from now on (generation even); then wait until !has_writers().
  void revoke() { generation.fetch_add(1, std::memory_order_seq_cst); }
  bool has_writers() const { return writers.load(std::memory_order_seq_cst) != 0; }

  // Any process: the fields of generation `g`, or false when the entry is not (or no longer)
  // that generation. Acquire before the fields, an acquire fence after them, then the check.
  bool read(uint32_t g, RegionFields& out) const {
    if ((g & 1) == 0 || generation.load(std::memory_order_acquire) != g) return false;
    out.device = static_cast<int32_t>(device.load(std::memory_order_relaxed));
    out.offset = offset.load(std::memory_order_relaxed);
    out.len = len.load(std::memory_order_relaxed);
    out.owner_ptr = owner_ptr.load(std::memory_order_relaxed);
    for (size_t w = 0; w < kHandleBytes / 8; w++) {
      uint64_t v = handle[w].load(std::memory_order_relaxed);
      std::memcpy(out.handle + 8 * w, &v, 8);
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    return generation.load(std::memory_order_relaxed) == g;
  }
  bool is(uint32_t g) const { return generation.load(std::memory_order_acquire) == g; }

  // Writer: a hold on generation `g` before issuing copies into it; false (and no hold) when the
  // region is no longer that generation. release() once the copies have completed.
  bool hold(uint32_t g) {
    writers.fetch_add(1, std::memory_order_seq_cst);
    if (generation.load(std::memory_order_seq_cst) == g) return true;
    writers.fetch_sub(1, std::memory_order_release);
    return false;
  }
  void release() { writers.fetch_sub(1, std::memory_order_release); }
};

struct alignas(64) Header {
  uint64_t magic;
  uint64_t nonce;          // the endpoint's random identity; also in the segment's name
  uint32_t pid;            // the owner (host scopes include the PID namespace: it names it)
  uint32_t msg_slot_size;  // payload bytes per message slot
  EndpointKind kind;
  uint64_t owner_base;     // the segment's address in its owner's process
  std::atomic<uint32_t> closed;  // the owner's domain has closed: writers stop at once
  // host_ipc: a writer checks that it may write into the owner's memory by writing here
  // through process_vm_writev (at owner_base + offsetof(Header, probe)).
  std::atomic<uint64_t> probe;
  alignas(64) std::atomic<uint64_t> imm_head;  // producers
  alignas(64) uint64_t imm_tail;               // the owner only
  alignas(64) std::atomic<uint64_t> msg_head;
  alignas(64) uint64_t msg_tail;
};

struct ImmCell {
  std::atomic<uint64_t> seq;
  uint64_t imm;
};

struct MsgCellHeader {
  std::atomic<uint64_t> seq;
  uint64_t len;
};

// Offsets of each part inside the segment.
struct Layout {
  size_t msg_slot_size;
  size_t regions = sizeof(Header);
  size_t imms = regions + sizeof(RegionEntry) * kMaxRegions;
  size_t msgs = imms + sizeof(ImmCell) * kImmSlots;
  size_t msg_stride = (sizeof(MsgCellHeader) + msg_slot_size + 63) / 64 * 64;
  size_t total = msgs + msg_stride * kMsgSlots;
  explicit Layout(size_t slot_size) : msg_slot_size(slot_size) {}
};

// A view of a mapped segment (ours or a peer's).
class Endpoint {
 public:
  Endpoint() = default;
  explicit Endpoint(void* base) : base_(static_cast<uint8_t*>(base)), layout_(header().msg_slot_size) {}

  // Formats a fresh (zeroed) segment.
  static void format(void* base, uint64_t nonce, uint32_t pid, size_t msg_slot_size, EndpointKind kind) {
    auto* h = new (base) Header{};
    h->magic = kMagic;
    h->nonce = nonce;
    h->pid = pid;
    h->msg_slot_size = static_cast<uint32_t>(msg_slot_size);
    h->kind = kind;
    h->owner_base = reinterpret_cast<uint64_t>(base);
    Endpoint e(base);
    for (uint32_t i = 0; i < kMaxRegions; i++) new (&e.region(i)) RegionEntry{};
    for (uint32_t i = 0; i < kImmSlots; i++) new (&e.imm_cell(i)) ImmCell{{i}, 0};
    for (uint32_t i = 0; i < kMsgSlots; i++) new (&e.msg_cell(i)) MsgCellHeader{{i}, 0};
  }

  Header& header() const { return *reinterpret_cast<Header*>(base_); }
  RegionEntry& region(uint32_t i) const {
    return reinterpret_cast<RegionEntry*>(base_ + layout_.regions)[i];
  }
  size_t msg_capacity() const { return layout_.msg_slot_size; }
  size_t size() const { return layout_.total; }
  bool closed() const { return header().closed.load(std::memory_order_acquire) != 0; }

  // Producers (any process). False when the inbox is full.
  bool push_imm(uint32_t imm) {
    uint64_t pos;
    ImmCell* cell = claim(header().imm_head, kImmSlots, [&](uint64_t i) { return &imm_cell(i); }, pos);
    if (!cell) return false;
    cell->imm = imm;
    tsan_release_key(header().nonce);
    cell->seq.store(pos + 1, std::memory_order_release);
    return true;
  }
  // Up to n immediates, in order, their cells claimed together (one CAS on the shared head for a
  // whole batch instead of one each). Returns how many were pushed: fewer when the inbox has less
  // room, 0 when it is full. The owner frees cells in order, so when the cell for position
  // pos + k - 1 is free (its sequence is that position), so are all cells from pos on.
  size_t push_imms(const uint32_t* imms, size_t n) {
    std::atomic<uint64_t>& head = header().imm_head;
    uint64_t pos = head.load(std::memory_order_relaxed);
    for (;;) {
      size_t k = n < kImmSlots ? n : kImmSlots;
      bool stale = false;
      while (k > 0) {
        const uint64_t last = pos + k - 1;
        auto diff = static_cast<int64_t>(imm_cell(last).seq.load(std::memory_order_acquire) - last);
        if (diff == 0) break;  // room for k
        if (diff > 0) {        // another producer claimed it: our head is old
          stale = true;
          break;
        }
        k /= 2;  // not consumed yet: try fewer
      }
      if (stale) {
        pos = head.load(std::memory_order_relaxed);
        continue;
      }
      if (k == 0) return 0;  // full
      if (!head.compare_exchange_weak(pos, pos + k, std::memory_order_relaxed)) continue;
      tsan_release_key(header().nonce);
      for (size_t j = 0; j < k; j++) {
        ImmCell& cell = imm_cell(pos + j);
        cell.imm = imms[j];
        cell.seq.store(pos + j + 1, std::memory_order_release);
      }
      return k;
    }
  }
  bool push_msg(const void* data, size_t len) {
    uint64_t pos;
    MsgCellHeader* cell = claim(header().msg_head, kMsgSlots, [&](uint64_t i) { return &msg_cell(i); }, pos);
    if (!cell) return false;
    cell->len = len;
    std::memcpy(reinterpret_cast<uint8_t*>(cell) + sizeof(MsgCellHeader), data, len);
    tsan_release_key(header().nonce);
    cell->seq.store(pos + 1, std::memory_order_release);
    return true;
  }

  // The owner (one thread).
  bool pop_imm(uint32_t& imm) {
    uint64_t& tail = header().imm_tail;
    ImmCell& cell = imm_cell(tail % kImmSlots);
    if (cell.seq.load(std::memory_order_acquire) != tail + 1) return false;
    tsan_acquire_key(header().nonce);
    imm = static_cast<uint32_t>(cell.imm);
    cell.seq.store(tail + kImmSlots, std::memory_order_release);
    tail++;
    return true;
  }
  // The next message, or null; release it with pop_msg() once its bytes are copied out.
  const MsgCellHeader* peek_msg() const {
    uint64_t tail = header().msg_tail;
    MsgCellHeader& cell = msg_cell(tail % kMsgSlots);
    if (cell.seq.load(std::memory_order_acquire) != tail + 1) return nullptr;
    tsan_acquire_key(header().nonce);
    return &cell;
  }
  void pop_msg() {
    uint64_t& tail = header().msg_tail;
    msg_cell(tail % kMsgSlots).seq.store(tail + kMsgSlots, std::memory_order_release);
    tail++;
  }

 private:
  ImmCell& imm_cell(uint64_t i) const { return reinterpret_cast<ImmCell*>(base_ + layout_.imms)[i % kImmSlots]; }
  MsgCellHeader& msg_cell(uint64_t i) const {
    return *reinterpret_cast<MsgCellHeader*>(base_ + layout_.msgs + layout_.msg_stride * (i % kMsgSlots));
  }

  // Vyukov's enqueue: claim the cell at head when its sequence says it is free.
  template <class CellAt>
  static auto claim(std::atomic<uint64_t>& head, uint64_t slots, CellAt cell_at, uint64_t& pos)
      -> decltype(cell_at(0)) {
    pos = head.load(std::memory_order_relaxed);
    for (;;) {
      auto* cell = cell_at(pos % slots);
      uint64_t seq = cell->seq.load(std::memory_order_acquire);
      auto diff = static_cast<int64_t>(seq - pos);
      if (diff == 0) {
        if (head.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) return cell;
      } else if (diff < 0) {
        return nullptr;  // full
      } else {
        pos = head.load(std::memory_order_relaxed);
      }
    }
  }

  uint8_t* base_ = nullptr;
  Layout layout_{0};
};

}  // namespace fabric::ipc
