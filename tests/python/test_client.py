"""mha_serve.Client against real servers: installed from a fresh venv, answers equal
to the C++ client's, the raw encoding, streams, and errors as mha_serve.Error."""

import os
import socket
import subprocess
import sysconfig
import threading
import time

import grpc
import numpy as np
import pytest

import mha_serve
from mha_serve.client import (build_request, decode_response, decode_response_bytes,
                              encode_request, pb2)
from mha_serve.safetensors import read_safetensors, write_safetensors

from conftest import CLIENT, TIMEOUT, VENV, max_diff


def test_installed_into_the_venv():
    site = sysconfig.get_paths()["purelib"]
    assert os.path.realpath(site).startswith(os.path.realpath(VENV))
    package = os.path.dirname(os.path.realpath(mha_serve.__file__))
    assert package == os.path.realpath(os.path.join(site, "mha_serve"))
    # The stubs were generated at build time into the installed package, from the
    # proto that has Tensor.raw.
    for stub in ("attention_pb2.py", "attention_pb2_grpc.py"):
        assert os.path.isfile(os.path.join(package, "_proto", stub))
    assert "raw" in pb2.Tensor.DESCRIPTOR.fields_by_name
    assert os.access(os.path.join(VENV, "bin", "mha-serve-client"), os.X_OK)


def test_models_and_model(deploy_target):
    with mha_serve.Client(deploy_target, timeout=TIMEOUT) as client:
        models = client.models()
        assert [m.name for m in models] == ["bert_base", "decoder", "toy"]
        bert = client.model("bert_base")
        assert (bert.num_hiddens, bert.num_heads, bert.head_size) == (768, 12, 64)
        assert (bert.query_size, bert.key_size, bert.value_size) == (768, 768, 768)
        assert bert.bias and bert.supports_self_attention and bert.precision == "f32"
        assert (bert.limits.max_batch_size, bert.limits.max_sequence_length) == (64, 512)
        assert models[0] == bert
        toy = client.model("toy")
        assert (toy.num_hiddens, toy.num_heads, toy.query_size, toy.bias) == (100, 5, 100, False)


def cpp_client_output(target, model, inputs, tmp_path, *flags):
    """attention_client infer on inputs written to a .safetensors file; returns the
    tensors of its --output .safetensors (inputs sent, output, attention)."""
    path, out = tmp_path / f"{model}.in.safetensors", tmp_path / f"{model}.out.safetensors"
    write_safetensors(path, inputs)
    done = subprocess.run(
        [CLIENT, "infer", f"--target={target}", f"--model={model}", f"--input={path}",
         f"--output={out}", "--timeout=60s", "--valid_lens=none", *flags],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return read_safetensors(out)


def test_toy_equals_cpp_client(deploy_target, tmp_path):
    q, k, v = mha_serve.uniform_inputs(3, [(2, 4, 100), (2, 6, 100), (2, 6, 100)])
    lens = np.int32([3, 2])
    cpp = cpp_client_output(deploy_target, "toy", dict(queries=q, keys=k, values=v,
                                                       valid_lens=lens), tmp_path,
                            "--return_attention")
    with mha_serve.Client(deploy_target, timeout=TIMEOUT) as client:
        output, attention = client.attend(q, k, v, valid_lens=lens, model="toy",
                                          return_attention=True)
    assert output.dtype == np.float32 and output.shape == (2, 4, 100)
    assert attention.shape == (2, 5, 4, 6)
    assert max_diff(output, cpp["output"]) <= 1e-6
    assert max_diff(attention, cpp["attention"]) <= 1e-6
    assert np.all(attention[0, :, :, 3:] == 0) and np.all(attention[1, :, :, 2:] == 0)


def test_bert_base_equals_cpp_client(deploy_target, tmp_path):
    # Self-attention, one key length per query (B*Q entries), causal.
    (q,) = mha_serve.uniform_inputs(11, [(2, 24, 768)])
    lens = np.int32([24 - i % 5 for i in range(48)])
    cpp = cpp_client_output(deploy_target, "bert_base", dict(queries=q, valid_lens=lens),
                            tmp_path, "--causal")
    with mha_serve.Client(deploy_target, timeout=TIMEOUT) as client:
        output = client.attend(q, valid_lens=lens, causal=True, model="bert_base")
    assert output.shape == (2, 24, 768)
    assert max_diff(output, cpp["output"]) <= 1e-6


def test_raw_both_ways_and_data_fallback(client):
    q, k = mha_serve.uniform_inputs(5, [(1, 3, 100), (1, 4, 100)])
    request = build_request(q, k, k, valid_lens=[2], model="default", request_id="r")
    assert len(request.queries.raw) == q.size * 4 and not request.queries.data
    # attend()'s hand-serialized request is the same message.
    encoded = encode_request(q, k, k, valid_lens=[2], model="default", request_id="r")
    assert pb2.AttendRequest.FromString(encoded) == request
    response = client.call(encoded)
    assert response.request_id == "r"
    assert len(response.output.raw) == 3 * 100 * 4 and not response.output.data
    assert response.timing.compute_us > 0 and response.timing.batch_rows == 1
    expected = decode_response(response)
    assert np.array_equal(client.attend(q, k, k, valid_lens=[2]), expected)
    assert np.array_equal(decode_response_bytes(response.SerializeToString()), expected)
    # A request in `data` is answered in `data`; decoding gives the same floats.
    old = client.call(build_request(q, k, k, valid_lens=[2], raw=False))
    assert not old.output.raw and len(old.output.data) == 300
    assert np.array_equal(decode_response(old), expected)
    assert np.array_equal(decode_response_bytes(old.SerializeToString()), expected)


def test_dtypes_and_layouts_are_converted(client):
    q, k = mha_serve.uniform_inputs(6, [(2, 3, 100), (2, 5, 100)])
    expected = client.attend(q, k, k, valid_lens=[5, 1])
    fortran = np.asfortranarray(k.astype(np.float64))
    transposed = np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)
    got = client.attend(transposed, fortran, k.tolist(), valid_lens=np.int64([5, 1]))
    assert np.array_equal(got, expected)
    got[0, 0, 0] = 1.0  # answers are writable arrays


def test_head_mask(client):
    (q,) = mha_serve.uniform_inputs(8, [(1, 2, 100)])
    plain = client.attend(q)
    assert np.array_equal(client.attend(q, head_mask=np.ones(5)), plain)
    assert np.all(client.attend(q, head_mask=[0.0] * 5) == 0)  # the toy layer has no bias


def test_stream_matches_unary(client):
    q1, q2, k2 = mha_serve.uniform_inputs(9, [(1, 2, 100), (3, 4, 100), (3, 7, 100)])
    requests = [dict(queries=q1), dict(queries=q2, keys=k2, values=k2, valid_lens=[7, 3, 1],
                                       return_attention=True),
                dict(queries=q2, causal=True, model="default")]
    results = list(client.stream(iter(requests)))
    assert len(results) == 3
    assert np.array_equal(results[0], client.attend(q1))
    out, weights = results[1]
    expected_out, expected_weights = client.attend(**requests[1])
    assert np.array_equal(out, expected_out) and np.array_equal(weights, expected_weights)
    assert np.array_equal(results[2], client.attend(q2, causal=True))


def test_stream_error_after_the_answers_before_it(client):
    (q,) = mha_serve.uniform_inputs(10, [(1, 2, 100)])
    results = client.stream([dict(queries=q), dict(queries=q[..., :99]), dict(queries=q)])
    assert np.array_equal(next(results), client.attend(q))
    with pytest.raises(mha_serve.Error) as error:
        next(results)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 1" in error.value.details and "queries" in error.value.details


@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 3, 1]])
def test_session_equals_causal_attend(deploy_target, chunks):
    """A self-attention session (the decoder model: 768, 12 heads, biases) fed token by
    token or in chunks answers the rows of one causal Attend over every token, 1e-5."""
    (x,) = mha_serve.uniform_inputs(11, [(1, sum(chunks), 768)])
    with mha_serve.Client(deploy_target, timeout=TIMEOUT) as client:
        expected = client.attend(x, causal=True, model="decoder")[0]
        outputs, start = [], 0
        with client.session(model="decoder", causal=True) as session:
            for n in chunks:
                outputs.append(session.step(x[0, start:start + n]))
                start += n
                assert session.context_tokens == start
                assert session.timing.compute_us > 0
            batched = session.step(x[:, :1])  # (1, T, d) in, (1, T, p_o) out
        assert batched.shape == (1, 1, 768)
    assert max_diff(np.concatenate(outputs), expected) <= 1e-5


def test_cross_session_attends_to_every_key_appended(client):
    q, k, v = mha_serve.uniform_inputs(12, [(1, 3, 100), (1, 7, 100), (1, 7, 100)])
    with client.session(kind="cross") as session:
        appended = session.step(keys=k[0, :4], values=v[0, :4])  # append only
        assert appended.shape == (0, 100) and session.context_tokens == 4
        first = session.step(q[0])
        second = session.step(q[0], keys=k[0, 4:], values=v[0, 4:])
    assert max_diff(first, client.attend(q, k[:, :4], v[:, :4])[0]) <= 1e-5
    assert max_diff(second, client.attend(q, k, v)[0]) <= 1e-5


def test_session_errors_name_the_field_and_end_the_session(client):
    (x,) = mha_serve.uniform_inputs(13, [(1, 2, 100)])
    threads = threading.active_count()
    # An argument that cannot be sent fails before any message: the settings still go
    # with the first step that is sent (a cross session, which a self one would refuse).
    with client.session(kind="cross") as session:
        with pytest.raises(TypeError):
            session.step(keys=np.array([["a"]]), values=x[0])
        assert session.step(keys=x[0], values=x[0]).shape == (0, 100)
    session = client.session()
    session.step(x[0])
    with pytest.raises(mha_serve.Error) as error:
        session.step(x[0, :, :99])
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.rpc == "AttendSession"
    assert "step 1" in error.value.details and "queries" in error.value.details
    with pytest.raises(ValueError, match="closed"):
        session.step(x[0])
    with pytest.raises(mha_serve.Error) as error:
        with client.session(model="no_such_model") as s:
            s.step(x[0])
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    assert "no_such_model" in error.value.details
    with pytest.raises(ValueError, match="kind"):
        client.session(kind="sideways")
    # Ended sessions leave no thread behind (gRPC's thread that sends the steps).
    deadline = time.monotonic() + TIMEOUT
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads


def test_unknown_model_is_not_found(client):
    with pytest.raises(mha_serve.Error) as error:
        client.attend(np.zeros((1, 1, 100)), model="no_such_model")
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    assert "no_such_model" in error.value.details and error.value.rpc == "Attend"
    with pytest.raises(mha_serve.Error) as error:
        client.model("no_such_model")
    assert error.value.code == grpc.StatusCode.NOT_FOUND


def test_model_version_names_a_version(serve, tmp_path):
    """Numbered version folders: "" is the newest served, a number picks that one,
    another is NOT_FOUND naming model_version."""
    rng = np.random.default_rng(3)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(
        "num_hiddens: 8 num_heads: 2 version_policy { all {} }")
    for version in (1, 2):
        folder = tmp_path / "m" / str(version)
        folder.mkdir()
        write_safetensors(str(folder / "weights.safetensors"), {
            name: rng.standard_normal((8, 8)).astype(np.float32)
            for name in ("W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight")})
    target = serve(f"--model_repository={tmp_path}")
    x = rng.standard_normal((1, 3, 8)).astype(np.float32)
    with mha_serve.Client(target, timeout=TIMEOUT) as client:
        newest, one, two = (client.attend(x, model="m", model_version=v) for v in ("", "1", "2"))
        assert np.array_equal(newest, two) and not np.allclose(one, two)
        with pytest.raises(mha_serve.Error) as error:
            client.attend(x, model="m", model_version="3")
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    assert "model_version: model m serves version(s) 1, 2" in error.value.details


@pytest.mark.parametrize("kwargs, field", [
    (dict(queries=np.zeros((2, 4, 99))), "queries"),
    (dict(queries=np.zeros((2, 4))), "queries"),
    (dict(queries=np.zeros((2, 4, 100)), keys=np.zeros((2, 6, 100))), "values"),
    (dict(queries=np.zeros((2, 4, 100)), valid_lens=[3, 2, 1]), "valid_lens"),
    (dict(queries=np.zeros((2, 4, 100)), head_mask=[1.0]), "head_mask"),
])
def test_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    with pytest.raises(mha_serve.Error) as error:
        client.attend(**kwargs)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details
    assert not isinstance(error.value, grpc.RpcError)


@pytest.fixture
def refused_target():
    """127.0.0.1:PORT where nothing listens: a socket holds the port, bound but not
    listening, for the test's length, so connections are refused and no other
    process (tests run in parallel) can start listening there meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_server_down_is_unavailable(refused_target):
    target = refused_target
    with mha_serve.Client(target, timeout=TIMEOUT) as client:
        for call in (client.models, lambda: client.attend(np.zeros((1, 1, 4))),
                     lambda: list(client.stream([dict(queries=np.zeros((1, 1, 4)))])),
                     lambda: client.session().step(np.zeros((1, 4)))):
            with pytest.raises(mha_serve.Error) as error:
                call()
            assert error.value.code == grpc.StatusCode.UNAVAILABLE
            assert target in error.value.details
            assert str(error.value).startswith("UNAVAILABLE: ")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """openssl: a CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("certs")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    commands = [
        ["req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=mha-serve-test-ca"],
        ["req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "server.ext"],
        ["req", *key, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=client"],
        ["x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "client.pem", "-days", "2"],
    ]
    for command in commands:
        subprocess.run(["openssl", *command], cwd=d, check=True, capture_output=True)
    return d


def test_mutual_tls(serve, certificates):
    d = certificates
    target = serve(f"--tls_cert={d / 'server.pem'}", f"--tls_key={d / 'server.key'}",
                   f"--tls_client_ca={d / 'ca.pem'}")
    (q,) = mha_serve.uniform_inputs(12, [(1, 2, 100)])
    with mha_serve.Client(target, tls=(d / "ca.pem", d / "client.pem", d / "client.key"),
                          timeout=TIMEOUT) as client:
        assert client.attend(q).shape == (1, 2, 100)
    hints = {None: "(the server may speak TLS, this client plaintext: give --tls or --tls_ca)",
             (d / "ca.pem", None, None): "(the server may require a client certificate "
                                         "(mutual TLS): give --tls_cert and --tls_key)"}
    for tls, hint in hints.items():  # plaintext; no client certificate
        with mha_serve.Client(target, tls=tls, timeout=TIMEOUT) as client:
            with pytest.raises(mha_serve.Error) as error:
                client.attend(q)
            assert error.value.code == grpc.StatusCode.UNAVAILABLE
            assert error.value.details.endswith(hint), error.value.details
    done = subprocess.run(
        [os.path.join(VENV, "bin", "mha-serve-client"), f"--target={target}",
         f"--tls_ca={d / 'ca.pem'}", f"--tls_cert={d / 'client.pem'}",
         f"--tls_key={d / 'client.key'}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "output shape: (2, 4, 100)" in done.stdout, done.stderr
