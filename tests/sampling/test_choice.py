"""Token choice (`onnxgen.sampling.choice`): greedy or an exponential race over a hash of (seed, step,
token). The same token from numpy and torch, alone or in a batch of rows with other settings, and the
right distribution."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxgen.sampling.choice import choose_numpy, choose_rows, race_noise_numpy
from onnxgen.sampling.params import SamplingParams

torch = pytest.importorskip("torch")

PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 5, 50]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    min_p=st.sampled_from([0.0, 0.05]),
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(PARAMS, st.integers(0, 2**64 - 1), st.integers(0, 10_000)), min_size=1, max_size=6
    ),
    data=st.integers(0, 2**32 - 1),
)
def test_numpy_torch_batch_and_alone_choose_the_same_token(rows, data) -> None:
    logits = np.random.default_rng(data).normal(size=(len(rows), 300)).astype(np.float32) * 3
    params, seeds, steps = zip(*rows, strict=True)
    alone_np = [choose_numpy(p, s, t, logits[i]) for i, (p, s, t) in enumerate(rows)]
    batch = choose_rows(list(params), list(seeds), list(steps), torch.from_numpy(logits))
    alone_torch = [
        choose_rows([p], [s], [t], torch.from_numpy(logits[i : i + 1]))[0] for i, (p, s, t) in enumerate(rows)
    ]
    assert alone_np == batch == alone_torch


def test_draws_follow_the_distribution_and_the_filters() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    n = 20_000
    free = np.bincount(
        [choose_numpy(SamplingParams(temperature=1.0), 7, t, logits) for t in range(n)], minlength=4
    )
    assert np.allclose(free / n, probs, atol=0.015)
    top2 = {choose_numpy(SamplingParams(temperature=1.0, top_k=2), 7, t, logits) for t in range(2000)}
    nucleus = {choose_numpy(SamplingParams(temperature=1.0, top_p=0.7), 7, t, logits) for t in range(2000)}
    assert top2 == {0, 1} and nucleus == {0, 1}
    assert choose_numpy(SamplingParams(temperature=0.0), 7, 0, logits) == 0


def test_noise_depends_on_seed_step_and_token_only() -> None:
    a, b = race_noise_numpy(1, 2, 64), race_noise_numpy(1, 2, 128)
    assert np.array_equal(a, b[:64]), "a token's draw does not depend on the vocabulary size"
    assert not np.array_equal(a, race_noise_numpy(1, 3, 64)) and not np.array_equal(
        a, race_noise_numpy(2, 2, 64)
    )
    assert (a > 0).all() and abs(float(np.mean(race_noise_numpy(5, 5, 100_000))) - 1.0) < 0.02  # Exp(1)


@pytest.mark.gpu
def test_cuda_batch_chooses_what_numpy_chooses() -> None:
    rng = np.random.default_rng(4)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t in (0.0, 0.7, 1.3)
        for k in (0, 40)
        for p in (1.0, 0.9)
    ]
    for step in range(30):
        logits = rng.normal(size=(len(params), 49152)).astype(np.float32) * 4
        seeds = list(range(100, 100 + len(params)))
        want = [
            choose_numpy(p, s, step, logits[i]) for i, (p, s) in enumerate(zip(params, seeds, strict=True))
        ]
        assert choose_rows(params, seeds, [step] * len(params), torch.from_numpy(logits).cuda()) == want
