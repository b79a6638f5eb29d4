"""Fixtures of the mha_serve package tests (run by run_tests.py from a fresh venv
with the package installed): real attention_server processes on 127.0.0.1 and a
model repository of PyTorch modules exported through the package.

Environment: MHA_SERVER, MHA_CLIENT (attention_client), MHA_SOURCE_DIR, MHA_VENV.
"""

import concurrent.futures
import os
import re
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch

SOURCE = os.environ["MHA_SOURCE_DIR"]
SERVER = os.environ["MHA_SERVER"]
CLIENT = os.environ["MHA_CLIENT"]
VENV = os.environ["MHA_VENV"]
# Sanitizer builds are several times slower: generous deadlines everywhere.
TIMEOUT = 60.0

sys.path.insert(0, os.path.join(SOURCE, "tests", "integration"))
from server_harness import start_server, stop_server  # noqa: E402

import mha_serve  # noqa: E402  (the installed package: test_client checks where from)


def pytest_configure(config):
    # torch 1.13 warns on every LazyLinear; d2l's layer is made of them.
    config.addinivalue_line("filterwarnings", "ignore:Lazy modules are a new feature")


class D2LAdditiveAttention(torch.nn.Module):
    """d2l's AdditiveAttention (section 11.3): w_v . tanh(W_q q + W_k k)."""

    def __init__(self, num_hiddens):
        super().__init__()
        self.W_k = torch.nn.LazyLinear(num_hiddens, bias=False)
        self.W_q = torch.nn.LazyLinear(num_hiddens, bias=False)
        self.w_v = torch.nn.LazyLinear(1, bias=False)

    def forward(self, queries, keys, values, valid_lens):
        features = torch.tanh(self.W_q(queries).unsqueeze(2) + self.W_k(keys).unsqueeze(1))
        return d2l_pool(self.w_v(features).squeeze(-1), values, valid_lens)


class D2LDotProductAttention(torch.nn.Module):
    def forward(self, queries, keys, values, valid_lens):
        scores = queries @ keys.transpose(1, 2) / queries.shape[-1] ** 0.5
        return d2l_pool(scores, values, valid_lens)


def d2l_pool(scores, values, valid_lens):
    """d2l's masked_softmax (masked scores set to -1e6) then the weighted sum."""
    if valid_lens is not None:
        lens = valid_lens if valid_lens.dim() == 2 else valid_lens[:, None].expand(
            -1, scores.shape[1])
        mask = torch.arange(scores.shape[2])[None, None, :] < lens[:, :, None]
        scores = scores.masked_fill(~mask, -1e6)
    return torch.softmax(scores, dim=-1) @ values


class D2LMultiHeadAttention(torch.nn.Module):
    """d2l's MultiHeadAttention (section 11.5), LazyLinear layers and all, written
    here because d2l is not a Debian package."""

    def __init__(self, num_hiddens, num_heads, bias=False, additive_hidden=0):
        super().__init__()
        self.num_heads = num_heads
        self.attention = (D2LAdditiveAttention(additive_hidden) if additive_hidden
                          else D2LDotProductAttention())
        self.W_q = torch.nn.LazyLinear(num_hiddens, bias=bias)
        self.W_k = torch.nn.LazyLinear(num_hiddens, bias=bias)
        self.W_v = torch.nn.LazyLinear(num_hiddens, bias=bias)
        self.W_o = torch.nn.LazyLinear(num_hiddens, bias=bias)

    def transpose_qkv(self, x):
        x = x.reshape(x.shape[0], x.shape[1], self.num_heads, -1).permute(0, 2, 1, 3)
        return x.reshape(-1, x.shape[2], x.shape[3])

    def transpose_output(self, x):
        x = x.reshape(-1, self.num_heads, x.shape[1], x.shape[2]).permute(0, 2, 1, 3)
        return x.reshape(x.shape[0], x.shape[1], -1)

    def forward(self, queries, keys, values, valid_lens):
        queries = self.transpose_qkv(self.W_q(queries))
        keys = self.transpose_qkv(self.W_k(keys))
        values = self.transpose_qkv(self.W_v(values))
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(queries, keys, values, valid_lens)
        return self.W_o(self.transpose_output(output))


def trained_looking(module, seed):
    """Random weights and non-zero biases, as a trained layer has."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.5 if "bias" in name else 1.0 / p.shape[-1] ** 0.5
            p.copy_((torch.rand(p.shape, generator=generator) * 2 - 1) * scale)
    return module.eval()


def export_cli(*args):
    """python -m mha_serve.export from the venv; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "mha_serve.export", *args],
                          capture_output=True, text=True, timeout=120)


# target -> the /metrics port of the server serve() started there.
METRICS_PORTS = {}
REQUESTS_TOTAL = re.compile(r'^mha_requests_total\{([^}]*)\} (\S+)$', re.M)


def requests_total(target, model=None, code="OK"):
    """The server's mha_requests_total for attention.v1 requests answered with `code`
    (of `model`, or of every model), read from its Prometheus /metrics."""
    port = METRICS_PORTS[target]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as f:
        text = f.read().decode()
    total = 0.0
    for labels, value in REQUESTS_TOTAL.findall(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if (labels.get("protocol") == "attention_v1" and labels.get("code") == code
                and model in (None, labels.get("model"))):
            total += float(value)
    return int(total)


@pytest.fixture(scope="session")
def serve():
    """serve(*flags) -> "127.0.0.1:PORT" of a fresh server (its /metrics port in
    METRICS_PORTS); all stop cleanly (exit 0) at the end of the session."""
    started = []

    def start(*flags):
        proc, target = start_server(SERVER, list(flags), timeout=TIMEOUT)
        started.append(proc)
        METRICS_PORTS[target] = proc.metrics_port
        return target

    yield start
    with concurrent.futures.ThreadPoolExecutor(max(1, len(started))) as pool:
        codes = list(pool.map(lambda proc: stop_server(proc, timeout=TIMEOUT), started))
    assert codes == [0] * len(codes), f"server exit codes {codes}"


@pytest.fixture(scope="session")
def default_target(serve):
    """The embedded toy model, "default"."""
    return serve()


@pytest.fixture(scope="session")
def deploy_target(serve):
    """deploy/models: toy, bert_base and decoder."""
    return serve(f"--model_repository={os.path.join(SOURCE, 'deploy', 'models')}")


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """PyTorch modules exported through the package into one repository:
    name -> local module (its io.safetensors holds PyTorch's answer)."""
    repository = tmp_path_factory.mktemp("repository")
    files = tmp_path_factory.mktemp("state_dicts")
    torch.manual_seed(0)
    modules = {
        # packed in_proj_weight, self-attention
        "mha_self": trained_looking(torch.nn.MultiheadAttention(32, 4, batch_first=True), 1),
        # kdim/vdim differ: q/k/v_proj_weight
        "mha_cross": trained_looking(torch.nn.MultiheadAttention(
            24, 3, kdim=16, vdim=20, batch_first=True), 2),
        # no bias, batch_first=False
        "mha_nobias": trained_looking(torch.nn.MultiheadAttention(16, 2, bias=False), 3),
    }
    samples = {"mha_self": (2, 5, 0), "mha_cross": (2, 5, 7), "mha_nobias": (3, 4, 6)}
    for name, module in modules.items():
        mha_serve.export(module, str(repository), name=name, sample_inputs=samples[name])

    # The same trained-looking module by state-dict CLI and by module object.
    trained = trained_looking(torch.nn.MultiheadAttention(32, 4, kdim=24, vdim=16,
                                                          batch_first=True), 4)
    torch.save(trained.state_dict(), files / "trained.pt")
    done = export_cli("--state-dict", str(files / "trained.pt"), "--embed-dim", "32",
                      "--num-heads", "4", "--kdim", "24", "--vdim", "16", "--name", "trained_cli",
                      "--output", str(repository), "--sample", "2,6,5", "--seed", "7")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"exported {repository / 'trained_cli'}: p_o 32, h 4, d_q 32, "
                                  "d_k 24, d_v 16, bias on"), done.stdout
    mha_serve.export(trained, str(repository), name="trained_obj", sample_inputs=(2, 6, 5), seed=7)
    modules["trained_cli"] = modules["trained_obj"] = trained

    # d2l: LazyLinear layers materialised by the exporter (d_q 20, d_k 12, d_v 16).
    lazy = D2LMultiHeadAttention(24, 4, bias=True)
    mha_serve.export(lazy, str(repository), name="d2l_lazy", sample_inputs=(2, 4, 6),
                     input_sizes=(20, 12, 16))
    modules["d2l_lazy"] = lazy.eval()
    # A trained-looking d2l layer by state-dict CLI.
    d2l = D2LMultiHeadAttention(24, 4, bias=True)
    d2l(torch.zeros(1, 1, 24), torch.zeros(1, 1, 8), torch.zeros(1, 1, 12), None)
    torch.save(trained_looking(d2l, 5).state_dict(), files / "d2l.pt")
    done = export_cli("--state-dict", str(files / "d2l.pt"), "--kind", "d2l", "--num-heads", "4",
                      "--name", "d2l_cli", "--output", str(repository), "--sample", "2,4,6")
    assert done.returncode == 0, done.stderr
    modules["d2l_cli"] = d2l
    # d2l's AdditiveAttention as the pooling: scoring ADDITIVE.
    additive = D2LMultiHeadAttention(16, 2, bias=False, additive_hidden=8)
    mha_serve.export(additive, str(repository), name="d2l_additive", sample_inputs=(2, 3, 5))
    modules["d2l_additive"] = additive.eval()
    return repository, modules


@pytest.fixture(scope="session")
def export_target(serve, exported):
    return serve(f"--model_repository={exported[0]}")


@pytest.fixture
def client(default_target):
    with mha_serve.Client(default_target, timeout=TIMEOUT) as c:
        yield c


def max_diff(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shapes {a.shape} and {b.shape}"
    return float(np.max(np.abs(a - b))) if a.size else 0.0
