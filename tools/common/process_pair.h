// Runs two roles in two processes joined by a socket pair (the out-of-band channel on which they
// exchange addresses and descriptors). Used by the demo, the benchmarks and the integration tests.
#pragma once

#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fabric/shm_cleanup.h"

namespace fabric::tools {

// waitpid, then removes what a killed child's shm endpoints left in /dev/shm. Returns the status.
inline int reap(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  remove_shm_endpoints_of(static_cast<int>(pid));
  return status;
}

// Length-prefixed messages over a stream socket.
class Channel {
 public:
  explicit Channel(int fd) : fd_(fd) {}
  void send(const std::string& message) const {
    uint64_t n = message.size();
    write_all(&n, sizeof n);
    write_all(message.data(), message.size());
  }
  void send(const std::vector<uint8_t>& bytes) const { send(std::string(bytes.begin(), bytes.end())); }
  std::string recv() const {
    uint64_t n = 0;
    read_all(&n, sizeof n);
    std::string s(n, '\0');
    read_all(s.data(), n);
    return s;
  }
  std::vector<uint8_t> recv_bytes() const {
    std::string s = recv();
    return {s.begin(), s.end()};
  }
  int fd() const { return fd_; }
  // True when a message (or the peer's close) is waiting: for loops that must keep polling a
  // provider while they wait on the channel.
  bool readable() const {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }

 private:
  void write_all(const void* p, size_t n) const {
    auto* b = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t w = ::write(fd_, b, n);
      if (w <= 0) throw std::runtime_error("out-of-band channel: peer closed");
      b += w;
      n -= static_cast<size_t>(w);
    }
  }
  void read_all(void* p, size_t n) const {
    auto* b = static_cast<char*>(p);
    while (n > 0) {
      ssize_t r = ::read(fd_, b, n);
      if (r <= 0) throw std::runtime_error("out-of-band channel: peer closed");
      b += r;
      n -= static_cast<size_t>(r);
    }
  }
  int fd_;
};

struct PairResult {
  int parent_rc = 0;
  int child_status = 0;  // as from waitpid
  bool ok() const { return parent_rc == 0 && WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0; }
};

// A child process joined to this one by a socket pair: `ch` is this side's end. The child runs
// `role` and exits with its return value (killed if the parent dies). Call before creating any
// engine or thread in this process.
struct ChildProcess {
  pid_t pid = -1;
  Channel ch{-1};
};

inline ChildProcess spawn_child(const std::function<int(Channel&)>& role) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) throw std::runtime_error("socketpair failed");
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(sv[0]);
    Channel ch(sv[1]);
    int rc = 1;
    try {
      rc = role(ch);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    std::fflush(nullptr);
    _exit(rc);
  }
  close(sv[1]);
  return ChildProcess{pid, Channel(sv[0])};
}

// Forks; the child runs `child` and exits with its return value (killed if the parent dies).
// Call before creating any engine or thread in this process.
inline PairResult run_process_pair(const std::function<int(Channel&)>& parent,
                                   const std::function<int(Channel&)>& child) {
  ChildProcess c = spawn_child(child);
  PairResult r;
  try {
    r.parent_rc = parent(c.ch);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parent: %s\n", e.what());
    r.parent_rc = 1;
  }
  close(c.ch.fd());
  r.child_status = reap(c.pid);
  return r;
}

}  // namespace fabric::tools
