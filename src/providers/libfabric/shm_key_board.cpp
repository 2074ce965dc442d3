// The live-key board of an shm domain (see shm_key_board.h).
#include "providers/libfabric/shm_key_board.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "fabric/error.h"

namespace fabric {
namespace {

constexpr size_t kBytes = ShmKeyBoard::kSlots * sizeof(uint64_t);
constexpr uint64_t kMagic = 0x6661627269636b62ull;  // "fabrickb"

std::atomic_ref<uint64_t> entry(uint64_t* slots, uint64_t slot) { return std::atomic_ref<uint64_t>(slots[slot]); }

}  // namespace

ShmKeyBoard::ShmKeyBoard(int fd, uint64_t* slots) : fd_(fd), slots_(slots) {}

ShmKeyBoard::~ShmKeyBoard() {
  if (slots_) munmap(slots_, kBytes);
  if (fd_ >= 0) close(fd_);
}

std::unique_ptr<ShmKeyBoard> ShmKeyBoard::create() {
  const int fd = memfd_create("fabric-shm-keys", MFD_CLOEXEC);
  if (fd < 0) throw Error(ErrorCode::kProvider, fmt::format("shm: memfd_create failed: {}", std::strerror(errno)));
  if (ftruncate(fd, kBytes) != 0) {
    const int err = errno;
    close(fd);
    throw Error(ErrorCode::kProvider, fmt::format("shm: sizing the key board failed: {}", std::strerror(err)));
  }
  void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    throw Error(ErrorCode::kProvider, fmt::format("shm: mapping the key board failed: {}", std::strerror(err)));
  }
  auto* slots = static_cast<uint64_t*>(p);
  entry(slots, kUnboarded).store(kMagic, std::memory_order_release);
  return std::unique_ptr<ShmKeyBoard>(new ShmKeyBoard(fd, slots));
}

std::unique_ptr<ShmKeyBoard> ShmKeyBoard::open(int pid, int fd) {
  if (pid <= 0 || fd < 0) return nullptr;
  const int own = ::open(fmt::format("/proc/{}/fd/{}", pid, fd).c_str(), O_RDONLY | O_CLOEXEC);
  if (own < 0) return nullptr;
  struct stat st {};
  void* p = MAP_FAILED;
  if (fstat(own, &st) == 0 && static_cast<size_t>(st.st_size) == kBytes)
    p = mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, own, 0);
  if (p == MAP_FAILED) {
    close(own);
    return nullptr;
  }
  auto board = std::unique_ptr<ShmKeyBoard>(new ShmKeyBoard(own, static_cast<uint64_t*>(p)));
  if (entry(board->slots_, kUnboarded).load(std::memory_order_acquire) != kMagic) return nullptr;
  return board;
}

uint32_t ShmKeyBoard::take_slot() {
  std::lock_guard lock(mu_);
  return free_.take().value_or(kUnboarded);
}

void ShmKeyBoard::release(uint32_t slot) {
  if (slot >= kUnboarded) return;
  std::lock_guard lock(mu_);
  free_.give(slot);
}

void ShmKeyBoard::publish(uint64_t key) {
  const uint64_t slot = key & kSlotMask;
  if (slot != kUnboarded) entry(slots_, slot).store(key, std::memory_order_release);
}

void ShmKeyBoard::revoke(uint64_t key) {
  const uint64_t slot = key & kSlotMask;
  if (slot == kUnboarded || entry(slots_, slot).load(std::memory_order_relaxed) != key) return;
  entry(slots_, slot).store(0, std::memory_order_release);
  release(static_cast<uint32_t>(slot));
}

bool ShmKeyBoard::live(uint64_t key) const {
  const uint64_t slot = key & kSlotMask;
  return slot == kUnboarded || entry(slots_, slot).load(std::memory_order_acquire) == key;
}

}  // namespace fabric
