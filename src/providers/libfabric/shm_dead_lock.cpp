// Frees the region lock a killed shm peer held (see shm_dead_lock.h).
#include "providers/libfabric/shm_dead_lock.h"

#include <fcntl.h>
#include <pthread.h>
#include <rdma/fabric.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>

#include "util/log.h"

namespace fabric {
namespace {

// The head of libfabric 1.17's struct smr_region (include/ofi_shm.h, SMR_VERSION 4), as far as
// the lock. Read from the file, never from libfabric's headers (they are not installed).
struct RegionHeaderV4 {
  uint8_t version;
  uint8_t resv;
  uint16_t flags;
  int pid;
  uint8_t cma_cap_peer;
  uint8_t cma_cap_self;
  uint32_t max_sar_buf_per_peer;
  void* base_addr;
  int lock;  // pthread_spinlock_t
};
static_assert(sizeof(pthread_spinlock_t) == sizeof(int));
constexpr uint8_t kRegionVersion = 4;

constexpr auto kHeldFor = std::chrono::milliseconds(20);

// What this glibc stores in a free process-shared spinlock (x86-64: 1, elsewhere 0).
int free_lock_value() {
  pthread_spinlock_t l;
  pthread_spin_init(&l, PTHREAD_PROCESS_SHARED);
  const int v = l;
  pthread_spin_destroy(&l);
  return v;
}

}  // namespace

bool release_dead_owner_lock(const std::string& address, int pid) {
  if (FI_MAJOR(fi_version()) != 1 || FI_MINOR(fi_version()) != 17) return false;
  std::string name = address.c_str();  // the address may end in its NUL
  if (auto at = name.find("://"); at != std::string::npos) name = name.substr(at + 3);
  const int fd = shm_open(("/" + name).c_str(), O_RDWR, 0);
  if (fd < 0) return false;
  struct stat st {};
  void* map = MAP_FAILED;
  if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= sizeof(RegionHeaderV4))
    map = mmap(nullptr, sizeof(RegionHeaderV4), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return false;
  auto* head = static_cast<RegionHeaderV4*>(map);
  bool released = false;
  if (head->version == kRegionVersion && head->pid == pid) {
    std::atomic_ref<int> lock(head->lock);
    const int free_value = free_lock_value();
    // Held all along by the dead owner; a lock that is ever free meanwhile is a live sender's.
    bool held = true;
    const auto until = std::chrono::steady_clock::now() + kHeldFor;
    while (held && std::chrono::steady_clock::now() < until) {
      held = lock.load() != free_value;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (held) {
      lock.store(free_value);
      released = true;
      log::warn("shm: released the region lock that peer process {} held when it died ({})", pid, name);
    }
  }
  munmap(map, sizeof(RegionHeaderV4));
  return released;
}

}  // namespace fabric
