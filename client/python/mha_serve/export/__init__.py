"""Exports a PyTorch attention layer as an attention_server model folder
(docs/python.md#exporting-a-pytorch-module).

    mha_serve.export(module, "models", name="mine", sample_inputs=(2, 5, 7))

writes
    models/mine/config.pbtxt          the ModelConfig (sizes, bias, scoring; no name:
                                      the folder's name is the model's)
    models/mine/weights.safetensors   the weights under names the server loads
    models/mine/io.safetensors        with sample_inputs: queries, keys, values,
                                      valid_lens (I32) and output, PyTorch's answer;
                                      `attention_client infer --input=` reads it

Modules:
  torch.nn.MultiheadAttention: PyTorch's own names (in_proj_weight, or
      q/k/v_proj_weight when kdim/vdim differ; in_proj_bias, out_proj.weight,
      out_proj.bias), bias on or off. add_bias_kv and add_zero_attn have no
      counterpart in the server: ValueError.
  Hugging Face-style attention layers (Llama, Mistral, Qwen2: q_proj, k_proj,
      v_proj, o_proj as nn.Linear; num_heads or config.num_attention_heads;
      num_key_value_heads (default num_heads); rope_theta (default 10000);
      rotary_dim, or partial_rotary_factor x head_dim (default the head size);
      rope_interleaved (default False: rotate-half pairs, as Hugging Face's Llama)):
      Hugging Face's names, num_kv_heads and rope in the config. q/k/v biases all or
      none; o_proj.bias optional (Qwen2 has none). The head size must be
      num_hiddens / num_heads. sample_inputs calls module(queries, keys, values,
      valid_lens), which Hugging Face's own forward is not: use it only with modules
      of that signature (tests/golden/hf_attention.py's).
  d2l's MultiHeadAttention (attributes W_q, W_k, W_v, W_o as nn.Linear or
      nn.LazyLinear, num_heads; forward(queries, keys, values, valid_lens)): d2l's
      names (W_q.weight, ...), one bias flag for all four linears. Uninitialised
      LazyLinear layers are materialised by one forward pass on zeros of feature
      sizes `input_sizes` (d_q, d_k, d_v; default num_hiddens each). A d2l
      AdditiveAttention in `.attention` (W_q, W_k, w_v) exports as ADDITIVE scoring.

sample_inputs (B, Q, K): uniform inputs from mha_serve.uniform_inputs(seed, ...),
valid_lens [max(1, K - b) for each row b] (no row fully masked: PyTorch answers NaN
there, the server 0); K = 0 is self-attention (no keys/values in the file).

The command line (python -m mha_serve.export) exports a saved state dict or a
random module; see __main__.py. This module imports torch only when called.
"""

import os
import re

import numpy as np

from ..safetensors import write_safetensors
from ..toy import uniform_inputs

_TORCH_NAMES = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                "in_proj_bias", "out_proj.weight", "out_proj.bias")
_D2L_LINEARS = ("W_q", "W_k", "W_v", "W_o")
_HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


class _Layer:
    """What export needs of a module: its config fields, the weight tensors by the
    server's names, and forward(queries, keys, values, valid_lens) -> output."""

    def __init__(self, kind, config, tensors, forward):
        self.kind, self.config, self.tensors, self.forward = kind, config, tensors, forward


def _is_d2l(module):
    return all(hasattr(module, a) for a in (*_D2L_LINEARS, "num_heads"))


def _torch_layer(module):
    import torch

    if module.bias_k is not None:
        raise ValueError("nn.MultiheadAttention(add_bias_kv=True) has no counterpart in "
                         "attention_server")
    if module.add_zero_attn:
        raise ValueError("nn.MultiheadAttention(add_zero_attn=True) has no counterpart in "
                         "attention_server")
    state = module.state_dict()
    tensors = {n: state[n] for n in _TORCH_NAMES if n in state and state[n] is not None}
    config = {"num_hiddens": module.embed_dim, "num_heads": module.num_heads,
              "query_size": module.embed_dim, "key_size": module.kdim,
              "value_size": module.vdim, "bias": "in_proj_bias" in tensors}

    def forward(queries, keys, values, valid_lens):
        num_keys = keys.shape[1]
        padding = torch.arange(num_keys)[None, :] >= valid_lens[:, None].long()
        q, k, v = (queries, keys, values) if module.batch_first else (
            t.transpose(0, 1) for t in (queries, keys, values))
        out, _ = module(q, k, v, key_padding_mask=padding, need_weights=False)
        return out if module.batch_first else out.transpose(0, 1)

    return _Layer("torch.nn.MultiheadAttention", config, tensors, forward)


def _materialise_lazy(module, input_sizes):
    import torch

    if not any(isinstance(p, torch.nn.parameter.UninitializedParameter)
               for p in module.parameters()):
        return
    num_hiddens = module.W_o.out_features
    sizes = input_sizes or (num_hiddens,) * 3
    zeros = [torch.zeros(1, 1, size) for size in sizes]
    with torch.no_grad():
        module(*zeros, None)


def _d2l_layer(module, input_sizes):
    _materialise_lazy(module, input_sizes)
    linears = [getattr(module, n) for n in _D2L_LINEARS]
    has_bias = [lin.bias is not None for lin in linears]
    if len(set(has_bias)) != 1:
        raise ValueError("d2l MultiHeadAttention: W_q, W_k, W_v and W_o must all have a bias "
                         f"or none (the server's `bias` applies to all four); got {has_bias}")
    tensors = {}
    for name, lin in zip(_D2L_LINEARS, linears):
        tensors[f"{name}.weight"] = lin.weight
        if lin.bias is not None:
            tensors[f"{name}.bias"] = lin.bias
    w_q, w_k, w_v, w_o = (lin.weight for lin in linears)
    config = {"num_hiddens": w_o.shape[0], "num_heads": module.num_heads,
              "query_size": w_q.shape[1], "key_size": w_k.shape[1], "value_size": w_v.shape[1],
              "bias": has_bias[0]}
    scoring = getattr(module, "attention", None)
    if scoring is not None and all(hasattr(scoring, a) for a in ("W_q", "W_k", "w_v")):
        for name in ("W_q", "W_k", "w_v"):
            lin = getattr(scoring, name)
            if lin.bias is not None:
                raise ValueError(f"d2l AdditiveAttention: attention.{name} has a bias; the "
                                 "server's additive scoring has none")
            tensors[f"attention.{name}.weight"] = lin.weight
        config["scoring"] = "ADDITIVE"
        config["additive_hidden"] = scoring.W_q.weight.shape[0]

    def forward(queries, keys, values, valid_lens):
        return module(queries, keys, values, valid_lens)

    return _Layer(f"d2l {type(module).__name__}", config, tensors, forward)


def _is_hugging_face(module):
    return all(hasattr(module, a) for a in _HF_LINEARS)


def _hf_setting(module, names, default=None):
    """The first of `names` set on the module, else on its `config` (Hugging Face
    keeps some on the layer, some on its config, depending on the version)."""
    config = getattr(module, "config", None)
    for owner in (module, config):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if value is not None:
                return value
    return default


def _hf_layer(module):
    linears = [getattr(module, n) for n in _HF_LINEARS]
    q, k, v, o = linears
    num_heads = _hf_setting(module, ("num_heads", "num_attention_heads"))
    if num_heads is None:
        raise ValueError(f"{type(module).__name__}: no num_heads (on the module or its config)")
    num_heads = int(num_heads)
    num_kv_heads = int(_hf_setting(module, ("num_key_value_heads",), num_heads))
    num_hiddens = q.weight.shape[0]
    if num_hiddens % num_heads:
        raise ValueError(f"q_proj.weight {tuple(q.weight.shape)}: {num_hiddens} rows is not "
                         f"num_heads ({num_heads}) heads of one size")
    head_dim = num_hiddens // num_heads
    explicit_head_dim = _hf_setting(module, ("head_dim",))
    if explicit_head_dim is not None and int(explicit_head_dim) != head_dim:
        raise ValueError(f"head_dim {explicit_head_dim} != q_proj rows / num_heads = {head_dim}: "
                         "the server's head size is num_hiddens / num_heads (layers such as "
                         "Gemma's are not served)")
    if tuple(o.weight.shape) != (num_hiddens, num_hiddens):
        raise ValueError(f"o_proj.weight {tuple(o.weight.shape)}: expected (p_o, h*d_h) = "
                         f"({num_hiddens}, {num_hiddens}); the server's output width is h*d_h")
    kv = num_kv_heads * head_dim
    for name, lin in (("k_proj", k), ("v_proj", v)):
        if lin.weight.shape[0] != kv:
            raise ValueError(f"{name}.weight {tuple(lin.weight.shape)}: expected (G*d_h, ...) "
                             f"with G = num_key_value_heads = {num_kv_heads}, d_h = {head_dim}")
    has_bias = [lin.bias is not None for lin in (q, k, v)]
    if len(set(has_bias)) != 1:
        raise ValueError("q_proj, k_proj and v_proj must all have a bias or none (the server's "
                         f"`bias`); got {has_bias}")
    if o.bias is not None and not has_bias[0]:
        raise ValueError("o_proj has a bias but q_proj, k_proj and v_proj have none: the server's "
                         "`bias` covers all four (o_proj.bias alone is optional, not the others)")
    tensors = {}
    for name, lin in zip(_HF_LINEARS, linears):
        tensors[f"{name}.weight"] = lin.weight
        if lin.bias is not None:
            tensors[f"{name}.bias"] = lin.bias
    theta = float(_hf_setting(module, ("rope_theta",), 10000.0))
    rotary_dim = _hf_setting(module, ("rotary_dim", "rotary_ndims"))
    if rotary_dim is None:
        factor = _hf_setting(module, ("partial_rotary_factor",), 1.0)
        rotary_dim = int(head_dim * float(factor))
    interleaved = bool(_hf_setting(module, ("rope_interleaved",), False))
    config = {"num_hiddens": num_hiddens, "num_heads": num_heads,
              "query_size": q.weight.shape[1], "key_size": k.weight.shape[1],
              "value_size": v.weight.shape[1], "bias": has_bias[0],
              "num_kv_heads": num_kv_heads,
              "rope": {"theta": theta, "rotary_dim": int(rotary_dim), "interleaved": interleaved}}

    def forward(queries, keys, values, valid_lens):
        # Only modules with this project's stateless signature (tests/golden's
        # reference); Hugging Face's own forward takes position embeddings and masks.
        return module(queries, keys, values, valid_lens)

    return _Layer(f"Hugging Face-style {type(module).__name__}", config, tensors, forward)


def describe(module, input_sizes=None):
    """The _Layer of a torch.nn.MultiheadAttention, a d2l MultiHeadAttention or a
    Hugging Face-style attention layer (q_proj, k_proj, v_proj, o_proj)."""
    import torch

    if isinstance(module, torch.nn.MultiheadAttention):
        return _torch_layer(module)
    if _is_d2l(module):
        return _d2l_layer(module, input_sizes)
    if _is_hugging_face(module):
        return _hf_layer(module)
    raise TypeError(f"cannot export {type(module).__name__}: expected torch.nn.MultiheadAttention, "
                    "a d2l-style MultiHeadAttention (W_q, W_k, W_v, W_o, num_heads) or a Hugging "
                    "Face-style attention layer (q_proj, k_proj, v_proj, o_proj, num_heads)")


PRECISIONS = ("f32", "bf16", "int8")


def config_text(config, source, precision="f32"):
    """The config.pbtxt of a layer. It names no model: the server names a model after
    its folder, so a renamed folder serves under its new name. precision: "f32",
    "bf16" or "int8" (the server quantizes the f32 weights at load)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "int8" and config.get("scoring"):
        raise ValueError("precision 'int8' quantizes dot-product layers only; this layer has "
                         f"{config['scoring']} scoring (use 'f32' or 'bf16')")
    lines = [f"# Exported from {source} by mha_serve.export; the model's name is its "
             "folder's"]
    for field in ("num_hiddens", "num_heads", "query_size", "key_size", "value_size"):
        lines.append(f"{field}: {int(config[field])}")
    lines.append(f"bias: {'true' if config['bias'] else 'false'}")
    lines.append(f'precision: "{precision}"')
    if config.get("scoring"):
        lines.append(f"scoring: {config['scoring']}")
        lines.append(f"additive_hidden: {int(config['additive_hidden'])}")
    if config.get("num_kv_heads") is not None:
        lines.append(f"num_kv_heads: {int(config['num_kv_heads'])}")
    rope = config.get("rope")
    if rope is not None:
        lines.append(f"rope {{ theta: {float(rope['theta'])!r} rotary_dim: "
                     f"{int(rope['rotary_dim'])} interleaved: "
                     f"{'true' if rope['interleaved'] else 'false'} }}")
    return "\n".join(lines) + "\n"


def sample_io(layer, sample_inputs, seed=0):
    """queries, keys, values (absent for K = 0), valid_lens and PyTorch's output."""
    import torch

    batch, num_queries, num_keys = (int(n) for n in sample_inputs)
    c = layer.config
    self_attention = num_keys == 0
    if self_attention and not c["query_size"] == c["key_size"] == c["value_size"]:
        raise ValueError(f"sample_inputs {tuple(sample_inputs)}: K = 0 (self-attention) needs "
                         f"d_q = d_k = d_v, the module has {c['query_size']}, {c['key_size']}, "
                         f"{c['value_size']}")
    if min(batch, num_queries) < 1 or num_keys < 0:
        raise ValueError(f"sample_inputs {tuple(sample_inputs)}: expected B, Q >= 1, K >= 0")
    shapes = [(batch, num_queries, c["query_size"])]
    if not self_attention:
        shapes += [(batch, num_keys, c["key_size"]), (batch, num_keys, c["value_size"])]
    arrays = uniform_inputs(seed, shapes)
    kv_len = num_queries if self_attention else num_keys
    valid_lens = np.array([max(1, kv_len - b) for b in range(batch)], dtype=np.int32)
    queries = torch.from_numpy(arrays[0].copy())
    keys = queries if self_attention else torch.from_numpy(arrays[1].copy())
    values = queries if self_attention else torch.from_numpy(arrays[2].copy())
    with torch.no_grad():
        output = layer.forward(queries, keys, values, torch.from_numpy(valid_lens))
    io = {"queries": arrays[0]}
    if not self_attention:
        io["keys"], io["values"] = arrays[1], arrays[2]
    io["valid_lens"] = valid_lens
    io["output"] = output.detach().to(torch.float32).numpy()
    return io


def export(module, directory, name="default", sample_inputs=None, seed=0, input_sizes=None,
           precision="f32"):
    """Writes `module` as the model folder `directory/name` of a model repository
    (name "default" is the model requests reach with model ""). Returns the folder.

    module: torch.nn.MultiheadAttention, a d2l-style MultiHeadAttention or a Hugging
    Face-style attention layer (see the module docstring). sample_inputs: None or (B, Q, K) for io.safetensors, inputs
    drawn with `seed`. input_sizes: (d_q, d_k, d_v) to materialise LazyLinear layers.
    precision: the config's `precision`, "f32" (default), "bf16" or "int8"; the weights
    are written in float32 either way (io.safetensors keeps PyTorch's f32 output).
    """
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name or ""):
        raise ValueError(f"name {name!r}: expected letters, digits, '_', '.', '-' "
                         "(a directory name not starting with '.' or '-')")
    was_training = module.training
    module.eval()
    try:
        layer = describe(module, input_sizes)
        text = config_text(layer.config, layer.kind, precision)
        folder = os.path.join(directory, name)
        os.makedirs(folder, exist_ok=True)
        write_safetensors(os.path.join(folder, "weights.safetensors"),
                          {n: t.detach().float() for n, t in layer.tensors.items()},
                          metadata={"format": "pt", "source": "mha_serve.export"})
        with open(os.path.join(folder, "config.pbtxt"), "w") as f:
            f.write(text)
        if sample_inputs is not None:
            write_safetensors(os.path.join(folder, "io.safetensors"),
                              sample_io(layer, sample_inputs, seed))
    finally:
        module.train(was_training)
    return folder
