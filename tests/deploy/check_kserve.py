#!/usr/bin/python3
"""Validates deploy/kserve against KServe's published CRD schemas.

    check_kserve.py SOURCE_DIR SERVER_BINARY

The schemas are test fixtures under tests/deploy/ (kserve_*_schema.json: the
openAPIV3Schema of each CRD with its source repository, path and commit). The API server
prunes unknown fields silently, so a misspelled field would pass a plain schema check:
here every object schema that lists properties and has no
x-kubernetes-preserve-unknown-fields gets additionalProperties: false first. Then:
  - each manifest validates (python3-jsonschema, Draft 7, as Kubernetes' OpenAPI v3
    subset reads);
  - the InferenceService names the ServingRuntime and one of its model formats;
  - the runtime serves v2 and grpc-v2, its ports are the args' --http_port and --port,
    its probes use the HTTP port, and every arg is a flag of attention_server (--help);
  - mutations (a misspelled field, a wrong port, a missing protocol) each fail, so the
    checks cannot silently pass.
Exits 0 when all hold; otherwise prints each failure and exits 1.
"""

import copy
import json
import os
import re
import subprocess
import sys

import jsonschema
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def strict(schema):
    """The schema with additionalProperties: false on every object that lists
    properties, unless it preserves unknown fields or sets additionalProperties."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and not out.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in out):
        out["additionalProperties"] = False
    return out


def load_schema(name):
    with open(os.path.join(HERE, name)) as f:
        fixture = json.load(f)
    source = fixture["source"]
    for key in ("repository", "commit", "path", "kind", "apiVersion"):
        if not source.get(key):
            raise SystemExit(f"{name}: its source header lacks {key}")
    return source, strict(fixture["openAPIV3Schema"])


def flags_of(binary):
    text = subprocess.run([binary, "--help"], capture_output=True, text=True,
                          timeout=30).stdout
    return set(re.findall(r"^\s+--([a-z_]+)", text, re.M))


def arg_value(args, flag):
    for a in args:
        if a.startswith(f"--{flag}="):
            return a.split("=", 1)[1]
    return None


def check(docs, schemas, flags):
    """Every failure, as text; [] when the manifests hold."""
    failures = []
    by_kind = {}
    for doc in docs:
        kind = doc.get("kind")
        if kind not in schemas:
            failures.append(f"unexpected kind {kind!r}")
            continue
        source, schema = schemas[kind]
        if doc.get("apiVersion") != source["apiVersion"]:
            failures.append(f"{kind}: apiVersion {doc.get('apiVersion')!r}, "
                            f"the CRD serves {source['apiVersion']}")
        validator = jsonschema.Draft7Validator(schema)
        for error in sorted(validator.iter_errors(doc), key=lambda e: list(e.path)):
            path = ".".join(str(p) for p in error.path) or "(top)"
            failures.append(f"{kind} {path}: {error.message}")
        by_kind[kind] = doc
    runtime = by_kind.get("ServingRuntime")
    isvc = by_kind.get("InferenceService")
    if runtime is None or isvc is None:
        return failures + ["need one ServingRuntime and one InferenceService"]
    spec = runtime.get("spec", {})
    model = isvc.get("spec", {}).get("predictor", {}).get("model", {})
    if model.get("runtime") != runtime.get("metadata", {}).get("name"):
        failures.append("InferenceService: model.runtime is not the ServingRuntime's name")
    formats = {f.get("name") for f in spec.get("supportedModelFormats", [])}
    if model.get("modelFormat", {}).get("name") not in formats:
        failures.append("InferenceService: modelFormat is not one the runtime supports")
    if sorted(spec.get("protocolVersions", [])) != ["grpc-v2", "v2"]:
        failures.append("ServingRuntime: protocolVersions must be [v2, grpc-v2]")
    if model.get("protocolVersion") not in spec.get("protocolVersions", []):
        failures.append("InferenceService: protocolVersion is not one the runtime serves")
    containers = spec.get("containers", [])
    if len(containers) != 1:
        return failures + ["ServingRuntime: expected one container"]
    container = containers[0]
    args = container.get("args", [])
    for a in args:
        name = a[2:].split("=", 1)[0] if a.startswith("--") else None
        if name not in flags:
            failures.append(f"ServingRuntime: {a!r} is not an attention_server flag")
    ports = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
    http, grpc = arg_value(args, "http_port"), arg_value(args, "port")
    if http is None or ports.get("http1") != int(http):
        failures.append("ServingRuntime: port http1 is not --http_port")
    if grpc is None or ports.get("h2c") != int(grpc):
        failures.append("ServingRuntime: port h2c is not --port")
    for probe in ("readinessProbe", "livenessProbe"):
        port = container.get(probe, {}).get("httpGet", {}).get("port")
        if http is None or port != int(http):
            failures.append(f"ServingRuntime: {probe} is not on --http_port")
    if arg_value(args, "model_repository") != "/mnt/models":
        failures.append("ServingRuntime: --model_repository is not /mnt/models "
                        "(where KServe's storage initializer puts storageUri)")
    metrics = runtime.get("metadata", {}).get("annotations", {}).get(
        "prometheus.kserve.io/port")
    if metrics != arg_value(args, "metrics_port"):
        failures.append("ServingRuntime: prometheus.kserve.io/port is not --metrics_port")
    return failures


def mutations(docs):
    """(what, mutated docs): each must fail check()."""
    def runtime(d):
        return next(x for x in d if x["kind"] == "ServingRuntime")

    def isvc(d):
        return next(x for x in d if x["kind"] == "InferenceService")

    def mutate(what, change):
        d = copy.deepcopy(docs)
        change(d)
        return what, d

    def rename(obj, old, new):
        obj[new] = obj.pop(old)

    return [
        mutate("storageUri misspelled storageURI",
               lambda d: rename(isvc(d)["spec"]["predictor"]["model"], "storageUri",
                                "storageURI")),
        mutate("protocolVersions misspelled protocolVersion",
               lambda d: rename(runtime(d)["spec"], "protocolVersions", "protocolVersion")),
        mutate("containerPort misspelled containerport",
               lambda d: rename(runtime(d)["spec"]["containers"][0]["ports"][0],
                                "containerPort", "containerport")),
        mutate("predictor misspelled predicter",
               lambda d: rename(isvc(d)["spec"], "predictor", "predicter")),
        mutate("minReplicas a string",
               lambda d: isvc(d)["spec"]["predictor"].__setitem__("minReplicas", "one")),
        mutate("h2c port not --port",
               lambda d: runtime(d)["spec"]["containers"][0]["ports"][1].__setitem__(
                   "containerPort", 9000)),
        mutate("grpc-v2 dropped",
               lambda d: runtime(d)["spec"].__setitem__("protocolVersions", ["v2"])),
        mutate("an unknown flag",
               lambda d: runtime(d)["spec"]["containers"][0]["args"].append("--htp_port=1")),
        mutate("runtime name differs",
               lambda d: isvc(d)["spec"]["predictor"]["model"].__setitem__("runtime", "x")),
    ]


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    source_dir, binary = sys.argv[1], sys.argv[2]
    schemas = {}
    for name in ("kserve_servingruntimes_schema.json", "kserve_inferenceservices_schema.json"):
        source, schema = load_schema(name)
        schemas[source["kind"]] = (source, schema)
        print(f"{source['kind']}: {source['repository']} {source['path']} at {source['commit']}")
    docs = []
    folder = os.path.join(source_dir, "deploy", "kserve")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".yaml"):
            with open(os.path.join(folder, name)) as f:
                docs += [d for d in yaml.safe_load_all(f) if d]
    flags = flags_of(binary)
    failures = check(docs, schemas, flags)
    for f in failures:
        print("FAIL:", f)
    for what, mutated in mutations(docs):
        caught = check(mutated, schemas, flags)
        if caught:
            print(f"ok: mutation '{what}' caught: {caught[0]}")
        else:
            failures.append(f"mutation '{what}' was not caught")
            print(f"FAIL: mutation '{what}' was not caught")
    print("OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
