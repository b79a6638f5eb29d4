"""Merging partial attentions by their log-sum-exp (issue 35, docs/python.md).

An attention-only model (projections NONE) answers, with return_lse=True, each
head's context and the natural log of its sum of exp(score) over the keys it saw.
Two such answers for the same queries over disjoint key sets (say, old tokens on a
CPU worker and recent ones elsewhere) merge into the attention over all the keys.

    out1, lse1 = client.attend(q, k_old, v_old, model="worker", return_lse=True)
    out2, lse2 = client.attend(q, k_new, v_new, model="worker", return_lse=True)
    out, lse = mha_serve.merge_attention(out1, lse1, out2, lse2)

Needs numpy only.
"""

import numpy as np


def merge_attention(output1, lse1, output2, lse2):
    """Merges two partial attentions of the same queries over disjoint key sets into
    the attention over their union, exactly (up to rounding):

        m = max(l1, l2), w_i = exp(l_i - m),
        output = (w1 output1 + w2 output2) / (w1 + w2), lse = m + log(w1 + w2)

    output_i (..., Q, h * d_h), the heads' contexts concatenated, as an attention-only
    model (projections NONE) answers them; lse_i (..., h, Q), its `lse` (natural log of
    each query's sum of exp(score) over its keys). A query that saw no key in one part
    (lse -inf) takes the other's result; in neither, output 0 and lse -inf. Returns
    (output, lse) as float32 arrays; computed in float64."""
    o1, o2 = np.asarray(output1, np.float64), np.asarray(output2, np.float64)
    l1, l2 = np.asarray(lse1, np.float64), np.asarray(lse2, np.float64)
    if o1.shape != o2.shape or l1.shape != l2.shape:
        raise ValueError(f"shapes differ: outputs {o1.shape} and {o2.shape}, "
                         f"lse {l1.shape} and {l2.shape}")
    heads, queries = l1.shape[-2], l1.shape[-1]
    if o1.shape[-2] != queries or o1.shape[-1] % heads:
        raise ValueError(f"output {o1.shape} does not fit lse {l1.shape}: expected "
                         f"(..., Q, h * d_h) and (..., h, Q)")
    m = np.maximum(l1, l2)
    finite = np.isfinite(m)
    safe = np.where(finite, m, 0.0)
    with np.errstate(invalid="ignore"):
        w1 = np.where(finite, np.exp(l1 - safe), 0.0)
        w2 = np.where(finite, np.exp(l2 - safe), 0.0)
    total = w1 + w2
    lse = np.where(finite, safe + np.log(np.where(finite, total, 1.0)), -np.inf)
    # (..., h, Q) weights onto (..., Q, h, d_h) contexts.
    split = o1.shape[:-1] + (heads, o1.shape[-1] // heads)
    a1 = np.swapaxes(np.where(finite, w1 / np.where(finite, total, 1.0), 0.0), -1, -2)[..., None]
    a2 = np.swapaxes(np.where(finite, w2 / np.where(finite, total, 1.0), 0.0), -1, -2)[..., None]
    out = a1 * o1.reshape(split) + a2 * o2.reshape(split)
    return out.reshape(o1.shape).astype(np.float32), lse.astype(np.float32)
