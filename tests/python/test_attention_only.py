"""The attention-only worker from Python (issue 35): attend(..., return_lse=True) and
sessions with return_lse on a projections NONE model, checked against a float64
softmax written here; mha_serve.merge_attention against one call over all keys."""

import grpc
import numpy as np
import pytest

import mha_serve

from conftest import TIMEOUT

H, G, D = 8, 2, 16  # query heads, key/value heads, head size
E, EKV = H * D, G * D


def reference(q, k, v, lens=None):
    """(B, Q, h*d) contexts and (B, h, Q) lse in float64: query t of head i sees keys
    j < lens[b, t] of key/value head i // (h // G); none: context 0, lse -inf."""
    b_, q_, _ = q.shape
    k_ = k.shape[1]
    qh = q.reshape(b_, q_, H, D).astype(np.float64)
    kh = np.repeat(k.reshape(b_, k_, G, D), H // G, axis=2).astype(np.float64)
    vh = np.repeat(v.reshape(b_, k_, G, D), H // G, axis=2).astype(np.float64)
    s = np.einsum("bqhd,bkhd->bhqk", qh, kh) / np.sqrt(D)
    if lens is not None:
        seen = np.arange(k_)[None, None, :] < np.asarray(lens)[:, :, None]  # (B, Q, K)
        s = np.where(seen[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - safe)
    total = p.sum(-1, keepdims=True)
    lse = np.where(total[..., 0] > 0, safe[..., 0] + np.log(np.maximum(total[..., 0], 1e-300)),
                   -np.inf)
    a = np.where(total > 0, p / np.maximum(total, 1e-300), 0.0)
    ctx = np.einsum("bhqk,bkhd->bqhd", a, vh).reshape(b_, q_, E)
    return ctx, lse


def close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    inf = np.isinf(a) | np.isinf(b)
    assert np.array_equal(a[inf], b[inf])
    return np.abs(a[~inf] - b[~inf]).max(initial=0.0) <= tol


@pytest.fixture(scope="module")
def worker(serve, tmp_path_factory):
    root = tmp_path_factory.mktemp("worker_models")
    (root / "worker").mkdir()
    (root / "worker" / "config.pbtxt").write_text(
        f"num_hiddens: {E} num_heads: {H} num_kv_heads: {G} projections: NONE")
    return serve(f"--model_repository={root}", "--default_warmup=false")


def test_merge_attention_equals_the_softmax_over_the_union():
    # No server: two float64 halves merged against the whole (1e-6 in float32 output).
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, E)).astype(np.float32)
    k = rng.standard_normal((2, 50, EKV)).astype(np.float32)
    v = rng.standard_normal((2, 50, EKV)).astype(np.float32)
    lens_first = np.array([[0, 20, 20], [20, 20, 0]])  # rows with no key in one part
    lens_second = np.array([[30, 0, 30], [30, 30, 0]])
    c1, l1 = reference(q, k[:, :20], v[:, :20], lens_first)
    c2, l2 = reference(q, k[:, 20:], v[:, 20:], lens_second)
    out, lse = mha_serve.merge_attention(c1, l1, c2, l2)
    # The union: keys 0..20 when the first part saw them, then the second part's.
    keep = np.concatenate([np.arange(20) < lens_first[..., None],
                           np.arange(30) < lens_second[..., None]], -1)  # (B, Q, 50)
    want_c, want_l = np.zeros((2, 3, E)), np.zeros((2, H, 3))
    for b in range(2):
        for t in range(3):
            idx = np.flatnonzero(keep[b, t])
            c, l = reference(q[b:b + 1, t:t + 1], k[b:b + 1, idx], v[b:b + 1, idx])
            want_c[b, t], want_l[b, :, t] = c[0, 0], l[0, :, 0]
    assert close(out, want_c, 1e-6)
    assert close(lse, want_l, 1e-5)
    assert lse[1, 0, 2] == -np.inf and np.all(out[1, 2] == 0)  # no key anywhere
    with pytest.raises(ValueError):
        mha_serve.merge_attention(c1, l1, c2[:, :2], l2)


def test_attend_returns_lse_and_calls_merge_into_one(worker):
    rng = np.random.default_rng(1)
    q = rng.uniform(-1, 1, (1, 2, E)).astype(np.float32)
    k = rng.uniform(-2, 2, (1, 60, EKV)).astype(np.float32)
    v = rng.uniform(-1, 1, (1, 60, EKV)).astype(np.float32)
    with mha_serve.Client(worker, timeout=TIMEOUT) as client:
        lens = np.array([[0, 60]], np.int32)
        out, lse = client.attend(q, k, v, valid_lens=lens, model="worker", return_lse=True)
        want_c, want_l = reference(q, k, v, lens)
        assert out.shape == (1, 2, E) and lse.shape == (1, H, 2)
        assert close(out, want_c, 1e-4) and close(lse, want_l, 1e-4)
        assert np.all(lse[0, :, 0] == -np.inf) and np.all(out[0, 0] == 0)
        out, attention, lse = client.attend(q, k, v, model="worker", return_attention=True,
                                            return_lse=True)
        assert attention.shape == (1, H, 2, 60)
        c1, l1 = client.attend(q, k[:, :25], v[:, :25], model="worker", return_lse=True)
        c2, l2 = client.attend(q, k[:, 25:], v[:, 25:], model="worker", return_lse=True)
        merged, merged_lse = mha_serve.merge_attention(c1, l1, c2, l2)
        assert close(merged, out, 1e-5) and close(merged_lse, lse, 1e-5)
        assert not close(c1, out, 1e-3)


def test_return_lse_on_a_full_model_is_refused(default_target):
    with mha_serve.Client(default_target, timeout=TIMEOUT) as client:  # the embedded toy
        with pytest.raises(mha_serve.Error) as error:
            client.attend(np.zeros((1, 1, 100)), return_lse=True)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details.startswith("return_lse:")


def test_session_steps_return_lse_and_merge_with_attend(worker):
    rng = np.random.default_rng(2)
    n, recent = 40, 10
    q = rng.uniform(-1, 1, (n, E)).astype(np.float32)
    k = rng.uniform(-2, 2, (n + recent, EKV)).astype(np.float32)
    v = rng.uniform(-1, 1, (n + recent, EKV)).astype(np.float32)
    with mha_serve.Client(worker, timeout=TIMEOUT) as client:
        with client.session(model="worker", kind="cross", causal=True, return_lse=True) as s:
            out, lse = s.step(q[:n - 1], k[:n - 1], v[:n - 1])
            assert out.shape == (n - 1, E) and lse.shape == (H, n - 1)
            step, step_lse = s.step(q[n - 1:], k[n - 1:n], v[n - 1:n])
        other, other_lse = client.attend(q[None, n - 1:], k[None, n:], v[None, n:],
                                         model="worker", return_lse=True)
        full, full_lse = client.attend(q[None, n - 1:], k[None], v[None], model="worker",
                                       return_lse=True)
        merged, merged_lse = mha_serve.merge_attention(step[None], step_lse[None], other,
                                                       other_lse)
        assert close(merged, full, 1e-5) and close(merged_lse, full_lse, 1e-5)
