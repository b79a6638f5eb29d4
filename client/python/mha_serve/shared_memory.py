"""Tensors through Triton's system shared memory (docs/python.md#shared-memory).

    import mha_serve
    with mha_serve.SharedMemoryClient("127.0.0.1:50051") as shm:   # or client.shared_memory()
        out = shm.attend(queries, keys, values, valid_lens=[3, 2])
        out, weights = shm.attend(queries, causal=True, return_attention=True)

For a client on the server's host, against attention_server --shared_memory=system:
the inputs are written into a POSIX shared-memory region (the standard library's
multiprocessing.shared_memory) and the server writes the outputs into it, so no
tensor crosses the socket. The requests are KServe v2 ModelInfer calls that name the
region (Triton's parameters shared_memory_region, shared_memory_byte_size,
shared_memory_offset) on the same port as attention.v1.

The region's life: created (mode 0600, a fresh name from multiprocessing), registered
with SystemSharedMemoryRegister under name = its name, key = "/" + its name, then
unlinked at once, whether the register succeeded or not: the server keeps its own
descriptor, so nothing is left in /dev/shm even if this process is killed; close()
unregisters it. A request bigger than the region replaces it with one that fits
(unregister, close, create, register, unlink); so does a call that ends without the
server's answer (deadline, cancel, connection lost), since its request may still write
into the region. Layout per request: the inputs, then the outputs, each at a
64-byte-aligned offset (so the server reads and writes them in place).

One request at a time per SharedMemoryClient (calls from several threads take turns);
use one per thread for concurrent requests.
"""

import math
import threading
from multiprocessing import shared_memory

import grpc
import numpy as np

from ._proto import grpc_service_pb2 as kserve
from ._proto import grpc_service_pb2_grpc as kserve_grpc
from .client import DEFAULT_TARGET, DEFAULT_TIMEOUT, Client, Error

ALIGNMENT = 64
# A call that ended with these may leave its request running at the server, which
# would still write its outputs into the region: the region is dropped (unregistered:
# the server keeps it until that request ends) and the next request gets a new one.
_MAY_STILL_RUN = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                  grpc.StatusCode.UNAVAILABLE)


def _aligned(n):
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _set_region(parameters, region, byte_size, offset):
    parameters["shared_memory_region"].string_param = region
    parameters["shared_memory_byte_size"].int64_param = byte_size
    parameters["shared_memory_offset"].int64_param = offset


class SharedMemoryClient:
    """attend() through one registered shared-memory region.

    client: a target "HOST:PORT" (a channel of its own, made as Client's from tls,
    timeout, server_name and options), or a mha_serve.Client whose channel is shared
    (and not closed by close()). byte_size: create and register a region of that many
    bytes now (0: at the first request, sized for it). timeout: each call's deadline in
    seconds (the Client's when one is given).
    """

    def __init__(self, client=DEFAULT_TARGET, byte_size=0, tls=None, timeout=None,
                 server_name=None, options=()):
        if isinstance(client, Client):
            self.client = client
            self._owns_client = False
        else:
            self.client = Client(client, tls=tls,
                                 timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
                                 server_name=server_name, options=options)
            self._owns_client = True
        self.timeout = self.client.timeout if timeout is None else timeout
        self._stub = kserve_grpc.GRPCInferenceServiceStub(self.client._channel)
        self._lock = threading.Lock()
        self._shm = None          # the registered region's multiprocessing SharedMemory
        self._closed = False
        self._features = {}       # (model, version) -> (p_o, h) from ModelMetadata
        if byte_size:
            self.reserve(byte_size)

    # The region ---------------------------------------------------------------------

    @property
    def name(self):
        """The region's name at the server ("" before one is made); its file was
        /dev/shm/<name> until registered."""
        return self._shm.name if self._shm is not None else ""

    @property
    def key(self):
        """The region's POSIX shm key, "/" + name ("" before one is made)."""
        return "/" + self._shm.name if self._shm is not None else ""

    @property
    def byte_size(self):
        """The registered region's size in bytes (0 before one is made)."""
        return self._shm.size if self._shm is not None else 0

    def reserve(self, byte_size, timeout=None):
        """Makes sure a region of at least byte_size bytes is registered: creates one,
        or replaces a smaller one. attend() does this itself."""
        with self._lock:
            self._reserve(int(byte_size), timeout)

    def _reserve(self, byte_size, timeout):
        if self._closed:
            raise ValueError("SharedMemoryClient is closed")
        if byte_size <= 0:
            raise ValueError(f"byte_size {byte_size}: a region needs at least one byte")
        if self._shm is not None and self._shm.size >= byte_size:
            return
        self._release()
        shm = shared_memory.SharedMemory(create=True, size=byte_size)
        try:
            self._unary("SystemSharedMemoryRegister", kserve.SystemSharedMemoryRegisterRequest(
                name=shm.name, key="/" + shm.name, offset=0, byte_size=byte_size), timeout)
        except BaseException:
            shm.close()
            raise
        finally:
            # Registered or not, the name goes now: the server holds its descriptor.
            # unlink() also drops the name from multiprocessing's resource_tracker,
            # which would otherwise unlink it again (and warn) at exit.
            shm.unlink()
        self._shm = shm

    def _release(self):
        """Unregisters (best effort: a server gone forgets its regions anyway) and
        unmaps the region, if any."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        try:
            self._stub.SystemSharedMemoryUnregister(
                kserve.SystemSharedMemoryUnregisterRequest(name=shm.name), timeout=self.timeout)
        except grpc.RpcError:
            pass
        finally:
            shm.close()

    def close(self):
        """Unregisters the region and unmaps it; closes the channel when this object
        made it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._release()
            finally:
                if self._owns_client:
                    self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # Requests -----------------------------------------------------------------------

    def _unary(self, rpc, request, timeout):
        try:
            return getattr(self._stub, rpc)(request,
                                            timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as error:
            raise self.client._error(error, rpc) from None

    def model_features(self, model="", model_version="", timeout=None):
        """(p_o, h) of a model, from its KServe ModelMetadata: the last dimension of
        `output` [B, Q, p_o] and the second of `attention` [B, h, Q, K]. Cached."""
        cache_key = (model, model_version)
        if cache_key not in self._features:
            metadata = self._unary("ModelMetadata", kserve.ModelMetadataRequest(
                name=model, version=model_version), timeout)
            shapes = {t.name: list(t.shape) for t in metadata.outputs}
            output, attention = shapes.get("output", []), shapes.get("attention", [])
            if len(output) != 3 or output[2] <= 0 or len(attention) != 4 or attention[1] <= 0:
                raise Error(grpc.StatusCode.INTERNAL,
                            f"model {metadata.name!r}: no output [B, Q, p_o] and attention "
                            f"[B, h, Q, K] in its metadata (outputs {shapes})", "ModelMetadata")
            self._features[cache_key] = (output[2], attention[1])
        return self._features[cache_key]

    def attend(self, queries, keys=None, values=None, valid_lens=None, causal=False,
               head_mask=None, return_attention=False, model="", timeout=None,
               model_version=""):
        """Client.attend's request and answer, the tensors through the region.

        queries (B, Q, d_q); keys (B, K, d_k) and values (B, K, d_v), or neither for
        self-attention; valid_lens: None, B or B*Q key lengths; head_mask: None or h
        factors. Inputs are written into the region as little-endian float32 (valid_lens
        as INT32, INT64 when a value does not fit), converted from any real dtype and
        layout on the way. Returns the output (B, Q, p_o), or (output, attention (B, h,
        Q, K)), as float32 arrays copied out of the region. The server's errors raise
        Error (.rpc "ModelInfer").
        """
        inputs = [("queries", queries, "<f4"), ("keys", keys, "<f4"), ("values", values, "<f4"),
                  ("valid_lens", valid_lens, None), ("head_mask", head_mask, "<f4")]
        arrays = []
        for name, value, dtype in inputs:
            if value is None:
                continue
            array = np.asarray(value)
            if name == "valid_lens":
                if not array.size:
                    continue   # as attention.v1: no lengths = every key counts
                if array.dtype.kind not in "iu":
                    raise TypeError(f"valid_lens: expected integers, got dtype {array.dtype}")
                info = np.iinfo(np.int32)
                fits = array.min() >= info.min and array.max() <= info.max
                dtype = "<i4" if fits else "<i8"
                array = array.reshape(self._lens_shape(array.size, np.shape(queries)))
            elif array.dtype.kind not in "fiu":
                raise TypeError(f"{name}: expected a real-valued array, got dtype {array.dtype}")
            arrays.append((name, array, np.dtype(dtype)))

        q_shape = np.shape(queries)
        if len(q_shape) != 3:   # the outputs could not be placed
            raise ValueError(f"queries: expected (B, Q, d_q), got shape {q_shape}")
        if self._closed:
            raise ValueError("SharedMemoryClient is closed")
        p_o, h = self.model_features(model, model_version, timeout)
        batch, num_queries = q_shape[0], q_shape[1]
        num_keys = np.shape(keys)[1] if keys is not None and np.ndim(keys) >= 2 else num_queries
        outputs = [("output", (batch, num_queries, p_o))]
        if return_attention:
            outputs.append(("attention", (batch, h, num_queries, num_keys)))

        placed, at = [], 0
        for name, array, dtype in arrays:
            placed.append((name, array, dtype, at))
            at += _aligned(array.size * dtype.itemsize)
        output_at = {}
        for name, shape in outputs:
            output_at[name] = (at, math.prod(shape) * 4)
            at += _aligned(math.prod(shape) * 4)

        with self._lock:
            self._reserve(max(at, 1), timeout)
            request = kserve.ModelInferRequest(model_name=model, model_version=model_version)
            if causal:
                request.parameters["causal"].bool_param = True
            for name, array, dtype, offset in placed:
                self._write(array, dtype, offset)
                tensor = request.inputs.add(name=name, shape=array.shape,
                                            datatype={"<f4": "FP32", "<i4": "INT32",
                                                      "<i8": "INT64"}[dtype.str])
                _set_region(tensor.parameters, self._shm.name, array.size * dtype.itemsize,
                            offset)
            for name, (offset, size) in output_at.items():
                # The byte size is the room given; the server writes the tensor's bytes.
                _set_region(request.outputs.add(name=name).parameters, self._shm.name,
                            _aligned(size), offset)
            try:
                response = self._unary("ModelInfer", request, timeout)
            except Error as error:
                if error.code in _MAY_STILL_RUN:
                    self._release()
                raise
            except BaseException:   # interrupted mid-call
                self._release()
                raise
            answers = {}
            for tensor, raw in zip(response.outputs, response.raw_output_contents):
                if tensor.name in output_at:
                    answers[tensor.name] = self._read(tensor, raw, *output_at[tensor.name])
            if len(answers) != len(output_at) or set(answers) != set(output_at):
                raise Error(grpc.StatusCode.INTERNAL,
                            f"answer has outputs {sorted(answers)}, asked for {sorted(output_at)}",
                            "ModelInfer")
        if return_attention:
            return answers["output"], answers["attention"]
        return answers["output"]

    @staticmethod
    def _lens_shape(size, queries_shape):
        """valid_lens' KServe shape: [B] for B values, [B, Q] for B*Q, else [size]
        (the server says what is wrong with it)."""
        if len(queries_shape) >= 2 and size != queries_shape[0]:
            if size == queries_shape[0] * queries_shape[1]:
                return (queries_shape[0], queries_shape[1])
        return (size,)

    def _write(self, array, dtype, offset):
        view = np.ndarray(array.shape, dtype=dtype, buffer=self._shm.buf, offset=offset)
        try:
            view[...] = array   # converts dtype and layout while copying in
        finally:
            del view            # no buffer left exported, or close() cannot unmap

    def _read(self, tensor, raw, offset, room):
        shape = tuple(tensor.shape)
        count = math.prod(shape)
        if raw or count * 4 > room or tensor.datatype != "FP32":
            raise Error(grpc.StatusCode.INTERNAL,
                        f"output {tensor.name!r}: {tensor.datatype} {shape} with "
                        f"{len(raw)} inline bytes does not fit the {room} bytes of the region "
                        "it was given", "ModelInfer")
        return np.frombuffer(self._shm.buf, dtype="<f4", count=count,
                             offset=offset).reshape(shape).astype(np.float32)
