"""A d2l-style MultiHeadAttention (scaled dot-product scoring) with sized nn.Linear
layers, for exporting a d2l state dict (or random weights) from the command line
without the d2l package. Same parameters and forward(queries, keys, values,
valid_lens) as d2l's; valid_lens None, (B,) or (B, Q)."""

import math

import torch
from torch import nn


class D2LMultiHeadAttention(nn.Module):
    def __init__(self, num_hiddens, num_heads, query_size, key_size, value_size, bias=False):
        super().__init__()
        if num_hiddens % num_heads:
            raise ValueError(f"num_hiddens {num_hiddens} is not a multiple of num_heads "
                             f"{num_heads}")
        self.num_heads = num_heads
        self.W_q = nn.Linear(query_size, num_hiddens, bias=bias)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=bias)
        self.W_v = nn.Linear(value_size, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    @classmethod
    def from_state_dict(cls, state, num_heads):
        """Sizes and bias from the tensors W_q.weight ... W_o.bias."""
        missing = [f"{n}.weight" for n in ("W_q", "W_k", "W_v", "W_o")
                   if f"{n}.weight" not in state]
        if missing:
            raise ValueError(f"not a d2l MultiHeadAttention state dict: no {', '.join(missing)} "
                             f"(has {', '.join(sorted(state)) or 'nothing'})")
        layer = cls(state["W_o.weight"].shape[0], num_heads, state["W_q.weight"].shape[1],
                    state["W_k.weight"].shape[1], state["W_v.weight"].shape[1],
                    bias="W_q.bias" in state)
        layer.load_state_dict(state)
        return layer

    def _split(self, x):  # (B, L, p_o) -> (B*h, L, p_o/h)
        b, length, _ = x.shape
        return x.reshape(b, length, self.num_heads, -1).permute(0, 2, 1, 3).reshape(
            b * self.num_heads, length, -1)

    def forward(self, queries, keys, values, valid_lens=None):
        q, k, v = self._split(self.W_q(queries)), self._split(self.W_k(keys)), \
            self._split(self.W_v(values))
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        if valid_lens is not None:
            lens = torch.repeat_interleave(valid_lens, self.num_heads, dim=0)
            if lens.dim() == 1:
                lens = lens[:, None].expand(-1, scores.shape[1])
            masked = torch.arange(scores.shape[2])[None, None, :] >= lens[:, :, None]
            scores = scores.masked_fill(masked, -1e6)  # d2l's masked_softmax value
        context = torch.softmax(scores, dim=-1) @ v
        b = queries.shape[0]
        context = context.reshape(b, self.num_heads, context.shape[1], -1).permute(0, 2, 1, 3)
        return self.W_o(context.reshape(b, context.shape[1], -1))
