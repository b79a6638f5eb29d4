"""mha_serve: Python client for attention_server's attention.v1 API (docs/python.md).

    import mha_serve
    with mha_serve.Client("127.0.0.1:50051") as client:          # mha_serve.client
        output = client.attend(queries, keys, values, valid_lens=[3, 2])
        with client.session(model="decoder", causal=True) as session:  # AttendSession
            output = session.step(token)

    with mha_serve.SharedMemoryClient("127.0.0.1:50051") as shm:  # mha_serve.shared_memory
        output = shm.attend(queries, keys, values)     # tensors through /dev/shm

    attn = mha_serve.RemoteMultiheadAttention("127.0.0.1:50051")  # mha_serve.nn (torch)
    output, weights = attn(x, x, x, key_padding_mask=padding)

    mha_serve.export(torch_module, "models", name="mine")         # mha_serve.export
    q, k, v = mha_serve.uniform_inputs(0, [(2, 4, 100), (2, 6, 100), (2, 6, 100)])

Command line: `mha-serve-client` (= `python -m mha_serve`, mha_serve.cli) sends one
request; `python -m mha_serve.export` exports a PyTorch module as a model folder.

Client, Error, ModelInfo, Session, SharedMemoryClient and RemoteMultiheadAttention load
on first use, so that `import mha_serve` needs neither grpc nor torch (the CLI reports a missing grpc in
one line, and the exporter needs no grpc).
"""

from .export import export
from .toy import uniform_inputs

__version__ = "0.1.0"
__all__ = ["Client", "Error", "ModelInfo", "ModelLimits", "RemoteMultiheadAttention",
           "Session", "SharedMemoryClient", "export", "merge_attention", "uniform_inputs"]

_LAZY = {"Client": "client", "Error": "client", "ModelInfo": "client",
         "ModelLimits": "client", "RemoteMultiheadAttention": "nn", "Session": "client",
         "SharedMemoryClient": "shared_memory", "merge_attention": "merge"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
