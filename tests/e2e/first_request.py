#!/usr/bin/env python3
"""The first request of each warmed kind on a fresh server, against the median of the
next 20 (issue 40: first <= 2x that median).

  first_request.py SERVER SOURCE_DIR [--rounds=3] [--next=20] [--bound=2]

Kinds, each on its own fresh server (attention_server --port=0, started and warmed
up; the channel is connected by a ListModels call before the timed request, so the
first request pays for compute, not for the connection):
  tour        the README tour's first request: the embedded default model (no
              repository), attention_client's default request: B 2, Q 4, K 6 with
              keys and values, valid_lens [3, 2] (cross-attention);
  bert_self   bert_base (deploy/models), B 1 x Q 96, self-attention (no keys);
  bert_cross  bert_base, B 2, Q 24, K 40 with keys: cross-attention, K != Q.
Times are the client's round trip (Client.call_bytes on pre-encoded requests) and
the server's compute time (the response's Timing). A control follows the 20: the same
request again after an idle spell as long as the one between the server's start and
the first request (the "idle" columns), on the now warm server: what a cold CPU cache
and a sleeping core cost a request that needs nothing built. Prints one line per kind and round,
and the worst round per kind. Exit 1 when a kind's first request is over the bound in
any round. Slow (about a minute, most of it warm-ups): skipped (exit 77) unless
MHA_SLOW_TESTS=1, like the other e2e measurements. The client shares the machine's
cores with the server; run it on a quiet machine.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
from server_harness import start_server, stop_server  # noqa: E402


def kinds(repo):
    return {
        "tour": ([], dict(model="", batch=2, queries=4, keys=6, size=100, valid_lens=[3, 2])),
        # the same without valid_lens (diagnosis)
        "tour_nolens": ([], dict(model="", batch=2, queries=4, keys=6, size=100)),
        "bert_self": ([f"--model_repository={repo}"],
                      dict(model="bert_base", batch=1, queries=96, keys=0, size=768)),
        "bert_cross": ([f"--model_repository={repo}"],
                       dict(model="bert_base", batch=2, queries=24, keys=40, size=768)),
    }


def encode(mha, shape):
    from mha_serve.toy import uniform_inputs
    b, q, k, d = shape["batch"], shape["queries"], shape["keys"], shape["size"]
    if k:
        queries, keys, values = uniform_inputs(0, [(b, q, d), (b, k, d), (b, k, d)])
    else:
        (queries,) = uniform_inputs(0, [(b, q, d)])
        keys = values = None
    return mha.encode_request(queries, keys, values, shape.get("valid_lens"), False, None,
                              False, shape["model"])


def measure(server, args, shape, following, connect_attend):
    import grpc
    import mha_serve.client as mha
    from mha_serve._proto import attention_pb2 as pb2
    request = encode(mha, shape)
    absent = encode(mha, dict(shape, model="no_such_model"))
    proc, target = start_server(server, args, timeout=300)
    ready = time.perf_counter()
    try:
        with mha.Client(target) as client:
            client.models()  # connects the channel; touches no model
            if connect_attend:
                # The connection's first Attend stream (HTTP/2 header tables, the method's
                # first call on the channel, both ends), on a model the server does not
                # have: a new connection costs this on a warm server too.
                try:
                    client.call_bytes(absent)
                except mha.Error as e:
                    if e.code != grpc.StatusCode.NOT_FOUND:
                        raise
            times, computes = [], []

            def timed():
                start = time.perf_counter()
                reply = client.call_bytes(request)
                times.append((time.perf_counter() - start) * 1e3)
                computes.append(pb2.AttendResponse.FromString(reply).timing.compute_us / 1e3)

            idle = time.perf_counter() - ready
            for _ in range(1 + following):
                timed()
            # The control: the same request after as long an idle spell on the now warm
            # server (cold CPU caches, a sleeping core), the last figure of each list.
            time.sleep(idle)
            timed()
    finally:
        code = stop_server(proc)
    if code != 0:
        raise RuntimeError(f"server exit status {code}")
    return times, computes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("source")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--next", type=int, default=20)
    parser.add_argument("--bound", type=float, default=2.0)
    parser.add_argument("--kinds", default="tour,bert_self,bert_cross")
    parser.add_argument("--server_args", default="", help="extra server flags, space-separated")
    parser.add_argument("--connect", choices=["models", "attend"], default="attend",
                        help="what opens the connection before the timed request: ListModels, "
                             "or ListModels then an Attend on an absent model (NOT_FOUND)")
    opts = parser.parse_args()
    if os.environ.get("MHA_SLOW_TESTS") != "1":
        print("first_request: skipped (set MHA_SLOW_TESTS=1)")
        return 77
    sys.path.insert(0, os.path.join(opts.source, "client", "python"))
    work = tempfile.mkdtemp(prefix="mha_first_")
    try:
        # deploy/models' toy and bert_base; its decoder would only lengthen each start-up.
        repo = os.path.join(work, "models")
        for name in ("toy", "bert_base"):
            shutil.copytree(os.path.join(opts.source, "deploy", "models", name),
                            os.path.join(repo, name))
        table = kinds(repo)
        worst = {}
        failed = False
        print(f"{'kind':<11} {'round':>5} {'first ms':>9} {'next med':>9} {'ratio':>6} "
              f"{'compute first':>14} {'compute med':>12} {'idle ms':>9} {'ratio':>6} "
              f"{'compute idle':>12}")
        for name in opts.kinds.split(","):
            args, shape = table[name]
            for r in range(opts.rounds):
                times, computes = measure(opts.server, args + opts.server_args.split(), shape,
                                          opts.next, opts.connect == "attend")
                med = statistics.median(times[1:-1])
                ratio = times[0] / med
                print(f"{name:<11} {r + 1:>5} {times[0]:>9.3f} {med:>9.3f} {ratio:>6.2f} "
                      f"{computes[0]:>14.3f} {statistics.median(computes[1:-1]):>12.3f} "
                      f"{times[-1]:>9.3f} {times[-1] / med:>6.2f} {computes[-1]:>12.3f}",
                      flush=True)
                worst[name] = max(worst.get(name, 0.0), ratio)
                failed |= ratio > opts.bound
        for name, ratio in worst.items():
            print(f"first_request: {name}: worst first / median of next {opts.next} = "
                  f"{ratio:.2f} (bound {opts.bound})")
        print("first_request: " + ("FAILED" if failed else "passed"))
        return 1 if failed else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
