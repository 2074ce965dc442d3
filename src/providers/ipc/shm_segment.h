// The POSIX shared-memory segment of a cuda_ipc endpoint, its name and its liveness, and the
// identity of the host it can be reached from. Plain POSIX and header-only, so that the CPU unit
// tests use it in builds without CUDA.
//
// - A segment is named "/fabric-ipc-<nonce>", the nonce a random 64-bit number (16 hex digits)
//   that the endpoint also writes into its header: names never depend on PIDs, which repeat
//   across PID namespaces (two containers both have a process 1).
// - Its owner holds an exclusive flock on the segment's file for its whole life (the kernel drops
//   it when the owner dies, however it dies). A segment whose lock can be taken has no owner: it
//   is stale. That holds across PID namespaces, where kill(pid, 0) cannot tell.
// - Two endpoints can reach each other when their host scopes are equal: the same boot (boot_id),
//   the same IPC and PID namespaces and the same /dev/shm file system. Legacy CUDA IPC handles do
//   not open across PID namespaces, and a container with its own /dev/shm cannot see our segment:
//   such peers go over the NICs.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "fabric/error.h"
#include "util/log.h"

namespace fabric {
namespace shm {

inline constexpr std::string_view kPrefix = "fabric-ipc-";  // /dev/shm/fabric-ipc-<16 hex digits>
inline constexpr size_t kNonceDigits = 16;

inline uint64_t random_nonce() {
  static std::mutex mu;
  static std::random_device rd;  // getrandom(2)
  std::lock_guard lock(mu);
  uint64_t n = 0;
  while (n == 0) n = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return n;
}

inline std::string endpoint_name(uint64_t nonce) {
  return fmt::format("/{}{:016x}", kPrefix, nonce);
}

// The nonce of "/fabric-ipc-<16 hex digits>" (the leading slash optional), or nothing when the
// name has another form (older fabric-lib versions named segments by PID; those are left alone).
inline std::optional<uint64_t> nonce_of(std::string_view name) {
  if (!name.empty() && name.front() == '/') name.remove_prefix(1);
  if (name.size() != kPrefix.size() + kNonceDigits || name.substr(0, kPrefix.size()) != kPrefix)
    return std::nullopt;
  uint64_t n = 0;
  for (char c : name.substr(kPrefix.size())) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return std::nullopt;
    n = n << 4 | static_cast<uint64_t>(d);
  }
  if (n == 0) return std::nullopt;
  return n;
}

namespace detail {
inline std::string inode_of(const char* path) {
  struct stat st {};
  return stat(path, &st) == 0 ? std::to_string(st.st_ino) : "0";
}
}  // namespace detail

// "<boot id>.ipc<inode>.pid<inode>.shm<device>": equal exactly for processes of one boot that share
// their IPC and PID namespaces and /dev/shm. It never contains '/' (addresses are "<scope>/<name>").
inline std::string host_scope() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  if (id.empty())
    throw Error(ErrorCode::kProvider, "cuda_ipc: cannot read /proc/sys/kernel/random/boot_id");
  struct stat st {};
  uint64_t shm_dev = stat("/dev/shm", &st) == 0 ? static_cast<uint64_t>(st.st_dev) : 0;
  return fmt::format("{}.ipc{}.pid{}.shm{:x}", id, detail::inode_of("/proc/self/ns/ipc"),
                     detail::inode_of("/proc/self/ns/pid"), shm_dev);
}

// An endpoint's address: "<host scope>/fabric-ipc-<nonce>" (the scope never holds a '/'), and
// its two parts back: the scope, and the segment name with its leading '/'. Empty parts when the
// address has no '/'.
inline std::string endpoint_address(const std::string& scope, const std::string& segment_name) {
  return scope + "/" + (segment_name.empty() || segment_name.front() != '/' ? segment_name : segment_name.substr(1));
}
struct AddressParts {
  std::string_view scope, segment_name;
};
inline AddressParts split_address(std::string_view address) {
  size_t slash = address.find('/');
  if (slash == std::string_view::npos) return {};
  return {address.substr(0, slash), address.substr(slash)};
}

// The nonces of this process's own endpoints: a peer whose nonce is here lives in this process
// (CUDA refuses to open an IPC handle in the process that exported it). Never decided by PID,
// which another PID namespace may share. Emptied in the child of a fork: it owns none of them.
class LocalEndpoints {
 public:
  static void add(uint64_t nonce) {
    std::lock_guard lock(state().mu);
    state().nonces.insert(nonce);
  }
  static void remove(uint64_t nonce) {
    std::lock_guard lock(state().mu);
    state().nonces.erase(nonce);
  }
  static bool contains(uint64_t nonce) {
    std::lock_guard lock(state().mu);
    return state().nonces.count(nonce) != 0;
  }

 private:
  struct State {
    std::mutex mu;
    std::unordered_set<uint64_t> nonces;
    State() {
      pthread_atfork([] { state().mu.lock(); }, [] { state().mu.unlock(); },
                     [] {
                       state().nonces.clear();
                       state().mu.unlock();
                     });
    }
  };
  static State& state() {
    static State s;
    return s;
  }
};

}  // namespace shm

class ShmSegment {
 public:
  ShmSegment() = default;
  ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }
  ShmSegment& operator=(ShmSegment&& o) noexcept {
    if (this != &o) {
      reset();
      name_ = std::move(o.name_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      fd_ = std::exchange(o.fd_, -1);
      nonce_ = std::exchange(o.nonce_, 0);
      owner_ = std::exchange(o.owner_, false);
    }
    return *this;
  }
  ~ShmSegment() { reset(); }

  // A fresh endpoint segment of `size` zeroed bytes under a new random name, locked for the life
  // of this object (and unlinked when it ends). Throws fabric::Error (kProvider).
  static ShmSegment create_endpoint(size_t size) {
    for (int attempt = 0;; attempt++) {
      uint64_t nonce = shm::random_nonce();
      std::string name = shm::endpoint_name(nonce);
      int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        if (errno == EEXIST && attempt < 8) continue;
        fail("shm_open (create)", name);
      }
      // A sweeper may have opened the empty file and taken its lock before we did, and unlinked
      // it: wait for the lock, then make sure the name is still ours; if not, take another name.
      if (flock(fd, LOCK_EX) != 0) {
        int e = errno;
        close(fd);
        shm_unlink(name.c_str());
        errno = e;
        fail("flock", name);
      }
      if (!names_file(name, fd)) {
        close(fd);
        if (attempt < 8) continue;
        errno = EAGAIN;
        fail("shm_open (create: the name was taken away repeatedly)", name);
      }
      ShmSegment s;
      s.name_ = std::move(name);
      s.fd_ = fd;
      s.nonce_ = nonce;
      s.owner_ = true;
      if (ftruncate(fd, static_cast<off_t>(size)) != 0) fail("ftruncate", s.name_);  // s unlinks
      s.size_ = size;
      s.data_ = map(fd, size, s.name_);
      return s;
    }
  }

  // Maps a peer's endpoint segment. Throws kUnsupported when it cannot be reached from here (the
  // caller may then use other routes): a name of another form, no such segment on this /dev/shm
  // (a container with its own), or no live owner (stale). kProvider for other system errors.
  static ShmSegment open_endpoint(const std::string& name) {
    std::optional<uint64_t> nonce = shm::nonce_of(name);
    if (!nonce || name.front() != '/')
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("cuda_ipc: '{}' is not a fabric-lib endpoint name (/{}<16 hex digits>)",
                              name, shm::kPrefix));
    int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      if (errno == ENOENT || errno == EACCES)
        throw Error(ErrorCode::kUnsupported,
                    fmt::format("cuda_ipc: the peer's segment /dev/shm{} is not visible here ({}): "
                                "the peer runs with another /dev/shm (a container?) or has ended",
                                name, std::strerror(errno)));
      fail("shm_open", name);
    }
    ShmSegment s;
    s.name_ = name;
    s.fd_ = fd;
    s.nonce_ = *nonce;
    if (!s.owner_alive())
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("cuda_ipc: the peer's segment /dev/shm{} has no live owner (its "
                              "process has ended)",
                              name));
    struct stat st {};
    if (fstat(fd, &st) != 0) fail("fstat", name);
    s.size_ = static_cast<size_t>(st.st_size);
    s.data_ = map(fd, s.size_, name);
    return s;
  }

  // Whether the segment's owner still lives (holds its lock). Always true for our own segment.
  bool owner_alive() const {
    if (owner_) return true;
    if (fd_ < 0) return false;
    if (flock(fd_, LOCK_SH | LOCK_NB) == 0) {  // nobody holds it exclusively: the owner is gone
      flock(fd_, LOCK_UN);
      return false;
    }
    return errno == EWOULDBLOCK;
  }

  void* data() const { return data_; }
  size_t size() const { return size_; }
  uint64_t nonce() const { return nonce_; }
  const std::string& name() const { return name_; }

  // Removes endpoint segments that no process owns any more (left by a SIGKILL): those whose lock
  // can be taken. Segments of live owners, in whatever PID namespace, stay. Returns the count.
  static size_t remove_stale() {
    DIR* dir = opendir("/dev/shm");
    if (!dir) return 0;
    size_t removed = 0;
    while (dirent* e = readdir(dir)) {
      std::string name = std::string("/") + e->d_name;
      if (!shm::nonce_of(name)) continue;
      int fd = shm_open(name.c_str(), O_RDONLY, 0);
      if (fd < 0) continue;  // gone meanwhile, or another user's
      if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
        // Ours now; the name is unique (64 random bits), so it still names this file.
        log::info("cuda_ipc: removing /dev/shm{}: its owner has ended", name);
        shm_unlink(name.c_str());
        removed++;
      }
      close(fd);
    }
    closedir(dir);
    return removed;
  }

 private:
  [[noreturn]] static void fail(const std::string& what, const std::string& name) {
    throw Error(ErrorCode::kProvider,
                fmt::format("cuda_ipc: {} /dev/shm{}: {}", what, name, std::strerror(errno)));
  }

  static void* map(int fd, size_t size, const std::string& name) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) fail("mmap", name);
    return p;
  }

  // Whether `name` still refers to the file open as `fd`.
  static bool names_file(const std::string& name, int fd) {
    int again = shm_open(name.c_str(), O_RDONLY, 0);
    if (again < 0) return false;
    struct stat a {}, b {};
    bool same = fstat(fd, &a) == 0 && fstat(again, &b) == 0 && a.st_ino == b.st_ino &&
                a.st_dev == b.st_dev;
    close(again);
    return same;
  }

  void reset() {
    if (data_) munmap(data_, size_);
    if (owner_) shm_unlink(name_.c_str());  // before the lock goes: no sweeper sees it unowned
    if (fd_ >= 0) close(fd_);
    data_ = nullptr;
    size_ = 0;
    fd_ = -1;
    owner_ = false;
  }

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;  // kept open: the owner's lock lives on it; a peer tests liveness through it
  uint64_t nonce_ = 0;
  bool owner_ = false;
};

}  // namespace fabric
