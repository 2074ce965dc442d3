#include "providers/libfabric/shm_names.h"

#include <dirent.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "fabric/shm_cleanup.h"

namespace fabric {
namespace shm_names {
namespace {

// Drawn once per process; a forked child draws its own (the cache is keyed by the pid). Called when
// an endpoint opens, never on a hot path.
uint64_t process_tag() {
  static std::mutex mu;
  static int tag_pid = 0;
  static uint64_t tag = 0;
  std::lock_guard lock(mu);
  const int pid = static_cast<int>(getpid());
  if (tag_pid != pid) {
    std::random_device rd;
    tag = rd() | (uint64_t{rd()} << 32);
    tag_pid = pid;
  }
  return tag;
}

}  // namespace

std::string next_endpoint_name(int board_fd) {
  static std::atomic<uint64_t> next{0};
  std::string name = fmt::format("fi_shm://{}{:016x}-{}", file_prefix(static_cast<int>(getpid())),
                                 process_tag(), next.fetch_add(1));
  if (board_fd >= 0) name += fmt::format("-k{}", board_fd);
  return name;
}

// The PID namespace is part of the name: two containers that share /dev/shm but not their PID
// namespaces have processes of equal pids, and removing one's leftovers must not touch the other's.
std::string file_prefix(int pid) {
  struct stat st {};
  const uint64_t pid_ns = stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
  return fmt::format("fabric-{}.{}-", pid_ns, pid);
}

std::string file_name(const std::string& address) {
  std::string name = address.substr(0, address.find('\0'));
  const std::string scheme = "fi_shm://";
  if (name.rfind(scheme, 0) == 0) name.erase(0, scheme.size());
  return name;
}

int pid_of(const std::string& name) {
  const size_t at = name.find("fabric-");
  if (at == std::string::npos) return 0;
  const std::string want = file_prefix(0);  // "fabric-<ns>.0-": this namespace's part
  const size_t ns_end = want.find('.');
  if (name.compare(at, ns_end + 1, want, 0, ns_end + 1) != 0) return 0;  // another namespace
  const char* p = name.c_str() + at + ns_end + 1;
  char* end = nullptr;
  const long pid = std::strtol(p, &end, 10);
  return end != p && *end == '-' && pid > 0 && pid < INT32_MAX ? static_cast<int>(pid) : 0;
}

int board_fd_of(const std::string& name) {
  const std::string n = file_name(name);
  const size_t at = n.rfind("-k");
  if (at == std::string::npos || n.rfind("fabric-", 0) != 0) return -1;
  const char* p = n.c_str() + at + 2;
  char* end = nullptr;
  const long fd = std::strtol(p, &end, 10);
  return end != p && *end == '\0' && fd >= 0 && fd < INT32_MAX ? static_cast<int>(fd) : -1;
}

}  // namespace shm_names

size_t remove_shm_endpoints_of(int pid) {
  if (pid <= 0) return 0;
  if (kill(pid, 0) == 0 || errno != ESRCH) return 0;  // alive (or not ours to judge)
  const std::string prefix = shm_names::file_prefix(pid);
  std::vector<std::string> names;
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir))
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) names.emplace_back(e->d_name);
    closedir(dir);
  }
  size_t removed = 0;
  for (auto& n : names) removed += unlink(("/dev/shm/" + n).c_str()) == 0;
  return removed;
}

}  // namespace fabric
