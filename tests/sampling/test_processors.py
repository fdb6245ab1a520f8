"""Logit bias and logprob recording on numpy and torch logits, checked against direct computation."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgen.errors import InvalidRequest
from onnxgen.sampling import Sampler, SamplingParams
from onnxgen.sampling.processors import LogitBias, LogprobsRecorder

V = 97


def logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(V).astype(np.float32) * 3


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def test_logit_bias_numpy_and_torch():
    x = logits()
    bias = {3: 5.0, 10: -100.0, 50: 0.5}
    want = x.copy()
    for k, v in bias.items():
        want[k] += v
    assert np.allclose(LogitBias(bias, V)(x.copy(), []), want)
    torch = pytest.importorskip("torch")
    got = LogitBias(bias, V)(torch.from_numpy(x.copy()), []).numpy()
    assert np.allclose(got, want)


@pytest.mark.parametrize("bad", [{V: 1.0}, {-1: 1.0}, {3: 101.0}, {"x": 1.0}])
def test_logit_bias_rejects_bad_values(bad):
    with pytest.raises(InvalidRequest) as exc:
        LogitBias(bad, V)
    assert exc.value.field == "logit_bias"


def test_logit_bias_steers_the_sampler():
    x = logits()
    target = int(np.argmin(x))
    s = Sampler(SamplingParams(), processors=[LogitBias({target: 100.0}, V)])
    assert s.sample(x) == target


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_logprobs_recorder_matches_log_softmax(backend):
    steps = [logits(i) for i in range(4)]
    chosen = [int(np.argsort(s)[-2]) for s in steps]  # not the argmax: the recorder must use `generated`
    rec = LogprobsRecorder(top=3)
    conv = (lambda a: a) if backend == "numpy" else pytest.importorskip("torch").from_numpy
    for k, s in enumerate(steps):
        out = rec(conv(s.copy()), chosen[:k])
        assert np.allclose(np.asarray(out), s)  # recording never changes the logits
    entries = rec.finish(chosen)
    assert [e.token for e in entries] == chosen
    for e, s in zip(entries, steps, strict=True):
        lp = log_softmax(s)
        assert e.logprob == pytest.approx(lp[e.token], abs=1e-5)
        order = np.argsort(-lp)[:3]
        assert [t for t, _ in e.top] == order.tolist()
        assert [v for _, v in e.top] == pytest.approx(lp[order].tolist(), abs=1e-5)


def test_logprobs_recorder_resets_per_request_and_validates_top():
    rec = LogprobsRecorder(top=0)
    rec(logits(0), [])
    rec(logits(1), [5])
    assert len(rec.finish([5, 6])) == 2 and rec.entries[0].top == ()
    rec(logits(2), [])  # a new request
    assert rec.finish([7]) == rec.entries and [e.token for e in rec.entries] == [7]
    with pytest.raises(InvalidRequest):
        LogprobsRecorder(top=21)
