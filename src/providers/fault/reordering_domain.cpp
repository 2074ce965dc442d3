// Reordering wrapper: forwards posts unchanged, shuffles and delays what poll() returns.
#include "providers/fault/reordering_domain.h"

#include <algorithm>
#include <random>
#include <vector>

namespace fabric {
namespace {

class ReorderingDomain final : public Domain {
 public:
  ReorderingDomain(std::unique_ptr<Domain> inner, const ReorderConfig& config, size_t nic_index)
      : inner_(std::move(inner)), config_(config), rng_(config.seed * 1000003 + nic_index) {}

  const std::string& provider_name() const override { return inner_->provider_name(); }
  const std::string& address() const override { return inner_->address(); }
  DomainRegion register_memory(void* ptr, size_t len, Device device) override {
    return inner_->register_memory(ptr, len, device);
  }
  void deregister_memory(DomainRegion& region) override { inner_->deregister_memory(region); }
  PeerId insert_peer(const std::string& address) override { return inner_->insert_peer(address); }
  PostResult post_write(const WriteOp& op, OpContext* ctx) override {
    return inner_->post_write(op, ctx);
  }
  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc,
                       OpContext* ctx) override {
    return inner_->post_send(peer, buf, len, desc, ctx);
  }
  PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) override {
    return inner_->post_recv(buf, len, desc, ctx);
  }
  const std::string& last_error() const override { return inner_->last_error(); }
  void* scratch_desc() const override { return inner_->scratch_desc(); }
  void* scratch_buffer() const override { return inner_->scratch_buffer(); }
  size_t max_in_flight() const override { return inner_->max_in_flight(); }
  InjectedFaults injected_faults() const override { return inner_->injected_faults(); }

  size_t poll(std::span<Completion> out) override {
    Completion fresh[64];
    size_t n = inner_->poll(std::span(fresh, std::min(out.size(), std::size(fresh))));
    std::uniform_int_distribution<uint32_t> hold(0, config_.max_hold_polls);
    for (size_t i = 0; i < n; i++) held_.push_back({std::move(fresh[i]), hold(rng_)});

    // Release in random order those whose hold ran out; age the rest.
    std::shuffle(held_.begin(), held_.end(), rng_);
    size_t written = 0;
    for (size_t i = 0; i < held_.size();) {
      if (held_[i].polls_left == 0 && written < out.size()) {
        out[written++] = std::move(held_[i].completion);
        held_[i] = std::move(held_.back());
        held_.pop_back();
      } else {
        if (held_[i].polls_left > 0) held_[i].polls_left--;
        i++;
      }
    }
    return written;
  }

 private:
  struct Held {
    Completion completion;
    uint32_t polls_left;
  };
  std::unique_ptr<Domain> inner_;
  ReorderConfig config_;
  std::mt19937_64 rng_;
  std::vector<Held> held_;
};

}  // namespace

std::unique_ptr<Domain> wrap_reordering(std::unique_ptr<Domain> inner, const ReorderConfig& config,
                                        size_t nic_index) {
  return std::make_unique<ReorderingDomain>(std::move(inner), config, nic_index);
}

}  // namespace fabric
