#!/usr/bin/python3
"""Generate (and verify) the golden fixtures for the mha-serve attention core.

Run with Debian's interpreter (it has torch 1.13 + numpy):

    /usr/bin/python3 tests/golden/make_golden.py            # (re)write tests/golden/data/
    /usr/bin/python3 tests/golden/make_golden.py --verify   # re-check the files with numpy only

For every case two safetensors files are written into tests/golden/data/:

  <case>.weights.safetensors  the module's own state_dict (F32), either
                              PyTorch nn.MultiheadAttention naming ("torch") or
                              the d2l-style naming W_q/W_k/W_v/W_o ("d2l").
  <case>.io.safetensors       queries F32 (B,Q,d_q); keys/values F32 (cross-attention
                              only; absent = self-attention); valid_lens I32 (B) or
                              (B,Q) when used; output F32 (B,Q,p_o) computed by torch
                              in float64 and cast to float32. __metadata__ describes
                              the layer (num_hiddens, num_heads, sizes, bias, causal,
                              naming, description).

PyTorch produces NaN for query rows whose keys are all masked; such rows are kept as
NaN in `output` (the C++ test skips them and expects zeros from our core).

The safetensors format is written by hand (json + struct); the `safetensors`
package is deliberately not used.
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.path.join(HERE, "data")
SEED = 20240531
VERIFY_TOL = 1e-5


# --------------------------------------------------------------------------------------
# safetensors I/O (hand-written)
# --------------------------------------------------------------------------------------
_NP_TO_ST = {np.dtype("<f4"): "F32", np.dtype("<i4"): "I32"}
_ST_TO_NP = {"F32": np.dtype("<f4"), "I32": np.dtype("<i4")}


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, np.ndarray) in the order they are stored."""
    header = {}
    blobs = []
    offset = 0
    for name, arr in tensors:
        arr = np.ascontiguousarray(arr)
        dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        if np.dtype(dt) not in _NP_TO_ST:
            raise TypeError(f"{name}: unsupported dtype {arr.dtype}")
        raw = arr.astype(np.dtype(dt).newbyteorder("<"), copy=False).tobytes(order="C")
        header[name] = {
            "dtype": _NP_TO_ST[np.dtype(dt)],
            "shape": [int(s) for s in arr.shape],
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        for k, v in metadata.items():
            if not isinstance(v, str):
                raise TypeError(f"metadata {k!r} must be a string, got {type(v).__name__}")
        header["__metadata__"] = dict(metadata)
    hbytes = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    hbytes += b" " * ((-len(hbytes)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """Returns (dict name -> np.ndarray, metadata dict). Strict about the layout."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    assert n % 8 == 0, f"{path}: header length {n} not a multiple of 8"
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    data = buf[8 + n:]
    meta = header.pop("__metadata__", {})
    assert all(isinstance(v, str) for v in meta.values()), "metadata values must be strings"
    out = {}
    spans = []
    for name, info in header.items():
        dt = _ST_TO_NP[info["dtype"]]
        b, e = info["data_offsets"]
        count = int(np.prod(info["shape"])) if info["shape"] else 1
        assert e - b == count * dt.itemsize, f"{name}: offsets do not match shape"
        out[name] = np.frombuffer(data[b:e], dtype=dt).reshape(info["shape"]).copy()
        spans.append((b, e))
    spans.sort()
    pos = 0
    for b, e in spans:
        assert b == pos, f"{path}: gap/overlap in data offsets"
        pos = e
    assert pos == len(data), f"{path}: trailing bytes after tensor data"
    return out, meta


# --------------------------------------------------------------------------------------
# Torch side (only imported when generating)
# --------------------------------------------------------------------------------------
def _torch_modules():
    import torch
    from torch import nn

    def masked_softmax(X, valid_lens):
        """d2l's masked softmax: masked positions filled with -1e6 before softmax."""

        def _sequence_mask(X, valid_len, value=0.0):
            maxlen = X.size(1)
            mask = torch.arange(maxlen, dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
            X[~mask] = value
            return X

        if valid_lens is None:
            return nn.functional.softmax(X, dim=-1)
        shape = X.shape
        if valid_lens.dim() == 1:
            valid_lens = torch.repeat_interleave(valid_lens, shape[1])
        else:
            valid_lens = valid_lens.reshape(-1)
        X = _sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
        return nn.functional.softmax(X.reshape(shape), dim=-1)

    class DotProductAttention(nn.Module):
        def __init__(self, dropout=0.0):
            super().__init__()
            self.dropout = nn.Dropout(dropout)

        def forward(self, queries, keys, values, valid_lens=None):
            d = queries.shape[-1]
            scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
            self.attention_weights = masked_softmax(scores, valid_lens)
            return torch.bmm(self.dropout(self.attention_weights), values)

    class D2LMultiHeadAttention(nn.Module):
        """d2l.ai "Multi-Head Attention" (PyTorch), with explicit input sizes."""

        def __init__(self, query_size, key_size, value_size, num_hiddens, num_heads,
                     dropout=0.0, bias=False, attention=None):
            super().__init__()
            self.num_heads = num_heads
            self.attention = attention if attention is not None else DotProductAttention(dropout)
            self.W_q = nn.Linear(query_size, num_hiddens, bias=bias)
            self.W_k = nn.Linear(key_size, num_hiddens, bias=bias)
            self.W_v = nn.Linear(value_size, num_hiddens, bias=bias)
            self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

        def transpose_qkv(self, X):
            X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1)
            X = X.permute(0, 2, 1, 3)
            return X.reshape(-1, X.shape[2], X.shape[3])

        def transpose_output(self, X):
            X = X.reshape(-1, self.num_heads, X.shape[1], X.shape[2])
            X = X.permute(0, 2, 1, 3)
            return X.reshape(X.shape[0], X.shape[1], -1)

        def forward(self, queries, keys, values, valid_lens):
            queries = self.transpose_qkv(self.W_q(queries))
            keys = self.transpose_qkv(self.W_k(keys))
            values = self.transpose_qkv(self.W_v(values))
            if valid_lens is not None:
                valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
            output = self.attention(queries, keys, values, valid_lens)
            return self.W_o(self.transpose_output(output))

    def zero_rows_without_keys(weights, valid_lens):
        """mha-serve's rule: a query that sees no key gets a zero context (d2l's -1e6
        fill would give it the uniform average over its masked keys)."""
        if valid_lens is None:
            return weights
        vl = valid_lens if valid_lens.dim() == 2 else valid_lens[:, None].expand(weights.shape[:2])
        return weights * (vl > 0).to(weights.dtype)[..., None]

    class AdditiveAttention(nn.Module):
        """d2l.ai "Attention Scoring Functions": additive attention, one module that
        every head shares (d2l's MultiHeadAttention holds one)."""

        def __init__(self, key_size, query_size, num_hiddens, dropout=0.0):
            super().__init__()
            self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
            self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
            self.w_v = nn.Linear(num_hiddens, 1, bias=False)
            self.dropout = nn.Dropout(dropout)

        def forward(self, queries, keys, values, valid_lens):
            queries, keys = self.W_q(queries), self.W_k(keys)
            features = torch.tanh(queries.unsqueeze(2) + keys.unsqueeze(1))
            scores = self.w_v(features).squeeze(-1)
            weights = zero_rows_without_keys(masked_softmax(scores, valid_lens), valid_lens)
            self.attention_weights = weights
            return torch.bmm(self.dropout(weights), values)

    class Stacked(nn.Module):
        """A parameter named `weight`, one slice per head."""

        def __init__(self, *shape, fan_in):
            super().__init__()
            bound = 1.0 / math.sqrt(fan_in)
            self.weight = nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))

    class PerHeadAdditiveAttention(nn.Module):
        """Additive attention with its own W_q, W_k (p_a, p) and w_v (p_a) per head,
        stacked: attention.W_q.weight (h, p_a, p) and so on."""

        def __init__(self, num_heads, head_size, num_hiddens):
            super().__init__()
            self.num_heads = num_heads
            self.W_q = Stacked(num_heads, num_hiddens, head_size, fan_in=head_size)
            self.W_k = Stacked(num_heads, num_hiddens, head_size, fan_in=head_size)
            self.w_v = Stacked(num_heads, num_hiddens, fan_in=num_hiddens)

        def forward(self, queries, keys, values, valid_lens):
            h = self.num_heads
            q = queries.reshape(-1, h, *queries.shape[1:])  # (B, h, Q, p): d2l's head order
            k = keys.reshape(-1, h, *keys.shape[1:])
            qa = torch.einsum("bhqp,hap->bhqa", q, self.W_q.weight)
            ka = torch.einsum("bhkp,hap->bhka", k, self.W_k.weight)
            features = torch.tanh(qa.unsqueeze(3) + ka.unsqueeze(2))  # (B, h, Q, K, p_a)
            scores = torch.einsum("bhqka,ha->bhqk", features, self.w_v.weight)
            scores = scores.reshape(-1, *scores.shape[2:])
            weights = zero_rows_without_keys(masked_softmax(scores, valid_lens), valid_lens)
            return torch.bmm(weights, values)

    return torch, nn, D2LMultiHeadAttention, AdditiveAttention, PerHeadAdditiveAttention


def _f32(t):
    return t.detach().to("cpu").float().contiguous().numpy()


def _meta(num_hiddens, num_heads, dq, dk, dv, bias, causal, naming, description,
          additive_hidden=None):
    extra = {} if additive_hidden is None else {"scoring": "additive",
                                                "additive_hidden": str(additive_hidden)}
    return extra | {
        "num_hiddens": str(num_hiddens),
        "num_heads": str(num_heads),
        "query_size": str(dq),
        "key_size": str(dk),
        "value_size": str(dv),
        "bias": "true" if bias else "false",
        "causal": "true" if causal else "false",
        "naming": naming,
        "description": description,
    }


def make_torch_case(torch, nn, name, E, h, bias, B, Q, K=None, kdim=None, vdim=None,
                    valid_lens=None, causal=False, description=""):
    """PyTorch nn.MultiheadAttention(batch_first=True). Self-attention when K is None."""
    self_attn = K is None
    mha = nn.MultiheadAttention(E, h, bias=bias, batch_first=True, kdim=kdim, vdim=vdim)
    with torch.no_grad():
        # Default init zeroes the biases; give them values so bias handling is exercised.
        if bias:
            mha.in_proj_bias.copy_(torch.randn_like(mha.in_proj_bias) * 0.1)
            mha.out_proj.bias.copy_(torch.randn_like(mha.out_proj.bias) * 0.1)
    dq = E
    dk = kdim if kdim is not None else E
    dv = vdim if vdim is not None else E
    queries = torch.randn(B, Q, dq)
    if self_attn:
        K = Q
        keys = values = queries
    else:
        keys = torch.randn(B, K, dk)
        values = torch.randn(B, K, dv)
    vl = None if valid_lens is None else torch.tensor(valid_lens, dtype=torch.int32)
    assert vl is None or vl.dim() == 1, "torch naming supports valid_lens of shape (B) only"

    kpm = None
    if vl is not None:
        kpm = torch.arange(K)[None, :] >= vl[:, None].long()  # True = masked
    am = None
    if causal:
        am = torch.triu(torch.ones(Q, K, dtype=torch.bool), diagonal=1)  # True = masked

    sd = mha.state_dict()
    m64 = nn.MultiheadAttention(E, h, bias=bias, batch_first=True, kdim=kdim, vdim=vdim).double()
    m64.load_state_dict({k: v.double() for k, v in sd.items()})
    q64 = queries.double()
    k64, v64 = (q64, q64) if self_attn else (keys.double(), values.double())
    with torch.no_grad():
        m64.train()  # dropout is 0: forces the reference (non-fast) path
        out, _ = m64(q64, k64, v64, key_padding_mask=kpm, attn_mask=am, need_weights=False)
        m64.eval()  # fast path where eligible; must agree
        out_eval, _ = m64(q64, k64, v64, key_padding_mask=kpm, attn_mask=am, need_weights=False)
    o, oe = out.numpy(), out_eval.numpy()
    fin = np.isfinite(o) & np.isfinite(oe)
    assert np.array_equal(np.isnan(o), np.isnan(oe)), f"{name}: eval/train NaN rows differ"
    assert np.max(np.abs(o[fin] - oe[fin]), initial=0.0) < 1e-9, f"{name}: eval/train paths disagree"

    weights = [(k, _f32(v)) for k, v in sd.items()]
    io = [("queries", _f32(queries))]
    if not self_attn:
        io += [("keys", _f32(keys)), ("values", _f32(values))]
    if vl is not None:
        io.append(("valid_lens", vl.numpy().astype("<i4")))
    io.append(("output", o.astype(np.float32)))
    meta = _meta(E, h, dq, dk, dv, bias, causal, "torch", description)
    return weights, io, meta


def make_d2l_case(torch, D2L, name, p_o, h, dq, dk, dv, bias, B, Q, K, valid_lens,
                  same_kv=False, description="", additive=None):
    """d2l's MultiHeadAttention; additive = (attention_factory, p_a) gives it additive
    pooling, attention_factory(p, p_a) building the module (whose rows with no valid
    key get a zero context)."""
    def build():
        attention = additive[0](p_o // h, additive[1]) if additive else None
        return D2L(dq, dk, dv, p_o, h, dropout=0.0, bias=bias, attention=attention)

    mod = build()
    queries = torch.randn(B, Q, dq)
    keys = torch.randn(B, K, dk)
    values = keys if same_kv else torch.randn(B, K, dv)
    vl = torch.tensor(valid_lens, dtype=torch.int32)
    assert additive or int(vl.min()) >= 1, "d2l cases must not have all-masked rows"
    sd = mod.state_dict()
    m64 = build().double()
    m64.load_state_dict({k: v.double() for k, v in sd.items()})
    m64.eval()
    with torch.no_grad():
        out = m64(queries.double(), keys.double(), values.double(), vl)
    weights = [(k, _f32(v)) for k, v in sd.items()]
    io = [("queries", _f32(queries)), ("keys", _f32(keys)), ("values", _f32(values)),
          ("valid_lens", vl.numpy().astype("<i4")), ("output", out.numpy().astype(np.float32))]
    meta = _meta(p_o, h, dq, dk, dv, bias, False, "d2l", description,
                 additive_hidden=additive[1] if additive else None)
    return weights, io, meta


def generate():
    torch, nn, D2L, Additive, PerHeadAdditive = _torch_modules()
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # deterministic reduction order
    os.makedirs(DATA_DIR, exist_ok=True)

    cases = []
    torch.manual_seed(SEED + 1)
    cases.append(("torch_packed_self", make_torch_case(
        torch, nn, "torch_packed_self", E=64, h=4, bias=True, B=3, Q=7,
        valid_lens=[7, 3, 5],
        description="nn.MultiheadAttention E=64 h=4 bias, self-attention B=3 L=7, "
                    "valid_lens(B)=[7,3,5]")))
    torch.manual_seed(SEED + 2)
    cases.append(("torch_kvdim_cross", make_torch_case(
        torch, nn, "torch_kvdim_cross", E=48, h=6, bias=True, B=2, Q=5, K=9, kdim=40, vdim=24,
        valid_lens=[9, 0],
        description="nn.MultiheadAttention E=48 h=6 kdim=40 vdim=24 bias, cross B=2 Q=5 K=9, "
                    "valid_lens(B)=[9,0]; batch 1 fully masked -> NaN rows")))
    torch.manual_seed(SEED + 3)
    cases.append(("torch_nobias_causal", make_torch_case(
        torch, nn, "torch_nobias_causal", E=32, h=2, bias=False, B=2, Q=6, causal=True,
        description="nn.MultiheadAttention E=32 h=2 no bias, causal self-attention B=2 L=6")))
    torch.manual_seed(SEED + 4)
    cases.append(("d2l_toy", make_d2l_case(
        torch, D2L, "d2l_toy", p_o=100, h=5, dq=100, dk=100, dv=100, bias=False,
        B=2, Q=4, K=6, valid_lens=[3, 2], same_kv=True,
        description="d2l toy: num_hiddens=100 h=5 no bias, queries (2,4,100), "
                    "keys=values (2,6,100), valid_lens(B)=[3,2]")))
    torch.manual_seed(SEED + 5)
    g = torch.Generator().manual_seed(SEED + 50)
    vl_bq = torch.randint(1, 9, (2, 5), generator=g).tolist()
    cases.append(("d2l_sizes_bias", make_d2l_case(
        torch, D2L, "d2l_sizes_bias", p_o=60, h=3, dq=40, dk=24, dv=32, bias=True,
        B=2, Q=5, K=8, valid_lens=vl_bq,
        description="d2l num_hiddens=60 h=3 d_q=40 d_k=24 d_v=32 bias, cross B=2 Q=5 K=8, "
                    "valid_lens(B,Q) in [1,8]")))
    torch.manual_seed(SEED + 6)
    g = torch.Generator().manual_seed(SEED + 60)
    vl_bq = torch.randint(0, 8, (2, 5), generator=g).tolist()
    vl_bq[1][2] = 0  # a query with no valid key: zero context
    cases.append(("d2l_additive_shared", make_d2l_case(
        torch, D2L, "d2l_additive_shared", p_o=32, h=4, dq=12, dk=10, dv=7, bias=True,
        B=2, Q=5, K=7, valid_lens=vl_bq, additive=(lambda p, p_a: Additive(p, p, p_a), 6),
        description="d2l MultiHeadAttention with one AdditiveAttention (p_a=6) shared by its "
                    "4 heads, p_o=32 d_q=12 d_k=10 d_v=7 bias, cross B=2 Q=5 K=7, "
                    "valid_lens(B,Q) in [0,7]")))
    torch.manual_seed(SEED + 7)
    cases.append(("d2l_additive_per_head", make_d2l_case(
        torch, D2L, "d2l_additive_per_head", p_o=24, h=3, dq=24, dk=24, dv=24, bias=False,
        B=3, Q=4, K=6, valid_lens=[6, 0, 3], additive=(lambda p, p_a: PerHeadAdditive(3, p, p_a), 5),
        description="d2l MultiHeadAttention with additive scoring, one W_q/W_k/w_v per head "
                    "(p_a=5), p_o=24 h=3 no bias, cross B=3 Q=4 K=6, valid_lens(B)=[6,0,3]")))

    total = 0
    for name, (weights, io, meta) in cases:
        for suffix, tensors, md in (("weights", weights, {"naming": meta["naming"]}),
                                    ("io", io, meta)):
            path = os.path.join(DATA_DIR, f"{name}.{suffix}.safetensors")
            write_safetensors(path, tensors, md)
            size = os.path.getsize(path)
            total += size
            print(f"wrote {os.path.relpath(path, os.getcwd())} ({size} bytes)")
    print(f"total {total} bytes")


# --------------------------------------------------------------------------------------
# Independent numpy check (float64), from the files only
# --------------------------------------------------------------------------------------
def _np_weights(w, meta):
    E = int(meta["num_hiddens"])
    bias = meta["bias"] == "true"
    if meta["naming"] == "torch":
        if "in_proj_weight" in w:
            Wq, Wk, Wv = np.split(w["in_proj_weight"].astype(np.float64), 3, axis=0)
        else:
            Wq, Wk, Wv = (w[n].astype(np.float64) for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight"))
        Wo = w["out_proj.weight"].astype(np.float64)
        if bias:
            bq, bk, bv = np.split(w["in_proj_bias"].astype(np.float64), 3)
            bo = w["out_proj.bias"].astype(np.float64)
        else:
            assert "in_proj_bias" not in w and "out_proj.bias" not in w
            bq = bk = bv = bo = np.zeros(E)
    else:
        Wq, Wk, Wv, Wo = (w[f"W_{x}.weight"].astype(np.float64) for x in "qkvo")
        if bias:
            bq, bk, bv, bo = (w[f"W_{x}.bias"].astype(np.float64) for x in "qkvo")
        else:
            assert not any(k.endswith(".bias") for k in w if not k.startswith("attention."))
            bq = bk = bv = bo = np.zeros(E)
    return Wq, Wk, Wv, Wo, bq, bk, bv, bo


def _np_scoring(w, h):
    """Additive scoring parameters per head: A_q, A_k (h, p_a, p), w_v (h, p_a)."""
    aq, ak, av = (w[f"attention.{n}.weight"].astype(np.float64) for n in ("W_q", "W_k", "w_v"))
    if aq.ndim == 2:  # shared by every head
        aq, ak, av = (np.broadcast_to(x, (h,) + x.shape[-2:]) for x in (aq, ak, av))
        av = av[:, 0, :]
    return aq, ak, av


def numpy_reference(w, io, meta):
    E = int(meta["num_hiddens"])
    h = int(meta["num_heads"])
    p = E // h
    causal = meta["causal"] == "true"
    Wq, Wk, Wv, Wo, bq, bk, bv, bo = _np_weights(w, meta)
    additive = meta.get("scoring") == "additive"
    if additive:
        aq, ak, av = _np_scoring(w, h)
    assert Wq.shape == (E, int(meta["query_size"]))
    assert Wk.shape == (E, int(meta["key_size"]))
    assert Wv.shape == (E, int(meta["value_size"]))
    X = io["queries"].astype(np.float64)
    Kx = io["keys"].astype(np.float64) if "keys" in io else X
    Vx = io["values"].astype(np.float64) if "values" in io else X
    B, Q, _ = X.shape
    K = Kx.shape[1]
    q = X @ Wq.T + bq
    k = Kx @ Wk.T + bk
    v = Vx @ Wv.T + bv
    # mask[b, i, j] True = key j visible to query i
    mask = np.ones((B, Q, K), dtype=bool)
    if "valid_lens" in io:
        vl = io["valid_lens"].astype(np.int64)
        vl = np.broadcast_to(vl[:, None], (B, Q)) if vl.ndim == 1 else vl
        mask &= np.arange(K)[None, None, :] < vl[:, :, None]
    if causal:
        mask &= np.arange(K)[None, :] <= np.arange(Q)[:, None]
    heads = []
    for i in range(h):
        qi, ki, vi = (t[..., i * p:(i + 1) * p] for t in (q, k, v))
        if additive:
            qa, ka = qi @ aq[i].T, ki @ ak[i].T  # (B, Q, p_a), (B, K, p_a)
            s = np.tanh(qa[:, :, None, :] + ka[:, None, :, :]) @ av[i]
        else:
            s = np.einsum("bqd,bkd->bqk", qi, ki) / math.sqrt(p)
        s = np.where(mask, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore"):
            e = np.exp(s - m)  # all-masked rows: -inf - -inf = NaN, as in PyTorch
            a = e / e.sum(axis=-1, keepdims=True)
        if additive:
            a = np.where(mask.any(axis=-1, keepdims=True), a, 0.0)  # zero-context rule
        heads.append(a @ vi)
    out = np.concatenate(heads, axis=-1) @ Wo.T + bo
    if meta["naming"] == "torch":
        # all-masked rows -> NaN (PyTorch's behaviour)
        out[~mask.any(axis=-1)] = np.nan
    elif not additive:
        assert mask.any(axis=-1).all(), "d2l fixtures must not contain all-masked rows"
    return out


def verify():
    names = sorted({f.split(".")[0] for f in os.listdir(DATA_DIR) if f.endswith(".io.safetensors")})
    assert names, f"no fixtures in {DATA_DIR}"
    ok = True
    for name in names:
        w, wmeta = read_safetensors(os.path.join(DATA_DIR, f"{name}.weights.safetensors"))
        io, meta = read_safetensors(os.path.join(DATA_DIR, f"{name}.io.safetensors"))
        assert wmeta.get("naming") == meta["naming"]
        assert set(io) <= {"queries", "keys", "values", "valid_lens", "output"}
        assert all(v.dtype == np.float32 for k, v in io.items() if k != "valid_lens")
        assert "valid_lens" not in io or io["valid_lens"].dtype == np.int32
        assert all(v.dtype == np.float32 for v in w.values())
        ref = numpy_reference(w, io, meta)
        got = io["output"].astype(np.float64)
        B, Q = io["queries"].shape[:2]
        assert got.shape == (B, Q, int(meta["num_hiddens"])), got.shape
        nan_ref, nan_got = np.isnan(ref), np.isnan(got)
        fin = ~nan_ref
        diff = float(np.max(np.abs(ref[fin] - got[fin]), initial=0.0))
        nan_rows = int(np.isnan(ref).all(axis=-1).sum())
        good = np.array_equal(nan_ref, nan_got) and diff < VERIFY_TOL
        ok &= good
        print(f"{'OK  ' if good else 'FAIL'} {name:22s} naming={meta['naming']:5s} "
              f"out={tuple(got.shape)} max|diff|={diff:.3g} nan_rows={nan_rows}")
    if not ok:
        sys.exit(1)
    print("all fixtures verified")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verify", action="store_true",
                    help="only re-check existing files with the numpy float64 reference")
    args = ap.parse_args()
    if not args.verify:
        generate()
    verify()


if __name__ == "__main__":
    main()
