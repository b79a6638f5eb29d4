"""mha-serve-client / python -m mha_serve against real servers: output, the shared
SplitMix64 inputs, exit codes and one-line errors."""

import os
import re
import subprocess
import sys

import numpy as np

import mha_serve

from conftest import CLIENT, SOURCE, TIMEOUT, VENV, requests_total
from test_client import refused_target  # noqa: F401 (a fixture)

ROW = re.compile(r"^\[(\d+), (\d+), :4\] =( [+-]\d\.\d{5}){4}$")


def run(*args, env=None, module=False):
    command = ([sys.executable, "-m", "mha_serve"] if module
               else [os.path.join(VENV, "bin", "mha-serve-client")])
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120,
                          env=env)


def splitmix64(seed, count):
    """The inputs' generator written out with Python integers, one draw at a time."""
    state, draws = seed, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) % 2**64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        draws.append(z ^ (z >> 31))
    return draws


def splitmix64_floats(seed, count):
    return np.array([(z >> 11) * 2.0**-53 * 2.0 - 1.0 for z in splitmix64(seed, count)],
                    dtype=np.float32)


def test_default_request_prints_rows_of_the_splitmix_inputs(default_target, tmp_path):
    out = tmp_path / "out.npy"
    done = run(f"--target={default_target}", f"--output={out}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "model default: p_o 100, h 5, d_q 100, d_k 100, d_v 100"
    assert lines[1] == "output shape: (2, 4, 100)"
    rows = lines[2:10]
    assert all(ROW.match(line) for line in rows), rows
    assert [line[:12] for line in rows] == [f"[{b}, {q}, :4] =" for b in range(2) for q in range(4)]
    # Same inputs as an independent SplitMix64 (checked against base/splitmix64.h's
    # documented first draws of seed 0): queries, then keys, then values.
    assert splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    flat = splitmix64_floats(0, 800 + 1200 + 1200)
    q, k, v = flat[:800].reshape(2, 4, 100), flat[800:2000].reshape(2, 6, 100), \
        flat[2000:].reshape(2, 6, 100)
    for got, want in zip((q, k, v), mha_serve.uniform_inputs(0, [q.shape, k.shape, v.shape])):
        assert np.array_equal(got, want)
    with mha_serve.Client(default_target, timeout=TIMEOUT) as client:
        output = client.attend(q, k, v, valid_lens=[3, 2])
    assert rows == [f"[{b}, {i}, :4] =" + "".join(" %+.5f" % x for x in output[b, i, :4])
                    for b in range(2) for i in range(4)]
    assert np.array_equal(np.load(out), output)
    assert lines[10].startswith("timing: queue ") and done.stderr == ""


def test_any_model_sizes_from_get_model(deploy_target):
    done = run(f"--target={deploy_target}", "--model=bert_base", module=True)
    assert done.returncode == 0, done.stderr
    assert "output shape: (2, 4, 768)" in done.stdout.splitlines()
    done = run(f"--target={deploy_target}", "--model=bert_base", "--batch=3", "--num_queries=5",
               "--num_keys=0", "--valid_lens=none", "--causal", "--return_attention")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "output shape: (3, 5, 768)" in lines and "attention shape: (3, 12, 5, 5)" in lines
    assert sum(bool(ROW.match(line)) for line in lines) == 8  # at most 8 rows


def one_line_error(done, code, status):
    assert done.returncode == code, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {status}"), done.stderr
    return lines[0]


def test_several_models_and_no_model_names_them(deploy_target):
    line = one_line_error(run(f"--target={deploy_target}"), 2, "INVALID_ARGUMENT: ")
    assert "--model=" in line and "bert_base, decoder, toy" in line


def test_server_down_is_one_unavailable_line(refused_target):
    target = refused_target
    line = one_line_error(run(f"--target={target}"), 1, "UNAVAILABLE: GetModel: ")
    assert target in line


def test_rpc_errors_exit_1(deploy_target):
    line = one_line_error(run(f"--target={deploy_target}", "--model=nope"), 1, "NOT_FOUND: ")
    assert "nope" in line


def test_usage_errors_exit_2(default_target):
    before = requests_total(default_target, code="INVALID_ARGUMENT")
    for flags, names in (
            (["--batch=x"], "--batch"), (["--valid_lens=a,b"], "--valid_lens"),
            (["--batch=0"], "--batch"), (["--tls_cert=c.pem"], "--tls_cert"),
            (["--output=out.txt"], "--output"),
            # checked before any call, not left to the server's INVALID_ARGUMENT
            (["--valid_lens=1,2,3"], "--valid_lens: expected B = 2 or B*Q = 8 lengths, got 3"),
            (["--valid_lens=7,2"], "--valid_lens: expected lengths 0 <= n <= K = 6, got 7"),
            (["--batch=3", "--num_keys=0", "--valid_lens=3,4,9"], "<= K = 4, got 9"),
            (["--timeout=5x"], "--timeout: expected a duration > 0"),
            (["--timeout=0s"], "--timeout: expected a duration > 0"),
            (["--duration=5s"], "unrecognized arguments: --duration=5s")):  # a bench flag
        done = run(f"--target={default_target}", *flags)
        assert done.returncode == 2, (flags, done.stderr)
        assert "Traceback" not in done.stderr and done.stdout == ""
        last = done.stderr.splitlines()[-1]
        assert last.startswith("mha-serve-client: error: ") and names in last, (flags, last)
    assert requests_total(default_target, code="INVALID_ARGUMENT") == before


def test_valid_lens_default_is_the_toy_requests_only(default_target):
    """3,2 for the toy sizes; other sizes send no valid_lens unless given."""
    for flags, shape, valid_lens in ((["--batch=8"], (8, 4, 100), None),
                                     (["--num_keys=2"], (2, 4, 100), None),
                                     (["--num_queries=3", "--valid_lens=1,2"], (2, 3, 100), [1, 2]),
                                     ([], (2, 4, 100), [3, 2])):
        done = run(f"--target={default_target}", *flags)
        assert done.returncode == 0, (flags, done.stderr)
        assert f"output shape: {shape}".replace(",)", ")") in done.stdout.splitlines()
        b, q, _ = shape
        k = int(next((f.split("=")[1] for f in flags if f.startswith("--num_keys")), 6))
        inputs = mha_serve.uniform_inputs(0, [(b, q, 100), (b, k, 100), (b, k, 100)])
        with mha_serve.Client(default_target, timeout=TIMEOUT) as client:
            output = client.attend(*inputs, valid_lens=valid_lens)
        assert rows(done.stdout) == [
            f"[{i // q}, {i % q}, :4] =" + "".join(" %+.5f" % x for x in output[i // q, i % q, :4])
            for i in range(min(8, b * q))], flags


def test_timeout_takes_durations(default_target):
    from mha_serve.cli import parse_duration
    assert [parse_duration(t) for t in ("10s", "500ms", "2m", "1h", "250us", "1.5", ".5s")] == \
        [10.0, 0.5, 120.0, 3600.0, 250e-6, 1.5, 0.5]
    for timeout in ("30s", "2m", "60"):
        done = run(f"--target={default_target}", f"--timeout={timeout}")
        assert done.returncode == 0, (timeout, done.stderr)
    # a deadline too short for any answer: DEADLINE_EXCEEDED, a failed call (exit 1).
    # gRPC rounds a deadline up to its next millisecond, and the toy request's two calls
    # (GetModel, Attend) were once answered within it (1 run in 60 on loopback): the
    # request here (B 8, Q = K = 256: 2.5 MB of inputs), answered with the default
    # deadline first, cannot be answered in a millisecond.
    big = ("--batch=8", "--num_queries=256", "--num_keys=256")
    assert run(f"--target={default_target}", *big).returncode == 0
    one_line_error(run(f"--target={default_target}", *big, "--timeout=1ns"), 1,
                   "DEADLINE_EXCEEDED: ")


def project_version():
    """The version in the top CMakeLists.txt's project(... VERSION x.y.z ...)."""
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        return re.search(r"^project\(mha_serve VERSION (\S+) ", f.read(), re.M).group(1)


def test_version_and_help_exit_0():
    version = project_version()
    assert mha_serve.__version__ == version
    for done, prog in ((run("--version"), "mha-serve-client"),
                       (run("--version", module=True), "mha-serve-client"),
                       (subprocess.run([sys.executable, "-m", "mha_serve.export", "--version"],
                                       capture_output=True, text=True, timeout=120),
                        "mha_serve.export")):
        assert (done.returncode, done.stdout, done.stderr) == (0, f"{prog} {version} (python)\n",
                                                              "")
    done = run("--help")
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("usage: mha-serve-client ") and "--timeout TIMEOUT" in done.stdout
    assert VENV not in done.stdout and SOURCE not in done.stdout


def test_missing_grpc_is_a_one_line_hint(tmp_path):
    fake = tmp_path / "grpc"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ImportError(\"No module named 'grpc'\", name='grpc')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    line = one_line_error(run("--target=127.0.0.1:1", env=env, module=True), 1, "cannot import")
    assert "python3-grpcio" in line and "/usr/bin/python3" in line


def rows(text):
    return [line for line in text.splitlines() if ROW.match(line)]


def test_same_rows_as_the_cpp_client(deploy_target):
    # Same flags, same SplitMix64 inputs, same rows: toy cross-attention by default,
    # bert_base self-attention with another seed, per-query lengths and causal.
    for flags in (["--model=toy"],
                  ["--model=bert_base", "--seed=5", "--batch=3", "--num_queries=3",
                   "--num_keys=0", "--valid_lens=3,2,1,1,2,3,3,3,3", "--causal"]):
        ours = run(f"--target={deploy_target}", *flags)
        cpp = subprocess.run([CLIENT, "infer", f"--target={deploy_target}", "--timeout=60s",
                              *flags], capture_output=True, text=True, timeout=120)
        assert ours.returncode == 0 and cpp.returncode == 0, (ours.stderr, cpp.stderr)
        assert len(rows(ours.stdout)) == 8 and rows(ours.stdout) == rows(cpp.stdout)
