// The write requests TransferEngine::submit takes: one struct per kind, built with designated
// initializers, e.g.
//   engine.submit(SingleWrite{.len = n, .src = {h, 0}, .dst = {remote, 0}, .imm = 7}, on_done);
// Every request has the same two options: `imm` (a 32-bit immediate carried by each of its
// WRITEs, counted by the receiver's expect_imm_count; for a region registered under an
// ImmReservation, a local value of that range, below 2^MrDesc::imms().bits) and `nic` (pin every
// WRITE to that NIC).
// Spans are read during the call only: the engine copies what it needs. docs/api.md says what
// each field means and how many immediates each request delivers.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "fabric/types.h"

namespace fabric {

// len bytes from src to dst. By default split over the NICs (see single_write_imm_count);
// num_shards asks for exactly that many WRITEs, spread round-robin over the NICs (or all on
// `nic` when pinned), each carrying `imm`.
struct SingleWrite {
  uint64_t len = 0;
  LocalSlice src{};
  RemoteSlice dst{};
  std::optional<uint32_t> imm{};
  std::optional<uint8_t> nic{};
  std::optional<uint32_t> num_shards{};
};

// One WRITE of page_len bytes per page: source page i goes to destination page i; the pages go
// round-robin over the NICs.
struct PagedWrites {
  uint64_t page_len = 0;
  MrHandle src{};
  Pages src_pages{};
  RemoteMr dst{};
  Pages dst_pages{};
  std::optional<uint32_t> imm{};
  std::optional<uint8_t> nic{};
};

// One WRITE per slice, each to its own destination region (round-robin over the NICs).
struct Scatter {
  MrHandle src{};
  std::span<const ScatterSlice> slices{};
  std::optional<uint32_t> imm{};
  std::optional<uint8_t> nic{};
};

// One WRITE per member of a peer group: slice i to member i (as many slices as members). No
// route or key is looked up per destination: the group's WRITE templates are patched and posted.
struct GroupScatter {
  PeerGroupHandle group{};
  MrHandle src{};
  std::span<const GroupSlice> slices{};
  std::optional<uint32_t> imm{};
  std::optional<uint8_t> nic{};
};

// One zero-byte WRITE carrying `imm` to each destination region's owner, from the NICs of the
// worker serving `device` (a multi-GPU engine: the GPU whose rail it goes out on; host: the first).
struct Barrier {
  std::span<const RemoteMr> dsts{};
  uint32_t imm = 0;
  std::optional<uint8_t> nic{};
  Device device{};
};

// One zero-byte WRITE carrying `imm` to every member of a peer group (from `device`'s worker).
struct GroupBarrier {
  PeerGroupHandle group{};
  uint32_t imm = 0;
  std::optional<uint8_t> nic{};
  Device device{};
};

}  // namespace fabric
