// The control side of the domain group: opening the domains, putting peers and regions into every
// one of them. The posting side is inline in the header (it runs for every WRITE).
#include "worker/domain_group.h"

#include "providers/open_domain.h"
#include "util/log.h"

namespace fabric {

void DomainGroup::open(const EngineConfig& config) {
  if (config.nics.empty() || config.nics.size() > kMaxNics)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("an engine needs 1 to {} NICs, the configuration has {}", kMaxNics,
                            config.nics.size()));
  for (size_t i = 0; i < config.nics.size(); i++) {
    domains_.push_back(open_domain(config, i));
    nic_addresses_.push_back(domains_.back()->address());
  }
  nic_count_ = nic_addresses_.size();
  provider_ = domains_[0]->provider_name();
  if (config.cuda_ipc || config.host_ipc) {
    domains_.push_back(open_local_domain(config));
    local_address_ = domains_.back()->address();
  }
  for (size_t d = 0; d < domains_.size(); d++) max_in_flight_[d] = domains_[d]->caps().max_in_flight;
  completions_.resize(config.cq_batch);
}

std::pair<uint64_t, uint64_t> DomainGroup::injected_faults(size_t d) const {
  InjectedFaults f = fabric::injected_faults(*domains_[d]);
  return {f.total, f.duplicated_imms};
}

void DomainGroup::book_refusal(size_t d, PeerId peer, PostResult result) {
  switch (result) {
    case PostResult::kRetry:
      // Retrying at once would only take the provider's locks again (shm shares one with the
      // peer): skip this domain until it completes something or a few polls have passed.
      backoff_[d] = kRetryBackoffPolls;
      stats_[d].retries.add();
      break;
    case PostResult::kRetryPeer:  // only this peer: the domain keeps serving the others
      peer_backoff_.push_back({static_cast<uint32_t>(d), peer, kRetryBackoffPolls});
      stats_[d].peer_retries.add();
      break;
    case PostResult::kFailed:
      stats_[d].errors.add();
      break;
    case PostResult::kPosted:
      break;
  }
}

ResolvedTarget DomainGroup::insert_peer(const NetAddr& peer) {
  ResolvedTarget t;
  size_t inserted = 0;
  try {
    for (; inserted < nic_count_; inserted++)
      t.peer[inserted] = domains_[inserted]->insert_peer(peer.nic(inserted));
  } catch (...) {
    while (inserted-- > 0) domains_[inserted]->remove_peer(t.peer[inserted]);
    throw;
  }
  if (has_local() && !peer.local().empty() &&
      local_scope(peer.local()) == local_scope(local_address_)) {
    try {
      t.peer[local_index()] = domains_[local_index()]->insert_peer(peer.local());
      t.local = true;
    } catch (const Error& e) {  // e.g. another container's endpoint: the NICs still reach it
      log::info("the local domain cannot reach a same-host peer, using the NICs: {}", e.what());
    }
  }
  return t;
}

void DomainGroup::remove_peer(const ResolvedTarget& route) {
  for (size_t i = 0; i < nic_count_; i++) domains_[i]->remove_peer(route.peer[i]);
  if (route.local) domains_[local_index()]->remove_peer(route.peer[local_index()]);
  std::erase_if(peer_backoff_, [&](const PeerBackoff& b) {
    return b.peer == route.peer[b.domain] && (b.domain < nic_count_ || route.local);
  });
}

void DomainGroup::register_region(void* ptr, size_t len, Device device, Part part, Registration& r) {
  auto in_part = [&](size_t d) { return registers_beside_worker(d) == (part == Part::kBesideWorker); };
  size_t done = 0;
  try {
    for (; done < domain_count(); done++) {
      if (!in_part(done)) continue;
      try {
        r.regions[done] = domains_[done]->register_memory(ptr, len, device);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kUnsupported || done >= nic_count_ || !has_local()) throw;
        r.nic_refusal = e.what();
        r.regions[done] = {};
      }
    }
  } catch (...) {
    while (done-- > 0)
      if (in_part(done)) domains_[done]->deregister_memory(r.regions[done]);
    throw;
  }
  r.on_nics = r.nic_refusal.empty();
}

void DomainGroup::deregister_region(std::array<DomainRegion, kMaxDomains>& regions, Part part) {
  for (size_t d = 0; d < domains_.size(); d++)
    if (registers_beside_worker(d) == (part == Part::kBesideWorker)) domains_[d]->deregister_memory(regions[d]);
}

void DomainGroup::deregister_region(std::array<DomainRegion, kMaxDomains>& regions) {
  for (size_t d = 0; d < domains_.size(); d++) domains_[d]->deregister_memory(regions[d]);
}

}  // namespace fabric
