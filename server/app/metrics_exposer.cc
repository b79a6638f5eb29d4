#include "server/app/metrics_exposer.h"

#include <CivetServer.h>
#include <dirent.h>
#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <sys/resource.h>
#include <unistd.h>

#include <exception>
#include <fstream>
#include <string>
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
  exposer->registry_ = std::move(registry);
  exposer->process_ = std::make_shared<ProcessCollector>();
  exposer->exposer_->RegisterCollectable(exposer->registry_);
  exposer->exposer_->RegisterCollectable(exposer->process_);
  return exposer;
}

MetricsExposer::~MetricsExposer() = default;

}  // namespace mha::server
