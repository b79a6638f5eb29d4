// How many CPUs, and how much memory, this process may use.
#ifndef MHA_SERVER_APP_CPU_H_
#define MHA_SERVER_APP_CPU_H_

#include <cstdint>

namespace mha::server {

// min(CPUs in the affinity mask (sched_getaffinity), ceil(cgroup CPU quota)),
// at least 1. The quota is read from cgroup v2 cpu.max, else cgroup v1
// cpu.cfs_quota_us / cpu.cfs_period_us; no quota means no limit.
int AvailableCpus();

// The memory this process may use, in bytes: min(physical RAM, the cgroup limit:
// v2 memory.max, else v1 memory.limit_in_bytes); no limit means RAM.
int64_t AvailableMemoryBytes();

}  // namespace mha::server

#endif  // MHA_SERVER_APP_CPU_H_
