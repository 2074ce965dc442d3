// Layout of a cuda_ipc endpoint's shared-memory segment, read and written by several processes:
// the header, the table of exported GPU regions, the inbox of immediates and the inbox of
// messages. Both inboxes are bounded multi-producer queues (Vyukov) on lock-free atomics, which
// work across processes because they hold no pointers and take no locks.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>

namespace fabric::ipc {

inline constexpr uint64_t kMagic = 0x31764350494246ull;  // "FBIPCv1"
inline constexpr uint32_t kMaxRegions = 4096;
inline constexpr uint32_t kImmSlots = 1u << 16;
inline constexpr uint32_t kMsgSlots = 256;

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "cross-process queues need address-free atomics");

// One exported region. The owner writes the fields, then makes the generation odd (release);
// a writer reads the generation (acquire), the fields, then the generation again (a seqlock).
struct RegionEntry {
  std::atomic<uint32_t> generation;
  int32_t device;
  uint64_t offset;      // of the region inside its CUDA allocation
  uint64_t len;
  uint64_t owner_ptr;   // the region's address in the owner's process (same-process writers)
  cudaIpcMemHandle_t handle;  // of the whole allocation
};

struct alignas(64) Header {
  uint64_t magic;
  uint32_t pid;
  uint32_t msg_slot_size;  // payload bytes per message slot
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
  static void format(void* base, uint32_t pid, size_t msg_slot_size) {
    auto* h = new (base) Header{};
    h->magic = kMagic;
    h->pid = pid;
    h->msg_slot_size = static_cast<uint32_t>(msg_slot_size);
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

  // Producers (any process). False when the inbox is full.
  bool push_imm(uint32_t imm) {
    uint64_t pos;
    ImmCell* cell = claim(header().imm_head, kImmSlots, [&](uint64_t i) { return &imm_cell(i); }, pos);
    if (!cell) return false;
    cell->imm = imm;
    cell->seq.store(pos + 1, std::memory_order_release);
    return true;
  }
  bool push_msg(const void* data, size_t len) {
    uint64_t pos;
    MsgCellHeader* cell = claim(header().msg_head, kMsgSlots, [&](uint64_t i) { return &msg_cell(i); }, pos);
    if (!cell) return false;
    cell->len = len;
    std::memcpy(reinterpret_cast<uint8_t*>(cell) + sizeof(MsgCellHeader), data, len);
    cell->seq.store(pos + 1, std::memory_order_release);
    return true;
  }

  // The owner (one thread).
  bool pop_imm(uint32_t& imm) {
    uint64_t& tail = header().imm_tail;
    ImmCell& cell = imm_cell(tail % kImmSlots);
    if (cell.seq.load(std::memory_order_acquire) != tail + 1) return false;
    imm = static_cast<uint32_t>(cell.imm);
    cell.seq.store(tail + kImmSlots, std::memory_order_release);
    tail++;
    return true;
  }
  // The next message, or null; release it with pop_msg() once its bytes are copied out.
  const MsgCellHeader* peek_msg() const {
    uint64_t tail = header().msg_tail;
    MsgCellHeader& cell = msg_cell(tail % kMsgSlots);
    return cell.seq.load(std::memory_order_acquire) == tail + 1 ? &cell : nullptr;
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
