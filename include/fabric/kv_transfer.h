// KV-cache transfer endpoints on a TransferEngine: a decode rank (KvReceiver) admits a request
// into pages it allocated and counts each layer's immediates; a prefill rank (KvSender) writes
// each layer's pages the moment the caller says the layer is computed, one paged write per
// (decode rank, K/V) as kv.h plans it. Descriptors are exchanged once per decode rank
// (KvReceiver::descriptor -> KvSender::add_decoder); a request costs one admit message (ids and
// page indices only), which the caller carries (engine messages, a store, ...).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "fabric/kv.h"
#include "fabric/on_done.h"
#include "fabric/transfer_engine.h"

namespace fabric::kv {

// One rank's K and V tensors, per layer (V = K + page_bytes() for interleaved K/V, with
// KvLayout::page_stride = 2 x page_bytes()). Registered once by the endpoint that takes them.
struct KvTensors {
  std::vector<void*> k, v;
  Device device{};
};

// Who a rank is: its TP group (an id the caller chooses, the same on every rank of the group), its
// place in it, and the model's KV heads (split evenly over the group).
struct KvRank {
  uint64_t group = 0;
  TensorParallel tp{};
  uint32_t total_heads = 0;
};

// Immediates: the request's tag (its id, 24 bits) and the layer (8 bits), so a decode rank counts
// each layer of each request on its own. At most 255 layers.
inline uint32_t layer_imm(uint64_t request, uint32_t layer) {
  return static_cast<uint32_t>((request & 0xFFFFFF) << 8) | (layer & 0xFF);
}

struct KvAdmit {
  // Unique among this rank's requests in flight (24 bits are used). A request that failed frees its
  // id at once, but WRITEs its prefill ranks posted may still arrive: retry under a new id, never
  // the failed one, or they would count toward the retry.
  uint64_t request = 0;
  std::vector<uint32_t> pages;  // the decode pages, in prompt order (the same on every decode rank)
  uint32_t prefill_size = 1;    // TP size of the prefill group that writes it
  std::chrono::milliseconds timeout{30000};
  std::function<void(uint32_t layer)> on_layer;  // each layer landed (callback thread)
  OnDone on_done;  // every layer landed, or the first error (a timeout names the missing layers)
};

class KvReceiver {
 public:
  KvReceiver(TransferEngine& engine, KvLayout layout, KvTensors tensors, KvRank rank);
  ~KvReceiver();
  KvReceiver(const KvReceiver&) = delete;
  KvReceiver& operator=(const KvReceiver&) = delete;

  // This rank's layout and region descriptors, for KvSender::add_decoder (once per prefill rank).
  std::vector<uint8_t> descriptor() const;
  // Arms one expectation per layer and returns the admit message for every prefill rank of the
  // writing group (send it from any one decode rank: they are identical).
  std::vector<uint8_t> admit(KvAdmit request);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

class KvSender {
 public:
  KvSender(TransferEngine& engine, KvLayout layout, KvTensors tensors, KvRank rank);
  ~KvSender();
  KvSender(const KvSender&) = delete;
  KvSender& operator=(const KvSender&) = delete;

  // Interns one decode rank's regions (KvReceiver::descriptor). Throws kInvalidArgument for a
  // layout that does not match this one's (layers, page tokens, head size, dtype, order).
  void add_decoder(std::span<const uint8_t> descriptor);
  // A request admitted by a decode group (its admit message) and this rank's pages of the prompt.
  // on_sent fires once every write of every layer has completed locally (the pages may be reused)
  // or with the first error. Throws kNotFound when the decode group was not added, or a rank of it.
  void begin(std::span<const uint8_t> admit, std::vector<uint32_t> src_pages, OnDone on_sent);
  // Layer `layer` of `request` is computed: its pages go out now.
  void layer_done(uint64_t request, uint32_t layer);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace fabric::kv
