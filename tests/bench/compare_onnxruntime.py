#!/usr/bin/python3
"""The core against ONNX Runtime on the same layer, in alternating rounds.

    /usr/bin/python3 tests/bench/compare_onnxruntime.py --bench build/release/tests/bench/mha_core_bench \
        [--rounds 3] [--threads 2] [--min_time 1] [--shapes bert_base,small] [--baseline OTHER_BENCH]

Not a test and not in CI: it installs npm's onnxruntime-node (1.30.0, --ignore-scripts:
the CPU library ships in the package; its postinstall only fetches CUDA files) into
--cache (default ~/.cache/mha-serve/onnxruntime) on first use, and needs Debian's
python3-onnx and python3-numpy and Node.js.

For every shape (self-attention, bias; the shapes of mha_core_bench's Forward/ and of
compare_torch.py) it builds the whole layer, W_o included, as ONNX graphs from the
weights mha_core_bench uses (SeededWeights(config, 1), written again here and checked
against the build's mha_core_bench/../tools/mha_toy_example output first):
  attention  com.microsoft.Attention (packed QKV weights, mask_index = valid lengths)
  mha        three MatMul projections + com.microsoft.MultiHeadAttention (key padding mask)
  unfused    plain ONNX ops: MatMul, Reshape, Transpose, Softmax with an additive mask
Each graph's output is checked against a float64 NumPy reference of the layer (max abs
difference <= 1e-4) before anything is timed. Then, round by round, mha_core_bench
(f32 and bf16 Forward, and oneDNN's 2048^3 GEMM peak) and ONNX Runtime (every graph,
and an Identity graph of the same input) run one after the other. ONNX Runtime's time
is session.run's median minus the Identity graph's (the call's own cost through Node),
both on --threads intra-op threads; ours is mha_core_bench's time per Forward on
OMP_NUM_THREADS=--threads. FLOPs are MultiHeadAttention::Flops for both engines (the
four projections and two attention products at full length, also when padded).

int8 (issue 37): ours is Forward/<shape>/int8 (precision "int8"); ONNX Runtime's is its
own dynamically quantized form of the mha graph, "mha_int8": each projection a
com.microsoft.DynamicQuantizeMatMul (what ORT fuses quantize_dynamic's
DynamicQuantizeLinear + MatMulInteger into: u8 activations with a scale per tensor,
int8 weights, here one scale per output column as ours), attention in f32. int8 graphs
are checked against the reference by relative Frobenius error (<= 2e-2), not 1e-4.
A second table compares int8 with our bf16 and with ORT's int8 graph, with oneDNN's
2048^3 s8 GEMM peak.

--baseline runs a second mha_core_bench (e.g. an earlier commit's) in the same rounds.
Prints the tables of medians over the rounds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError:
    sys.exit("needs Debian's python3-onnx: apt-get install python3-onnx")

ORT_VERSION = "1.30.0"
HERE = os.path.dirname(os.path.abspath(__file__))

SHAPES = [
    # name, B, L, E, h, padded (valid_lens = L/2 for every batch row)
    ("bert_base", 8, 128, 768, 12, False),
    ("long", 1, 2048, 512, 8, False),
    ("small", 1, 16, 256, 8, False),
    ("padded", 1, 2048, 512, 8, True),
]
VARIANTS = ("attention", "mha", "unfused")  # f32 graphs; "mha_int8" is compared apart
MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


# ---- SeededWeights (core/weights.cc), written again: FNV-1a of the tensor's name
# xor the seed starts a SplitMix64 (base/splitmix64.h); each value is
# bound * ((next >> 40) * 2^-23 - 1) with bound = 1/sqrt(fan_in).
def _fnv1a(name):
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def _splitmix64(seed, n):
    with np.errstate(over="ignore"):
        state = np.uint64(seed) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(
            0x9E3779B97F4A7C15)
        z = state
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniform(name, seed, shape, fan_in):
    n = int(np.prod(shape))
    z = _splitmix64(seed ^ _fnv1a(name), n)
    sym = ((z >> np.uint64(40)).astype(np.float64) * 2.0**-23 - 1.0).astype(np.float32)
    bound = np.float32(1.0) / np.sqrt(np.float32(fan_in))
    return (bound * sym).reshape(shape)


def seeded_weights(E, seed=1):
    w = {}
    for m in ("q", "k", "v", "o"):
        w[f"w_{m}"] = uniform(f"W_{m}.weight", seed, (E, E), E)
        w[f"b_{m}"] = uniform(f"W_{m}.bias", seed, (E,), E)
    return w


def _signed(seed, n):
    z = _splitmix64(seed, n)
    return ((z >> np.uint64(11)).astype(np.float64) * 2.0**-53 * 2.0 - 1.0).astype(np.float32)


def check_seeded_weights(toy_example):
    """SeededWeights written again here must be the C++ one: the toy layer (p_o 100, h 5,
    no bias, seed 0) on the toy request (SplitMix64(0) inputs, valid_lens 3, 2) through
    reference() must print mha_toy_example's rows."""
    out = subprocess.run([toy_example], check=True, capture_output=True, text=True).stdout
    rows = [list(map(float, line.split("=")[1].split()))
            for line in out.splitlines() if line.startswith("[")]
    v = _signed(0, 2 * 4 * 100 + 2 * 2 * 6 * 100)
    q, k, vv = v[:800].reshape(2, 4, 100), v[800:2000].reshape(2, 6, 100), v[2000:].reshape(2, 6, 100)
    w = {f"w_{m}": uniform(f"W_{m}.weight", 0, (100, 100), 100) for m in "qkvo"}
    w.update({f"b_{m}": np.zeros(100, dtype=np.float32) for m in "qkvo"})
    ours = np.concatenate([reference(q[b:b + 1], w, 5, valid, k[b:b + 1], vv[b:b + 1])[0, :, :4]
                           for b, valid in enumerate((3, 2))])
    err = float(np.max(np.abs(ours - np.array(rows))))
    if not (len(rows) == 8 and err <= 1e-5):
        sys.exit(f"SeededWeights written again here differ from mha_toy_example's ({err:.3g})")
    print(f"check SeededWeights against {toy_example}: max diff {err:.1e}", file=sys.stderr)


def inputs_of(B, L, E):
    rng = np.random.default_rng(7)
    return rng.uniform(-1.0, 1.0, size=(B, L, E)).astype(np.float32)


def reference(x, w, h, valid, keys=None, values=None):
    """The layer in float64: softmax(q k^T / sqrt(p)) v per head, keys >= valid masked;
    self-attention unless keys and values are given."""
    src = {"q": x, "k": x if keys is None else keys, "v": x if values is None else values}
    B, _, E = x.shape
    p = E // h
    proj = {m: src[m].astype(np.float64) @ w[f"w_{m}"].T.astype(np.float64) + w[f"b_{m}"]
            for m in src}
    heads = {m: proj[m].reshape(B, -1, h, p).transpose(0, 2, 1, 3) for m in proj}
    s = heads["q"] @ heads["k"].transpose(0, 1, 3, 2) / np.sqrt(p)
    s[..., valid:] = -np.inf
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    a = s / s.sum(axis=-1, keepdims=True)
    ctx = (a @ heads["v"]).transpose(0, 2, 1, 3).reshape(B, -1, E)
    return ctx @ w["w_o"].T.astype(np.float64) + w["b_o"]


def flops(B, L, E):
    # MultiHeadAttention::Flops, dot-product scoring, d_q = d_k = d_v = E.
    return 2 * B * E * (4 * L * E) + 4 * B * L * L * E


# ---- the graphs
def _init(name, array):
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def _linear(nodes, inits, w, m, src, dst):
    """dst = src W_m^T + b_m."""
    inits += [_init(f"w_{m}_t", w[f"w_{m}"].T), _init(f"b_{m}", w[f"b_{m}"])]
    nodes += [helper.make_node("MatMul", [src, f"w_{m}_t"], [f"{m}_mm"]),
              helper.make_node("Add", [f"{m}_mm", f"b_{m}"], [dst])]


def _output_projection(nodes, inits, w, src):
    _linear(nodes, inits, w, "o", src, "output")


def graph_attention(B, L, E, h, w, padded):
    nodes, inits = [], []
    inits.append(_init("qkv_w", np.concatenate([w["w_q"].T, w["w_k"].T, w["w_v"].T], axis=1)))
    inits.append(_init("qkv_b", np.concatenate([w["b_q"], w["b_k"], w["b_v"]])))
    ins = ["input", "qkv_w", "qkv_b"]
    graph_inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [B, L, E])]
    if padded:
        ins.append("mask_index")
        graph_inputs.append(helper.make_tensor_value_info("mask_index", TensorProto.INT32, [B]))
    nodes.append(helper.make_node("Attention", ins, ["ctx"], domain="com.microsoft",
                                  num_heads=h))
    _output_projection(nodes, inits, w, "ctx")
    return nodes, inits, graph_inputs


def graph_mha(B, L, E, h, w, padded, linear=_linear):
    """Three projections, com.microsoft.MultiHeadAttention, W_o; `linear` makes each
    projection (_quantized_linear: ONNX Runtime's int8 form)."""
    nodes, inits = [], []
    graph_inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [B, L, E])]
    for m in ("q", "k", "v"):
        linear(nodes, inits, w, m, "input", m)
    ins = ["q", "k", "v"]
    if padded:
        ins += ["", "mask_index"]
        graph_inputs.append(helper.make_tensor_value_info("mask_index", TensorProto.INT32, [B]))
    nodes.append(helper.make_node("MultiHeadAttention", ins, ["ctx"], domain="com.microsoft",
                                  num_heads=h))
    linear(nodes, inits, w, "o", "ctx", "output")
    return nodes, inits, graph_inputs


def _quantized_linear(nodes, inits, w, m, src, dst):
    """dst = src W_m^T + b_m with W_m int8, one scale per output column."""
    wt = w[f"w_{m}"].T.astype(np.float64)  # (in, out)
    scale = np.max(np.abs(wt), axis=0) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(wt / scale), -127, 127).astype(np.int8)
    inits += [_init(f"w_{m}_q", q), _init(f"w_{m}_scale", scale.astype(np.float32)),
              _init(f"b_{m}", w[f"b_{m}"])]
    nodes.append(helper.make_node("DynamicQuantizeMatMul",
                                  [src, f"w_{m}_q", f"w_{m}_scale", "", f"b_{m}"], [dst],
                                  domain="com.microsoft"))


def graph_mha_int8(B, L, E, h, w, padded):
    return graph_mha(B, L, E, h, w, padded, linear=_quantized_linear)


def graph_unfused(B, L, E, h, w, padded):
    p = E // h
    nodes, inits = [], []
    graph_inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [B, L, E])]
    inits.append(_init("heads_shape", np.array([B, L, h, p], dtype=np.int64)))
    inits.append(_init("ctx_shape", np.array([B, L, E], dtype=np.int64)))
    inits.append(_init("scale", np.array(1.0 / np.sqrt(p), dtype=np.float32)))
    for m in ("q", "k", "v"):
        _linear(nodes, inits, w, m, "input", f"{m}_rows")
        nodes.append(helper.make_node("Reshape", [f"{m}_rows", "heads_shape"], [f"{m}_4d"]))
        perm = [0, 2, 3, 1] if m == "k" else [0, 2, 1, 3]  # k transposed for q k^T
        nodes.append(helper.make_node("Transpose", [f"{m}_4d"], [f"{m}_h"], perm=perm))
    nodes.append(helper.make_node("MatMul", ["q_h", "k_h"], ["s_raw"]))
    nodes.append(helper.make_node("Mul", ["s_raw", "scale"], ["s_scaled"]))
    scores = "s_scaled"
    if padded:
        # An additive mask (B, 1, 1, L): 0 for keys < valid, -inf beyond.
        graph_inputs.append(
            helper.make_tensor_value_info("key_mask", TensorProto.FLOAT, [B, 1, 1, L]))
        nodes.append(helper.make_node("Add", ["s_scaled", "key_mask"], ["s_masked"]))
        scores = "s_masked"
    nodes.append(helper.make_node("Softmax", [scores], ["a"], axis=-1))
    nodes.append(helper.make_node("MatMul", ["a", "v_h"], ["ctx_h"]))
    nodes.append(helper.make_node("Transpose", ["ctx_h"], ["ctx_t"], perm=[0, 2, 1, 3]))
    nodes.append(helper.make_node("Reshape", ["ctx_t", "ctx_shape"], ["ctx"]))
    _output_projection(nodes, inits, w, "ctx")
    return nodes, inits, graph_inputs


def save_graph(path, name, nodes, inits, graph_inputs, out_dims):
    out = helper.make_tensor_value_info("output", TensorProto.FLOAT, out_dims)
    g = helper.make_graph(nodes, name, graph_inputs, [out], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    onnx.save(model, path)


def save_identity(path, dims):
    g = helper.make_graph([helper.make_node("Identity", ["input"], ["output"])], "identity",
                          [helper.make_tensor_value_info("input", TensorProto.FLOAT, dims)],
                          [helper.make_tensor_value_info("output", TensorProto.FLOAT, dims)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


# ---- running
def ensure_onnxruntime(cache):
    module = os.path.join(cache, "node_modules", "onnxruntime-node")
    if not os.path.isdir(module):
        os.makedirs(cache, exist_ok=True)
        print(f"installing onnxruntime-node@{ORT_VERSION} into {cache}", file=sys.stderr)
        subprocess.run(["npm", "install", "--prefix", cache, "--ignore-scripts", "--no-audit",
                        "--no-fund", f"onnxruntime-node@{ORT_VERSION}"], check=True,
                       stdout=subprocess.DEVNULL)
    return module


def run_ort(job, work):
    path = os.path.join(work, "job.json")
    with open(path, "w") as f:
        json.dump(job, f)
    out = subprocess.run(["node", os.path.join(HERE, "ort_time.js"), path], check=True,
                         capture_output=True, text=True)
    return {r["name"]: r["median_ms"] for r in map(json.loads, out.stdout.split("\n")[:-1])}


def run_ours(bench, shapes, threads, min_time):
    names = "|".join(s[0] for s in shapes)
    out = subprocess.run([bench, f"--benchmark_filter=^(Forward/({names})/|GemmPeak/)",
                          f"--benchmark_min_time={min_time}", "--benchmark_format=json"],
                         check=True, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    result = {}
    for b in json.loads(out.stdout)["benchmarks"]:
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b["time_unit"]]
        parts = b["name"].split("/")
        result["/".join(parts[:3]) if parts[0] == "Forward" else "/".join(parts[:2])] = (
            b["real_time"] * scale, b.get("GFLOPS", 0.0))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", required=True, help="mha_core_bench of the build to compare")
    ap.add_argument("--baseline", help="a second mha_core_bench, run in the same rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min_time", type=float, default=1.0, help="seconds per figure per round")
    ap.add_argument("--shapes", help="subset of " + ",".join(s[0] for s in SHAPES))
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/mha-serve/onnxruntime"))
    args = ap.parse_args()
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    toy_example = os.path.join(os.path.dirname(args.bench), "..", "tools", "mha_toy_example")
    if not os.path.exists(toy_example):
        sys.exit(f"{toy_example}: not built (the check that the weights are mha_core_bench's)")
    check_seeded_weights(toy_example)
    module = ensure_onnxruntime(args.cache)
    work = tempfile.mkdtemp(prefix="mha_ort.")

    graphs, check = [], {}
    for name, B, L, E, h, padded in shapes:
        w = seeded_weights(E)
        x = inputs_of(B, L, E)
        valid = L // 2 if padded else L
        x.tofile(os.path.join(work, f"{name}_x.bin"))
        np.full(B, valid, dtype=np.int32).tofile(os.path.join(work, f"{name}_lens.bin"))
        key_mask = np.zeros((B, 1, 1, L), dtype=np.float32)
        key_mask[..., valid:] = -np.inf
        key_mask.tofile(os.path.join(work, f"{name}_mask.bin"))
        check[name] = reference(x, w, h, valid)
        for variant, build in (("attention", graph_attention), ("mha", graph_mha),
                               ("unfused", graph_unfused), ("mha_int8", graph_mha_int8)):
            nodes, inits, graph_inputs = build(B, L, E, h, w, padded)
            path = os.path.join(work, f"{name}_{variant}.onnx")
            save_graph(path, f"{name}_{variant}", nodes, inits, graph_inputs, [B, L, E])
            feeds = [{"name": "input", "type": "float32", "dims": [B, L, E],
                      "file": os.path.join(work, f"{name}_x.bin")}]
            if padded and variant == "unfused":
                feeds.append({"name": "key_mask", "type": "float32", "dims": [B, 1, 1, L],
                              "file": os.path.join(work, f"{name}_mask.bin")})
            elif padded:
                feeds.append({"name": "mask_index", "type": "int32", "dims": [B],
                              "file": os.path.join(work, f"{name}_lens.bin")})
            graphs.append({"name": f"{name}/{variant}", "path": path, "inputs": feeds,
                           "dump": None})
        ident = os.path.join(work, f"{name}_identity.onnx")
        save_identity(ident, [B, L, E])
        graphs.append({"name": f"{name}/identity", "path": ident, "dump": None,
                       "inputs": [{"name": "input", "type": "float32", "dims": [B, L, E],
                                   "file": os.path.join(work, f"{name}_x.bin")}]})

    # Every graph against the reference before anything is timed.
    checked = [dict(g, dump=os.path.join(work, g["name"].replace("/", "_") + ".out"))
               for g in graphs if not g["name"].endswith("/identity")]
    run_ort({"module": module, "threads": args.threads, "min_time": 0, "graphs": checked}, work)
    for g in checked:
        shape = g["name"].split("/")[0]
        got = np.fromfile(g["dump"], dtype=np.float32).reshape(check[shape].shape)
        err = float(np.max(np.abs(got - check[shape])))
        if g["name"].endswith("_int8"):
            rel = float(np.linalg.norm(got - check[shape]) / np.linalg.norm(check[shape]))
            print(f"check {g['name']:22s} relative Frobenius {rel:.2e}, max abs {err:.2e}",
                  file=sys.stderr)
            if not rel <= 2e-2:
                sys.exit(f"{g['name']}: relative Frobenius error {rel:.3g} (> 2e-2)")
            continue
        print(f"check {g['name']:22s} max |ORT - reference| = {err:.2e}", file=sys.stderr)
        if not err <= 1e-4:
            sys.exit(f"{g['name']}: differs from the reference by {err:.3g} (> 1e-4)")

    rounds = []
    for r in range(args.rounds):
        figures = {"ours": run_ours(args.bench, shapes, args.threads, args.min_time)}
        if args.baseline:
            figures["baseline"] = run_ours(args.baseline, shapes, args.threads, args.min_time)
        figures["ort"] = run_ort({"module": module, "threads": args.threads,
                                  "min_time": args.min_time, "graphs": graphs}, work)
        rounds.append(figures)
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)

    def med(f):
        return statistics.median(f(r) for r in rounds)

    peak = {p: med(lambda r: r["ours"][f"GemmPeak/{p}"][1]) for p in ("f32", "bf16", "int8")}
    print(f"ONNX Runtime {ORT_VERSION} (onnxruntime-node), {args.threads} threads each; "
          f"medians of {args.rounds} alternated rounds")
    print(f"oneDNN 2048^3 GEMM peak in the same run: f32 {peak['f32']:.1f} GFLOP/s, "
          f"bf16 {peak['bf16']:.1f} GFLOP/s")
    head = ("| shape | ours f32 ms | ours bf16 ms | ORT ms (best variant) | ORT call ms "
            "| ORT/ours f32 | ORT/ours bf16 | ours f32 GFLOP/s (% f32 peak) "
            "| ours bf16 GFLOP/s (% bf16 peak) | ORT GFLOP/s |")
    if args.baseline:
        head += " baseline f32 ms | baseline bf16 ms |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    variants = []
    for name, B, L, E, h, padded in shapes:
        f = flops(B, L, E)
        ours = {p: med(lambda r: r["ours"][f"Forward/{name}/{p}"][0]) for p in ("f32", "bf16")}
        call = med(lambda r: r["ort"][f"{name}/identity"])
        ort_by = {v: med(lambda r: r["ort"][f"{name}/{v}"]) - call for v in VARIANTS}
        variants.append(f"{name} " + ", ".join(f"{v} {t:.3f}" for v, t in ort_by.items()))
        best = min(ort_by, key=ort_by.get)
        ort = ort_by[best]
        gf = {p: f / ours[p] * 1e-6 for p in ours}
        row = (f"| {name} | {ours['f32']:.3f} | {ours['bf16']:.3f} | {ort:.3f} ({best}) "
               f"| {call:.3f} | {ort / ours['f32']:.2f}x | {ort / ours['bf16']:.2f}x "
               f"| {gf['f32']:.1f} ({100 * gf['f32'] / peak['f32']:.1f}%) "
               f"| {gf['bf16']:.1f} ({100 * gf['bf16'] / peak['bf16']:.1f}%) "
               f"| {f / ort * 1e-6:.0f} |")
        if args.baseline:
            base = {p: med(lambda r: r["baseline"][f"Forward/{name}/{p}"][0])
                    for p in ("f32", "bf16")}
            row += f" {base['f32']:.3f} | {base['bf16']:.3f} |"
        print(row)
    print("ORT variants (ms, call cost subtracted): " + "; ".join(variants))
    print()
    print(f"int8: oneDNN 2048^3 s8 GEMM peak in the same run {peak['int8']:.0f} GOP/s")
    head = ("| shape | ours int8 ms | ours bf16 ms | ours bf16 / int8 | ORT int8 ms (mha_int8) "
            "| ORT int8 / ours int8 | ours f32 / int8 | ours int8 GFLOP/s |")
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for name, B, L, E, h, padded in shapes:
        ours = {p: med(lambda r: r["ours"][f"Forward/{name}/{p}"][0])
                for p in ("f32", "bf16", "int8")}
        call = med(lambda r: r["ort"][f"{name}/identity"])
        ort8 = med(lambda r: r["ort"][f"{name}/mha_int8"]) - call
        print(f"| {name} | {ours['int8']:.3f} | {ours['bf16']:.3f} "
              f"| {ours['bf16'] / ours['int8']:.2f}x | {ort8:.3f} | {ort8 / ours['int8']:.2f}x "
              f"| {ours['f32'] / ours['int8']:.2f}x | {flops(B, L, E) / ours['int8'] * 1e-6:.0f} |")


if __name__ == "__main__":
    main()
