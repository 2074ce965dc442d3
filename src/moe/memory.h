// Memory an AllToAll allocates once: plain blocks (host, pinned device-mapped host, device) and
// the node region its node-mates map (POSIX shared memory, or a CUDA allocation shared by IPC).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fabric::moe::detail {

// Zeroed memory: `host` is what host code uses (null for device memory), `device` what kernels
// use (null for plain host memory; the mapped address for pinned memory).
class Block {
 public:
  Block() = default;
  Block(std::byte* host, std::byte* device, size_t len, std::function<void()> release)
      : host_(host), device_(device), len_(len), release_(std::move(release)) {}
  Block(Block&& o) noexcept { *this = std::move(o); }
  Block& operator=(Block&& o) noexcept {
    if (this != &o) {
      reset();
      host_ = o.host_, device_ = o.device_, len_ = o.len_, release_ = std::move(o.release_);
      o.host_ = o.device_ = nullptr, o.len_ = 0, o.release_ = nullptr;
    }
    return *this;
  }
  ~Block() { reset(); }
  std::byte* host() const { return host_; }
  std::byte* device() const { return device_; }
  size_t len() const { return len_; }

 private:
  void reset() {
    if (release_) release_();
    release_ = nullptr;
  }
  std::byte* host_ = nullptr;
  std::byte* device_ = nullptr;
  size_t len_ = 0;
  std::function<void()> release_;
};

Block host_block(size_t len);
// CUDA builds only (kUnsupported otherwise), on the current device.
Block pinned_block(size_t len);  // cudaHostAlloc(mapped), zeroed
Block device_block(size_t len);  // cudaMalloc, zeroed

// This rank's node region and the handle its node-mates open it by.
class NodeRegion {
 public:
  virtual ~NodeRegion() = default;
  virtual std::byte* own() const = 0;  // host pointer (host regions) or device pointer
  virtual std::vector<std::byte> handle() const = 0;
  // Maps a node-mate's region from its handle; valid while this object lives.
  virtual std::byte* open(const std::vector<std::byte>& handle) = 0;
  // Called once every node-mate has opened this region: drop names others could still open.
  virtual void seal() {}
};

// POSIX shared memory "/fabric-moe-<job>-<rank>-<random>", unlinked by seal().
std::unique_ptr<NodeRegion> host_node_region(size_t len, const std::string& job, unsigned rank);
// cudaMalloc on the current device, shared by cudaIpcGetMemHandle (CUDA builds only).
std::unique_ptr<NodeRegion> cuda_node_region(size_t len);

}  // namespace fabric::moe::detail
