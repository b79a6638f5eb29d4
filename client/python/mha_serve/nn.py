"""RemoteMultiheadAttention: torch.nn.MultiheadAttention's forward, computed by an
attention_server (docs/python.md#remotemultiheadattention).

    attn = mha_serve.RemoteMultiheadAttention("127.0.0.1:50051", model="mine")
    out, weights = attn(x, x, x, key_padding_mask=pad, attn_mask=causal_mask)

Inputs are (B, L, E) (or unbatched (L, E)); (L, B, E) with batch_first=False, as in
PyTorch's nn.Transformer* layers by default. The model's weights live in
the server (mha_serve.export puts a module's there); this module has no parameters,
and its outputs carry no gradient (inference only). Masks are translated into the
request's fields, so only what attention.v1 expresses is accepted:

  key_padding_mask (B, S): bool (True = ignore) or float (-inf = ignore, 0 = keep),
      each row a right-padding suffix -> valid_lens; anything else is a ValueError.
  attn_mask (L, S) or (B*h, L, S): a causal mask (bool True above the diagonal, or
      float -inf above and 0 elsewhere) -> causal; anything else is a ValueError.
      is_causal=True without attn_mask is causal too.
  query is key is value (the same tensor, or the same storage, shape and strides) ->
      self-attention (no keys/values sent) when the model supports it.

A row whose every key is masked: the server answers zeros (output = W_o's bias),
PyTorch answers NaN.

Inside PyTorch's own layers: assign it in place of their nn.MultiheadAttention,

    layer = torch.nn.TransformerEncoderLayer(512, 8).eval()      # batch_first=False
    layer.self_attn = mha_serve.RemoteMultiheadAttention(target, model="enc0",
                                                         batch_first=False)

(TransformerDecoderLayer: self_attn and multihead_attn; TransformerEncoder: each of
its .layers). _qkv_same_embed_dim is False, so the eval-mode fast paths of
TransformerEncoderLayer and TransformerEncoder, which would compute with the local
in_proj_weight, are never taken: every attention is a request to the server. Their
src_mask / tgt_mask / memory_mask arrive here as attn_mask, their *_key_padding_mask
as key_padding_mask.
"""

import torch

from .client import DEFAULT_TARGET, DEFAULT_TIMEOUT, Client

_SUPPORTED_PADDING = ("key_padding_mask: supported are bool masks (True = ignore) or float "
                      "masks (-inf = ignore, 0 = keep) of shape (B, S) whose masked keys in "
                      "each row are a suffix (right padding); nn.Transformer* layers pass "
                      "src_key_padding_mask, tgt_key_padding_mask and memory_key_padding_mask "
                      "as key_padding_mask")
_SUPPORTED_ATTN_MASK = ("attn_mask: only a causal mask is supported: float with -inf exactly "
                        "above the diagonal and 0 elsewhere, as "
                        "nn.Transformer.generate_square_subsequent_mask(L) makes it, or bool "
                        "True exactly above the diagonal; shape (L, S) or (B*h, L, S) (or "
                        "is_causal=True and no attn_mask); nn.Transformer* layers pass "
                        "src_mask, tgt_mask and memory_mask as attn_mask")


def _to_bool_mask(mask, what):
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"{what}; got dtype {mask.dtype}")
    is_inf = torch.isneginf(mask)
    if not bool(torch.all(is_inf | (mask == 0))):
        raise ValueError(f"{what}; got float values other than 0 and -inf")
    return is_inf


def padding_to_valid_lens(key_padding_mask, batch, num_keys):
    """key_padding_mask (B, S) -> B key lengths, or None when nothing is masked."""
    if key_padding_mask is None:
        return None
    mask = _to_bool_mask(key_padding_mask.detach().cpu(), _SUPPORTED_PADDING)
    if tuple(mask.shape) != (batch, num_keys):
        raise ValueError(f"{_SUPPORTED_PADDING}; got shape {tuple(mask.shape)} for B {batch}, "
                         f"S {num_keys}")
    if not bool(mask.any()):
        return None
    lens = (~mask).sum(dim=1)
    expected = torch.arange(num_keys)[None, :] >= lens[:, None]
    bad = (mask != expected).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"{_SUPPORTED_PADDING}; row {bad[0]} masks "
                         f"{mask[bad[0]].nonzero().flatten().tolist()}")
    return lens.to(torch.int32).numpy()


def is_causal_mask(attn_mask, num_queries, num_keys):
    """Raises ValueError unless attn_mask is the top-left causal mask."""
    mask = _to_bool_mask(attn_mask.detach().cpu(), _SUPPORTED_ATTN_MASK)
    if mask.dim() not in (2, 3) or tuple(mask.shape[-2:]) != (num_queries, num_keys):
        raise ValueError(f"{_SUPPORTED_ATTN_MASK}; got shape {tuple(mask.shape)} for L "
                         f"{num_queries}, S {num_keys}")
    causal = torch.ones(num_queries, num_keys, dtype=torch.bool).triu(diagonal=1)
    if not bool((mask == causal).all()):
        raise ValueError(f"{_SUPPORTED_ATTN_MASK}; got another mask")
    return True


def _same_tensor(a, b):
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype
                      and a.device == b.device)


def _array(t):
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


class RemoteMultiheadAttention(torch.nn.Module):
    """nn.MultiheadAttention's forward, served by `model` at `target` (or by `client`,
    an mha_serve.Client). embed_dim, num_heads, kdim, vdim come from GetModel on first
    use. batch_first=False takes (L, B, E) inputs, as nn.MultiheadAttention and the
    nn.Transformer* layers do by default."""

    # Not PyTorch's packed in_proj_weight: TransformerEncoderLayer and TransformerEncoder
    # skip their local eval-mode fast path (torch._transformer_encoder_layer_fwd) for it.
    # No local in_proj tensors either (newer torch checks in_proj_bias first).
    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None

    def __init__(self, target=DEFAULT_TARGET, model="", tls=None, timeout=DEFAULT_TIMEOUT,
                 client=None, batch_first=True):
        super().__init__()
        self.client = client if client is not None else Client(target, tls=tls, timeout=timeout)
        self.model = model
        self.batch_first = bool(batch_first)
        self._info = None

    def __deepcopy__(self, memo):
        """A copy on the same client (channel) and model: nn.TransformerEncoder and
        nn.TransformerDecoder deep-copy the layer they are given once per layer; set each
        copy's `.model` to serve each layer's own weights."""
        copy = type(self)(model=self.model, client=self.client,
                          batch_first=self.batch_first)
        copy.train(self.training)
        copy._info = self._info
        memo[id(self)] = copy
        return copy

    @property
    def info(self):
        """The served model's mha_serve.ModelInfo (fetched once)."""
        if self._info is None:
            self._info = self.client.model(self.model)
        return self._info

    embed_dim = property(lambda self: self.info.num_hiddens)
    num_heads = property(lambda self: self.info.num_heads)
    kdim = property(lambda self: self.info.key_size)
    vdim = property(lambda self: self.info.value_size)

    def close(self):
        """Closes the client's channel."""
        self.client.close()

    def extra_repr(self):
        return (f"target={self.client.target!r}, model={self.model!r}"
                + ("" if self.batch_first else ", batch_first=False"))

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        """Returns (output, weights or None): output (B, L, E) ((L, B, E) when not
        batch_first), weights (B, L, S) averaged over heads, or (B, h, L, S) when
        average_attn_weights is False. need_weights=True (PyTorch's default) asks the
        server for the weights: a slower request (docs/python.md); pass False when
        they are not used, as the nn.Transformer* layers do."""
        batched = query.dim() == 3
        if not batched:
            if query.dim() != 2:
                raise ValueError(f"query: expected (B, L, E) or (L, E), got {tuple(query.shape)}")
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, num_queries, num_keys = query.shape[0], query.shape[1], key.shape[1]
        valid_lens = padding_to_valid_lens(key_padding_mask, batch, num_keys)
        causal = bool(is_causal) and attn_mask is None
        if attn_mask is not None:
            causal = is_causal_mask(attn_mask, num_queries, num_keys)
        self_attention = (_same_tensor(query, key) and _same_tensor(key, value)
                          and self.info.supports_self_attention)
        result = self.client.attend(
            _array(query), None if self_attention else _array(key),
            None if self_attention else _array(value), valid_lens=valid_lens, causal=causal,
            return_attention=need_weights, model=self.model)
        output, weights = result if need_weights else (result, None)
        output = torch.from_numpy(output).to(query.device, query.dtype)
        if weights is not None:
            weights = torch.from_numpy(weights).to(query.device, query.dtype)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        if not batched:
            output = output.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            output = output.transpose(0, 1)
        return output, weights
