// KvReceiver and KvSender: the KV write plan (plan.cpp) carried out on a TransferEngine.
//
// Descriptor: "FBKV" u8 version u64 group u32 tp_size u32 tp_rank u32 total_heads
//             u32 layers u32 pages u32 page_tokens u32 kv_heads u32 head_dim u32 dtype_bytes
//             u8 order u64 page_stride { u32 len, MrDesc bytes }*(2 * layers)   (K then V per layer)
// Admit:      "FBKA" u8 version u64 group u64 request u32 prefill_size u32 n { u32 page }*n
#include "fabric/kv_transfer.h"

#include <fmt/format.h>

#include <atomic>
#include <map>
#include <mutex>
#include <set>

#include "util/bytes.h"

namespace fabric::kv {

namespace {

constexpr char kDescMagic[4] = {'F', 'B', 'K', 'V'};
constexpr char kAdmitMagic[4] = {'F', 'B', 'K', 'A'};
constexpr uint8_t kVersion = 1;
constexpr uint32_t kMaxLayers = 255;

void write_magic(util::ByteWriter& w, const char (&m)[4]) {
  w.raw(m, 4);
  w.u8(kVersion);
}
void read_magic(util::ByteReader& r, const char (&m)[4]) {
  for (char c : m)
    if (r.u8("magic") != static_cast<uint8_t>(c)) r.fail("bad magic");
  if (r.u8("version") != kVersion) r.fail("unsupported version");
}

void check_layout(const KvLayout& l, const KvTensors& t, const KvRank& rank) {
  if (l.num_layers == 0 || l.num_layers > kMaxLayers)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("kv: {} layers; 1 to {} are supported", l.num_layers, kMaxLayers));
  if (t.k.size() != l.num_layers || t.v.size() != l.num_layers)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("kv: {} K and {} V tensors for {} layers", t.k.size(), t.v.size(), l.num_layers));
  if (rank.tp.size == 0 || rank.tp.rank >= rank.tp.size || rank.total_heads % rank.tp.size != 0 ||
      l.kv_heads != rank.total_heads / rank.tp.size)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("kv: rank {} of TP {} with {} of {} heads: the heads must split evenly", rank.tp.rank,
                            rank.tp.size, l.kv_heads, rank.total_heads));
  if (l.num_pages == 0 || l.page_tokens == 0 || l.head_dim == 0 || l.dtype_bytes == 0)
    throw Error(ErrorCode::kInvalidArgument, "kv: pages, page tokens, head size and dtype must be non-zero");
}

// Registers every layer's K and V tensor once.
struct Registered {
  TransferEngine& engine;
  std::vector<MrHandle> k, v;
  std::vector<MrDesc> k_desc, v_desc;
  Registered(TransferEngine& e, const KvLayout& l, const KvTensors& t) : engine(e) {
    try {
      for (uint32_t i = 0; i < l.num_layers; i++) {
        auto [hk, dk] = e.reg_mr(t.k[i], l.tensor_bytes(), t.device);
        k.push_back(hk);
        k_desc.push_back(dk);
        auto [hv, dv] = e.reg_mr(t.v[i], l.tensor_bytes(), t.device);
        v.push_back(hv);
        v_desc.push_back(dv);
      }
    } catch (...) {
      release();
      throw;
    }
  }
  void release() {
    for (auto* list : {&k, &v})
      for (MrHandle h : *list) engine.dereg_mr(h);
    k.clear();
    v.clear();
  }
  ~Registered() { release(); }
};

struct Descriptor {
  KvRank rank;
  KvLayout layout;
  std::vector<MrDesc> k, v;
};

Descriptor parse_descriptor(std::span<const uint8_t> bytes) {
  util::ByteReader r(bytes, "KV descriptor");
  read_magic(r, kDescMagic);
  Descriptor d;
  d.rank.group = r.u64("group");
  d.rank.tp.size = r.u32("tp size");
  d.rank.tp.rank = r.u32("tp rank");
  d.rank.total_heads = r.u32("total heads");
  KvLayout& l = d.layout;
  l.num_layers = r.u32("layers");
  l.num_pages = r.u32("pages");
  l.page_tokens = r.u32("page tokens");
  l.kv_heads = r.u32("kv heads");
  l.head_dim = r.u32("head dim");
  l.dtype_bytes = r.u32("dtype bytes");
  uint8_t order = r.u8("order");
  if (order > 1) r.fail("page order " + std::to_string(order));
  l.order = static_cast<PageOrder>(order);
  l.page_stride = r.u64("page stride");
  if (l.num_layers == 0 || l.num_layers > kMaxLayers) r.fail("layer count " + std::to_string(l.num_layers));
  if (d.rank.tp.size == 0 || d.rank.tp.rank >= d.rank.tp.size) r.fail("tp rank outside its group");
  for (uint32_t i = 0; i < 2 * l.num_layers; i++) {
    uint32_t n = r.u32("descriptor length");
    if (n > r.remaining()) r.fail("descriptor length exceeds the input");
    std::string s = r.str(n, "descriptor");
    MrDesc m = MrDesc::from_bytes(std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
    (i % 2 ? d.v : d.k).push_back(std::move(m));
  }
  r.expect_end();
  return d;
}

struct Admit {
  uint64_t group = 0, request = 0;
  uint32_t prefill_size = 0;
  std::vector<uint32_t> pages;
};

Admit parse_admit(std::span<const uint8_t> bytes) {
  util::ByteReader r(bytes, "KV admit message");
  read_magic(r, kAdmitMagic);
  Admit a;
  a.group = r.u64("group");
  a.request = r.u64("request");
  a.prefill_size = r.u32("prefill size");
  uint32_t n = r.u32("page count");
  if (uint64_t{n} * 4 > r.remaining()) r.fail("page count exceeds the input");
  for (uint32_t i = 0; i < n; i++) a.pages.push_back(r.u32("page"));
  r.expect_end();
  return a;
}

// What both endpoints hold: the engine, this rank's layout and memory, registered once.
struct Endpoint {
  TransferEngine& engine;
  KvLayout layout;
  KvTensors tensors;
  KvRank rank;
  Registered regions;
  std::mutex mu;
  Endpoint(TransferEngine& e, KvLayout l, KvTensors t, KvRank r)
      : engine(e), layout(l), tensors(std::move(t)), rank(r), regions(e, layout, tensors) {}
};

}  // namespace

// ---- decode side ----

struct KvReceiver::State : Endpoint {
  using Endpoint::Endpoint;
  std::set<uint64_t> in_flight;  // request tags
};

KvReceiver::KvReceiver(TransferEngine& engine, KvLayout layout, KvTensors tensors, KvRank rank) {
  check_layout(layout, tensors, rank);
  state_ = std::make_shared<State>(engine, layout, std::move(tensors), rank);
}

KvReceiver::~KvReceiver() = default;

std::vector<uint8_t> KvReceiver::descriptor() const {
  const State& s = *state_;
  const KvLayout& l = s.layout;
  util::ByteWriter w;
  write_magic(w, kDescMagic);
  w.u64(s.rank.group);
  w.u32(s.rank.tp.size);
  w.u32(s.rank.tp.rank);
  w.u32(s.rank.total_heads);
  for (uint32_t v : {l.num_layers, l.num_pages, l.page_tokens, l.kv_heads, l.head_dim, l.dtype_bytes}) w.u32(v);
  w.u8(static_cast<uint8_t>(l.order));
  w.u64(l.page_stride);
  for (uint32_t i = 0; i < l.num_layers; i++)
    for (const MrDesc* d : {&s.regions.k_desc[i], &s.regions.v_desc[i]}) {
      auto b = d->to_bytes();
      w.u32(static_cast<uint32_t>(b.size()));
      w.raw(b.data(), b.size());
    }
  return w.take();
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
  const uint64_t tag = a.request & 0xFFFFFF;
  {
    std::lock_guard l(s.mu);
    if (!s.in_flight.insert(tag).second)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("KvReceiver::admit: request {} (tag {}) is already in flight", a.request, tag));
  }
  KvLayout prefill = s.layout;
  prefill.kv_heads = s.rank.total_heads / a.prefill_size;
  prefill.page_stride = 0;  // the counts depend only on the page order and the TP sizes
  const uint64_t per_layer =
      layer_writes_into(prefill, s.rank.total_heads, a.prefill_size, s.rank.tp, static_cast<uint32_t>(a.pages.size()));

  // One expectation per layer; the first failure ends the request and cancels the rest.
  struct Request {
    std::atomic<uint32_t> layers_left;
    std::atomic<bool> ended{false};
    std::vector<ImmExpectation> expectations;
    std::mutex mu;  // expectations, while they are being armed
    std::function<void(uint32_t)> on_layer;
    OnDone on_done;
    explicit Request(uint32_t n) : layers_left(n) {}
  };
  auto req = std::make_shared<Request>(s.layout.num_layers);
  req->on_layer = std::move(a.on_layer);
  req->on_done = std::move(a.on_done);
  std::weak_ptr<State> weak = state_;
  auto finish = [weak, req, tag](const Status& status) {
    if (req->ended.exchange(true)) return;
    if (auto st = weak.lock()) {
      if (!status.ok()) {
        std::lock_guard l(req->mu);
        for (const ImmExpectation& e : req->expectations) st->engine.cancel_imm_expectation(e);
      }
      std::lock_guard l(st->mu);
      st->in_flight.erase(tag);
    }
    req->on_done.fire(status);
  };
  std::lock_guard armed(req->mu);
  for (uint32_t layer = 0; layer < s.layout.num_layers; layer++)
    req->expectations.push_back(s.engine.expect_imm_count(
        layer_imm(a.request, layer), per_layer, OnDone::callback([req, finish, layer](const Status& st) {
          if (!st.ok()) {
            finish(Status(st.code(), fmt::format("KV request: layer {} did not land: {}", layer, st.message())));
            return;
          }
          if (req->on_layer && !req->ended.load()) req->on_layer(layer);
          if (req->layers_left.fetch_sub(1) == 1) finish(Status{});
        }),
        ExpectOptions{.timeout = a.timeout, .device = s.tensors.device}));

  util::ByteWriter w;
  write_magic(w, kAdmitMagic);
  w.u64(s.rank.group);
  w.u64(a.request);
  w.u32(a.prefill_size);
  w.u32(static_cast<uint32_t>(a.pages.size()));
  for (uint32_t p : a.pages) w.u32(p);
  return w.take();
}

// ---- prefill side ----

struct KvSender::State : Endpoint {
  using Endpoint::Endpoint;
  struct DecodeRank {
    KvLayout layout;
    std::vector<RemoteMr> k, v;
  };
  struct Group {
    uint32_t size = 0;
    std::map<uint32_t, DecodeRank> ranks;
  };
  struct Request {
    uint64_t id = 0;
    const Group* group = nullptr;
    std::vector<LayerWrite> plan;  // the same for every layer
    std::vector<bool> layer_posted;
    std::atomic<uint64_t> writes_left{0};
    std::atomic<bool> ended{false};
    OnDone on_sent;
  };
  std::map<uint64_t, Group> groups;
  std::map<uint64_t, std::shared_ptr<Request>> requests;
};

KvSender::KvSender(TransferEngine& engine, KvLayout layout, KvTensors tensors, KvRank rank) {
  check_layout(layout, tensors, rank);
  state_ = std::make_shared<State>(engine, layout, std::move(tensors), rank);
}

KvSender::~KvSender() = default;

void KvSender::add_decoder(std::span<const uint8_t> descriptor) {
  State& s = *state_;
  Descriptor d = parse_descriptor(descriptor);
  const KvLayout& a = s.layout;
  const KvLayout& b = d.layout;
  if (a.num_layers != b.num_layers || a.page_tokens != b.page_tokens || a.head_dim != b.head_dim ||
      a.dtype_bytes != b.dtype_bytes || a.order != b.order || d.rank.total_heads != s.rank.total_heads)
    throw Error(ErrorCode::kInvalidArgument,
                "KvSender::add_decoder: the decoder's layout differs in layers, page tokens, head size, dtype, "
                "page order or total heads");
  State::DecodeRank r{b, {}, {}};
  for (uint32_t i = 0; i < b.num_layers; i++) {
    r.k.push_back(s.engine.add_remote(d.k[i]));
    r.v.push_back(s.engine.add_remote(d.v[i]));
  }
  std::lock_guard l(s.mu);
  State::Group& g = s.groups[d.rank.group];
  if (g.size && g.size != d.rank.tp.size)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KvSender::add_decoder: group {} has TP {}, this rank says {}", d.rank.group, g.size,
                            d.rank.tp.size));
  g.size = d.rank.tp.size;
  g.ranks[d.rank.tp.rank] = std::move(r);
}

void KvSender::begin(std::span<const uint8_t> admit, std::vector<uint32_t> src_pages, OnDone on_sent) {
  State& s = *state_;
  Admit a = parse_admit(admit);
  if (a.prefill_size != s.rank.tp.size)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KvSender::begin: the request was admitted for a prefill TP of {}, this group's is {}",
                            a.prefill_size, s.rank.tp.size));
  auto req = std::make_shared<State::Request>();
  req->id = a.request;
  req->on_sent = std::move(on_sent);
  req->layer_posted.assign(s.layout.num_layers, false);
  std::unique_lock l(s.mu);
  auto g = s.groups.find(a.group);
  if (g == s.groups.end() || g->second.ranks.size() != g->second.size)
    throw Error(ErrorCode::kNotFound,
                fmt::format("KvSender::begin: decode group {} {}", a.group,
                            g == s.groups.end() ? "was never added"
                                                : fmt::format("has {} of its {} ranks added", g->second.ranks.size(),
                                                              g->second.size)));
  if (s.requests.count(a.request))
    throw Error(ErrorCode::kInvalidArgument, fmt::format("KvSender::begin: request {} already begun", a.request));
  req->group = &g->second;
  req->plan = plan_layer(s.layout, g->second.ranks.begin()->second.layout, s.rank.total_heads, s.rank.tp,
                         g->second.size, src_pages, a.pages);
  req->writes_left = uint64_t{s.layout.num_layers} * req->plan.size();
  if (req->writes_left == 0) {  // an empty prompt: nothing to send
    l.unlock();  // on_sent may call back into this sender
    req->on_sent.fire(Status{});
    return;
  }
  s.requests.emplace(a.request, std::move(req));
}

void KvSender::layer_done(uint64_t request, uint32_t layer) {
  State& s = *state_;
  std::shared_ptr<State::Request> req;
  {
    std::lock_guard l(s.mu);
    auto it = s.requests.find(request);
    if (it == s.requests.end())
      throw Error(ErrorCode::kNotFound, fmt::format("KvSender::layer_done: request {} was not begun (or ended)", request));
    if (layer >= s.layout.num_layers)
      throw Error(ErrorCode::kOutOfBounds, fmt::format("KvSender::layer_done: layer {} of {}", layer, s.layout.num_layers));
    if (it->second->layer_posted[layer])
      throw Error(ErrorCode::kInvalidArgument, fmt::format("KvSender::layer_done: layer {} was already sent", layer));
    it->second->layer_posted[layer] = true;
    req = it->second;
  }
  std::weak_ptr<State> weak = state_;
  auto done = OnDone::callback([weak, req](const Status& st) {
    const bool last = req->writes_left.fetch_sub(1) == 1;
    if ((st.ok() && !last) || req->ended.exchange(true)) return;
    if (auto s2 = weak.lock()) {
      std::lock_guard l(s2->mu);
      s2->requests.erase(req->id);
    }
    req->on_sent.fire(st);
  });
  for (const LayerWrite& w : req->plan) {
    const State::DecodeRank& dst = req->group->ranks.at(w.decode_rank);
    s.engine.submit(PagedWrites{.page_len = w.run_bytes,
                                .src = (w.value ? s.regions.v : s.regions.k)[layer],
                                .src_pages = {.indices = w.src_index, .stride = w.src_stride, .offset = w.src_offset},
                                .dst = (w.value ? dst.v : dst.k)[layer],
                                .dst_pages = {.indices = w.dst_index, .stride = w.dst_stride, .offset = w.dst_offset},
                                .imm = layer_imm(request, layer)},
                    done);
  }
}

}  // namespace fabric::kv
