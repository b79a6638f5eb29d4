"""mha-serve-client (= python -m mha_serve): one Attend request to an attention_server.

    mha-serve-client --target=127.0.0.1:50051 [--model=bert_base] [--batch=2 --num_queries=4
        --num_keys=6 --valid_lens=3,2 --seed=0 --causal --return_attention --output=out.npy
        --timeout=60s]
    mha-serve-client --version        # mha-serve-client 0.1.0 (python)

Feature sizes come from GetModel, so any model works. The inputs are those of the C++
client (attention_client infer) for the same flags: uniform in [-1, 1) from
SplitMix64(--seed), queries then keys then values (mha_serve.toy). Prints the model,
the output's shape and the first 4 values of up to 8 (b, q) rows:

    model default: p_o 100, h 5, d_q 100, d_k 100, d_v 100
    output shape: (2, 4, 100)
    [0, 0, :4] = +0.12345 -0.06789 +0.00123 +0.04567

The default --valid_lens is the toy request's 3,2, for the toy sizes (--batch=2
--num_queries=4 --num_keys=6) only; other sizes send none unless given. --timeout takes
a duration as the C++ client's does (60s, 500ms, 2m, 1h; a bare number is seconds).

Errors are one line, `error: CODE: details`: exit 1 for a failed call, 2 for usage
(argparse's, flags the request cannot satisfy, such as --valid_lens of the wrong count).
"""

import argparse
import re
import sys

from . import __version__, toy

MAX_ROWS = 8
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|ms|s|m|h)?")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text):
    """'10s', '500ms', '1.5m', '2h', '250us' or a bare number of seconds -> seconds
    (float > 0). argparse type: a bad one is a usage error naming the flag."""
    match = _DURATION.fullmatch(text.strip())
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)] if match else 0.0
    if seconds <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a duration > 0 such as 60s, 500ms, 2m, 1h (a bare number is seconds), "
            f"got {text!r}")
    return seconds


def version_line(prog="mha-serve-client"):
    """`PROG VERSION (python)`: the C++ binaries print their build type in its place."""
    return f"{prog} {__version__} (python)"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="mha-serve-client", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     epilog="See docs/python.md.")
    parser.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    parser.add_argument("--model", default="", help='model name; "" = the default model')
    parser.add_argument("--batch", type=int, default=toy.DEFAULT_BATCH, help="B")
    parser.add_argument("--num_queries", type=int, default=toy.DEFAULT_NUM_QUERIES, help="Q")
    parser.add_argument("--num_keys", type=int, default=toy.DEFAULT_NUM_KEYS,
                        help="K; 0 = self-attention (no keys/values sent)")
    parser.add_argument("--valid_lens", default=None,
                        help="B or B*Q comma-separated key lengths, or 'none'; default: "
                             f"{','.join(map(str, toy.DEFAULT_VALID_LENS))} for the toy sizes "
                             "(B 2, Q 4, K 6), else none")
    parser.add_argument("--causal", action="store_true", help="query i sees keys j <= i")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs (SplitMix64)")
    parser.add_argument("--return_attention", action="store_true",
                        help="also ask for the attention weights (prints their shape)")
    parser.add_argument("--output", default="", help="write the output to FILE.npy")
    parser.add_argument("--timeout", type=parse_duration, default="60s",
                        help="deadline per call: 60s, 500ms, 2m (a bare number is seconds)")
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the version and exit")
    parser.add_argument("--tls", action="store_true", help="TLS (system roots unless --tls_ca)")
    parser.add_argument("--tls_ca", default="", help="PEM root certificates (implies --tls)")
    parser.add_argument("--tls_cert", default="", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls_key", default="", help="PEM client key (mutual TLS)")
    parser.add_argument("--tls_server_name", default="",
                        help="name the server's certificate must carry")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.num_queries < 1 or args.num_keys < 0:
        parser.error("--batch and --num_queries must be >= 1 and --num_keys >= 0")
    toy_sizes = (args.batch, args.num_queries, args.num_keys) == (
        toy.DEFAULT_BATCH, toy.DEFAULT_NUM_QUERIES, toy.DEFAULT_NUM_KEYS)
    if args.valid_lens is None:
        args.valid_lens = list(toy.DEFAULT_VALID_LENS) if toy_sizes else None
    elif args.valid_lens.lower() in ("", "none"):
        args.valid_lens = None
    else:
        try:
            args.valid_lens = [int(n) for n in args.valid_lens.split(",")]
        except ValueError:
            parser.error(f"--valid_lens: expected comma-separated integers or none, got "
                         f"{args.valid_lens!r}")
        b, q = args.batch, args.num_queries
        k = args.num_keys or q  # self-attention: the queries are the keys
        if len(args.valid_lens) not in (b, b * q):
            parser.error(f"--valid_lens: expected B = {b} or B*Q = {b * q} lengths, got "
                         f"{len(args.valid_lens)}")
        bad = [n for n in args.valid_lens if not 0 <= n <= k]
        if bad:
            parser.error(f"--valid_lens: expected lengths 0 <= n <= K = {k}, got {bad[0]}")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls_cert and --tls_key go together")
    if args.output and not args.output.endswith(".npy"):
        parser.error(f"--output: expected FILE.npy, got {args.output!r}")
    return args


def _tls(args):
    if not (args.tls or args.tls_ca or args.tls_cert):
        return None
    return (args.tls_ca or None, args.tls_cert or None, args.tls_key or None)


def _fail(message, code):
    print(f"error: {message}", file=sys.stderr)
    return code


def _shape(shape):
    return "(" + ", ".join(str(n) for n in shape) + ")"


def format_rows(output, max_rows=MAX_ROWS):
    """Lines `[b, q, :4] = +v +v +v +v` for the first max_rows (b, q) rows, as
    mha_toy_example and attention_client infer print them (base/output_rows.h;
    `:n` and n values when the rows are shorter than 4)."""
    batch, num_queries, count = output.shape[0], output.shape[1], min(output.shape[2], 4)
    lines = []
    for row in range(min(max_rows, batch * num_queries)):
        b, q = divmod(row, num_queries)
        values = "".join(" %+.5f" % v for v in output[b, q, :count])
        lines.append("[%d, %d, :%d] =%s" % (b, q, count, values))
    return lines


def run(args):
    import numpy as np

    from .client import Client, Error, decode_response, encode_request

    try:
        with Client(args.target, tls=_tls(args), timeout=args.timeout,
                    server_name=args.tls_server_name or None) as client:
            try:
                info = client.model(args.model)
            except Error as error:
                if args.model or error.code.name != "INVALID_ARGUMENT":
                    raise
                names = ", ".join(m.name for m in client.models())
                return _fail(f"INVALID_ARGUMENT: {args.target} serves several models "
                             f"({names}) and none named \"default\": choose one with "
                             "--model=NAME", 2)
            print(f"model {info.name}: p_o {info.num_hiddens}, h {info.num_heads}, "
                  f"d_q {info.query_size}, d_k {info.key_size}, d_v {info.value_size}")
            b, q, k = args.batch, args.num_queries, args.num_keys
            shapes = [(b, q, info.query_size)]
            if k:
                shapes += [(b, k, info.key_size), (b, k, info.value_size)]
            inputs = toy.uniform_inputs(args.seed, shapes) + [None, None]
            request = encode_request(inputs[0], inputs[1], inputs[2], valid_lens=args.valid_lens,
                                     causal=args.causal, return_attention=args.return_attention,
                                     model=info.name)
            response = client.call(request)
            result = decode_response(response, args.return_attention)
    except Error as error:
        return _fail(f"{error.code.name}: {error.rpc}: {error.details}", 1)
    except OSError as error:  # unreadable TLS files
        return _fail(f"{error.strerror or error}: {error.filename or ''}".rstrip(": "), 2)
    output = result[0] if args.return_attention else result
    print(f"output shape: {_shape(output.shape)}")
    for line in format_rows(output):
        print(line)
    if args.return_attention:
        print(f"attention shape: {_shape(result[1].shape)}")
    t = response.timing
    print(f"timing: queue {t.queue_us} us, compute {t.compute_us} us, batch rows {t.batch_rows}")
    if args.output:
        np.save(args.output, output)
        print(f"wrote {args.output}")
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        import grpc  # noqa: F401
        from ._proto import attention_pb2  # noqa: F401
    except ImportError as error:
        missing = getattr(error, "name", None) or str(error)
        return _fail(f"cannot import {missing} ({error}): install Debian's python3-grpcio "
                     "and python3-protobuf (and python3-grpc-tools to run from a source "
                     "checkout), or run with /usr/bin/python3", 1)
    except (OSError, RuntimeError) as error:  # a source checkout without proto/
        return _fail(" ".join(str(error).split()), 1)
    try:
        return run(args)
    except KeyboardInterrupt:
        return _fail("CANCELLED: interrupted", 1)


if __name__ == "__main__":
    sys.exit(main())
