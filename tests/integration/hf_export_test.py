#!/usr/bin/python3
"""Hugging Face-style attention layers (grouped-query heads, rotary positions)
exported with mha_serve.export, served by the real attention_server on loopback, and
compared over attention.v1 (mha_serve.Client) with the independent reference
tests/golden/hf_attention.py run in float64: max |server - reference| <= 1e-4.

    hf_export_test.py SERVER_BINARY SOURCE_DIR

Also: the exporter's config.pbtxt carries num_kv_heads and rope, the weights keep
Hugging Face's names, and layers the server cannot serve are refused naming why.
"""

import os
import sys
import tempfile
import types

import numpy as np
import torch

from server_harness import start_server, stop_server

TOLERANCE = 1e-4

# name: (module settings, call: B, Q, K (0 = self), causal, valid_lens)
MODULES = {
    # GQA G = 2, rotate-half on 4 of 8 features, every bias; Q < K bottom-right causal.
    "hf_gqa": (dict(num_hiddens=32, num_heads=4, num_key_value_heads=2, bias=True, o_bias=True,
                    rope_theta=10000.0, rotary_dim=4),
               (2, 3, 7, True, [7, 4])),
    # MQA, interleaved, theta 500000, biases without o_proj.bias (Qwen2's), other sizes.
    "hf_mqa": (dict(num_hiddens=48, num_heads=6, num_key_value_heads=1, query_size=40,
                    key_size=24, value_size=16, bias=True, o_bias=False, rope_theta=500000.0,
                    rotary_dim=6, rope_interleaved=True),
               (2, 4, 9, False, [9, 2])),
    # No bias, full rotary, causal self-attention (a decoder's prefill).
    "hf_self": (dict(num_hiddens=32, num_heads=4, num_key_value_heads=4, bias=False),
                (2, 6, 0, True, None)),
}


def main():
    binary, source = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.join(source, "client", "python"))
    sys.path.insert(0, os.path.join(source, "tests", "golden"))
    import mha_serve
    from mha_serve.export import export
    from mha_serve.safetensors import read_safetensors
    from hf_attention import GroupedRotaryAttention

    failures = []

    def check(condition, message):
        print(("OK   " if condition else "FAIL ") + message)
        if not condition:
            failures.append(message)

    torch.manual_seed(34)
    workdir = tempfile.TemporaryDirectory(prefix="hf_export_")
    repository = workdir.name
    modules = {}
    for name, (settings, _) in MODULES.items():
        module = GroupedRotaryAttention(**settings)
        modules[name] = module
        folder = export(module, repository, name=name)
        with open(os.path.join(folder, "config.pbtxt")) as f:
            config = f.read()
        g = settings["num_key_value_heads"]
        check(f"num_kv_heads: {g}" in config and "rope {" in config,
              f"{name}: config.pbtxt has num_kv_heads and rope")
        names = set(read_safetensors(os.path.join(folder, "weights.safetensors")))
        want = {f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if settings["bias"]:
            want |= {"q_proj.bias", "k_proj.bias", "v_proj.bias"}
            if settings["o_bias"]:
                want.add("o_proj.bias")
        check(names == want, f"{name}: weights {sorted(names)}")

    # Settings read from a Hugging Face-style `config` when the layer lacks them.
    module = GroupedRotaryAttention(32, 4, 2, rotary_dim=4)
    layer_config = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2,
                                         rope_theta=20000.0, partial_rotary_factor=0.5)
    bare = torch.nn.Module()
    for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(bare, part, getattr(module, part))
    bare.config = layer_config
    from mha_serve.export import describe
    described = describe(bare).config
    check(described["num_heads"] == 4 and described["num_kv_heads"] == 2 and
          described["rope"] == {"theta": 20000.0, "rotary_dim": 4, "interleaved": False},
          f"settings from .config: {described}")

    # Refusals, each naming why.
    refusals = []
    odd = GroupedRotaryAttention(32, 4, 2, bias=False, o_bias=True)
    refusals.append((odd, "o_proj has a bias"))
    gemma = GroupedRotaryAttention(32, 4, 2)
    gemma.head_dim = 16
    refusals.append((gemma, "head_dim 16"))
    for bad, words in refusals:
        try:
            describe(bad)
            check(False, f"refused: {words}")
        except ValueError as error:
            check(words in str(error), f"refused naming '{words}': {error}")

    proc, target = start_server(binary, [f"--model_repository={repository}"])
    try:
        with mha_serve.Client(target, timeout=60) as client:
            for name, (settings, (b, q, k, causal, lens)) in MODULES.items():
                module = modules[name]
                d_q = settings.get("query_size") or settings["num_hiddens"]
                rng = np.random.default_rng(len(name))
                queries = rng.uniform(-1, 1, (b, q, d_q)).astype(np.float32)
                keys = values = None
                if k:
                    keys = rng.uniform(-1, 1, (b, k, settings.get("key_size") or
                                               settings["num_hiddens"])).astype(np.float32)
                    values = rng.uniform(-1, 1, (b, k, settings.get("value_size") or
                                                 settings["num_hiddens"])).astype(np.float32)
                got = client.attend(queries, keys, values, valid_lens=lens, causal=causal,
                                    model=name)
                reference = module.double()
                with torch.no_grad():
                    want = reference(torch.from_numpy(queries).double(),
                                     None if keys is None else torch.from_numpy(keys).double(),
                                     None if values is None else torch.from_numpy(values).double(),
                                     None if lens is None else torch.tensor(lens),
                                     causal=causal).numpy()
                diff = float(np.max(np.abs(got - want)))
                check(got.shape == want.shape and diff <= TOLERANCE,
                      f"{name}: shape {got.shape}, max |server - reference| = {diff:.2e}")
            for name, (settings, _) in MODULES.items():
                info = client.model(name)
                head = settings["num_hiddens"] // settings["num_heads"]
                want = (settings["num_key_value_heads"], settings.get("rope_theta", 10000.0),
                        settings.get("rotary_dim") or head,
                        settings.get("rope_interleaved", False), "full", "f32")
                got = (info.num_kv_heads, info.rope_theta, info.rotary_dim,
                       info.rope_interleaved, info.projections, info.kv_cache_precision)
                check(got == want, f"{name}: ModelInfo {got}")
    finally:
        code = stop_server(proc)
    check(code == 0, f"server exit code {code}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
