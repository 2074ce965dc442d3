// Host memory of an AllToAll (memory.h): zeroed aligned blocks, and the node region as POSIX
// shared memory that the node-mates map.
#include "memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "fabric/error.h"

namespace fabric::moe::detail {

Block host_block(size_t len) {
  const size_t rounded = (len + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, rounded == 0 ? 4096 : rounded);
  if (!p) throw Error(ErrorCode::kResourceExhausted, fmt::format("MoE: cannot allocate {} bytes", len));
  std::memset(p, 0, rounded == 0 ? 4096 : rounded);
  return Block(static_cast<std::byte*>(p), nullptr, len, [p] { std::free(p); });
}

namespace {

// A mapping of a shared-memory object; owners also hold its name until seal().
struct Mapping {
  std::byte* base = nullptr;
  size_t len = 0;
};

Mapping map_fd(int fd, size_t len, const std::string& name) {
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    throw Error(ErrorCode::kResourceExhausted, fmt::format("MoE: mmap of {} ({} bytes): {}", name, len, std::strerror(errno)));
  return {static_cast<std::byte*>(p), len};
}

class HostNodeRegion final : public NodeRegion {
 public:
  HostNodeRegion(size_t len, const std::string& job, unsigned rank) : len_(len) {
    std::random_device rd;
    name_ = fmt::format("/fabric-moe-{}-{}-{:08x}{:08x}", job, rank, rd(), rd());
    const int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
      throw Error(ErrorCode::kResourceExhausted, fmt::format("MoE: shm_open({}): {}", name_, std::strerror(errno)));
    if (::ftruncate(fd, static_cast<off_t>(len)) != 0) {
      const int err = errno;
      ::close(fd);
      ::shm_unlink(name_.c_str());
      throw Error(ErrorCode::kResourceExhausted,
                  fmt::format("MoE: cannot size {} to {} bytes (is /dev/shm big enough?): {}", name_, len, std::strerror(err)));
    }
    try {
      own_ = map_fd(fd, len, name_);
    } catch (...) {
      ::close(fd);
      ::shm_unlink(name_.c_str());
      throw;
    }
    ::close(fd);
    named_ = true;
  }
  ~HostNodeRegion() override {
    seal();
    for (const Mapping& m : opened_) ::munmap(m.base, m.len);
    ::munmap(own_.base, own_.len);
  }
  std::byte* own() const override { return own_.base; }
  std::vector<std::byte> handle() const override {
    std::vector<std::byte> h(name_.size());
    std::memcpy(h.data(), name_.data(), name_.size());
    return h;
  }
  std::byte* open(const std::vector<std::byte>& handle) override {
    const std::string name(reinterpret_cast<const char*>(handle.data()), handle.size());
    if (name == name_) return own_.base;
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0)
      throw Error(ErrorCode::kNotFound,
                  fmt::format("MoE: cannot open node-mate region {}: {} (is the node size right: same host, same /dev/shm?)",
                              name, std::strerror(errno)));
    Mapping m;
    try {
      m = map_fd(fd, len_, name);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    opened_.push_back(m);
    return m.base;
  }
  void seal() override {
    if (named_) ::shm_unlink(name_.c_str());
    named_ = false;
  }

 private:
  size_t len_;
  std::string name_;
  bool named_ = false;
  Mapping own_{};
  std::vector<Mapping> opened_;
};

}  // namespace

std::unique_ptr<NodeRegion> host_node_region(size_t len, const std::string& job, unsigned rank) {
  return std::make_unique<HostNodeRegion>(len, job, rank);
}

}  // namespace fabric::moe::detail
