#!/usr/bin/env python3
"""Writes the small seed corpora under tests/fuzz/corpus/ (committed; rerun to
regenerate). No dependencies: the protobuf wire format and safetensors are written
by hand, so the seeds do not depend on generated code.

Usage: python3 tests/fuzz/make_seeds.py
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def varint(n):
    n &= (1 << 64) - 1  # negative int64/int32 are 10-byte varints
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(number, wire_type, payload):
    key = varint((number << 3) | wire_type)
    if wire_type == 2:
        return key + varint(len(payload)) + payload
    return key + payload


def tensor(shape, data=None, count=None, raw=False):
    """attention.v1.Tensor; raw puts the values in `raw` (field 3) instead of `data`."""
    if data is None:
        n = 1
        for d in shape:
            n *= d
        n = n if count is None else count
        data = [((i * 37) % 17 - 8) / 8.0 for i in range(max(n, 0))]
    body = field(1, 2, b"".join(varint(d) for d in shape))
    body += field(3 if raw else 2, 2, struct.pack("<%df" % len(data), *data))
    return body


def request(model=b"", queries=None, keys=None, values=None, valid_lens=(), causal=False,
            return_attention=False, head_mask=(), request_id=b""):
    out = b""
    if model:
        out += field(1, 2, model)
    for number, t in ((2, queries), (3, keys), (4, values)):
        if t is not None:
            out += field(number, 2, t)
    if valid_lens:
        out += field(5, 2, b"".join(varint(v) for v in valid_lens))
    if causal:
        out += field(6, 0, varint(1))
    if return_attention:
        out += field(7, 0, varint(1))
    if head_mask:
        out += field(8, 2, struct.pack("<%df" % len(head_mask), *head_mask))
    if request_id:
        out += field(9, 2, request_id)
    return out


def request_seeds():
    # Models in request_fuzzer.cc: default (d 4, h 2), cross (p_o 6, h 3, d_q 3,
    # d_k 5, d_v 2), tight (d 4, h 1, small limits).
    return {
        "self_attention": request(queries=tensor([2, 3, 4]), request_id=b"a"),
        "self_valid_lens_causal": request(queries=tensor([2, 3, 4]), valid_lens=[3, 0],
                                          causal=True, return_attention=True),
        "per_query_lens_head_mask": request(queries=tensor([1, 3, 4]), valid_lens=[1, 2, 3],
                                            head_mask=[1.0, 0.0]),
        "cross": request(model=b"cross", queries=tensor([2, 2, 3]), keys=tensor([2, 4, 5]),
                         values=tensor([2, 4, 2]), valid_lens=[4, 1], return_attention=True,
                         head_mask=[1.0, 0.5, 0.0]),
        "tight": request(model=b"tight", queries=tensor([2, 4, 4]), return_attention=True),
        "raw_cross": request(model=b"cross", queries=tensor([2, 2, 3], raw=True),
                             keys=tensor([2, 4, 5], raw=True), values=tensor([2, 4, 2]),
                             valid_lens=[4, 1], return_attention=True),
        "raw_and_data": request(queries=tensor([1, 2, 4]) + field(3, 2, b"\0" * 32)),
        "unknown_model": request(model=b"nope", queries=tensor([1, 1, 4])),
        "negative_dim": request(queries=tensor([1, -3, 4], data=[0.0] * 4)),
        "overflow_shape": request(queries=tensor([1 << 40, 1 << 40, 4], data=[0.0] * 4)),
        "nan": request(queries=tensor([1, 1, 4], data=[0.0, float("nan"), 1.0, 2.0])),
        "short_data": request(queries=tensor([1, 2, 4], count=7)),
        # fuzz_models.h's rotary (p_o 8, h 4, G 2, rope) and mqa (d 4, G 1, rope, bias).
        "rotary_q_lt_k_causal": request(model=b"rotary", queries=tensor([1, 2, 8]),
                                        keys=tensor([1, 5, 8]), values=tensor([1, 5, 8]),
                                        valid_lens=[4], causal=True),
        "rotary_q_gt_k": request(model=b"rotary", queries=tensor([1, 4, 8]),
                                 keys=tensor([1, 2, 8]), values=tensor([1, 2, 8])),
        "mqa_self_causal": request(model=b"mqa", queries=tensor([2, 3, 4]), valid_lens=[3, 1],
                                   causal=True, return_attention=True),
    }


def safetensors(tensors, metadata=None):
    header, blob = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob


def f32(n, scale=0.1):
    return struct.pack("<%df" % n, *[((i * 13) % 11 - 5) * scale for i in range(n)])


def safetensors_seeds():
    # Configurations in safetensors_fuzzer.cc: torch packed (p_o 4, bias), torch
    # kdim/vdim (p_o 4, d_k 3, d_v 2), d2l (p_o 4, d_q 3, d_k 5, d_v 2, bias).
    return {
        "torch_packed": safetensors([
            ("in_proj_weight", "F32", [12, 4], f32(48)), ("in_proj_bias", "F32", [12], f32(12)),
            ("out_proj.weight", "F32", [4, 4], f32(16)), ("out_proj.bias", "F32", [4], f32(4))],
            {"format": "pt"}),
        "torch_kvdim": safetensors([
            ("q_proj_weight", "F32", [4, 4], f32(16)), ("k_proj_weight", "F32", [4, 3], f32(12)),
            ("v_proj_weight", "F32", [4, 2], f32(8)), ("out_proj.weight", "F32", [4, 4], f32(16))]),
        "d2l_bias": safetensors([
            ("W_q.weight", "F32", [4, 3], f32(12)), ("W_k.weight", "F32", [4, 5], f32(20)),
            ("W_v.weight", "F32", [4, 2], f32(8)), ("W_o.weight", "F32", [4, 4], f32(16)),
            ("W_q.bias", "F32", [4], f32(4)), ("W_k.bias", "F32", [4], f32(4)),
            ("W_v.bias", "F32", [4], f32(4)), ("W_o.bias", "F32", [4], f32(4))]),
        "dtypes": safetensors([
            ("h", "F16", [2, 2], struct.pack("<4H", 0x3C00, 0xC000, 0x0001, 0x7C00)),
            ("b", "BF16", [2], struct.pack("<2H", 0x3F80, 0xFF80)),
            ("d", "F64", [1], struct.pack("<d", 2.5)), ("i", "I32", [1], struct.pack("<i", 7)),
            ("empty", "F32", [0, 3], b"")]),
    }


def config_seeds():
    return {
        "toy": b'name: "fuzz"\nnum_hiddens: 8\nnum_heads: 2\nseeded { seed: 0 }\n',
        "cross_bf16": b"num_hiddens: 6 num_heads: 3 query_size: 3 key_size: 5 value_size: 2\n"
                      b'bias: true precision: "bf16" dropout: 0.1 seeded { seed: 7 }\n',
        "limits_batching": b"num_hiddens: 768 num_heads: 12 bias: true\n"
                           b"limits { max_batch_size: 64 max_sequence_length: 512 "
                           b"max_request_bytes: 1048576 max_attention_elements: 4096 }\n"
                           b"batching { max_batch_size: 32 max_queue_delay_us: 500 "
                           b"max_queue_size: 128 }\n",
        "file": b'num_hiddens: 16 num_heads: 4 file: "weights.safetensors"\n',
        "bad_heads": b"num_hiddens: 100 num_heads: 7 seeded { seed: 0 }\n",
        # Issue 34's fields: grouped-query heads, rotary positions, the session cache.
        "gqa_rope": b"num_hiddens: 8 num_heads: 4 num_kv_heads: 2 bias: true\n"
                    b"rope { theta: 500000 rotary_dim: 2 interleaved: true }\n"
                    b'kv_cache_precision: "bf16" seeded { seed: 3 }\n',
        "mqa_rope_default": b"num_hiddens: 6 num_heads: 3 num_kv_heads: 1 rope {} "
                            b"seeded { seed: 4 }\n",
        "bad_kv_heads": b"num_hiddens: 8 num_heads: 4 num_kv_heads: 3 seeded { seed: 0 }\n",
        "bad_rotary_dim": b"num_hiddens: 8 num_heads: 2 rope { rotary_dim: 3 } "
                          b"seeded { seed: 0 }\n",
        "bad_theta": b"num_hiddens: 8 num_heads: 2 rope { theta: -inf } seeded { seed: 0 }\n",
        "bad_cache": b'num_hiddens: 8 num_heads: 2 precision: "bf16" kv_cache_precision: "f32"\n',
        "projections_none": b"num_hiddens: 8 num_heads: 2 projections: NONE\n",
        # Issue 37: int8 models, and the two layers int8 refuses.
        "int8_gqa": b'num_hiddens: 8 num_heads: 4 num_kv_heads: 2 bias: true precision: "int8" '
                    b"seeded { seed: 5 }\n",
        "bad_int8_additive": b'num_hiddens: 8 num_heads: 2 precision: "int8" scoring: ADDITIVE '
                             b"additive_hidden: 4\n",
        "bad_int8_none": b'num_hiddens: 8 num_heads: 2 precision: "int8" projections: NONE\n',
        "warmup": b"num_hiddens: 8 num_heads: 2 seeded { seed: 0 } "
                  b"limits { max_sequence_length: 16 }\n"
                  b"warmup { batch: 2 num_queries: 16 } warmup { batch: 1 num_queries: 3 "
                  b"num_keys: 17 }\n",
    }


def http_body(body, header_length=None, mode=None):
    # http_body_fuzzer.cc: mode byte (0 no Inference-Header-Content-Length, 1 the value
    # modulo the body size + 1, 2 the value as int32), 4-byte value, then the body.
    if isinstance(body, str):
        body = body.encode()
    if mode is None:
        mode = 0 if header_length is None else 1
    return bytes([mode]) + struct.pack("<i", header_length or 0) + body


def http_body_seeds():
    binary_json = json.dumps({
        "id": "b1", "parameters": {"binary_data_output": True},
        "inputs": [
            {"name": "h", "datatype": "FP16", "shape": [1, 2],
             "parameters": {"binary_data_size": 4}},
            {"name": "n", "datatype": "INT64", "shape": [2], "data": [5, -6]},
            {"name": "f", "datatype": "FP32", "shape": [3], "parameters": {"binary_data_size": 12}}],
        "outputs": [{"name": "n", "parameters": {"binary_data": False}}, {"name": "f"}]}).encode()
    binary_tail = struct.pack("<2H", 0x3C00, 0x7E00) + struct.pack("<3f", 0.1, -2.5, 1e-40)
    common_json = json.dumps({
        "id": "7", "inputs": [
            {"name": "queries", "datatype": "FP32", "shape": [1, 2, 2],
             "parameters": {"binary_data_size": 16}},
            {"name": "valid_lens", "datatype": "INT32", "shape": [1],
             "parameters": {"binary_data_size": 4}}],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}]},
        separators=(",", ":")).encode()
    common_tail = struct.pack("<4f", 1, 2, 3, 4) + struct.pack("<i", 2)
    return {
        "json_flat": http_body(json.dumps({
            "id": "r1",
            "inputs": [{"name": "queries", "datatype": "FP32", "shape": [1, 2, 2],
                        "data": [0.1, -2.5, 3, 1e-45]}],
            "outputs": [{"name": "output"}]})),
        "json_nested_types": http_body(json.dumps({"inputs": [
            {"name": "b", "datatype": "BOOL", "shape": [2, 1], "data": [[True], [False]]},
            {"name": "u8", "datatype": "UINT8", "shape": [1, 2], "data": [[0, 255]]},
            {"name": "i16", "datatype": "INT16", "shape": [2], "data": [-32768, 32767]},
            {"name": "u64", "datatype": "UINT64", "shape": [1], "data": [18446744073709551615]},
            {"name": "d", "datatype": "FP64", "shape": [1, 1, 1], "data": [[[1e300]]]}]})),
        "binary_mixed": http_body(binary_json + binary_tail, len(binary_json)),
        "binary_leftover": http_body(binary_json + binary_tail + b"xx", len(binary_json)),
        "parameters": http_body(json.dumps({
            "parameters": {"b": True, "i": -5, "u": 18446744073709551615, "d": 1.5, "s": "x"},
            "inputs": [{"name": "x", "datatype": "INT8", "shape": [0], "data": [],
                        "parameters": {"k": "v"}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True, "p": 2}}]})),
        "huge_shape": http_body(json.dumps({"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1 << 40, 3], "data": [[1, 2, 3]]}]})),
        "shared_memory_mixed": http_body(json.dumps({
            "parameters": {"binary_data_output": True},
            "inputs": [
                {"name": "queries", "datatype": "FP32", "shape": [1, 2, 2],
                 "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 16,
                                "shared_memory_offset": 64}},
                {"name": "keys", "datatype": "FP32", "shape": [1], "data": [1.5]}],
            "outputs": [{"name": "output", "parameters": {
                "shared_memory_region": "out", "shared_memory_byte_size": 4096}}]})),
        # attention_client's binary request, the fast path's form (compact, as it writes it).
        "binary_common": http_body(common_json + common_tail, len(common_json)),
        "deep": http_body(b'{"inputs": [], "x": ' + b"[" * 40 + b"]" * 40 + b"}"),
        "bad_header_length": http_body(b'{"inputs": []}', -3, mode=2),
    }


def http_framing_seeds():
    # http_framing_fuzzer.cc: byte 0 picks the piece size, the rest is a connection's bytes.
    get = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b'{"inputs": []}'
    post = (b"POST /v2/models/m/versions/1/infer?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: %d"
            b"\r\nExpect: 100-continue\r\n\r\n" % len(body) + body)
    chunked = (b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               b"\r\n4;ext=1\r\n{\"a\"\r\n2\r\n:1\r\n1\r\n}\r\n0\r\nTrailer: t\r\n\r\n")
    return {
        "pipelined": b"\x00" + get + post + chunked + b"GET /v2 HTTP/1.0\r\n\r\n",
        "bytewise": b"\x00" + post,
        "split7": b"\x06" + chunked + get,
        "bare_lf": b"\x03" + b"\r\nGET /v2/models/a%20b/ready HTTP/1.1\nHost: x\n\n",
        "both_lengths": b"\x01" + b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n",
        "lengths": b"\x02" + b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3, 3\r\n"
                   b"Content-Length: 4\r\n\r\nabcd",
        "shm_routes": b"\x05" + b"GET /v2/systemsharedmemory/region/r1/status HTTP/1.1\r\nHost: x"
                       b"\r\n\r\nPOST /v2/cudasharedmemory/unregister HTTP/1.1\r\nHost: x\r\n\r\n",
    }


def http_response_seeds():
    # http_response_fuzzer.cc: byte 0 picks the piece size, bit 7 of byte 1 a HEAD
    # request, the rest is what a server sends before it closes.
    infer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
             b"Inference-Header-Content-Length: 2\r\nContent-Length: 6\r\n\r\n{}\x00\x00\x80?")
    return {
        "length": b"\x00\x00" + infer,
        "bytewise_head": b"\x00\x80" + infer,
        "chunked": b"\x06\x00" + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"4;x=1\r\nabcd\r\n0\r\nTrailer: t\r\n\r\n",
        "to_close": b"\x02\x00" + b"HTTP/1.0 404 Not Found\r\nConnection: keep-alive\r\n\r\nno",
        "interim": b"\x03\x00" + b"HTTP/1.1 100 Continue\n\nHTTP/1.1 204 No Content\n\n",
        "lengths": b"\x01\x00" + b"HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n"
                   b"Content-Length: 4\r\n\r\nabcd",
    }


def infer_input(name, datatype, shape, contents=b""):
    # ModelInferRequest.InferInputTensor: name 1, datatype 2, shape 3 (packed), contents 5
    body = field(1, 2, name) + field(2, 2, datatype)
    body += field(3, 2, b"".join(varint(d) for d in shape))
    return body + (field(5, 2, contents) if contents else b"")


def infer_request(model, inputs, raw=(), outputs=(), causal=None):
    # ModelInferRequest: model_name 1, id 3, parameters 4, inputs 5, outputs 6, raw 7
    body = field(1, 2, model) + field(3, 2, b"seed")
    if causal is not None:  # map entry: key 1, value 2 = InferParameter{bool_param 1}
        body += field(4, 2, field(1, 2, b"causal") + field(2, 2, field(1, 0, varint(causal))))
    body += b"".join(field(5, 2, i) for i in inputs)
    body += b"".join(field(6, 2, field(1, 2, o)) for o in outputs)
    return body + b"".join(field(7, 2, r) for r in raw)


def inference_request_seeds():
    q = struct.pack("<16f", *[((i * 37) % 17 - 8) / 8.0 for i in range(16)])
    half = bytes(range(32))
    return {
        "raw_fp32": infer_request(b"default", [infer_input(b"queries", b"FP32", [2, 2, 4])], [q]),
        "typed_fp32_causal": infer_request(
            b"default", [infer_input(b"queries", b"FP32", [1, 4, 4], field(6, 2, q))],
            causal=1),
        "bf16_fp16": infer_request(
            b"default", [infer_input(b"queries", b"BF16", [1, 4, 4]),
                         infer_input(b"head_mask", b"FP16", [2])], [half, b"\x00\x3c\x00\x00"]),
        "cross_lens_attention": infer_request(
            b"cross", [infer_input(b"queries", b"FP32", [1, 2, 3]),
                       infer_input(b"keys", b"FP32", [1, 2, 5]),
                       infer_input(b"values", b"FP32", [1, 2, 2]),
                       infer_input(b"valid_lens", b"INT64", [1, 2])],
            [q[:24], q[:40], q[:16], struct.pack("<2q", 1, 2)], outputs=[b"attention", b"output"]),
        "rotary_q_lt_k": infer_request(
            b"rotary", [infer_input(b"queries", b"FP32", [1, 1, 8]),
                        infer_input(b"keys", b"FP32", [1, 2, 8]),
                        infer_input(b"values", b"FP32", [1, 2, 8])],
            [q[:32], q[:64], q[:64]], causal=True),
    }


def session_request(model=b"", kind=None, causal=False, queries=None, keys=None, values=None,
                    model_version=b""):
    """attention.v1.SessionRequest: model 1, kind 2, causal 3, queries 4, keys 5,
    values 6, model_version 7."""
    out = field(1, 2, model) if model else b""
    if kind is not None:
        out += field(2, 0, varint(kind))
    if causal:
        out += field(3, 0, varint(1))
    for number, t in ((4, queries), (5, keys), (6, values)):
        if t is not None:
            out += field(number, 2, t)
    if model_version:
        out += field(7, 2, model_version)
    return out


def session(*messages):
    # session_request_fuzzer.cc: the stream's messages, each a varint length and its
    # bytes (protobuf's delimited format).
    return b"".join(varint(len(m)) + m for m in messages)


def rows(n, d, offset=0, raw=False):
    """A (1, n, d) tensor of rows offset .. offset + n of one fixed sequence."""
    data = [((i * 37) % 17 - 8) / 8.0 for i in range(offset * d, (offset + n) * d)]
    return tensor([1, n, d], data=data, raw=raw)


def self_chunks(model, d, chunks, causal=True, raw=False):
    out, at = [], 0
    for n in chunks:
        first = not out
        out.append(session_request(model=model if first else b"", causal=causal and first,
                                   queries=rows(n, d, at, raw)))
        at += n
    return session(*out)


def session_request_seeds():
    # Models in fuzz_models.h: default (d 4, h 2), cross (p_o 6, h 3, d_q 3, d_k 5,
    # d_v 2), short (d 4, h 1, max_session_tokens 12), half (d 4, bf16), additive.
    # The fuzzer's cache budget is 6 KiB: 6 blocks (192 tokens) of d 4, 4 of cross.
    CROSS = 1
    cross_steps = [
        session_request(model=b"cross", kind=CROSS, keys=rows(5, 5), values=rows(5, 2)),
        session_request(queries=rows(2, 3)),
        session_request(queries=rows(1, 3, 2), keys=rows(3, 5, 5), values=rows(3, 2, 5)),
        session_request(queries=tensor([1, 0, 3], data=[]), keys=rows(1, 5, 8),
                        values=rows(1, 2, 8)),
    ]
    return {
        "self_causal_chunked": self_chunks(b"", 4, [3, 1, 1, 4]),
        "rotary_self_chunks": self_chunks(b"rotary", 8, [3, 1, 2]),
        "rotary_cross_refused": session(session_request(model=b"rotary", kind=CROSS,
                                                        keys=rows(2, 8), values=rows(2, 8))),
        "mqa_bf16_cache_chunks": self_chunks(b"mqa", 4, [5, 1, 1], causal=False),
        "self_whole_then_decode": self_chunks(b"default", 4, [30, 1, 1, 1]),
        "self_noncausal_raw": self_chunks(b"default", 4, [2, 2, 1], causal=False, raw=True),
        "self_across_blocks": self_chunks(b"default", 4, [31, 2, 40]),
        "self_over_budget": self_chunks(b"default", 4, [100, 100]),
        "short_over_token_limit": self_chunks(b"short", 4, [8, 4, 1]),
        "half_bf16": self_chunks(b"half", 4, [5, 1, 1]),
        "cross_chunked": session(*cross_steps),
        "cross_causal": session(
            session_request(model=b"cross", kind=CROSS, causal=True, queries=rows(2, 3),
                            keys=rows(2, 5), values=rows(2, 2)),
            session_request(queries=rows(1, 3, 2), keys=rows(1, 5, 2), values=rows(1, 2, 2)),
            session_request(queries=rows(3, 3, 3), keys=rows(3, 5, 3), values=rows(3, 2, 3))),
        "cross_raw_then_truncated": session(
            session_request(model=b"cross", kind=CROSS, queries=rows(1, 3, raw=True),
                            keys=rows(2, 5, raw=True), values=rows(2, 2, raw=True)),
            session_request(queries=rows(1, 3, 1))) + b"\x40\x22",
        "cross_keys_without_values": session(
            session_request(model=b"cross", kind=CROSS, queries=rows(1, 3), keys=rows(1, 5))),
        "self_on_cross_model": session(session_request(model=b"cross", queries=rows(1, 3))),
        "kind_unknown": session(session_request(kind=7, queries=rows(1, 4))),
        "model_in_second": session(session_request(queries=rows(1, 4)),
                                   session_request(model=b"default", queries=rows(1, 4, 1))),
        "additive": session(session_request(model=b"additive", queries=rows(1, 4))),
        "nan_in_second": session(
            session_request(queries=rows(2, 4)),
            session_request(queries=tensor([1, 1, 4], data=[0.0, float("nan"), 1.0, 2.0]))),
        "huge_shape": session(session_request(
            queries=tensor([1, 1 << 40, 100], data=[0.0] * 100))),
        "negative_t": session(session_request(queries=tensor([1, -1, 4], data=[0.0] * 4))),
        "raw_odd_bytes": session(session_request(
            queries=field(1, 2, b"".join(varint(d) for d in [1, 1, 4])) + field(3, 2, b"\0" * 15))),
    }


def shared_memory_seeds():
    """shared_memory_fuzzer.cc: a read's offset and length (two little-endian
    uint64s), a key selector (odd: the fuzzer's real shm file), the register body."""
    def seed(body, offset=0, length=16, real=1):
        return struct.pack("<QQB", offset, length, real) + body
    return {
        "real_whole": seed(b'{"key": "/x", "offset": 0, "byte_size": 4096}'),
        "real_tail": seed(b'{"key": "/x", "offset": 4000, "byte_size": 96}', offset=80),
        "real_beyond": seed(b'{"key": "/x", "offset": 4000, "byte_size": 97}'),
        "read_beyond": seed(b'{"key": "/x", "byte_size": 64}', offset=60, length=8),
        "huge_offset": seed(b'{"key": "/x", "offset": 18446744073709551615, "byte_size": 1}'),
        "own_key": seed(b'{"key": "/a/b", "byte_size": 16}', real=0),
        "dot_key": seed(b'{"key": "/..", "byte_size": 16}', real=0),
        "string_size": seed(b'{"key": "/x", "byte_size": "16"}'),
        "negative": seed(b'{"key": "/x", "byte_size": -16}'),
        "not_object": seed(b'[1, 2]'),
        "peer": seed(b'ipv6:[::ffff:127.0.0.1]:50051', real=0),
    }


def main():
    for target, seeds in (("request", request_seeds()), ("safetensors", safetensors_seeds()),
                          ("config", config_seeds()), ("http_body", http_body_seeds()),
                          ("http_framing", http_framing_seeds()),
                          ("http_response", http_response_seeds()),
                          ("inference_request", inference_request_seeds()),
                          ("session_request", session_request_seeds()),
                          ("shared_memory", shared_memory_seeds())):
        folder = os.path.join(HERE, "corpus", target)
        os.makedirs(folder, exist_ok=True)
        for name, data in seeds.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        print("%s: %d seeds" % (target, len(seeds)))


if __name__ == "__main__":
    main()
