// The pieces shm's dead-peer recovery stands on: the pid in our endpoint names, the pidfd watch
// (exits, zombies, slots reused), and freeing a region lock its killed owner held.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "providers/libfabric/shm_dead_lock.h"
#include "providers/libfabric/shm_names.h"
#include "providers/libfabric/shm_senders.h"
#include "util/process_watch.h"

namespace fabric {
namespace {

bool eventually(const std::function<bool()>& f) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!f()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

pid_t sleeper() {
  pid_t pid = fork();
  if (pid == 0) {
    pause();
    _exit(0);
  }
  return pid;
}

TEST(ShmNames, EndpointNamesCarryThisProcesssPid) {
  const std::string name = shm_names::next_endpoint_name();
  EXPECT_EQ(shm_names::pid_of(name), getpid()) << name;
  EXPECT_EQ(shm_names::pid_of(name + std::string(1, '\0')), getpid()) << "an address ends in its NUL";
  EXPECT_EQ(shm_names::pid_of("fi_shm://1234:0:0"), 0) << "libfabric's own names carry no pid we trust";
  EXPECT_EQ(shm_names::pid_of("fi_shm://fabric-1.1234-ab-0"), 0) << "another PID namespace";
  EXPECT_EQ(shm_names::pid_of(""), 0);
}

TEST(ProcessWatch, AKilledProcessIsSeenExitedZombieOrReaped) {
  util::ProcessWatch watch;
  const pid_t a = sleeper(), b = sleeper();
  std::atomic<int> exits{0};
  EXPECT_TRUE(watch.watch(3, a, [&] { exits++; }));
  EXPECT_TRUE(watch.watch(4, b));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(watch.exited(3));
  EXPECT_FALSE(watch.exited(4));
  kill(a, SIGKILL);  // a zombie until reaped: kill(a, 0) still succeeds
  EXPECT_TRUE(eventually([&] { return watch.exited(3); }));
  EXPECT_TRUE(eventually([&] { return exits.load() == 1; }));
  EXPECT_FALSE(watch.exited(4)) << "only the dead one";
  EXPECT_FALSE(shm_process_alive(a)) << "a zombie is not alive";
  EXPECT_TRUE(shm_process_alive(b));
  waitpid(a, nullptr, 0);
  EXPECT_FALSE(shm_process_alive(a));
  // The slot reused for a live process starts clear, and the old exit never marks it.
  EXPECT_TRUE(watch.watch(3, b));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(watch.exited(3));
  EXPECT_FALSE(watch.watch(5, a)) << "already gone";
  EXPECT_TRUE(watch.exited(5));
  kill(b, SIGKILL);
  waitpid(b, nullptr, 0);
  EXPECT_TRUE(eventually([&] { return watch.exited(3) && watch.exited(4); }));
  EXPECT_EQ(exits.load(), 1) << "a's callback once";
}

// A region file with the head of libfabric 1.17's shm region (version 4), owned by `pid`, its
// lock as `lock`.
struct FakeRegion {
  std::string name;
  int* lock = nullptr;
  void* map = nullptr;
  FakeRegion(int pid, uint8_t version, bool held) {
    name = "fabric-dead-lock-test-" + std::to_string(getpid()) + "-" + std::to_string(pid);
    int fd = shm_open(("/" + name).c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, 4096), 0);
    map = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    auto* p = static_cast<uint8_t*>(map);
    p[0] = version;
    std::memcpy(p + 4, &pid, sizeof pid);
    auto* l = reinterpret_cast<pthread_spinlock_t*>(p + 24);
    pthread_spin_init(l, PTHREAD_PROCESS_SHARED);
    if (held) pthread_spin_lock(l);
    lock = reinterpret_cast<int*>(p + 24);
  }
  bool locked() const {
    auto* l = reinterpret_cast<pthread_spinlock_t*>(lock);
    if (pthread_spin_trylock(l) != 0) return true;
    pthread_spin_unlock(l);
    return false;
  }
  ~FakeRegion() {
    munmap(map, 4096);
    shm_unlink(("/" + name).c_str());
  }
};

TEST(ShmDeadLock, TheLockADeadOwnerHeldIsFreedAndNothingElseIsTouched) {
  const pid_t dead = sleeper();
  kill(dead, SIGKILL);
  waitpid(dead, nullptr, 0);
  {
    FakeRegion r(dead, 4, true);
    EXPECT_TRUE(release_dead_owner_lock("fi_shm://" + r.name + std::string(1, '\0'), dead));
    EXPECT_FALSE(r.locked()) << "freed: a sender spinning on it goes on";
  }
  {
    FakeRegion r(dead, 4, false);
    EXPECT_FALSE(release_dead_owner_lock(r.name, dead)) << "free already";
    EXPECT_FALSE(r.locked());
  }
  {
    FakeRegion r(dead, 5, true);
    EXPECT_FALSE(release_dead_owner_lock(r.name, dead)) << "a layout it does not know";
    EXPECT_TRUE(r.locked());
  }
  {
    FakeRegion r(dead + 1, 4, true);
    EXPECT_FALSE(release_dead_owner_lock(r.name, dead)) << "another owner's region";
    EXPECT_TRUE(r.locked());
  }
  EXPECT_FALSE(release_dead_owner_lock("fabric-no-such-region", dead));
}

}  // namespace
}  // namespace fabric
