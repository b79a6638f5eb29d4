#include "server/app/cpu.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

namespace mha::server {
namespace {

// Cores granted by a CFS quota: ceil(quota / period), or 0 for "no quota".
int QuotaCpus(double quota, double period) {
  if (quota <= 0 || period <= 0) return 0;
  return std::max(1, static_cast<int>((quota + period - 1) / period));
}

int CgroupCpus() {
  // cgroup v2: "max 100000" or "<quota> <period>".
  if (std::ifstream f("/sys/fs/cgroup/cpu.max"); f) {
    std::string quota;
    double period = 0;
    if (f >> quota >> period && quota != "max")
      return QuotaCpus(std::strtod(quota.c_str(), nullptr), period);
    return 0;
  }
  std::ifstream q("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
  std::ifstream p("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  double quota = 0, period = 0;
  if (q >> quota && p >> period) return QuotaCpus(quota, period);
  return 0;
}

}  // namespace

int64_t AvailableMemoryBytes() {
  int64_t bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    std::string limit;
    if (!(f >> limit)) continue;
    // "max" (v2) or a huge number (v1) when unlimited.
    const int64_t value = std::strtoll(limit.c_str(), nullptr, 10);
    if (limit != "max" && value > 0) bytes = std::min(bytes, value);
    break;
  }
  return bytes;
}

int AvailableCpus() {
  int cpus = 1;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = std::max(1, CPU_COUNT(&set));
  if (int quota = CgroupCpus(); quota > 0) cpus = std::min(cpus, quota);
  return cpus;
}

}  // namespace mha::server
