#!/usr/bin/env bash
# The container image, built and run: builds the Dockerfile, starts attention_server
# inside the image with the image's own ENTRYPOINT and CMD (only the ports moved to
# free ones), then checks from inside and outside the container:
#   - the image's config: non-root USER, EXPOSE, STOPSIGNAL, HEALTHCHECK, size < 250 MB;
#   - the server runs as that user and listens on 0.0.0.0 (gRPC and /metrics);
#   - the toy request from the image's attention_client: shape (2, 4, 100), and the same
#     numbers as the host build's client and server give (to 1e-5);
#   - the image's HEALTHCHECK command passes, and fails against a port with no server;
#   - a short bench from the image's client (what compose's load job runs), and
#     /metrics, scraped from the host, counting exactly the requests sent;
#   - SIGTERM: the server drains and exits 0.
#
#   bash tests/container/container_test.sh            (as root; installs what it needs)
#   MHA_CONTAINER_TEST=1 ctest --preset release -L container
#
# Engines: `docker build`/`docker run` when a Docker engine answers (`docker info`);
# otherwise buildah: base images from debootstrap (tests/container/base_image.sh),
# `buildah bud --isolation chroot --pull=never`, and the server run with `buildah from`
# + `buildah run --isolation chroot` (host network; `podman run` cannot set rlimits on
# this kind of machine). Environment: MHA_IMAGE (default mha-serve:test),
# MHA_ROOTFS (default /var/tmp/mha-rootfs), MHA_HOST_BUILD (default build/release: the
# host binaries the answer is compared with).
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ "${1:-}" == --ctest && "${MHA_CONTAINER_TEST:-0}" != 1 ]]; then
  echo "container test skipped: set MHA_CONTAINER_TEST=1 to build and run the image (slow)"
  exit 77
fi

image="${MHA_IMAGE:-mha-serve:test}"
host_build="${MHA_HOST_BUILD:-build/release}"
max_image_mb=250
t0=$(date +%s)
work=$(mktemp -d /tmp/mha-container-test.XXXXXX)
log() { printf '[container %5ds] %s\n' "$(($(date +%s) - t0))" "$*"; }
fail() { log "FAIL: $*"; exit 1; }
free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
server_pid=""
host_server=""
ctr=""
cleanup() {
  for pid in $server_pid $host_server; do
    if kill -0 "$pid" 2> /dev/null; then kill -KILL "$pid" 2> /dev/null || true; fi
  done
  if [[ -n $ctr ]]; then
    if [[ $engine == docker ]]; then docker rm -f "$ctr" > /dev/null 2>&1 || true
    else buildah rm "$ctr" > /dev/null 2>&1 || true; fi
  fi
  rm -rf "$work"
}
trap cleanup EXIT

for bin in server/attention_server client/attention_client; do
  [[ -x "$host_build/$bin" ]] || fail "$host_build/$bin missing: build the release preset first"
done

if docker info > /dev/null 2>&1; then engine=docker; else engine=buildah; fi
log "engine: $engine"

# ---- build --------------------------------------------------------------------------------
if [[ $engine == buildah ]]; then
  need=()
  for p in buildah podman debootstrap; do
    command -v "$p" > /dev/null || need+=("$p")
  done
  if ((${#need[@]})); then
    log "installing ${need[*]}"
    apt-get update -q > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      buildah podman debootstrap uidmap > /dev/null
  fi
  bash tests/container/base_image.sh "${MHA_ROOTFS:-/var/tmp/mha-rootfs}"
fi

log "building $image"
tb=$(date +%s)
if [[ $engine == docker ]]; then
  docker build -t "$image" . > "$work/build.log" 2>&1 || { tail -40 "$work/build.log"; fail "docker build"; }
  config=$(docker image inspect "$image")
  size=$(docker image inspect --format '{{.Size}}' "$image")
else
  buildah bud --isolation chroot --pull=never --format docker --layers --force-rm -t "$image" . \
    > "$work/build.log" 2>&1 || { tail -40 "$work/build.log"; fail "buildah bud"; }
  config=$(buildah inspect --type image "$image")
  size=$(podman image inspect --format '{{.Size}}' "$image")
fi
build_s=$(($(date +%s) - tb))
grep -m1 '^runtime packages:' "$work/build.log" || true
size_mb=$((size / 1000000))
log "image $image: ${size_mb} MB, built in ${build_s}s"
((size_mb < max_image_mb)) || fail "image is ${size_mb} MB, the target is < ${max_image_mb} MB"

# ---- the image's config -------------------------------------------------------------------
echo "$config" > "$work/config.json"
/usr/bin/python3 - "$work/config.json" > "$work/config.sh" <<'EOF' || fail "image config"
import json, shlex, sys
inspect = json.load(open(sys.argv[1]))
# docker image inspect: [{"Config": ...}]; buildah inspect: {"Docker": {"config": ...}}
c = inspect[0]["Config"] if isinstance(inspect, list) else inspect["Docker"]["config"]
user = c.get("User", "")
assert user and user.split(":")[0] not in ("", "0", "root"), f"User {user!r}: not non-root"
assert {"50051/tcp", "9464/tcp"} <= set(c.get("ExposedPorts") or {}), c.get("ExposedPorts")
assert c.get("StopSignal") == "SIGTERM", c.get("StopSignal")
assert "/models" in (c.get("Volumes") or {}), c.get("Volumes")
test = (c.get("Healthcheck") or {}).get("Test") or []
assert test[:1] == ["CMD"] and test[1:3] == ["attention_client", "health"], test
entry, cmd = c.get("Entrypoint") or [], c.get("Cmd") or []
assert entry[:1] == ["attention_server"], entry
print("user=" + shlex.quote(user.split(":")[0]))
print("entrypoint=(" + " ".join(map(shlex.quote, entry)) + ")")
print("cmd=(" + " ".join(map(shlex.quote, cmd)) + ")")
print("healthcheck=(" + " ".join(map(shlex.quote, test[1:])) + ")")
EOF
# shellcheck disable=SC1091
source "$work/config.sh"
log "config: USER $user, ENTRYPOINT ${entrypoint[*]}, CMD ${cmd[*]}, HEALTHCHECK ${healthcheck[*]}"

# ---- run ----------------------------------------------------------------------------------
port=$(free_port)
metrics_port=$(free_port)
# The image's own command line; absl takes the last value, so these move the ports.
server_argv=("${entrypoint[@]}" "${cmd[@]}")
ports=("--port=$port" "--metrics_port=$metrics_port")

if [[ $engine == docker ]]; then
  ctr=mha-serve-test-$$
  docker run -d --name "$ctr" --read-only --tmpfs /tmp -p "127.0.0.1:$port:$port" \
    -p "127.0.0.1:$metrics_port:$metrics_port" "$image" "${cmd[@]}" "${ports[@]}" > /dev/null
  in_ctr() { docker exec "$ctr" "$@"; }
  server_log() { docker logs "$ctr" 2>&1; }
else
  ctr=$(buildah from --pull=never "$image")
  in_ctr() { buildah run --isolation chroot "$ctr" -- "$@"; }
  in_ctr "${server_argv[@]}" "${ports[@]}" > "$work/server.log" 2>&1 &
  buildah_pid=$!
  server_log() { cat "$work/server.log"; }
fi

for _ in $(seq 120); do
  server_log | grep -q "^listening on" && break
  if [[ $engine == buildah ]] && ! kill -0 "$buildah_pid" 2> /dev/null; then break; fi
  sleep 0.5
done
server_log | sed 's/^/  server: /'
server_log | grep -qx "listening on 0.0.0.0:$port" || fail "the server is not listening on 0.0.0.0:$port"
server_log | grep -q "^metrics on 0.0.0.0:$metrics_port" \
  || fail "/metrics is not served on 0.0.0.0:$metrics_port"

if [[ $engine == buildah ]]; then
  # The attention_server process that buildah started (a descendant of our buildah run).
  descendants() { local c; for c in $(cat /proc/"$1"/task/*/children 2> /dev/null); do echo "$c"; descendants "$c"; done; }
  for pid in $(descendants "$buildah_pid"); do
    [[ $(cat /proc/"$pid"/comm 2> /dev/null) == attention_serve* ]] && server_pid=$pid
  done
  [[ -n $server_pid ]] || fail "no attention_server process under buildah run ($buildah_pid)"
  uid=$(awk '/^Uid:/ {print $2}' /proc/"$server_pid"/status)
else
  uid=$(docker exec "$ctr" sh -c 'id -u')
fi
[[ $uid == "$user" ]] || fail "the server runs as uid $uid, the image's USER is $user"
log "server runs as uid $uid, gRPC on 0.0.0.0:$port, /metrics on 0.0.0.0:$metrics_port"

# ---- the toy request, with the image's client ---------------------------------------------
in_ctr attention_client infer --target="127.0.0.1:$port" --model=toy --output=/tmp/toy.npy \
  > "$work/infer.txt" 2>&1 || { cat "$work/infer.txt"; fail "attention_client infer in the image"; }
sed 's/^/  infer: /' "$work/infer.txt"
grep -q "output shape: (2, 4, 100)" "$work/infer.txt" || fail "infer: expected output shape (2, 4, 100)"
in_ctr cat /tmp/toy.npy > "$work/image.npy"

# The same request from the host's client to the host's server: the answers must agree.
"$host_build/server/attention_server" --port=0 --metrics_port=-1 --model_repository=deploy/models \
  > "$work/host_server.out" 2> "$work/host_server.err" &
host_server=$!
for _ in $(seq 60); do grep -q "^listening on" "$work/host_server.out" && break; sleep 0.5; done
host_port=$(sed -n 's/^listening on .*:\([0-9]*\)$/\1/p' "$work/host_server.out")
[[ -n $host_port ]] || fail "host server: $(cat "$work/host_server.err")"
"$host_build/client/attention_client" infer --target="127.0.0.1:$host_port" --model=toy \
  --output="$work/host.npy" > /dev/null || fail "host infer"
kill -TERM "$host_server"
wait "$host_server" || fail "the host server did not stop cleanly"
host_server=""
/usr/bin/python3 - "$work/image.npy" "$work/host.npy" <<'EOF' || fail "the image's answer differs from the host build's"
import sys
import numpy as np
image, host = np.load(sys.argv[1]), np.load(sys.argv[2])
assert image.shape == (2, 4, 100), image.shape
assert np.isfinite(image).all() and np.abs(image).max() > 0, "output is zero or not finite"
err = float(np.abs(image - host).max())
print(f"  answer: max |image - host| = {err:.3g} over {image.size} values")
assert err <= 1e-5, err
EOF

# ---- health --------------------------------------------------------------------------------
check=("${healthcheck[@]/--target=127.0.0.1:50051/--target=127.0.0.1:$port}")
in_ctr "${check[@]}" > "$work/health.txt" 2>&1 || { cat "$work/health.txt"; fail "HEALTHCHECK ${check[*]}"; }
sed 's/^/  health: /' "$work/health.txt"
dead_port=$(free_port)
if in_ctr attention_client health --target="127.0.0.1:$dead_port" --timeout=2s > /dev/null 2>&1; then
  fail "the health check passes against port $dead_port, where nothing listens"
fi
log "HEALTHCHECK passes (and fails with no server)"

# ---- load from the image's client (compose's load job), then /metrics from the host ------
in_ctr attention_client bench --target="127.0.0.1:$port" --model=toy --concurrency=4 \
  --duration=2s --progress=false --json=/tmp/bench.json > "$work/bench.txt" 2>&1 \
  || { cat "$work/bench.txt"; fail "attention_client bench in the image"; }
grep -E "^(concurrency|requests sent)" "$work/bench.txt" | sed 's/^/  bench: /'
in_ctr cat /tmp/bench.json > "$work/bench.json"
/usr/bin/python3 - "$metrics_port" "$work/bench.json" <<'EOF' || fail "/metrics"
import json, re, sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
sent = json.load(open(sys.argv[2]))["attend_requests"]
ok = sum(float(v) for v in re.findall(
    r'^mha_requests_total\{[^}]*code="OK"[^}]*\} (\S+)$', text, re.M))
print(f"  metrics: mha_requests_total{{code=\"OK\"}} = {ok:g}; sent: 1 infer + {sent} bench")
assert sent > 0 and ok == 1 + sent, "/metrics does not count the requests sent"
assert re.search(r"^process_resident_memory_bytes \S+$", text, re.M), "no process metrics"
EOF

# ---- SIGTERM: drain and exit 0 ------------------------------------------------------------
if [[ $engine == docker ]]; then
  docker stop --time 20 "$ctr" > /dev/null
  code=$(docker inspect --format '{{.State.ExitCode}}' "$ctr")
else
  kill -TERM "$server_pid"
  code=0
  wait "$buildah_pid" || code=$?
fi
server_log | tail -2 | sed 's/^/  server: /'
[[ $code == 0 ]] || fail "the server exited $code after SIGTERM"
server_log | grep -q "^stopped" || fail "no 'stopped' after SIGTERM"

log "PASS: image $image ${size_mb} MB (build ${build_s}s), served the toy request, health and /metrics"
