#!/usr/bin/python3
"""Triton's system shared memory extension against the real attention_server
(--shared_memory=system), written against the wire protocol (the generated
inference.GRPCInferenceService stubs, and the HTTP JSON body), not against our
client library: the registry RPCs with Triton's codes, inputs and outputs by region
equal to the same request sent inline, every refusal with its code and the region
or field named (the server still serving after each), unregister while requests
are in flight, and a client that truncates its region while requests read it.

    kserve_shared_memory_test.py SERVER_BINARY SOURCE_DIR [unittest arguments]

Regions are made as tritonclient.utils.shared_memory makes them: a POSIX
shared-memory file of this uid, mode 0600 (Python's multiprocessing.shared_memory),
registered by key.
"""

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import unittest
import urllib.error
import urllib.request
from multiprocessing import shared_memory

import grpc
import numpy as np
from grpc_tools import protoc

from server_harness import start_server, stop_server

TOLERANCE = 1e-6
D = 100      # the built-in model "default": d_q = d_k = d_v = 100
P_O = 100    # output features
HEADS = 5
TIMEOUT = 60.0
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1)]

BINARY = None
SOURCE = None
API = None


def load_api(source, out_dir):
    proto_dir = os.path.join(source, "proto")
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    files = ["inference/grpc_service.proto", "inference/model_config.proto"]
    code = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}",
                        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *files])
    if code != 0:
        raise RuntimeError(f"protoc failed on {proto_dir} (exit {code})")
    sys.path.insert(0, out_dir)
    from inference import grpc_service_pb2  # noqa: E402  (generated above)
    from inference import grpc_service_pb2_grpc  # noqa: E402
    return types.SimpleNamespace(inf=grpc_service_pb2, inf_grpc=grpc_service_pb2_grpc)


def uniform(seed, *shape):
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape).astype(np.float32)


def max_abs_diff(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} != {b.shape}")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


class Region:
    """A POSIX shared-memory region as tritonclient's create_shared_memory_region
    makes it: create, set (write the bytes at an offset), read, destroy."""

    def __init__(self, size):
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.key = "/" + self.shm.name
        self.size = size

    def set(self, offset, array):
        data = np.ascontiguousarray(array).tobytes()
        self.shm.buf[offset:offset + len(data)] = data
        return len(data)

    def get(self, offset, dtype, shape):
        count = int(np.prod(shape))
        return np.frombuffer(self.shm.buf, dtype=dtype, count=count,
                             offset=offset).reshape(shape).copy()

    def destroy(self):
        self.shm.close()
        self.shm.unlink()


def shm_params(parameters, region, byte_size, offset=None):
    parameters["shared_memory_region"].string_param = region
    parameters["shared_memory_byte_size"].int64_param = byte_size
    if offset is not None:
        parameters["shared_memory_offset"].int64_param = offset


def build_request(inputs, outputs=(), model="default", request_id=""):
    """inputs: (name, datatype, array or None, shm) with shm None (inline, raw) or
    (region, byte_size, offset); outputs: (name, shm or None)."""
    request = API.inf.ModelInferRequest(model_name=model, id=request_id)
    for name, datatype, array, shm in inputs:
        array = np.asarray(array)
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if shm is None:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
        else:
            shm_params(tensor.parameters, *shm)
    for name, shm in outputs:
        output = request.outputs.add(name=name)
        if shm is not None:
            shm_params(output.parameters, *shm)
    return request


def outputs_of(response):
    return {tensor.name: (tensor, raw)
            for tensor, raw in zip(response.outputs, response.raw_output_contents)}


class Case(unittest.TestCase):
    server_args = ["--shared_memory=system"]

    @classmethod
    def setUpClass(cls):
        cls.proc, cls.target = start_server(BINARY, cls.server_args)
        cls.channel = grpc.insecure_channel(cls.target, options=CHANNEL_OPTIONS)
        cls.inf = API.inf_grpc.GRPCInferenceServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        code = stop_server(cls.proc)
        if code != 0:
            raise AssertionError(f"server exit code {code}")

    def setUp(self):
        self.regions = []

    def tearDown(self):
        try:
            self.unregister("")
        except grpc.RpcError:
            pass
        for region in self.regions:
            region.destroy()

    def region(self, size):
        region = Region(size)
        self.regions.append(region)
        return region

    def register(self, name, key, byte_size, offset=0, metadata=None):
        return self.inf.SystemSharedMemoryRegister(
            API.inf.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset,
                                                      byte_size=byte_size),
            timeout=TIMEOUT, metadata=metadata)

    def unregister(self, name):
        return self.inf.SystemSharedMemoryUnregister(
            API.inf.SystemSharedMemoryUnregisterRequest(name=name), timeout=TIMEOUT)

    def status(self, name=""):
        return self.inf.SystemSharedMemoryStatus(
            API.inf.SystemSharedMemoryStatusRequest(name=name), timeout=TIMEOUT)

    def infer(self, request):
        return self.inf.ModelInfer(request, timeout=TIMEOUT)

    def assertRpcError(self, code, call, *args, names=(), **kwargs):
        with self.assertRaises(grpc.RpcError) as caught:
            call(*args, **kwargs)
        self.assertEqual(caught.exception.code(), code, caught.exception.details())
        for name in names:
            self.assertIn(name, caught.exception.details())
        return caught.exception

    def assertServing(self):
        """The server still answers, and computes."""
        self.assertTrue(self.inf.ServerLive(API.inf.ServerLiveRequest(), timeout=TIMEOUT).live)
        q = uniform(99, 1, 2, D)
        response = self.infer(build_request([("queries", "FP32", q, None)]))
        self.assertEqual(len(response.raw_output_contents[0]), 2 * P_O * 4)

    def inline(self, inputs, outputs=("output",)):
        """name -> array of the same request sent inline."""
        request = build_request([(n, t, a, None) for n, t, a in inputs],
                                [(name, None) for name in outputs])
        return {name: np.frombuffer(raw, dtype="<f4").reshape(tuple(tensor.shape))
                for name, (tensor, raw) in outputs_of(self.infer(request)).items()}


class RegistryTest(Case):
    def test_metadata_lists_the_extension(self):
        metadata = self.inf.ServerMetadata(API.inf.ServerMetadataRequest(), timeout=TIMEOUT)
        self.assertIn("system_shared_memory", metadata.extensions)

    def test_status_register_unregister_round_trip(self):
        region = self.region(4096)
        self.assertEqual(len(self.status().regions), 0)
        self.register("r1", region.key, 4096)
        self.register("r0", region.key, 1024, offset=2048)
        regions = self.status().regions
        self.assertEqual(sorted(regions), ["r0", "r1"])
        self.assertEqual((regions["r0"].name, regions["r0"].key, regions["r0"].offset,
                          regions["r0"].byte_size), ("r0", region.key, 2048, 1024))
        one = self.status("r1").regions
        self.assertEqual(list(one), ["r1"])
        self.assertEqual(one["r1"].byte_size, 4096)
        # Triton's codes: a name twice ALREADY_EXISTS, status of an unknown NOT_FOUND,
        # unregistering an unknown name succeeds.
        self.assertRpcError(grpc.StatusCode.ALREADY_EXISTS, self.register, "r1", region.key, 16,
                            names=['"r1"'])
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, self.status, "nope", names=['"nope"'])
        self.unregister("nope")
        self.unregister("r1")
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, self.status, "r1")
        self.assertEqual(list(self.status().regions), ["r0"])
        self.unregister("")
        self.assertEqual(len(self.status().regions), 0)

    def test_register_refusals(self):
        region = self.region(4096)
        cases = [
            (dict(name="k", key="no_slash", byte_size=16), grpc.StatusCode.INVALID_ARGUMENT,
             ["key", "no_slash"]),
            (dict(name="k", key="/a/b", byte_size=16), grpc.StatusCode.INVALID_ARGUMENT,
             ["key", "/a/b"]),
            (dict(name="k", key="/..", byte_size=16), grpc.StatusCode.INVALID_ARGUMENT, ["key"]),
            (dict(name="k", key="/" + "x" * 300, byte_size=16),
             grpc.StatusCode.INVALID_ARGUMENT, ["key"]),
            (dict(name="k", key="/mha_no_such_region_key", byte_size=16),
             grpc.StatusCode.INVALID_ARGUMENT, ['"k"', "cannot open"]),
            (dict(name="", key=region.key, byte_size=16), grpc.StatusCode.INVALID_ARGUMENT,
             ["name"]),
            (dict(name="k", key=region.key, byte_size=0), grpc.StatusCode.INVALID_ARGUMENT,
             ["byte_size"]),
            (dict(name="k", key=region.key, byte_size=4096, offset=1),
             grpc.StatusCode.INVALID_ARGUMENT, ['"k"', "offset 1", "4096 bytes"]),
            (dict(name="k", key=region.key, byte_size=4096, offset=2**64 - 100),
             grpc.StatusCode.INVALID_ARGUMENT, ['"k"', "beyond"]),
        ]
        for kwargs, code, names in cases:
            with self.subTest(**{k: str(v)[:40] for k, v in kwargs.items()}):
                self.assertRpcError(code, self.register, kwargs["name"], kwargs["key"],
                                    kwargs["byte_size"], offset=kwargs.get("offset", 0),
                                    names=names)
        self.assertEqual(len(self.status().regions), 0)
        self.assertServing()

    @unittest.skipUnless(os.geteuid() == 0, "needs root to give a file away")
    def test_register_refuses_another_users_file(self):
        region = self.region(4096)
        os.chown(f"/dev/shm/{region.shm.name}", 65534, 65534)
        self.assertRpcError(grpc.StatusCode.PERMISSION_DENIED, self.register, "theirs",
                            region.key, 16, names=['"theirs"', region.key, "uid 65534"])
        self.assertServing()

    def test_cuda_shared_memory_unimplemented(self):
        call = self.channel.unary_unary(
            "/inference.GRPCInferenceService/CudaSharedMemoryRegister",
            request_serializer=lambda b: b, response_deserializer=lambda b: b)
        self.assertRpcError(grpc.StatusCode.UNIMPLEMENTED, call, b"", timeout=TIMEOUT,
                            names=["CUDA shared-memory"])


class InferTest(Case):
    """Inputs and outputs by region equal the same request sent inline."""

    def test_tritonclient_usage_pattern(self):
        # create, set, register, infer with regions, read outputs, unregister.
        q, k, v = uniform(1, 2, 3, D), uniform(2, 2, 5, D), uniform(3, 2, 5, D)
        lens = np.array([5, 2], dtype=np.int32)
        in_bytes = q.nbytes + k.nbytes + v.nbytes + lens.nbytes
        out_bytes = 2 * 3 * P_O * 4
        inputs = self.region(in_bytes)
        outputs = self.region(out_bytes + 4096)  # sized generously, as perf_analyzer does
        offsets = np.cumsum([0, q.nbytes, k.nbytes, v.nbytes])
        for offset, array in zip(offsets, (q, k, v, lens)):
            inputs.set(int(offset), array)
        self.register("input_data", inputs.key, in_bytes)
        self.register("output_data", outputs.key, outputs.size)
        request = build_request(
            [("queries", "FP32", q, ("input_data", q.nbytes, int(offsets[0]))),
             ("keys", "FP32", k, ("input_data", k.nbytes, int(offsets[1]))),
             ("values", "FP32", v, ("input_data", v.nbytes, int(offsets[2]))),
             ("valid_lens", "INT32", lens, ("input_data", lens.nbytes, int(offsets[3])))],
            [("output", ("output_data", outputs.size, None))], request_id="shm1")
        self.assertEqual(len(request.raw_input_contents), 0)
        response = self.infer(request)
        self.assertEqual(response.id, "shm1")
        self.assertEqual(len(response.outputs), 1)
        self.assertEqual(len(response.raw_output_contents), 1)
        self.assertEqual(response.raw_output_contents[0], b"")  # the bytes are in the region
        tensor = response.outputs[0]
        self.assertEqual(list(tensor.shape), [2, 3, P_O])
        self.assertEqual(tensor.parameters["shared_memory_region"].string_param, "output_data")
        got = outputs.get(0, "<f4", (2, 3, P_O))
        want = self.inline([("queries", "FP32", q), ("keys", "FP32", k), ("values", "FP32", v),
                            ("valid_lens", "INT32", lens)])["output"]
        self.assertLessEqual(max_abs_diff(got, want), TOLERANCE)
        self.assertGreater(float(np.max(np.abs(want))), 1e-3)
        # The bytes past the output are untouched.
        self.assertTrue(np.all(outputs.get(out_bytes, "<u1", (4096,)) == 0))
        self.unregister("input_data")
        self.unregister("output_data")
        self.assertEqual(len(self.status().regions), 0)

    def test_self_attention_with_valid_lens_and_attention_output(self):
        q = uniform(4, 3, 4, D)
        lens = np.array([[1, 2, 3, 4], [4, 4, 4, 4], [2, 1, 0, 3]], dtype=np.int64)
        region = self.region(1 << 16)
        self.register("io", region.key, region.size)
        region.set(0, q)
        region.set(8192, lens)
        att_bytes = 3 * HEADS * 4 * 4 * 4
        request = build_request(
            [("queries", "FP32", q, ("io", q.nbytes, 0)),
             ("valid_lens", "INT64", lens, ("io", lens.nbytes, 8192))],
            [("attention", ("io", att_bytes, 16384)), ("output", ("io", 3 * 4 * P_O * 4, 32768))])
        response = self.infer(request)
        self.assertEqual([t.name for t in response.outputs], ["attention", "output"])
        self.assertEqual(list(response.raw_output_contents), [b"", b""])
        want = self.inline([("queries", "FP32", q), ("valid_lens", "INT64", lens)],
                           outputs=("attention", "output"))
        self.assertLessEqual(
            max_abs_diff(region.get(16384, "<f4", (3, HEADS, 4, 4)), want["attention"]), TOLERANCE)
        self.assertLessEqual(max_abs_diff(region.get(32768, "<f4", (3, 4, P_O)), want["output"]),
                             TOLERANCE)

    def test_mixed_inline_and_shared_memory(self):
        q, k, v = uniform(5, 2, 3, D), uniform(6, 2, 4, D), uniform(7, 2, 4, D)
        region = self.region(k.nbytes + 64 + v.nbytes)
        region.set(0, k)
        region.set(k.nbytes + 64, v)
        self.register("kv", region.key, region.size)
        # queries inline (raw_input_contents[0]), keys in shm, values inline
        # (raw_input_contents[1]): the raw index skips the shm input.
        request = build_request([("queries", "FP32", q, None),
                                 ("keys", "FP32", k, ("kv", k.nbytes, 0)),
                                 ("values", "FP32", v, None)],
                                [("attention", None), ("output", None)])
        self.assertEqual(len(request.raw_input_contents), 2)
        got = {name: np.frombuffer(raw, dtype="<f4").reshape(tuple(t.shape))
               for name, (t, raw) in outputs_of(self.infer(request)).items()}
        want = self.inline([("queries", "FP32", q), ("keys", "FP32", k), ("values", "FP32", v)],
                           outputs=("attention", "output"))
        for name in ("attention", "output"):
            self.assertLessEqual(max_abs_diff(got[name], want[name]), TOLERANCE, name)
        # values from shm at an offset, queries and keys inline; the output inline too.
        request = build_request([("queries", "FP32", q, None), ("keys", "FP32", k, None),
                                 ("values", "FP32", v, ("kv", v.nbytes, k.nbytes + 64))])
        got = outputs_of(self.infer(request))["output"]
        self.assertLessEqual(
            max_abs_diff(np.frombuffer(got[1], dtype="<f4").reshape(2, 3, P_O), want["output"]),
            TOLERANCE)

    def test_stream_infer_with_regions(self):
        q = uniform(8, 1, 2, D)
        region = self.region(1 << 14)
        region.set(0, q)
        self.register("s", region.key, region.size)
        request = build_request([("queries", "FP32", q, ("s", q.nbytes, 0))],
                                [("output", ("s", 2 * P_O * 4, 4096))])
        responses = list(self.inf.ModelStreamInfer(iter([request, request]), timeout=TIMEOUT))
        self.assertEqual([r.error_message for r in responses], ["", ""])
        want = self.inline([("queries", "FP32", q)])["output"]
        self.assertLessEqual(max_abs_diff(region.get(4096, "<f4", (1, 2, P_O)), want), TOLERANCE)


class RefusalTest(Case):
    """Every refusal of an infer request names the region and field; the server serves on."""

    def setUp(self):
        super().setUp()
        self.q = uniform(20, 1, 2, D)
        self.a = self.region(8192)
        self.b = self.region(8192)
        self.a.set(0, self.q)
        self.register("a", self.a.key, 4096)
        self.register("a_tail", self.a.key, 4096, offset=4096)  # the same file
        self.register("a_mid", self.a.key, 4096, offset=2048)  # overlapping both
        self.register("b", self.b.key, 8192)

    def refused(self, code, inputs, outputs, names):
        self.assertRpcError(code, self.infer, build_request(inputs, outputs), names=names)
        self.assertServing()

    def test_unknown_region(self):
        self.refused(grpc.StatusCode.NOT_FOUND, [("queries", "FP32", self.q, ("zz", 800, 0))], [],
                     ['inputs[0] ("queries").parameters.shared_memory_region', '"zz"'])

    def test_byte_size_must_equal_the_input(self):
        self.refused(grpc.StatusCode.INVALID_ARGUMENT,
                     [("queries", "FP32", self.q, ("a", 804, 0))], [],
                     ['inputs[0] ("queries").parameters.shared_memory_byte_size', "800 bytes",
                      "804"])

    def test_output_byte_size_too_small(self):
        self.refused(grpc.StatusCode.INVALID_ARGUMENT, [("queries", "FP32", self.q, None)],
                     [("output", ("b", 799, 0))],
                     ['outputs[0] ("output").parameters.shared_memory_byte_size', "799"])

    def test_beyond_the_region(self):
        self.refused(grpc.StatusCode.INVALID_ARGUMENT,
                     [("queries", "FP32", self.q, ("a", 800, 3500))], [],
                     ['inputs[0] ("queries").parameters.shared_memory_offset', "3500",
                      '"a"', "4096"])
        self.refused(grpc.StatusCode.INVALID_ARGUMENT, [("queries", "FP32", self.q, None)],
                     [("output", ("b", 800, 2**63 - 1))],
                     ['outputs[0] ("output").parameters.shared_memory_offset', '"b"'])

    def test_output_overlapping_an_input(self):
        self.refused(grpc.StatusCode.INVALID_ARGUMENT,
                     [("queries", "FP32", self.q, ("a", 800, 0))], [("output", ("a", 800, 400))],
                     ['outputs[0] ("output")', 'inputs[0] ("queries")', '"a"'])
        # Through two regions over one file: a_tail's 0 is the file's 4096, a_mid's
        # 2400 the file's 4448.
        self.a.set(4096, self.q)
        self.refused(grpc.StatusCode.INVALID_ARGUMENT,
                     [("queries", "FP32", self.q, ("a_tail", 800, 0))],
                     [("output", ("a_mid", 800, 2400))],
                     ['outputs[0] ("output")', '"a_mid"', 'inputs[0] ("queries")', '"a_tail"',
                      "[4448, 5248)", "[4096, 4896)"])
        # Adjacent ranges are fine.
        response = self.infer(build_request([("queries", "FP32", self.q, ("a", 800, 0))],
                                            [("output", ("a", 800, 800))]))
        self.assertEqual(response.raw_output_contents[0], b"")

    def test_outputs_overlapping_each_other(self):
        self.refused(grpc.StatusCode.INVALID_ARGUMENT, [("queries", "FP32", self.q, None)],
                     [("attention", ("b", 80, 0)), ("output", ("b", 800, 40))],
                     ['outputs[1] ("output")', 'outputs[0] ("attention")'])

    def test_bad_parameters(self):
        request = build_request([("queries", "FP32", self.q, None)])
        request.outputs.add(name="output").parameters["shared_memory_byte_size"].int64_param = 8
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.infer, request,
                            names=['outputs[0] ("output").parameters.shared_memory_region',
                                   "required"])
        request = build_request([("queries", "FP32", self.q, ("a", 800, 0))])
        request.inputs[0].parameters["shared_memory_byte_size"].string_param = "800"
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.infer, request,
                            names=['inputs[0] ("queries").parameters.shared_memory_byte_size'])
        request = build_request([("queries", "FP32", self.q, ("a", 800, 0))])
        request.inputs[0].parameters["shared_memory_offset"].int64_param = -4
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.infer, request,
                            names=['inputs[0] ("queries").parameters.shared_memory_offset'])
        # An shm input with an entry of raw_input_contents: one entry too many.
        request = build_request([("queries", "FP32", self.q, ("a", 800, 0))])
        request.raw_input_contents.append(self.q.tobytes())
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.infer, request,
                            names=["raw_input_contents", "shared memory"])
        self.assertServing()

    def test_non_finite_values_in_a_region(self):
        bad = self.q.copy()
        bad[0, 1, 7] = np.nan
        self.b.set(0, bad)
        self.refused(grpc.StatusCode.INVALID_ARGUMENT,
                     [("queries", "FP32", bad, ("b", 800, 0))], [], ["queries"])

    def test_truncated_region_single_request(self):
        # The client truncates its file below a registered input, then below an
        # output: each request fails naming the region; no signal reaches the server.
        path = f"/dev/shm/{self.b.shm.name}"
        self.b.shm.close()  # no mapping of ours may see the file shrink
        with open(path, "r+b") as f:
            os.truncate(f.fileno(), 100)
        self.refused(grpc.StatusCode.FAILED_PRECONDITION,
                     [("queries", "FP32", self.q, ("b", 800, 0))], [],
                     ['inputs[0] ("queries").parameters.shared_memory_region', '"b"', "truncated"])
        self.refused(grpc.StatusCode.FAILED_PRECONDITION, [("queries", "FP32", self.q, None)],
                     [("output", ("b", 800, 0))],
                     ['outputs[0] ("output").parameters.shared_memory_region', '"b"',
                      "truncated"])
        self.assertEqual(os.stat(path).st_size, 100)  # not grown back
        os.truncate(path, 8192)
        self.b.shm = shared_memory.SharedMemory(name=self.b.shm.name)  # for tearDown's unlink


class InFlightTest(Case):
    """A region unregistered or truncated while requests use it."""

    server_args = ["--shared_memory=system", "--batching=false"]

    def requests(self, region_name, q, count, out_offset):
        request = build_request([("queries", "FP32", q, (region_name, q.nbytes, 0))],
                                [("output", (region_name, q.shape[0] * q.shape[1] * P_O * 4,
                                             out_offset))])
        pool = concurrent.futures.ThreadPoolExecutor(8)
        futures = [pool.submit(self.inf.ModelInfer, request, timeout=TIMEOUT)
                   for _ in range(count)]
        return pool, futures

    def test_unregister_during_in_flight_requests(self):
        q = uniform(30, 8, 64, D)
        region = self.region(2 * q.nbytes + 4096)
        region.set(0, q)
        self.register("live", region.key, region.size)
        pool, futures = self.requests("live", q, 24, q.nbytes + 4096)
        time.sleep(0.05)
        self.unregister("live")
        codes = []
        for future in futures:
            try:
                self.assertEqual(future.result().raw_output_contents[0], b"")
                codes.append("OK")
            except grpc.RpcError as e:  # decoded after the unregister
                self.assertEqual(e.code(), grpc.StatusCode.NOT_FOUND, e.details())
                self.assertIn('"live"', e.details())
                codes.append("NOT_FOUND")
        pool.shutdown()
        self.assertIn("OK", codes)
        # What the accepted requests wrote is the answer: the region stayed alive.
        want = self.inline([("queries", "FP32", q)])["output"]
        self.assertLessEqual(max_abs_diff(region.get(q.nbytes + 4096, "<f4", (8, 64, P_O)), want),
                             TOLERANCE)
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, self.status, "live")
        self.assertServing()

    def test_truncation_while_requests_run(self):
        q = uniform(31, 8, 64, D)
        region = self.region(2 * q.nbytes)
        region.set(0, q)
        self.register("trunc", region.key, region.size)
        path = f"/dev/shm/{region.shm.name}"
        pool, futures = self.requests("trunc", q, 24, q.nbytes)
        region.shm.close()  # our own mapping must not see the file shrink
        time.sleep(0.02)
        with open(path, "r+b") as f:
            os.truncate(f.fileno(), 0)
        for future in futures:
            try:
                future.result()
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.FAILED_PRECONDITION, e.details())
                self.assertIn('"trunc"', e.details())
        pool.shutdown()
        self.assertServing()
        os.truncate(path, region.size)
        region.shm = shared_memory.SharedMemory(name=region.shm.name)


class HttpTest(Case):
    """The HTTP routes of the registry with Triton's statuses, and inputs and outputs
    by region from the shared codec."""

    server_args = ["--shared_memory=system", "--http_port=0"]

    def post(self, path, body=None):
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.proc.http_port}{path}",
            data=None if body is None else json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as f:
                return f.status, json.loads(f.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.proc.http_port}{path}",
                                        timeout=TIMEOUT) as f:
                return f.status, json.loads(f.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def test_http_status_register_unregister_round_trip(self):
        status, metadata = self.get("/v2")
        self.assertIn("system_shared_memory", metadata["extensions"])
        region = self.region(4096)
        base = "/v2/systemsharedmemory"
        self.assertEqual(self.post(f"{base}/region/r1/register",
                                   {"key": region.key, "offset": 0, "byte_size": 4096}),
                         (200, {}))
        self.assertEqual(self.post(f"{base}/region/r2/register",
                                   {"key": region.key, "offset": 1024, "byte_size": 1024}),
                         (200, {}))
        status, regions = self.get(f"{base}/status")
        self.assertEqual(status, 200)
        self.assertEqual([(r["name"], r["key"], r["offset"], r["byte_size"]) for r in regions],
                         [("r1", region.key, 0, 4096), ("r2", region.key, 1024, 1024)])
        self.assertEqual(self.get(f"{base}/region/r2/status")[1],
                         [{"name": "r2", "key": region.key, "offset": 1024, "byte_size": 1024}])
        # Triton's codes: a name registered twice 400, an unknown name's status 404,
        # unregistering an unknown name succeeds; a bad body names its field.
        status, answer = self.post(f"{base}/region/r1/register",
                                   {"key": region.key, "byte_size": 16})
        self.assertEqual(status, 400, answer)
        self.assertIn("r1", answer["error"])
        status, answer = self.post(f"{base}/region/r3/register", {"key": region.key,
                                                                  "byte_size": "16"})
        self.assertEqual(status, 400, answer)
        self.assertIn("byte_size", answer["error"])
        self.assertEqual(self.get(f"{base}/region/nope/status")[0], 404)
        self.assertEqual(self.post(f"{base}/region/nope/unregister"), (200, {}))
        self.assertEqual(self.post(f"{base}/region/r1/unregister"), (200, {}))
        self.assertEqual([r["name"] for r in self.get(f"{base}/status")[1]], ["r2"])
        self.assertEqual(self.post(f"{base}/unregister"), (200, {}))  # every region
        self.assertEqual(self.get(f"{base}/status"), (200, []))
        status, answer = self.get("/v2/cudasharedmemory/status")
        self.assertEqual(status, 501, answer)
        self.assertServing()

    def test_infer_with_regions(self):
        q, k, v = uniform(40, 2, 3, D), uniform(41, 2, 4, D), uniform(42, 2, 4, D)
        lens = np.array([4, 1], dtype=np.int32)
        region = self.region(1 << 16)
        region.set(0, k)
        region.set(8192, lens)
        self.register("h", region.key, region.size)
        body = {"inputs": [
            {"name": "queries", "datatype": "FP32", "shape": [2, 3, D],
             "data": q.ravel().tolist()},
            {"name": "keys", "datatype": "FP32", "shape": [2, 4, D],
             "parameters": {"shared_memory_region": "h", "shared_memory_byte_size": k.nbytes}},
            {"name": "values", "datatype": "FP32", "shape": [2, 4, D],
             "data": v.ravel().tolist()},
            {"name": "valid_lens", "datatype": "INT32", "shape": [2],
             "parameters": {"shared_memory_region": "h", "shared_memory_byte_size": 8,
                            "shared_memory_offset": 8192}}],
            "outputs": [{"name": "output", "parameters": {
                "shared_memory_region": "h", "shared_memory_byte_size": 2 * 3 * P_O * 4,
                "shared_memory_offset": 16384}}]}
        status, answer = self.post("/v2/models/default/infer", body)
        self.assertEqual(status, 200, answer)
        output = answer["outputs"][0]
        self.assertNotIn("data", output)
        self.assertNotIn("parameters", output)  # as Triton: tritonclient reads them as binary
        self.assertEqual(output["shape"], [2, 3, P_O])
        want = self.inline([("queries", "FP32", q), ("keys", "FP32", k), ("values", "FP32", v),
                            ("valid_lens", "INT32", lens)])["output"]
        self.assertLessEqual(max_abs_diff(region.get(16384, "<f4", (2, 3, P_O)), want), TOLERANCE)
        # data and a region at once: refused naming the input.
        body["inputs"][1]["data"] = k.ravel().tolist()
        status, answer = self.post("/v2/models/default/infer", body)
        self.assertEqual(status, 400, answer)
        self.assertIn('inputs[1] ("keys")', answer["error"])


class OffTest(Case):
    """--shared_memory=none (the default): the RPCs are UNIMPLEMENTED, the extension
    is not listed, and an infer request naming a region is refused."""

    server_args = []

    def tearDown(self):
        for region in self.regions:
            region.destroy()

    def test_off(self):
        for call in (lambda: self.status(), lambda: self.unregister(""),
                     lambda: self.register("r", "/k", 16)):
            self.assertRpcError(grpc.StatusCode.UNIMPLEMENTED, call,
                                names=["--shared_memory=system"])
        metadata = self.inf.ServerMetadata(API.inf.ServerMetadataRequest(), timeout=TIMEOUT)
        self.assertNotIn("system_shared_memory", metadata.extensions)
        q = uniform(50, 1, 2, D)
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.infer,
                            build_request([("queries", "FP32", q, ("r", 800, 0))]),
                            names=['inputs[0] ("queries").parameters.shared_memory_region',
                                   "--shared_memory=system"])


class LimitsTest(Case):
    server_args = ["--shared_memory=system", "--shared_memory_max_regions=2",
                   "--shared_memory_max_bytes=8000",
                   "--restricted_api=shared-memory:shm-key=secret"]

    def test_limits_and_restricted_group(self):
        region = self.region(8192)
        self.assertRpcError(grpc.StatusCode.PERMISSION_DENIED, self.register, "r", region.key,
                            16)
        key = [("shm-key", "secret")]
        self.register("r1", region.key, 16, metadata=key)
        self.assertRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, self.register, "r2", region.key,
                            8192, metadata=key, names=["--shared_memory_max_bytes"])
        self.register("r2", region.key, 16, metadata=[("triton-grpc-protocol-shm-key", "secret")])
        self.assertRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, self.register, "r3", region.key,
                            16, metadata=key, names=["--shared_memory_max_regions"])


    def tearDown(self):
        for region in self.regions:
            region.destroy()


class ClientTest(Case):
    """attention_client infer|bench --protocol=kserve --shared_memory=system: the
    same answer as inline, and no region left behind (created, registered, unlinked
    at once, unregistered on exit)."""

    def client(self, *args):
        binary = os.path.join(os.path.dirname(os.path.dirname(BINARY)), "client",
                              "attention_client")
        if not os.path.exists(binary):
            self.skipTest(f"no {binary}")
        return subprocess.run([binary, *args, "--protocol=kserve", f"--target={self.target}"],
                              capture_output=True, text=True, timeout=120)

    def test_infer_and_bench(self):
        before = set(os.listdir("/dev/shm"))
        request = ["--batch=2", "--num_queries=3", "--num_keys=5", "--valid_lens=5,2",
                   "--return_attention"]
        shm = self.client("infer", "--shared_memory=system", *request)
        inline = self.client("infer", *request)
        self.assertEqual(shm.returncode, 0, shm.stderr)
        self.assertEqual(inline.returncode, 0, inline.stderr)
        strip = lambda text: [l for l in text.splitlines() if not l.startswith("time:")]
        self.assertEqual(strip(shm.stdout), strip(inline.stdout))
        bench = self.client("bench", "--shared_memory=system", "--concurrency=1:2",
                            "--duration=2s", "--warmup=0.2s", "--window=0.5s")
        self.assertEqual(bench.returncode, 0, bench.stderr)
        self.assertIn("failed: 0", bench.stdout)
        self.assertEqual(len(self.status().regions), 0)  # unregistered on exit
        self.assertEqual(set(os.listdir("/dev/shm")) - before, set())  # unlinked
        refused = self.client("bench", "--shared_memory=system", "--mode=stream")
        self.assertEqual(refused.returncode, 2, refused.stderr)
        self.assertIn("--shared_memory=system", refused.stderr)


class RequestBytesTest(Case):
    server_args = ["--shared_memory=system", "--max_request_bytes=100000"]

    def test_region_bytes_count_against_max_request_bytes(self):
        # Checked before any byte is read (no allocation proportional to what a
        # request names).
        big = uniform(61, 1, 300, D)  # 120000 bytes
        large = self.region(big.nbytes)
        large.set(0, big)
        self.register("large", large.key, big.nbytes)
        self.assertRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, self.infer,
                            build_request([("queries", "FP32", big, ("large", big.nbytes, 0))]),
                            names=["max_request_bytes"])
        small = big[:, :100]  # 40000 bytes: fits
        response = self.infer(build_request([("queries", "FP32", small,
                                              ("large", small.nbytes, 0))]))
        self.assertEqual(list(response.outputs[0].shape), [1, 100, P_O])
        self.assertServing()


class TruncationUnderLoadTest(Case):
    """Slow (--slow; MHA_SLOW_TESTS=1): eight clients send requests by region for
    SECONDS while another thread truncates the file to a random size and grows it
    back, again and again. Every answer is OK or FAILED_PRECONDITION naming the
    region; the server stays up and answers correctly afterwards."""

    SECONDS = 20

    def test_truncation_under_load(self):
        import random
        import threading
        q = uniform(70, 8, 64, D)
        size = 2 * q.nbytes
        region = self.region(size)
        self.register("load", region.key, size)
        path = f"/dev/shm/{region.shm.name}"
        region.shm.close()  # no mapping of ours may see the file shrink
        fd = os.open(path, os.O_RDWR)
        os.pwrite(fd, q.tobytes(), 0)
        request = build_request([("queries", "FP32", q, ("load", q.nbytes, 0))],
                                [("output", ("load", 8 * 64 * P_O * 4, q.nbytes))])
        stop = time.monotonic() + self.SECONDS
        outcomes = {"OK": 0, "FAILED_PRECONDITION": 0}
        lock = threading.Lock()
        failures = []

        def client():
            while time.monotonic() < stop:
                try:
                    self.inf.ModelInfer(request, timeout=TIMEOUT)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                    if code != "FAILED_PRECONDITION" or '"load"' not in e.details():
                        failures.append((code, e.details()))
                with lock:
                    outcomes[code] = outcomes.get(code, 0) + 1

        def truncator():
            rng = random.Random(7)
            while time.monotonic() < stop:
                os.ftruncate(fd, rng.randrange(0, size))
                time.sleep(rng.uniform(0.0, 0.02))
                os.ftruncate(fd, size)
                os.pwrite(fd, q.tobytes(), 0)
                time.sleep(rng.uniform(0.0, 0.05))

        threads = [threading.Thread(target=client) for _ in range(8)]
        threads.append(threading.Thread(target=truncator))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        os.ftruncate(fd, size)
        os.pwrite(fd, q.tobytes(), 0)
        self.assertEqual(failures, [])
        self.assertGreater(outcomes["OK"], 0, outcomes)
        self.assertGreater(outcomes["FAILED_PRECONDITION"], 0, outcomes)
        print(f"truncation under load: {outcomes}", file=sys.stderr)
        self.infer(request)
        got = np.frombuffer(os.pread(fd, 8 * 64 * P_O * 4, q.nbytes), dtype="<f4")
        want = self.inline([("queries", "FP32", q)])["output"]
        self.assertLessEqual(max_abs_diff(got.reshape(8, 64, P_O), want), TOLERANCE)
        os.close(fd)
        region.shm = shared_memory.SharedMemory(name=region.shm.name)
        self.assertServing()


def non_loopback_address():
    """An address of this host that is not loopback, or None."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent
            address = s.getsockname()[0]
        return None if address.startswith("127.") else address
    except OSError:
        return None


class RemotePeerTest(unittest.TestCase):
    """Register from a peer that is not loopback: PERMISSION_DENIED unless
    --shared_memory_allow_remote."""

    def check(self, allow):
        address = non_loopback_address()
        if address is None:
            self.skipTest("no address but loopback")
        args = ["--shared_memory=system", "--host=0.0.0.0"]
        if allow:
            args.append("--shared_memory_allow_remote")
        proc, target = start_server(BINARY, args)
        region = Region(64)
        try:
            port = target.rsplit(":", 1)[1]
            with grpc.insecure_channel(f"{address}:{port}") as channel:
                stub = API.inf_grpc.GRPCInferenceServiceStub(channel)
                request = API.inf.SystemSharedMemoryRegisterRequest(name="far", key=region.key,
                                                                    byte_size=64)
                if allow:
                    stub.SystemSharedMemoryRegister(request, timeout=TIMEOUT)
                else:
                    with self.assertRaises(grpc.RpcError) as caught:
                        stub.SystemSharedMemoryRegister(request, timeout=TIMEOUT)
                    self.assertEqual(caught.exception.code(), grpc.StatusCode.PERMISSION_DENIED)
                    self.assertIn('"far"', caught.exception.details())
                    self.assertIn("--shared_memory_allow_remote", caught.exception.details())
                self.assertTrue(stub.ServerLive(API.inf.ServerLiveRequest(),
                                                timeout=TIMEOUT).live)
        finally:
            region.destroy()
            self.assertEqual(stop_server(proc), 0)

    def test_remote_refused(self):
        self.check(allow=False)

    def test_remote_allowed(self):
        self.check(allow=True)


def main():
    global BINARY, SOURCE, API
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    BINARY, SOURCE = sys.argv[1], sys.argv[2]
    rest = sys.argv[3:]
    if "--slow" in rest:  # the slow label's run: truncation under load only
        if os.environ.get("MHA_SLOW_TESTS") != "1":
            print("skipped: slow (MHA_SLOW_TESTS=1 runs it)")
            return 77
        rest = [a for a in rest if a != "--slow"] + ["TruncationUnderLoadTest"]
    else:
        unittest.skip("slow: kserve_shared_memory_truncation_load runs it")(
            TruncationUnderLoadTest)
    out_dir = tempfile.mkdtemp(prefix="kserve_shm_stubs_")
    try:
        API = load_api(SOURCE, out_dir)
        program = unittest.main(argv=[sys.argv[0], *rest], exit=False, verbosity=2)
        return 0 if program.result.wasSuccessful() else 1
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
