#!/bin/sh
# Fails when a file of the serving layer (server/serving/, or the folder given)
# includes a transport or generated protobuf: grpcpp/, grpc/, google/protobuf/,
# httplib.h, civetweb or any .pb.h; or a header of another server/ folder (the
# models layer, a front, the app). The layer must build without them
# (server/serving/CMakeLists.txt). Prints each offending line.
set -eu
dir=${1:-$(dirname "$0")/../server/serving}
[ -d "$dir" ] || { echo "FAIL: no folder $dir"; exit 1; }
pattern='^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]([^>"]*/)?(grpcpp/|grpc/|google/protobuf/|httplib\.h|civetweb|[^>"]*\.pb\.h)'
transport=$(grep -rnE "$pattern" "$dir" --include='*.h' --include='*.cc' || true)
# Another layer's header: "server/<folder>/..." other than server/serving/.
layers=$(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"server/' "$dir" \
           --include='*.h' --include='*.cc' |
         grep -vE '#[[:space:]]*include[[:space:]]*"server/serving/' || true)
found=$(printf '%s\n%s' "$transport" "$layers" | sed '/^$/d')
if [ -n "$found" ]; then
  echo "$found"
  echo "FAIL: the serving layer ($dir) includes a transport, generated protobuf or another layer (above)"
  exit 1
fi
echo "OK: no transport, generated protobuf or other layer included under $dir"
