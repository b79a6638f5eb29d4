"""The attention.v1 client (docs/python.md).

    import mha_serve
    with mha_serve.Client("127.0.0.1:50051") as client:
        client.models()                      # [ModelInfo(name="default", ...)], ListModels
        info = client.model()                # GetModel: sizes and limits
        out = client.attend(queries, keys, values, valid_lens=[3, 2])
        out, weights = client.attend(queries, return_attention=True)   # self-attention
        for out in client.stream(dict(queries=q) for q in batches):   # AttendStream
            ...
        with client.session(model="decoder", causal=True) as s:       # AttendSession
            out = s.step(prefix)             # (T, d): the server caches its keys
            out = s.step(next_token)         # (1, d): attends to every token so far

Arrays are numpy (anything np.asarray takes: lists, CPU torch tensors); their values
are sent as little-endian float32 in C order, and answers come back as float32 numpy
arrays: output (B, Q, p_o), attention weights (B, h, Q, K). Tensors travel as the
`raw` bytes of attention.v1.Tensor (the repeated `data` field only when the server
answers with it). The server validates shapes; its errors, and every other gRPC
failure, raise mha_serve.Error with the canonical `.code` (grpc.StatusCode) and the
server's `.details`.

Lower level, for callers that want the messages (benchmarks, timing):
encode_request(...) -> the serialized AttendRequest attend() sends (each tensor's bytes
copied once), build_request(...) -> the same as an attention_pb2.AttendRequest,
Client.call(request or bytes) -> AttendResponse (with .timing),
decode_response(response, return_attention) -> attend()'s result, and
decode_response_bytes(serialized response, return_attention), what attend() uses.

Attention-only models (projections NONE, the disaggregated-decoding worker) take
q, k, v already projected and return, with return_lse=True, each head's log-sum-exp;
merge_attention(out1, lse1, out2, lse2) merges partial attentions over disjoint keys.
"""

import dataclasses
import math
import queue

import grpc
import numpy as np

from ._proto import attention_pb2 as pb2
from ._proto import attention_pb2_grpc as pb2_grpc
from .merge import merge_attention  # noqa: F401 (re-exported)

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 60.0
# gRPC's 4 MiB default cannot carry a BERT-sized output with its weights.
MAX_MESSAGE_BYTES = 256 << 20


class Error(Exception):
    """A failed call: `.code` is the grpc.StatusCode, `.details` the server's message
    (for UNAVAILABLE it names the target), `.rpc` the method ("Attend", ...)."""

    def __init__(self, code, details, rpc=""):
        self.code = code
        self.details = details
        self.rpc = rpc
        super().__init__(f"{code.name}: {rpc + ': ' if rpc else ''}{details}")


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    max_batch_size: int
    max_sequence_length: int
    max_request_bytes: int
    max_attention_elements: int


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """A model's sizes (attention.v1.ModelInfo): p_o = num_hiddens, h = num_heads,
    d_q = query_size, d_k = key_size, d_v = value_size."""
    name: str
    num_hiddens: int
    num_heads: int
    head_size: int
    query_size: int
    key_size: int
    value_size: int
    bias: bool
    precision: str
    scoring: str
    additive_hidden: int
    supports_self_attention: bool
    limits: ModelLimits
    # Grouped-query heads and rotary positions (issue 34), resolved: G (never 0);
    # theta and rotary_dim 0 without rope; projections "full" or "none";
    # kv_cache_precision of sessions' caches, "f32" or "bf16".
    num_kv_heads: int = 0
    rope_theta: float = 0.0
    rotary_dim: int = 0
    rope_interleaved: bool = False
    projections: str = "full"
    kv_cache_precision: str = "f32"

    @classmethod
    def from_proto(cls, info):
        fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(cls)
                  if f.name != "limits"}
        limits = {f.name: getattr(info.limits, f.name) for f in dataclasses.fields(ModelLimits)}
        return cls(**fields, limits=ModelLimits(**limits))


def _float32(value, name):
    """value as a C-order little-endian float32 array (no copy when it already is)."""
    array = np.asarray(value)
    if array.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected a real-valued array, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype="<f4")


def encode_tensor(value, name="tensor", raw=True, tensor=None):
    """A row-major float32 attention.v1.Tensor from an array-like (raw bytes, or the
    repeated `data` field when raw is False), written into `tensor` when given (a
    field of a request: no copy of the message afterwards)."""
    array = _float32(value, name)
    if tensor is None:
        tensor = pb2.Tensor()
    tensor.shape.extend(array.shape)
    if raw:
        tensor.raw = array.tobytes()
    else:
        tensor.data.extend(array.ravel().tolist())
    return tensor


def decode_tensor(tensor, name="tensor"):
    """attention.v1.Tensor -> float32 numpy array of its shape (a writable copy)."""
    shape = tuple(tensor.shape)
    raw = tensor.raw  # each read of a bytes field copies it: read once
    if raw:
        array = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    else:
        array = np.array(tensor.data, dtype=np.float32)
    if array.size != math.prod(shape):
        raise Error(grpc.StatusCode.INTERNAL,
                    f"{name}: {array.size} values in the answer for shape {shape}")
    return array.reshape(shape)


def _request_without_tensors(valid_lens, causal, head_mask, return_attention, model,
                             request_id, model_version="", return_lse=False):
    request = pb2.AttendRequest(model=model, causal=causal, return_attention=return_attention,
                                request_id=request_id, model_version=model_version,
                                return_lse=return_lse)
    if valid_lens is not None:
        lens = np.asarray(valid_lens)
        if lens.size and lens.dtype.kind not in "iu":
            raise TypeError(f"valid_lens: expected integers, got dtype {lens.dtype}")
        request.valid_lens.extend(lens.ravel().tolist())
    if head_mask is not None:
        request.head_mask.extend(np.asarray(head_mask, dtype=np.float32).ravel().tolist())
    return request


def build_request(queries, keys=None, values=None, valid_lens=None, causal=False,
                  head_mask=None, return_attention=False, model="", request_id="",
                  raw=True, model_version="", return_lse=False):
    """The AttendRequest of attend() as a message (keys and values None =
    self-attention). attend() sends encode_request()'s bytes instead: the same
    message, serialized with one copy of the tensors."""
    request = _request_without_tensors(valid_lens, causal, head_mask, return_attention, model,
                                       request_id, model_version, return_lse)
    for name, value in (("queries", queries), ("keys", keys), ("values", values)):
        if value is not None:
            encode_tensor(value, name, raw, getattr(request, name))
    return request


def _varint(n):
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _length_delimited(field_number, length):
    """The key and length of a protobuf length-delimited field (wire type 2)."""
    return _varint(field_number << 3 | 2) + _varint(length)


# AttendRequest's tensor fields; Tensor's shape = 1, raw = 3 (proto/attention.proto).
_TENSOR_FIELDS = (("queries", 2), ("keys", 3), ("values", 4))


def encode_request(queries, keys=None, values=None, valid_lens=None, causal=False,
                   head_mask=None, return_attention=False, model="", request_id="",
                   model_version="", return_lse=False):
    """build_request()'s message, serialized. The small fields go through protobuf;
    each tensor is appended in its wire form, Tensor { shape, raw }, its bytes copied
    once, straight from the array into the message (protobuf would copy them into the
    message and again when serializing). Field order does not matter on the wire."""
    parts = [_request_without_tensors(valid_lens, causal, head_mask, return_attention, model,
                                      request_id, model_version,
                                      return_lse).SerializeToString()]
    for (name, number), value in zip(_TENSOR_FIELDS, (queries, keys, values)):
        if value is None:
            continue
        array = _float32(value, name)
        shape = b"".join(_varint(d) for d in array.shape)
        header = _length_delimited(1, len(shape)) + shape + _length_delimited(3, array.nbytes)
        parts += [_length_delimited(number, len(header) + array.nbytes), header,
                  memoryview(array.reshape(-1)).cast("B")]
    return b"".join(parts)


def _result(output, attention, lse, return_attention, return_lse):
    """attend()'s result: output, with attention and/or lse after it when asked for."""
    if not return_attention and not return_lse:
        return output
    return (output,) + ((attention,) if return_attention else ()) + ((lse,) if return_lse else ())


def decode_response(response, return_attention=False, return_lse=False):
    """output; (output, attention) when return_attention; (output, lse) when return_lse;
    (output, attention, lse) with both."""
    output = decode_tensor(response.output, "output")
    attention = decode_tensor(response.attention, "attention") if return_attention else None
    lse = decode_tensor(response.lse, "lse") if return_lse else None
    return _result(output, attention, lse, return_attention, return_lse)


def _read_varint(data, pos):
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data, start, end):
    """(field number, wire type, value or (begin, end)) of the message in data[start:end]."""
    pos = start
    while pos < end:
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            value, pos = (pos, pos + length), pos + length
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value
    if pos != end:
        raise ValueError("truncated message")


def _raw_tensor(data, begin, end):
    """A Tensor { shape, raw } in data[begin:end] as a writable float32 array, or None
    when it carries `data` (the protobuf path decodes that)."""
    shape, raw = [], None
    for number, wire, value in _fields(data, begin, end):
        if number == 1 and wire == 2:
            pos = value[0]
            while pos < value[1]:
                dim, pos = _read_varint(data, pos)
                shape.append(dim)
        elif number == 1 and wire == 0:
            shape.append(value)
        elif number == 3 and wire == 2:
            raw = value
        elif number == 2:
            return None
    count = math.prod(shape)
    if raw is None or raw[1] - raw[0] != 4 * count:
        return None if count else np.zeros(shape, np.float32)
    return np.frombuffer(data, "<f4", count, raw[0]).reshape(shape).astype(np.float32)


def decode_response_bytes(data, return_attention=False, return_lse=False):
    """decode_response() of a serialized AttendResponse. Tensors in `raw` are read
    straight from `data`, one copy each (protobuf would copy them into the message, out
    of it, then into the array); anything else goes through protobuf."""
    try:
        # AttendResponse: output = 1, attention = 2, lse = 5.
        tensors = {number: _raw_tensor(data, *value)
                   for number, wire, value in _fields(data, 0, len(data))
                   if number in (1, 2, 5) and wire == 2}
        output, attention, lse = tensors.get(1), tensors.get(2), tensors.get(5)
        if (output is not None and (attention is not None or not return_attention)
                and (lse is not None or not return_lse)):
            return _result(output, attention, lse, return_attention, return_lse)
    except (ValueError, IndexError):
        pass
    return decode_response(pb2.AttendResponse.FromString(data), return_attention, return_lse)


def channel_credentials(tls):
    """None/False: plaintext. True: TLS with the system roots. A
    grpc.ChannelCredentials as is. A tuple (root_cert, client_cert, client_key) of
    PEM file paths, any of them None: TLS with that CA (None = system roots) and, when
    both are given, a client certificate (mutual TLS)."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    root, cert, key = (tuple(tls) + (None, None, None))[:3]
    if (cert is None) != (key is None):
        raise ValueError("tls: a client certificate and its key go together")

    def read(path):
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(root), read(key), read(cert))


class Client:
    """A channel to an attention_server.

    target: "HOST:PORT" (any gRPC target). tls: see channel_credentials().
    timeout: the deadline of each call in seconds (a whole stream's for stream()).
    server_name: the name the server's certificate must carry, when it differs from
    the target's host. options: extra grpc channel options.
    """

    def __init__(self, target=DEFAULT_TARGET, tls=None, timeout=DEFAULT_TIMEOUT,
                 server_name=None, options=()):
        self.target = target
        self.timeout = timeout
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *options]
        if server_name:
            opts.append(("grpc.ssl_target_name_override", server_name))
        credentials = channel_credentials(tls)
        # For the hints on UNAVAILABLE (the C++ client's, client/sdk/channel.cc).
        self._tls = credentials is not None
        self._client_cert = isinstance(tls, (tuple, list)) and len(tls) > 1 and tls[1] is not None
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=opts)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=opts)
        self._stub = pb2_grpc.AttentionServiceStub(self._channel)
        # Attend and AttendStream on serialized bytes (encode_request), parsed here.
        self._attend = self._channel.unary_unary("/attention.v1.AttentionService/Attend")
        self._attend_stream = self._channel.stream_stream(
            "/attention.v1.AttentionService/AttendStream")
        self._attend_session = self._channel.stream_stream(
            "/attention.v1.AttentionService/AttendSession",
            request_serializer=pb2.SessionRequest.SerializeToString,
            response_deserializer=pb2.SessionResponse.FromString)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _error(self, error, rpc):
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else "") or str(error)
        if code == grpc.StatusCode.UNAVAILABLE and self.target not in details:
            details = f"{self.target}: {details}"
        hint = self._hint(code, details)
        if hint:
            details = f"{details} ({hint})"
        return Error(code, details, rpc)

    def _hint(self, code, details):
        """What a transport failure most likely means, as the C++ client says it."""
        if code != grpc.StatusCode.UNAVAILABLE:
            return ""
        if not self._tls and "Socket closed" in details:
            return "the server may speak TLS, this client plaintext: give --tls or --tls_ca"
        if self._tls and "Socket closed" in details and not self._client_cert:
            return ("the server may require a client certificate (mutual TLS): "
                    "give --tls_cert and --tls_key")
        if self._tls and "wrong version number" in details:
            return "the server may speak plaintext, this client TLS: drop the --tls flags"
        if self._tls and "certificate verify failed" in details:
            return "the client does not trust the server's certificate: give its CA with --tls_ca"
        return ""

    def _unary(self, rpc, request, timeout, method=None):
        try:
            return (method or getattr(self._stub, rpc))(
                request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as error:
            raise self._error(error, rpc) from None

    def models(self, timeout=None):
        """Every served model (ListModels), sorted by name: a list of ModelInfo."""
        response = self._unary("ListModels", pb2.ListModelsRequest(), timeout)
        return [ModelInfo.from_proto(m) for m in response.models]

    def model(self, name="", timeout=None):
        """GetModel: ModelInfo of `name` ("" = the default model)."""
        return ModelInfo.from_proto(
            self._unary("GetModel", pb2.GetModelRequest(model=name), timeout))

    def call(self, request, timeout=None):
        """Attend with an AttendRequest message or its serialized bytes
        (encode_request()); returns the AttendResponse message (with .timing)."""
        if not isinstance(request, bytes):
            request = request.SerializeToString()
        return pb2.AttendResponse.FromString(self.call_bytes(request, timeout))

    def call_bytes(self, request, timeout=None):
        """Attend on a serialized AttendRequest; returns the serialized AttendResponse."""
        return self._unary("Attend", request, timeout, self._attend)

    def attend(self, queries, keys=None, values=None, valid_lens=None, causal=False,
               head_mask=None, return_attention=False, model="", timeout=None,
               model_version="", return_lse=False):
        """One Attend call.

        queries (B, Q, d_q); keys (B, K, d_k) and values (B, K, d_v), or neither for
        self-attention; valid_lens: None, B or B*Q key lengths; causal: query i sees
        keys j <= i; head_mask: None or h factors; model_version: "" = the newest the
        server serves, or a version number as a string. Returns the output (B, Q, p_o),
        or (output, attention (B, h, Q, K)) when return_attention, as float32 arrays.
        return_lse (attention-only models, projections NONE): each head's log-sum-exp
        (B, h, Q) comes last, (output, lse) or (output, attention, lse); merge partial
        results over disjoint keys with merge_attention().
        """
        request = encode_request(queries, keys, values, valid_lens, causal, head_mask,
                                 return_attention, model, model_version=model_version,
                                 return_lse=return_lse)
        return decode_response_bytes(self.call_bytes(request, timeout), return_attention,
                                     return_lse)

    def shared_memory(self, byte_size=0, timeout=None):
        """A SharedMemoryClient on this client's channel (mha_serve.shared_memory):
        attend() with the tensors in a shared-memory region, for a server on this host
        run with --shared_memory=system. Closing it leaves this client open."""
        from .shared_memory import SharedMemoryClient
        return SharedMemoryClient(self, byte_size=byte_size, timeout=timeout)

    def stream(self, requests, timeout=None):
        """AttendStream: `requests` is an iterable of dicts of attend()'s keyword
        arguments (queries, keys, ..., model); yields attend()'s result for each, in
        order. The first failing request ends the stream with an Error (the results
        before it are yielded first)."""
        wants_attention = []
        wants_lse = []
        failure = []

        def messages():
            try:
                for index, kwargs in enumerate(requests):
                    kwargs = dict(kwargs)
                    wants_attention.append(bool(kwargs.get("return_attention", False)))
                    wants_lse.append(bool(kwargs.get("return_lse", False)))
                    yield encode_request(**kwargs, request_id=str(index))
            except Exception as error:  # noqa: BLE001 (re-raised below, in the caller)
                failure.append(error)

        call = self._attend_stream(messages(),
                                   timeout=self.timeout if timeout is None else timeout)
        try:
            for index, response in enumerate(call):
                yield decode_response_bytes(response, wants_attention[index], wants_lse[index])
        except grpc.RpcError as error:
            raise self._error(error, "AttendStream") from None
        finally:
            call.cancel()
        if failure:
            raise failure[0]

    def session(self, model="", kind="self", causal=False, model_version="", timeout=None,
                return_lse=False):
        """Opens an AttendSession stream: a Session whose keys and values the server
        keeps between steps (docs/service.md "Sessions"). kind: "self" (each step's
        queries are also its keys and values) or "cross" (steps append keys and values
        of their own); causal: query n + i sees keys <= n + i. timeout: a deadline for
        the whole session in seconds; None (the default) sets none, as a session lasts
        as long as its steps keep coming (the server ends one idle for longer than its
        --session_idle_timeout). return_lse (attention-only models, whose sessions are
        kind "cross" with causal True): every step returns (output, lse)."""
        return Session(self, model, kind, causal, model_version, timeout, return_lse)


_END = object()  # ends a Session's request iterator: the client half-closes


class Session:
    """One attention session: one AttendSession stream, whose cache of keys and values
    the server holds until the session ends (close(), the end of a `with` block, a
    failed step, cancel(), or the server's idle timeout).

        with client.session(model="decoder", causal=True) as s:
            out = s.step(prefix)         # (T, d_q) -> (T, p_o); or (1, T, d_q) -> (1, T, p_o)
            out = s.step(token)          # attends to the prefix and itself
            s.context_tokens             # keys cached after the last step
        with client.session(model="m", kind="cross") as s:
            s.step(keys=k, values=v)     # append only: an empty (0, p_o) output
            out = s.step(queries)        # attends to every key appended so far

    Steps run one at a time, in order; a failed step raises Error (rpc
    "AttendSession") and ends the session, as the server ends its stream. A step
    interrupted on the client (KeyboardInterrupt, ...) cancels the session: its
    answer could no longer be told from the next step's.
    """

    def __init__(self, client, model, kind, causal, model_version, timeout, return_lse=False):
        kinds = {"self": pb2.SELF, "cross": pb2.CROSS}
        if kind not in kinds:
            raise ValueError(f"kind: expected 'self' or 'cross', got {kind!r}")
        self._client = client
        # Sent with the first step only: the server reads the settings from it.
        self._settings = pb2.SessionRequest(model=model, kind=kinds[kind], causal=causal,
                                            model_version=model_version, return_lse=return_lse)
        self._return_lse = return_lse
        self._requests = queue.Queue()
        self._responses = client._attend_session(iter(self._requests.get, _END),
                                                 timeout=timeout)
        self._closed = False  # no more steps
        self._half_closed = False  # _END queued: gRPC's sending thread has returned
        self.context_tokens = 0  # keys cached after the last step
        self.timing = None  # the last step's attention.v1.Timing (queue and compute time)

    def step(self, queries=None, keys=None, values=None):
        """One step: queries (T, d_q) or (1, T, d_q), and in a cross session keys and
        values (T_k, d) or (1, T_k, d) to append first. Returns the output in the rank
        of the queries (of the keys for an append-only step): (T, p_o) or (1, T, p_o),
        (0, p_o) or (1, 0, p_o) when there are no queries. A session opened with
        return_lse returns (output, lse), lse (h, T) or (1, h, T) likewise."""
        if self._closed:
            raise ValueError("the session is closed")
        arrays = {name: _float32(value, name)
                  for name, value in (("queries", queries), ("keys", keys), ("values", values))
                  if value is not None}
        lead = arrays.get("queries", arrays.get("keys"))
        unbatched = lead is None or lead.ndim == 2
        request = pb2.SessionRequest()
        if self._settings is not None:
            request.CopyFrom(self._settings)
        for name, array in arrays.items():
            encode_tensor(array[np.newaxis] if array.ndim == 2 else array, name,
                          tensor=getattr(request, name))
        self._requests.put(request)
        self._settings = None
        try:
            response = next(self._responses)
        except StopIteration:  # the server ended the stream without an answer
            self._end()
            raise Error(grpc.StatusCode.INTERNAL, "the session ended without an answer",
                        "AttendSession") from None
        except grpc.RpcError as error:
            self._end()
            raise self._client._error(error, "AttendSession") from None
        except BaseException:
            self.cancel()
            raise
        self.context_tokens = response.context_tokens
        self.timing = response.timing
        output = decode_tensor(response.output, "output")
        output = output[0] if unbatched and output.ndim == 3 else output
        if not self._return_lse:
            return output
        lse = decode_tensor(response.lse, "lse")  # (1, h, T)
        return output, (lse[0] if unbatched and lse.ndim == 3 else lse)

    def close(self):
        """Half-closes the stream and waits for the server to end it; the server then
        frees the session's cache. Raises Error if the server ended it with an error."""
        if self._closed:
            self._end()
            return
        self._end()
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError as error:
            raise self._client._error(error, "AttendSession") from None

    def cancel(self):
        """Ends the session at once (CANCELLED on the server)."""
        self._responses.cancel()
        self._end()

    def _end(self):
        """No more steps; lets gRPC's thread that sends them return (once)."""
        self._closed = True
        if not self._half_closed:
            self._half_closed = True
            self._requests.put(_END)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.cancel()
