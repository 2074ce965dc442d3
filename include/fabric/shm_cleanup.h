// Cleaning up after a process that died with shm endpoints open.
#pragma once

#include <cstddef>

namespace fabric {

// The libfabric shm provider backs each endpoint with a file in /dev/shm and unlinks it when the
// endpoint closes. A process killed (SIGKILL, a crash) leaves its files behind. fabric-lib names
// them so that a leftover never blocks a later endpoint (see docs/architecture.md), but they
// still hold memory until someone removes them: a supervisor that reaps a dead worker calls this
// with the worker's pid. It removes only files of fabric-lib endpoints created by that pid in this
// process's PID namespace, and only when no process with that pid exists there (returns 0
// otherwise). Returns how many it removed.
size_t remove_shm_endpoints_of(int pid);

}  // namespace fabric
