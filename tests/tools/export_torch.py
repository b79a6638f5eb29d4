#!/usr/bin/python3
"""Exports a PyTorch nn.MultiheadAttention (random weights) as a model-repository
folder for attention_server, plus inputs and PyTorch's outputs for them.

    /usr/bin/python3 tests/tools/export_torch.py --repository DIR --name NAME \
        [--embed_dim 64 --num_heads 8 --kdim K --vdim V --no_bias --seed 0]

writes
    DIR/NAME/config.pbtxt        the ModelConfig (p_o = embed_dim, d_k = kdim, ...)
    DIR/NAME/weights.safetensors PyTorch's own tensor names: in_proj_weight (or
                                 q/k/v_proj_weight when kdim/vdim differ),
                                 in_proj_bias, out_proj.weight, out_proj.bias
    DIR/NAME.io.json             {"queries", "keys", "values": {"shape", "data"},
                                  "valid_lens", "self_attention", "output"}
                                 (keys/values absent for self-attention)

The safetensors file is written with json + struct (no safetensors package).
Padding follows valid_lens through key_padding_mask; every valid_len is >= 1
(PyTorch answers NaN for a row with every key masked; the server answers 0).
"""

import argparse
import json
import os
import struct

import torch


def write_safetensors(path, tensors):
    """tensors: dict name -> float32 torch.Tensor."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.detach().contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt", "source": "export_torch.py"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # 8-byte alignment of the data, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def as_json(t):
    return {"shape": list(t.shape), "data": [float(v) for v in t.reshape(-1).tolist()]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--embed_dim", type=int, default=64)
    parser.add_argument("--num_heads", type=int, default=8)
    parser.add_argument("--kdim", type=int, default=0, help="0 = embed_dim")
    parser.add_argument("--vdim", type=int, default=0, help="0 = embed_dim")
    parser.add_argument("--no_bias", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--queries", type=int, default=5)
    parser.add_argument("--keys", type=int, default=7, help="ignored for self-attention")
    parser.add_argument("--self_attention", action="store_true",
                        help="inputs are queries only (needs kdim = vdim = embed_dim)")
    args = parser.parse_args()

    e = args.embed_dim
    kdim, vdim = args.kdim or e, args.vdim or e
    torch.manual_seed(args.seed)
    mha = torch.nn.MultiheadAttention(e, args.num_heads, bias=not args.no_bias, kdim=kdim,
                                      vdim=vdim, batch_first=True).eval()
    # Non-zero biases, so a wrongly loaded bias shows.
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.uniform_(-0.5, 0.5)

    model_dir = os.path.join(args.repository, args.name)
    os.makedirs(model_dir, exist_ok=True)
    write_safetensors(os.path.join(model_dir, "weights.safetensors"),
                      {n: p for n, p in mha.state_dict().items()})
    with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
        f.write(f'# Exported from torch.nn.MultiheadAttention by tests/tools/export_torch.py\n'
                f'name: "{args.name}"\nnum_hiddens: {e}\nnum_heads: {args.num_heads}\n'
                f'query_size: {e}\nkey_size: {kdim}\nvalue_size: {vdim}\n'
                f'bias: {"false" if args.no_bias else "true"}\nprecision: "f32"\n')

    b, q = args.batch, args.queries
    k = q if args.self_attention else args.keys
    queries = torch.randn(b, q, e)
    keys = queries if args.self_attention else torch.randn(b, k, kdim)
    values = queries if args.self_attention else torch.randn(b, k, vdim)
    valid_lens = [max(1, k - i) for i in range(b)]
    padding = torch.arange(k)[None, :] >= torch.tensor(valid_lens)[:, None]
    with torch.no_grad():
        output, _ = mha(queries, keys, values, key_padding_mask=padding, need_weights=False)
    io = {"queries": as_json(queries), "valid_lens": valid_lens,
          "self_attention": args.self_attention, "output": as_json(output)}
    if not args.self_attention:
        io["keys"], io["values"] = as_json(keys), as_json(values)
    with open(os.path.join(args.repository, f"{args.name}.io.json"), "w") as f:
        json.dump(io, f)
    print(f"exported {model_dir} (p_o {e}, h {args.num_heads}, d_k {kdim}, d_v {vdim})")


if __name__ == "__main__":
    main()
