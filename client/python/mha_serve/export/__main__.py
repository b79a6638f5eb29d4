"""Exports an attention layer as an attention_server model folder, OUTPUT/NAME.

From a saved state dict (torch.save(module.state_dict(), FILE), a checkpoint dict
holding "state_dict", or a .safetensors file):
    python -m mha_serve.export --state-dict FILE --embed-dim E --num-heads H \
        [--kdim K --vdim V --no-bias --kind torch|d2l] [--prefix P] --name N --output DIR \
        [--sample B,Q,K]
--prefix takes one layer out of a whole model's state dict: its tensors named P...
(e.g. --prefix blocks.0.attn. for blocks.0.attn.in_proj_weight, ...). Without it the
tensors must be the layer's own (in_proj_weight, ...); either way, a state dict with
no layer there is a one-line error listing the prefixes of the layers it holds.
A random module (nn.Linear's initialisation, biases uniform in [-0.5, 0.5), from --seed):
    python -m mha_serve.export --random --embed-dim E --num-heads H ... --output DIR

--kind torch: nn.MultiheadAttention(E, H, bias, kdim, vdim); d2l: d2l's
MultiHeadAttention (sizes and bias read from the state dict; random: d_q = E).
--sample B,Q,K also writes io.safetensors (inputs, valid_lens, PyTorch's output;
K = 0 is self-attention). Errors: one line, exit 1 (2 for bad flags).
"""

import argparse
import re
import sys

from .. import __version__


def _sample(text):
    try:
        sizes = tuple(int(n) for n in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 3:
        raise argparse.ArgumentTypeError(f"expected B,Q,K (three integers), got {text!r}")
    return sizes


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m mha_serve.export", description=__doc__.split("\n")[0],
        epilog="See docs/python.md.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--state-dict", "--state_dict", dest="state_dict", metavar="FILE",
                        help="a saved state dict (.pt/.pth via torch.load, or .safetensors)")
    source.add_argument("--random", action="store_true",
                        help="random weights and non-zero biases from --seed")
    parser.add_argument("--kind", choices=("torch", "d2l"), default="torch")
    parser.add_argument("--embed-dim", "--embed_dim", dest="embed_dim", type=int, default=0,
                        help="p_o (num_hiddens); required but for --kind=d2l --state-dict")
    parser.add_argument("--num-heads", "--num_heads", dest="num_heads", type=int, required=True)
    parser.add_argument("--kdim", type=int, default=0, help="d_k; 0 = embed dim")
    parser.add_argument("--vdim", type=int, default=0, help="d_v; 0 = embed dim")
    parser.add_argument("--no-bias", "--no_bias", dest="no_bias", action="store_true")
    parser.add_argument("--prefix", default="",
                        help="with --state-dict: the layer's prefix in a whole model's state "
                             "dict, e.g. blocks.0.attn. (its tensors are P + in_proj_weight, ...)")
    parser.add_argument("--name", default="default", help="model name (folder name)")
    parser.add_argument("--output", "--repository", dest="output", required=True,
                        help="model repository directory; the model goes to OUTPUT/NAME")
    parser.add_argument("--sample", type=_sample, metavar="B,Q,K",
                        help="also write io.safetensors with inputs of these sizes")
    parser.add_argument("--seed", type=int, default=0, help="random weights and sample inputs")
    parser.add_argument("--precision", choices=("f32", "bf16", "int8"), default="f32",
                        help="config.pbtxt's precision (int8: quantized by the server at load)")
    parser.add_argument("--version", action="version",
                        version=f"mha_serve.export {__version__} (python)",
                        help="print the version and exit")
    args = parser.parse_args(argv)
    if not args.embed_dim and not (args.kind == "d2l" and args.state_dict):
        parser.error("--embed-dim is required")
    if args.prefix and not args.state_dict:
        parser.error("--prefix applies to --state-dict only")
    return args


def load_state_dict(path):
    import torch

    if path.endswith(".safetensors"):
        from ..safetensors import read_safetensors
        return {n: torch.from_numpy(a.copy()) for n, a in read_safetensors(path).items()}
    loaded = torch.load(path, map_location="cpu")
    if isinstance(loaded, torch.nn.Module):
        return loaded.state_dict()
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        return loaded["state_dict"]
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: holds a {type(loaded).__name__}, not a state dict")
    return loaded


# What marks a layer of each kind: one of its first tensors, and its last.
_MARKS = {"torch": (("in_proj_weight", "q_proj_weight"), "out_proj.weight"),
          "d2l": (("W_q.weight",), "W_o.weight")}
_KIND_NAMES = {"torch": "nn.MultiheadAttention", "d2l": "d2l MultiHeadAttention"}


def _natural(text):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def layer_prefixes(state, kind):
    """The prefixes P of the layers of `kind` in a state dict: P + in_proj_weight (or
    q_proj_weight) and P + out_proj.weight are among its names (d2l: P + W_q.weight and
    P + W_o.weight). "" is a bare layer's."""
    firsts, last = _MARKS[kind]
    found = set()
    for name in state:
        for first in firsts:
            if name == first or name.endswith("." + first):
                prefix = name[:len(name) - len(first)]
                if prefix + last in state:
                    found.add(prefix)
    return sorted(found, key=_natural)


def select_layer(state, prefix, kind, path):
    """The tensors named prefix + ..., with the prefix taken off. A state dict with no
    layer of `kind` at `prefix` is a ValueError listing the prefixes it has."""
    prefixes = layer_prefixes(state, kind)
    if prefix and not prefix.endswith(".") and prefix + "." in prefixes:
        prefix += "."  # blocks.0.attn for blocks.0.attn.
    if prefix in prefixes:
        return {name[len(prefix):]: t for name, t in state.items() if name.startswith(prefix)}
    firsts, last = _MARKS[kind]
    where = f"--prefix {prefix!r}" if prefix else "no --prefix"
    if not prefixes:
        names = ", ".join(sorted(state, key=_natural)[:4]) or "none"
        raise ValueError(f"{where}: {path} is not a {_KIND_NAMES[kind]} state dict: no "
                         f"{' or '.join(firsts)} with {last} at any prefix (its first names: "
                         f"{names}{', ...' if len(state) > 4 else ''})")
    shown = prefixes if len(prefixes) <= 10 else [*prefixes[:8], "...", prefixes[-1]]
    listed = ", ".join(p if p == "..." else repr(p) for p in shown)
    there = f"at {prefix!r}" if prefix else "at its top level"
    raise ValueError(f"{where}: {path} has no {_KIND_NAMES[kind]} {there}; the prefixes of "
                     f"its {len(prefixes)} layers: {listed} (pass one as --prefix)")


def build_module(args):
    import torch

    from ._d2l import D2LMultiHeadAttention

    e = args.embed_dim
    kdim, vdim = args.kdim or e, args.vdim or e
    if args.state_dict:
        state = select_layer(load_state_dict(args.state_dict), args.prefix, args.kind,
                             args.state_dict)
        if args.kind == "d2l":
            module = D2LMultiHeadAttention.from_state_dict(state, args.num_heads)
            if e and module.W_o.out_features != e:
                raise ValueError(f"--embed-dim {e}, but W_o.weight is "
                                 f"{tuple(module.W_o.weight.shape)}")
            return module
        module = torch.nn.MultiheadAttention(e, args.num_heads, bias=not args.no_bias,
                                             kdim=kdim, vdim=vdim, batch_first=True)
        module.load_state_dict(state)
        return module
    torch.manual_seed(args.seed)
    if args.kind == "d2l":
        module = D2LMultiHeadAttention(e, args.num_heads, e, kdim, vdim, bias=not args.no_bias)
    else:
        module = torch.nn.MultiheadAttention(e, args.num_heads, bias=not args.no_bias,
                                             kdim=kdim, vdim=vdim, batch_first=True)
    with torch.no_grad():  # non-zero biases, so a wrongly loaded bias shows
        for name, p in module.named_parameters():
            if "bias" in name:
                p.uniform_(-0.5, 0.5)
    return module


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("error: the exporter needs PyTorch (Debian: apt install python3-torch)",
              file=sys.stderr)
        return 1
    from . import describe, export
    try:
        module = build_module(args)
        folder = export(module, args.output, name=args.name, sample_inputs=args.sample,
                        seed=args.seed, precision=args.precision)
        c = describe(module).config
    except (ValueError, TypeError, RuntimeError, OSError, KeyError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    print(f"exported {folder}: p_o {c['num_hiddens']}, h {c['num_heads']}, d_q "
          f"{c['query_size']}, d_k {c['key_size']}, d_v {c['value_size']}, bias "
          f"{'on' if c['bias'] else 'off'}" + (", io.safetensors" if args.sample else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
