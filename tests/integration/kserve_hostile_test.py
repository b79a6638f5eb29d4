#!/usr/bin/python3
"""Hostile input against the Open Inference Protocol fronts of a real
attention_server, gRPC (inference.GRPCInferenceService) and HTTP (KServe v2 REST):
each bad request gets its canonical code (HTTP: its status) naming the field, and
the server goes on answering a good request after every one of them.

    kserve_hostile_test.py SERVER_BINARY SOURCE_DIR [unittest arguments]
"""

import json
import struct
import sys
import tempfile
import unittest
import urllib.error
import urllib.request

import grpc

from kserve_grpc_test import load_api
from server_harness import start_server, stop_server

TIMEOUT = 30.0
D = 100  # d_q of the built-in model "default"


def queries_bytes(b=1, q=2, d=D):
    return struct.pack(f"<{b * q * d}f", *([0.25] * (b * q * d)))


class KserveHostileTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.proc, cls.target = start_server(BINARY, ["--http_port=0",
                                                     "--max_request_bytes=1000000"])
        cls.http = f"http://127.0.0.1:{cls.proc.http_port}"
        cls.channel = grpc.insecure_channel(cls.target)
        cls.stub = API.inf_grpc.GRPCInferenceServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        if stop_server(cls.proc) != 0:
            raise AssertionError("the server did not drain cleanly")

    def tearDown(self):
        # After every hostile request, a good one on each front still succeeds.
        response = self.stub.ModelInfer(self.request(), timeout=TIMEOUT)
        self.assertEqual(list(response.outputs[0].shape), [1, 2, D])
        status, _ = self.post("/v2/models/default/infer", json.dumps({"inputs": [
            {"name": "queries", "datatype": "FP32", "shape": [1, 1, D], "data": [0.5] * D}]}))
        self.assertEqual(status, 200)

    # --- helpers -------------------------------------------------------------

    def request(self, inputs=None, raw=None):
        request = API.inf.ModelInferRequest(model_name="default")
        for name, datatype, shape in inputs or [("queries", "FP32", [1, 2, D])]:
            request.inputs.add(name=name, datatype=datatype, shape=shape)
        for data in [queries_bytes()] if raw is None else raw:
            request.raw_input_contents.append(data)
        return request

    def assertGrpc(self, request, code, *fragments):
        with self.assertRaises(grpc.RpcError) as caught:
            self.stub.ModelInfer(request, timeout=TIMEOUT)
        self.assertEqual(caught.exception.code(), code, caught.exception.details())
        for fragment in fragments:
            self.assertIn(fragment, caught.exception.details())

    def post(self, path, body, headers=None):
        data = body.encode() if isinstance(body, str) else body
        headers = {"Content-Type": "application/json", **(headers or {})}
        request = urllib.request.Request(self.http + path, data=data, method="POST",
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def assertHttp(self, body, status, fragment, headers=None):
        got, answer = self.post("/v2/models/default/infer", body, headers)
        self.assertEqual(got, status, answer[:300])
        message = json.loads(answer)["error"]
        self.assertIn(fragment, message)

    # --- gRPC ----------------------------------------------------------------

    def test_wrong_datatype(self):
        self.assertGrpc(self.request([("queries", "INT8", [1, 2, D])], [b"\0" * 2 * D]),
                        grpc.StatusCode.INVALID_ARGUMENT, 'inputs[0] ("queries")', "INT8")

    def test_shape_and_bytes_disagree(self):
        self.assertGrpc(self.request(raw=[queries_bytes()[:-4]]),
                        grpc.StatusCode.INVALID_ARGUMENT, "needs 800 bytes",
                        "raw_input_contents[0] has 796")

    def test_raw_and_typed_both_set(self):
        request = self.request()
        request.inputs[0].contents.fp32_contents.extend([0.0] * 2 * D)
        self.assertGrpc(request, grpc.StatusCode.INVALID_ARGUMENT, "use one or the other")

    def test_duplicate_input(self):
        self.assertGrpc(self.request([("queries", "FP32", [1, 2, D])] * 2, [queries_bytes()] * 2),
                        grpc.StatusCode.INVALID_ARGUMENT, 'inputs[1] ("queries")', "twice")

    def test_unknown_input_name(self):
        self.assertGrpc(
            self.request([("queries", "FP32", [1, 2, D]), ("query_mask", "FP32", [1])],
                         [queries_bytes(), b"\0" * 4]),
            grpc.StatusCode.INVALID_ARGUMENT, 'inputs[1] ("query_mask"): unknown input')

    def test_raw_count_differs_from_inputs(self):
        self.assertGrpc(self.request(raw=[queries_bytes()] * 2),
                        grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents: 2 entries for 1")

    def test_overflowing_shape(self):
        self.assertGrpc(self.request([("queries", "FP32", [1 << 40, 1 << 40, D])]),
                        grpc.StatusCode.INVALID_ARGUMENT, 'inputs[0] ("queries")', "too large")

    def test_nan_in_bf16(self):
        bf16 = struct.pack(f"<{2 * D}H", *([0x7fc0] + [0x3f80] * (2 * D - 1)))
        self.assertGrpc(self.request([("queries", "BF16", [1, 2, D])], [bf16]),
                        grpc.StatusCode.INVALID_ARGUMENT, "queries: non-finite value")

    def test_unknown_output_and_bad_parameter(self):
        request = self.request()
        request.outputs.add(name="logits")
        self.assertGrpc(request, grpc.StatusCode.INVALID_ARGUMENT, 'outputs[0] ("logits")')
        request = self.request()
        request.parameters["causal"].string_param = "yes"
        self.assertGrpc(request, grpc.StatusCode.INVALID_ARGUMENT, "parameters.causal")

    def test_request_over_byte_limit(self):
        # 3000 x 100 floats = 1.2 MB > --max_request_bytes: the transport refuses it.
        big = 3000
        self.assertGrpc(self.request([("queries", "FP32", [1, big, D])],
                                     [queries_bytes(1, big)]),
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")

    # --- HTTP ----------------------------------------------------------------

    def test_http_wrong_datatype(self):
        self.assertHttp(json.dumps({"inputs": [
            {"name": "queries", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}),
            400, 'inputs[0] ("queries")')

    def test_http_shape_and_data_disagree(self):
        self.assertHttp(json.dumps({"inputs": [
            {"name": "queries", "datatype": "FP32", "shape": [1, 2, D], "data": [1.0] * 3}]}),
            400, "needs 200 values")

    def test_http_duplicate_and_unknown_inputs(self):
        one = {"name": "queries", "datatype": "FP32", "shape": [1, 1, D], "data": [0.5] * D}
        self.assertHttp(json.dumps({"inputs": [one, one]}), 400, "twice")
        other = dict(one, name="mask")
        self.assertHttp(json.dumps({"inputs": [one, other]}), 400, 'inputs[1] ("mask")')

    def test_http_deep_nesting(self):
        self.assertHttp('{"inputs": ' + "[" * 100000 + "]" * 100000 + "}", 400,
                        "nesting deeper than 32")

    def test_http_huge_json_is_refused(self):
        body = json.dumps({"inputs": [{"name": "queries", "datatype": "FP32",
                                       "shape": [1, 10000, D], "data": [0.5] * 10000 * D}]})
        self.assertGreater(len(body), 1000000)
        status, _ = self.post("/v2/models/default/infer", body)
        self.assertEqual(status, 413)

    def test_http_binary_header_length_out_of_range(self):
        self.assertHttp(b'{"inputs": []}', 400, "Inference-Header-Content-Length",
                        headers={"Inference-Header-Content-Length": "99999"})
        self.assertHttp(b'{"inputs": []}', 400, "Inference-Header-Content-Length",
                        headers={"Inference-Header-Content-Length": "-1"})

    def test_http_binary_size_mismatch(self):
        header = json.dumps({"inputs": [{"name": "queries", "datatype": "FP32",
                                         "shape": [1, 2, D],
                                         "parameters": {"binary_data_size": 800}}]}).encode()
        self.assertHttp(header + queries_bytes()[:400], 400, 'inputs[0] ("queries")',
                        headers={"Inference-Header-Content-Length": str(len(header))})

    def test_http_unknown_model_and_bad_json(self):
        status, answer = self.post("/v2/models/nope/infer", '{"inputs": []}')
        self.assertEqual(status, 404)
        self.assertIn("nope", json.loads(answer)["error"])
        self.assertHttp('{"inputs": [', 400, "")


if __name__ == "__main__":
    BINARY, SOURCE = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as stubs:
        API = load_api(SOURCE, stubs)
        sys.modules["kserve_grpc_test"].API = API
        unittest.main(argv=[sys.argv[0], *sys.argv[3:]])
