// Plain value types of the public API: addresses, memory descriptors, page lists, scatter targets.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fabric/imm_range.h"

namespace fabric {

inline constexpr size_t kMaxNics = 4;           // NICs per worker (per GPU), as on AWS p5
inline constexpr size_t kMaxWorkers = 8;        // workers (GPUs) per engine: one host
inline constexpr size_t kMaxNicAddrLen = 256;  // longest provider endpoint name we accept
inline constexpr size_t kMaxProviderNameLen = 64;

// Where memory lives: host memory, or the memory of CUDA device `index`. A multi-GPU engine
// registers a region with the NICs of the worker serving its device; host memory goes to the first
// worker unless host_for_worker names another (a staging buffer on GPU w's rail).
struct Device {
  enum class Kind : uint8_t { kHost, kCuda };
  Kind kind = Kind::kHost;
  int index = -1;  // kCuda: the CUDA device; kHost: the worker serving it (-1: the first)
  static Device host() { return {}; }
  static Device host_for_worker(int worker) { return {Kind::kHost, worker}; }
  static Device cuda(int i) { return {Kind::kCuda, i}; }
  bool operator==(const Device&) const = default;
};

// Opaque, serializable address of one engine: the provider name and, per GPU the engine serves
// (its workers: one for a one-GPU or host-only engine), one endpoint name per NIC and, where that
// worker serves same-host GPU peers through CUDA IPC, its local endpoint. Every worker has the same
// number of NICs (the rail width). It also says the longest message the engine accepts (its
// EngineConfig::max_message_size; its receive buffers are at least that long), so a sender refuses a
// longer one at submit instead of the receiver dropping it. Exchanged out of band (a TCP store, a
// file, a command line) as bytes or hex.
class NetAddr {
 public:
  NetAddr() = default;
  // One worker.
  NetAddr(std::string provider, std::vector<std::string> nic_addrs, std::string local = {});
  // Several workers: nic_addrs[w] and locals[w] are worker w's (locals may be empty: none has one).
  NetAddr(std::string provider, std::vector<std::vector<std::string>> nic_addrs,
          std::vector<std::string> locals, uint32_t max_message = 0);

  const std::string& provider() const { return provider_; }
  // NICs per worker (the rail width).
  size_t nic_count() const { return nics_.empty() ? 0 : nics_[0].size(); }
  size_t worker_count() const { return nics_.size(); }
  // Worker 0's NIC i and local endpoint; the cuda_ipc endpoint is "<host id>/...", empty when the
  // worker does not offer one.
  const std::string& nic(size_t i) const { return nics_.at(0).at(i); }
  const std::string& local() const;
  const std::string& nic(size_t worker, size_t i) const { return nics_.at(worker).at(i); }
  const std::string& local(size_t worker) const { return locals_.at(worker); }
  // The address of one worker alone (what a worker of another engine connects to).
  NetAddr worker(size_t w) const;
  // The longest message (bytes) the engine accepts; 0: not said (an address made by hand).
  uint32_t max_message() const { return max_message_; }

  std::vector<uint8_t> to_bytes() const;
  std::string to_hex() const;
  // Strict parsers: throw fabric::Error(kMalformed) naming what was wrong.
  static NetAddr from_bytes(std::span<const uint8_t> bytes);
  static NetAddr from_hex(std::string_view hex);

  bool operator==(const NetAddr&) const = default;

 private:
  std::string provider_;
  std::vector<std::vector<std::string>> nics_;  // per worker
  std::vector<std::string> locals_;             // per worker
  uint32_t max_message_ = 0;
};

// Local handle of a registered memory region (source of writes). Cheap to copy.
// A stale handle (after dereg_mr) is detected: its generation no longer matches. A handle names
// its engine (`engine`, unique in the process, never 0): another engine of the process refuses it
// instead of reading its own region in the same slot.
struct MrHandle {
  uint32_t slot = UINT32_MAX;
  uint32_t generation = 0;
  uint32_t engine = 0;
  bool operator==(const MrHandle&) const = default;
};

// Per-NIC remote access key of a region: the key and the base that offsets are added to
// (the region's virtual address where the provider uses FI_MR_VIRT_ADDR, else 0).
struct RemoteKey {
  uint64_t rkey = 0;
  uint64_t base = 0;
  bool operator==(const RemoteKey&) const = default;
};

// Serializable remote descriptor of a region: its owner, the owner's worker whose NICs it is
// registered with (the GPU it lives on; host memory: worker 0), its length, one key per NIC of that
// worker and, for GPU memory of an engine that offers CUDA IPC, the key of its local (same-host)
// endpoint. Writers reach it through that worker's NICs, from their NIC k to its NIC k.
// `keys` is empty when the owner's NICs cannot reach the region (a NIC provider without GPU
// memory support): then only same-host peers can write it, through CUDA IPC.
// Destinations are given as offsets into the region; the length lets the initiator reject an
// out-of-bounds write at submit time (the providers do not report it, they drop the connection).
class MrDesc {
 public:
  MrDesc() = default;
  MrDesc(NetAddr owner, uint64_t addr, uint64_t len, std::vector<RemoteKey> keys,
         std::optional<RemoteKey> local_key = std::nullopt, uint32_t worker = 0, ImmRange imms = {});

  const NetAddr& owner() const { return owner_; }
  uint32_t worker() const { return worker_; }
  // The owner's address as seen by a writer of this region: that worker's alone.
  NetAddr endpoint() const { return owner_.worker(worker_); }
  uint64_t addr() const { return addr_; }  // the owner's virtual address, for logs only
  uint64_t len() const { return len_; }
  const std::vector<RemoteKey>& keys() const { return keys_; }
  const std::optional<RemoteKey>& local_key() const { return local_key_; }
  // Whose immediates WRITEs into it carry (ImmReservation): a writer's immediate v goes out as
  // imms().base + v and must be below 2^imms().bits. The whole space for an unreserved region.
  const ImmRange& imms() const { return imms_; }

  std::vector<uint8_t> to_bytes() const;
  std::string to_hex() const;
  static MrDesc from_bytes(std::span<const uint8_t> bytes);
  static MrDesc from_hex(std::string_view hex);

  bool operator==(const MrDesc&) const = default;

 private:
  NetAddr owner_;
  uint64_t addr_ = 0;
  uint64_t len_ = 0;
  std::vector<RemoteKey> keys_;
  std::optional<RemoteKey> local_key_{};
  uint32_t worker_ = 0;
  ImmRange imms_{};
};

// A remote region interned by TransferEngine::add_remote: its owner's addresses are resolved and
// its keys copied once, so requests name it by this handle instead of carrying the descriptor.
// Cheap to copy; stale after remove_remote (detected: its generation no longer matches). Bound to
// the engine that interned it, as MrHandle is.
struct RemoteMr {
  uint32_t slot = UINT32_MAX;
  uint32_t generation = 0;
  uint32_t engine = 0;
  bool operator==(const RemoteMr&) const = default;
};

// Where a write reads: a registered local region and an offset into it.
struct LocalSlice {
  MrHandle mr{};
  uint64_t offset = 0;
};

// Where a write lands: an interned remote region and an offset into it.
struct RemoteSlice {
  RemoteMr mr{};
  uint64_t offset = 0;
};

// Page i of a paged transfer lives at offset + stride * indices[i] in its region. The indices are
// copied at submit: the caller may reuse its array when the call returns.
struct Pages {
  std::span<const uint32_t> indices{};
  uint64_t stride = 0;
  uint64_t offset = 0;
};

// One slice of a scatter: len bytes from src_offset in the source region to dst.
struct ScatterSlice {
  uint64_t len = 0;
  uint64_t src_offset = 0;
  RemoteSlice dst{};
};

// One slice of a scatter to a peer group: slice i goes to member i of the group.
struct GroupSlice {
  uint64_t len = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
};

// A set of destination regions (typically one per peer) whose routes and WRITE templates are
// built once, by add_peer_group; scatters and barriers to it patch and post them. Bound to the
// engine that made it, as MrHandle is.
struct PeerGroupHandle {
  uint32_t id = UINT32_MAX;
  uint32_t size = 0;
  uint32_t engine = 0;
};

}  // namespace fabric
