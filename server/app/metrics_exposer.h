// The /metrics endpoint of the attention_server binary: prometheus-cpp's civetweb
// exposer serving the serving layer's registry (server/serving/metrics.h) and the
// process_* figures (resident/virtual memory, CPU seconds, threads, open fds, start
// time; read from /proc at each scrape).
#ifndef MHA_SERVER_APP_METRICS_EXPOSER_H_
#define MHA_SERVER_APP_METRICS_EXPOSER_H_

#include <prometheus/registry.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace prometheus {
class Collectable;
class Exposer;
}  // namespace prometheus

namespace mha::server {

// The /metrics HTTP endpoint (prometheus-cpp's civetweb exposer) serving a
// registry and the process_* figures.
class MetricsExposer {
 public:
  // `address` is "host:port" ("[::1]:port" for IPv6); port 0 picks a free port.
  // UNAVAILABLE naming the address if it cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsExposer>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry);
  ~MetricsExposer();

  int port() const { return port_; }

 private:
  MetricsExposer() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> process_;
  int port_ = 0;
  std::string wake_host_;  // where the destructor connects to stop civetweb at once
};

}  // namespace mha::server

#endif  // MHA_SERVER_APP_METRICS_EXPOSER_H_
