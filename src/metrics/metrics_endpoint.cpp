// MetricsEndpoint (metrics_endpoint.h): plain POSIX sockets and poll(); an eventfd wakes the
// thread to stop.
#include "metrics/metrics_endpoint.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "fabric/error.h"
#include "util/log.h"

namespace fabric {

namespace {

constexpr size_t kMaxRequest = 8192;  // a request line and headers; a longer one is refused
constexpr int kClientTimeoutMs = 2000;

void send_all(int fd, const std::string& data, int wake_fd) {
  size_t sent = 0;
  while (sent < data.size()) {
    ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return;
    pollfd p[2] = {{fd, POLLOUT, 0}, {wake_fd, POLLIN, 0}};
    if (::poll(p, 2, kClientTimeoutMs) <= 0 || p[1].revents) return;  // slow client, or stopping
  }
}

std::string response(int code, std::string_view reason, std::string_view type, const std::string& body) {
  return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                     code, reason, type, body.size(), body);
}

}  // namespace

MetricsEndpoint::MetricsEndpoint(const std::string& address, uint16_t port,
                                 std::function<std::string()> render)
    : render_(std::move(render)) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  if (::inet_pton(AF_INET, address.c_str(), &sa.sin_addr) != 1)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("EngineConfig::metrics_address '{}' is not an IPv4 address", address));
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0)
    throw Error(ErrorCode::kResourceExhausted, fmt::format("metrics endpoint: socket: {}", std::strerror(errno)));
  int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(listen_fd_, 16) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("cannot serve metrics on {}:{}: {} (EngineConfig::metrics_port, "
                            "metrics_address: pick a free port, or 0 for no endpoint)",
                            address, port, std::strerror(err)));
  }
  socklen_t len = sizeof sa;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len);
  port_ = ntohs(sa.sin_port);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    ::close(listen_fd_);
    throw Error(ErrorCode::kResourceExhausted, fmt::format("metrics endpoint: eventfd: {}", std::strerror(errno)));
  }
  thread_ = std::thread([this] { run(); });
  log::info("metrics: serving GET /metrics on {}:{}", address, port_);
}

MetricsEndpoint::~MetricsEndpoint() {
  uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof one) < 0) log::warn("metrics endpoint: cannot wake its thread");
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

void MetricsEndpoint::run() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      log::error("metrics endpoint: poll: {}; it stops serving", std::strerror(errno));
      return;
    }
    if (p[1].revents) return;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;  // gone before we took it, or out of descriptors: try again later
    serve(fd);
    ::close(fd);
  }
}

// Reads the request head (until the blank line, kMaxRequest bytes, or kClientTimeoutMs), answers
// one response and closes.
void MetricsEndpoint::serve(int fd) {
  std::string req;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kClientTimeoutMs);
  while (req.find("\r\n\r\n") == std::string::npos && req.find("\n\n") == std::string::npos) {
    if (req.size() >= kMaxRequest) {
      send_all(fd, response(431, "Request Header Fields Too Large", "text/plain", "request too long\n"), wake_fd_);
      return;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    pollfd p[2] = {{fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(p, 2, static_cast<int>(left.count())) <= 0 || p[1].revents) return;
    char buf[1024];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) return;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return;
    }
    req.append(buf, static_cast<size_t>(n));
  }
  // "GET /metrics HTTP/1.1" (a query string is ignored, as Prometheus' own exporters do).
  const size_t line_end = req.find_first_of("\r\n");
  const std::string line = req.substr(0, line_end);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos) {
    send_all(fd, response(400, "Bad Request", "text/plain", "bad request line\n"), wake_fd_);
    return;
  }
  const std::string method = line.substr(0, sp1);
  std::string path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  if (path != "/metrics") {
    send_all(fd, response(404, "Not Found", "text/plain", "only /metrics is served here\n"), wake_fd_);
    return;
  }
  if (method != "GET" && method != "HEAD") {
    send_all(fd, response(405, "Method Not Allowed", "text/plain", "GET /metrics\n"), wake_fd_);
    return;
  }
  std::string body;
  try {
    body = render_();
  } catch (const std::exception& e) {
    send_all(fd, response(500, "Internal Server Error", "text/plain", std::string(e.what()) + "\n"), wake_fd_);
    return;
  }
  std::string out = response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", body);
  if (method == "HEAD") out.resize(out.size() - body.size());
  send_all(fd, out, wake_fd_);
}

}  // namespace fabric
