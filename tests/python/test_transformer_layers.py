"""RemoteMultiheadAttention inside PyTorch's own layers (nn.TransformerEncoderLayer,
nn.TransformerDecoderLayer, nn.TransformerEncoder) against the same local layers, to
1e-4, in eval mode with grad on, under torch.no_grad and under torch.inference_mode.

Every check also reads the server's mha_requests_total (its Prometheus /metrics) and
asserts it rose by the number of attentions the layers hold: a layer that computed
locally (PyTorch's eval-mode fast path, or a fallback) fails the test. The reference
is the local layer run with grad enabled, which is PyTorch's plain path (its fast path
needs grad off and zeroes the padded rows of a nested tensor); the servers' answers are
compared on every row, padded or not."""

import contextlib
import copy

import pytest
import torch
from torch import nn

import mha_serve
from mha_serve.client import pb2

from conftest import TIMEOUT, max_diff, requests_total, trained_looking

TOLERANCE = 1e-4
D_MODEL, HEADS, FEEDFORWARD = 32, 4, 64
MODES = ["eval", "no_grad", "inference_mode"]


def mode_context(mode):
    return {"eval": contextlib.nullcontext, "no_grad": torch.no_grad,
            "inference_mode": torch.inference_mode}[mode]()


def attention_layers(module):
    """(path, nn.MultiheadAttention) of every attention in the module."""
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, nn.MultiheadAttention)]


def model_name(prefix, path):
    return f"{prefix}.{path}".replace(".", "_")


@pytest.fixture(scope="module")
def layers(serve, tmp_path_factory):
    """Local layers with trained-looking attention weights, each attention exported as
    its own model of one repository; target of the server on it."""
    repository = tmp_path_factory.mktemp("transformer_layers")
    torch.manual_seed(20)
    local = {
        "enc": nn.TransformerEncoderLayer(D_MODEL, HEADS, FEEDFORWARD, batch_first=True),
        # PyTorch's default (L, B, E) layout, pre-norm, gelu
        "enc_seq": nn.TransformerEncoderLayer(D_MODEL, HEADS, FEEDFORWARD, norm_first=True,
                                              activation="gelu"),
        "dec": nn.TransformerDecoderLayer(D_MODEL, HEADS, FEEDFORWARD, batch_first=True),
        "stack": nn.TransformerEncoder(
            nn.TransformerEncoderLayer(D_MODEL, HEADS, FEEDFORWARD, batch_first=True), 2,
            norm=nn.LayerNorm(D_MODEL)),
    }
    seed = 30
    for prefix, module in local.items():
        for path, attention in attention_layers(module):
            seed += 1
            trained_looking(attention, seed)
            mha_serve.export(attention, str(repository), name=model_name(prefix, path))
        module.eval()
    return local, serve(f"--model_repository={repository}")


@pytest.fixture(scope="module")
def remote_of(layers):
    """remote_of(prefix): a deep copy of the local layer with each nn.MultiheadAttention
    replaced by a RemoteMultiheadAttention on its exported model."""
    local, target = layers
    made = []

    def make(prefix):
        module = copy.deepcopy(local[prefix])
        for path, attention in attention_layers(local[prefix]):
            parent_path, _, attribute = path.rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            remote = mha_serve.RemoteMultiheadAttention(
                target, model=model_name(prefix, path), timeout=TIMEOUT,
                batch_first=attention.batch_first)
            made.append(remote)
            setattr(parent, attribute, remote)
        assert not attention_layers(module)
        return module.eval()

    yield make
    for remote in made:
        remote.close()


@contextlib.contextmanager
def requests_rise_by(target, count):
    """Asserts the server answered exactly `count` attention.v1 requests (OK) inside."""
    before = requests_total(target)
    yield
    assert requests_total(target) - before == count


def reference(module, *args, **kwargs):
    with torch.enable_grad():
        return module(*args, **kwargs).detach()


def inputs(seed, *shapes):
    return [torch.from_numpy(a.copy()) for a in mha_serve.uniform_inputs(seed, shapes)]


def right_padding(lengths, size):
    return torch.arange(size)[None, :] >= torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("mode", MODES)
def test_encoder_layer(layers, remote_of, mode):
    local, target = layers
    layer = remote_of("enc")
    assert layer.self_attn._qkv_same_embed_dim is False
    (src,) = inputs(1, (3, 6, D_MODEL))
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    padding = right_padding([6, 4, 1], 6)
    calls = [{}, {"src_key_padding_mask": padding},
             {"src_mask": causal, "src_key_padding_mask": padding}]
    for kwargs in calls:
        expected = reference(local["enc"], src, **kwargs)
        with requests_rise_by(target, 1), mode_context(mode):
            got = layer(src, **kwargs)
        assert got.shape == expected.shape and max_diff(got.detach(), expected) <= TOLERANCE, kwargs


def test_encoder_layer_sequence_first_float_padding(layers, remote_of):
    local, target = layers
    layer = remote_of("enc_seq")
    (src,) = inputs(2, (5, 2, D_MODEL))  # (L, B, E)
    padding = right_padding([3, 5], 5)
    float_padding = torch.zeros(2, 5).masked_fill(padding, float("-inf"))
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    # The reference gets the bool padding: torch 1.13's MultiheadAttention drops a float
    # key_padding_mask when attn_mask is float too (masked_fill with a float mask fills
    # nothing), so its own answer to the float pair ignores the padding.
    for kwargs, reference_kwargs in (
            ({"src_key_padding_mask": float_padding}, {"src_key_padding_mask": padding}),
            ({"src_mask": causal, "src_key_padding_mask": float_padding},
             {"src_mask": causal, "src_key_padding_mask": padding})):
        expected = reference(local["enc_seq"], src, **reference_kwargs)
        with requests_rise_by(target, 1), torch.no_grad():
            got = layer(src, **kwargs)
        assert got.shape == (5, 2, D_MODEL) and max_diff(got, expected) <= TOLERANCE, kwargs
    # unbatched (L, E)
    expected = reference(local["enc_seq"], src[:, 0])
    with requests_rise_by(target, 1), torch.inference_mode():
        got = layer(src[:, 0])
    assert got.shape == (5, D_MODEL) and max_diff(got.detach(), expected) <= TOLERANCE


@pytest.mark.parametrize("mode", MODES)
def test_decoder_layer_self_and_cross_attention(layers, remote_of, mode):
    local, target = layers
    layer = remote_of("dec")
    tgt, memory, square_memory = inputs(3, (3, 5, D_MODEL), (3, 7, D_MODEL), (3, 5, D_MODEL))
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    calls = [
        (memory, {}),
        (memory, {"tgt_mask": causal, "tgt_key_padding_mask": right_padding([5, 3, 2], 5),
                  "memory_key_padding_mask": right_padding([7, 1, 4], 7)}),
        # a memory_mask: the causal one, on a memory as long as the target
        (square_memory, {"tgt_mask": causal, "memory_mask": causal,
                         "memory_key_padding_mask": right_padding([5, 5, 2], 5)}),
    ]
    for mem, kwargs in calls:
        expected = reference(local["dec"], tgt, mem, **kwargs)
        with requests_rise_by(target, 2), mode_context(mode):
            got = layer(tgt, mem, **kwargs)
        assert got.shape == expected.shape and max_diff(got.detach(), expected) <= TOLERANCE, kwargs


@pytest.mark.parametrize("mode", MODES)
def test_transformer_encoder(layers, remote_of, mode):
    local, target = layers
    encoder = remote_of("stack")
    (src,) = inputs(4, (3, 6, D_MODEL))
    padding = right_padding([6, 2, 5], 6)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    for kwargs in ({}, {"src_key_padding_mask": padding},
                   {"mask": causal, "src_key_padding_mask": padding}):
        expected = reference(local["stack"], src, **kwargs)
        with requests_rise_by(target, 2), mode_context(mode):
            got = encoder(src, **kwargs)
        assert got.shape == expected.shape and max_diff(got.detach(), expected) <= TOLERANCE, kwargs


def test_transformer_encoder_deep_copies_the_remote_layer(layers):
    """nn.TransformerEncoder(layer, N) deep-copies `layer` N times: the copies share the
    client and are pointed at each layer's own model."""
    local, target = layers
    layer = copy.deepcopy(local["stack"].layers[0])
    remote = mha_serve.RemoteMultiheadAttention(target, model="", timeout=TIMEOUT)
    try:
        layer.self_attn = remote
        encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D_MODEL))
        copies = [encoder.layers[i].self_attn for i in range(2)]
        assert all(c is not remote and c.client is remote.client for c in copies)
        missing, unexpected = encoder.load_state_dict(local["stack"].state_dict(), strict=False)
        assert not missing and all(".self_attn." in n for n in unexpected)
        for i, c in enumerate(copies):
            c.model = model_name("stack", f"layers.{i}.self_attn")
        encoder.eval()
        (src,) = inputs(5, (2, 4, D_MODEL))
        expected = reference(local["stack"], src)
        with requests_rise_by(target, 2), torch.no_grad():
            got = encoder(src)
        assert max_diff(got.detach(), expected) <= TOLERANCE
    finally:
        remote.close()


def test_masks_are_sent_as_causal_and_valid_lens(layers, remote_of):
    """generate_square_subsequent_mask -> causal, right padding -> valid_lens, and
    self-attention sends no keys; cross-attention sends the memory."""
    layer = remote_of("dec")
    sent = []
    for attention in (layer.self_attn, layer.multihead_attn):
        client = attention.client
        call = client.call_bytes
        client.call_bytes = (lambda request, timeout=None, call=call:
                             sent.append(pb2.AttendRequest.FromString(request)) or call(request))
    tgt, memory = inputs(6, (2, 4, D_MODEL), (2, 5, D_MODEL))
    with torch.no_grad():
        layer(tgt, memory, tgt_mask=nn.Transformer.generate_square_subsequent_mask(4),
              tgt_key_padding_mask=right_padding([4, 3], 4),
              memory_key_padding_mask=right_padding([2, 5], 5))
        layer(tgt, memory)
    assert [(r.causal, list(r.valid_lens), r.HasField("keys"), r.return_attention)
            for r in sent] == [(True, [4, 3], False, False), (False, [2, 5], True, False),
                               (False, [], False, False), (False, [], True, False)]


def test_unsupported_masks_are_refused_before_their_request(layers, remote_of):
    """A ValueError naming the mask, and no request for that attention (a decoder's
    self-attention, before its cross-attention's refusal, was sent)."""
    local, target = layers
    encoder_layer, decoder_layer = remote_of("enc"), remote_of("dec")
    (src,) = inputs(7, (2, 4, D_MODEL))
    (memory,) = inputs(8, (2, 4, D_MODEL))
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    left_padding = torch.tensor([[True, True, False, False], [False] * 4])
    attn_mask = "attn_mask: only a causal mask is supported.*src_mask, tgt_mask and memory_mask"
    padding_mask = "key_padding_mask: supported are .*right padding.*src_key_padding_mask"
    refused = [
        (encoder_layer, (src,), {"src_mask": causal.T.contiguous()}, attn_mask, 0),
        (encoder_layer, (src,), {"src_mask": causal.clamp(min=-1e9)}, attn_mask, 0),
        (encoder_layer, (src,), {"src_mask": torch.ones(4, 4, dtype=torch.bool).triu(2)},
         attn_mask, 0),
        (encoder_layer, (src,), {"src_key_padding_mask": left_padding}, padding_mask, 0),
        (decoder_layer, (src, memory), {"tgt_mask": torch.rand(4, 4)}, attn_mask, 0),
        (decoder_layer, (src, memory), {"tgt_key_padding_mask": left_padding}, padding_mask, 0),
        (decoder_layer, (src, memory), {"memory_mask": torch.zeros(4, 4).masked_fill(
            torch.eye(4, dtype=torch.bool), float("-inf"))}, attn_mask, 1),
        (decoder_layer, (src, memory), {"memory_key_padding_mask": left_padding},
         padding_mask, 1),
    ]
    for module, args, kwargs, message, sent in refused:
        with requests_rise_by(target, sent), torch.no_grad():
            with pytest.raises(ValueError, match=message):
                module(*args, **kwargs)
