// A Domain that hands every call to another one: the base of the test wrappers, which override
// only what they change.
#pragma once

#include <memory>

#include "domain/domain.h"

namespace fabric {

class ForwardingDomain : public Domain {
 public:
  explicit ForwardingDomain(std::unique_ptr<Domain> inner) : inner_(std::move(inner)) {}

  const std::string& provider_name() const override { return inner_->provider_name(); }
  const std::string& address() const override { return inner_->address(); }
  const DomainCaps& caps() const override { return inner_->caps(); }
  DomainRegion register_memory(void* ptr, size_t len, Device device) override {
    return inner_->register_memory(ptr, len, device);
  }
  void deregister_memory(DomainRegion& region) override { inner_->deregister_memory(region); }
  PeerId insert_peer(const std::string& address) override { return inner_->insert_peer(address); }
  void remove_peer(PeerId peer) override { inner_->remove_peer(peer); }
  PostResult post_write(const WriteOp& op, OpContext* ctx) override { return inner_->post_write(op, ctx); }
  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc, OpContext* ctx) override {
    return inner_->post_send(peer, buf, len, desc, ctx);
  }
  PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) override {
    return inner_->post_recv(buf, len, desc, ctx);
  }
  const std::string& last_error() const override { return inner_->last_error(); }
  size_t poll(std::span<Completion> out) override { return inner_->poll(out); }
  void* scratch_desc() const override { return inner_->scratch_desc(); }
  void* scratch_buffer() const override { return inner_->scratch_buffer(); }
  size_t max_in_flight() const override { return inner_->max_in_flight(); }
  InjectedFaults injected_faults() const override { return inner_->injected_faults(); }

 protected:
  std::unique_ptr<Domain> inner_;
};

}  // namespace fabric
