"""An independent PyTorch reference for grouped-query attention with rotary positions
(issue 34), written from the published formulas, not from any library's code:

  - grouped-query attention (Ainslie et al., 2023): G key/value heads, query head i
    uses key/value head i // (h / G) (Hugging Face calls this expansion repeat_kv);
    G = 1 is multi-query attention (Shazeer, 2019);
  - rotary position embedding (Su et al., RoFormer, 2021): inv_freq[k] =
    theta^(-2k / r) for k < r/2, the angle of position p is p * inv_freq[k]; the
    first r = rotary_dim features of every q and k head are rotated in pairs, the
    rest pass unchanged. Pairs (k, k + r/2) ("rotate half", as Hugging Face's Llama)
    or (2k, 2k + 1) (interleaved, as Meta's original Llama). A pair (a, b) at angle t
    becomes (a cos t - b sin t, a sin t + b cos t).

The module has Hugging Face's attribute names (q_proj, k_proj, v_proj, o_proj as
nn.Linear; num_heads, num_key_value_heads, head_dim, rope_theta) plus rotary_dim and
rope_interleaved, so mha_serve.export reads it as it reads a Hugging Face attention
layer. Its forward is this project's stateless call, not Hugging Face's:

    forward(queries (B, Q, d_q), keys (B, K, d_k) = None, values (B, K, d_v) = None,
            valid_lens (B) or (B, Q) = None, causal = False) -> (B, Q, p_o)

keys None = self-attention on the queries (K = Q). Key j is at position j, query i at
K - Q + i (the queries are the last Q tokens); causal: query i sees keys at
positions <= K - Q + i (bottom-right aligned). Keys j >= valid_len are masked; a query
with no visible key has a zero context (this project's rule; softmax over nothing
would be NaN). Angles are computed in float64 whatever the module's dtype (Hugging
Face computes them in float32: about 1e-3 apart at 8k positions). Run the module in
float64 (.double()) for golden outputs.

Used by tests/golden/make_golden_gqa.py (golden outputs for the core) and
tests/integration/hf_export_test.py (an exported module served and compared).
"""

import math

import torch
from torch import nn


def rotary_angles(positions, rotary_dim, theta):
    """(len(positions), rotary_dim / 2) angles in float64."""
    k = torch.arange(rotary_dim // 2, dtype=torch.float64)
    inv_freq = 1.0 / (float(theta) ** (2.0 * k / rotary_dim))
    return positions.to(torch.float64)[:, None] * inv_freq[None, :]


def apply_rotary(x, positions, rotary_dim, theta, interleaved):
    """x (B, heads, L, d): rotates the first rotary_dim features of each head by the
    angles of `positions` (L); the other features are returned as they are."""
    angles = rotary_angles(positions, rotary_dim, theta)  # (L, r/2)
    cos = torch.cos(angles).to(x.dtype)
    sin = torch.sin(angles).to(x.dtype)
    rotated, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    if interleaved:
        a, b = rotated[..., 0::2], rotated[..., 1::2]  # pairs (2k, 2k + 1)
        out = torch.empty_like(rotated)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    else:
        a, b = rotated[..., :half], rotated[..., half:]  # pairs (k, k + r/2)
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([out, rest], dim=-1)


def repeat_kv(x, groups):
    """(B, G, L, d) -> (B, G * groups, L, d): head i of the result is head i // groups."""
    return x.repeat_interleave(groups, dim=1)


class GroupedRotaryAttention(nn.Module):
    """q_proj (h*d_h, d_q), k_proj (G*d_h, d_k), v_proj (G*d_h, d_v), o_proj (p_o, h*d_h).
    bias: q, k and v projections; o_bias: o_proj's (Qwen2 has none)."""

    def __init__(self, num_hiddens, num_heads, num_key_value_heads, query_size=None,
                 key_size=None, value_size=None, bias=False, o_bias=None, rope_theta=10000.0,
                 rotary_dim=None, rope_interleaved=False):
        super().__init__()
        if num_hiddens % num_heads or num_heads % num_key_value_heads:
            raise ValueError("need num_hiddens % num_heads == 0 and "
                             "num_heads % num_key_value_heads == 0")
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = num_hiddens // num_heads
        self.rope_theta = rope_theta
        self.rotary_dim = self.head_dim if rotary_dim is None else rotary_dim
        self.rope_interleaved = rope_interleaved
        kv = num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(query_size or num_hiddens, num_hiddens, bias=bias)
        self.k_proj = nn.Linear(key_size or num_hiddens, kv, bias=bias)
        self.v_proj = nn.Linear(value_size or num_hiddens, kv, bias=bias)
        self.o_proj = nn.Linear(num_hiddens, num_hiddens, bias=bias if o_bias is None else o_bias)

    def _heads(self, x, heads):
        batch, length, _ = x.shape
        return x.reshape(batch, length, heads, self.head_dim).transpose(1, 2)

    def forward(self, queries, keys=None, values=None, valid_lens=None, causal=False):
        if keys is None:
            keys = values = queries
        batch, num_q, _ = queries.shape
        num_k = keys.shape[1]
        q = self._heads(self.q_proj(queries), self.num_heads)
        k = self._heads(self.k_proj(keys), self.num_key_value_heads)
        v = self._heads(self.v_proj(values), self.num_key_value_heads)
        key_pos = torch.arange(num_k)
        query_pos = torch.arange(num_q) + (num_k - num_q)
        q = apply_rotary(q, query_pos, self.rotary_dim, self.rope_theta, self.rope_interleaved)
        k = apply_rotary(k, key_pos, self.rotary_dim, self.rope_theta, self.rope_interleaved)
        groups = self.num_heads // self.num_key_value_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (B, h, Q, K)
        visible = torch.ones(batch, num_q, num_k, dtype=torch.bool)
        if valid_lens is not None:
            lens = torch.as_tensor(valid_lens).long()
            lens = lens[:, None].expand(batch, num_q) if lens.dim() == 1 else lens
            visible &= key_pos[None, None, :] < lens[:, :, None]
        if causal:
            visible &= key_pos[None, None, :] <= query_pos[None, :, None]
        visible = visible[:, None]  # every head
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        weights = torch.where(visible.any(-1, keepdim=True), weights, torch.zeros_like(weights))
        context = (weights @ v).transpose(1, 2).reshape(batch, num_q, -1)
        return self.o_proj(context)
