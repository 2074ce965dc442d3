// The cuda_ipc endpoint's plain-POSIX parts, without a GPU: segment names (random nonces, not
// PIDs), liveness through the owner's flock, the stale sweep across PID namespaces, the host scope
// across IPC / PID namespaces and /dev/shm mounts, the same-process registry, and the region
// protocol (seqlock, writers' holds). Namespace cases need root (CAP_SYS_ADMIN) and skip without.
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "providers/ipc/ipc_shared.h"
#include "providers/ipc/shm_segment.h"

namespace fabric {
namespace {

constexpr size_t kSize = 1 << 16;
constexpr int kSkip = 77;  // a child's exit code: the namespace could not be made here

bool segment_exists(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

// A pipe that carries short lines between forked processes.
struct Pipe {
  int fd[2] = {-1, -1};
  Pipe() {
    if (pipe(fd) != 0) throw std::runtime_error("pipe");
  }
  ~Pipe() {
    for (int f : fd)
      if (f >= 0) close(f);
  }
  void put(const std::string& s) const {
    std::string line = s + "\n";
    if (write(fd[1], line.data(), line.size()) != static_cast<ssize_t>(line.size())) _exit(90);
  }
  void close_write() {
    close(fd[1]);
    fd[1] = -1;
  }
  std::string get() const {
    std::string s;
    char c;
    while (read(fd[0], &c, 1) == 1 && c != '\n') s += c;
    return s;
  }
};

// Runs `body` in a forked child and returns its exit code (body's return value; 99 on throw).
int in_child(const std::function<int()>& body) {
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    int rc = 99;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    std::fflush(nullptr);
    _exit(rc);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Runs `body` as process 1 of a new PID namespace (a child that unshares, and its child).
int in_new_pid_namespace(const std::function<int()>& body) {
  return in_child([&] {
    if (unshare(CLONE_NEWPID) != 0) return kSkip;
    return in_child(body);
  });
}

TEST(ShmEndpoint, NamesCarryARandomNonceAndNoPid) {
  ShmSegment a = ShmSegment::create_endpoint(kSize), b = ShmSegment::create_endpoint(kSize);
  for (const ShmSegment* s : {&a, &b}) {
    ASSERT_EQ(s->name().size(), 1 + shm::kPrefix.size() + shm::kNonceDigits) << s->name();
    EXPECT_EQ(s->name().rfind("/fabric-ipc-", 0), 0u) << s->name();
    EXPECT_EQ(shm::nonce_of(s->name()), s->nonce());
    EXPECT_NE(s->nonce(), 0u);
    EXPECT_TRUE(segment_exists(s->name()));
  }
  EXPECT_NE(a.nonce(), b.nonce());
  EXPECT_EQ(shm::endpoint_name(0x00ab00cd00ef0012ull), "/fabric-ipc-00ab00cd00ef0012");
  // Other forms (the old PID-based names among them) are never taken for endpoints.
  for (const char* bad : {"/fabric-ipc-1234-0", "/fabric-ipc-00AB00CD00EF0012", "/fabric-ipc-0000000000000000",
                          "/fabric-ipc-00ab00cd00ef00123", "/fabric-ipc-00ab00cd00ef001", "/other-00ab00cd00ef0012"})
    EXPECT_FALSE(shm::nonce_of(bad)) << bad;
  // Addresses: "<scope>/fabric-ipc-<nonce>", one '/', split back into scope and segment name.
  std::string address = shm::endpoint_address(shm::host_scope(), a.name());
  EXPECT_EQ(std::count(address.begin(), address.end(), '/'), 1) << address;
  shm::AddressParts parts = shm::split_address(address);
  EXPECT_EQ(parts.scope, shm::host_scope());
  EXPECT_EQ(parts.segment_name, a.name());
  EXPECT_TRUE(ShmSegment::open_endpoint(std::string(parts.segment_name)).owner_alive());
  EXPECT_TRUE(shm::split_address("no-slash").segment_name.empty());
  std::string name = a.name();
  a = ShmSegment();
  EXPECT_FALSE(segment_exists(name)) << "the owner unlinks its segment when it ends";
}

TEST(ShmEndpoint, APeerSeesTheOwnerAliveAndTheSweepLeavesItAlone) {
  ShmSegment owner = ShmSegment::create_endpoint(kSize);
  ShmSegment peer = ShmSegment::open_endpoint(owner.name());
  EXPECT_TRUE(peer.owner_alive());
  EXPECT_EQ(peer.size(), kSize);
  static_cast<uint8_t*>(owner.data())[100] = 42;
  EXPECT_EQ(static_cast<uint8_t*>(peer.data())[100], 42) << "one segment, two mappings";
  ShmSegment::remove_stale();
  EXPECT_TRUE(segment_exists(owner.name()));
  EXPECT_TRUE(peer.owner_alive()) << "the peer's own check takes no lock for long";
}

TEST(ShmEndpoint, OpeningWhatIsNotALiveEndpointIsUnsupported) {
  for (const char* name : {"/fabric-ipc-1234-0", "fabric-ipc-00ab00cd00ef0012", "/fabric-ipc-00ab00cd00ef0012"}) {
    try {
      ShmSegment::open_endpoint(name);
      ADD_FAILURE() << name << " opened";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << name << ": " << e.what();
    }
  }
}

TEST(ShmEndpoint, ASegmentLeftByAKilledOwnerIsStaleAndSwept) {
  Pipe names, hold;
  pid_t pid = fork();
  if (pid == 0) {
    ShmSegment s = ShmSegment::create_endpoint(kSize);
    names.put(s.name());
    hold.get();  // never answered: SIGKILLed here, so the segment stays behind
    _exit(0);
  }
  std::string name = names.get();
  ASSERT_FALSE(name.empty());
  ShmSegment peer = ShmSegment::open_endpoint(name);
  EXPECT_TRUE(peer.owner_alive());
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  EXPECT_TRUE(segment_exists(name)) << "SIGKILL leaves the segment";
  EXPECT_FALSE(peer.owner_alive()) << "the kernel dropped the dead owner's lock";
  try {
    ShmSegment::open_endpoint(name);
    ADD_FAILURE() << "a stale segment opened";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("no live owner"), std::string::npos) << e.what();
  }
  ShmSegment::remove_stale();
  EXPECT_FALSE(segment_exists(name));
  static_cast<uint8_t*>(peer.data())[0] = 1;  // our mapping outlives the name
}

// The bugs of PID-based names and kill(pid, 0): process 1 of a PID namespace cannot see our PID
// (kill says ESRCH, so the old sweep deleted our live segment), and two namespaces' process 1
// made the same name ("/fabric-ipc-1-0", O_EXCL then refused the second engine).
TEST(ShmEndpoint, TheSweepSparesLiveSegmentsOfOtherPidNamespaces) {
  ShmSegment ours = ShmSegment::create_endpoint(kSize);
  pid_t me = getpid();
  int rc = in_new_pid_namespace([&] {
    if (getpid() != 1) return 10;
    if (me != 1 && !(kill(me, 0) != 0 && errno == ESRCH)) return 11;  // what fooled the old sweep
    ShmSegment::remove_stale();
    if (!segment_exists(ours.name())) return 12;  // deleted a live segment
    ShmSegment peer = ShmSegment::open_endpoint(ours.name());
    return peer.owner_alive() ? 0 : 13;
  });
  if (rc == kSkip) GTEST_SKIP() << "unshare(CLONE_NEWPID) refused (needs root)";
  EXPECT_EQ(rc, 0);
  EXPECT_TRUE(segment_exists(ours.name()));

  // Two namespaces' process 1 at once: both create endpoints, under different names; each sees
  // the other alive; our sweep spares both while they live and removes both once they are gone.
  Pipe to_parent, release;
  std::vector<pid_t> children;
  for (int k = 0; k < 2; k++) {
    std::fflush(nullptr);
    pid_t c = fork();
    if (c == 0)
      _exit(in_new_pid_namespace([&] {
        ShmSegment s = ShmSegment::create_endpoint(kSize);
        to_parent.put(std::to_string(getpid()) + " " + s.name());
        release.get();
        return 0;
      }));
    children.push_back(c);
  }
  to_parent.close_write();  // a child that fails without a line ends our read
  std::vector<std::string> names;
  for (int k = 0; k < 2; k++) {
    std::string line = to_parent.get();
    if (line.empty()) break;
    EXPECT_EQ(line.substr(0, 2), "1 ") << "each is process 1 of its namespace: " << line;
    names.push_back(line.substr(line.find(' ') + 1));
  }
  if (names.size() == 2) {
    EXPECT_NE(names[0], names[1]);
    ShmSegment::remove_stale();
    for (auto& n : names) {
      EXPECT_TRUE(segment_exists(n)) << n;
      EXPECT_TRUE(ShmSegment::open_endpoint(n).owner_alive()) << n;
    }
  }
  release.put("go");
  release.put("go");
  for (pid_t c : children) {
    int status = 0;
    waitpid(c, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == kSkip) GTEST_SKIP() << "no PID namespaces";
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  ASSERT_EQ(names.size(), 2u);
  for (auto& n : names) EXPECT_FALSE(segment_exists(n)) << n << ": its owner ended cleanly";
}

TEST(HostScope, DiffersAcrossIpcAndPidNamespacesAndPrivateDevShm) {
  std::string ours = shm::host_scope();
  EXPECT_EQ(ours.find('/'), std::string::npos) << ours;
  EXPECT_NE(ours.find(".ipc"), std::string::npos) << ours;
  Pipe p;
  EXPECT_EQ(in_child([&] {
              p.put(shm::host_scope());
              return 0;
            }),
            0);
  EXPECT_EQ(p.get(), ours) << "a plain child is on the same host";

  int rc = in_child([&] {
    if (unshare(CLONE_NEWIPC) != 0) return kSkip;
    return shm::host_scope() != ours ? 0 : 1;
  });
  if (rc == kSkip) GTEST_SKIP() << "unshare refused (needs root)";
  EXPECT_EQ(rc, 0) << "a private IPC namespace (docker's default) is another host";

  rc = in_new_pid_namespace([&] { return shm::host_scope() != ours ? 0 : 1; });
  if (rc == kSkip) GTEST_SKIP() << "unshare(CLONE_NEWPID) refused";
  EXPECT_EQ(rc, 0) << "another PID namespace is another host (legacy CUDA IPC handles do not open there)";

  // The same IPC namespace but a private /dev/shm: another host, and our segment is not there.
  ShmSegment seg = ShmSegment::create_endpoint(kSize);
  rc = in_child([&] {
    if (unshare(CLONE_NEWNS) != 0) return kSkip;
    // Never let the mount below reach the host's mount namespace.
    if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return kSkip;
    if (mount("fabric-test-shm", "/dev/shm", "tmpfs", 0, "size=16m") != 0) return kSkip;
    if (shm::host_scope() == ours) return 1;
    try {
      ShmSegment::open_endpoint(seg.name());
      return 2;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kUnsupported) return 3;
      if (std::string(e.what()).find("not visible here") == std::string::npos) return 4;
    }
    ShmSegment mine = ShmSegment::create_endpoint(kSize);  // endpoints work inside it
    return segment_exists(mine.name()) ? 0 : 5;
  });
  if (rc == kSkip) GTEST_SKIP() << "mount namespace refused";
  EXPECT_EQ(rc, 0);
  EXPECT_TRUE(segment_exists(seg.name()));
}

TEST(LocalEndpoints, SameProcessIsKnownByNonceAndForgottenInAForkedChild) {
  ShmSegment s = ShmSegment::create_endpoint(kSize);
  EXPECT_FALSE(shm::LocalEndpoints::contains(s.nonce()));
  shm::LocalEndpoints::add(s.nonce());
  EXPECT_TRUE(shm::LocalEndpoints::contains(s.nonce()));
  EXPECT_EQ(in_child([&] { return shm::LocalEndpoints::contains(s.nonce()) ? 1 : 0; }), 0)
      << "a forked child must not take its parent's endpoints for its own";
  shm::LocalEndpoints::remove(s.nonce());
  EXPECT_FALSE(shm::LocalEndpoints::contains(s.nonce()));
}

ipc::RegionFields fields_of(uint64_t k) {
  ipc::RegionFields f;
  f.device = static_cast<int32_t>(k & 0x7fff);
  f.offset = k * 3;
  f.len = k * 5 + 1;
  f.owner_ptr = ~k;
  for (size_t i = 0; i < ipc::kHandleBytes; i++) f.handle[i] = static_cast<uint8_t>(k + i);
  return f;
}

bool same(const ipc::RegionFields& a, const ipc::RegionFields& b) {
  return a.device == b.device && a.offset == b.offset && a.len == b.len &&
         a.owner_ptr == b.owner_ptr && std::memcmp(a.handle, b.handle, ipc::kHandleBytes) == 0;
}

// One owner re-publishes an entry over and over while readers read it with the generations they
// have seen: a read that succeeds always returns exactly the fields published with that
// generation. (On x86 the hardware keeps loads in order, so this cannot show the reordering of
// REVIEW L2, which needs a weaker machine; it checks the protocol itself.)
TEST(RegionEntry, TheSeqlockNeverHandsOutTornOrStaleFields) {
  ipc::RegionEntry e;
  std::atomic<uint64_t> latest{0};  // generation << 32 | k of the last publication
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> good{0}, refused{0}, wrong{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; t++)
    readers.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
        uint64_t l = latest.load(std::memory_order_acquire);
        if (!l) continue;
        ipc::RegionFields f;
        if (e.read(static_cast<uint32_t>(l >> 32), f)) {
          (same(f, fields_of(l & 0xffffffff)) ? good : wrong)++;
        } else {
          refused++;
        }
      }
    });
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (uint64_t k = 1; k <= 20000 || good.load() < 1000; k++) {
    if (e.generation.load() & 1) e.revoke();
    uint32_t g = e.publish(fields_of(k));
    ASSERT_EQ(g & 1, 1u);
    latest.store(static_cast<uint64_t>(g) << 32 | k, std::memory_order_release);
    if (k % 64 == 0) std::this_thread::yield();  // let readers succeed now and then
    if (std::chrono::steady_clock::now() > deadline) break;
  }
  stop = true;
  for (auto& t : readers) t.join();
  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_GT(good.load(), 0u);
  std::printf("seqlock: %llu reads returned the published fields, %llu refused, %llu wrong\n",
              static_cast<unsigned long long>(good.load()), static_cast<unsigned long long>(refused.load()),
              static_cast<unsigned long long>(wrong.load()));
  ipc::RegionFields f;
  EXPECT_FALSE(e.read(e.generation.load() + 1, f)) << "an even generation never reads";
}

// The writers' holds (REVIEW M3) between threads: writers "copy" into a region only under a
// hold; the owner revokes, waits until no hold is left, then frees the memory and watches it.
// No write may land while it is freed.
TEST(RegionEntry, NoHeldWriteLandsAfterTheOwnerHasWaitedOutItsWriters) {
  ipc::RegionEntry e;
  std::atomic<uint32_t> published{0};
  std::atomic<bool> freed{false}, stop{false};
  std::vector<std::atomic<uint64_t>> memory(64);
  std::atomic<uint64_t> writes{0}, late{0}, refusals{0};
  std::vector<std::thread> writers;
  for (int t = 0; t < 2; t++)
    writers.emplace_back([&, t] {
      uint64_t x = static_cast<uint64_t>(t) + 1;
      while (!stop.load(std::memory_order_relaxed)) {
        uint32_t g = published.load(std::memory_order_acquire);
        if (!(g & 1)) continue;
        if (!e.hold(g)) {
          refusals++;
          continue;
        }
        for (int pass = 0; pass < 64; pass++) {  // a copy that takes a while
          for (auto& m : memory) m.store(x, std::memory_order_relaxed);
          if (freed.load(std::memory_order_seq_cst)) late++;  // the owner thinks nobody writes
        }
        writes++;
        e.release();
        x += 3;
      }
    });
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  int rounds = 0;
  for (; rounds < 300 && std::chrono::steady_clock::now() < deadline; rounds++) {
    published.store(e.publish(fields_of(static_cast<uint64_t>(rounds) + 1)), std::memory_order_release);
    // Revoke while a writer is in the middle of a copy (or after 10 ms without one).
    auto round_end = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
    while (!e.has_writers() && std::chrono::steady_clock::now() < round_end) std::this_thread::yield();
    e.revoke();
    while (e.has_writers()) std::this_thread::yield();
    freed.store(true, std::memory_order_seq_cst);
    for (auto& m : memory) m.store(0, std::memory_order_relaxed);
    for (int spin = 0; spin < 50; spin++)
      for (auto& m : memory)
        if (m.load(std::memory_order_relaxed) != 0) late++;
    freed.store(false, std::memory_order_seq_cst);
  }
  stop = true;
  for (auto& t : writers) t.join();
  EXPECT_EQ(late.load(), 0u);
  EXPECT_GT(writes.load(), 0u);
  EXPECT_GE(rounds, 3);
  std::printf("holds: %d rounds, %llu held writes, %llu refused, %llu late\n", rounds,
              static_cast<unsigned long long>(writes.load()), static_cast<unsigned long long>(refusals.load()),
              static_cast<unsigned long long>(late.load()));
  EXPECT_GT(refusals.load(), 0u) << "some writers came after a revocation and were refused";
  EXPECT_FALSE(e.has_writers());
}

// ---- the inbox of immediates: batches pushed in one claim ----------------------------------------

// A formatted endpoint in plain heap memory (the layout needs no shared memory to be tested).
struct HeapEndpoint {
  std::vector<uint8_t> bytes;
  ipc::Endpoint e;
  HeapEndpoint() : bytes(ipc::Layout(64).total + 64) {
    void* base = bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64;
    ipc::Endpoint::format(base, 1, 1, 64, ipc::EndpointKind::kCuda);
    e = ipc::Endpoint(base);
  }
};

TEST(ImmInbox, ABatchArrivesWholeInOrderAndAFullInboxTakesWhatFits) {
  HeapEndpoint h;
  std::vector<uint32_t> v(3000);
  for (size_t i = 0; i < v.size(); i++) v[i] = static_cast<uint32_t>(i * 7 + 1);
  EXPECT_EQ(h.e.push_imms(v.data(), v.size()), v.size());
  EXPECT_TRUE(h.e.push_imm(99));
  for (size_t i = 0; i < v.size(); i++) {
    uint32_t got = 0;
    ASSERT_TRUE(h.e.pop_imm(got));
    ASSERT_EQ(got, v[i]);
  }
  uint32_t got = 0;
  ASSERT_TRUE(h.e.pop_imm(got));
  EXPECT_EQ(got, 99u);
  EXPECT_FALSE(h.e.pop_imm(got));
  // Fill all but 10 cells, wrapping around the ring; a batch of 100 then pushes exactly 10.
  std::vector<uint32_t> many(ipc::kImmSlots - 10, 5);
  size_t pushed = 0;
  while (pushed < many.size()) {
    size_t n = h.e.push_imms(many.data() + pushed, many.size() - pushed);
    ASSERT_GT(n, 0u);
    pushed += n;
  }
  std::vector<uint32_t> more(100, 6);
  size_t room = 0;
  for (size_t n; (n = h.e.push_imms(more.data() + room, more.size() - room)) > 0;) room += n;
  EXPECT_EQ(room, 10u);
  EXPECT_EQ(h.e.push_imms(more.data(), 1), 0u) << "full";
  EXPECT_FALSE(h.e.push_imm(7));
  size_t popped = 0;
  while (h.e.pop_imm(got)) popped++;
  EXPECT_EQ(popped, static_cast<size_t>(ipc::kImmSlots));
}

// Producers pushing batches and single immediates at once while the owner pops: every
// immediate arrives exactly once, and each producer's immediates arrive in its order.
TEST(ImmInbox, ConcurrentBatchAndSingleProducersLoseAndDuplicateNothing) {
  HeapEndpoint h;
  constexpr uint32_t kPerProducer = 200000;
  constexpr uint32_t kProducers = 3;
  std::atomic<bool> go{false};
  std::vector<std::thread> producers;
  for (uint32_t p = 0; p < kProducers; p++)
    producers.emplace_back([&, p] {
      while (!go.load()) std::this_thread::yield();
      uint32_t next = 0;
      std::vector<uint32_t> batch;
      while (next < kPerProducer) {
        if (p == 0) {  // one at a time
          if (h.e.push_imm(p << 28 | next)) {
            next++;
          } else {
            std::this_thread::yield();  // full
          }
          continue;
        }
        batch.clear();
        uint32_t n = std::min<uint32_t>(kPerProducer - next, 1 + next % 5000);
        for (uint32_t k = 0; k < n; k++) batch.push_back(p << 28 | (next + k));
        size_t pushed = h.e.push_imms(batch.data(), batch.size());
        if (pushed == 0) std::this_thread::yield();  // full
        next += static_cast<uint32_t>(pushed);
      }
    });
  go = true;
  std::vector<uint32_t> expect(kProducers, 0);
  uint64_t total = 0, out_of_order = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (total < uint64_t{kPerProducer} * kProducers && std::chrono::steady_clock::now() < deadline) {
    uint32_t v;
    if (!h.e.pop_imm(v)) {
      std::this_thread::yield();
      continue;
    }
    uint32_t p = v >> 28;
    ASSERT_LT(p, kProducers);
    if ((v & 0x0fffffff) != expect[p]) out_of_order++;
    expect[p] = (v & 0x0fffffff) + 1;
    total++;
  }
  for (auto& t : producers) t.join();
  EXPECT_EQ(total, uint64_t{kPerProducer} * kProducers);
  EXPECT_EQ(out_of_order, 0u);
  uint32_t v;
  EXPECT_FALSE(h.e.pop_imm(v)) << "nothing extra";
}

}  // namespace
}  // namespace fabric
