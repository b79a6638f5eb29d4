"""mha_serve.RemoteMultiheadAttention against a local nn.MultiheadAttention holding
the same weights (exported through the package, served from a temp repository)."""

import numpy as np
import pytest
import torch

import mha_serve
from mha_serve.client import pb2

from conftest import TIMEOUT, max_diff

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def remote(export_target):
    made = []

    def make(model):
        made.append(mha_serve.RemoteMultiheadAttention(export_target, model=model,
                                                       timeout=TIMEOUT))
        return made[-1]

    yield make
    for module in made:
        module.close()


def inputs(seed, *shapes):
    return [torch.from_numpy(a.copy()) for a in mha_serve.uniform_inputs(seed, shapes)]


def check(remote_result, local_result):
    (out_r, w_r), (out_l, w_l) = remote_result, local_result
    assert out_r.dtype == out_l.dtype
    assert max_diff(out_r, out_l) <= TOLERANCE
    assert (w_r is None) == (w_l is None)
    if w_l is not None:
        assert max_diff(w_r, w_l) <= TOLERANCE


def test_sizes_from_get_model(remote):
    attn = remote("mha_cross")
    assert (attn.embed_dim, attn.num_heads, attn.kdim, attn.vdim) == (24, 3, 16, 20)
    assert attn.batch_first and not list(attn.parameters())


@pytest.mark.parametrize("average", [True, False])
def test_self_attention_with_weights(remote, exported, average):
    local, attn = exported[1]["mha_self"], remote("mha_self")
    (x,) = inputs(1, (2, 5, 32))
    with torch.no_grad():
        expected = local(x, x, x, average_attn_weights=average)
    got = attn(x, x, x, average_attn_weights=average)
    assert got[1].shape == ((2, 5, 5) if average else (2, 4, 5, 5))
    check(got, expected)


def test_cross_attention_kdim_vdim(remote, exported):
    local, attn = exported[1]["mha_cross"], remote("mha_cross")
    q, k, v = inputs(2, (3, 4, 24), (3, 7, 16), (3, 7, 20))
    with torch.no_grad():
        expected = local(q, k, v, need_weights=False)
    check(attn(q, k, v, need_weights=False), expected)
    with torch.no_grad():
        expected = local(q, k, v)
    check(attn(q, k, v), expected)


def test_key_padding_mask_bool_and_float(remote, exported):
    local, attn = exported[1]["mha_cross"], remote("mha_cross")
    q, k, v = inputs(3, (2, 4, 24), (2, 7, 16), (2, 7, 20))
    padding = torch.arange(7)[None, :] >= torch.tensor([7, 3])[:, None]
    with torch.no_grad():
        expected = local(q, k, v, key_padding_mask=padding)
    check(attn(q, k, v, key_padding_mask=padding), expected)
    float_padding = torch.zeros(2, 7).masked_fill(padding, float("-inf"))
    check(attn(q, k, v, key_padding_mask=float_padding), expected)


def test_causal_attn_mask_with_padding(remote, exported):
    local, attn = exported[1]["mha_self"], remote("mha_self")
    (x,) = inputs(4, (2, 6, 32))
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    padding = torch.arange(6)[None, :] >= torch.tensor([6, 4])[:, None]
    with torch.no_grad():
        expected = local(x, x, x, key_padding_mask=padding, attn_mask=causal,
                         average_attn_weights=False)
    check(attn(x, x, x, key_padding_mask=padding, attn_mask=causal, average_attn_weights=False),
          expected)
    float_causal = torch.zeros(6, 6).masked_fill(causal, float("-inf"))
    check(attn(x, x, x, key_padding_mask=padding, attn_mask=float_causal,
               average_attn_weights=False), expected)
    per_head = causal.expand(2 * 4, 6, 6)
    check(attn(x, x, x, key_padding_mask=padding, attn_mask=per_head,
               average_attn_weights=False), expected)
    with torch.no_grad():
        expected = local(x, x, x, attn_mask=causal)
    check(attn(x, x, x, is_causal=True), expected)


def test_unbatched_input(remote, exported):
    local, attn = exported[1]["mha_self"], remote("mha_self")
    (x,) = inputs(5, (5, 32))
    with torch.no_grad():
        expected = local(x, x, x)
    got = attn(x, x, x)
    assert got[0].shape == (5, 32) and got[1].shape == (5, 5)
    check(got, expected)


def test_self_attention_is_sent_without_keys(remote):
    attn = remote("mha_self")
    sent = []
    call = attn.client.call_bytes
    attn.client.call_bytes = lambda request, timeout=None: sent.append(request) or call(request)
    x, other = inputs(6, (1, 3, 32), (1, 3, 32))
    same_storage = x.view(1, 3, 32)
    out_self = attn(x, same_storage, x, need_weights=False)[0]
    out_copy = attn(x, x.clone(), x.clone(), need_weights=False)[0]
    attn(x, other, other, need_weights=False)
    sent = [pb2.AttendRequest.FromString(r) for r in sent]
    assert [r.HasField("keys") for r in sent] == [False, True, True]
    assert max_diff(out_self, out_copy) <= 1e-6


def test_fully_masked_row_is_zero_context_not_nan(remote, exported):
    local, attn = exported[1]["mha_self"], remote("mha_self")
    (x,) = inputs(7, (2, 3, 32))
    padding = torch.tensor([[False, False, True], [True, True, True]])
    got, _ = attn(x, x, x, key_padding_mask=padding)
    with torch.no_grad():
        expected, _ = local(x, x, x, key_padding_mask=padding)
    assert max_diff(got[0], expected[0]) <= TOLERANCE
    assert torch.isnan(expected[1]).all()
    # The server: zero weights and context, so the output is W_o's bias.
    assert max_diff(got[1], local.out_proj.bias.detach().expand(3, 32)) <= 1e-6


@pytest.mark.parametrize("mask", [
    torch.tensor([[False, True, False, False], [False, False, False, False]]),
    torch.tensor([[True, False, False, False], [False, False, False, False]]),
    torch.tensor([[0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    torch.zeros(2, 4, dtype=torch.int64),
    torch.zeros(2, 3, dtype=torch.bool),
])
def test_unsupported_key_padding_mask(remote, mask):
    (x,) = inputs(8, (2, 4, 32))
    with pytest.raises(ValueError, match="key_padding_mask: supported are .*right padding"):
        remote("mha_self")(x, x, x, key_padding_mask=mask)


@pytest.mark.parametrize("mask", [
    torch.ones(4, 4, dtype=torch.bool).triu(2),
    torch.ones(4, 4, dtype=torch.bool).tril(-1),
    torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -1e9),
    torch.rand(4, 4),
    torch.ones(3, 3, dtype=torch.bool).triu(1),
])
def test_unsupported_attn_mask(remote, mask):
    (x,) = inputs(9, (2, 4, 32))
    with pytest.raises(ValueError, match="attn_mask: only a causal mask is supported"):
        remote("mha_self")(x, x, x, attn_mask=mask)


def test_server_errors_are_mha_serve_errors(remote):
    attn = remote("mha_self")
    (x,) = inputs(10, (1, 2, 31))
    with pytest.raises(mha_serve.Error) as error:
        attn(x, x, x)
    assert error.value.code.name == "INVALID_ARGUMENT" and "queries" in error.value.details
    with pytest.raises(mha_serve.Error) as error:
        remote("not_exported").embed_dim
    assert error.value.code.name == "NOT_FOUND"
    assert np.isfinite(attn(*inputs(10, (1, 2, 32)) * 3)[0].numpy()).all()
