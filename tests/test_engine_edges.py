"""Engine behaviour found untested by the mutation run (benchmarks/mutation.py, docs/mutation.md), through
the public API: what `Result.stats` reports."""

from __future__ import annotations

import time

import pytest

import onnxgen

STEP = 0.2  # seconds a processor sleeps before each sample


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return onnxgen.load(str(tiny_dir), backend="ort", threads=1)


class Slow:
    """A logits processor that sleeps `STEP` seconds per sampled token (a slow sampler stand-in)."""

    def __init__(self, eos):
        self.eos = list(eos)

    def __call__(self, logits, generated):
        time.sleep(STEP)
        logits[self.eos] = -1e9  # never stop early: exactly max_new_tokens tokens
        return logits


def test_stats_time_to_first_token_and_decode_rate(tiny):
    n = 4
    r = tiny.generate(list(range(3, 40)), max_new_tokens=n, reuse=False, processors=[Slow(tiny.eos_token_ids)])
    st = r.stats
    assert st.generated_tokens == n == len(r.tokens) and r.finish_reason == "length"
    assert STEP <= st.ttft_s < 1.5 * STEP  # one sample (after the prefill), not two
    assert st.ttft_s < st.total_s
    # decode: the n - 1 tokens after the first, each one step
    assert (n - 1) / ((n - 1) * STEP * 1.5) < st.decode_tok_s <= (n - 1) / ((n - 1) * STEP)
    assert st.total_s >= n * STEP
    assert st.prompt_tokens == 37 and st.prefilled_tokens == 37 and st.reused_tokens == 0
    assert st.backend == "ort" and st.device == "cpu" and st.chunk_size is None
    line = st.line()
    assert "37 in" in line and "0 reused (0%)" in line and f"{n} out" in line and "ort/cpu" in line


def test_one_token_has_no_decode_rate(tiny):
    r = tiny.generate(list(range(3, 40)), max_new_tokens=1, reuse=False)
    assert r.stats.generated_tokens == 1 and r.stats.decode_tok_s == 0.0 and r.stats.ttft_s > 0


def test_text_held_back_for_a_possible_stop_string_is_streamed_at_the_end(tiny):
    prompt = list(range(3, 40))
    ref = tiny.generate(prompt, max_new_tokens=12, reuse=False)
    assert ref.text, "the reference reply has no text"
    stop = ref.text[-1] + "\u0007"  # the reply's last character may start it, so it is held back...
    streamed: list[str] = []
    r = tiny.generate(prompt, max_new_tokens=12, reuse=False, stop=[stop], on_token=streamed.append)
    assert r.text == ref.text and r.tokens == ref.tokens and r.finish_reason == ref.finish_reason
    assert "".join(streamed) == r.text  # ...and streamed when generation ends without it
