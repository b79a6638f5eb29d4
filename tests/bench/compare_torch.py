#!/usr/bin/python3
"""Benchmark PyTorch 1.13 nn.MultiheadAttention against our Google Benchmark results.

    /usr/bin/python3 tests/bench/compare_torch.py --ours build/release/ours.json \
        [--threads N] [--min_time 2] [--json OUT]

Shapes (self-attention, batch_first, bias, eval, no_grad, need_weights=False, f32):
  bert_base  B=8 L=128  E=768 h=12
  long       B=1 L=2048 E=512 h=8
  small      B=1 L=16   E=256 h=8
  padded     as `long`, key_padding_mask masks keys >= L/2
FLOPs per call (full length, also for padded): 4*2*B*L*E*E + 2*2*B*L*L*E.

--additive compares additive scoring instead: d2l's MultiHeadAttention with d2l's
AdditiveAttention pooling (shared by the heads, num_hiddens p_a = 64), which broadcasts
a (B*h, Q, K, p_a) tensor through tanh, against our "Additive/<shape>/<precision>"
entries, as times (ratio = torch ms / ours ms):
  additive_128   B=4 L=128  E=256 h=8 p_a=64
  additive_1024  B=1 L=1024 E=256 h=8 p_a=64
Peak memory: run each under /usr/bin/time -v in its own process, e.g.
  /usr/bin/time -v tests/bench/compare_torch.py --additive --shapes additive_1024
  /usr/bin/time -v mha_core_bench --benchmark_filter=Additive/additive_1024/f32

`--ours` is Google Benchmark `--benchmark_format=json` output with entries named
"Forward/<shape>/<f32|bf16>/..." carrying a "GFLOPS" user counter.
ratio = ours GFLOP/s / torch GFLOP/s (> 1: ours is faster).

Caveat: in this Firecracker VM first-touch page faults are very slow, and glibc
returns the large (>32 MB) score buffers to the OS after every call, so torch's
long/padded figures are dominated by page faults. --malloc_cache re-runs with
MALLOC_MMAP_MAX_=0 to show torch without that cost; --torch_path slow bypasses
torch 1.13's native fast path (which is slower than the regular path here).
"""

import argparse
import json
import os
import statistics
import sys
import time

SHAPES = [
    # name, B, L, E, h, padded
    ("bert_base", 8, 128, 768, 12, False),
    ("long", 1, 2048, 512, 8, False),
    ("small", 1, 16, 256, 8, False),
    ("padded", 1, 2048, 512, 8, True),
]
ADDITIVE_SHAPES = [
    # name, B, L, E, h, p_a
    ("additive_128", 4, 128, 256, 8, 64),
    ("additive_1024", 1, 1024, 256, 8, 64),
]
PRECISIONS = ("f32", "bf16")
_UNIT_TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def flops(B, L, E):
    return 4 * 2 * B * L * E * E + 2 * 2 * B * L * L * E


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ours", help="Google Benchmark JSON of our core (optional)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch intra-op threads (default: os.cpu_count())")
    ap.add_argument("--min_time", type=float, default=2.0,
                    help="seconds of timed repeats per shape (default 2)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up calls per shape")
    ap.add_argument("--json", dest="json_out", help="write the result table as JSON here")
    ap.add_argument("--shapes", help="comma-separated subset of: "
                    + ",".join(s[0] for s in SHAPES + ADDITIVE_SHAPES))
    ap.add_argument("--additive", action="store_true",
                    help="additive scoring: d2l's broadcast AdditiveAttention vs our "
                         "Additive/ entries")
    ap.add_argument("--torch_path", choices=("auto", "slow"), default="auto",
                    help="auto: eval mode, torch picks its native fast path when eligible "
                         "(default); slow: force F.multi_head_attention_forward (train mode "
                         "with dropout=0 under no_grad, identical math)")
    ap.add_argument("--malloc_cache", action="store_true",
                    help="re-exec with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=huge so glibc "
                         "keeps freed memory instead of munmap/mmap + page faults every call")
    return ap.parse_args()


# The thread count must be in the environment before torch (and its OpenMP /
# OpenBLAS runtimes) is loaded.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.malloc_cache and os.environ.get("MALLOC_MMAP_MAX_") != "0":
    os.environ["MALLOC_MMAP_MAX_"] = "0"
    os.environ["MALLOC_TRIM_THRESHOLD_"] = str(1 << 40)
    os.execv(sys.executable, [sys.executable] + sys.argv)
if ARGS is not None:
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["OPENBLAS_NUM_THREADS"] = str(ARGS.threads)
    os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402
from torch import nn  # noqa: E402


# --------------------------------------------------------------------------------------
# BLAS detection
# --------------------------------------------------------------------------------------
def blas_info():
    """Which BLAS/LAPACK libraries torch has mapped, after running a matmul."""
    a = torch.randn(256, 256)
    (a @ a).sum().item()
    libs = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    path = parts[5]
                    base = os.path.basename(path).lower()
                    if any(k in base for k in ("blas", "lapack", "mkl", "blis", "dnnl", "atlas")):
                        if path not in libs:
                            libs.append(path)
    except OSError as e:
        return {"libs": [], "kind": f"unknown ({e})", "config": None, "threads": None}

    kind = "unknown"
    config = nthreads = None
    blas_libs = [p for p in libs if "blas" in os.path.basename(p).lower() or "mkl" in p.lower()
                 or "blis" in p.lower()]
    if any("mkl" in p.lower() for p in blas_libs):
        kind = "MKL"
    elif any("openblas" in p.lower() for p in blas_libs):
        kind = "OpenBLAS"
    elif any("blis" in p.lower() for p in blas_libs):
        kind = "BLIS"
    elif any("atlas" in p.lower() for p in blas_libs):
        kind = "ATLAS"
    elif any(os.path.basename(p).startswith("libblas.so") for p in blas_libs):
        kind = "REFERENCE (netlib libblas)"
    # Ask OpenBLAS itself (works whatever the file is called).
    try:
        import ctypes
        for p in blas_libs:
            lib = ctypes.CDLL(p)
            if hasattr(lib, "openblas_get_config"):
                lib.openblas_get_config.restype = ctypes.c_char_p
                config = lib.openblas_get_config().decode()
                if hasattr(lib, "openblas_get_num_threads"):
                    nthreads = lib.openblas_get_num_threads()
                if hasattr(lib, "openblas_get_corename"):
                    lib.openblas_get_corename.restype = ctypes.c_char_p
                    config += f" (core: {lib.openblas_get_corename().decode()})"
                kind = "OpenBLAS"
                break
    except Exception:  # pragma: no cover - informational only
        pass
    return {"libs": libs, "kind": kind, "config": config, "threads": nthreads}


# --------------------------------------------------------------------------------------
# torch timing
# --------------------------------------------------------------------------------------
def fast_path_used(mha, x, kpm):
    """True if nn.MultiheadAttention dispatched to torch._native_multi_head_attention."""
    try:
        with torch.autograd.profiler.profile() as prof:
            mha(x, x, x, key_padding_mask=kpm, need_weights=False)
        return any("_native_multi_head_attention" in e.name for e in prof.function_events)
    except Exception:
        return None


def _busy_seconds():
    """(busy CPU seconds of the whole machine, CPU seconds of this process)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system


def bench_torch(name, B, L, E, h, padded, min_time, warmup, torch_path="auto"):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, h, bias=True, batch_first=True, dropout=0.0).eval()
    if torch_path == "slow":
        mha.train()  # dropout is 0.0: same math, but bypasses the native fast path
    x = torch.randn(B, L, E)
    kpm = None
    if padded:
        kpm = torch.arange(L)[None, :].expand(B, L) >= L // 2  # True = masked
    times = []
    with torch.no_grad():
        for _ in range(warmup):
            mha(x, x, x, key_padding_mask=kpm, need_weights=False)
        fast = fast_path_used(mha, x, kpm)
        busy0, own0 = _busy_seconds()
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            mha(x, x, x, key_padding_mask=kpm, need_weights=False)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            if t1 - start >= min_time and len(times) >= 3:
                break
    busy1, own1 = _busy_seconds()
    wall = time.perf_counter() - start
    # CPUs' worth of work done by *other* processes while we were timing (noise indicator)
    foreign = max(0.0, ((busy1 - busy0) - (own1 - own0)) / wall)
    ms = statistics.median(times) * 1e3
    return {"ms": ms, "gflops": flops(B, L, E) / (ms * 1e-3) / 1e9, "reps": len(times),
            "fast_path": fast, "foreign_cpus": foreign}


class D2LAdditiveMultiHeadAttention(nn.Module):
    """d2l's MultiHeadAttention (bias) with d2l's AdditiveAttention as its pooling."""

    def __init__(self, E, h, p_a):
        super().__init__()
        self.h = h
        p = E // h
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(E, E) for _ in range(4))
        self.score_q = nn.Linear(p, p_a, bias=False)
        self.score_k = nn.Linear(p, p_a, bias=False)
        self.score_v = nn.Linear(p_a, 1, bias=False)

    def split(self, x):  # (B, L, E) -> (B*h, L, p)
        B, L, _ = x.shape
        return x.reshape(B, L, self.h, -1).permute(0, 2, 1, 3).reshape(B * self.h, L, -1)

    def forward(self, x):
        q, k, v = self.split(self.W_q(x)), self.split(self.W_k(x)), self.split(self.W_v(x))
        features = torch.tanh(self.score_q(q).unsqueeze(2) + self.score_k(k).unsqueeze(1))
        weights = nn.functional.softmax(self.score_v(features).squeeze(-1), dim=-1)
        out = torch.bmm(weights, v)  # (B*h, L, p)
        B = x.shape[0]
        out = out.reshape(B, self.h, out.shape[1], -1).permute(0, 2, 1, 3).reshape(x.shape)
        return self.W_o(out)


def bench_torch_additive(B, L, E, h, p_a, min_time, warmup):
    torch.manual_seed(0)
    mod = D2LAdditiveMultiHeadAttention(E, h, p_a).eval()
    x = torch.randn(B, L, E)
    times = []
    with torch.no_grad():
        for _ in range(warmup):
            mod(x)
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            mod(x)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            if t1 - start >= min_time and len(times) >= 3:
                break
    return {"ms": statistics.median(times) * 1e3, "reps": len(times)}


def additive_main(args):
    ours = {}
    if args.ours and os.path.exists(args.ours):
        with open(args.ours) as f:
            for b in json.load(f).get("benchmarks", []):
                parts = b.get("name", "").split("/")
                if len(parts) >= 3 and parts[0] == "Additive" and "real_time" in b:
                    ms = float(b["real_time"]) * _UNIT_TO_MS[b.get("time_unit", "ns")]
                    ours[(parts[1], parts[2])] = ms
    wanted = set(args.shapes.split(",")) if args.shapes else None
    print(f"torch {torch.__version__}  threads={torch.get_num_threads()}  additive scoring")
    print("shape | torch ms | ours f32 ms | torch/ours f32 | ours bf16 ms | torch/ours bf16")
    for name, B, L, E, h, p_a in ADDITIVE_SHAPES:
        if wanted and name not in wanted:
            continue
        t = bench_torch_additive(B, L, E, h, p_a, args.min_time, args.warmup)
        cells = [name, f"{t['ms']:.2f}"]
        for prec in PRECISIONS:
            o = ours.get((name, prec))
            cells += [fmt(o, ".2f"), fmt(t["ms"] / o if o else None, ".2f")]
        print(" | ".join(cells), flush=True)
    return 0


# --------------------------------------------------------------------------------------
# our Google Benchmark JSON
# --------------------------------------------------------------------------------------
def load_ours(path):
    """-> {(shape, precision): {"ms": float, "gflops": float}} (median over entries)."""
    with open(path) as f:
        doc = json.load(f)
    per_key = {}
    aggregates = {}
    for b in doc.get("benchmarks", []):
        parts = b.get("run_name", b.get("name", "")).split("/")
        if len(parts) < 3 or parts[0] != "Forward":
            continue
        shape, prec = parts[1], parts[2].lower()
        if prec == "fp32":
            prec = "f32"
        if "real_time" not in b:
            continue
        ms = float(b["real_time"]) * _UNIT_TO_MS[b.get("time_unit", "ns")]
        g = b.get("GFLOPS")
        sh = next((s for s in SHAPES if s[0] == shape), None)
        g_rt = flops(sh[1], sh[2], sh[3]) / (ms * 1e-3) / 1e9 if sh else float("nan")
        if g is None:
            g = g_rt
        elif sh and abs(float(g) / g_rt - 1.0) > 0.05:
            print(f"note: {b.get('name')}: GFLOPS counter {float(g):.1f} != FLOPs/real_time "
                  f"{g_rt:.1f} (counter over CPU time, or different FLOP count?)")
        entry = {"ms": ms, "gflops": float(g)}
        if b.get("run_type") == "aggregate":
            aggregates.setdefault((shape, prec), {})[b.get("aggregate_name")] = entry
        else:
            per_key.setdefault((shape, prec), []).append(entry)
    out = {}
    for key, entries in per_key.items():
        out[key] = {"ms": statistics.median(e["ms"] for e in entries),
                    "gflops": statistics.median(e["gflops"] for e in entries)}
    for key, aggs in aggregates.items():  # prefer GB's own median aggregate
        if "median" in aggs:
            out[key] = aggs["median"]
        elif key not in out and "mean" in aggs:
            out[key] = aggs["mean"]
    return out


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main():
    args = ARGS
    torch.set_num_threads(args.threads)
    if args.additive:
        return additive_main(args)

    info = blas_info()
    print(f"torch {torch.__version__}  threads={torch.get_num_threads()} "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})  cpu_count={os.cpu_count()}")
    print(f"BLAS: {info['kind']}")
    for p in info["libs"]:
        print(f"  mapped: {p}")
    if info["config"]:
        print(f"  openblas_get_config: {info['config']}  threads={info['threads']}")
    print(f"torch path: {args.torch_path}   malloc: "
          + ("cached (MALLOC_MMAP_MAX_=0)" if os.environ.get("MALLOC_MMAP_MAX_") == "0"
             else "glibc default"))
    for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if k in os.environ:
            print(f"  env {k}={os.environ[k]}")
    if info["kind"].startswith("REFERENCE") or info["kind"].startswith("unknown"):
        bar = "!" * 78
        print(f"{bar}\n!!! WARNING: torch is NOT using an optimized BLAS ({info['kind']}).\n"
              f"!!! Torch figures are meaningless for comparison. Install/select OpenBLAS:\n"
              f"!!!   update-alternatives --config libblas.so.3-x86_64-linux-gnu\n{bar}")

    ours = {}
    if args.ours:
        if os.path.exists(args.ours):
            ours = load_ours(args.ours)
            if not ours:
                print(f"note: no Forward/<shape>/<precision> entries in {args.ours}")
        else:
            print(f"note: {args.ours} not found; printing torch figures only")

    shapes = SHAPES
    if args.shapes:
        wanted = set(args.shapes.split(","))
        shapes = [s for s in SHAPES if s[0] in wanted]

    rows = []
    for name, B, L, E, h, padded in shapes:
        t = bench_torch(name, B, L, E, h, padded, args.min_time, args.warmup, args.torch_path)
        row = {"shape": name, "B": B, "L": L, "E": E, "heads": h, "padded": padded,
               "gflop_per_call": flops(B, L, E) / 1e9,
               "torch_ms": t["ms"], "torch_gflops": t["gflops"], "torch_reps": t["reps"],
               "torch_fast_path": t["fast_path"], "foreign_cpus": t["foreign_cpus"]}
        for prec in PRECISIONS:
            o = ours.get((name, prec))
            row[f"ours_{prec}_ms"] = o["ms"] if o else None
            row[f"ours_{prec}_gflops"] = o["gflops"] if o else None
            row[f"ratio_{prec}"] = o["gflops"] / t["gflops"] if o else None
        rows.append(row)
        print(f"  measured {name}: {t['ms']:.3f} ms over {t['reps']} reps "
              f"(fast path: {t['fast_path']}; other processes busy: "
              f"{t['foreign_cpus']:.2f} CPUs)", flush=True)
        if t["foreign_cpus"] > 0.25:
            print(f"  WARNING: other processes used {t['foreign_cpus']:.2f} CPUs while timing "
                  f"{name}; torch figures are unreliable", flush=True)

    hdr = ["shape", "torch ms", "torch GFLOP/s", "ours f32 GFLOP/s", "ratio f32",
           "ours bf16 GFLOP/s", "ratio bf16"]
    table = [[r["shape"], fmt(r["torch_ms"], ".3f"), fmt(r["torch_gflops"], ".1f"),
              fmt(r["ours_f32_gflops"], ".1f"), fmt(r["ratio_f32"], ".2f"),
              fmt(r["ours_bf16_gflops"], ".1f"), fmt(r["ratio_bf16"], ".2f")] for r in rows]
    widths = [max(len(hdr[i]), *(len(t[i]) for t in table)) for i in range(len(hdr))]
    line = " | ".join(h.ljust(w) for h, w in zip(hdr, widths))
    print()
    print(line)
    print("-+-".join("-" * w for w in widths))
    for t in table:
        print(" | ".join(c.ljust(w) for c, w in zip(t, widths)))
    print("(ratio = ours GFLOP/s / torch GFLOP/s; FLOPs counted at full length, also for padded)")

    by = {r["shape"]: r for r in rows}
    pad = {}
    if "padded" in by and "long" in by:
        pad["torch"] = by["padded"]["torch_ms"] / by["long"]["torch_ms"]
        o_p, o_l = ours.get(("padded", "f32")), ours.get(("long", "f32"))
        pad["ours_f32"] = o_p["ms"] / o_l["ms"] if o_p and o_l else None
        o_p, o_l = ours.get(("padded", "bf16")), ours.get(("long", "bf16"))
        pad["ours_bf16"] = o_p["ms"] / o_l["ms"] if o_p and o_l else None
        print(f"\npadded/unpadded time ratio (long shape, keys >= L/2 masked):  "
              f"torch {fmt(pad['torch'], '.3f')}   ours f32 {fmt(pad['ours_f32'], '.3f')}"
              + (f"   ours bf16 {fmt(pad['ours_bf16'], '.3f')}" if pad["ours_bf16"] else ""))

    if args.json_out:
        doc = {"torch_version": torch.__version__, "threads": torch.get_num_threads(),
               "min_time_s": args.min_time, "blas": info, "torch_path": args.torch_path,
               "malloc_cache": os.environ.get("MALLOC_MMAP_MAX_") == "0", "ours_json": args.ours,
               "rows": rows, "padded_over_unpadded_time": pad}
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    sys.exit(main())
