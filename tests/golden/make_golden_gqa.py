#!/usr/bin/python3
"""Golden outputs for grouped-query heads and rotary positions (issue 34), from the
independent PyTorch reference tests/golden/hf_attention.py computed in float64.

    /usr/bin/python3 tests/golden/make_golden_gqa.py           # (re)write data/gqa_*.out.safetensors
    /usr/bin/python3 tests/golden/make_golden_gqa.py --check   # recompute and compare

Only outputs are stored. Inputs and weights come from one SplitMix64 stream per case
(base/splitmix64.h; mha_serve.toy.uniform_stream, Signed()), drawn in this order, each
row-major:

    queries (B, Q, d_q); keys (B, K, d_k), values (B, K, d_v) unless self-attention;
    q_proj.weight (h*d_h, d_q), k_proj.weight (G*d_h, d_k), v_proj.weight (G*d_h, d_v),
    o_proj.weight (p_o, p_o); with bias q_proj.bias, k_proj.bias, v_proj.bias, and
    o_proj.bias when o_bias

inputs as drawn, q_proj.weight and k_proj.weight times the case's qk_scale (0.125
unless given), every other weight and bias times 0.125 (powers of two: exact in
float32). tests/unit/
golden_gqa_test.cc draws the same stream in C++ and compares the core's output to
`output` within 1e-4. Each file's metadata (strings) describes its case: the layer
(num_hiddens, num_heads, num_kv_heads, query_size, key_size, value_size, bias, o_bias,
rope_theta, rotary_dim, interleaved), the call (batch, num_queries, num_keys, self,
causal, valid_lens: "" or comma-separated, B or B*Q entries), seed, weight_scale and
qk_scale.
"""

import argparse
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.path.join(HERE, "data")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))

from hf_attention import GroupedRotaryAttention  # noqa: E402
from mha_serve.safetensors import read_safetensors, write_safetensors  # noqa: E402
from mha_serve.toy import uniform_stream  # noqa: E402

WEIGHT_SCALE = 0.125

# name: layer and call. p_o, h, G, d_q, d_k, d_v, bias, o_bias, theta, rotary_dim,
# interleaved; B, Q, K (0 = self-attention, K = Q), causal, valid_lens, seed.
CASES = {
    # GQA G = 2, rotate-half RoPE on half of each head, causal self-attention.
    "gqa_g2_rotate_half_partial": dict(p_o=32, h=4, G=2, d_q=32, d_k=32, d_v=32, bias=False,
                                       o_bias=False, theta=10000.0, rotary_dim=4,
                                       interleaved=False, B=2, Q=6, K=0, causal=True,
                                       valid_lens=[], seed=341),
    # MQA (G = 1), interleaved RoPE on 6 of 8 features, biases without o_proj.bias
    # (Qwen2's), Q < K bottom-right causal, cross with other input sizes, valid_lens (B).
    "mqa_interleaved_partial_bias_no_obias": dict(p_o=48, h=6, G=1, d_q=40, d_k=24, d_v=16,
                                                  bias=True, o_bias=False, theta=500000.0,
                                                  rotary_dim=6, interleaved=True, B=2, Q=3,
                                                  K=7, causal=True, valid_lens=[7, 5],
                                                  seed=342),
    # GQA with every bias, o_proj.bias included, Q < K not causal, valid_lens (B, Q).
    "gqa_g2_bias_obias_cross": dict(p_o=32, h=4, G=2, d_q=32, d_k=32, d_v=32, bias=True,
                                    o_bias=True, theta=10000.0, rotary_dim=0, interleaved=False,
                                    B=2, Q=2, K=5, causal=False, valid_lens=[5, 3, 4, 1],
                                    seed=343),
    # MQA, full rotate-half RoPE, causal self-attention with valid_lens (B).
    "mqa_rotate_half_self_valid_lens": dict(p_o=24, h=3, G=1, d_q=24, d_k=24, d_v=24, bias=True,
                                            o_bias=True, theta=10000.0, rotary_dim=0,
                                            interleaved=False, B=2, Q=5, K=0, causal=True,
                                            valid_lens=[5, 3], seed=344),
    # Positions near 8,191: the last 2 of 8,192 keys, causal (bottom-right). q_proj and
    # k_proj at 1.0 sharpen the attention over 8,192 keys, so that the output depends on
    # the positions: queries put at 0, 1 instead of 8190, 8191 move it by 0.096 (its
    # largest entry is 0.076). Angles in float32, as Hugging Face's, move it by only
    # 1e-6 here: this case shows accuracy at large positions, not that difference.
    "gqa_position_8191": dict(p_o=32, h=4, G=2, d_q=32, d_k=32, d_v=32, bias=False,
                              o_bias=False, theta=10000.0, rotary_dim=0, interleaved=False, B=1,
                              Q=2, K=8192, causal=True, valid_lens=[], seed=345, qk_scale=1.0),
}


def draw(case):
    """The case's inputs and weights (float32 arrays), from its seed."""
    c = case
    d_h = c["p_o"] // c["h"]
    kv = c["G"] * d_h
    self_attention = c["K"] == 0
    shapes = [("queries", (c["B"], c["Q"], c["d_q"]))]
    if not self_attention:
        shapes += [("keys", (c["B"], c["K"], c["d_k"])), ("values", (c["B"], c["K"], c["d_v"]))]
    shapes += [("q_proj.weight", (c["p_o"], c["d_q"])), ("k_proj.weight", (kv, c["d_k"])),
               ("v_proj.weight", (kv, c["d_v"])), ("o_proj.weight", (c["p_o"], c["p_o"]))]
    if c["bias"]:
        shapes += [("q_proj.bias", (c["p_o"],)), ("k_proj.bias", (kv,)), ("v_proj.bias", (kv,))]
        if c["o_bias"]:
            shapes += [("o_proj.bias", (c["p_o"],))]
    total = sum(int(np.prod(s)) for _, s in shapes)
    stream = uniform_stream(c["seed"], total)
    arrays, offset = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        a = stream[offset:offset + n].reshape(shape)
        offset += n
        if name in ("q_proj.weight", "k_proj.weight"):
            a = a * np.float32(c.get("qk_scale", WEIGHT_SCALE))
        elif name not in ("queries", "keys", "values"):
            a = a * np.float32(WEIGHT_SCALE)
        arrays[name] = a
    return arrays


def reference_output(case):
    c = case
    arrays = draw(c)
    module = GroupedRotaryAttention(
        c["p_o"], c["h"], c["G"], c["d_q"], c["d_k"], c["d_v"], bias=c["bias"],
        o_bias=c["o_bias"], rope_theta=c["theta"], rotary_dim=c["rotary_dim"] or None,
        rope_interleaved=c["interleaved"]).double()
    state = {n: torch.from_numpy(a.astype(np.float64)) for n, a in arrays.items() if "proj" in n}
    missing = module.load_state_dict(state, strict=False)
    # o_proj.bias absent (o_bias false with bias): the module has none either.
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    t = {n: torch.from_numpy(arrays[n].astype(np.float64))
         for n in ("queries", "keys", "values") if n in arrays}
    lens = None
    if c["valid_lens"]:
        lens = torch.tensor(c["valid_lens"]).reshape(c["B"], -1).squeeze(1)
    with torch.no_grad():
        out = module(t["queries"], t.get("keys"), t.get("values"), lens, causal=c["causal"])
    return out.numpy().astype(np.float32)


def metadata(name, c):
    return {"case": name, "num_hiddens": str(c["p_o"]), "num_heads": str(c["h"]),
            "num_kv_heads": str(c["G"]), "query_size": str(c["d_q"]),
            "key_size": str(c["d_k"]), "value_size": str(c["d_v"]),
            "bias": "true" if c["bias"] else "false", "o_bias": "true" if c["o_bias"] else "false",
            "rope_theta": repr(c["theta"]), "rotary_dim": str(c["rotary_dim"]),
            "interleaved": "true" if c["interleaved"] else "false", "batch": str(c["B"]),
            "num_queries": str(c["Q"]), "num_keys": str(c["K"] or c["Q"]),
            "self": "true" if c["K"] == 0 else "false",
            "causal": "true" if c["causal"] else "false",
            "valid_lens": ",".join(str(v) for v in c["valid_lens"]), "seed": str(c["seed"]),
            "weight_scale": repr(WEIGHT_SCALE), "qk_scale": repr(c.get("qk_scale", WEIGHT_SCALE))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="recompute every case and compare with data/ (max |diff| <= 1e-6)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    worst = 0.0
    for name, case in CASES.items():
        path = os.path.join(DATA_DIR, f"{name}.out.safetensors")
        output = reference_output(case)
        if args.check:
            stored = read_safetensors(path)["output"]
            diff = float(np.max(np.abs(stored - output)))
            worst = max(worst, diff)
            print(f"{name}: max |stored - recomputed| = {diff:.2e}")
        else:
            write_safetensors(path, {"output": output}, metadata=metadata(name, case))
            print(f"{name}: output {output.shape} -> {os.path.relpath(path)}")
    return 1 if worst > 1e-6 else 0


if __name__ == "__main__":
    sys.exit(main())
