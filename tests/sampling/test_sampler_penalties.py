"""Sampler details the engine tests do not reach: repetition / presence / frequency penalties (numpy and
torch give the same logits), min-p, top-p on a flat distribution (the bisection path), processors that
watch each chosen token."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgen.sampling import Sampler, SamplingParams

torch = pytest.importorskip("torch")


def logits() -> np.ndarray:
    return np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 4.0], dtype=np.float32)


def test_penalties_exact_values_and_numpy_equals_torch():
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    assert p.has_penalties
    outs = []
    for as_torch in (False, True):
        s = Sampler(p, prompt_ids=[0, 1])  # prompt tokens count for the repetition penalty only
        for t in (3, 3, 4):
            s.accept(t)
        x = torch.from_numpy(logits()) if as_torch else logits()
        y = s.process(x)
        outs.append(y.numpy() if as_torch else y)
    want = logits()
    want[0] /= 2.0  # seen in the prompt, positive: divided
    want[1] *= 2.0  # seen, negative: multiplied
    want[3] = want[3] / 2.0 - (0.5 + 0.25 * 2)  # generated twice
    want[4] = want[4] * 2.0 - (0.5 + 0.25 * 1)  # generated once, negative
    np.testing.assert_allclose(outs[0], want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(outs[1], want, rtol=0, atol=1e-6)
    assert logits()[3] == 3.0  # process() never changes its input


def test_no_penalties_leave_logits_unchanged():
    s = Sampler(SamplingParams(), prompt_ids=[0, 1])
    s.accept(3)
    np.testing.assert_array_equal(s.process(logits()), logits())
    np.testing.assert_array_equal(s.process(torch.from_numpy(logits())).numpy(), logits())


@pytest.mark.parametrize("as_torch", [False, True])
def test_min_p_never_samples_below_the_threshold(as_torch):
    x = np.log(np.array([0.5, 0.3, 0.12, 0.05, 0.03], dtype=np.float32))
    arr = torch.from_numpy(x) if as_torch else x
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.2, seed=0))  # keeps p >= 0.1
    seen = {s.sample(arr) for _ in range(300)}
    assert seen == {0, 1, 2}


def test_processors_see_each_choice_through_accept():
    class Watch:
        def __init__(self):
            self.seen: list[int] = []
            self.calls: list[list[int]] = []

        def __call__(self, x, generated):
            self.calls.append(list(generated))
            return x

        def accept(self, token):
            self.seen.append(token)

    w = Watch()
    s = Sampler(SamplingParams(), processors=[w])
    assert [s.sample(logits()) for _ in range(3)] == [7, 7, 7]
    assert w.seen == [7, 7, 7] and w.calls == [[], [7], [7, 7]]
