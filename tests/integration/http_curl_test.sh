#!/usr/bin/env bash
# Runs the curl examples of docs/service.md (the sh block after <!-- curl-examples -->)
# against a fresh attention_server, its port in place of 8000, and checks each answer.
# Usage: http_curl_test.sh SERVER_BINARY SOURCE_DIR
set -euo pipefail
server="$1"
docs="$2/docs/service.md"
work=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT

"$server" --port=0 --metrics_port=-1 --http_port=0 > "$work/server.out" 2> "$work/server.err" &
pid=$!
for _ in $(seq 100); do
  grep -q '^listening on' "$work/server.out" && break
  sleep 0.1
done
port=$(sed -n 's/^http on .*:\([0-9]*\)$/\1/p' "$work/server.out")
[[ -n "$port" ]] || { echo "no 'http on' line"; cat "$work/server.err"; exit 1; }

awk '/<!-- curl-examples -->/ { on = 1; next } on && /^```sh/ { inside = 1; next }
     inside && /^```/ { exit } inside { print }' "$docs" |
  sed "s/localhost:8000/127.0.0.1:$port/g" > "$work/examples.sh"
[[ -s "$work/examples.sh" ]] || { echo "no curl examples found in $docs"; exit 1; }
(cd "$work" && bash -euo pipefail examples.sh) > "$work/out.txt"
cat "$work/out.txt"

fail=0
expect() {
  if ! grep -qE -- "$1" "$work/out.txt"; then
    echo "FAIL: expected /$1/ in the output: $2"
    fail=1
  fi
}
expect '^\{\} 200$' "health/ready answers 200"
expect '"name":"mha-serve"' "server metadata"
expect '"name":"default".*"platform":"mha_attention"|"platform":"mha_attention".*' "model metadata"
expect '"id":"r1".*"name":"output".*"shape":\[1,2,100\]' "JSON infer answers the output"
expect '^[Ii]nference-[Hh]eader-[Cc]ontent-[Ll]ength: [0-9]+' "binary infer answers a binary output"
expect '"error":"inputs\[0\] \(\\"queries\\"\)[^"]*".* 400$|needs 99 values.* 400$' "a bad shape is 400"
expect 'unknown model.* 404$' "an unknown model is 404"
expect '^\[\{"name":"default","state":"READY","version":"1"\}\] 200$' "the repository index"
expect 'model_control=explicit.* 403$' "load without explicit model control is 403"
header=$(grep -i '^inference-header-content-length' "$work/out.txt" | tr -dc '0-9')
size=$(stat -c %s "$work/response.bin")
if ((size != header + 800)); then
  echo "FAIL: response.bin holds $size bytes, expected the $header-byte JSON + 800"
  fail=1
fi
kill -TERM "$pid"
wait "$pid" || { echo "server did not stop cleanly"; fail=1; }
exit $fail
