// MetricsEndpoint: a small HTTP server on one thread answering GET /metrics with the text its
// render function returns (EngineConfig::metrics_port), 404 to other paths, for processes without
// Python. One connection at a time, each with a read deadline, so a slow client delays only the
// next scrape; the engine's workers never wait for it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

namespace fabric {

class MetricsEndpoint {
 public:
  // Binds and listens now (throws kInvalidArgument naming the address when it cannot), then
  // serves on its own thread until destroyed.
  MetricsEndpoint(const std::string& address, uint16_t port, std::function<std::string()> render);
  ~MetricsEndpoint();  // stops accepting, ends the connection being served, joins
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  uint16_t port() const { return port_; }

 private:
  void run();
  void serve(int fd);

  std::function<std::string()> render_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd: written once to stop the thread
  uint16_t port_ = 0;
  std::thread thread_;
};

}  // namespace fabric
