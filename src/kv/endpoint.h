// What KvReceiver and KvSender share: the checks of a rank's layout and memory, and its K, V and
// extras regions, registered once for the endpoint's life.
#pragma once

#include <mutex>
#include <optional>
#include <vector>

#include "fabric/kv/transfer.h"
#include "kv/wire.h"

namespace fabric::kv {

// Throws kInvalidArgument naming what is wrong.
void check_layout(const KvLayout& l, const KvTensors& t, const KvRank& rank);

struct Registered {
  TransferEngine& engine;
  std::vector<MrHandle> k, v;
  std::vector<MrDesc> k_desc, v_desc;
  std::optional<MrHandle> extras;
  std::optional<MrDesc> extras_desc;
  // Under `imms` where it is held (a receiver's regions: their WRITEs' immediates are its range's).
  Registered(TransferEngine& e, const KvLayout& l, const KvTensors& t, const ImmReservation& imms);
  ~Registered();
  Registered(const Registered&) = delete;
  Registered& operator=(const Registered&) = delete;

 private:
  void release();
};

struct Endpoint {
  TransferEngine& engine;
  KvLayout layout;
  KvTensors tensors;
  KvRank rank;
  ImmReservation imms;  // a receiver's; none on a sender
  Registered regions;
  mutable std::mutex mu;
  Endpoint(TransferEngine& e, KvLayout l, KvTensors t, KvRank r, ImmReservation i = {})
      : engine(e), layout(l), tensors(std::move(t)), rank(r), imms(std::move(i)), regions(e, layout, tensors, imms) {}
  wire::Descriptor descriptor() const;
};

}  // namespace fabric::kv
