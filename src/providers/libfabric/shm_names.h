// Names of the shm provider's endpoints: one per endpoint, never reused, carrying the pid.
#pragma once

#include <string>

namespace fabric::shm_names {

// libfabric 1.17 names shm endpoints "<pid>:<uid>:<index>" and refuses (-FI_EBUSY) to create one
// whose file exists while a process of the file's pid lives. A process killed with endpoints open
// leaves its files; when its pid is later reused by a fabric-lib process, that process's own
// endpoint names match the leftovers and the owner it sees alive is itself. Our names add a
// random tag per process, so no leftover can match them.
// "fi_shm://fabric-<pid namespace>.<pid>-<tag>-<n>", with "-k<fd>" where the endpoint has a key
// board (shm_key_board.h) at descriptor `board_fd`.
std::string next_endpoint_name(int board_fd = -1);

// The /dev/shm file-name prefix of every endpoint `pid` (of this process's PID namespace)
// created: "fabric-<pid namespace inode>.<pid>-".
std::string file_prefix(int pid);

// The /dev/shm file of an endpoint address ("fi_shm://name" -> "name", trailing NULs dropped).
std::string file_name(const std::string& address);

// The pid in an endpoint name (or address) of ours from this PID namespace; 0 for any other name.
int pid_of(const std::string& name);

// The key board's descriptor number in an endpoint name (or address); -1 when it names none.
int board_fd_of(const std::string& name);

}  // namespace fabric::shm_names
