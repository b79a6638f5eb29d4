#!/bin/sh
# Fails when a file of the serving layer (server/serving/, or the folder given)
# includes a transport or generated protobuf: grpcpp/, grpc/, google/protobuf/,
# httplib.h, civetweb or any .pb.h. The layer must build without them
# (server/serving/CMakeLists.txt). Prints each offending line.
set -eu
dir=${1:-$(dirname "$0")/../server/serving}
pattern='^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]([^>"]*/)?(grpcpp/|grpc/|google/protobuf/|httplib\.h|civetweb|[^>"]*\.pb\.h)'
if found=$(grep -rnE "$pattern" "$dir" --include='*.h' --include='*.cc'); then
  echo "$found"
  echo "FAIL: the serving layer ($dir) includes a transport or generated protobuf (above)"
  exit 1
fi
echo "OK: no transport or generated protobuf included under $dir"
