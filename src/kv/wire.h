// The KV endpoints' two wire formats, both little-endian and versioned:
//
// Descriptor: "FBKV" u8 version u64 group u32 tp_size u32 tp_rank u32 total_heads
//             u32 layers u32 pages u32 page_tokens u32 kv_heads u32 head_dim u32 dtype_bytes
//             u8 order u64 page_stride u32 extra_slots u64 extra_bytes
//             { u32 len, MrDesc bytes }*(2 * layers + (extra_slots ? 1 : 0))   (K, V per layer; extras)
// Admit:      "FBKA" u8 version u64 group u64 request u32 prefill_size u8 has_extra u32 extra_slot
//             u32 n { u32 page }*n
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "fabric/kv/transfer.h"
#include "fabric/types.h"

namespace fabric::kv::wire {

struct Descriptor {
  KvRank rank;
  KvLayout layout;
  uint32_t extra_slots = 0;
  uint64_t extra_bytes = 0;
  std::vector<MrDesc> k, v;
  std::optional<MrDesc> extras;
};
std::vector<uint8_t> encode(const Descriptor& d);
Descriptor parse_descriptor(std::span<const uint8_t> bytes);  // throws kMalformed

struct Admit {
  uint64_t group = 0, request = 0;
  uint32_t prefill_size = 0;
  std::optional<uint32_t> extra_slot;
  std::vector<uint32_t> pages;
};
std::vector<uint8_t> encode(const Admit& a);
Admit parse_admit(std::span<const uint8_t> bytes);  // throws kMalformed

}  // namespace fabric::kv::wire
