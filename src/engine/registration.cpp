// Registration of memory regions: reg_mr (one) and reg_mrs (many, all or none) share
// EngineImpl::register_all, which checks every region, prefaults those that ask, pins what the
// domains pin on the caller's thread, then registers and publishes each worker's regions in one
// worker call. Also the registration counters of metrics_text.
#include <optional>

#include "engine/engine_impl.h"
#include "engine/mapped_range.h"
#include "engine/prefault.h"
#include "util/log.h"

namespace fabric {

namespace {

// `e`'s message without the "<code>: " that Error puts before it.
std::string message_of(const Error& e) {
  std::string_view m = e.what();
  const std::string_view code = to_string(e.code());
  if (m.starts_with(code) && m.substr(code.size()).starts_with(": ")) m.remove_prefix(code.size() + 2);
  return std::string(m);
}

// A region registered on its worker's domains and given a slot, not yet visible to submitters.
struct Taken {
  size_t entry = 0;
  uint32_t slot = 0;
  uint32_t generation = 0;  // odd: what the slot turns to when published
};

}  // namespace

void RegistrationStats::registered(size_t regions, uint64_t bytes, std::chrono::nanoseconds elapsed) {
  regions_.fetch_add(regions, std::memory_order_relaxed);
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
  seconds_.observe(elapsed);
}

void RegistrationStats::write(MetricsWriter& w) const {
  w.counter("fabric_registrations_total", "Regions registered (reg_mr, reg_mrs), deregistered or not",
            regions_.load(std::memory_order_relaxed));
  w.counter("fabric_registered_bytes_total", "Bytes of the regions in fabric_registrations_total",
            bytes_.load(std::memory_order_relaxed));
  w.counter("fabric_registration_failures_total",
            "Registration calls that failed and registered nothing", failed_.load(std::memory_order_relaxed));
  seconds_.write(w, "fabric_registration_seconds",
                 "Duration of a successful registration call (reg_mr: one region, reg_mrs: all of its "
                 "regions): checks, prefault and every NIC's registration");
}

std::pair<MrHandle, MrDesc> EngineImpl::reg_mr(void* ptr, size_t len, Device device, ImmRange imms) {
  const RegionEntry entry{ptr, len, device, imms, false};
  return std::move(register_all(std::span(&entry, 1), "reg_mr").front());
}

std::vector<std::pair<MrHandle, MrDesc>> EngineImpl::register_all(std::span<const RegionEntry> entries,
                                                                  const char* what) {
  check_open();
  const auto started = std::chrono::steady_clock::now();
  const bool many = std::string_view(what) != "reg_mr";
  // Errors of a batch name the entry, and say that nothing of the batch stays registered.
  // The checks below are reg_mr's, and their messages say so: a batch names itself instead.
  auto entry_error = [&](size_t i, const Error& e) {
    if (!many) return e;
    std::string m = message_of(e);
    if (m.starts_with("reg_mr: ")) m.erase(0, 8);
    return Error(e.code(), fmt::format("{}: region {} of {}: {}; nothing was registered", what, i,
                                       entries.size(), m));
  };
  std::vector<uint32_t> worker_of_entry(entries.size());
  std::vector<Device> devices(entries.size());
  uint64_t bytes = 0;
  for (size_t i = 0; i < entries.size(); i++) {
    const RegionEntry& e = entries[i];
    try {
      e.imms.validate("reg_mr");
      if (!e.ptr || e.len == 0)
        throw Error(ErrorCode::kInvalidArgument, "reg_mr: pointer must be non-null and length > 0");
      worker_of_entry[i] = worker_index(e.device, "reg_mr");
      check_mapped(e.ptr, e.len, e.device);  // a peer's WRITE must never land past the real end
    } catch (const Error& err) {
      registrations_.failed();
      throw entry_error(i, err);
    }
    // The providers see host memory as host memory, whichever worker serves it.
    devices[i] = e.device.kind == Device::Kind::kHost ? Device::host() : e.device;
    bytes += e.len;
  }
  std::vector<HostRange> prefault;
  for (size_t i = 0; i < entries.size(); i++)
    if (entries[i].prefault && devices[i].kind == Device::Kind::kHost)
      prefault.push_back({entries[i].ptr, entries[i].len, i});
  if (auto failed = prefault_host(prefault, "reg_mr")) {  // entry_error names the batch
    registrations_.failed();
    throw entry_error(failed->first, failed->second);
  }

  using Part = DomainGroup::Part;
  std::vector<DomainGroup::Registration> regs(entries.size());
  std::vector<std::pair<MrHandle, MrDesc>> results;
  // The domains that allow it (verbs) pin each region on this thread, before anything else: tens
  // of GB take seconds, and the worker keeps posting meanwhile. Undone in reverse on failure.
  size_t pinned = 0;
  std::vector<std::vector<Taken>> published(workers_.size());  // per worker, for the undo
  auto undo = [&] {
    for (size_t w = 0; w < workers_.size(); w++) {
      if (published[w].empty()) continue;
      Worker& worker = *workers_[w];
      // No handle of these was returned, so nothing reads them: stale, forgotten, free.
      worker.call([&] {
        for (const Taken& t : published[w]) {
          RegionSlot& slot = mrs_.slot(t.slot);
          slot.generation.store(t.generation + 1, std::memory_order_release);
          worker.deregister_region(slot.per_nic, Part::kOnWorker);
          slot.per_nic = {};
          mrs_.return_slot(t.slot);
        }
      });
    }
    while (pinned > 0) {
      pinned--;
      workers_[worker_of_entry[pinned]]->deregister_region(regs[pinned].regions, Part::kBesideWorker);
    }
  };
  try {
    for (; pinned < entries.size(); pinned++) try {
        workers_[worker_of_entry[pinned]]->register_region(entries[pinned].ptr, entries[pinned].len,
                                                           devices[pinned], Part::kBesideWorker, regs[pinned]);
      } catch (const Error& err) {
        throw entry_error(pinned, err);
      }
    std::lock_guard lock(control_mu_);
    std::vector<std::optional<std::pair<MrHandle, MrDesc>>> done(entries.size());
    // One call per worker: take a slot and register on every domain for each of its regions;
    // publish them only once all succeeded, so a failure undoes what no submitter has seen.
    for (size_t w = 0; w < workers_.size(); w++) {
      Worker& worker = *workers_[w];
      std::vector<size_t> mine;
      for (size_t i = 0; i < entries.size(); i++)
        if (worker_of_entry[i] == w) mine.push_back(i);
      if (mine.empty()) continue;
      published[w] = worker.call([&] {
        std::vector<Taken> taken;
        size_t current = 0;
        try {
          for (size_t i : mine) {
            current = i;
            const RegionEntry& e = entries[i];
            auto s = mrs_.take_free_slot();
            if (!s)
              throw Error(ErrorCode::kResourceExhausted,
                          fmt::format("reg_mr: all {} region slots are in use; deregister regions or "
                                      "raise EngineConfig::max_regions",
                                      mrs_.capacity()));
            RegionSlot& slot = mrs_.slot(*s);
            taken.push_back({i, *s, slot.generation.load(std::memory_order_relaxed) + 1});
            // Every domain registers the region; GPU memory the NICs cannot reach is writable by
            // same-host peers only (DomainGroup::register_region).
            worker.register_region(e.ptr, e.len, devices[i], Part::kOnWorker, regs[i]);
            std::vector<RemoteKey> keys;
            if (regs[i].on_nics)
              for (size_t n = 0; n < nic_count_; n++) keys.push_back(regs[i].regions[n].remote);
            std::optional<RemoteKey> local_key;
            if (worker.domains().has_local() && regs[i].regions[nic_count_].remote_access)
              local_key = regs[i].regions[nic_count_].remote;
            done[i].emplace(MrHandle{*s, taken.back().generation, engine_id_},
                            MrDesc(address_, reinterpret_cast<uint64_t>(e.ptr), e.len, keys, local_key,
                                   static_cast<uint32_t>(w), e.imms));
          }
        } catch (const Error& err) {
          for (const Taken& t : taken) {
            worker.deregister_region(regs[t.entry].regions, Part::kOnWorker);
            mrs_.return_slot(t.slot);
          }
          throw entry_error(current, err);
        } catch (...) {
          for (const Taken& t : taken) {
            worker.deregister_region(regs[t.entry].regions, Part::kOnWorker);
            mrs_.return_slot(t.slot);
          }
          throw;
        }
        for (const Taken& t : taken) {
          const RegionEntry& e = entries[t.entry];
          if (!regs[t.entry].on_nics)
            log::info("{}: {}; the region is reachable through cuda_ipc only", what,
                      regs[t.entry].nic_refusal);
          RegionSlot& slot = mrs_.slot(t.slot);
          slot.per_nic = regs[t.entry].regions;
          slot.ptr = static_cast<uint8_t*>(e.ptr);
          slot.device = devices[t.entry];
          // Release: a submitting thread that reads these also sees the slot's last
          // deregistration (MrTable::view checks the generation again after reading them).
          slot.len.store(e.len, std::memory_order_release);
          slot.on_nics.store(regs[t.entry].on_nics, std::memory_order_release);
          slot.worker.store(static_cast<uint32_t>(w), std::memory_order_release);
          slot.generation.store(t.generation, std::memory_order_release);
        }
        return taken;
      });
    }
    results.reserve(entries.size());
    for (auto& d : done) results.push_back(std::move(*d));
  } catch (...) {
    registrations_.failed();
    undo();
    throw;
  }
  registrations_.registered(entries.size(), bytes, std::chrono::steady_clock::now() - started);
  return results;
}

std::vector<std::pair<MrHandle, MrDesc>> TransferEngine::reg_mrs(std::span<const MrRequest> regions) {
  std::vector<RegionEntry> entries;
  entries.reserve(regions.size());
  for (size_t i = 0; i < regions.size(); i++) {
    const MrRequest& r = regions[i];
    ImmRange imms{};
    if (r.imms) {
      if (!r.imms->held())
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("reg_mrs: region {} of {}: the immediate reservation is not held; "
                                "nothing was registered",
                                i, regions.size()));
      imms = r.imms->range();
    }
    entries.push_back({r.ptr, r.len, r.device, imms, r.prefault});
  }
  if (entries.empty()) return {};
  return impl_->register_all(entries, "reg_mrs");
}

}  // namespace fabric
