#!/usr/bin/python3
"""Checks that the deployment files agree with each other and with the server.

    check_deploy.py manifests SOURCE_DIR SERVER_BINARY
        Dockerfile, deploy/k8s/*.yaml and deploy/compose.yaml against the server's
        defaults (from `attention_server --help`): ports, probes, Services, the drain
        timeout against the grace periods, the security context, the model ConfigMap
        against deploy/models, Prometheus and Grafana wiring, and compose's "replicas"
        profile against deploy/haproxy/haproxy.cfg (HTTP/2 both sides, round robin,
        every replica and only them, timeouts above the replicas'
        --session_idle_timeout). Then mutates the loaded
        files (a wrong probe port, a short grace period, ...) and checks that each
        mutation is caught, so the checks cannot silently pass.
    check_deploy.py configmap SOURCE_DIR SERVER_BINARY
        Lays the ConfigMap out as the kubelet mounts it (..data symlinks) and starts the
        server on it with the Deployment's flags: every model must load.

Exits 0 when everything agrees; otherwise prints each disagreement and exits 1.
"""

import copy
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile

import yaml


# --- reading the server and the files ------------------------------------------------

def server_defaults(binary):
    """{flag: default string} from `attention_server --help` (absl's format)."""
    proc = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    text = proc.stdout + proc.stderr
    defaults = {}
    for match in re.finditer(r"--(\w+) \((.*?)\);\s+default:\s+(.*?);", text, re.S):
        defaults[match.group(1)] = match.group(3).strip('"')
    for flag in ("port", "metrics_port", "host", "metrics_host", "drain_timeout",
                 "model_repository", "session_idle_timeout"):
        if flag not in defaults:
            raise SystemExit(f"attention_server --help lists no --{flag}:\n{text}")
    return defaults


def parse_flags(args, defaults):
    """Effective flag values: the defaults, then --name=value in order (absl: last wins)."""
    flags = dict(defaults)
    for arg in args:
        match = re.fullmatch(r"--(\w+)=(.*)", arg)
        if not match:
            raise ValueError(f"not a --flag=value argument: {arg!r}")
        flags[match.group(1)] = match.group(2)
    return flags


def seconds(duration):
    """absl duration ("10s", "1m30s", "500ms") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|ns|m|s)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a duration: {duration!r}")
    return sum(float(n) * units[u] for n, u in parts)


def read_dockerfile(path):
    """The final stage's instructions: {instruction: [argument strings]}."""
    text = open(path).read().replace("\\\n", " ")
    stage = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stage = {}
        stage.setdefault(word, []).append(rest.strip())
    return stage


def exec_form(value):
    """A JSON exec-form list (["a", "b"]); shell form is refused (signals, args)."""
    value = value.strip()
    if not value.startswith("["):
        raise ValueError(f"expected exec form [\"...\"], got {value!r}")
    return json.loads(value)


def read_haproxy(path):
    """haproxy.cfg as a list of sections, each {"header": [words], "lines": [[words]]}:
    a section starts at an unindented line; comments and blank lines are dropped."""
    sections = []
    with open(path) as f:
        for raw in f:
            line = raw.split("#", 1)[0].rstrip()
            if not line.strip():
                continue
            words = line.split()
            if not raw[0].isspace():
                sections.append({"header": words, "lines": []})
            elif not sections:
                raise ValueError(f"{path}: {line.strip()!r} before any section")
            else:
                sections[-1]["lines"].append(words)
    return sections


def render_haproxy(sections):
    """The text of read_haproxy()'s sections (one blank line between sections)."""
    return "\n".join(" ".join(s["header"]) + "\n" +
                     "".join("    " + " ".join(words) + "\n" for words in s["lines"])
                     for s in sections)


def haproxy_seconds(value):
    """An HAProxy time ("90s", "5m", "500ms"; a bare number is milliseconds) in seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}
    match = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value)
    if not match:
        raise ValueError(f"not an HAProxy time: {value!r}")
    return int(match.group(1)) * units[match.group(2) or "ms"]


def haproxy_sections(cfg, keyword):
    return [s for s in cfg if s["header"][0] == keyword]


def haproxy_directives(section, *prefix):
    """The lines of `section` that start with the words `prefix`."""
    return [w for w in section["lines"] if w[:len(prefix)] == list(prefix)]


def check_haproxy(cfg, replicas, proxy, defaults, entrypoint, cmd):
    """Compose's "replicas" profile (the `replicas` services and `proxy`, the haproxy
    service) against haproxy.cfg (read_haproxy). Returns the disagreements."""
    errors = []

    def expect(condition, message):
        if not condition:
            errors.append(message)

    where = "deploy/haproxy/haproxy.cfg"
    expect(len(replicas) == 3, f"compose replicas profile: {len(replicas)} replicas "
                               f"({sorted(replicas)}), expected 3")
    replica_flags = {}
    for name, replica in sorted(replicas.items()):
        flags = parse_flags(entrypoint[1:] + replica.get("command", cmd), defaults)
        replica_flags[name] = flags
        expect(replica.get("profiles") == ["replicas"],
               f"compose {name}: profiles {replica.get('profiles')}, expected [replicas]")
        expect(str(replica.get("image", "")).split(":")[0] == "mha-serve",
               f"compose {name}: image {replica.get('image')}, expected mha-serve")
        mounts = [str(v).split(":") for v in replica.get("volumes", [])]
        expect(any(m[0] == "./models" and m[1] == flags["model_repository"] for m in mounts),
               f"compose {name}: ./models is not mounted at {flags['model_repository']}")
        grace = replica.get("stop_grace_period", "10s")
        expect(seconds(grace) > seconds(flags["drain_timeout"]),
               f"compose {name}: stop_grace_period {grace} <= --drain_timeout "
               f"{flags['drain_timeout']}")
        expect(not replica.get("ports"),
               f"compose {name}: publishes {replica.get('ports')}; clients go through haproxy")
    if proxy is None:
        return errors + ["compose: the replicas profile has no haproxy service"]
    expect(proxy.get("profiles") == ["replicas"],
           f"compose haproxy: profiles {proxy.get('profiles')}, expected [replicas]")
    mounts = {str(v).split(":")[0]: str(v).split(":")[1] for v in proxy.get("volumes", [])}
    expect(mounts.get("./haproxy/haproxy.cfg") == "/usr/local/etc/haproxy/haproxy.cfg",
           f"compose haproxy: ./haproxy/haproxy.cfg mounted at "
           f"{mounts.get('./haproxy/haproxy.cfg')}, the image reads "
           "/usr/local/etc/haproxy/haproxy.cfg")
    depends = proxy.get("depends_on", {})
    expect(set(depends) == set(replicas),
           f"compose haproxy: depends_on {sorted(depends)}, the replicas are {sorted(replicas)}")
    if cfg is None:
        return errors + [f"{where} is missing"]

    sections = {k: haproxy_sections(cfg, k) for k in ("defaults", "frontend", "backend")}
    if len(sections["frontend"]) != 1 or len(sections["backend"]) != 1:
        return errors + [f"{where}: expected one frontend and one backend"]
    (frontend,), (backend,) = sections["frontend"], sections["backend"]

    def setting(section, *prefix):
        """The words after `prefix` in `section`, else in the defaults (last wins)."""
        for s in (section, *reversed(sections["defaults"])):
            found = haproxy_directives(s, *prefix)
            if found:
                return found[-1][len(prefix):]
        return None

    for section in (frontend, backend):
        expect(setting(section, "mode") == ["http"],
               f"{where}: {' '.join(section['header'])} is not mode http (per-call balancing "
               "needs HTTP)")
    binds = haproxy_directives(frontend, "bind")
    expect(len(binds) == 1, f"{where}: frontend has {len(binds)} bind lines, expected 1")
    if binds:
        bind = binds[0]
        expect("proto" in bind and bind[bind.index("proto") + 1:][:1] == ["h2"],
               f"{where}: {' '.join(bind)}: the frontend must speak HTTP/2 (proto h2)")
        port = bind[1].rsplit(":", 1)[-1]
        published = [str(p).rsplit(":", 1)[-1].split("/")[0] for p in proxy.get("ports", [])]
        expect(port in published,
               f"compose haproxy: the bind port {port} is not published {proxy.get('ports')}")
    expect(setting(frontend, "default_backend") == [backend["header"][1]],
           f"{where}: the frontend's default_backend is not {backend['header'][1]}")
    expect(setting(backend, "balance") == ["roundrobin"],
           f"{where}: balance {setting(backend, 'balance')}, expected roundrobin (per call)")
    default_server = [w for line in haproxy_directives(backend, "default-server")
                      for w in line[1:]]
    servers = {}
    for line in haproxy_directives(backend, "server"):
        options = default_server + line[3:]
        host, _, port = line[2].rpartition(":")
        servers[host] = port
        expect("proto" in options and options[options.index("proto") + 1:][:1] == ["h2"],
               f"{where}: server {line[1]} is not proto h2 (gRPC needs HTTP/2 to the replica)")
        if host in replica_flags:
            expect(port == replica_flags[host]["port"],
                   f"{where}: server {line[1]} dials {host}:{port}, {host} listens on "
                   f"--port={replica_flags[host]['port']}")
    expect(set(servers) == set(replicas),
           f"{where}: servers {sorted(servers)}, the compose replicas are {sorted(replicas)}")
    idle = max([seconds(f["session_idle_timeout"]) for f in replica_flags.values()] or [0])
    for side, section in (("client", frontend), ("server", backend)):
        value = setting(section, "timeout", side)
        try:
            timeout = haproxy_seconds(value[0]) if value else float("inf")
        except ValueError as e:
            errors.append(f"{where}: timeout {side}: {e}")
            continue
        expect(timeout > idle,
               f"{where}: timeout {side} {value[0] if value else None} <= the replicas' "
               f"--session_idle_timeout ({idle:g}s): the proxy would end idle sessions first")
    return errors


def load(source):
    """Everything the checks read, as plain data (so mutations are easy)."""
    deploy = os.path.join(source, "deploy")
    files = {"dockerfile": read_dockerfile(os.path.join(source, "Dockerfile"))}
    with open(os.path.join(source, "docs", "deploy.md")) as f:
        files["deploy_md"] = f.read()
    k8s_dir = os.path.join(deploy, "k8s")
    files["k8s"] = {}
    for name in sorted(os.listdir(k8s_dir)):
        if name.endswith(".yaml"):
            with open(os.path.join(k8s_dir, name)) as f:
                files["k8s"][name] = [d for d in yaml.safe_load_all(f) if d]
    with open(os.path.join(deploy, "compose.yaml")) as f:
        files["compose"] = yaml.safe_load(f)
    with open(os.path.join(deploy, "prometheus", "prometheus.yml")) as f:
        files["prometheus"] = yaml.safe_load(f)
    grafana = os.path.join(deploy, "grafana", "provisioning")
    with open(os.path.join(grafana, "datasources", "prometheus.yaml")) as f:
        files["grafana_datasources"] = yaml.safe_load(f)
    with open(os.path.join(grafana, "dashboards", "mha-serve.yaml")) as f:
        files["grafana_dashboards"] = yaml.safe_load(f)
    files["models"] = {}
    models_dir = os.path.join(deploy, "models")
    for name in sorted(os.listdir(models_dir)):
        config = os.path.join(models_dir, name, "config.pbtxt")
        if os.path.isfile(config):
            files["models"][name] = open(config).read()
    files["dashboards_dir"] = sorted(os.listdir(os.path.join(deploy, "grafana", "dashboards")))
    haproxy = os.path.join(deploy, "haproxy", "haproxy.cfg")
    files["haproxy"] = read_haproxy(haproxy) if os.path.isfile(haproxy) else None
    return files


def k8s_objects(files, kind):
    return [(name, doc) for name, docs in files["k8s"].items() for doc in docs
            if doc.get("kind") == kind]


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# --- the checks ------------------------------------------------------------------------

def check(files, defaults):
    """Returns a list of disagreements (empty when everything agrees)."""
    errors = []

    def expect(condition, message):
        if not condition:
            errors.append(message)

    # The image.
    df = files["dockerfile"]
    try:
        entrypoint = exec_form(df["ENTRYPOINT"][-1])
        cmd = exec_form(df["CMD"][-1])
    except (KeyError, ValueError) as e:
        return [f"Dockerfile: ENTRYPOINT and CMD in exec form: {e}"]
    expect(entrypoint[0] == "attention_server",
           f"Dockerfile: ENTRYPOINT runs {entrypoint[0]!r}, expected attention_server")
    image = parse_flags(entrypoint[1:] + cmd, defaults)
    expect(image["host"] == "0.0.0.0",
           f"Dockerfile: the server listens on {image['host']}, expected 0.0.0.0 in a container")
    expect(image.get("metrics_host") == "0.0.0.0",
           f"Dockerfile: /metrics binds {image.get('metrics_host', 'the default')}, "
           "expected --metrics_host=0.0.0.0 in ENTRYPOINT")
    expect(not any(a.startswith(("--host=", "--metrics_host=")) for a in cmd),
           "Dockerfile: --host/--metrics_host belong in ENTRYPOINT, so a new CMD keeps them")
    exposed = {p.split("/")[0] for e in df.get("EXPOSE", []) for p in e.split()}
    for flag in ("port", "http_port", "metrics_port"):
        expect(image[flag] in exposed,
               f"Dockerfile: --{flag}={image[flag]} is not in EXPOSE {sorted(exposed)}")
    volumes = [v for e in df.get("VOLUME", []) for v in exec_form(e)]
    expect(image["model_repository"] in volumes,
           f"Dockerfile: --model_repository={image['model_repository']} is not a VOLUME {volumes}")
    # docs/deploy.md says what the image does: its EXPOSE line, a first `docker run`
    # that publishes every port the image serves, and none of the claims issue 39 found
    # stale.
    doc = files["deploy_md"]
    expose = " ".join(" ".join(df.get("EXPOSE", [])).split())
    expect(f"`EXPOSE {expose}`" in doc,
           f"docs/deploy.md: does not say `EXPOSE {expose}`, as the Dockerfile does")
    runs = [line for line in doc.splitlines() if line.startswith("docker run")]
    for flag in ("port", "http_port", "metrics_port"):
        expect(runs and f"-p {image[flag]}:{image[flag]}" in runs[0],
               f"docs/deploy.md: its first docker run does not publish --{flag}={image[flag]}")
    for stale in ("no admin RPC", "read only at start-up"):
        expect(stale not in " ".join(doc.split()), f"docs/deploy.md: says {stale!r}")
    user = df.get("USER", ["0"])[-1].split(":")[0]
    expect(user.isdigit() and int(user) != 0,
           f"Dockerfile: USER {user!r}, expected a numeric non-root uid")
    expect(df.get("STOPSIGNAL") == ["SIGTERM"], f"Dockerfile: STOPSIGNAL {df.get('STOPSIGNAL')}")
    health = " ".join(df.get("HEALTHCHECK", []))
    health_cmd = exec_form(health[health.index("CMD") + 3:]) if "CMD" in health else []
    expect(health_cmd[:2] == ["attention_client", "health"]
           and f"--target=127.0.0.1:{image['port']}" in health_cmd,
           f"Dockerfile: HEALTHCHECK {health_cmd}, expected attention_client health "
           f"--target=127.0.0.1:{image['port']}")

    # Kubernetes: the Deployment and its server container.
    deployments = k8s_objects(files, "Deployment")
    if len(deployments) != 1:
        return errors + [f"k8s: expected one Deployment, found {len(deployments)}"]
    _, deployment = deployments[0]
    pod = deployment["spec"]["template"]
    pod_labels = pod["metadata"].get("labels", {})
    spec = pod["spec"]
    expect(matches(deployment["spec"]["selector"]["matchLabels"], pod_labels),
           "k8s Deployment: selector does not match the pod template's labels")
    containers = [c for c in spec["containers"] if c.get("image", "").split(":")[0]
                  .endswith("mha-serve")]
    if len(containers) != 1:
        return errors + ["k8s Deployment: expected one mha-serve container"]
    c = containers[0]
    expect("command" not in c, "k8s Deployment: `command` would drop the image's ENTRYPOINT "
                               "(and its 0.0.0.0 binds); set `args` only")
    pod_flags = parse_flags(entrypoint[1:] + c.get("args", cmd), defaults)
    port, metrics_port = int(pod_flags["port"]), int(pod_flags["metrics_port"])
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    expect(ports.get("grpc") == port,
           f"k8s Deployment: containerPort grpc {ports.get('grpc')}, the server listens on {port}")
    expect(ports.get("metrics") == metrics_port,
           f"k8s Deployment: containerPort metrics {ports.get('metrics')}, "
           f"the server serves /metrics on {metrics_port}")
    expect(pod_flags["host"] == "0.0.0.0" and pod_flags.get("metrics_host") == "0.0.0.0",
           "k8s Deployment: the pod must listen on 0.0.0.0 for gRPC and /metrics")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe == "startupProbe" and probe not in c:
            continue
        grpc = c.get(probe, {}).get("grpc")
        expect(grpc is not None, f"k8s Deployment: {probe} is not a native gRPC probe")
        if grpc is not None:
            expect(grpc.get("port") == port,
                   f"k8s Deployment: {probe} checks port {grpc.get('port')}, the server is on {port}")
            expect(grpc.get("service", "") == "",
                   f"k8s Deployment: {probe} asks for service {grpc.get('service')!r}; "
                   "\"\" is the server's overall health")
    annotations = pod["metadata"].get("annotations", {})
    if "prometheus.io/port" in annotations:
        expect(annotations["prometheus.io/port"] == str(metrics_port),
               f"k8s Deployment: prometheus.io/port {annotations['prometheus.io/port']}, "
               f"/metrics is on {metrics_port}")
    # Drain: grace period > preStop sleep + --drain_timeout.
    drain = seconds(pod_flags["drain_timeout"])
    pre_stop = c.get("lifecycle", {}).get("preStop", {})
    sleep = 0.0
    if "exec" in pre_stop:
        command = pre_stop["exec"]["command"]
        expect(command[0] == "sleep" and len(command) == 2,
               f"k8s Deployment: preStop {command}, expected [sleep, N]")
        sleep = float(command[-1])
    elif "sleep" in pre_stop:
        sleep = float(pre_stop["sleep"]["seconds"])
    expect(sleep > 0, "k8s Deployment: no preStop sleep before SIGTERM")
    grace = spec.get("terminationGracePeriodSeconds", 30)
    expect(grace > sleep + drain,
           f"k8s Deployment: terminationGracePeriodSeconds {grace} must exceed preStop sleep "
           f"{sleep:g} + --drain_timeout {drain:g}s")
    # Security context: non-root, the image's uid, read-only root filesystem.
    pod_sc, sc = spec.get("securityContext", {}), c.get("securityContext", {})
    expect(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True,
           "k8s Deployment: runAsNonRoot is not true")
    run_as = sc.get("runAsUser", pod_sc.get("runAsUser"))
    expect(run_as is None or str(run_as) == user,
           f"k8s Deployment: runAsUser {run_as}, the image's USER is {user}")
    expect(sc.get("readOnlyRootFilesystem") is True,
           "k8s Deployment: readOnlyRootFilesystem is not true")
    expect(sc.get("allowPrivilegeEscalation") is False,
           "k8s Deployment: allowPrivilegeEscalation is not false")
    resources = c.get("resources", {})
    for kind in ("requests", "limits"):
        expect({"cpu", "memory"} <= set(resources.get(kind, {})),
               f"k8s Deployment: resources.{kind} needs cpu and memory")
    # The model repository: a ConfigMap mounted at --model_repository.
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    repo_volume = [n for n, path in mounts.items() if path == pod_flags["model_repository"]]
    expect(len(repo_volume) == 1,
           f"k8s Deployment: nothing is mounted at --model_repository={pod_flags['model_repository']}")
    configmaps = {doc["metadata"]["name"]: doc for _, doc in k8s_objects(files, "ConfigMap")}
    if len(repo_volume) == 1:
        source = volumes.get(repo_volume[0], {}).get("configMap")
        expect(source is not None and source["name"] in configmaps,
               "k8s Deployment: the model volume is not one of the ConfigMaps")
        if source is not None and source["name"] in configmaps:
            data = configmaps[source["name"]].get("data", {})
            items = {i["key"]: i["path"] for i in source.get("items", [])}
            for key in data:
                expect(items.get(key) == f"{key}/config.pbtxt",
                       f"k8s ConfigMap key {key!r} is mounted at {items.get(key)!r}, "
                       f"expected {key}/config.pbtxt")
            expect(set(data) == set(files["models"]),
                   f"k8s ConfigMap models {sorted(data)} differ from deploy/models "
                   f"{sorted(files['models'])}")
            for key, text in data.items():
                if key in files["models"]:
                    expect(text == files["models"][key],
                           f"k8s ConfigMap {key!r} differs from deploy/models/{key}/config.pbtxt")

    # Services: selectors find the pods, ports reach the container's.
    services = {doc["metadata"]["name"]: doc for _, doc in k8s_objects(files, "Service")}
    headless = [s for s in services.values() if s["spec"].get("clusterIP") == "None"]
    cluster_ip = [s for s in services.values() if s["spec"].get("clusterIP") != "None"
                  and s["spec"].get("type", "ClusterIP") == "ClusterIP"]
    expect(len(headless) == 1, f"k8s: expected one headless Service, found {len(headless)}")
    expect(len(cluster_ip) == 1, f"k8s: expected one ClusterIP Service, found {len(cluster_ip)}")
    by_number = {v: k for k, v in ports.items()}
    for name, service in services.items():
        expect(matches(service["spec"].get("selector"), pod_labels),
               f"k8s Service {name}: selector does not match the server pods")
        for sp in service["spec"].get("ports", []):
            target = sp.get("targetPort", sp["port"])
            resolved = ports.get(target) if isinstance(target, str) else target
            expect(resolved in by_number,
                   f"k8s Service {name}: port {sp.get('name')} targets {target!r}, "
                   f"not a container port {ports}")
            expect(sp["port"] == resolved,
                   f"k8s Service {name}: port {sp['port']} differs from the container's "
                   f"{resolved} (clients dial the Service port)")
    for service in headless:
        expect(any(sp.get("targetPort") in ("grpc", port) for sp in service["spec"]["ports"]),
               "k8s headless Service: no gRPC port")
    # HPA and PDB point at the Deployment's pods.
    for _, hpa in k8s_objects(files, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        expect(ref["kind"] == "Deployment" and ref["name"] == deployment["metadata"]["name"],
               f"k8s HPA: scales {ref['kind']}/{ref['name']}")
        expect(1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"],
               "k8s HPA: minReplicas > maxReplicas")
    pdbs = k8s_objects(files, "PodDisruptionBudget")
    expect(len(pdbs) == 1, f"k8s: expected one PodDisruptionBudget, found {len(pdbs)}")
    for _, pdb in pdbs:
        expect(matches(pdb["spec"]["selector"]["matchLabels"], pod_labels),
               "k8s PDB: selector does not match the server pods")
        minimum = pdb["spec"].get("minAvailable")
        replicas = min([deployment["spec"].get("replicas", 1)] +
                       [h["spec"].get("minReplicas", 1)
                        for _, h in k8s_objects(files, "HorizontalPodAutoscaler")])
        expect(not isinstance(minimum, int) or minimum < replicas,
               f"k8s PDB: minAvailable {minimum} with {replicas} replicas blocks every drain")
    for _, kustomization in k8s_objects(files, "Kustomization"):
        listed = set(kustomization.get("resources", []))
        wanted = {n for n in files["k8s"] if n != "kustomization.yaml"}
        expect(listed == wanted, f"k8s kustomization: resources {sorted(listed)}, "
                                 f"files {sorted(wanted)}")

    # Compose: the server's ports and models, Prometheus and Grafana wiring.
    services = files["compose"].get("services", {})
    server = services.get("server", {})
    compose_flags = parse_flags(entrypoint[1:] + server.get("command", cmd), defaults)
    published = {}
    for mapping in server.get("ports", []):
        container = str(mapping).rsplit(":", 1)[1].split("/")[0]
        published[container] = mapping
    for flag in ("port", "metrics_port"):
        expect(compose_flags[flag] in published,
               f"compose server: --{flag}={compose_flags[flag]} is not published {server.get('ports')}")
    mounts = [str(v).split(":") for v in server.get("volumes", [])]
    expect(any(m[0] == "./models" and m[1] == compose_flags["model_repository"] for m in mounts),
           f"compose server: ./models is not mounted at {compose_flags['model_repository']}")
    grace = server.get("stop_grace_period", "10s")
    expect(seconds(grace) > seconds(compose_flags["drain_timeout"]),
           f"compose server: stop_grace_period {grace} <= --drain_timeout "
           f"{compose_flags['drain_timeout']}")
    targets = [t for job in files["prometheus"].get("scrape_configs", [])
               for sc in job.get("static_configs", []) for t in sc.get("targets", [])]
    expect(f"server:{compose_flags['metrics_port']}" in targets,
           f"prometheus.yml: targets {targets}, expected server:{compose_flags['metrics_port']}")
    expect("prometheus" in services and "grafana" in services,
           "compose: prometheus and grafana services are missing")
    prom_mounts = [str(v).split(":")[0] for v in services.get("prometheus", {}).get("volumes", [])]
    expect("./prometheus/prometheus.yml" in prom_mounts,
           "compose prometheus: deploy/prometheus/prometheus.yml is not mounted")
    urls = [d.get("url") for d in files["grafana_datasources"].get("datasources", [])]
    expect("http://prometheus:9090" in urls,
           f"grafana datasource urls {urls}, expected http://prometheus:9090")
    grafana_mounts = {str(v).split(":")[0]: str(v).split(":")[1]
                      for v in services.get("grafana", {}).get("volumes", [])}
    paths = [p["options"]["path"] for p in files["grafana_dashboards"].get("providers", [])]
    expect(grafana_mounts.get("./grafana/dashboards") in paths,
           f"compose grafana: dashboards mounted at {grafana_mounts.get('./grafana/dashboards')}, "
           f"the provider reads {paths}")
    expect(any(n.endswith(".json") for n in files["dashboards_dir"]),
           "deploy/grafana/dashboards has no dashboard JSON")
    load = services.get("load")
    if load is not None:
        expect(load.get("profiles") == ["load"], "compose load: not behind a profile")
        argv = load.get("entrypoint", [])
        if isinstance(argv, str):
            argv = shlex.split(argv)
        expect(argv[:2] == ["attention_client", "bench"]
               and f"--target=server:{compose_flags['port']}" in argv,
               f"compose load: {argv}, expected attention_client bench "
               f"--target=server:{compose_flags['port']}")
    replicas = {n: v for n, v in services.items()
                if n != "haproxy" and "replicas" in (v.get("profiles") or [])}
    if replicas or "haproxy" in services:
        errors += check_haproxy(files["haproxy"], replicas, services.get("haproxy"), defaults,
                                entrypoint, cmd)
    return errors


# Each mutation breaks one agreement; check() must report it.
def _container(files):
    return files["k8s"]["deployment.yaml"][0]["spec"]["template"]["spec"]["containers"][0]


MUTATIONS = {
    "readiness probe port": lambda f: _container(f)["readinessProbe"]["grpc"].update(port=50052),
    "container port": lambda f: _container(f)["ports"][0].update(containerPort=8080),
    "server port flag": lambda f: _container(f)["args"].append("--port=6000"),
    "drain timeout": lambda f: _container(f)["args"].append("--drain_timeout=40s"),
    "grace period": lambda f: f["k8s"]["deployment.yaml"][0]["spec"]["template"]["spec"]
    .update(terminationGracePeriodSeconds=12),
    "read-only root": lambda f: _container(f)["securityContext"]
    .update(readOnlyRootFilesystem=False),
    "service target": lambda f: f["k8s"]["service.yaml"][0]["spec"]["ports"][0]
    .update(targetPort="grpcx"),
    "service selector": lambda f: f["k8s"]["service.yaml"][1]["spec"]["selector"]
    .update({"app.kubernetes.io/name": "other"}),
    "configmap drift": lambda f: f["k8s"]["configmap.yaml"][0]["data"]
    .update(toy=f["models"]["toy"] + "num_heads: 4\n"),
    "image host": lambda f: f["dockerfile"].update(
        ENTRYPOINT=['["attention_server", "--metrics_host=0.0.0.0"]']),
    "prometheus target": lambda f: f["prometheus"]["scrape_configs"][0]["static_configs"][0]
    .update(targets=["server:9465"]),
    "compose port": lambda f: f["compose"]["services"]["server"]["command"]
    .append("--metrics_port=9999"),
    "replica missing": lambda f: f["compose"]["services"].pop("replica-3"),
    "replica port": lambda f: f["compose"]["services"].update(
        {"replica-2": dict(f["compose"]["services"]["replica-2"],
                           command=["--port=6000", "--model_repository=/models"])}),
    "haproxy http/1.1 to replicas": lambda f: _haproxy_line(f, "default-server")
    .__delitem__(slice(1, 3)),
    "haproxy balance": lambda f: _haproxy_line(f, "balance").__setitem__(1, "source"),
    "haproxy timeout": lambda f: _haproxy_line(f, "timeout", "server").__setitem__(2, "30s"),
    "docs EXPOSE": lambda f: f.update(
        deploy_md=f["deploy_md"].replace("EXPOSE 50051 8000 9464", "EXPOSE 50051 9464")),
    "docs docker run": lambda f: f.update(
        deploy_md=f["deploy_md"].replace("-p 8000:8000 -p 9464", "-p 9464")),
    "docs admin claim": lambda f: f.update(
        deploy_md=f["deploy_md"] + "\nThere is no admin RPC.\n"),
    "haproxy bind port": lambda f: _haproxy_line(f, "bind").__setitem__(1, ":50053"),
}


def _haproxy_line(files, *prefix):
    """The first line of haproxy.cfg starting with the words `prefix` (a mutable list)."""
    return next(w for s in files["haproxy"] for w in s["lines"] if w[:len(prefix)] == list(prefix))


def cmd_manifests(source, binary):
    defaults = server_defaults(binary)
    files = load(source)
    errors = check(files, defaults)
    for e in errors:
        print("FAIL", e)
    if errors:
        return 1
    print(f"manifests agree with the server (--port {defaults['port']}, --metrics_port "
          f"{defaults['metrics_port']}, --drain_timeout {defaults['drain_timeout']})")
    missed = []
    for name, mutate in MUTATIONS.items():
        mutated = copy.deepcopy(files)
        mutate(mutated)
        found = check(mutated, defaults)
        print(f"mutation {name!r}: {'caught: ' + found[0] if found else 'NOT caught'}")
        if not found:
            missed.append(name)
    if missed:
        print("FAIL: mutations not caught:", ", ".join(missed))
        return 1
    print(f"{len(MUTATIONS)} mutations caught")
    return 0


def cmd_configmap(source, binary):
    """The kubelet's atomic-writer layout: <mount>/..<timestamp>/<files>,
    ..data -> ..<timestamp>, and each top-level entry -> ..data/<entry>."""
    files = load(source)
    _, deployment = k8s_objects(files, "Deployment")[0]
    spec = deployment["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if "configMap" in v)
    configmap = next(doc for _, doc in k8s_objects(files, "ConfigMap")
                     if doc["metadata"]["name"] == volume["configMap"]["name"])
    c = _container(files)
    with tempfile.TemporaryDirectory(prefix="mha-configmap-") as mount:
        stamp = os.path.join(mount, "..2024_01_01_00_00_00.000000001")
        for item in volume["configMap"]["items"]:
            path = os.path.join(stamp, item["path"])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(configmap["data"][item["key"]])
        os.symlink(os.path.basename(stamp), os.path.join(mount, "..data"))
        for top in sorted({i["path"].split("/")[0] for i in volume["configMap"]["items"]}):
            os.symlink(os.path.join("..data", top), os.path.join(mount, top))
        # The Deployment's flags, on loopback with free ports; the mount moved here.
        args = [a for a in c["args"] if not a.startswith(("--port=", "--metrics_port=",
                                                          "--http_port=", "--model_repository="))]
        args += ["--port=0", "--metrics_port=-1", "--http_port=-1", f"--model_repository={mount}"]
        proc = subprocess.Popen([binary, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            if line.startswith("warming up on "):  # health answers; serving comes next
                line = proc.stdout.readline()
            if not line.startswith("listening on "):
                proc.wait(timeout=30)
                print("FAIL: the server did not start on the ConfigMap layout:", proc.stderr.read())
                return 1
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        loaded = set(re.findall(r"^model (\w+):", err, re.M))
        wanted = set(configmap["data"])
        print(err.strip())
        if loaded != wanted or proc.returncode != 0:
            print(f"FAIL: loaded {sorted(loaded)}, the ConfigMap has {sorted(wanted)}; "
                  f"exit code {proc.returncode}")
            return 1
        print(f"the server loads every ConfigMap model from the kubelet layout: {sorted(loaded)}")
    return 0


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("manifests", "configmap"):
        print(__doc__)
        return 2
    command, source, binary = sys.argv[1:]
    return {"manifests": cmd_manifests, "configmap": cmd_configmap}[command](source, binary)


if __name__ == "__main__":
    sys.exit(main())
