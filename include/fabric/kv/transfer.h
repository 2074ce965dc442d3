// KV-cache transfer endpoints on a TransferEngine: a decode rank (KvReceiver) admits a request
// into pages it allocated and counts each layer's immediates; a prefill rank (KvSender) writes
// each layer's pages the moment the layer is computed (the caller says so, or the GPU does through
// a trigger word), one paged write per (decode rank, K/V) as layout.h plans it, and the request's
// extras (last-token hidden state, logits) last. Descriptors are exchanged once per decode rank
// (KvReceiver::descriptor -> KvSender::add_decoder); a request costs one admit message (ids and
// page indices only), which the caller carries (engine messages, a store, ...).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fabric/kv/layout.h"
#include "fabric/on_done.h"
#include "fabric/transfer_engine.h"

namespace fabric::kv {

// One rank's K and V tensors, per layer (V = K + page_bytes() for interleaved K/V, with
// KvLayout::page_stride = 2 x page_bytes()), and its extras: `extra_slots` slots of `extra_bytes`
// each (one request's hidden state and logits, in the caller's format), or none. Registered once
// by the endpoint that takes them.
struct KvTensors {
  std::vector<void*> k{}, v{};
  void* extras = nullptr;
  uint32_t extra_slots = 0;
  uint64_t extra_bytes = 0;
  Device device{};
};

// Who a rank is: its TP group (an id the caller chooses, the same on every rank of the group), its
// place in it, and the model's KV heads (split evenly over the group).
struct KvRank {
  uint64_t group = 0;
  TensorParallel tp{};
  uint32_t total_heads = 0;
};

// At most this many layers: the immediate's low byte is the layer, and kExtrasLayer marks the
// extras' write.
inline constexpr uint32_t kMaxLayers = 254;
inline constexpr uint32_t kExtrasLayer = 255;

// Immediates: the request's tag (its id, 20 bits) and the layer (8 bits), so a decode rank counts
// each layer of each request on its own. They are local values of the decode rank's immediate
// range (kKvImmBits wide, reserved by its KvReceiver; its regions' MrDescs carry it), so other
// users of its engine never count them.
inline constexpr uint8_t kKvImmBits = 28;
inline constexpr uint64_t kKvTagMask = (uint64_t{1} << (kKvImmBits - 8)) - 1;
inline uint32_t layer_imm(uint64_t request, uint32_t layer) {
  return static_cast<uint32_t>((request & kKvTagMask) << 8) | (layer & 0xFF);
}

struct KvAdmit {
  // Unique among this rank's requests in flight; 20 bits are used (the tag). A request that failed
  // keeps its tag for KvReceiverOptions::late_writes (its prefill ranks' WRITEs may still land):
  // admitting the tag again before then throws kInvalidArgument; the first admit (of any id) after
  // the window discards its late immediates. Schedulers that number requests in order never meet
  // this.
  uint64_t request = 0;
  std::vector<uint32_t> pages{};  // the decode pages, in prompt order (the same on every decode rank)
  uint32_t prefill_size = 1;    // TP size of the prefill group that writes it
  std::optional<uint32_t> extra_slot{};  // where the extras land (the same on every decode rank)
  std::chrono::milliseconds timeout{30000};
  std::function<void(uint32_t layer)> on_layer{};  // each layer landed (callback thread)
  // Incremented (release) once per layer landed and once for the extras: a decode kernel waits on
  // it (a GpuCounter's host word, or any atomic) for num_layers (+ 1 with extras). Not reset.
  std::atomic<uint64_t>* landed = nullptr;
  OnDone on_done{};  // every layer and the extras landed, or the first error (a timeout names the layer)
};

// What an admit message says, for a prefill scheduler that picks its source pages before begin.
struct KvAdmitInfo {
  uint64_t group = 0, request = 0;
  uint32_t prefill_size = 0;
  std::optional<uint32_t> extra_slot{};
  std::vector<uint32_t> pages{};
};
KvAdmitInfo read_admit(std::span<const uint8_t> admit);  // throws kMalformed

struct KvReceiverOptions {
  // How long a failed request's tag stays retired: the longest a prefill rank may still write it
  // (its engine's transfer timeout, with margin).
  std::chrono::milliseconds late_writes{60000};
  // Where this rank's 2^kKvImmBits immediates go in its engine's space (TransferEngine::
  // reserve_imms; a range that overlaps another user's is refused, naming it); none: the highest
  // free block.
  std::optional<uint32_t> imm_base{};
};

class KvReceiver {
 public:
  KvReceiver(TransferEngine& engine, KvLayout layout, KvTensors tensors, KvRank rank,
             KvReceiverOptions options = {});
  ~KvReceiver();
  KvReceiver(const KvReceiver&) = delete;
  KvReceiver& operator=(const KvReceiver&) = delete;

  // This rank's layout and region descriptors, for KvSender::add_decoder (once per prefill rank).
  std::vector<uint8_t> descriptor() const;
  // Arms one expectation per layer (and one for the extras) and returns the admit message for
  // every prefill rank of the writing group (send it from any one decode rank: they are identical).
  std::vector<uint8_t> admit(KvAdmit request);
  // Ends a request in flight on this side with kCancelled and `reason` (its prefill side refused
  // it, so nothing will land): its expectations are cancelled, its on_done fires now, and its tag
  // is retired as for any failure (late_writes). False when the request is unknown or has ended.
  bool fail(uint64_t request, const std::string& reason);
  // Requests admitted and not ended.
  size_t in_flight() const;
  // This rank's immediate range, and the immediates of one layer of a request counted there and
  // not consumed by an expectation (diagnostics and tests; kExtrasLayer for the extras).
  ImmRange imm_range() const;
  uint64_t imm_count(uint64_t request, uint32_t layer) const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// A request admitted by a decode group (its admit message) and this prefill rank's side of it.
struct KvSend {
  std::span<const uint8_t> admit{};
  std::vector<uint32_t> src_pages{};   // this rank's pages of the prompt, in prompt order
  std::optional<uint32_t> extra_slot{};  // this rank's extras (needed on TP rank 0 when admitted with extras)
  // Once every write of every layer and of the extras has completed locally (the pages may be
  // reused), or with the first error.
  OnDone on_sent{};
};

class KvSender {
 public:
  KvSender(TransferEngine& engine, KvLayout layout, KvTensors tensors, KvRank rank);
  ~KvSender();
  KvSender(const KvSender&) = delete;
  KvSender& operator=(const KvSender&) = delete;

  // Interns one decode rank's regions (KvReceiver::descriptor). Throws kInvalidArgument for a
  // layout that does not match this one's (layers, page tokens, head size, dtype, order, extras).
  void add_decoder(std::span<const uint8_t> descriptor);
  // Forgets decode group `group`: its regions, and its ranks as peers of the engine (nothing of
  // it is left). Its requests in flight end with kCancelled. False when it was not added.
  bool remove_decoder(uint64_t group);
  // Throws kNotFound when the decode group was not added (or a rank of it), kInvalidArgument for
  // an id already begun or extras that do not match.
  void begin(KvSend send);
  // Layer `layer` of `request` is computed: its pages go out now.
  void layer_done(uint64_t request, uint32_t layer);
  // The request's extras are written: they go out once every layer has gone (at once if all have).
  // Only TP rank 0 of the prefill group writes them; on other ranks this ends the request's steps.
  void extras_done(uint64_t request);
  // Ends a request on this side (its decode side failed it, say): its on_sent gets kCancelled and
  // later calls for it throw kNotFound; writes already posted still land. False when unknown.
  bool cancel(uint64_t request);
  // Requests begun and not ended.
  size_t in_flight() const;

  // Layers triggered by the GPU. A trigger is a word that the prefill forward (a CUDA graph
  // captured once) increments by one after each layer's attention and once more after the extras
  // are written (also when there are none): num_layers + 1 steps per forward. Before launching a
  // forward, say which requests it computes with begin_forward; each step then calls layer_done
  // (then extras_done) for each of them, in order.
  //   gpu_trigger: the word, allocated on the first call (CUDA builds, an engine with cuda_device;
  //   kUnsupported elsewhere); its watcher calls trigger_reached.
  //   trigger_reached(value): the trigger has counted `value` steps in all. Engines that count
  //   layers on the host call it themselves. Steps beyond the forwards begun are an error (logged).
  UvmWatcher gpu_trigger();
  void begin_forward(std::vector<uint64_t> requests);
  void trigger_reached(uint64_t value);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace fabric::kv
