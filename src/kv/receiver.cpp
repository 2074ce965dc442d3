// KvReceiver: a decode rank admits requests into the pages its caller allocated and counts each
// layer's (and the extras') immediates, whatever their order.
#include <fmt/format.h>

#include <map>
#include <set>

#include "kv/endpoint.h"
#include "kv/kv_stats.h"

namespace fabric::kv {

using Clock = std::chrono::steady_clock;

struct KvReceiver::State : Endpoint {
  State(TransferEngine& e, KvLayout l, KvTensors t, KvRank r, KvReceiverOptions o)
      : Endpoint(e, l, std::move(t), r,
                 e.reserve_imms({.holder = fmt::format("kv receiver: group {} rank {}", r.group, r.tp.rank),
                                 .bits = kKvImmBits,
                                 .base = o.imm_base})),
        options(o) {}
  KvReceiverOptions options;
  std::shared_ptr<KvReceiverStats> stats = std::make_shared<KvReceiverStats>();  // requests' callbacks hold it too
  std::set<uint64_t> in_flight;                // request tags
  std::map<uint64_t, Clock::time_point> retired;  // failed tags, until their late WRITEs can no longer land
  std::set<uint64_t> discarding;                  // expired retired tags whose counts are being dropped
  // How each request in flight ends (by tag, with its id): fail() ends one from outside.
  std::map<uint64_t, std::pair<uint64_t, std::function<bool(const Status&)>>> finishers;
  MetricsRegistration metrics;  // last: removed before what its source reads

  // Takes `tag` for a new request, or throws. Retired tags whose window has passed (this one or
  // any other) have their late immediates discarded first, so none counts toward a later request
  // and the engine's table of unclaimed immediates does not fill with them.
  void take_tag(uint64_t request, uint64_t tag) {
    std::vector<uint64_t> expired;
    {
      std::lock_guard l(mu);
      if (in_flight.count(tag))
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("KvReceiver::admit: request {} (tag {}) is already in flight", request, tag));
      const auto now = Clock::now();
      auto r = retired.find(tag);
      if (discarding.count(tag) || (r != retired.end() && now < r->second))
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("KvReceiver::admit: request tag {} failed and may still receive its late WRITEs "
                                "for {} ms: admit the request under another id",
                                tag, r != retired.end() ? std::chrono::duration_cast<std::chrono::milliseconds>(
                                                              r->second - now).count() : 0));
      for (auto it = retired.begin(); it != retired.end();) {
        if (it->second > now) {
          ++it;
          continue;
        }
        expired.push_back(it->first);
        discarding.insert(it->first);  // until its counts are gone: not admitted meanwhile
        it = retired.erase(it);
      }
      in_flight.insert(tag);
    }
    // Without the lock: each discard is a round trip to the engine's worker.
    for (uint64_t t : expired) {
      for (uint32_t layer = 0; layer < layout.num_layers; layer++) imms.discard(layer_imm(t, layer));
      imms.discard(layer_imm(t, kExtrasLayer));
    }
    std::lock_guard l(mu);
    for (uint64_t t : expired) discarding.erase(t);
  }
};

KvReceiver::KvReceiver(TransferEngine& engine, KvLayout layout, KvTensors tensors, KvRank rank,
                       KvReceiverOptions options) {
  check_layout(layout, tensors, rank);
  state_ = std::make_shared<State>(engine, layout, std::move(tensors), rank, options);
  state_->metrics =
      engine.add_metrics_source([st = state_.get()](MetricsWriter& w) { write_metrics(w, *st->stats, st->rank); });
}

KvReceiver::~KvReceiver() { state_->metrics.remove(); }  // now, though a request's callback may keep the state a while

std::vector<uint8_t> KvReceiver::descriptor() const { return wire::encode(state_->descriptor()); }

ImmRange KvReceiver::imm_range() const { return state_->imms.range(); }
uint64_t KvReceiver::imm_count(uint64_t request, uint32_t layer) const {
  return state_->imms.count(layer_imm(request, layer));
}

bool KvReceiver::fail(uint64_t request, const std::string& reason) {
  State& s = *state_;
  std::function<bool(const Status&)> finish;
  {
    std::lock_guard l(s.mu);
    auto it = s.finishers.find(request & kKvTagMask);
    if (it == s.finishers.end() || it->second.first != request) return false;
    finish = it->second.second;  // a copy: finish erases the entry
  }
  // Without the lock: finish takes it, cancels the expectations and fires on_done (or does
  // nothing when an expectation ended the request meanwhile).
  return finish(Status(ErrorCode::kCancelled, fmt::format("KV request {}: {}", request, reason)));
}

size_t KvReceiver::in_flight() const {
  std::lock_guard l(state_->mu);
  return state_->in_flight.size();
}

std::vector<uint8_t> KvReceiver::admit(KvAdmit a) {
  State& s = *state_;
  for (uint32_t p : a.pages)
    if (p >= s.layout.num_pages)
      throw Error(ErrorCode::kOutOfBounds, fmt::format("KvReceiver::admit: page {} of {}", p, s.layout.num_pages));
  if (a.prefill_size == 0 || s.rank.total_heads % a.prefill_size != 0)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KvReceiver::admit: {} heads do not split over a prefill TP of {}",
                            s.rank.total_heads, a.prefill_size));
  if (a.extra_slot && *a.extra_slot >= s.tensors.extra_slots)
    throw Error(s.tensors.extra_slots ? ErrorCode::kOutOfBounds : ErrorCode::kInvalidArgument,
                fmt::format("KvReceiver::admit: extra slot {} of {}", *a.extra_slot, s.tensors.extra_slots));
  const uint64_t tag = a.request & kKvTagMask;
  const bool extras = a.extra_slot.has_value();
  s.take_tag(a.request, tag);

  KvLayout prefill = s.layout;
  prefill.kv_heads = s.rank.total_heads / a.prefill_size;
  prefill.page_stride = 0;  // the counts depend only on the page order and the TP sizes
  const uint64_t per_layer =
      layer_writes_into(prefill, s.rank.total_heads, a.prefill_size, s.rank.tp, static_cast<uint32_t>(a.pages.size()));

  // One expectation per layer (and one for the extras); the first failure ends the request and
  // cancels the rest.
  struct Request {
    std::atomic<uint32_t> left;
    std::atomic<bool> ended{false};
    std::vector<ImmExpectation> expectations;
    std::mutex mu;  // expectations, while they are being armed
    std::function<void(uint32_t)> on_layer;
    std::atomic<uint64_t>* landed;
    OnDone on_done;
    explicit Request(uint32_t n) : left(n) {}
  };
  const uint32_t steps = s.layout.num_layers + (extras ? 1 : 0);
  auto req = std::make_shared<Request>(steps);
  req->on_layer = std::move(a.on_layer);
  req->landed = a.landed;
  req->on_done = std::move(a.on_done);
  std::weak_ptr<State> weak = state_;
  const auto late_writes = s.options.late_writes;
  std::shared_ptr<KvReceiverStats> stats = s.stats;
  // What one layer (and the extras) brings into this rank: its K and V pages.
  const uint64_t layer_bytes = 2 * s.layout.page_bytes() * a.pages.size(), extras_bytes = s.tensors.extra_bytes;
  // False when the request had ended already.
  auto finish = [weak, req, tag, late_writes, stats](const Status& status) {
    if (req->ended.exchange(true)) return false;
    (status.ok() ? stats->completed : stats->failed).add();
    if (auto st = weak.lock()) {
      if (!status.ok()) {
        std::lock_guard l(req->mu);
        for (const ImmExpectation& e : req->expectations) st->engine.cancel_imm_expectation(e);
      }
      std::lock_guard l(st->mu);
      st->in_flight.erase(tag);
      st->finishers.erase(tag);
      if (!status.ok()) st->retired[tag] = Clock::now() + late_writes;
    }
    req->on_done.fire(status);
    return true;
  };
  auto step_landed = [req, finish, stats, layer_bytes, extras_bytes](uint32_t layer) {
    return OnDone::callback([req, finish, layer, stats, layer_bytes, extras_bytes](const Status& st) {
      if (!st.ok()) {
        finish(Status(st.code(), layer == kExtrasLayer
                                     ? fmt::format("KV request: the extras did not land: {}", st.message())
                                     : fmt::format("KV request: layer {} did not land: {}", layer, st.message())));
        return;
      }
      if (layer != kExtrasLayer) stats->layers.add();
      stats->bytes.add(layer == kExtrasLayer ? extras_bytes : layer_bytes);
      if (req->landed) req->landed->fetch_add(1, std::memory_order_release);
      if (layer != kExtrasLayer && req->on_layer && !req->ended.load()) req->on_layer(layer);
      if (req->left.fetch_sub(1) == 1) finish(Status{});
    });
  };
  {
    std::lock_guard l(s.mu);
    s.finishers[tag] = {a.request, finish};  // before arming: an expectation may end at once
  }
  s.stats->admitted.add();  // before arming too: a reader never sees more ended than admitted
  const ExpectOptions opts{.timeout = a.timeout, .device = s.tensors.device};
  try {
    std::lock_guard armed(req->mu);
    for (uint32_t layer = 0; layer < s.layout.num_layers; layer++)
      req->expectations.push_back(
          s.imms.expect(layer_imm(a.request, layer), per_layer, step_landed(layer), opts));
    if (extras)  // one page from prefill rank 0
      req->expectations.push_back(
          s.imms.expect(layer_imm(a.request, kExtrasLayer), 1, step_landed(kExtrasLayer), opts));
  } catch (...) {  // the engine refused (shut down): nothing of the request stays armed
    if (!req->ended.exchange(true)) s.stats->failed.add();  // unless an expectation ended it already
    for (const ImmExpectation& e : req->expectations) s.engine.cancel_imm_expectation(e);
    std::lock_guard l(s.mu);
    s.in_flight.erase(tag);
    s.finishers.erase(tag);
    throw;
  }
  return wire::encode(wire::Admit{.group = s.rank.group,
                                  .request = a.request,
                                  .prefill_size = a.prefill_size,
                                  .extra_slot = a.extra_slot,
                                  .pages = std::move(a.pages)});
}

}  // namespace fabric::kv
