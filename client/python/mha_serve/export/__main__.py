"""Exports an attention layer as an attention_server model folder, OUTPUT/NAME.

From a saved state dict (torch.save(module.state_dict(), FILE), a checkpoint dict
holding "state_dict", or a .safetensors file):
    python -m mha_serve.export --state-dict FILE --embed-dim E --num-heads H \
        [--kdim K --vdim V --no-bias --kind torch|d2l] --name N --output DIR [--sample B,Q,K]
A random module (nn.Linear's initialisation, biases uniform in [-0.5, 0.5), from --seed):
    python -m mha_serve.export --random --embed-dim E --num-heads H ... --output DIR

--kind torch: nn.MultiheadAttention(E, H, bias, kdim, vdim); d2l: d2l's
MultiHeadAttention (sizes and bias read from the state dict; random: d_q = E).
--sample B,Q,K also writes io.safetensors (inputs, valid_lens, PyTorch's output;
K = 0 is self-attention). Errors: one line, exit 1 (2 for bad flags).
"""

import argparse
import sys


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
    parser.add_argument("--name", default="default", help="model name (folder name)")
    parser.add_argument("--output", "--repository", dest="output", required=True,
                        help="model repository directory; the model goes to OUTPUT/NAME")
    parser.add_argument("--sample", type=_sample, metavar="B,Q,K",
                        help="also write io.safetensors with inputs of these sizes")
    parser.add_argument("--seed", type=int, default=0, help="random weights and sample inputs")
    args = parser.parse_args(argv)
    if not args.embed_dim and not (args.kind == "d2l" and args.state_dict):
        parser.error("--embed-dim is required")
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


def build_module(args):
    import torch

    from ._d2l import D2LMultiHeadAttention

    e = args.embed_dim
    kdim, vdim = args.kdim or e, args.vdim or e
    if args.state_dict:
        state = load_state_dict(args.state_dict)
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
                        seed=args.seed)
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
