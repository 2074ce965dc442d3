// ImmRange, the engine's registry of reserved immediate ranges, and ImmReservation.
#include "engine/imm_registry.h"

#include <fmt/format.h>

#include "engine/engine_impl.h"
#include "fabric/error.h"

namespace fabric {

namespace {
std::string describe(const ImmRange& r) { return fmt::format("[{:#x}, {:#x}]", r.base, r.end() - 1); }
}  // namespace

std::pair<uint64_t, ImmRange> ImmRegistry::reserve(const ImmReserveRequest& req) {
  ImmRange want{req.base.value_or(0), req.bits};
  want.validate("reserve_imms");
  std::lock_guard lock(mu_);
  auto overlapping = [&](const ImmRange& r) -> const Held* {
    for (const Held& h : held_)
      if (h.range.overlaps(r)) return &h;
    return nullptr;
  };
  if (req.base) {
    if (const Held* h = overlapping(want))
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("reserve_imms: immediates {} for '{}' overlap {}, held by '{}'", describe(want), req.holder,
                              describe(h->range), h->holder));
  } else {
    // The highest free block: raw users of the engine tend to pick small values. Each held range
    // in the way is jumped below at once, so this takes at most one step per held range.
    bool found = false;
    for (uint64_t b = (uint64_t{1} << 32) - want.size();;) {
      ImmRange r{static_cast<uint32_t>(b), want.bits};
      const Held* h = overlapping(r);
      if (!h) {
        want = r;
        found = true;
        break;
      }
      if (h->range.base < want.size()) break;  // no aligned block below it
      b = (h->range.base - want.size()) / want.size() * want.size();
    }
    if (!found) {
      std::string holders;
      for (const Held& h : held_) holders += fmt::format("{}'{}' {}", holders.empty() ? "" : ", ", h.holder, describe(h.range));
      throw Error(ErrorCode::kResourceExhausted,
                  fmt::format("reserve_imms: no free block of 2^{} immediates for '{}'; held: {}", want.bits,
                              req.holder, holders));
    }
  }
  const uint64_t id = next_id_++;
  held_.push_back({id, want, req.holder});
  count_.store(held_.size(), std::memory_order_release);
  return {id, want};
}

void ImmRegistry::release(uint64_t id) {
  std::lock_guard lock(mu_);
  std::erase_if(held_, [&](const Held& h) { return h.id == id; });
  count_.store(held_.size(), std::memory_order_release);
}

std::optional<std::string> ImmRegistry::holder_of(uint32_t imm) const {
  if (count_.load(std::memory_order_acquire) == 0) return std::nullopt;
  std::lock_guard lock(mu_);
  for (const Held& h : held_)
    if (h.range.contains(imm)) return fmt::format("'{}' {}", h.holder, describe(h.range));
  return std::nullopt;
}

EngineImpl& ImmRegistry::engine() const {
  std::lock_guard lock(mu_);
  if (!engine_) throw Error(ErrorCode::kShutdown, "ImmReservation: its engine has been closed");
  return *engine_;
}

void ImmRegistry::close() {
  std::lock_guard lock(mu_);
  engine_ = nullptr;
}

// ---- ImmReservation ----

ImmReservation::~ImmReservation() { release(); }
ImmReservation::ImmReservation(ImmReservation&& o) noexcept
    : registry_(std::move(o.registry_)), id_(o.id_), range_(o.range_), holder_(std::move(o.holder_)) {
  o.registry_.reset();
}
ImmReservation& ImmReservation::operator=(ImmReservation&& o) noexcept {
  if (this != &o) {
    release();
    registry_ = std::move(o.registry_);
    o.registry_.reset();
    id_ = o.id_;
    range_ = o.range_;
    holder_ = std::move(o.holder_);
  }
  return *this;
}

void ImmReservation::release() {
  if (registry_) registry_->release(id_);
  registry_.reset();
}

uint32_t ImmReservation::checked(uint64_t local, const char* what) const {
  if (!registry_)
    throw Error(ErrorCode::kNotFound, fmt::format("ImmReservation::{}: the reservation is not held", what));
  if (!range_.fits(local))
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("ImmReservation::{}: local immediate {:#x} of '{}' is outside its {} bits", what, local,
                            holder_, range_.bits));
  return static_cast<uint32_t>(range_.base + local);
}

ImmExpectation ImmReservation::expect(uint64_t local, uint64_t count, OnDone on_reached, ExpectOptions opts) {
  const uint32_t imm = checked(local, "expect");
  return registry_->engine().expect_reserved(imm, count, std::move(on_reached), opts);
}
uint64_t ImmReservation::count(uint64_t local) {
  const uint32_t imm = checked(local, "count");
  return registry_->engine().count_reserved(imm);
}
uint64_t ImmReservation::discard(uint64_t local) {
  const uint32_t imm = checked(local, "discard");
  return registry_->engine().discard_reserved(imm);
}
bool ImmReservation::cancel(const ImmExpectation& e) {
  if (!registry_) return false;
  return registry_->engine().cancel_expectation(e);
}

}  // namespace fabric
