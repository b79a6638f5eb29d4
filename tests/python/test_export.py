"""mha_serve.export and python -m mha_serve.export: modules exported (by object and
by state-dict CLI), served, and checked against PyTorch."""

import subprocess

import numpy as np
import pytest
import torch

import mha_serve
from mha_serve.safetensors import read_safetensors

from conftest import (CLIENT, TIMEOUT, D2LMultiHeadAttention, export_cli, max_diff,
                      trained_looking)

TOLERANCE = 1e-4
EXPORTS = ["mha_self", "mha_cross", "mha_nobias", "trained_cli", "trained_obj", "d2l_lazy",
           "d2l_cli", "d2l_additive"]


def local_forward(module, io):
    """The module's own answer on io.safetensors' inputs, with its own API."""
    q = torch.from_numpy(io["queries"])
    k = torch.from_numpy(io["keys"]) if "keys" in io else q
    v = torch.from_numpy(io["values"]) if "values" in io else q
    lens = torch.from_numpy(io["valid_lens"])
    with torch.no_grad():
        if isinstance(module, torch.nn.MultiheadAttention):
            padding = torch.arange(k.shape[1])[None, :] >= lens[:, None]
            if not module.batch_first:
                out, _ = module(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                key_padding_mask=padding)
                return out.transpose(0, 1)
            return module(q, k, v, key_padding_mask=padding)[0]
        return module(q, k, v, lens)


@pytest.mark.parametrize("name", EXPORTS)
def test_served_export_matches_pytorch(exported, export_target, name):
    repository, modules = exported
    io = read_safetensors(repository / name / "io.safetensors")
    assert io["valid_lens"].dtype == np.int32 and io["output"].dtype == np.float32
    expected = local_forward(modules[name], io)
    assert max_diff(io["output"], expected) <= 1e-6
    with mha_serve.Client(export_target, timeout=TIMEOUT) as client:
        got = client.attend(io["queries"], io.get("keys"), io.get("values"),
                            valid_lens=io["valid_lens"], model=name)
    assert max_diff(got, expected) <= TOLERANCE


def test_configs_and_weight_names(exported, export_target):
    repository, _ = exported
    names = {n: set(read_safetensors(repository / n / "weights.safetensors")) for n in EXPORTS}
    assert names["mha_self"] == {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                 "out_proj.bias"}
    assert names["mha_cross"] == {"q_proj_weight", "k_proj_weight", "v_proj_weight",
                                  "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    assert names["mha_nobias"] == {"in_proj_weight", "out_proj.weight"}
    assert names["d2l_cli"] == {f"W_{x}.{p}" for x in "qkvo" for p in ("weight", "bias")}
    assert names["d2l_additive"] == {"W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight",
                                     "attention.W_q.weight", "attention.W_k.weight",
                                     "attention.w_v.weight"}
    with mha_serve.Client(export_target, timeout=TIMEOUT) as client:
        info = {m.name: m for m in client.models()}
    assert set(info) == set(EXPORTS)
    lazy = info["d2l_lazy"]
    assert (lazy.num_hiddens, lazy.num_heads, lazy.query_size, lazy.key_size,
            lazy.value_size, lazy.bias) == (24, 4, 20, 12, 16, True)
    assert not info["mha_cross"].supports_self_attention and info["mha_self"].bias
    assert not info["mha_nobias"].bias
    assert (info["d2l_additive"].scoring, info["d2l_additive"].additive_hidden) == ("additive", 8)
    assert info["trained_cli"] == mha_serve.ModelInfo(**{**vars(info["trained_obj"]),
                                                         "name": "trained_cli"})


def test_cpp_client_reads_io_safetensors(exported, export_target, tmp_path):
    repository, _ = exported
    io_file = repository / "trained_cli" / "io.safetensors"
    out = tmp_path / "out.npy"
    done = subprocess.run([CLIENT, "infer", f"--target={export_target}", "--model=trained_cli",
                           f"--input={io_file}", f"--output={out}", "--timeout=60s"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert max_diff(np.load(out), read_safetensors(io_file)["output"]) <= TOLERANCE


def test_unsupported_modules_are_refused(tmp_path):
    with pytest.raises(ValueError, match="add_bias_kv"):
        mha_serve.export(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True), str(tmp_path))
    with pytest.raises(ValueError, match="add_zero_attn"):
        mha_serve.export(torch.nn.MultiheadAttention(8, 2, add_zero_attn=True), str(tmp_path))
    d2l = D2LMultiHeadAttention(8, 2, bias=True)
    d2l.W_o = torch.nn.Linear(8, 8, bias=False)
    with pytest.raises(ValueError, match="all have a bias or none"):
        mha_serve.export(d2l, str(tmp_path), input_sizes=(8, 8, 8))
    with pytest.raises(TypeError, match="cannot export Linear"):
        mha_serve.export(torch.nn.Linear(8, 8), str(tmp_path))
    with pytest.raises(ValueError, match="K = 0 .* needs d_q = d_k = d_v"):
        mha_serve.export(torch.nn.MultiheadAttention(8, 2, kdim=4), str(tmp_path),
                         sample_inputs=(1, 2, 0))
    with pytest.raises(ValueError, match="name"):
        mha_serve.export(torch.nn.MultiheadAttention(8, 2), str(tmp_path), name="../up")


def test_export_cli_errors(tmp_path):
    state = trained_looking(torch.nn.MultiheadAttention(8, 2), 0).state_dict()
    torch.save(state, tmp_path / "sd.pt")
    done = export_cli("--state-dict", str(tmp_path / "sd.pt"), "--embed-dim", "8",
                      "--num-heads", "2", "--no-bias", "--output", str(tmp_path))
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "in_proj_bias" in lines[0]
    done = export_cli("--state-dict", str(tmp_path / "sd.pt"), "--kind", "d2l", "--num-heads",
                      "2", "--output", str(tmp_path))
    assert done.returncode == 1 and "not a d2l MultiHeadAttention state dict" in done.stderr
    done = export_cli("--random", "--embed-dim", "8", "--num-heads", "2", "--output",
                      str(tmp_path), "--sample", "1,2")
    assert done.returncode == 2 and "expected B,Q,K" in done.stderr
    done = export_cli("--embed-dim", "8", "--num-heads", "2", "--output", str(tmp_path))
    assert done.returncode == 2 and "--state-dict" in done.stderr


def test_export_cli_random_module_is_reproducible(tmp_path):
    for out in ("a", "b"):
        done = export_cli("--random", "--kind", "d2l", "--embed-dim", "8", "--num-heads", "2",
                          "--kdim", "6", "--seed", "3", "--output", str(tmp_path / out),
                          "--name", "r", "--sample", "1,2,3")
        assert done.returncode == 0, done.stderr
    a = read_safetensors(tmp_path / "a" / "r" / "weights.safetensors")
    b = read_safetensors(tmp_path / "b" / "r" / "weights.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
    assert a["W_k.weight"].shape == (8, 6) and np.all(a["W_q.bias"] != 0)


class WholeModel(torch.nn.Module):
    """A model whose attention layers sit deep in its state dict: blocks.N.attn. and
    an nn.TransformerEncoder's encoder.layers.N.self_attn."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "attn": torch.nn.MultiheadAttention(16, 4, batch_first=True),
            "mlp": torch.nn.Linear(16, 16)}) for _ in range(12))
        self.encoder = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)


@pytest.fixture(scope="module")
def whole_model(tmp_path_factory):
    """A saved checkpoint ({"state_dict": ..., "epoch": ...}) of WholeModel with
    trained-looking attention weights."""
    model = WholeModel()
    for i, (_, m) in enumerate(n for n in model.named_modules()
                               if isinstance(n[1], torch.nn.MultiheadAttention)):
        trained_looking(m, 100 + i)
    path = tmp_path_factory.mktemp("checkpoint") / "model.pt"
    torch.save({"state_dict": model.state_dict(), "epoch": 7}, path)
    return model.eval(), path


def test_export_prefix_takes_one_layer_of_a_whole_checkpoint(whole_model, serve, tmp_path):
    model, path = whole_model
    repository = tmp_path / "repository"
    layers = {"block11": ("blocks.11.attn.", model.blocks[11]["attn"], 4),
              "encoder1": ("encoder.layers.1.self_attn", model.encoder.layers[1].self_attn, 2)}
    for name, (prefix, layer, heads) in layers.items():
        done = export_cli("--state-dict", str(path), "--prefix", prefix, "--embed-dim", "16",
                          "--num-heads", str(heads), "--output", str(repository), "--name", name,
                          "--sample", "2,3,5")
        assert done.returncode == 0, done.stderr
        weights = read_safetensors(repository / name / "weights.safetensors")
        state = layer.state_dict()
        assert set(weights) == set(state)
        assert all(np.array_equal(weights[n], state[n].numpy()) for n in state)
        # No name in config.pbtxt: the folder names the model.
        config = (repository / name / "config.pbtxt").read_text()
        assert not any(line.startswith("name") for line in config.splitlines()), config
    # A renamed folder serves under its new name.
    (repository / "encoder1").rename(repository / "renamed")
    target = serve(f"--model_repository={repository}")
    with mha_serve.Client(target, timeout=TIMEOUT) as client:
        assert sorted(m.name for m in client.models()) == ["block11", "renamed"]
        for name, layer in (("block11", layers["block11"][1]), ("renamed", layers["encoder1"][1])):
            io = read_safetensors(repository / name / "io.safetensors")
            expected = local_forward(layer, io)
            assert max_diff(io["output"], expected) <= 1e-6
            got = client.attend(io["queries"], io["keys"], io["values"],
                                valid_lens=io["valid_lens"], model=name)
            assert max_diff(got, expected) <= TOLERANCE


def test_export_prefix_errors_list_the_prefixes(whole_model, tmp_path):
    _, path = whole_model
    expected = ("the prefixes of its 14 layers: 'blocks.0.attn.', 'blocks.1.attn.', "
                "'blocks.2.attn.', 'blocks.3.attn.', 'blocks.4.attn.', 'blocks.5.attn.', "
                "'blocks.6.attn.', 'blocks.7.attn.', ..., 'encoder.layers.1.self_attn.' "
                "(pass one as --prefix)")
    for flags, where in (([], "no --prefix: model.pt has no nn.MultiheadAttention at its "
                              "top level; "),
                         (["--prefix", "blocks.12.attn."],
                          "--prefix 'blocks.12.attn.': model.pt has no nn.MultiheadAttention "
                          "at 'blocks.12.attn.'; ")):
        done = export_cli("--state-dict", str(path), *flags, "--embed-dim", "16",
                          "--num-heads", "4", "--output", str(tmp_path))
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.splitlines() == [f"error: {where}{expected}".replace(
            "model.pt", str(path))], done.stderr
    done = export_cli("--state-dict", str(path), "--kind", "d2l", "--prefix", "blocks.0.attn.",
                      "--num-heads", "4", "--output", str(tmp_path))
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1
    assert "is not a d2l MultiHeadAttention state dict: no W_q.weight with W_o.weight" in \
        done.stderr
    done = export_cli("--random", "--prefix", "blocks.0.attn.", "--embed-dim", "16",
                      "--num-heads", "4", "--output", str(tmp_path))
    assert done.returncode == 2 and "--prefix applies to --state-dict only" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_int8_export_serves_within_its_bound(serve, tmp_path):
    """precision="int8" (issue 37): the server quantizes the exported f32 weights at
    load, reports int8, and answers within a relative Frobenius error of 2e-2 of
    PyTorch; additive layers are refused naming the precision."""
    torch.manual_seed(5)
    module = trained_looking(torch.nn.MultiheadAttention(32, 4, batch_first=True), 5)
    folder = mha_serve.export(module, str(tmp_path), name="m8", sample_inputs=(2, 6, 0),
                              precision="int8")
    assert 'precision: "int8"' in (tmp_path / "m8" / "config.pbtxt").read_text()
    io = read_safetensors(f"{folder}/io.safetensors")
    expected = local_forward(module, io).numpy()
    with mha_serve.Client(serve(f"--model_repository={tmp_path}"), timeout=TIMEOUT) as client:
        (info,) = client.models()
        got = client.attend(io["queries"], valid_lens=io["valid_lens"], model="m8")
    assert info.precision == "int8" and info.kv_cache_precision == "f32"
    err = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert 1e-5 < err <= 2e-2, err
    d2l = D2LMultiHeadAttention(16, 2, additive_hidden=4)
    with pytest.raises(ValueError, match="precision 'int8'"):
        mha_serve.export(d2l, str(tmp_path), name="bad", input_sizes=(16, 16, 16),
                         precision="int8")
    with pytest.raises(ValueError, match="precision 'fp8'"):
        mha_serve.export(module, str(tmp_path), name="bad", precision="fp8")
