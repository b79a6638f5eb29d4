#!/usr/bin/python3
"""The Open Inference Protocol over gRPC (inference.GRPCInferenceService) against
the real attention_server: every RPC, ModelInfer and ModelStreamInfer checked
against attention.v1 Attend on the same server and the same inputs, and
ModelStatistics checked against the server's /metrics.

    kserve_grpc_test.py SERVER_BINARY SOURCE_DIR [unittest arguments]

The Python stubs are generated at run time from SOURCE_DIR/proto into a
temporary directory.
"""

import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import types
import unittest
import urllib.error
import urllib.request

import grpc
import numpy as np
import torch
from grpc_tools import protoc

from server_harness import start_server, stop_server

# ModelInfer and Attend run the same kernels on the same float32 inputs.
TOLERANCE = 1e-6
# The built-in model "default".
D = 100      # d_q = d_k = d_v
P_O = 100    # output features
HEADS = 5
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1)]
TIMEOUT = 60.0

BINARY = None
SOURCE = None
API = None  # the generated modules, see load_api()


def load_api(source, out_dir):
    """Generates the stubs of SOURCE/proto into out_dir; returns their modules."""
    proto_dir = os.path.join(source, "proto")
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    files = ["inference/grpc_service.proto", "inference/model_config.proto",
             "attention.proto", "grpc/health/v1/health.proto"]
    code = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}",
                        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *files])
    if code != 0:
        raise RuntimeError(f"protoc failed on {proto_dir} (exit {code})")
    sys.path.insert(0, out_dir)
    import attention_pb2  # noqa: E402  (generated above)
    import attention_pb2_grpc  # noqa: E402
    from inference import grpc_service_pb2  # noqa: E402
    from inference import grpc_service_pb2_grpc  # noqa: E402
    from inference import model_config_pb2  # noqa: E402
    # grpc/health/v1 would resolve to the installed grpc package: load the
    # message module from its file and call Check through the channel directly.
    path = os.path.join(out_dir, "grpc", "health", "v1", "health_pb2.py")
    spec = importlib.util.spec_from_file_location("mha_health_pb2", path)
    health_pb2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(health_pb2)
    return types.SimpleNamespace(a=attention_pb2, a_grpc=attention_pb2_grpc,
                                 inf=grpc_service_pb2, inf_grpc=grpc_service_pb2_grpc,
                                 config=model_config_pb2, health=health_pb2)


# --- numeric helpers -----------------------------------------------------------

def bf16_bits(array):
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest, ties to
    even, as the top 16 bits of the float32 after adding the rounding bias."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    assert np.all(np.isfinite(array)), "finite values only"
    bias = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + bias) >> 16).astype(np.uint16)


def bf16_round(array):
    """The float32 values a BF16 tensor of `array` holds."""
    return (bf16_bits(array).astype(np.uint32) << 16).view(np.float32)


def fp16_round(array):
    return np.asarray(array, dtype=np.float32).astype(np.float16).astype(np.float32)


NUMPY_TYPES = {"FP32": "<f4", "FP16": "<f2", "INT32": "<i4", "INT64": "<i8"}


def raw_bytes(datatype, array):
    """Row-major little-endian bytes of `array` as `datatype`."""
    if datatype == "BF16":
        return bf16_bits(array).astype("<u2").tobytes()
    return np.ascontiguousarray(array, dtype=NUMPY_TYPES[datatype]).tobytes()


def max_abs_diff(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} != {b.shape}")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def uniform(seed, *shape):
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape).astype(np.float32)


# --- request builders ----------------------------------------------------------

def infer_request(inputs, raw=True, causal=None, outputs=(), request_id="", model="default"):
    """A ModelInferRequest. inputs: (name, datatype, array) triples; raw: the
    data in raw_input_contents, else in the typed contents field."""
    request = API.inf.ModelInferRequest(model_name=model, id=request_id)
    for name, datatype, array in inputs:
        array = np.asarray(array)
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if raw:
            request.raw_input_contents.append(raw_bytes(datatype, array))
        elif datatype == "FP32":
            tensor.contents.fp32_contents.extend(array.astype(np.float32).ravel().tolist())
        elif datatype == "INT32":
            tensor.contents.int_contents.extend(int(v) for v in array.ravel())
        elif datatype == "INT64":
            tensor.contents.int64_contents.extend(int(v) for v in array.ravel())
        else:
            raise ValueError(f"no typed contents for {datatype}")
    if causal is not None:
        request.parameters["causal"].bool_param = causal
    for name in outputs:
        request.outputs.add(name=name)
    return request


def attend_request(queries, keys=None, values=None, valid_lens=None, causal=False,
                   head_mask=None, return_attention=False, request_id=""):
    """The attention.v1 AttendRequest of the same inputs (float32 values)."""
    def tensor(array):
        array = np.asarray(array, dtype=np.float32)
        return API.a.Tensor(shape=list(array.shape), data=array.ravel().tolist())
    request = API.a.AttendRequest(model="default", queries=tensor(queries), causal=causal,
                                  return_attention=return_attention, request_id=request_id)
    if keys is not None:
        request.keys.CopyFrom(tensor(keys))
        request.values.CopyFrom(tensor(values))
    if valid_lens is not None:
        request.valid_lens.extend(int(v) for v in np.asarray(valid_lens).ravel())
    if head_mask is not None:
        request.head_mask.extend(np.asarray(head_mask, dtype=np.float32).tolist())
    return request


def from_tensor(tensor):
    return np.array(tensor.data, dtype=np.float32).reshape(tuple(tensor.shape))


def infer_outputs(test, response):
    """name -> float32 array of a ModelInferResponse, checking the raw layout."""
    test.assertEqual(len(response.raw_output_contents), len(response.outputs))
    result = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        test.assertEqual(tensor.datatype, "FP32", tensor.name)
        shape = tuple(tensor.shape)
        test.assertEqual(len(raw), 4 * int(np.prod(shape)), tensor.name)
        result[tensor.name] = np.frombuffer(raw, dtype="<f4").reshape(shape)
    return result


# --- metrics -------------------------------------------------------------------

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(port):
    """Prometheus text -> list of (name, labels dict, value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as f:
        text = f.read().decode()
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        if match is None:
            raise AssertionError(f"unparsed metrics line: {line!r}")
        labels = dict(LABEL.findall(match.group(2) or ""))
        samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def metric_sum(samples, name, **labels):
    return sum(value for n, l, value in samples
               if n == name and all(l.get(k) == v for k, v in labels.items()))


# --- the tests -----------------------------------------------------------------

class ServerTestCase(unittest.TestCase):
    """One server for the class; stubs of both services on one channel."""

    server_args = []

    @classmethod
    def setUpClass(cls):
        cls.proc, cls.target = start_server(BINARY, cls.server_args)
        cls.channel = grpc.insecure_channel(cls.target, options=CHANNEL_OPTIONS)
        cls.inf = API.inf_grpc.GRPCInferenceServiceStub(cls.channel)
        cls.att = API.a_grpc.AttentionServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        code = stop_server(cls.proc)
        if code != 0:
            raise AssertionError(f"server exit code {code}")

    def attend(self, **kwargs):
        return self.att.Attend(attend_request(**kwargs), timeout=TIMEOUT)

    def infer(self, *args, **kwargs):
        return self.inf.ModelInfer(infer_request(*args, **kwargs), timeout=TIMEOUT)

    def assertRpcError(self, code, call, *args, names=None):
        with self.assertRaises(grpc.RpcError) as caught:
            call(*args, timeout=TIMEOUT)
        self.assertEqual(caught.exception.code(), code, caught.exception.details())
        if names is not None:
            self.assertIn(names, caught.exception.details())
        return caught.exception


class HelperTest(unittest.TestCase):
    """The test's own BF16 rounding against PyTorch's (round to nearest even)."""

    def test_bf16_round_matches_torch(self):
        values = uniform(1, 4096) * np.float32(1e3)
        # Exact ties: the low 16 bits 0x8000, once with an even and once with an
        # odd upper half.
        ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xC1018000],
                        dtype=np.uint32).view(np.float32)
        values = np.concatenate([values, ties, np.float32([0.0, -0.0, 1e-40, 3e38])])
        expected = torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()
        np.testing.assert_array_equal(bf16_round(values).view(np.uint32),
                                      expected.view(np.uint32))


class RpcTest(ServerTestCase):
    """Every RPC of the service answers what the model is."""

    server_args = ["--max_queue_delay_us=2500", "--http_port=0"]

    def test_harness_records_http_port(self):
        self.assertGreater(self.proc.http_port, 0)
        url = f"http://127.0.0.1:{self.proc.http_port}/v2/health/live"
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
            self.assertEqual(response.status, 200)

    def test_server_live_and_ready(self):
        self.assertTrue(self.inf.ServerLive(API.inf.ServerLiveRequest(), timeout=TIMEOUT).live)
        self.assertTrue(
            self.inf.ServerReady(API.inf.ServerReadyRequest(), timeout=TIMEOUT).ready)

    def test_health_serving(self):
        check = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=API.health.HealthCheckRequest.SerializeToString,
            response_deserializer=API.health.HealthCheckResponse.FromString)
        for service in ["", "default"]:
            response = check(API.health.HealthCheckRequest(service=service), timeout=TIMEOUT)
            self.assertEqual(response.status, API.health.HealthCheckResponse.SERVING, service)

    def test_model_ready(self):
        response = self.inf.ModelReady(API.inf.ModelReadyRequest(name="default"),
                                       timeout=TIMEOUT)
        self.assertTrue(response.ready)
        self.assertTrue(self.inf.ModelReady(API.inf.ModelReadyRequest(name="default",
                                                                      version="1"),
                                            timeout=TIMEOUT).ready)
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, self.inf.ModelReady,
                            API.inf.ModelReadyRequest(name="no_such_model"))

    def test_server_metadata(self):
        response = self.inf.ServerMetadata(API.inf.ServerMetadataRequest(), timeout=TIMEOUT)
        self.assertEqual(response.name, "mha-serve")
        self.assertNotEqual(response.version, "")
        self.assertGreater(len(response.extensions), 0)
        self.assertTrue(all(response.extensions), list(response.extensions))

    def test_model_metadata(self):
        response = self.inf.ModelMetadata(API.inf.ModelMetadataRequest(name="default"),
                                          timeout=TIMEOUT)
        self.assertEqual(response.name, "default")
        inputs = {t.name: t for t in response.inputs}
        outputs = {t.name: t for t in response.outputs}
        self.assertIn("queries", inputs)
        self.assertEqual(inputs["queries"].datatype, "FP32")
        self.assertEqual(list(inputs["queries"].shape), [-1, -1, D])
        self.assertIn("output", outputs)
        self.assertEqual(outputs["output"].datatype, "FP32")
        self.assertEqual(list(outputs["output"].shape), [-1, -1, P_O])
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, self.inf.ModelMetadata,
                            API.inf.ModelMetadataRequest(name="no_such_model"))

    def test_model_config(self):
        config = self.inf.ModelConfig(API.inf.ModelConfigRequest(name="default"),
                                      timeout=TIMEOUT).config
        info = self.att.GetModel(API.a.GetModelRequest(model="default"), timeout=TIMEOUT)
        self.assertEqual(config.name, "default")
        # max_batch_size 0: the dims are the full shapes, batch dimension included
        # (Triton's clients would prepend one to every input otherwise); the request
        # limit is a parameter.
        self.assertEqual(config.max_batch_size, 0)
        self.assertEqual(int(config.parameters["max_batch_size"].string_value),
                         info.limits.max_batch_size)
        dims = {t.name: list(t.dims) for t in list(config.input) + list(config.output)}
        self.assertEqual(dims, {"queries": [-1, -1, D], "keys": [-1, -1, D],
                                "values": [-1, -1, D], "valid_lens": [-1],
                                "head_mask": [HEADS], "output": [-1, -1, P_O],
                                "attention": [-1, HEADS, -1, -1]})
        inputs = {t.name: t for t in config.input}
        self.assertEqual(inputs["queries"].data_type, API.config.TYPE_FP32)
        self.assertEqual(inputs["valid_lens"].data_type, API.config.TYPE_INT32)
        self.assertEqual([t.name for t in config.input if not t.optional], ["queries"])
        # Batching is on by default, with the server's max_queue_delay_us.
        self.assertEqual(config.WhichOneof("scheduling_choice"), "dynamic_batching")
        self.assertEqual(config.dynamic_batching.max_queue_delay_microseconds, 2500)

    def test_model_statistics(self):
        response = self.inf.ModelStatistics(API.inf.ModelStatisticsRequest(name="default"),
                                            timeout=TIMEOUT)
        self.assertEqual([s.name for s in response.model_stats], ["default"])
        everything = self.inf.ModelStatistics(API.inf.ModelStatisticsRequest(),
                                              timeout=TIMEOUT)
        self.assertIn("default", [s.name for s in everything.model_stats])

    def test_repository_index(self):
        response = self.inf.RepositoryIndex(API.inf.RepositoryIndexRequest(), timeout=TIMEOUT)
        models = {m.name: m for m in response.models}
        self.assertIn("default", models)
        self.assertEqual(models["default"].state, "READY")


class BatchingOffTest(ServerTestCase):
    """Without dynamic batching ModelConfig names no scheduler."""

    server_args = ["--batching=false"]

    def test_model_config_without_dynamic_batching(self):
        config = self.inf.ModelConfig(API.inf.ModelConfigRequest(name="default"),
                                      timeout=TIMEOUT).config
        self.assertEqual(config.name, "default")
        self.assertIsNone(config.WhichOneof("scheduling_choice"))


class ModelInferTest(ServerTestCase):
    """ModelInfer equals Attend on the same inputs, to TOLERANCE."""

    def check(self, infer_inputs, attend_kwargs, raw=True, causal=None, outputs=(),
              request_id="r"):
        response = self.infer(infer_inputs, raw=raw, causal=causal, outputs=outputs,
                              request_id=request_id)
        self.assertEqual(response.id, request_id)
        self.assertEqual(response.model_name, "default")
        got = infer_outputs(self, response)
        expected = self.attend(**attend_kwargs)
        want = from_tensor(expected.output)
        self.assertIn("output", got)
        self.assertEqual(got["output"].shape, want.shape)
        self.assertLessEqual(max_abs_diff(got["output"], want), TOLERANCE)
        # The reference is not trivially zero.
        self.assertGreater(float(np.max(np.abs(want))), 1e-3)
        return got, expected

    def test_raw_fp32_self_attention(self):
        q = uniform(10, 2, 4, D)
        got, _ = self.check([("queries", "FP32", q)], dict(queries=q))
        self.assertEqual(set(got), {"output"})  # attention only when asked
        self.assertEqual(got["output"].shape, (2, 4, P_O))

    def test_typed_fp32_contents(self):
        q = uniform(11, 3, 2, D)
        self.check([("queries", "FP32", q)], dict(queries=q), raw=False)

    def test_raw_and_typed_agree(self):
        q = uniform(12, 1, 5, D)
        raw = infer_outputs(self, self.infer([("queries", "FP32", q)], raw=True))
        typed = infer_outputs(self, self.infer([("queries", "FP32", q)], raw=False))
        np.testing.assert_array_equal(raw["output"], typed["output"])

    def test_cross_attention(self):
        q, k, v = uniform(13, 2, 3, D), uniform(14, 2, 6, D), uniform(15, 2, 6, D)
        self.check([("queries", "FP32", q), ("keys", "FP32", k), ("values", "FP32", v)],
                   dict(queries=q, keys=k, values=v))

    def test_valid_lens_int32_per_row(self):
        q, k, v = uniform(16, 3, 4, D), uniform(17, 3, 5, D), uniform(18, 3, 5, D)
        lens = np.array([5, 2, 1], dtype=np.int32)
        for raw in (True, False):
            self.check([("queries", "FP32", q), ("keys", "FP32", k), ("values", "FP32", v),
                        ("valid_lens", "INT32", lens)],
                       dict(queries=q, keys=k, values=v, valid_lens=lens), raw=raw)
        # The mask takes effect: all keys valid gives another answer.
        masked = infer_outputs(self, self.infer(
            [("queries", "FP32", q), ("keys", "FP32", k), ("values", "FP32", v),
             ("valid_lens", "INT32", lens)]))["output"]
        full = infer_outputs(self, self.infer(
            [("queries", "FP32", q), ("keys", "FP32", k), ("values", "FP32", v)]))["output"]
        self.assertGreater(max_abs_diff(masked[1], full[1]), 1e-3)

    def test_valid_lens_int64_per_query(self):
        q = uniform(19, 2, 4, D)
        lens = np.array([[1, 2, 3, 4], [4, 1, 0, 2]], dtype=np.int64)
        for raw in (True, False):
            self.check([("queries", "FP32", q), ("valid_lens", "INT64", lens)],
                       dict(queries=q, valid_lens=lens), raw=raw)

    def test_causal(self):
        q = uniform(20, 2, 5, D)
        got, _ = self.check([("queries", "FP32", q)], dict(queries=q, causal=True),
                            causal=True)
        plain = infer_outputs(self, self.infer([("queries", "FP32", q)], causal=False))
        # The mask takes effect: causally the first query sees only the first key.
        self.assertGreater(max_abs_diff(got["output"][:, 0], plain["output"][:, 0]), 1e-3)

    def test_head_mask(self):
        q = uniform(21, 2, 3, D)
        mask = np.array([1.0, 0.0, 0.5, 2.0, -1.0], dtype=np.float32)
        self.check([("queries", "FP32", q), ("head_mask", "FP32", mask)],
                   dict(queries=q, head_mask=mask))
        self.check([("queries", "FP32", q), ("head_mask", "FP32", mask)],
                   dict(queries=q, head_mask=mask), raw=False)

    def test_attention_weights(self):
        q, k, v = uniform(22, 2, 3, D), uniform(23, 2, 4, D), uniform(24, 2, 4, D)
        lens = np.array([4, 2], dtype=np.int32)
        inputs = [("queries", "FP32", q), ("keys", "FP32", k), ("values", "FP32", v),
                  ("valid_lens", "INT32", lens)]
        kwargs = dict(queries=q, keys=k, values=v, valid_lens=lens, return_attention=True)
        for outputs in (["output", "attention"], ["attention"]):
            got, expected = self.check(inputs, kwargs, outputs=outputs)
            want = from_tensor(expected.attention)
            self.assertEqual(got["attention"].shape, (2, HEADS, 3, 4))
            self.assertLessEqual(max_abs_diff(got["attention"], want), TOLERANCE)
            # Masked keys weigh exactly 0 and each query's weights sum to 1.
            np.testing.assert_array_equal(got["attention"][1, :, :, 2:], 0.0)
            np.testing.assert_allclose(got["attention"].sum(axis=-1), 1.0, atol=1e-5)

    def test_bf16_inputs(self):
        q, k, v = uniform(25, 2, 3, D), uniform(26, 2, 4, D), uniform(27, 2, 4, D)
        mask = np.array([1.0, 0.3, 0.5, 2.0, -1.7], dtype=np.float32)
        self.assertGreater(max_abs_diff(bf16_round(q), q), 0.0)  # rounding happens
        self.check([("queries", "BF16", q)], dict(queries=bf16_round(q)))
        self.check([("queries", "BF16", q), ("keys", "BF16", k), ("values", "BF16", v),
                    ("head_mask", "BF16", mask)],
                   dict(queries=bf16_round(q), keys=bf16_round(k), values=bf16_round(v),
                        head_mask=bf16_round(mask)))

    def test_fp16_inputs(self):
        q, k, v = uniform(28, 2, 3, D), uniform(29, 2, 4, D), uniform(30, 2, 4, D)
        mask = np.array([1.0, 0.3, 0.5, 2.0, -1.7], dtype=np.float32)
        self.assertGreater(max_abs_diff(fp16_round(q), q), 0.0)
        self.check([("queries", "FP16", q)], dict(queries=fp16_round(q)))
        self.check([("queries", "FP16", q), ("keys", "FP16", k), ("values", "FP16", v),
                    ("head_mask", "FP16", mask)],
                   dict(queries=fp16_round(q), keys=fp16_round(k), values=fp16_round(v),
                        head_mask=fp16_round(mask)))

    def test_mixed_datatypes(self):
        q, k, v = uniform(31, 1, 3, D), uniform(32, 1, 4, D), uniform(33, 1, 4, D)
        self.check([("queries", "FP32", q), ("keys", "BF16", k), ("values", "FP16", v)],
                   dict(queries=q, keys=bf16_round(k), values=fp16_round(v)))

    def test_id_echoed(self):
        q = uniform(34, 1, 2, D)
        for request_id in ["", "a", "request-\u00e9-42" * 10]:
            response = self.infer([("queries", "FP32", q)], request_id=request_id)
            self.assertEqual(response.id, request_id)

    def test_errors_name_the_input(self):
        q = uniform(35, 2, 3, D)
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        call = self.inf.ModelInfer
        # Wrong feature size.
        self.assertRpcError(invalid, call, infer_request([("queries", "FP32", q[:, :, :99])]),
                            names="queries")
        # No queries.
        self.assertRpcError(invalid, call, infer_request(
            [("keys", "FP32", q), ("values", "FP32", q)]), names="queries")
        # Raw bytes that do not match the shape.
        request = infer_request([("queries", "FP32", q)])
        request.raw_input_contents[0] = request.raw_input_contents[0][:-4]
        self.assertRpcError(invalid, call, request, names="queries")
        # Raw and typed contents mixed: across inputs, and within one.
        request = infer_request([("queries", "FP32", q)], raw=False)
        request.inputs.add(name="head_mask", datatype="FP32", shape=[HEADS])
        request.raw_input_contents.append(raw_bytes("FP32", np.ones(HEADS)))
        self.assertRpcError(invalid, call, request)
        request = infer_request([("queries", "FP32", q)], raw=False)
        request.raw_input_contents.append(raw_bytes("FP32", q))
        self.assertRpcError(invalid, call, request, names="queries")
        # BF16 only as raw bytes.
        request = infer_request([("queries", "FP32", q)], raw=False)
        request.inputs[0].datatype = "BF16"
        self.assertRpcError(invalid, call, request, names="queries")
        # valid_lens out of range, and of the wrong count.
        self.assertRpcError(invalid, call, infer_request(
            [("queries", "FP32", q), ("valid_lens", "INT32", np.array([1, 4]))]),
            names="valid_lens")
        self.assertRpcError(invalid, call, infer_request(
            [("queries", "FP32", q), ("valid_lens", "INT32", np.array([1, 2, 3]))]),
            names="valid_lens")
        # head_mask of the wrong length.
        self.assertRpcError(invalid, call, infer_request(
            [("queries", "FP32", q), ("head_mask", "FP32", np.ones(4))]), names="head_mask")
        # A non-finite query value.
        bad = q.copy()
        bad[1, 2, 3] = np.nan
        self.assertRpcError(invalid, call, infer_request([("queries", "FP32", bad)]),
                            names="queries")
        # Unknown model.
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, call,
                            infer_request([("queries", "FP32", q)], model="no_such_model"))


class ModelStreamInferTest(ServerTestCase):
    """1,000 requests on one stream, one of them bad."""

    COUNT = 1000
    BAD = 500

    def test_stream_in_order_and_survives_a_bad_request(self):
        inputs = []
        requests = []
        for i in range(self.COUNT):
            q = uniform(1000 + i, 1, 2, D)
            if i == self.BAD:
                q = uniform(1000 + i, 1, 2, D - 1)  # wrong last dimension
            inputs.append(q)
            requests.append(infer_request([("queries", "FP32", q)], request_id=f"s{i}"))
        responses = list(self.inf.ModelStreamInfer(iter(requests), timeout=120.0))
        self.assertEqual(len(responses), self.COUNT)
        for i, response in enumerate(responses):
            if i == self.BAD:
                self.assertNotEqual(response.error_message, "")
                self.assertIn("queries", response.error_message)
                self.assertIn(response.infer_response.id, ("", f"s{i}"))
                continue
            self.assertEqual(response.error_message, "", f"request {i}")
            self.assertEqual(response.infer_response.id, f"s{i}")
        samples = sorted(set(range(0, self.COUNT, 97)) | {self.BAD - 1, self.BAD + 1,
                                                          self.COUNT - 1})
        for i in samples:
            got = infer_outputs(self, responses[i].infer_response)["output"]
            want = from_tensor(self.attend(queries=inputs[i]).output)
            self.assertLessEqual(max_abs_diff(got, want), TOLERANCE, f"request {i}")


class StatisticsTest(ServerTestCase):
    """ModelStatistics agrees with /metrics and with the requests sent, on a
    server of its own (so every count is known)."""

    def test_statistics_match_metrics(self):
        start_ms = int(time.time() * 1000)
        ok_rows = 0
        sent = {"attention_v1": [0, 0], "kserve_grpc": [0, 0]}  # [ok, failed]
        # attention.v1: three good, two bad.
        for seed, batch in [(40, 2), (41, 1), (42, 3)]:
            self.attend(queries=uniform(seed, batch, 3, D))
            ok_rows += batch
            sent["attention_v1"][0] += 1
        for request in [attend_request(queries=uniform(43, 1, 3, D - 1)),
                        attend_request(queries=uniform(44, 2, 3, D), valid_lens=[9, 9])]:
            self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.att.Attend, request)
            sent["attention_v1"][1] += 1
        # An unknown model is counted apart from "default".
        request = attend_request(queries=uniform(45, 1, 3, D))
        request.model = "no_such_model"
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, self.att.Attend, request)
        # ModelInfer: four good, two bad.
        for seed, batch in [(46, 1), (47, 2), (48, 1), (49, 2)]:
            self.infer([("queries", "FP32", uniform(seed, batch, 4, D))])
            ok_rows += batch
            sent["kserve_grpc"][0] += 1
        for request in [infer_request([("queries", "FP32", uniform(50, 1, 4, D - 1))]),
                        infer_request([("keys", "FP32", uniform(51, 1, 4, D))])]:
            self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.inf.ModelInfer,
                                request)
            sent["kserve_grpc"][1] += 1
        # ModelStreamInfer: two good, one bad.
        stream = [infer_request([("queries", "FP32", uniform(52, 2, 2, D))]),
                  infer_request([("queries", "FP32", uniform(53, 2, 2, D + 1))]),
                  infer_request([("queries", "FP32", uniform(54, 1, 2, D))])]
        responses = list(self.inf.ModelStreamInfer(iter(stream), timeout=TIMEOUT))
        self.assertEqual([r.error_message != "" for r in responses], [False, True, False])
        ok_rows += 3
        sent["kserve_grpc"][0] += 2
        sent["kserve_grpc"][1] += 1
        total = sum(ok + failed for ok, failed in sent.values())

        # Counters may be bumped just after a response leaves: wait until both
        # views count every request, then take a stable pair of snapshots.
        deadline = time.monotonic() + 10.0
        while True:
            before = self.statistics()
            samples = scrape(self.proc.metrics_port)
            after = self.statistics()
            counted = metric_sum(samples, "mha_requests_total", model="default")
            stats_total = after.inference_stats.success.count + after.inference_stats.fail.count
            if before == after and counted == total and stats_total == total:
                break
            if time.monotonic() > deadline:
                self.fail(f"counts did not settle: metrics {counted}, statistics "
                          f"{stats_total}, sent {total}")
            time.sleep(0.1)
        stats = after
        infer = stats.inference_stats

        # success/fail equal mha_requests_total by code, over every protocol.
        ok = metric_sum(samples, "mha_requests_total", model="default", code="OK")
        self.assertEqual(infer.success.count, ok)
        self.assertEqual(infer.fail.count, counted - ok)
        # ... and what was sent, protocol by protocol.
        for protocol, (want_ok, want_failed) in sent.items():
            got_ok = metric_sum(samples, "mha_requests_total", model="default", code="OK",
                                protocol=protocol)
            got_all = metric_sum(samples, "mha_requests_total", model="default",
                                 protocol=protocol)
            self.assertEqual((got_ok, got_all - got_ok), (want_ok, want_failed), protocol)
        self.assertEqual(infer.success.count, sum(ok for ok, _ in sent.values()))
        self.assertEqual(infer.fail.count, sum(failed for _, failed in sent.values()))
        self.assertEqual(metric_sum(samples, "mha_requests_total", model="_unknown"), 1)

        # Forward calls and their time, as mha_compute_duration_seconds: execution_count
        # and the batch statistics. The histogram sums seconds as a double and /metrics
        # prints it in decimal, the statistics add whole nanoseconds: allow 1000 ns
        # per executed batch.
        calls = metric_sum(samples, "mha_compute_duration_seconds_count", model="default")
        seconds = metric_sum(samples, "mha_compute_duration_seconds_sum", model="default")
        self.assertGreater(calls, 0)
        self.assertEqual(stats.execution_count, calls)
        # compute_*: per computed request as Triton counts them (each request with
        # its forward call's time), the queue's count; every computed request here
        # succeeded.
        computed = infer.success.count
        for name in ["queue", "compute_input", "compute_infer", "compute_output"]:
            self.assertEqual(getattr(infer, name).count, computed, name)
        self.assertEqual(infer.compute_input.ns, 0)
        self.assertEqual(infer.compute_output.ns, 0)
        self.assertGreaterEqual(infer.compute_infer.ns, seconds * 1e9 - 1000 * calls)
        self.assertGreater(infer.compute_infer.ns, 0)

        # Rows: every computed request succeeded, so batch rows = OK rows sent.
        self.assertEqual(stats.inference_count, ok_rows)
        self.assertEqual(metric_sum(samples, "mha_batch_size_sum", model="default"), ok_rows)
        self.assertEqual(sum(b.batch_size * b.compute_infer.count for b in stats.batch_stats),
                         ok_rows)
        self.assertEqual(sum(b.compute_infer.count for b in stats.batch_stats), calls)
        self.assertLessEqual(abs(sum(b.compute_infer.ns for b in stats.batch_stats)
                                 - seconds * 1e9), 1000 * calls)

        self.assertGreaterEqual(stats.last_inference, start_ms)
        self.assertLessEqual(stats.last_inference, int(time.time() * 1000))

    def statistics(self):
        response = self.inf.ModelStatistics(API.inf.ModelStatisticsRequest(name="default"),
                                            timeout=TIMEOUT)
        self.assertEqual(len(response.model_stats), 1)
        self.assertEqual(response.model_stats[0].name, "default")
        return response.model_stats[0]


class AttentionOnlyTest(ServerTestCase):
    """The attention-only worker (issue 35): the `lse` output over gRPC and HTTP (HTTP
    always binary) equals attention.v1's AttendResponse.lse; FULL models refuse it."""

    H, G, DH = 8, 2, 16

    @classmethod
    def setUpClass(cls):
        cls.repository = tempfile.mkdtemp(prefix="worker_models_")
        os.makedirs(os.path.join(cls.repository, "worker"))
        with open(os.path.join(cls.repository, "worker", "config.pbtxt"), "w") as f:
            f.write(f"num_hiddens: {cls.H * cls.DH} num_heads: {cls.H} "
                    f"num_kv_heads: {cls.G} projections: NONE")
        os.makedirs(os.path.join(cls.repository, "full"))
        with open(os.path.join(cls.repository, "full", "config.pbtxt"), "w") as f:
            f.write("num_hiddens: 100 num_heads: 5 seeded { seed: 0 }")
        cls.server_args = [f"--model_repository={cls.repository}", "--http_port=0",
                           "--default_warmup=false"]
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        try:
            super().tearDownClass()
        finally:
            shutil.rmtree(cls.repository, ignore_errors=True)

    def inputs(self):
        e, ekv = self.H * self.DH, self.G * self.DH
        q, k, v = uniform(31, 1, 3, e), uniform(32, 1, 9, ekv), uniform(33, 1, 9, ekv)
        lens = np.array([[4, 0, 9]], np.int32)  # query 1 sees no key: lse -inf
        return q, k, v, lens

    def want(self):
        q, k, v, lens = self.inputs()
        request = API.a.AttendRequest(model="worker", return_lse=True)
        for field, array in (("queries", q), ("keys", k), ("values", v)):
            getattr(request, field).shape.extend(array.shape)
            getattr(request, field).data.extend(array.ravel().tolist())
        request.valid_lens.extend(lens.ravel().tolist())
        response = self.att.Attend(request, timeout=TIMEOUT)
        return from_tensor(response.output), from_tensor(response.lse)

    def test_grpc_lse_output_equals_attend(self):
        q, k, v, lens = self.inputs()
        want_out, want_lse = self.want()
        self.assertEqual(want_lse.shape, (1, self.H, 3))
        self.assertTrue(np.all(want_lse[0, :, 1] == -np.inf))
        response = self.infer([("queries", "FP32", q), ("keys", "FP32", k), ("values", "FP32", v),
                               ("valid_lens", "INT32", lens)], model="worker",
                              outputs=("lse", "output"))
        self.assertEqual([t.name for t in response.outputs], ["lse", "output"])
        got = infer_outputs(self, response)
        np.testing.assert_array_equal(got["lse"], want_lse)
        self.assertLessEqual(max_abs_diff(got["output"], want_out), TOLERANCE)

    def test_http_lse_output_is_always_binary(self):
        q, k, v, lens = self.inputs()
        want_out, want_lse = self.want()
        body = json.dumps({
            "inputs": [
                {"name": "queries", "datatype": "FP32", "shape": list(q.shape),
                 "data": q.ravel().tolist()},
                {"name": "keys", "datatype": "FP32", "shape": list(k.shape),
                 "data": k.ravel().tolist()},
                {"name": "values", "datatype": "FP32", "shape": list(v.shape),
                 "data": v.ravel().tolist()},
                {"name": "valid_lens", "datatype": "INT32", "shape": list(lens.shape),
                 "data": lens.ravel().tolist()}],
            "outputs": [{"name": "output"}, {"name": "lse"}]}).encode()
        url = f"http://127.0.0.1:{self.proc.http_port}/v2/models/worker/infer"
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            header_length = int(response.headers["Inference-Header-Content-Length"])
            data = response.read()
        header = json.loads(data[:header_length])
        outputs = {o["name"]: o for o in header["outputs"]}
        self.assertIn("data", outputs["output"])  # JSON, as the request asked nothing else
        self.assertEqual(outputs["lse"]["parameters"]["binary_data_size"], 4 * self.H * 3)
        lse = np.frombuffer(data[header_length:], "<f4").reshape(outputs["lse"]["shape"])
        np.testing.assert_array_equal(lse, want_lse)
        out = np.array(outputs["output"]["data"], np.float32).reshape(want_out.shape)
        self.assertLessEqual(max_abs_diff(out, want_out), TOLERANCE)
        # Asking for lse as JSON is refused naming the parameter.
        refused = json.loads(body)
        refused["outputs"][1]["parameters"] = {"binary_data": False}
        request = urllib.request.Request(url, data=json.dumps(refused).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with self.assertRaises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=TIMEOUT)
        self.assertEqual(caught.exception.code, 400)
        self.assertIn("binary_data", json.loads(caught.exception.read())["error"])

    def test_lse_on_a_full_model_is_refused_naming_it(self):
        response_error = self.assertRpcError(
            grpc.StatusCode.INVALID_ARGUMENT, self.inf.ModelInfer,
            infer_request([("queries", "FP32", uniform(1, 1, 2, D))], model="full",
                          outputs=("lse",)),
            names="return_lse")
        self.assertIn('"lse"', response_error.details())

    def test_model_config_lists_lse_for_the_worker_only(self):
        for model, listed in (("worker", True), ("full", False)):
            metadata = self.inf.ModelMetadata(API.inf.ModelMetadataRequest(name=model),
                                              timeout=TIMEOUT)
            self.assertEqual("lse" in [t.name for t in metadata.outputs], listed, model)


def main():
    global BINARY, SOURCE, API
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    BINARY, SOURCE = sys.argv[1], sys.argv[2]
    out_dir = tempfile.mkdtemp(prefix="kserve_stubs_")
    try:
        API = load_api(SOURCE, out_dir)
        program = unittest.main(argv=[sys.argv[0], *sys.argv[3:]], exit=False, verbosity=2)
        return 0 if program.result.wasSuccessful() else 1
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
