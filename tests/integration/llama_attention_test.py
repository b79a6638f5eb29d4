#!/usr/bin/python3
"""deploy/models_llm/llama_attention served by the real attention_server on loopback
(its own two warm-up passes, then one session): the server starts with it and reports
it as configured, and it answers consistently. Light: 8 tokens of a 4,096-wide layer.

    llama_attention_test.py SERVER_BINARY SOURCE_DIR

Checks: ModelInfo (p_o 4096, h 32, G 8, theta 500000, rotary_dim 128, max sequence
8192); a session fed 8 tokens in chunks of 5, 1, 2 equals one stateless causal Attend
over the 8 tokens (token t at position t both ways) within 1e-4; a stateless Q 3 < K 8
causal Attend equals the last 3 rows of the Q = K = 8 one (query i at K - Q + i); Q > K
is refused naming queries. The golden tests (tests/golden) check the arithmetic
against an independent reference on smaller layers.
"""

import os
import sys

import numpy as np

from server_harness import start_server, stop_server

TOLERANCE = 1e-4


def main():
    binary, source = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.join(source, "client", "python"))
    import mha_serve

    failures = []

    def check(condition, message):
        print(("OK   " if condition else "FAIL ") + message)
        if not condition:
            failures.append(message)

    repository = os.path.join(source, "deploy", "models_llm")
    proc, target = start_server(binary, [f"--model_repository={repository}"], timeout=120)
    try:
        with mha_serve.Client(target, timeout=60) as client:
            info = client.model("llama_attention")
            got = (info.num_hiddens, info.num_heads, info.head_size, info.num_kv_heads,
                   info.rope_theta, info.rotary_dim, info.rope_interleaved, info.bias,
                   info.kv_cache_precision, info.limits.max_sequence_length)
            check(got == (4096, 32, 128, 8, 500000.0, 128, False, False, "f32", 8192),
                  f"ModelInfo {got}")

            tokens = np.random.default_rng(8).uniform(-1, 1, (1, 8, 4096)).astype(np.float32)
            whole = client.attend(tokens, causal=True, model="llama_attention")
            with client.session(model="llama_attention", causal=True) as session:
                steps = [session.step(tokens[:, a:b]) for a, b in ((0, 5), (5, 6), (6, 8))]
            chunked = np.concatenate(steps, axis=1)
            diff = float(np.max(np.abs(chunked - whole)))
            check(chunked.shape == whole.shape and diff <= TOLERANCE,
                  f"session in chunks 5, 1, 2 vs stateless causal: max diff {diff:.2e}")

            last = client.attend(tokens[:, 5:], tokens, tokens, causal=True,
                                 model="llama_attention")
            diff = float(np.max(np.abs(last - whole[:, 5:])))
            check(diff <= TOLERANCE, f"Q 3 < K 8 causal vs the last 3 rows: max diff {diff:.2e}")

            try:
                client.attend(tokens, tokens[:, :2], tokens[:, :2], model="llama_attention")
                check(False, "Q 8 > K 2 refused")
            except mha_serve.Error as error:
                check(error.code.name == "INVALID_ARGUMENT" and "queries:" in error.details,
                      f"Q 8 > K 2 refused: {error}")
    finally:
        code = stop_server(proc)
    check(code == 0, f"server exit code {code}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
