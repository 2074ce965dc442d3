// Immediate namespaces: a range of the 32-bit immediate space that one user of an engine (a KV
// receiver, a weight update, an all-to-all) holds, so that several users share one engine without
// counting each other's WRITEs. A range is an aligned block of 2^bits values; its users write and
// count local values in [0, 2^bits) and the engine places them at base + local. See docs/api.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace fabric {

struct ImmRange {
  uint32_t base = 0;   // the first value; a multiple of 2^bits
  uint8_t bits = 32;   // 2^bits values (32: the whole space, what an unreserved region uses)

  uint64_t size() const { return uint64_t{1} << bits; }
  uint64_t end() const { return uint64_t{base} + size(); }  // one past the last value
  bool contains(uint32_t imm) const { return imm >= base && imm < end(); }
  bool overlaps(const ImmRange& o) const { return base < o.end() && o.base < end(); }
  bool fits(uint64_t local) const { return local < size(); }
  // The value on the wire of local value `local`; throws kInvalidArgument when it does not fit.
  uint32_t imm(uint64_t local) const;
  // Throws kInvalidArgument for bits outside 1..32 or a base that is not a multiple of 2^bits.
  void validate(const char* what) const;
  bool operator==(const ImmRange&) const = default;
};

// What TransferEngine::reserve_imms is asked for: 2^bits values, anywhere free (the highest free
// block, so the small values stay to callers of the raw API) or at `base`.
struct ImmReserveRequest {
  std::string holder;  // who holds it, for the errors of anyone who overlaps it ("kv receiver group 3")
  uint8_t bits = 28;
  std::optional<uint32_t> base{};
};

}  // namespace fabric
