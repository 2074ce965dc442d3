// POSIX shm: shm_open + ftruncate + mmap, with errno turned into fabric::Error.
#include "providers/cuda_ipc/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <utility>
#include <cstring>

#include "fabric/error.h"
#include "util/log.h"

namespace fabric {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& name) {
  throw Error(ErrorCode::kProvider, fmt::format("{} /dev/shm{}: {}", what, name, std::strerror(errno)));
}

void* map(int fd, size_t size, const std::string& name) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) fail("mmap", name);
  return p;
}

}  // namespace

ShmSegment ShmSegment::create(const std::string& name, size_t size) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) fail("shm_open (create)", name);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    fail("ftruncate", name);
  }
  ShmSegment s;
  s.name_ = name;
  s.size_ = size;
  s.owner_ = true;
  try {
    s.data_ = map(fd, size, name);
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
  return s;
}

ShmSegment ShmSegment::open(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) fail("shm_open: cannot open the peer's segment (is the peer alive and on this host?)", name);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    close(fd);
    fail("fstat", name);
  }
  ShmSegment s;
  s.name_ = name;
  s.size_ = static_cast<size_t>(st.st_size);
  s.data_ = map(fd, s.size_, name);
  return s;
}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    this->~ShmSegment();
    name_ = std::move(o.name_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    owner_ = std::exchange(o.owner_, false);
  }
  return *this;
}

ShmSegment::~ShmSegment() {
  if (data_) munmap(data_, size_);
  if (owner_) shm_unlink(name_.c_str());
  data_ = nullptr;
  owner_ = false;
}

// Names are "<prefix><pid>-<n>": a segment whose pid is gone belongs to nobody.
void ShmSegment::remove_stale(const std::string& prefix) {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  while (dirent* e = readdir(dir)) {
    std::string n = e->d_name;
    if (n.rfind(prefix, 0) != 0) continue;
    long pid = std::strtol(n.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      log::info("removing /dev/shm/{} left by process {}, which is gone", n, pid);
      shm_unlink(("/" + n).c_str());
    }
  }
  closedir(dir);
}

}  // namespace fabric
