// KvSender: a prefill rank writes each layer of each request into the decode ranks' pages the
// moment it is computed, then the extras, as include/fabric/kv/layout.h plans it.
#include <fmt/format.h>

#include <map>

#include "kv/endpoint.h"
#include "kv/forward_steps.h"
#include "kv/kv_stats.h"
#include "util/log.h"

namespace fabric::kv {

namespace {

struct DecodeRank {
  KvLayout layout;
  uint32_t extra_slots = 0;
  uint64_t extra_bytes = 0;
  std::vector<RemoteMr> k, v;
  std::optional<RemoteMr> extras;
  NetAddr owner;
};

// A decode group as requests see it: replaced (never changed) when a rank is added, so a request
// keeps the group it began with.
struct Group {
  uint64_t id = 0;
  uint32_t size = 0;
  std::map<uint32_t, DecodeRank> ranks;
};

struct Request {
  uint64_t id = 0;
  std::shared_ptr<const Group> group;
  std::vector<LayerWrite> plan;  // the same for every layer
  std::vector<bool> layer_posted;
  uint32_t layers_posted = 0;
  bool writes_extras = false;  // TP rank 0 of a request admitted with extras
  bool extras_ready = false, extras_posted = false;
  uint32_t src_extra = 0, dst_extra = 0;
  std::atomic<uint64_t> writes_left{0};
  std::atomic<bool> ended{false};
  OnDone on_sent;
  std::shared_ptr<KvSenderStats> stats;  // the sender's: a request may end after it
  std::atomic<int64_t> last_layer_ns{0};  // steady clock when its last layer was handed over (0: not yet)
};

int64_t now_ns() { return std::chrono::steady_clock::now().time_since_epoch().count(); }

}  // namespace

struct KvSender::State : Endpoint, std::enable_shared_from_this<KvSender::State> {
  using Endpoint::Endpoint;
  std::map<uint64_t, std::shared_ptr<const Group>> groups;
  std::map<uint64_t, std::shared_ptr<Request>> requests;
  ForwardSteps steps{layout.num_layers};
  std::optional<UvmWatcher> trigger;
  std::shared_ptr<KvSenderStats> stats = std::make_shared<KvSenderStats>();
  MetricsRegistration metrics;  // last: removed before what its source reads

  std::shared_ptr<Request> find_locked(uint64_t request, const char* call) {
    auto it = requests.find(request);
    if (it == requests.end())
      throw Error(ErrorCode::kNotFound, fmt::format("KvSender::{}: request {} was not begun (or ended)", call, request));
    return it->second;
  }

  // How every request ends, once: it leaves the table of `s` (none when the sender is gone) and
  // its on_sent fires. False when it had ended already.
  static bool end(State* s, const std::shared_ptr<Request>& req, const Status& status) {
    if (req->ended.exchange(true)) return false;
    if (!status.ok()) {
      req->stats->failed.add();
    } else {
      req->stats->completed.add();
      // Every write completed: how long the request outlived its last layer's computation.
      if (const int64_t t = req->last_layer_ns.load(std::memory_order_relaxed))
        req->stats->exposed.observe(std::chrono::nanoseconds(now_ns() - t));
    }
    if (s) {
      std::lock_guard l(s->mu);
      auto it = s->requests.find(req->id);
      if (it != s->requests.end() && it->second == req) s->requests.erase(it);
    }
    req->on_sent.fire(status);
    return true;
  }

  // Every write of a request reports here; the last one (or the first error) ends it.
  OnDone write_done(const std::shared_ptr<Request>& req) {
    std::weak_ptr<State> weak = weak_from_this();
    return OnDone::callback([weak, req](const Status& st) {
      const bool last = req->writes_left.fetch_sub(1) == 1;
      if (st.ok() && !last) return;
      end(weak.lock().get(), req, st);
    });
  }

  // Submits the writes; a refusal (the decode rank's regions went stale when the engine let a
  // failed peer go, or the engine is closing) fails the request.
  template <class EachWrite>
  void submit_all(const std::shared_ptr<Request>& req, EachWrite each) {
    OnDone done = write_done(req);
    try {
      each([&](const PagedWrites& w) {
        engine.submit(w, done);
        stats->bytes.add(w.page_len * w.src_pages.indices.size());
      });
    } catch (const Error& e) {
      // The writes not posted would never report: the request ends now.
      end(this, req, Status(e.code(), fmt::format("KV request {}: a write was refused: {}", req->id, e.what())));
    }
  }

  void post_layer(const std::shared_ptr<Request>& req, uint32_t layer) {
    submit_all(req, [&](auto&& submit) {
      for (const LayerWrite& w : req->plan) {
        const DecodeRank& dst = req->group->ranks.at(w.decode_rank);
        submit(PagedWrites{.page_len = w.run_bytes,
                           .src = (w.value ? regions.v : regions.k)[layer],
                           .src_pages = {.indices = w.src_index, .stride = w.src_stride, .offset = w.src_offset},
                           .dst = (w.value ? dst.v : dst.k)[layer],
                           .dst_pages = {.indices = w.dst_index, .stride = w.dst_stride, .offset = w.dst_offset},
                           .imm = layer_imm(req->id, layer)});
      }
    });
  }

  // One page per decode rank, from TP rank 0.
  void post_extras(const std::shared_ptr<Request>& req) {
    submit_all(req, [&](auto&& submit) {
      for (const auto& [rank, dst] : req->group->ranks)
        submit(PagedWrites{.page_len = tensors.extra_bytes,
                           .src = *regions.extras,
                           .src_pages = {.indices = std::span(&req->src_extra, 1), .stride = tensors.extra_bytes},
                           .dst = *dst.extras,
                           .dst_pages = {.indices = std::span(&req->dst_extra, 1), .stride = dst.extra_bytes},
                           .imm = layer_imm(req->id, kExtrasLayer)});
    });
  }

  void layer_done(uint64_t request, uint32_t layer) {
    std::shared_ptr<Request> req;
    bool extras_now = false;
    {
      std::lock_guard l(mu);
      req = find_locked(request, "layer_done");
      if (layer >= layout.num_layers)
        throw Error(ErrorCode::kOutOfBounds, fmt::format("KvSender::layer_done: layer {} of {}", layer, layout.num_layers));
      if (req->layer_posted[layer])
        throw Error(ErrorCode::kInvalidArgument, fmt::format("KvSender::layer_done: layer {} was already sent", layer));
      req->layer_posted[layer] = true;
      req->layers_posted++;
      if (req->layers_posted == layout.num_layers) req->last_layer_ns.store(now_ns(), std::memory_order_relaxed);
      extras_now = req->writes_extras && req->extras_ready && req->layers_posted == layout.num_layers;
      req->extras_posted |= extras_now;
    }
    post_layer(req, layer);
    stats->layers.add();
    if (extras_now) post_extras(req);
  }

  void extras_done(uint64_t request) {
    std::shared_ptr<Request> req;
    bool extras_now = false;
    {
      std::lock_guard l(mu);
      req = find_locked(request, "extras_done");
      if (req->extras_ready)
        throw Error(ErrorCode::kInvalidArgument, fmt::format("KvSender::extras_done: request {} said so already", request));
      req->extras_ready = true;
      extras_now = req->writes_extras && req->layers_posted == layout.num_layers;
      req->extras_posted |= extras_now;
    }
    if (extras_now) post_extras(req);
  }

  // What the trigger's steps mean; errors are logged (the watcher thread has nobody to tell).
  void reach(uint64_t value) {
    std::vector<ForwardSteps::Event> events;
    uint64_t unmatched = 0;
    {
      std::lock_guard l(mu);
      unmatched = steps.reach(value, events);
    }
    if (unmatched)
      log::error("KvSender: the trigger counted {} step(s) beyond the forwards begun (begin_forward)", unmatched);
    for (const auto& e : events)
      for (uint64_t request : e.requests) {
        try {
          if (e.layer != kExtrasLayer) {
            layer_done(request, e.layer);
          } else {
            bool pending;
            {
              std::lock_guard l(mu);
              auto it = requests.find(request);
              pending = it != requests.end() && !it->second->extras_ready;
            }
            if (pending) extras_done(request);  // a request without extras may have ended already
          }
        } catch (const Error& err) {
          log::error("KvSender: trigger step for request {}: {}", request, err.what());
        }
      }
  }
};

KvSender::KvSender(TransferEngine& engine, KvLayout layout, KvTensors tensors, KvRank rank) {
  check_layout(layout, tensors, rank);
  state_ = std::make_shared<State>(engine, layout, std::move(tensors), rank);
  state_->metrics = engine.add_metrics_source([st = state_.get()](MetricsWriter& w) { write_metrics(w, *st->stats, st->rank); });
}

KvSender::~KvSender() {
  state_->metrics.remove();  // now, though a request's callback may keep the state a while
  if (state_->trigger) state_->engine.free_uvm_watcher(*state_->trigger);
}

size_t KvSender::in_flight() const {
  std::lock_guard l(state_->mu);
  return state_->requests.size();
}

void KvSender::add_decoder(std::span<const uint8_t> descriptor) {
  State& s = *state_;
  wire::Descriptor d = wire::parse_descriptor(descriptor);
  const KvLayout& a = s.layout;
  const KvLayout& b = d.layout;
  if (a.num_layers != b.num_layers || a.page_tokens != b.page_tokens || a.head_dim != b.head_dim ||
      a.dtype_bytes != b.dtype_bytes || a.order != b.order || d.rank.total_heads != s.rank.total_heads)
    throw Error(ErrorCode::kInvalidArgument,
                "KvSender::add_decoder: the decoder's layout differs in layers, page tokens, head size, dtype, "
                "page order or total heads");
  if (d.extra_slots && s.tensors.extra_slots && d.extra_bytes != s.tensors.extra_bytes)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KvSender::add_decoder: the decoder's extras are {} bytes, this rank's {}", d.extra_bytes,
                            s.tensors.extra_bytes));
  DecodeRank r{.layout = b, .extra_slots = d.extra_slots, .extra_bytes = d.extra_bytes, .k = {}, .v = {},
               .extras = std::nullopt, .owner = d.k.at(0).owner()};
  for (uint32_t i = 0; i < b.num_layers; i++) {
    r.k.push_back(s.engine.add_remote(d.k[i]));
    r.v.push_back(s.engine.add_remote(d.v[i]));
  }
  if (d.extras) r.extras = s.engine.add_remote(*d.extras);
  std::lock_guard l(s.mu);
  auto it = s.groups.find(d.rank.group);
  if (it != s.groups.end() && it->second->size != d.rank.tp.size)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KvSender::add_decoder: group {} has TP {}, this rank says {}", d.rank.group,
                            it->second->size, d.rank.tp.size));
  auto g = std::make_shared<Group>(it != s.groups.end() ? *it->second : Group{d.rank.group, d.rank.tp.size, {}});
  g->ranks[d.rank.tp.rank] = std::move(r);
  s.groups[d.rank.group] = std::move(g);
}

bool KvSender::remove_decoder(uint64_t group) {
  State& s = *state_;
  std::shared_ptr<const Group> g;
  std::vector<std::shared_ptr<Request>> of_group;
  {
    std::lock_guard l(s.mu);
    auto it = s.groups.find(group);
    if (it == s.groups.end()) return false;
    g = it->second;
    s.groups.erase(it);
    for (const auto& [id, r] : s.requests)
      if (r->group->id == group) of_group.push_back(r);
  }
  // Ended first, so that the writes the peers' removal cancels do not speak for them.
  for (auto& r : of_group)
    State::end(&s, r, Status(ErrorCode::kCancelled, fmt::format("KV request {}: decode group {} was removed", r->id, group)));
  // The peers go with their regions; what is still in flight to them ends with kCancelled.
  for (const auto& [rank, dst] : g->ranks) s.engine.remove_peer(dst.owner);
  return true;
}

void KvSender::begin(KvSend send) {
  State& s = *state_;
  wire::Admit a = wire::parse_admit(send.admit);
  if (a.prefill_size != s.rank.tp.size)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KvSender::begin: the request was admitted for a prefill TP of {}, this group's is {}",
                            a.prefill_size, s.rank.tp.size));
  auto req = std::make_shared<Request>();
  req->id = a.request;
  req->stats = s.stats;
  req->on_sent = std::move(send.on_sent);
  req->layer_posted.assign(s.layout.num_layers, false);
  std::unique_lock l(s.mu);
  auto g = s.groups.find(a.group);
  if (g == s.groups.end() || g->second->ranks.size() != g->second->size)
    throw Error(ErrorCode::kNotFound,
                fmt::format("KvSender::begin: decode group {} {}", a.group,
                            g == s.groups.end() ? "was never added"
                                                : fmt::format("has {} of its {} ranks added", g->second->ranks.size(),
                                                              g->second->size)));
  if (s.requests.count(a.request))
    throw Error(ErrorCode::kInvalidArgument, fmt::format("KvSender::begin: request {} already begun", a.request));
  req->group = g->second;
  req->writes_extras = a.extra_slot.has_value() && s.rank.tp.rank == 0;
  if (req->writes_extras) {
    if (!send.extra_slot || *send.extra_slot >= s.tensors.extra_slots)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("KvSender::begin: request {} was admitted with extras: TP rank 0 needs one of its {} "
                              "extra slots",
                              a.request, s.tensors.extra_slots));
    for (const auto& [rank, dst] : req->group->ranks)
      if (!dst.extras || *a.extra_slot >= dst.extra_slots)
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("KvSender::begin: decode rank {} has no extra slot {}", rank, *a.extra_slot));
    req->src_extra = *send.extra_slot;
    req->dst_extra = *a.extra_slot;
  }
  req->plan = plan_layer(s.layout, req->group->ranks.begin()->second.layout, s.rank.total_heads, s.rank.tp,
                         req->group->size, send.src_pages, a.pages);
  req->writes_left =
      uint64_t{s.layout.num_layers} * req->plan.size() + (req->writes_extras ? req->group->ranks.size() : 0);
  s.stats->begun.add();
  if (req->writes_left == 0) {  // an empty prompt: nothing to send
    l.unlock();  // on_sent may call back into this sender
    s.stats->completed.add();
    req->on_sent.fire(Status{});
    return;
  }
  s.requests.emplace(a.request, std::move(req));
}

bool KvSender::cancel(uint64_t request) {
  State& s = *state_;
  std::shared_ptr<Request> req;
  {
    std::lock_guard l(s.mu);
    auto it = s.requests.find(request);
    if (it == s.requests.end()) return false;
    req = it->second;
  }
  return State::end(&s, req, Status(ErrorCode::kCancelled, fmt::format("KV request {} was cancelled", request)));
}

void KvSender::layer_done(uint64_t request, uint32_t layer) { state_->layer_done(request, layer); }

void KvSender::extras_done(uint64_t request) { state_->extras_done(request); }

UvmWatcher KvSender::gpu_trigger() {
  State& s = *state_;
  std::lock_guard l(s.mu);
  if (!s.trigger) {
    std::weak_ptr<State> weak = state_;
    std::optional<int> gpu;
    if (s.tensors.device.kind == Device::Kind::kCuda) gpu = s.tensors.device.index;
    s.trigger = s.engine.alloc_uvm_watcher(
        [weak](uint64_t, uint64_t now) {
          if (auto st = weak.lock()) st->reach(now);
        },
        gpu);
  }
  return *s.trigger;
}

void KvSender::begin_forward(std::vector<uint64_t> requests) {
  std::lock_guard l(state_->mu);
  state_->steps.push(std::move(requests));
}

void KvSender::trigger_reached(uint64_t value) { state_->reach(value); }

}  // namespace fabric::kv
