// Fault wrapper: decides each operation's fate when it is posted and applies it when its
// completion comes back; immediates are duplicated or delayed as they arrive.
#include "providers/fault/fault_domain.h"

#include <fmt/format.h>

#include <atomic>
#include <deque>
#include <chrono>
#include <random>
#include <thread>
#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "providers/fault/forwarding_domain.h"

namespace fabric {
namespace {

std::atomic<uint64_t> calls_after_wedge{0};

class FaultDomain final : public ForwardingDomain {
 public:
  FaultDomain(std::unique_ptr<Domain> inner, const FaultConfig& config, size_t nic_index)
      : ForwardingDomain(std::move(inner)), config_(config), rng_(config.seed * 1000003 + nic_index) {}

  const std::string& last_error() const override { return injected_error_ ? error_ : inner_->last_error(); }
  InjectedFaults injected() const {
    return {total_.load(std::memory_order_relaxed), duplicated_.load(std::memory_order_relaxed)};
  }

  PeerId insert_peer(const std::string& address) override {
    PeerId id = inner_->insert_peer(address);
    if (std::find(config_.busy_peers.begin(), config_.busy_peers.end(), address) != config_.busy_peers.end())
      busy_.insert(id);
    return id;
  }
  void remove_peer(PeerId peer) override {
    busy_.erase(peer);
    inner_->remove_peer(peer);
  }

  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    if (busy_.count(op.peer)) return PostResult::kRetryPeer;
    return post(ctx, "WRITE", [&] { return inner_->post_write(op, ctx); });
  }
  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc, OpContext* ctx) override {
    if (busy_.count(peer)) return PostResult::kRetryPeer;
    return post(ctx, "SEND", [&] { return inner_->post_send(peer, buf, len, desc, ctx); });
  }

  ~FaultDomain() override { count_if_lifted(); }

  size_t poll(std::span<Completion> out) override {
    if (wedged()) {
      auto until = std::chrono::steady_clock::now() + config_.wedge_for;
      while (config_.wedge_for.count() == 0 || std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      wedge_lifted_ = true;
      return 0;
    }
    count_if_lifted();
    Completion fresh[64];
    size_t n = inner_->poll(std::span(fresh, std::min(out.size(), std::size(fresh))));
    for (size_t i = 0; i < n; i++) apply(std::move(fresh[i]));
    release_delayed();
    size_t written = 0;
    while (written < out.size() && !ready_.empty()) {
      out[written++] = std::move(ready_.front());
      ready_.pop_front();
    }
    return written;
  }

 private:
  enum class Fate : uint8_t { kError, kStuck };

  bool wedged() const {
    return config_.wedge_after_posts && posts_ >= config_.wedge_after_posts && !wedge_lifted_;
  }
  void count_if_lifted() const {
    if (wedge_lifted_) calls_after_wedge.fetch_add(1, std::memory_order_relaxed);
  }

  bool roll(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  void count() { total_.fetch_add(1, std::memory_order_relaxed); }

  template <class Post>
  PostResult post(OpContext* ctx, const char* what, Post&& inner_post) {
    count_if_lifted();
    injected_error_ = false;
    if (roll(config_.post_failure)) {
      count();
      injected_error_ = true;
      error_ = fmt::format("injected fault: {} refused at post time (fault seed {})", what, config_.seed);
      return PostResult::kFailed;
    }
    PostResult r = inner_post();
    if (r != PostResult::kPosted) return r;
    posts_++;
    if (roll(config_.completion_error)) fates_[ctx] = Fate::kError;
    else if (roll(config_.stuck)) fates_[ctx] = Fate::kStuck;
    return r;
  }

  void apply(Completion&& c) {
    if (c.kind == Completion::Kind::kRemoteImm) {
      if (roll(config_.duplicate_imm)) {
        count();
        duplicated_.fetch_add(1, std::memory_order_relaxed);
        ready_.push_back(c);
      }
      if (roll(config_.delay_imm)) {
        count();
        std::uniform_int_distribution<uint32_t> polls(1, std::max<uint32_t>(1, config_.max_delay_polls));
        delayed_.push_back({std::move(c), polls(rng_)});
        return;
      }
      ready_.push_back(std::move(c));
      return;
    }
    auto it = c.context ? fates_.find(c.context) : fates_.end();
    if (it == fates_.end()) {
      ready_.push_back(std::move(c));
      return;
    }
    Fate fate = it->second;
    fates_.erase(it);
    count();
    if (fate == Fate::kStuck) return;  // swallowed: the engine's transfer timeout must notice
    c.kind = Completion::Kind::kError;
    c.error = fmt::format("injected fault: completion error (fault seed {})", config_.seed);
    ready_.push_back(std::move(c));
  }

  void release_delayed() {
    for (size_t i = 0; i < delayed_.size();) {
      if (--delayed_[i].polls_left == 0) {
        ready_.push_back(std::move(delayed_[i].completion));
        delayed_[i] = std::move(delayed_.back());
        delayed_.pop_back();
      } else {
        i++;
      }
    }
  }

  struct Delayed {
    Completion completion;
    uint32_t polls_left;
  };
  FaultConfig config_;
  std::mt19937_64 rng_;
  std::unordered_map<OpContext*, Fate> fates_;
  std::unordered_set<PeerId> busy_;
  std::deque<Completion> ready_;
  std::vector<Delayed> delayed_;
  bool injected_error_ = false;
  bool wedge_lifted_ = false;
  uint64_t posts_ = 0;
  std::string error_;
  std::atomic<uint64_t> total_{0}, duplicated_{0};
};

}  // namespace

uint64_t fault_calls_after_wedge() { return calls_after_wedge.load(std::memory_order_relaxed); }

std::unique_ptr<Domain> wrap_faults(std::unique_ptr<Domain> inner, const FaultConfig& config,
                                    size_t nic_index) {
  return std::make_unique<FaultDomain>(std::move(inner), config, nic_index);
}

InjectedFaults injected_faults(const Domain& domain) {
  // A control call (NicStats), so a dynamic_cast per wrapper is cheap enough.
  for (const Domain* d = &domain; d != nullptr;) {
    if (const auto* faults = dynamic_cast<const FaultDomain*>(d)) return faults->injected();
    const auto* wrapper = dynamic_cast<const ForwardingDomain*>(d);
    d = wrapper ? &wrapper->inner() : nullptr;
  }
  return {};
}

}  // namespace fabric
