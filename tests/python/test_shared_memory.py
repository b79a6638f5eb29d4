"""mha_serve.SharedMemoryClient against a real attention_server --shared_memory=system:
answers equal to Client.attend's (to 1e-6), the region's life (unlinked from /dev/shm
right after registering, unregistered on close, replaced when a request outgrows it,
nothing left by a killed client), and the server's errors as mha_serve.Error with the
server still serving. The server's view is read with the package's own KServe stubs
(SystemSharedMemoryStatus), not through SharedMemoryClient."""

import os
import signal
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest

import mha_serve
import mha_serve.shared_memory
from mha_serve._proto import grpc_service_pb2 as kserve
from mha_serve._proto import grpc_service_pb2_grpc as kserve_grpc

from conftest import TIMEOUT, max_diff

TOLERANCE = 1e-6
D, P_O, HEADS = 100, 100, 5   # the embedded toy model "default"


@pytest.fixture(scope="module")
def shm_target(serve):
    return serve("--shared_memory=system")


@pytest.fixture
def inference(shm_target):
    """The server's KServe stub, for SystemSharedMemoryStatus and Unregister."""
    channel = grpc.insecure_channel(shm_target)
    yield kserve_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


@pytest.fixture
def client(shm_target):
    with mha_serve.Client(shm_target, timeout=TIMEOUT) as c:
        yield c


def regions(inference):
    """name -> (key, offset, byte_size) of every region the server has registered."""
    status = inference.SystemSharedMemoryStatus(kserve.SystemSharedMemoryStatusRequest(),
                                                timeout=TIMEOUT)
    return {name: (r.key, r.offset, r.byte_size) for name, r in status.regions.items()}


def uniform(seed, *shape):
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape).astype(np.float32)


@pytest.fixture
def created(monkeypatch):
    """The names of the regions mha_serve.shared_memory creates during the test."""
    names = []
    original = mha_serve.shared_memory.shared_memory.SharedMemory

    def recording(*args, **kwargs):
        shm = original(*args, **kwargs)
        names.append(shm.name)
        return shm

    monkeypatch.setattr(mha_serve.shared_memory.shared_memory, "SharedMemory", recording)
    return names


def test_kserve_stubs_installed_with_the_package():
    package = os.path.dirname(os.path.realpath(mha_serve.__file__))
    for stub in ("grpc_service_pb2.py", "grpc_service_pb2_grpc.py", "model_config_pb2.py"):
        assert os.path.isfile(os.path.join(package, "_proto", stub))
    assert os.path.dirname(os.path.realpath(kserve.__file__)) == os.path.join(package, "_proto")
    assert kserve.SystemSharedMemoryRegisterRequest.DESCRIPTOR.full_name == \
        "inference.SystemSharedMemoryRegisterRequest"


def test_self_attention_equals_attend(client, inference):
    q = uniform(1, 2, 4, D)
    with client.shared_memory() as shm:
        for kwargs in (dict(), dict(valid_lens=[3, 2]), dict(causal=True),
                       dict(valid_lens=[1, 2, 3, 4, 4, 3, 2, 1])):
            expected = client.attend(q, **kwargs)
            out = shm.attend(q, **kwargs)
            assert out.dtype == np.float32 and out.shape == (2, 4, P_O)
            assert max_diff(out, expected) <= TOLERANCE, kwargs
        expected, weights = client.attend(q, valid_lens=[3, 2], causal=True,
                                          return_attention=True)
        out, got = shm.attend(q, valid_lens=[3, 2], causal=True, return_attention=True)
        assert got.shape == (2, HEADS, 4, 4)
        assert max_diff(out, expected) <= TOLERANCE
        assert max_diff(got, weights) <= TOLERANCE
        assert list(regions(inference)) == [shm.name]
    assert regions(inference) == {}


def test_cross_attention_with_valid_lens_equals_attend(client, inference):
    q, k, v = uniform(2, 2, 4, D), uniform(3, 2, 6, D), uniform(4, 2, 6, D)
    lens_per_query = [6, 5, 4, 3, 1, 2, 0, 6]
    with mha_serve.SharedMemoryClient(client.target, timeout=TIMEOUT) as shm:
        for lens in ([3, 2], lens_per_query):
            expected, weights = client.attend(q, k, v, valid_lens=lens, return_attention=True)
            out, got = shm.attend(q, k, v, valid_lens=lens, return_attention=True)
            assert out.shape == (2, 4, P_O) and got.shape == (2, HEADS, 4, 6)
            assert max_diff(out, expected) <= TOLERANCE
            assert max_diff(got, weights) <= TOLERANCE
            per_query = np.broadcast_to(np.reshape(lens, (2, -1)), (2, 4))
            for b, i in np.ndindex(2, 4):   # keys past a query's valid_len get no weight
                assert np.all(got[b, :, i, per_query[b, i] or 6:] == 0)
        head_mask = [1.0, 0.0, 1.0, 0.5, 1.0]
        expected = client.attend(q, k, v, valid_lens=[3, 2], head_mask=head_mask)
        assert max_diff(shm.attend(q, k, v, valid_lens=[3, 2], head_mask=head_mask),
                        expected) <= TOLERANCE
        # Any real dtype and layout is converted while written into the region.
        out = shm.attend(q.astype(np.float64), np.asfortranarray(k), v.astype(np.float16),
                         valid_lens=np.array([3, 2], dtype=np.int64))
        expected = client.attend(q, k, v.astype(np.float16), valid_lens=[3, 2])
        assert max_diff(out, expected) <= TOLERANCE
        # A second answer does not alias the first: both are copies out of the region.
        first = shm.attend(q, k, v)
        second = shm.attend(q * 0.5, k, v)
        assert max_diff(first, client.attend(q, k, v)) <= TOLERANCE
        assert max_diff(second, client.attend(q * 0.5, k, v)) <= TOLERANCE
    assert regions(inference) == {}


def test_region_unlinked_after_register_and_unregistered_on_close(client, inference, created):
    shm = mha_serve.SharedMemoryClient(client, byte_size=1 << 16)
    try:
        # Registered under its name and key, and already gone from /dev/shm.
        assert shm.name and shm.key == "/" + shm.name and shm.byte_size == 1 << 16
        assert created == [shm.name]
        assert not os.path.exists(f"/dev/shm/{shm.name}")
        assert regions(inference) == {shm.name: (shm.key, 0, 1 << 16)}
        q = uniform(5, 2, 4, D)
        assert max_diff(shm.attend(q), client.attend(q)) <= TOLERANCE

        # A request bigger than the region replaces it: the old one unregistered, the
        # new one registered and unlinked.
        big = uniform(6, 8, 64, D)
        out = shm.attend(big)
        assert max_diff(out, client.attend(big)) <= TOLERANCE
        assert len(created) == 2 and shm.name == created[1]
        assert shm.byte_size == 2 * 8 * 64 * D * 4
        assert regions(inference) == {shm.name: (shm.key, 0, shm.byte_size)}
        assert not os.path.exists(f"/dev/shm/{shm.name}")
    finally:
        shm.close()
    assert regions(inference) == {}
    shm.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        shm.attend(uniform(5, 2, 4, D))
    # The client it was made from stays open.
    assert client.attend(uniform(5, 1, 2, D)).shape == (1, 2, P_O)
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in created)


def run_python(code, **kwargs):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, **kwargs)


def test_no_warning_and_nothing_left_at_exit(shm_target, inference):
    """A process that uses a region and exits (closing it, or not) leaves no file and
    multiprocessing's resource_tracker has nothing to warn about."""
    done = run_python(f"""
        import numpy as np, mha_serve
        shm = mha_serve.SharedMemoryClient("{shm_target}")
        shm.attend(np.ones((1, 2, {D}), np.float32))
        print(shm.name, flush=True)
        shm.close()
        forgotten = mha_serve.SharedMemoryClient("{shm_target}", byte_size=4096)
        print(forgotten.name, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    closed, forgotten = done.stdout.split()
    assert not os.path.exists(f"/dev/shm/{closed}")
    assert not os.path.exists(f"/dev/shm/{forgotten}")
    # Never closed: the server keeps the region (its descriptor) until unregistered.
    assert list(regions(inference)) == [forgotten]
    inference.SystemSharedMemoryUnregister(
        kserve.SystemSharedMemoryUnregisterRequest(name=forgotten), timeout=TIMEOUT)
    assert regions(inference) == {}


def test_killed_client_leaves_nothing_in_dev_shm(shm_target, inference):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time, numpy as np, mha_serve
        shm = mha_serve.SharedMemoryClient("{shm_target}")
        shm.attend(np.ones((1, 2, {D}), np.float32))
        print(shm.name, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name, proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT)
    assert not os.path.exists(f"/dev/shm/{name}")
    assert list(regions(inference)) == [name]
    inference.SystemSharedMemoryUnregister(
        kserve.SystemSharedMemoryUnregisterRequest(name=""), timeout=TIMEOUT)
    assert regions(inference) == {}


@pytest.mark.parametrize("kwargs, field", [
    (dict(queries=uniform(7, 2, 4, D - 1)), "queries"),
    (dict(queries=uniform(7, 2, 4, D), keys=uniform(8, 2, 6, D)), "values"),
    (dict(queries=uniform(7, 2, 4, D), valid_lens=[9, 9]), "valid_lens"),
])
def test_server_error_is_an_error_and_the_server_keeps_serving(client, inference, kwargs,
                                                                field):
    q = uniform(9, 2, 4, D)
    with client.shared_memory() as shm:
        with pytest.raises(mha_serve.Error) as caught:
            shm.attend(**kwargs)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.rpc == "ModelInfer"
        assert field in caught.value.details
        assert str(caught.value).startswith("INVALID_ARGUMENT: ModelInfer: ")
        # The same region serves the next request, and the server everyone.
        assert max_diff(shm.attend(q), client.attend(q)) <= TOLERANCE
        assert list(regions(inference)) == [shm.name]
    assert regions(inference) == {}


def test_refused_before_any_call(client, inference, created):
    """What cannot be placed or sent raises before any call (no region is made);
    empty valid_lens mean none, as in attention.v1."""
    with client.shared_memory() as shm:
        with pytest.raises(ValueError, match=r"queries: expected \(B, Q, d_q\)"):
            shm.attend(uniform(9, 4, D))
        with pytest.raises(TypeError, match="keys"):
            shm.attend(uniform(9, 1, 2, D), np.array([["a"]]), uniform(9, 1, 1, D))
        with pytest.raises(TypeError, match="valid_lens"):
            shm.attend(uniform(9, 1, 2, D), valid_lens=[1.5])
        assert created == []
        q = uniform(10, 2, 3, D)
        assert max_diff(shm.attend(q, valid_lens=[]), client.attend(q)) <= TOLERANCE
    assert regions(inference) == {}


def test_a_call_past_its_deadline_drops_the_region(client, inference, created):
    """The request may still run at the server and write into the region: the next
    request gets a new one. (A request that computes for tens of milliseconds against a
    1 ms deadline: gRPC's timers are too coarse to fail a quicker call reliably.)"""
    q = uniform(11, 32, 256, D)
    with client.shared_memory() as shm:
        shm.attend(q)
        first = shm.name
        with pytest.raises(mha_serve.Error) as caught:
            shm.attend(q, timeout=1e-3)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert shm.name == "" and regions(inference) == {}
        assert max_diff(shm.attend(q), client.attend(q)) <= TOLERANCE
        assert shm.name != first and created == [first, shm.name]
        assert list(regions(inference)) == [shm.name]
    assert regions(inference) == {}


def test_unknown_model_is_not_found(client, inference):
    with client.shared_memory() as shm:
        with pytest.raises(mha_serve.Error) as caught:
            shm.attend(uniform(9, 1, 2, D), model="nope")
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
        assert "nope" in caught.value.details
    assert regions(inference) == {}


def test_server_without_shared_memory_is_unimplemented(default_target, created):
    """--shared_memory=none (the default): the register fails with the server's
    UNIMPLEMENTED, and the region made for it is unlinked all the same."""
    with mha_serve.Client(default_target, timeout=TIMEOUT) as client:
        shm = client.shared_memory()
        with pytest.raises(mha_serve.Error) as caught:
            shm.attend(uniform(9, 1, 2, D))
        assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert caught.value.rpc == "SystemSharedMemoryRegister"
        assert "--shared_memory=system" in caught.value.details
        assert len(created) == 1 and not os.path.exists(f"/dev/shm/{created[0]}")
        assert shm.name == ""
        shm.close()
        assert client.attend(uniform(9, 1, 2, D)).shape == (1, 2, P_O)
