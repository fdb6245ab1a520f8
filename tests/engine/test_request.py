"""The per-request record of the batching engine (`engine/request.py`): what happens when a token is
sampled (EOS, stop strings across pieces, max_new_tokens, the context length, streaming, logits) and which
tokens the cache holds when it finishes. Exact values, a scripted detokenizer, no model."""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import pytest

from onnxgen.engine.request import Request, Status, StopScanner, to_host
from onnxgen.sampling import Sampler, SamplingParams

VOCAB = 16
EOS = 2


class Pieces:
    """A detokenizer whose text for token t is PIECES[t]; `tail` is what `flush` returns (held bytes)."""

    PIECES: ClassVar[dict[int, str]] = {
        3: "he",
        4: "llo",
        5: " wor",
        6: "ld",
        7: "!",
        8: "EN",
        9: "D",
        10: "",
    }

    def __init__(self, tail: str = "") -> None:
        self.tail = tail
        self.pushed: list[int] = []

    def push(self, token: int) -> str:
        self.pushed.append(token)
        return self.PIECES.get(token, "?")

    def flush(self) -> str:
        out, self.tail = self.tail, ""
        return out


def one_hot(token: int) -> np.ndarray:
    x = np.zeros(VOCAB, dtype=np.float32)
    x[token] = 5.0
    return x


def request(prompt=(11, 12, 13), *, max_new=8, context=64, stop=(), tail="", **kw) -> Request:
    return Request(
        prompt=list(prompt),
        digest=b"d",
        sampler=Sampler(SamplingParams()),
        detokenizer=Pieces(tail),
        max_new_tokens=max_new,
        context_length=context,
        eos_ids=frozenset({EOS}),
        stop=stop,
        **kw,
    )


def feed(req: Request, tokens: list[int]) -> list[bool]:
    """Sample `tokens` one after another (as if each was the argmax), advancing `computed` like a step,
    until the request finishes."""
    out = []
    for t in tokens:
        req.computed = req.num_tokens
        out.append(req.accept(one_hot(t)))
        if out[-1]:
            break
    return out


def test_positions_before_and_after_sampling():
    r = request()
    assert r.tokens == [11, 12, 13] and r.num_tokens == 3 and r.pending == 3 and r.fed == []
    assert r.status is Status.WAITING and r.finish_reason is None and not r.cancelled
    r.computed = 3
    assert r.pending == 0
    assert r.accept(one_hot(3)) is False
    assert r.output == [3] and r.tokens == [11, 12, 13, 3] and r.num_tokens == 4 and r.pending == 1
    assert r.fed == [11, 12, 13]  # the sampled token was never fed
    assert r.t_first > 0


def test_eos_finishes_with_stop_and_is_neither_streamed_nor_text():
    streamed: list[str] = []
    r = request(on_token=streamed.append)
    assert feed(r, [3, 4, EOS]) == [False, False, True]
    assert r.finish_reason == "stop" and r.text == "hello" and "".join(streamed) == "hello"
    assert r.detokenizer.pushed == [3, 4]  # EOS never reaches the detokenizer
    assert r.fed == [11, 12, 13, 3, 4]  # prompt + every generated token but the last


def test_max_new_tokens_finishes_with_length_after_exactly_that_many():
    r = request(max_new=3)
    assert feed(r, [3, 4, 5]) == [False, False, True]
    assert r.finish_reason == "length" and r.output == [3, 4, 5] and r.text == "hello wor"


def test_the_context_length_bounds_prompt_plus_output():
    r = request(prompt=range(20, 27), context=10)  # 7 prompt tokens: 3 more fit
    assert feed(r, [3, 4, 5]) == [False, False, True]
    assert r.finish_reason == "length" and r.num_tokens == 10
    r = request(prompt=range(20, 26), context=10, max_new=100)
    assert feed(r, [3, 4, 5, 6]) == [False, False, False, True]
    assert r.num_tokens == 10


def test_a_stop_string_across_pieces_ends_the_text_before_it():
    streamed: list[str] = []
    r = request(stop=["END"], on_token=streamed.append)
    assert feed(r, [3, 4, 8, 9, 5]) == [False, False, False, True]
    assert r.finish_reason == "stop"
    assert r.output == [3, 4, 8, 9]  # stopped at the piece completing "END"; nothing sampled after
    assert r.text == "hello" and "".join(streamed) == "hello"


def test_text_that_may_start_a_stop_string_is_held_back_then_released():
    streamed: list[str] = []
    r = request(stop=["ENX"], max_new=3, on_token=streamed.append)
    feed(r, [3, 8])
    assert "".join(streamed) == "he"  # "EN" may begin "ENX": held
    feed(r, [9])  # "END" is not "ENX": released at the finish (length)
    assert r.finish_reason == "length" and r.text == "heEND" and "".join(streamed) == "heEND"


def test_the_flushed_tail_is_streamed_and_may_complete_a_stop_string():
    streamed: list[str] = []
    r = request(max_new=1, tail="!", on_token=streamed.append)
    feed(r, [3])
    assert r.finish_reason == "length" and r.text == "he!" and "".join(streamed) == "he!"
    streamed.clear()
    r = request(max_new=2, tail="D", stop=["END"], on_token=streamed.append)
    feed(r, [3, 8])
    assert r.finish_reason == "stop" and r.text == "he" and "".join(streamed) == "he"


def test_empty_pieces_are_not_streamed():
    calls: list[str] = []
    r = request(max_new=2, on_token=calls.append)
    feed(r, [10, 10])
    assert calls == [] and r.text == ""


def test_output_logits_are_float32_host_copies_of_each_step():
    r = request(output_logits=True, max_new=2)
    raw = one_hot(3)
    r.computed = 3
    r.accept(raw)
    raw[:] = 0  # the request kept a copy, not a view
    feed(r, [4])
    assert len(r.logits) == 2 and all(x.dtype == np.float32 for x in r.logits)
    assert int(np.argmax(r.logits[0])) == 3 and int(np.argmax(r.logits[1])) == 4
    assert request().logits == []


def test_to_host_copies_numpy_and_torch_logits():
    x = np.arange(4, dtype=np.float16)
    y = to_host(x)
    assert y.dtype == np.float32 and y.tolist() == [0, 1, 2, 3] and y is not x
    torch = pytest.importorskip("torch")
    t = torch.arange(4, dtype=torch.bfloat16)
    z = to_host(t)
    assert isinstance(z, np.ndarray) and z.dtype == np.float32 and z.tolist() == [0, 1, 2, 3]


def test_cancel_wait_and_identity():
    ev = threading.Event()
    r = request(cancel=ev)
    assert not r.cancelled
    ev.set()
    assert r.cancelled
    assert not r.wait(0.01)
    r.done.set()
    assert r.wait(0)
    a, b = request(), request()
    assert a.id != b.id and a != b  # records compare by identity
    with pytest.raises(AssertionError):
        request(prompt=())


def test_stop_scanner_holds_back_partial_matches_and_cuts_at_the_first_hit():
    s = StopScanner(["END", "", "STOP"])
    assert s.stops == ["END", "STOP"]
    assert s.feed("abc E") == ("abc ", False)
    assert s.feed("N") == ("", False)
    assert s.feed("X S") == ("ENX ", False)
    assert s.feed("TOP and END") == ("", True)
    assert s.text == "abc ENX "
    s = StopScanner([])
    assert s.feed("E") == ("E", False) and s.flush() == ""
    s = StopScanner(["ab"])
    assert s.feed("xa") == ("x", False) and s.flush() == "a" and s.flush() == ""


def _from_loop(name: str):
    """The old decode loop's copy of a helper (`engine/loop.py`, while it exists), else None."""
    import importlib

    try:
        return getattr(importlib.import_module("onnxgen.engine.loop"), name, None)
    except ModuleNotFoundError:
        return None


def _scanners():
    """The stop-string scanner of the batching engine's Request (and of the old decode loop, if any)."""
    return [f for f in (StopScanner, _from_loop("_StopScanner")) if f is not None]


def _to_hosts():
    return [f for f in (to_host, _from_loop("_to_host")) if f is not None]


@pytest.mark.parametrize("scanner", _scanners())
def test_stop_scanner_exact_cuts(scanner):
    s = scanner(["END"])
    assert s.feed("ENDx") == ("", True) and s.text == "" and s.flush() == ""  # a stop at the very start
    s = scanner(["END"])
    assert s.feed("ab") == ("ab", False)
    assert s.feed("cENDx") == ("c", True)  # everything before the stop, nothing after
    assert s.text == "abc" and s.flush() == ""
    s = scanner(["END"])
    assert s.feed("abE") == ("ab", False)  # "E" may start "END": held back
    assert s.flush() == "E" and s.flush() == ""  # released once, at the end
    s = scanner(["END", "XY"])
    assert s.feed("aX") == ("a", False)
    assert s.feed("EN") == ("X", False)  # "X" no longer starts "XY"; "EN" may start "END"
    assert s.feed("D") == ("", True) and s.text == "aX"
    s = scanner(["longer stop", "S"])
    assert s.feed("xxxxxxxxxxxxxxS") == ("xxxxxxxxxxxxxx", True)  # the earliest hit wins
    s = scanner(["ab"])
    assert s.feed("xxxxxxxxxxxxxxxxa") == ("xxxxxxxxxxxxxxxx", False)
    assert s.feed("b") == ("", True) and s.text == "xxxxxxxxxxxxxxxx"  # a stop across two feeds, far along


@pytest.mark.parametrize("host", _to_hosts())
def test_to_host_copies_float32_too(host):
    x = np.arange(4, dtype=np.float32)
    y = host(x)
    x[:] = 9
    assert y.tolist() == [0, 1, 2, 3]  # a copy, never a view of the decoder's reused buffer


def test_defaults_keep_no_logits_and_reuse():
    r = request(max_new=2)
    feed(r, [3, 4])
    assert r.logits == [] and r.reuse and r.cached == 0 and r.admissions == 0


def test_text_after_a_stop_string_stays_out_even_when_the_detokenizer_holds_more():
    streamed: list[str] = []
    r = request(stop=["END"], tail="!", on_token=streamed.append)
    assert feed(r, [3, 8, 9]) == [False, False, True]
    assert r.finish_reason == "stop" and r.text == "he" and "".join(streamed) == "he"


def test_the_scheduler_needs_room_for_one_request_and_one_token():
    from onnxgen.engine.scheduler import Scheduler

    for bad in ({"max_running": 0, "token_budget": 8}, {"max_running": 1, "token_budget": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            Scheduler(None, preempt=False, **bad)
    s = Scheduler(None, max_running=1, token_budget=1, preempt=False)
    assert (s.max_running, s.token_budget) == (1, 1) and not s.has_work() and s.num_waiting() == 0
    s.add(request())
    s.add(request())
    assert s.has_work() and s.num_waiting() == 2  # queued from any thread, not yet scheduled
