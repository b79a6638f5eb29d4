"""mha-serve-client / python -m mha_serve against real servers: output, the shared
SplitMix64 inputs, exit codes and one-line errors."""

import os
import re
import subprocess
import sys

import numpy as np

import mha_serve

from conftest import CLIENT, TIMEOUT, VENV
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
    line = one_line_error(run(f"--target={deploy_target}", "--model=toy", "--valid_lens=1,2,3"),
                          1, "INVALID_ARGUMENT: Attend: ")
    assert "valid_lens" in line


def test_usage_errors_exit_2(default_target):
    for flags in (["--batch=x"], ["--valid_lens=a,b"], ["--batch=0"], ["--tls_cert=c.pem"],
                  ["--output=out.txt"]):
        done = run(f"--target={default_target}", *flags)
        assert done.returncode == 2, (flags, done.stderr)
        assert "Traceback" not in done.stderr and "error:" in done.stderr.splitlines()[-1]


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
