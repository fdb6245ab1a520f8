"""Engine behaviour found untested by the mutation run (benchmarks/mutation.py, docs/mutation.md), through
the public API: what `Result.stats` reports."""

from __future__ import annotations

import time

import pytest

import onnxgen
from tests.conftest import native_available
from tests.harness import stepper

NATIVE = pytest.mark.skipif(not native_available(), reason="the native backend needs torch")

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
    r = tiny.generate(
        list(range(3, 40)), max_new_tokens=n, reuse=False, processors=[Slow(tiny.eos_token_ids)]
    )
    st = r.stats
    assert st.generated_tokens == n == len(r.tokens) and r.finish_reason == "length"
    assert STEP <= st.ttft_s < 1.5 * STEP  # one sample (after the prefill), not two
    assert st.ttft_s < st.total_s
    # decode: the n - 1 tokens after the first, each one step
    assert (n - 1) / ((n - 1) * STEP * 1.5) < st.decode_tok_s <= (n - 1) / ((n - 1) * STEP)
    assert n * STEP <= st.total_s < 60
    assert st.prompt_tokens == 37 and st.prefilled_tokens == 37 and st.reused_tokens == 0
    assert st.backend == "ort" and st.device == "cpu" and st.chunk_size is None
    line = st.line()
    assert "37 in" in line and "0 reused (0%)" in line and f"{n} out" in line and "ort/cpu" in line


def test_one_token_has_no_decode_rate_and_two_have_one(tiny):
    r = tiny.generate(list(range(3, 40)), max_new_tokens=1, reuse=False)
    assert r.stats.generated_tokens == 1 and r.stats.decode_tok_s == 0.0 and r.stats.ttft_s > 0
    r = tiny.generate(
        list(range(3, 40)), max_new_tokens=2, reuse=False, processors=[NoEos(tiny.eos_token_ids)]
    )
    assert r.stats.generated_tokens == 2 and r.stats.decode_tok_s > 0
    assert r.logits is None  # logits only when asked


def test_text_held_back_for_a_possible_stop_string_is_streamed_at_the_end(tiny):
    prompt = list(range(3, 40))
    ref = tiny.generate(prompt, max_new_tokens=12, reuse=False)
    assert ref.text, "the reference reply has no text"
    stop = ref.text[-1] + "\u0007"  # the reply's last character may start it, so it is held back...
    streamed: list[str] = []
    r = tiny.generate(prompt, max_new_tokens=12, reuse=False, stop=[stop], on_token=streamed.append)
    assert r.text == ref.text and r.tokens == ref.tokens and r.finish_reason == ref.finish_reason
    assert "".join(streamed) == r.text  # ...and streamed when generation ends without it


class NoEos:
    def __init__(self, eos):
        self.eos = list(eos)

    def __call__(self, logits, generated):
        logits[self.eos] = -1e9
        return logits


def test_default_max_new_tokens_is_256(tiny):
    r = tiny.generate([5, 6, 7], reuse=False, processors=[NoEos(tiny.eos_token_ids)])
    assert len(r.tokens) == 256 and r.finish_reason == "length"


def test_load_retains_eight_sessions_by_default(tiny_dir):
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    sessions = [m.session() for _ in range(9)]
    for i, s in enumerate(sessions):
        s.generate([3 + i, 4, 5, 6], max_new_tokens=1)
    assert [s.retained_tokens > 0 for s in sessions] == [False] + [True] * 8


def test_token_id_prompts_are_checked_against_the_vocabulary(tiny):
    v = tiny.spec.vocab_size
    assert (
        tiny.generate([0, v - 1], max_new_tokens=1, reuse=False).stats.prompt_tokens == 2
    )  # both ends are ids
    for prompt, bad in (
        ([5, v], v),
        ([5, -1], -1),
        ([5, v + 7, -3], v + 7),
        ([-3, v + 7], -3),
        ([0, v, 1], v),
    ):
        with pytest.raises(
            onnxgen.errors.InvalidRequest, match=rf"token id {bad} is outside the vocabulary \[0, {v}\)"
        ):
            tiny.generate(prompt, max_new_tokens=1)


@pytest.mark.parametrize("backend", ["ort", "native"])
def test_a_session_turn_checks_the_ids_past_its_history(tiny_dir, backend):
    """A turn whose ids start with the session's last context checks only the ids past it (those were
    checked before), and still names a bad new id, a float or a bool among them."""
    m = onnxgen.load(str(tiny_dir), backend=backend, threads=1)
    v, s = m.spec.vocab_size, m.session()
    r = s.generate([3, 4, 5, 6], max_new_tokens=2)
    ctx = [3, 4, 5, 6, *r.tokens]
    with pytest.raises(onnxgen.errors.InvalidRequest, match=rf"token id {v} is outside the vocabulary"):
        s.generate([*ctx, 7, v], max_new_tokens=1)
    for bad in (1.5, True, "x"):
        with pytest.raises(onnxgen.errors.InvalidRequest, match="prompt must be a string"):
            s.generate([*ctx, bad], max_new_tokens=1)
    assert s.generate([*ctx, 7, 8], max_new_tokens=1).stats.prompt_tokens == len(ctx) + 2


def test_ids_beyond_int64_are_named_and_long_ones_abbreviated(tiny):
    cases = [
        ([5, 2**63], str(2**63)),
        ([-(2**63), 2**64], str(2**64)),  # -(2**63) is an int64: the id named is the one beyond
        ([5, -(2**63) - 1], str(-(2**63) - 1)),
        ([5, 10**23 * 2**8], str(10**23 * 2**8)),  # 26 digits: abbreviated below
    ]
    for prompt, shown in cases:
        with pytest.raises(onnxgen.errors.InvalidRequest) as e:
            tiny.generate(prompt, max_new_tokens=1)
        text = shown if len(shown) <= 24 else f"{shown[:12]}...({len(shown)} digits)"
        assert f"token id {text} is outside the vocabulary" in str(e.value)
    with pytest.raises(onnxgen.errors.InvalidRequest, match=r"token id 1{24} is outside"):
        tiny.generate([int("1" * 24)], max_new_tokens=1)  # 24 digits: shown whole
    with pytest.raises(onnxgen.errors.InvalidRequest, match=r"token id 1{12}\.\.\.\(25 digits\)"):
        tiny.generate([int("1" * 25)], max_new_tokens=1)


@pytest.mark.parametrize(
    "prompt", [[1, "a"], [1.5, 2], [True, 2], [None], 42, [{"role": "user", "content": "x"}, 3]]
)
def test_prompts_of_no_known_form_are_invalid(tiny, prompt):
    with pytest.raises(onnxgen.errors.InvalidRequest, match="prompt must be a string"):
        tiny.generate(prompt, max_new_tokens=1)


def test_the_tool_call_format_is_read_off_the_packages_template(tiny_dir, tmp_path):
    import shutil

    assert onnxgen.load(str(tiny_dir), backend="ort", threads=1).tool_format.name == "hermes"  # nothing told
    pkg = tmp_path / "mistral"
    shutil.copytree(tiny_dir, pkg)
    template = pkg / "chat_template.jinja"
    template.write_text("{# calls are written as [TOOL_CALLS] [...] #}" + template.read_text())
    assert onnxgen.load(str(pkg), backend="ort", threads=1).tool_format.name == "mistral"
    forced = onnxgen.load(str(pkg), backend="ort", threads=1, tool_parser="llama3_json")
    assert forced.tool_format.name == "llama3_json"  # the caller's choice wins


def test_load_checks_the_batching_limits(tiny_dir):
    for name in ("max_running", "max_batch_tokens"):
        for bad in (0, -1, "2", 1.5):
            with pytest.raises(onnxgen.errors.InvalidRequest, match=f"{name} must be an int >= 1"):
                onnxgen.load(str(tiny_dir), backend="ort", threads=1, **{name: bad})
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1, max_running=1, max_batch_tokens=1)
    assert m.generate([5, 6, 7], max_new_tokens=2, reuse=False).stats.generated_tokens >= 1


def test_a_fresh_ort_engine_has_one_idle_decoder(tiny_dir):
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    assert m.kv_stats()["idle_decoders"] == 1  # the decoder made at load waits for the first request


def test_reused_fraction_and_the_result_record(tiny):
    from onnxgen.engine.output import Result

    s = tiny.session()
    prompt = list(range(3, 43))
    s.generate(prompt, max_new_tokens=2)
    r = s.generate(prompt, max_new_tokens=2, output_logits=True)
    assert r.stats.reused_tokens == 39 and r.stats.reused_fraction == 39 / 40
    assert "39 reused (98%)" in r.stats.line()
    assert r.content == r.text and r.tool_calls == []  # no tools: the content is the text
    text = repr(r)
    assert "prompt_ids" not in text and "logits" not in text  # big arrays stay out of the repr
    base = dict(text="hi", tokens=[1], finish_reason="stop", stats=r.stats)
    assert Result(**base).content == "hi"
    assert Result(**base, content="x").content == "x"
    assert Result(**base, tool_calls=["call"]).content is None  # calls and no text around them


def test_step_says_whether_there_was_work(tiny_dir):
    m = stepper(tiny_dir, backend="ort", threads=1)
    assert m.step() is False  # nothing queued
    p = m.submit([5, 6, 7], max_new_tokens=3, reuse=False)
    steps = 0
    while not p.done():
        assert m.step() is True
        steps += 1
    assert steps >= 1 and m.step() is False
    assert p.result().stats.generated_tokens >= 1
    ev = __import__("threading").Event()
    q = m.submit([5, 6, 7], max_new_tokens=3, reuse=False, cancel=ev)
    ev.set()
    assert m.step() is True and q.done()  # a step that only finds a cancelled request still did work
    with pytest.raises(onnxgen.errors.Cancelled):
        q.result()


def test_loops_are_stopped_and_joined_at_interpreter_exit(tiny_dir):
    """`engine.loop.stop_all` (an atexit hook): every live model's loop thread ends and is joined before the
    interpreter finalizes, so no daemon thread is left inside a step's native code (which aborts the process
    there: "terminate called without an active exception")."""
    from onnxgen.engine import loop

    models = [onnxgen.load(str(tiny_dir), device="cpu") for _ in range(2)]
    for m in models:
        assert len(m.generate([1, 2, 3], max_new_tokens=2, temperature=0).tokens) == 2
    threads = [m._loop.thread for m in models]
    assert all(t is not None and t.is_alive() for t in threads)
    loop.stop_all()
    assert not any(t.is_alive() for t in threads)
    for m in models:
        m.close()


@pytest.mark.parametrize("backend", ["ort", pytest.param("native", marks=NATIVE)])
def test_a_closed_and_dropped_model_is_freed_at_the_next_collection(tiny_dir, backend):
    """`close()` returns once the loop thread has let go of the engine (right after a result is delivered it may
    still be finishing that step), so dropping the model and collecting frees the engine, its caches and its
    weights there and then (a benchmark that loads another model next relies on it)."""
    import gc
    import weakref

    for i in range(8):
        m = onnxgen.load(str(tiny_dir), backend=backend)
        m.generate([5, 6, 7, 8 + i], max_new_tokens=3, temperature=0)
        engine = weakref.ref(m._engine)
        m.close()
        del m
        gc.collect()
        assert engine() is None, f"round {i}: the engine outlived its model's close, drop and collection"
