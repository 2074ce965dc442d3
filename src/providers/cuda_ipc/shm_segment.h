// A POSIX shared-memory segment mapped into this process: created by its owner, opened by peers.
#pragma once

#include <cstddef>
#include <string>

namespace fabric {

class ShmSegment {
 public:
  ShmSegment() = default;
  // Creates /dev/shm/<name> of `size` bytes, zero-filled; unlinked again when this is destroyed.
  static ShmSegment create(const std::string& name, size_t size);
  // Maps an existing segment (its size is read from the file).
  static ShmSegment open(const std::string& name);
  ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ~ShmSegment();

  void* data() const { return data_; }
  size_t size() const { return size_; }

  // Removes segments that fabric-lib processes which no longer exist left behind (SIGKILL).
  static void remove_stale(const std::string& prefix);

 private:
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
};

}  // namespace fabric
