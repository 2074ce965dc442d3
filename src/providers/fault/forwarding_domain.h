// A Domain that hands every call to another one: the base of the test wrappers, which override
// only what they change. The wrappers act on single operations, so they take no write batches:
// their caps are the wrapped domain's with max_write_batch 0, and the engine posts a wrapped
// local domain's pages one WRITE at a time.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "domain/domain.h"

namespace fabric {

class ForwardingDomain : public Domain {
 public:
  explicit ForwardingDomain(std::unique_ptr<Domain> inner)
      : inner_(std::move(inner)), caps_(inner_->caps()) {
    caps_.max_write_batch = 0;
  }

  // The wrapped domain (injected_faults, fault_domain.h, looks through the wrappers with it).
  const Domain& inner() const { return *inner_; }

  const std::string& provider_name() const override { return inner_->provider_name(); }
  const std::string& address() const override { return inner_->address(); }
  const DomainCaps& caps() const override { return caps_; }
  DomainRegion register_memory(void* ptr, size_t len, Device device) override {
    return inner_->register_memory(ptr, len, device);
  }
  void deregister_memory(DomainRegion& region) override { inner_->deregister_memory(region); }
  PeerId insert_peer(const std::string& address) override { return inner_->insert_peer(address); }
  void remove_peer(PeerId peer) override { inner_->remove_peer(peer); }
  PostResult post_write(const WriteOp& op, OpContext* ctx) override { return inner_->post_write(op, ctx); }
  PostResult post_write_batch(std::span<const WriteOp>, OpContext*) override {  // caps_: never called
    batch_error_ = "a test wrapper takes no write batches (its caps().max_write_batch is 0)";
    return PostResult::kFailed;
  }
  PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc, OpContext* ctx) override {
    return inner_->post_send(peer, buf, len, desc, ctx);
  }
  PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) override {
    return inner_->post_recv(buf, len, desc, ctx);
  }
  const std::string& last_error() const override {
    return batch_error_.empty() ? inner_->last_error() : batch_error_;
  }
  size_t poll(std::span<Completion> out) override { return inner_->poll(out); }
  void* scratch_desc() const override { return inner_->scratch_desc(); }
  void* scratch_buffer() const override { return inner_->scratch_buffer(); }

 protected:
  std::unique_ptr<Domain> inner_;

 private:
  DomainCaps caps_;
  std::string batch_error_;
};

}  // namespace fabric
