// Which of an shm domain's registrations are live, readable by the peers that write to them.
//
// Why: libfabric 1.17's shm drops a WRITE into a region its owner deregistered without telling
// the sender: one up to shm's inject size completes ok, a larger one never completes. verbs and EFA
// report a remote access error; shm needs the engine's own means. Every region an shm domain
// registers takes a slot of this board, and its key carries the slot (low 16 bits); the owner
// clears the slot *before* it closes the registration, and a sender reads the slot before it
// posts, refusing a WRITE whose key is no longer there.
//
// Where it lives: a memfd of the owner, so a killed process leaves no file behind. Its descriptor
// number is part of the owner's endpoint name (shm_names.h), and a peer opens it read-only through
// /proc/<pid>/fd/<n>, which needs the ptrace access that shm's own cross-memory copies need. A peer
// that cannot open it (another PID namespace, a restricted ptrace scope, an address of an older
// build) gets no board and posts unchecked, as before.
//
// A WRITE posted before the owner deregistered is not covered: as with any RDMA, freeing a region
// peers may still write is the application's race.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "util/free_slots.h"

namespace fabric {

class ShmKeyBoard {
 public:
  static constexpr uint32_t kSlots = 1u << 16;
  static constexpr uint64_t kSlotMask = kSlots - 1;
  // A key whose slot is this one is on no board (the board was full): never refused.
  static constexpr uint32_t kUnboarded = kSlots - 1;

  ~ShmKeyBoard();
  ShmKeyBoard(const ShmKeyBoard&) = delete;
  ShmKeyBoard& operator=(const ShmKeyBoard&) = delete;

  // The owner's board; throws kProvider when no memfd can be made.
  static std::unique_ptr<ShmKeyBoard> create();
  // A peer's board: `pid` is the owner's, `fd` the number in its endpoint name. Null where it
  // cannot be opened or is not a board.
  static std::unique_ptr<ShmKeyBoard> open(int pid, int fd);

  int fd() const { return fd_; }

  // Owner, thread-safe. A registration takes a slot (kUnboarded when all are taken), makes its
  // key with key_for, publishes it once the provider accepted the key, and revokes it (clears the
  // slot, so peers refuse the key from then on, and frees the slot) before the registration is
  // closed. A slot whose key was never published goes back with release().
  uint32_t take_slot();
  static uint64_t key_for(uint64_t random, uint32_t slot) { return (random & ~kSlotMask) | slot; }
  void publish(uint64_t key);
  void revoke(uint64_t key);
  void release(uint32_t slot);

  // Peer. False only when the key's slot no longer holds it: its region was deregistered.
  bool live(uint64_t key) const;

 private:
  ShmKeyBoard(int fd, uint64_t* slots);

  int fd_ = -1;
  uint64_t* slots_ = nullptr;  // kSlots entries; the last is the board's magic
  std::mutex mu_;  // owner: the free slots
  util::FreeSlots free_{kUnboarded};
};

}  // namespace fabric
