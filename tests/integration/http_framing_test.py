#!/usr/bin/python3
"""The event-driven HTTP front's framing, limits and timeouts (RFC 9112), over raw
sockets against a real attention_server: each rule answered with its status within
its bound, floods refused with the server's RSS sampled before and after, idle and
slow connections that lock nobody out, a client that leaves while its request
computes counted CANCELLED, and 64 keep-alive clients at once.

    http_framing_test.py SERVER_BINARY SOURCE_DIR [unittest arguments]
"""

import gzip
import http.client
import json
import os
import socket
import struct
import sys
import threading
import time
import unittest
import urllib.request
import zlib

from server_harness import start_server, stop_server

LIMIT = 1_000_000  # --max_request_bytes: the body limit
# Under a sanitizer, shadow memory grows with what the server touches: RSS growth is
# checked in the release build only (the refusals are checked everywhere).
RSS_BOUND = float("inf") if os.environ.get("MHA_SANITIZED") else 2 * LIMIT
D = 100  # d_q of the built-in model "default"


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def parse_responses(data):
    """Every complete response in `data`: [(status, {header: value}, body)]."""
    out = []
    while data:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            break
        head = data[:end].decode("latin-1").split("\r\n")
        status = int(head[0].split(" ")[1])
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        if status == 100:
            length = 0
        body = data[end + 4:end + 4 + length]
        if len(body) < length:
            break
        out.append((status, headers, body))
        data = data[end + 4 + length:]
    return out


class Conn:
    """A raw TCP connection to the HTTP front."""

    def __init__(self, port, timeout=10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def send(self, data):
        self.sock.sendall(data if isinstance(data, bytes) else data.encode("latin-1"))

    def read_until_closed(self, timeout=10.0):
        """Reads until the server closes; returns (bytes, seconds waited)."""
        start = time.monotonic()
        self.sock.settimeout(timeout)
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                self.buf += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        return self.buf, time.monotonic() - start

    def responses(self, count, timeout=10.0):
        """Reads until `count` complete responses arrived (or timeout)."""
        deadline = time.monotonic() + timeout
        while len(parse_responses(self.buf)) < count and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            self.buf += chunk
        return parse_responses(self.buf)

    def closed(self, timeout=3.0):
        """True when the server closed the connection (EOF or reset) within timeout."""
        self.sock.settimeout(timeout)
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
                self.buf += chunk
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    def close(self):
        self.sock.close()


def get(path, host="x"):
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n"


def infer_body(q=1):
    return json.dumps({"inputs": [{"name": "queries", "datatype": "FP32", "shape": [1, q, D],
                                   "data": [0.5] * (q * D)}]}).encode()


class FramingTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.proc, cls.target = start_server(BINARY, [
            "--http_port=0", f"--max_request_bytes={LIMIT}", "--http_header_timeout=2s",
            "--http_idle_timeout=30s"])
        cls.port = cls.proc.http_port

    @classmethod
    def tearDownClass(cls):
        if stop_server(cls.proc) != 0:
            raise AssertionError("the server did not drain cleanly")

    def tearDown(self):
        # After every rule, a good request on a new connection is answered at once.
        c = Conn(self.port)
        start = time.monotonic()
        c.send(get("/v2/health/live"))
        responses = c.responses(1, timeout=5)
        c.close()
        self.assertEqual([r[0] for r in responses], [200])
        self.assertLess(time.monotonic() - start, 1.0)

    def refused(self, request, status, bound=2.0, closed=True):
        c = Conn(self.port)
        start = time.monotonic()
        c.send(request)
        responses = c.responses(1, timeout=bound + 3)
        took = time.monotonic() - start
        self.assertTrue(responses, f"no answer to {request[:80]!r}")
        self.assertEqual(responses[0][0], status, responses[0][2])
        self.assertIn("error", json.loads(responses[0][2]))
        self.assertLess(took, bound)
        if closed:
            self.assertTrue(c.closed(), "the connection stays open after the refusal")
        c.close()
        return responses[0]

    # --- RFC 9112 framing ------------------------------------------------------

    def test_a_post_without_length_or_chunks_has_an_empty_body(self):
        c = Conn(self.port)
        start = time.monotonic()
        c.send("POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n")
        responses = c.responses(1)
        self.assertEqual(responses[0][0], 200)
        self.assertIsInstance(json.loads(responses[0][2]), list)
        self.assertLess(time.monotonic() - start, 1.0)
        c.close()

    def test_transfer_encoding_with_content_length_is_400_and_close(self):
        _, _, body = self.refused("POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n"
                                  "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"
                                  "0\r\n\r\n", 400)
        self.assertIn(b"Content-Length", body)

    def test_differing_content_lengths_are_400_and_close(self):
        self.refused("POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                     "Content-Length: 3\r\n\r\n{}", 400)
        self.refused("POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 3\r\n"
                     "\r\n{}", 400)
        self.refused("POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n"
                     "\r\n{}", 400)

    def test_repeated_equal_content_lengths_are_one(self):
        c = Conn(self.port)
        c.send("POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
               "Content-Length: 2\r\n\r\n{}")
        self.assertEqual(c.responses(1)[0][0], 200)
        c.close()

    def test_a_transfer_encoding_other_than_chunked_is_400_and_close(self):
        for coding in ("gzip", "gzip, chunked", "chunked, chunked", "identity"):
            _, _, body = self.refused("POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n"
                                      f"Transfer-Encoding: {coding}\r\n\r\n", 400)
            self.assertIn(b"Transfer-Encoding", body)
        self.refused("POST /v2/repository/index HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"
                     "0\r\n\r\n", 400)

    def test_missing_or_repeated_host_is_400(self):
        _, _, body = self.refused("GET /v2/health/live HTTP/1.1\r\n\r\n", 400)
        self.assertIn(b"Host", body)
        self.refused("GET /v2/health/live HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400)
        c = Conn(self.port)  # HTTP/1.0 needs none
        c.send("GET /v2/health/live HTTP/1.0\r\n\r\n")
        self.assertEqual(c.responses(1)[0][0], 200)
        self.assertTrue(c.closed())
        c.close()

    def test_malformed_heads_are_refused(self):
        self.refused("GARBAGE\r\n\r\n", 400)
        self.refused("GET /v2/health/live HTTP/2.0\r\nHost: x\r\n\r\n", 505)
        self.refused("GET /v2/health/live HTTP/1.1\r\nHost : x\r\n\r\n", 400)
        self.refused("GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-A: b\r\n folded\r\n\r\n", 400)
        self.refused("GET /v2/health/live HTTP/1.1\r\nHost: x\r\nExpect: magic\r\n\r\n", 417)

    def test_pipelined_requests_are_answered_in_order(self):
        body = infer_body()
        c = Conn(self.port)
        c.send(get("/v2/health/live") + get("/v2/models/default") +
               "POST /v2/models/default/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
               f"{len(body)}\r\n\r\n" + body.decode() + get("/v2/nothing") + get("/v2"))
        responses = c.responses(5)
        self.assertEqual([r[0] for r in responses], [200, 200, 200, 404, 200])
        self.assertEqual(json.loads(responses[0][2]), {})
        self.assertEqual(json.loads(responses[1][2])["name"], "default")
        self.assertEqual(json.loads(responses[2][2])["outputs"][0]["shape"], [1, 1, D])
        self.assertIn("extensions", json.loads(responses[4][2]))
        c.close()

    def test_a_body_is_never_read_as_a_request(self):
        smuggled = get("/v2/nothing").encode()
        c = Conn(self.port)
        c.send(f"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: {len(smuggled)}"
               "\r\n\r\n")
        time.sleep(0.3)
        c.send(smuggled)  # the GET's body, in a second write
        c.send(get("/v2"))
        responses = c.responses(3, timeout=2)
        self.assertEqual([r[0] for r in responses], [200, 200])
        self.assertIn("extensions", json.loads(responses[1][2]))
        c.close()

    def test_expect_continue_is_answered_within_the_limit_only(self):
        body = infer_body()
        c = Conn(self.port)
        c.send("POST /v2/models/default/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
               f"Content-Length: {len(body)}\r\n\r\n")
        first = c.responses(1)
        self.assertEqual(first[0][0], 100)
        c.send(body)
        responses = c.responses(2)
        self.assertEqual(responses[1][0], 200)
        c.close()
        for expect in ("Expect: 100-continue\r\n", ""):
            _, _, message = self.refused(
                f"POST /v2/models/default/infer HTTP/1.1\r\nHost: x\r\n{expect}"
                f"Content-Length: {1 << 30}\r\n\r\n", 413, bound=1.0)
            self.assertIn(str(LIMIT).encode(), message)

    # --- limits whatever the encoding ------------------------------------------

    def flood_rss(self, send, status):
        """Sends a flood, expects `status`, returns the server's RSS growth."""
        before = rss_bytes(self.proc.pid)
        c = Conn(self.port)
        try:
            send(c)
        except (BrokenPipeError, ConnectionResetError):
            pass
        responses = c.responses(1, timeout=5)
        c.close()
        self.assertTrue(responses, "no answer to the flood")
        self.assertEqual(responses[0][0], status, responses[0][2])
        return rss_bytes(self.proc.pid) - before

    def test_compression_bombs_are_refused_at_the_decoded_limit(self):
        plain = b"0" * (65 << 20)
        for name, packed in (("gzip", gzip.compress(plain, 9)), ("deflate", zlib.compress(plain, 9))):
            self.assertLess(len(packed), LIMIT)
            head = (f"POST /v2/models/default/infer HTTP/1.1\r\nHost: x\r\nContent-Encoding: "
                    f"{name}\r\nContent-Length: {len(packed)}\r\n\r\n").encode()
            growth = self.flood_rss(lambda c: c.send(head + packed), 413)
            self.assertLess(growth, RSS_BOUND, f"{name}: RSS grew {growth} bytes")

    def test_a_compressed_body_within_the_limit_is_decoded(self):
        body = gzip.compress(infer_body())
        c = Conn(self.port)
        c.send((f"POST /v2/models/default/infer HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                f"Accept-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        status, headers, answer = c.responses(1)[0]
        self.assertEqual(status, 200)
        self.assertEqual(headers.get("content-encoding"), "gzip")
        self.assertEqual(json.loads(gzip.decompress(answer))["outputs"][0]["shape"], [1, 1, D])
        c.close()
        self.refused("POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\n"
                     "Content-Length: 2\r\n\r\n{}", 415)

    def test_a_chunked_flood_is_refused_at_the_limit(self):
        chunk = b"%x\r\n" % 65536 + b"x" * 65536 + b"\r\n"

        def send(c):
            c.send(b"POST /v2/models/default/infer HTTP/1.1\r\nHost: x\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n")
            for _ in range((65 << 20) // 65536):
                c.send(chunk)

        growth = self.flood_rss(send, 413)
        self.assertLess(growth, RSS_BOUND, f"RSS grew {growth} bytes")

    def test_chunked_bodies_within_the_limit_are_read(self):
        body = infer_body()
        chunked = b"".join(b"%x;ext=1\r\n" % len(body[i:i + 100]) + body[i:i + 100] + b"\r\n"
                           for i in range(0, len(body), 100)) + b"0\r\nTrailer: x\r\n\r\n"
        c = Conn(self.port)
        c.send(b"POST /v2/models/default/infer HTTP/1.1\r\nHost: x\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + chunked + get("/v2/health/live").encode())
        responses = c.responses(2)
        self.assertEqual([r[0] for r in responses], [200, 200])
        c.close()

    def test_a_header_flood_is_431(self):
        line = b"X-Flood: " + b"y" * 1000 + b"\r\n"

        def send(c):
            c.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
            for _ in range((65 << 20) // len(line)):
                c.send(line)

        growth = self.flood_rss(send, 431)
        self.assertLess(growth, RSS_BOUND, f"RSS grew {growth} bytes")

    # --- timeouts and connections ----------------------------------------------

    def test_a_slow_head_gets_408_at_its_deadline(self):
        c = Conn(self.port)
        start = time.monotonic()
        c.send("GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        status = None
        try:
            for _ in range(100):  # a byte per 100 ms: an idle timer would never fire
                c.send("X")
                time.sleep(0.1)
                if parse_responses(c.buf):
                    break
                c.sock.setblocking(False)
                try:
                    chunk = c.sock.recv(65536)
                    c.buf += chunk
                except BlockingIOError:
                    pass
                c.sock.setblocking(True)
        except (BrokenPipeError, ConnectionResetError):
            pass
        responses = c.responses(1, timeout=3)
        took = time.monotonic() - start
        status = responses[0][0] if responses else None
        c.close()
        self.assertEqual(status, 408)
        self.assertGreater(took, 1.8)
        self.assertLess(took, 3.5)

    def test_idle_and_slow_connections_lock_nobody_out(self):
        idle = [Conn(self.port) for _ in range(200)]
        slow = [Conn(self.port) for _ in range(70)]
        for s in slow:
            s.send("GET /v2/health/live HTTP/1.1\r\n")
        stop = threading.Event()

        def drip():
            while not stop.is_set():
                for s in slow:
                    try:
                        s.send("X")
                    except OSError:
                        pass
                time.sleep(0.1)

        dripper = threading.Thread(target=drip)
        dripper.start()
        try:
            for _ in range(5):
                start = time.monotonic()
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/health/ready",
                                            timeout=5) as r:
                    self.assertEqual(r.status, 200)
                self.assertLess(time.monotonic() - start, 0.5)
        finally:
            stop.set()
            dripper.join()
            for c in idle + slow:
                c.close()

    def test_64_keep_alive_clients_at_once(self):
        errors = []
        body = infer_body()

        def client():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                for i in range(10):
                    if i % 2:
                        conn.request("GET", "/v2/health/live")
                    else:
                        conn.request("POST", "/v2/models/default/infer", body=body)
                    r = conn.getresponse()
                    r.read()
                    if r.status != 200:
                        errors.append(r.status)
                conn.close()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=client) for _ in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])


class ConnectionLimitTest(unittest.TestCase):
    """--http_max_connections, and a client that leaves while its request computes."""

    @classmethod
    def setUpClass(cls):
        cls.proc, cls.target = start_server(BINARY, [
            "--http_port=0", "--http_max_connections=4", "--max_request_bytes=20000000"])
        cls.port = cls.proc.http_port

    @classmethod
    def tearDownClass(cls):
        if stop_server(cls.proc) != 0:
            raise AssertionError("the server did not drain cleanly")

    def test_connections_beyond_the_limit_get_503_and_close(self):
        held = [Conn(self.port) for _ in range(4)]
        time.sleep(0.2)
        extra = Conn(self.port)
        data, took = extra.read_until_closed(timeout=3)
        responses = parse_responses(data)
        self.assertEqual(responses[0][0], 503)
        self.assertIn(b"http_max_connections", responses[0][2])
        for c in held + [extra]:
            c.close()
        time.sleep(0.2)
        c = Conn(self.port)
        c.send(get("/v2/health/live"))
        self.assertEqual(c.responses(1)[0][0], 200)
        c.close()

    def cancelled_count(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.proc.metrics_port}/metrics",
                                    timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if (line.startswith("mha_requests_total{") and 'code="CANCELLED"' in line and
                    'protocol="kserve_http"' in line):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def test_a_client_that_leaves_while_its_request_computes_is_counted_cancelled(self):
        before = self.cancelled_count()
        b, q = 8, 2048  # ~14 GFLOP: hundreds of milliseconds here
        header = json.dumps({"inputs": [{"name": "queries", "datatype": "FP32",
                                         "shape": [b, q, D],
                                         "parameters": {"binary_data_size": b * q * D * 4}}]})
        data = struct.pack("<f", 0.25) * (b * q * D)
        for _ in range(3):
            c = Conn(self.port)
            c.send((f"POST /v2/models/default/infer HTTP/1.1\r\nHost: x\r\n"
                    f"Inference-Header-Content-Length: {len(header)}\r\n"
                    f"Content-Length: {len(header) + len(data)}\r\n\r\n{header}").encode() + data)
            time.sleep(0.05)  # read by the server, and computing or queued
            c.close()
        deadline = time.monotonic() + 20
        while self.cancelled_count() < before + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual(self.cancelled_count(), before + 3)


if __name__ == "__main__":
    BINARY = sys.argv[1]
    sys.path.insert(0, sys.argv[2] + "/tests/integration")
    unittest.main(argv=[sys.argv[0]] + sys.argv[3:])
