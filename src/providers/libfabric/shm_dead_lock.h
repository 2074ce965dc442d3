// Frees a shm region's lock that its owner held when it was killed, so that senders spinning on it
// (our worker among them) go on. libfabric 1.17's shm takes a peer's region lock (a process-shared
// spinlock inside the peer's /dev/shm file) to post to it, and the peer holds it while it works
// through what arrived; a peer killed then never lets go, and every later post to it spins for
// ever inside libfabric, where nothing of ours can interrupt it.
#pragma once

#include <string>

namespace fabric {

// `address`: the dead peer's shm endpoint name; `pid`: its process, already gone. Returns true
// when it found the lock held for kHeldFor by the dead owner and released it. Only for the region
// layout it knows (libfabric 1.17, shm region format 4, recognised by its version byte and the
// owner's pid at their places); any other layout, a live owner or a lock that is free at any
// sample is left alone.
bool release_dead_owner_lock(const std::string& address, int pid);

}  // namespace fabric
