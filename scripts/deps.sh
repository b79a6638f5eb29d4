#!/usr/bin/env bash
# Installs the Debian 12 packages mha-serve needs, and only the ones missing.
# Usage: bash scripts/deps.sh          everything: build, tests, benchmarks, deploy checks
#        bash scripts/deps.sh build    only what building the binaries needs (the
#                                      Dockerfile's build stage uses this)
# As root, or with sudo available.
set -euo pipefail

build_packages=(
  # toolchain
  cmake ninja-build g++ pkg-config
  # core; Debian's oneDNN CMake config requires OpenCL (its GPU runtime), which
  # libdnnl-dev only recommends
  libdnnl-dev ocl-icd-opencl-dev libabsl-dev nlohmann-json3-dev
  # proto and server
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc prometheus-cpp-dev
  # the KServe v2 HTTP front (libevent, with OpenSSL for HTTPS) and the client's --protocol=http (cpp-httplib)
  libcpp-httplib-dev libssl-dev libevent-dev
  # client: Cairo draws the attention heat maps (PNG out) with DejaVu for the labels
  libcairo2-dev fonts-dejavu-core
)
test_packages=(
  # tests and benchmarks: GoogleTest, Google Benchmark; openssl makes the TLS test
  # certificates; Python gRPC and PyTorch drive the example client, the export test
  # and the PyTorch comparison (with a real BLAS)
  libgtest-dev libgmock-dev libbenchmark-dev openssl
  # the HTTP front's examples (docs/service.md) are run with curl
  curl
  # the e2e tests: a real Prometheus server (and promtool) scraping ours, and HAProxy
  # (2.6) in front of three servers (tests/e2e/proxy_test.py; haproxy -c on
  # deploy/haproxy). The test runs it in the foreground; its system service is unused.
  prometheus haproxy
  # fuzzing (cmake --preset fuzz): clang with libFuzzer and its sanitizer runtimes,
  # and LLVM's OpenMP runtime for clang's -fopenmp
  clang libclang-rt-14-dev libomp-14-dev
  python3 python3-grpcio python3-grpc-tools python3-numpy python3-torch libopenblas0-pthread
  # the Python package (client/python) installed offline into a venv and its pytest tests
  python3-protobuf python3-setuptools python3-wheel python3-venv python3-pytest
  # deploy checks: yamllint for the manifests (promtool comes with prometheus above),
  # jsonschema for deploy/kserve against KServe's CRD schemas (tests/deploy)
  yamllint python3-yaml python3-jsonschema
)

case "${1:-all}" in
  build) packages=("${build_packages[@]}") ;;
  all) packages=("${build_packages[@]}" "${test_packages[@]}") ;;
  *) echo "usage: $0 [build|all]" >&2; exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "installing: ${missing[*]}"
sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
"${sudo[@]}" apt-get update -q
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
