"""Decode runs (`DecodingConfig.decode_steps`): several decode steps back to back with tokens chosen on the device and
read once per run give exactly what one step at a time gives: the same tokens, text and finish reasons
(greedy and seeded sampling, EOS, stop strings, lengths, requests of one batch finishing at different
steps), and the positions fed after a request finished never reach a later turn (native, paged, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import onnxgen
from tests.conftest import native_available
from tests.harness import Stepper, set_policy, stepper

pytestmark = pytest.mark.skipif(not native_available(), reason="native backend not importable")

PROMPTS = [[5, 9, 2, 33, 7], [11, 4, 4, 80, 3, 19, 21, 6, 2], [100, 3], list(range(40, 77))]


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Stepper:
    """The module's engine (paged, native), driven by the test's own thread; tests switch its decode policy."""
    return stepper(tiny_dir, backend="native", paged=True)


class Spy:
    """Counts the runs of several decode steps the engine launches (and how many follow a launched run)."""

    def __init__(self, model: Any) -> None:
        self.runs: list[int] = []
        self.offsets: list[int] = []
        self.continued = 0
        self._inner = model.executor.launch_decodes
        model.executor.launch_decodes = self

    def __call__(self, chunks: Any, k: int, offset: int = 0, after: Any = None) -> Any:
        self.runs.append(k)
        self.offsets.append(offset)
        self.continued += after is not None
        return self._inner(chunks, k, offset, after)


def batch(model: Any, steps: int, prompts: list[list[int]], first: int | None = None, **kw: Any) -> list[Any]:
    """The prompts submitted at once with `decode_steps` = `steps`, as CUDA would run them (the first run
    launched behind the prompts' step, `launch_first`; `first`: its steps, `first_run_steps`, else the
    default) on the CPU's paged pool."""
    saved = model.pipeline.policy.first_run_steps
    set_policy(model, decode_steps=steps, launch_first=True)
    set_policy(model, first_run_steps=saved if first is None else first)
    try:
        pend = [
            model.submit(p, reuse=False, speculative=False, **{**kw, **extra})
            for p, extra in zip(prompts, kw.pop("per", [{}] * len(prompts)), strict=True)
        ]
        return [p.result() for p in pend]
    finally:
        set_policy(model, decode_steps=1, launch_first=False, first_run_steps=saved)


def tail(model: Stepper) -> Any:
    """The executor's handle of the run the engine left for its next step to wait for (None: none)."""
    run = model.pipeline.tail
    return None if run is None else run.handle


def same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.tokens, x.text, x.finish_reason) == (y.tokens, y.text, y.finish_reason)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0},
        {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 3},
        {"temperature": 1.3, "min_p": 0.05, "seed": 11},
    ],
)
def test_runs_equal_single_steps(model: Any, sampling: dict) -> None:
    """Different max_new_tokens per request: runs shrink to what the closest-to-done request may take."""
    per = [{"max_new_tokens": n} for n in (13, 30, 7, 22)]
    ref = batch(model, 1, PROMPTS, per=per, **sampling)
    spy = Spy(model)
    try:
        got = batch(model, 4, PROMPTS, per=per, **sampling)
    finally:
        model.executor.launch_decodes = spy._inner
    same(got, ref)
    # runs continue one another (launched before the previous is read) down to the last token a request may take
    assert spy.runs and max(spy.runs) == 4 and all(1 <= k <= 4 for k in spy.runs) and spy.continued
    assert [len(r.tokens) for r in got if r.finish_reason == "length"] == [
        n for r, n in zip(got, (13, 30, 7, 22), strict=True) if r.finish_reason == "length"
    ]


def test_stop_strings_and_eos_mid_run(model: Any) -> None:
    """A request that stops inside a run takes only its tokens up to the stop; the batch goes on."""
    ref = batch(model, 1, PROMPTS, max_new_tokens=24, temperature=0)
    stop = ref[1].text[len(ref[1].text) // 2 :][:3]
    eos = ref[3].tokens[9]
    for extra in ({"stop": [stop]}, {"stop": [stop], "per": [{}, {}, {}, {}]}):
        want = batch(model, 1, PROMPTS, max_new_tokens=24, temperature=0, **extra)
        got = batch(model, 8, PROMPTS, max_new_tokens=24, temperature=0, **extra)
        same(got, want)
    assert want[1].finish_reason == "stop" and len(want[1].tokens) < 24
    # EOS: a model whose eos list holds a token the reference emits mid-run
    saved = model.inputs.eos_ids
    model.inputs.eos_ids = (eos,)
    try:
        want = batch(model, 1, PROMPTS, max_new_tokens=24, temperature=0)
        got = batch(model, 8, PROMPTS, max_new_tokens=24, temperature=0)
    finally:
        model.inputs.eos_ids = saved
    same(got, want)
    assert got[3].finish_reason == "stop" and got[3].tokens[-1] == eos and len(got[3].tokens) == 10


@pytest.mark.parametrize("launch_first", [False, True])
def test_overshoot_never_reaches_the_next_turn(model: Any, tiny_dir: Path, launch_first: bool) -> None:
    """Turn 1 stops mid-run (its run fed positions past the stop); turn 2 of the session reuses turn 1's
    context and equals a fresh run of the same tokens, logits included (with the first run launched behind
    the prompt's step too, as on CUDA)."""
    fresh = onnxgen.load(str(tiny_dir), backend="native", paged=False, kv_floor=16)
    prompt = [8 + launch_first, *PROMPTS[3]]  # each case its own context (the pool's index outlives a case)
    probe = model.generate(prompt, max_new_tokens=20, temperature=0, reuse=False, speculative=False)
    stop = probe.text[8:11]
    s = model.session(f"runs-{launch_first}")
    set_policy(model, decode_steps=8, launch_first=launch_first)
    try:
        one = s.generate(prompt, max_new_tokens=20, temperature=0, stop=[stop], speculative=False)
        assert one.finish_reason == "stop" and len(one.tokens) < 20
        ctx = [*one.prompt_ids, *one.tokens, 50, 51, 52]
        two = s.generate(ctx, max_new_tokens=6, temperature=0, output_logits=True, speculative=False)
    finally:
        set_policy(model, decode_steps=1, launch_first=False)
    ref = fresh.generate(
        ctx, max_new_tokens=6, temperature=0, output_logits=True, reuse=False, speculative=False
    )
    assert two.stats.reused_tokens == len(ctx) - 4  # turn 1's context but its last sample (never fed)
    assert two.tokens == ref.tokens
    d = np.linalg.norm(two.logits - ref.logits, axis=-1) / np.linalg.norm(ref.logits, axis=-1)
    assert float(d.max()) <= 1e-5


@pytest.mark.parametrize("max_new", [40, 17])
def test_a_reply_ending_in_a_runs_first_part_does_not_wait_for_the_rest(model: Any, max_new: int) -> None:
    """Runs of 8 are read in parts of 4 (the runner's `part_steps`): a lone request whose EOS falls in the first
    part of its third run (the first run one step: token 1; the second tokens 2-9; the third 10-17, or 10-16
    with 17 tokens allowed) takes that part only — the run's rest (and the run launched behind it, with 40
    tokens allowed; none with 17) is left to the next step (`_trailing`) — and its output equals single
    steps'; the next request's too."""
    assert model.executor.runner.part_steps == 4 and model.pipeline.policy.first_run_steps == 1
    probe = model.generate(PROMPTS[3], max_new_tokens=max_new, temperature=0, reuse=False, speculative=False)
    p = next(i for i in range(10, 13) if probe.tokens[i] not in probe.tokens[:i])
    saved = model.inputs.eos_ids
    model.inputs.eos_ids = (probe.tokens[p],)
    reads: list[tuple[Any, Any]] = []
    launches: list[Any] = []
    launch, collect = model.executor.launch_decodes, model.executor.collect_decodes
    model.executor.launch_decodes = lambda *a: launches.append(launch(*a)) or launches[-1]
    model.executor.collect_decodes = lambda run, rows=None: reads.append((run, rows)) or collect(run, rows)
    try:
        want = model.generate(
            PROMPTS[3], max_new_tokens=max_new, temperature=0, reuse=False, speculative=False
        )
        assert not launches and len(want.tokens) == p + 1 and want.finish_reason == "stop"
        set_policy(model, decode_steps=8, launch_first=True)
        got = model.generate(
            PROMPTS[3], max_new_tokens=max_new, temperature=0, reuse=False, speculative=False
        )
        assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, want.finish_reason)
        holder = launches[2]  # the run holding EOS: read up to its first part only
        assert [rows for run, rows in reads if run is holder] == [4]
        trailing = tail(model)
        assert trailing is (launches[3] if max_new == 40 else holder) and len(launches) == 3 + (max_new == 40)
        set_policy(model, decode_steps=1, launch_first=False)
        again = model.generate(PROMPTS[0], max_new_tokens=12, temperature=0, reuse=False, speculative=False)
        assert model.pipeline.tail is None and any(
            run is trailing and rows is None for run, rows in reads
        )  # drained
    finally:
        model.inputs.eos_ids = saved
        set_policy(model, decode_steps=1, launch_first=False)
        model.executor.launch_decodes, model.executor.collect_decodes = launch, collect
        model.settle()
    plain = model.generate(PROMPTS[0], max_new_tokens=12, temperature=0, reuse=False, speculative=False)
    assert (again.tokens, again.text) == (plain.tokens, plain.text)


def test_a_finished_requests_caller_does_not_wait_for_the_run_behind_its_last(model: Any) -> None:
    """A lone request that stops inside a chain of runs returns once the run holding its stop is read: the
    run launched behind it (steps past its end, whose tokens nobody takes) is waited for by the next step,
    before that step's own work (`DecodePipeline.tail`, `settle`); the next request's output is unchanged."""
    probe = model.generate(PROMPTS[3], max_new_tokens=30, temperature=0, reuse=False, speculative=False)
    stop = probe.text[12:15]
    want = model.generate(PROMPTS[0], max_new_tokens=12, temperature=0, reuse=False, speculative=False)
    log: list[tuple[str, Any]] = []  # ("launch", k) / ("collect", run), in order
    launch, collect = model.executor.launch_decodes, model.executor.collect_decodes

    def spy_launch(chunks: Any, k: int, offset: int = 0, after: Any = None) -> Any:
        log.append(("launch", after is not None))
        return launch(chunks, k, offset, after)

    model.executor.launch_decodes = spy_launch
    model.executor.collect_decodes = lambda run, rows=None: log.append(("collect", run)) or collect(run, rows)
    set_policy(model, decode_steps=4, launch_first=True)  # as on CUDA
    try:
        one = model.generate(
            PROMPTS[3], max_new_tokens=30, temperature=0, stop=[stop], reuse=False, speculative=False
        )
        trailing, first = tail(model), len(log)
        assert one.finish_reason == "stop" and len(one.tokens) < 30 and ("launch", True) in log
        assert trailing is not None and not any(x is trailing for _, x in log)  # launched, not waited for
        two = model.generate(PROMPTS[0], max_new_tokens=12, temperature=0, reuse=False, speculative=False)
        assert log[first][0] == "collect" and log[first][1] is trailing  # the next step's first act
        assert tail(model) is not trailing and any(kind == "launch" for kind, _ in log[first + 1 :])
    finally:
        set_policy(model, decode_steps=1, launch_first=False)
        model.executor.launch_decodes, model.executor.collect_decodes = launch, collect
        model.settle()
    assert (two.tokens, two.text) == (want.tokens, want.text)
    assert model.pipeline.tail is None


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}])
def test_the_first_run_is_launched_before_the_prompts_token_is_read(model: Any, sampling: dict) -> None:
    """The step that ends a prompt chooses the first token on the device and launches the first decode run
    behind it (continuing from that choice, offset 1) before the host reads the token (`DecodePipeline.launch_first`),
    so the device decodes while the host takes the first token; the output is unchanged."""
    want = model.generate(PROMPTS[3], max_new_tokens=20, reuse=False, speculative=False, **sampling)
    log: list[tuple[Any, ...]] = []
    launch, chosen = model.executor.launch_decodes, model.executor.chosen

    def spy_launch(chunks: Any, k: int, offset: int = 0, after: Any = None) -> Any:
        log.append(("launch", offset, after is not None))
        return launch(chunks, k, offset, after)

    model.executor.launch_decodes = spy_launch
    model.executor.chosen = lambda first: log.append(("read",)) or chosen(first)
    assert (
        model.pipeline.policy.launch_first is False
    )  # the CPU's default: a run launched there is computed at once
    set_policy(model, decode_steps=4, launch_first=True)  # CUDA's default
    try:
        got = model.generate(PROMPTS[3], max_new_tokens=20, reuse=False, speculative=False, **sampling)
        chained = list(log)
        log.clear()
        set_policy(model, launch_first=False)  # the first run launched by the next step, from the read token
        late = model.generate(PROMPTS[3], max_new_tokens=20, reuse=False, speculative=False, **sampling)
    finally:
        set_policy(model, decode_steps=1)
        del model.executor.launch_decodes, model.executor.chosen
        model.settle()
    for r in (got, late):
        assert (r.tokens, r.text, r.finish_reason) == (want.tokens, want.text, want.finish_reason)
    assert chained[:2] == [("launch", 1, True), ("read",)]  # launched first, then the token read
    assert all(entry[0] == "launch" and entry[2] for entry in chained[2:])  # runs continue one another
    assert log[0] == ("launch", 0, False) and ("read",) not in log


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.1, "top_k": 20, "seed": 2}])
def test_first_runs_equal_single_steps_where_requests_end_early(
    model: Any, sampling: dict, first: int
) -> None:
    """Prompts' first runs (a batch of four prompts at once; `decode_steps` long, or `first_run_steps` 1)
    give single steps' output when requests may take only a few tokens (1: no run; 2: a run of one step; 3
    and 5: short runs), when one or every request stops at its first token (EOS: the others take the
    launched run; all: it is left to the next step), and when one request's streaming callback fails (it
    fails alone)."""
    for n in (1, 2, 3, 5):
        want = batch(model, 1, PROMPTS, max_new_tokens=n, **sampling)
        spy = Spy(model)
        try:
            got = batch(model, 8, PROMPTS, first, max_new_tokens=n, **sampling)
        finally:
            del model.executor.launch_decodes
        same(got, want)
        assert (1 in spy.offsets) == (n >= 2)  # a first run launched behind the prompts' step
        if first and n >= 2:  # one step long; the runs after it continue from it, full length
            assert spy.runs[spy.offsets.index(1)] == 1
            assert spy.runs[1:] == [min(8, n - 2)] * (n > 2)
    ref = batch(model, 1, PROMPTS, max_new_tokens=12, **sampling)
    saved = model.inputs.eos_ids
    try:
        for eos in ((ref[2].tokens[0],), tuple(r.tokens[0] for r in ref)):
            model.inputs.eos_ids = eos
            want = batch(model, 1, PROMPTS, max_new_tokens=12, **sampling)
            got = batch(model, 8, PROMPTS, first, max_new_tokens=12, **sampling)
            same(got, want)
            assert got[2].finish_reason == "stop" and len(got[2].tokens) == 1
        assert (
            model.pipeline.tail is not None
        )  # every request stopped at its first token: the run behind is left
    finally:
        model.inputs.eos_ids = saved
        model.settle()

    def boom(_: str) -> None:
        raise RuntimeError("callback failed")

    saved = model.pipeline.policy.first_run_steps
    set_policy(model, decode_steps=8, launch_first=True, first_run_steps=first)
    try:
        pend = [
            model.submit(
                p,
                max_new_tokens=12,
                reuse=False,
                speculative=False,
                on_token=boom if i == 1 else None,
                **sampling,
            )
            for i, p in enumerate(PROMPTS)
        ]
        with pytest.raises(RuntimeError, match="callback failed"):
            pend[1].result()
        got = [p.result() for i, p in enumerate(pend) if i != 1]
    finally:
        set_policy(model, decode_steps=1, launch_first=False, first_run_steps=saved)
    same(got, [r for i, r in enumerate(ref) if i != 1])


def test_cancel_during_continued_runs(model: Any) -> None:
    """A request cancelled while runs continue one another stops within a run: it raises `Cancelled`, the
    other request of the batch equals its single-step output, and no page stays held."""
    import threading

    ref = batch(model, 1, PROMPTS[1:2], max_new_tokens=60, temperature=0)
    held = model.kv_stats()["pages_used"]  # earlier tests' sessions may still pin pages
    ev, seen = threading.Event(), []

    def count(_: Any) -> None:
        seen.append(1)
        if len(seen) == 10:
            ev.set()

    set_policy(model, decode_steps=4)
    spy = Spy(model)
    try:
        doomed = model.submit(
            PROMPTS[0], max_new_tokens=60, reuse=False, speculative=False, cancel=ev, on_token=count
        )
        other = model.submit(PROMPTS[1], max_new_tokens=60, reuse=False, speculative=False, temperature=0)
        with pytest.raises(onnxgen.errors.Cancelled):
            doomed.result()
        got = other.result()
    finally:
        model.executor.launch_decodes = spy._inner
        set_policy(model, decode_steps=1)
    assert got.tokens == ref[0].tokens and spy.continued
    assert 10 <= len(seen) <= 10 + 2 * 4  # the run being read and the one launched after it
    assert model.kv_stats()["pages_used"] == held


def test_copying_requests_run_shorter_runs(model: Any) -> None:
    """A run that holds a copying request (a draft of it accepted lately) is at most `spec_decode_steps` long
    (a match found on reading a run is verified after the run launched behind it: shorter runs verify a copy
    sooner); before its first accepted draft a speculating request keeps `decode_steps`, as a batch without
    speculation does; the output is plain decoding's."""
    prompt = [5, 9, 2, 33, 7, 5, 9, 2, 33, 7, 5, 9, 2, 33, 7]  # something to copy
    ref = model.generate(prompt, max_new_tokens=40, temperature=0, reuse=False, speculative=False)
    set_policy(model, decode_steps=8)
    spy = Spy(model)
    try:
        assert model.pipeline.policy.spec_decode_steps == 2
        got = model.generate(
            prompt, max_new_tokens=40, temperature=0, reuse=False, speculative="prompt_lookup"
        )
        spec_runs = list(spy.runs)
        spy.runs.clear()
        plain = model.generate(prompt, max_new_tokens=40, temperature=0, reuse=False, speculative=False)
    finally:
        model.executor.launch_decodes = spy._inner
        set_policy(model, decode_steps=1)
    assert got.tokens == ref.tokens == plain.tokens
    assert got.stats.accepted_tokens > 0
    assert spec_runs and max(spec_runs) <= 8 and 2 in spec_runs
    assert max(spy.runs) == 8


def test_host_side_sampling_runs_one_step_at_a_time(model: Any) -> None:
    """Penalties (or kept logits) need the host between steps: no runs, same result as before."""
    spy = Spy(model)
    try:
        got = batch(model, 8, PROMPTS[:2], max_new_tokens=10, temperature=0, repetition_penalty=1.3)
        kept = batch(model, 8, PROMPTS[:2], max_new_tokens=10, temperature=0, output_logits=True)
    finally:
        model.executor.launch_decodes = spy._inner
    assert spy.runs == []
    same(got, batch(model, 1, PROMPTS[:2], max_new_tokens=10, temperature=0, repetition_penalty=1.3))
    assert all(r.logits.shape[0] == 10 for r in kept)


def test_decode_steps_validated(tiny_dir: Path) -> None:
    with pytest.raises(onnxgen.errors.InvalidRequest, match="decode_steps"):
        onnxgen.load(str(tiny_dir), backend="native", decode_steps=0)
    assert stepper(tiny_dir, backend="native").pipeline.policy.decode_steps == 1  # the CPU default


@pytest.mark.gpu
@pytest.mark.parametrize("first_multi", [True, False])
def test_runs_on_cuda_graphs_equal_single_steps(tiny_dir: Path, first_multi: bool) -> None:
    """On CUDA each step of a run replays the captured decode graph with its ids copied on the device (greedy
    runs: several steps a replay where they fit, `ONNXGEN_RUN_GRAPH_STEPS`, the run's first replay included
    with the runner option `first_multi`)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU host)")
    m = stepper(tiny_dir, backend="native", device="cuda", first_multi=first_multi)
    runner = m.executor.runner
    assert (
        m.pipeline.policy.decode_steps == 8 and runner.cuda_graphs and m.pipeline.policy.first_run_steps == 1
    )
    # runs of 40 steps: longer than a graph's token record (RUN_TOKENS), across page boundaries; the first
    # run (launched behind the prompts' step) is one step, the next one as long as the shortest request's
    # rest: 38 - 1 (the prompt's token) - 1
    for steps, lengths, longest in ((8, (13, 30, 7, 22), 8), (40, (45, 60, 38, 50), 36)):
        for sampling in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 5}):
            per = [{"max_new_tokens": n} for n in lengths]
            ref = batch(m, 1, PROMPTS, per=per, **sampling)
            spy = Spy(m)
            got = batch(m, steps, PROMPTS, per=per, **sampling)
            m.executor.launch_decodes = spy._inner
            same(got, ref)
            assert spy.runs[0] == 1 and max(spy.runs) == longest
    assert runner.steps["multi"] > 0  # greedy runs replayed the several-step decode graphs (RUN_GRAPH_STEPS)
    m.close()


@pytest.mark.parametrize("in_advance", [False, True])
def test_greedy_advance_chooses_each_rows_first_maximum(
    in_advance: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kernels.advance.greedy_advance` (a captured decode step's greedy choice and advance; with `GREEDY_IN_ADVANCE`
    on a Triton device, partial maxima per column block and the choice inside the advance) records each live
    row's `torch.argmax` token: ties within a column block and across blocks go to the first column, a row of
    -inf takes 0, bf16 logits, a width that is not a whole number of blocks; padding rows untouched."""
    import torch

    from onnxgen.backends.native.kernels import advance

    monkeypatch.setenv("ONNXGEN_GREEDY_IN_ADVANCE", "1" if in_advance else "0")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b, mp, page, live, v = 5, 3, 4, 4, 3 * advance.ARGMAX_BLOCK + 123
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(b, v, generator=g).to(torch.bfloat16)
    logits[0, [7, 9000, 11000]] = 40.0  # ties: within the first block's reach and across blocks
    logits[1, [5000, 5001, v - 1]] = 40.0  # ties inside one block and in the last, partial block
    logits[2] = float("-inf")
    logits[3, v - 1] = 50.0  # the maximum in the last column
    pos = torch.tensor([0, 3, 7, 2, 5])
    wide = torch.cat([torch.zeros(4 * b, dtype=torch.int64), torch.tensor([0, live])])
    wide[b : 2 * b] = pos
    narrow = torch.cat(
        [
            (pos + 1).to(torch.int32),
            torch.arange(b * mp, dtype=torch.int32),
            torch.tensor([0, 0], dtype=torch.int32),
        ]
    )
    toks = torch.full((2, b), -1, dtype=torch.int64)
    args = [t.to(dev) for t in (logits, wide, narrow, toks)]
    advance.greedy_advance(*args, b, mp, page)
    want = [int(i) for i in logits.float().argmax(-1)[:live]]
    assert want == [7, 5000, 0, v - 1]
    assert args[3][0, :live].tolist() == want and args[3][0, live:].tolist() == [-1] * (b - live)
    assert args[1][:live].tolist() == want and int(args[1][4 * b]) == 1


def test_decode_advance_moves_each_live_row_to_its_next_step() -> None:
    """`kernels.advance.decode_advance` (the tail of a captured decode step; Triton on CUDA, the torch reference
    elsewhere) against a row-by-row reading of its contract: padding rows untouched, slots through each
    row's page table, the token recorded at the step counter modulo the record's length."""
    import torch

    from onnxgen.backends.native.kernels import advance

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b, mp, page, live, kmax = 6, 5, 4, 4, 3
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 3, 7, 18, 2, 9])
    table = torch.randint(0, 50, (b, mp), generator=g, dtype=torch.int32)
    wide = torch.cat([torch.randint(0, 99, (4 * b,), generator=g), torch.tensor([4, live])])
    wide[b : 2 * b] = pos
    narrow = torch.cat([(pos + 1).to(torch.int32), table.view(-1), torch.tensor([7, 7], dtype=torch.int32)])
    top = torch.randint(0, 1000, (b,), generator=g)
    toks = torch.full((kmax, b), -1, dtype=torch.int64)
    want_w, want_n, want_t = wide.clone(), narrow.clone(), toks.clone()
    for r in range(live):
        p = int(pos[r]) + 1
        want_t[4 % kmax, r] = top[r]
        want_w[r], want_w[b + r], want_w[2 * b + r] = top[r], p, int(table[r, p // page]) * page + p % page
        want_n[r] = p + 1
    want_w[4 * b] = 5
    args = [t.to(dev) for t in (top, wide, narrow, toks)]
    advance.decode_advance(*args, b, mp, page)
    for got, want in zip(args[1:], (want_w, want_n, want_t), strict=True):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("first_multi", [True, False])
@pytest.mark.parametrize("part_steps", [4, 0, 3])
def test_replay_plan_covers_each_row_once_and_stages_only_written_rows(
    first_multi: bool, part_steps: int
) -> None:
    """The CUDA run's schedule (`runs.replay_plan`, on the CPU): replays cover the steps in order, deep
    ones only for greedy runs of graphs that have them and never across a token record window; greedy runs
    flush each record window once, at its end or the run's; the parts staged to the host cover the rows in
    order, each read from the run's tokens only once they are all there, else from the record within its
    current window, rows already recorded and not yet overwritten. A greedy run of deep replays has the parts
    the CPU's `decode_parts` gives, so the engine reads runs alike on both."""
    from types import SimpleNamespace

    import torch

    from onnxgen import envs
    from onnxgen.backends.native import runs
    from onnxgen.backends.native.runner import NativeRunner

    W, D = runs.RUN_TOKENS, envs.RUN_GRAPH_STEPS
    for k in range(1, 2 * W + 7):
        for greedy in (True, False):
            for multi in (True, False):
                plan = runs.replay_plan(
                    k, greedy, multi, depth=D, first_multi=first_multi, part_steps=part_steps
                )
                assert [r.first for r in plan] == [sum(r.steps for r in plan[:i]) for i in range(len(plan))]
                assert sum(r.steps for r in plan) == k
                written = flushed_to = staged = 0
                for r in plan:
                    j, n, flush, part = r.first, r.steps, r.flush, r.part
                    last = j + n - 1
                    assert last == r.last
                    assert n in (1, D) and (n == 1 or (greedy and multi and j // W == last // W))
                    assert n == 1 or j > 0 or first_multi
                    written = last + 1  # rows chosen so far (greedy: in the record; else in the run's tokens)
                    if not greedy:
                        assert flush is None
                        flushed_to = written
                    elif flush is not None:
                        assert (
                            flush == flushed_to
                            and flush // W == last // W
                            and ((last + 1) % W == 0 or last == k - 1)
                        )
                        flushed_to = written
                    if part is not None:
                        a, e, from_toks = part.start, part.end, part.from_run
                        assert a == staged and a < e == written
                        assert e <= flushed_to if from_toks else (a // W == (e - 1) // W and e - 1 <= last)
                        staged = e
                assert staged == k and (not greedy or flushed_to == k)
                ends = tuple(r.part.end for r in plan if r.part is not None)
                if greedy and multi and first_multi and part_steps == 4 and k % D == 0:
                    cpu = SimpleNamespace(part_steps=part_steps)  # a runner's `part_steps`, as on the CPU
                    assert ends == tuple(NativeRunner.decode_parts(cpu, runs.DecodeRun(torch.empty(k, 1))))


def test_a_request_ending_at_a_parts_last_row_gives_back_the_rest_of_its_run(model: Any) -> None:
    """EOS on the last row of a run's first part (token 13: the first run one step, the second tokens 2-9, the
    third 10-17 in parts 10-13 and 14-17): the request takes that part whole, and the positions its run fed
    past it are taken back out of its cache (`discard` at its end), as when EOS falls inside a part."""
    for prompt in PROMPTS:
        probe = model.generate(prompt, max_new_tokens=20, temperature=0, reuse=False, speculative=False)
        if probe.tokens[13] not in probe.tokens[:13]:
            break
    else:
        pytest.fail("no prompt whose token 13 is new: pick another EOS position")
    saved, discard = model.inputs.eos_ids, model.executor.discard
    model.inputs.eos_ids = (probe.tokens[13],)
    kept: list[int] = []
    model.executor.discard = lambda req, keep: kept.append(keep) or discard(req, keep)
    set_policy(model, decode_steps=8, launch_first=True)
    try:
        got = model.generate(prompt, max_new_tokens=40, temperature=0, reuse=False, speculative=False)
    finally:
        model.inputs.eos_ids, model.executor.discard = saved, discard
        set_policy(model, decode_steps=1, launch_first=False)
        model.settle()
    assert got.tokens == probe.tokens[:14] and got.finish_reason == "stop"
    assert kept == [len(prompt) + 13]  # computed: the prompt and the 13 tokens before EOS (EOS is never fed)
