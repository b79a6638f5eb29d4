#include "server/app/metrics_exposer.h"

#include <CivetServer.h>
#include <dirent.h>
#include <netdb.h>
#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/log.h"

namespace mha::server {
namespace {

// process_* in the names the Prometheus client libraries use, read from /proc
// at each scrape.
class ProcessCollector final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families;
    auto add = [&families](const char* name, const char* help, prometheus::MetricType type,
                           double value) {
      prometheus::ClientMetric metric;
      if (type == prometheus::MetricType::Counter) {
        metric.counter.value = value;
      } else {
        metric.gauge.value = value;
      }
      families.push_back({name, help, type, {metric}});
    };
    const long page = sysconf(_SC_PAGESIZE);
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    // /proc/self/stat: "pid (comm) state ..."; comm may hold spaces, so split
    // after the last ')'. Fields from there: [0] state, [11] utime, [12] stime,
    // [17] num_threads, [19] starttime, [20] vsize, [21] rss (pages).
    std::ifstream stat_file("/proc/self/stat");
    std::string stat((std::istreambuf_iterator<char>(stat_file)), {});
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size()) {
      std::vector<std::string> f = absl::StrSplit(stat.substr(paren + 2), ' ', absl::SkipEmpty());
      if (f.size() > 21) {
        add("process_cpu_seconds_total", "User and system CPU time spent in seconds.",
            prometheus::MetricType::Counter, (std::stod(f[11]) + std::stod(f[12])) / ticks);
        add("process_threads", "Number of OS threads in the process.",
            prometheus::MetricType::Gauge, std::stod(f[17]));
        add("process_virtual_memory_bytes", "Virtual memory size in bytes.",
            prometheus::MetricType::Gauge, std::stod(f[20]));
        add("process_resident_memory_bytes", "Resident memory size in bytes.",
            prometheus::MetricType::Gauge, std::stod(f[21]) * static_cast<double>(page));
        if (const double boot = BootTime(); boot > 0) {
          add("process_start_time_seconds",
              "Start time of the process since unix epoch in seconds.",
              prometheus::MetricType::Gauge, boot + std::stod(f[19]) / ticks);
        }
      }
    }
    add("process_open_fds", "Number of open file descriptors.", prometheus::MetricType::Gauge,
        static_cast<double>(OpenFds()));
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
      add("process_max_fds", "Maximum number of open file descriptors.",
          prometheus::MetricType::Gauge, static_cast<double>(limit.rlim_cur));
    }
    return families;
  }

 private:
  static double BootTime() {
    std::ifstream file("/proc/stat");
    std::string line;
    while (std::getline(file, line)) {
      if (line.rfind("btime ", 0) == 0) return std::stod(line.substr(6));
    }
    return 0;
  }

  static int OpenFds() {
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return 0;
    int count = 0;
    while (const dirent* entry = readdir(dir)) {
      if (entry->d_name[0] != '.') ++count;
    }
    closedir(dir);
    return count - 1;  // the directory stream's own descriptor
  }
};

// civetweb's own messages (the only ones prometheus-cpp lets through: its
// CivetCallbacks) go to the server's log, shown with --log_verbose >= 1.
int CivetwebLog(const mg_connection* /*connection*/, const char* message) {
  log::Verbose(1, "civetweb", message);
  return 1;  // handled: civetweb prints nothing itself
}

const CivetCallbacks& Callbacks() {
  static const CivetCallbacks* const callbacks = [] {
    auto* c = new CivetCallbacks();
    c->log_message = &CivetwebLog;
    return c;
  }();
  return *callbacks;
}

// The host a local connection reaches the exposer on: the address's host ("[::1]:9090"
// -> "::1"), loopback for a wildcard.
std::string WakeHost(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// Opens a TCP connection to the first of `addresses` that takes one, and closes it.
void Knock(const addrinfo* addresses) {
  for (const addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (connected) return;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsExposer>> MetricsExposer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  std::unique_ptr<MetricsExposer> exposer(new MetricsExposer());
  try {
    exposer->exposer_ =
        std::make_unique<prometheus::Exposer>(address, /*num_threads=*/1, &Callbacks());
  } catch (const std::exception&) {
    // civetweb's own words ("null context when constructing CivetServer") say nothing.
    return absl::UnavailableError(absl::StrCat("metrics_port: cannot listen on ", address,
                                               " (address in use, or a bad host)"));
  }
  const std::vector<int> ports = exposer->exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(absl::StrCat("metrics_port: cannot listen on ", address));
  }
  exposer->port_ = ports.front();
  exposer->wake_host_ = WakeHost(address);
  exposer->registry_ = std::move(registry);
  exposer->process_ = std::make_shared<ProcessCollector>();
  exposer->exposer_->RegisterCollectable(exposer->registry_);
  exposer->exposer_->RegisterCollectable(exposer->process_);
  return exposer;
}

MetricsExposer::~MetricsExposer() {
  if (exposer_ == nullptr) return;
  // civetweb 1.15 (Debian 12) notices its stop flag only when its accept loop's poll()
  // returns, which with no connection takes up to its 2 s period: a stopping server
  // would wait that long. A connection wakes it, so one is made every few milliseconds
  // until the exposer is gone (docs/service.md, after the ports).
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (getaddrinfo(wake_host_.c_str(), std::to_string(port_).c_str(), &hints, &addresses) != 0) {
    addresses = nullptr;
  }
  std::atomic<bool> stopped = false;
  std::thread waker([addresses, &stopped] {
    while (!stopped.load(std::memory_order_acquire)) {
      Knock(addresses);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  exposer_.reset();
  stopped.store(true, std::memory_order_release);
  waker.join();
  if (addresses != nullptr) freeaddrinfo(addresses);
}

}  // namespace mha::server
