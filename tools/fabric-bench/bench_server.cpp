// fabric-bench server: hosts the destination engines, arms immediate expectations on request,
// answers ping-pongs, and verifies what landed. Everything is driven by the client's messages.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>

#include "bench_options.h"
#include "control.h"

namespace fabric::bench {

std::vector<uint32_t> page_order(uint32_t n, uint32_t seed) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; i++) v[i] = i;
  std::shuffle(v.begin(), v.end(), std::mt19937(seed));
  return v;
}

namespace {

struct Target {
  std::unique_ptr<TransferEngine> engine;
  std::vector<uint8_t> buf;
  MrDesc desc;
};

// Answers each arrival of `in` with a 64-byte WRITE carrying `out`, `left` times.
struct Ponger : std::enable_shared_from_this<Ponger> {
  TransferEngine* engine;
  MrHandle src;
  RemoteMr dst;
  uint32_t in, out;
  uint64_t left;
  void arm() {
    if (left-- == 0) return;
    auto self = shared_from_this();
    engine->expect_imm_count(in, 1, OnDone::callback([self](const Status& s) {
      if (!s.ok()) return;
      self->engine->submit(SingleWrite{.len = 64, .src = {self->src, 0}, .dst = {self->dst, 0}, .imm = self->out},
                           OnDone::none());
      self->arm();
    }));
  }
};

bool check_range(const uint8_t* got, uint64_t src_off, uint64_t len) {
  for (uint64_t i = 0; i < len; i++)
    if (got[i] != pattern(src_off + i)) return false;
  return true;
}

}  // namespace

int run_server(const Options& o, const std::function<void(const std::string&)>& on_ready) {
  std::vector<Target> targets(std::max<size_t>(o.peers, 1));
  for (size_t p = 0; p < targets.size(); p++) {
    targets[p].engine = std::make_unique<TransferEngine>(o.server_engine_config(p));
    targets[p].buf.assign((p == 0 ? o.buffer_mib : o.peer_buffer_mib) << 20, 0);
    targets[p].desc = targets[p].engine->reg_mr(targets[p].buf.data(), targets[p].buf.size()).second;
  }
  TransferEngine& main = *targets[0].engine;
  std::vector<uint8_t> pong_src(4096, 1);
  MrHandle pong_handle = main.reg_mr(pong_src.data(), pong_src.size()).first;
  Control ctl(main);
  // The engines outlive `ctl` (they are declared first). When the server ends on an error (e.g. a
  // reply to a client that is gone), their shutdown fails the pending expectations, whose callbacks
  // must then not send through `ctl` or the dying engine: they check `replies` under its lock.
  struct Replies {
    std::mutex mu;
    bool open = true;
  };
  auto replies = std::make_shared<Replies>();
  struct CloseReplies {
    Replies& r;
    ~CloseReplies() {
      std::lock_guard lock(r.mu);
      r.open = false;
    }
  } close_replies{*replies};
  on_ready(main.main_address().to_hex());

  for (;;) {
    std::string msg = ctl.recv(std::chrono::hours(24));
    auto w = split(msg);
    if (w.empty()) continue;
    const std::string& cmd = w[0];
    if (cmd == "hello") {  // hello <client addr hex>
      ctl.set_peer(NetAddr::from_hex(w[1]));
      std::string reply = "descs";
      for (auto& t : targets) reply += " " + t.desc.to_hex();
      ctl.send(reply);
    } else if (cmd == "expect") {  // expect <first|all> <imm> <count>: "reached" when met
      uint32_t imm = static_cast<uint32_t>(std::stoul(w[2]));
      uint64_t count = std::stoull(w[3]);
      size_t n = w[1] == "all" ? targets.size() : 1;
      auto left = std::make_shared<std::atomic<size_t>>(n);
      for (size_t p = 0; p < n; p++)
        targets[p].engine->expect_imm_count(imm, count, OnDone::callback([&ctl, left, imm, replies](const Status& s) {
          std::lock_guard lock(replies->mu);
          if (--*left == 0 && replies->open)
            ctl.send(fmt::format("reached {} {}", imm, s.ok() ? "ok" : s.message()));
        }));
      ctl.send("armed");
    } else if (cmd == "pong") {  // pong <in> <out> <iters> <client desc hex>
      auto p = std::make_shared<Ponger>();
      p->engine = &main;
      p->src = pong_handle;
      p->dst = main.add_remote(MrDesc::from_hex(w[4]));
      p->in = static_cast<uint32_t>(std::stoul(w[1]));
      p->out = static_cast<uint32_t>(std::stoul(w[2]));
      p->left = std::stoull(w[3]);
      p->arm();
      ctl.send("armed");
    } else if (cmd == "ping") {
      ctl.send("pong");
    } else if (cmd == "verify") {  // verify single <len> | paged <page> <n> <stride> <seed> | scatter <len>
      bool ok = true;
      if (w[1] == "single") {
        ok = check_range(targets[0].buf.data(), 0, std::stoull(w[2]));
      } else if (w[1] == "paged") {
        uint64_t page = std::stoull(w[2]), stride = std::stoull(w[4]);
        uint32_t n = static_cast<uint32_t>(std::stoul(w[3])), seed = static_cast<uint32_t>(std::stoul(w[5]));
        auto src = page_order(n, seed), dst = page_order(n, seed + 1);
        for (uint32_t i = 0; i < n && ok; i++)
          ok = check_range(targets[0].buf.data() + dst[i] * stride, src[i] * stride, page);
      } else if (w[1] == "scatter") {
        uint64_t len = std::stoull(w[2]);
        for (size_t p = 0; p < targets.size() && ok; p++)
          ok = check_range(targets[p].buf.data(), p * len, len);
      }
      ctl.send(ok ? "verified ok" : "verified BAD");
    } else if (cmd == "bye") {
      ctl.send("bye");
      return 0;
    } else {
      ctl.send("error unknown command " + cmd);
    }
  }
}

}  // namespace fabric::bench
