"""Speculative decoding without a draft model (prompt lookup): drafts come from the context, are verified
in one forward, and the output is exactly plain decoding's (greedy and seeded sampling), on both backends;
rejected drafts are taken back out of the KV, so a session's next turn reuses exactly what it should."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import onnxgen
from onnxgen.engine.drafts import DraftControl, NgramIndex, draft_control, prompt_lookup
from onnxgen.errors import InvalidRequest
from tests.harness import loaded

DOC = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps under the old oak tree near the river. "
    "Every morning the farmer walks to the market to sell apples, pears and fresh bread. "
) * 2
EDIT = [
    {"role": "user", "content": "Repeat the following text exactly, replacing 'fox' with 'cat':\n\n" + DOC}
]


def test_prompt_lookup_proposes_what_followed_the_most_recent_match() -> None:
    assert prompt_lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert prompt_lookup([1, 2, 9, 7, 1, 2, 8, 6, 1, 2], 2) == [8, 6]  # the most recent of two matches
    assert prompt_lookup([1, 2, 3, 9, 3, 7, 2, 3], 2) == [9, 3]  # the longest n-gram wins ([2, 3], not [3])
    assert prompt_lookup([1, 2, 3, 4], 3) == []  # nothing repeats
    assert prompt_lookup([5, 6, 5], 5) == [6, 5]  # fewer than k follow
    assert prompt_lookup([5, 6, 5], 0) == [] and prompt_lookup([7], 2) == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=0, max_size=60),
    st.lists(st.integers(1, 7), max_size=12),
    st.integers(0, 6),
)
def test_ngram_index_answers_what_prompt_lookup_answers(tokens: list[int], cuts: list[int], k: int) -> None:
    """Fed in pieces of any size (as a request's prompt and then its samples arrive), the incremental index
    proposes exactly what a full scan of the same tokens proposes, after every piece."""
    for bulk_min in (1, 10**9):  # the first piece indexed in bulk (numpy), or token by token
        index, at = NgramIndex(bulk_min=bulk_min), 0
        for c in [*cuts, len(tokens)]:
            piece = tokens[at : at + c]
            at += len(piece)
            index.extend(piece)
            assert index.lookup(k) == prompt_lookup(tokens[:at], k)
    control, out = DraftControl(), []
    for t in tokens:  # DraftControl.propose over a prompt that grows by output
        out.append(t)
        assert control.propose(tokens[:3], out[3:] if len(out) > 3 else [], k) == prompt_lookup(
            tokens[:3] + (out[3:] if len(out) > 3 else []), k
        )


def test_ngram_index_bulk_prompt_matches_a_full_scan_and_takes_large_ids() -> None:
    """A long first piece is indexed in bulk; ids too large for its integer keys fall back to the dict."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 3000).tolist()
    index = NgramIndex()
    index.extend(prompt)
    for extra in ([7], [3, 3, 9], prompt[100:110]):
        index.extend(extra)
        prompt = prompt + extra
        assert index.lookup(6) == prompt_lookup(prompt, 6)
    big = [1 << 22, 5, 6, 1 << 22, 5] * 60
    index = NgramIndex()
    index.extend(big)
    assert not index.bulk_indexed and index.lookup(3) == prompt_lookup(big, 3) != []


def test_draft_control_grows_on_acceptance_and_backs_off_on_rejection() -> None:
    """Doubling on full acceptance (to k_max), halving on rejection; at 0 a one-token retry once `cooldown`
    tokens of output have passed (a run of decode steps makes many at once), the wait doubling after each
    rejected retry (to cooldown_max) and reset by an accepted draft."""
    c = DraftControl(k=4, k_max=6, cooldown=3, cooldown_max=8)
    c.update(4, 4, 10)
    assert c.budget(10) == 6
    c.update(6, 2, 12)
    assert c.k == 6  # partly accepted: unchanged
    c.update(6, 0, 13)
    c.update(3, 0, 14)
    c.update(1, 0, 15)
    assert c.k == 0
    assert [c.budget(g) for g in (15, 17, 18, 30)] == [0, 0, 1, 1]  # from output 15 + 3
    c.update(1, 0, 18)
    assert [c.budget(g) for g in (18, 23, 24)] == [0, 0, 1]  # the wait doubled: 18 + 6
    c.update(1, 0, 24)
    c.update(1, 0, 40)
    assert c.budget(47) == 0 and c.budget(48) == 1  # capped at cooldown_max
    c.update(1, 1, 48)
    assert c.k == 2
    c.update(2, 0, 50)
    c.update(1, 0, 51)
    assert c.budget(53) == 0 and c.budget(54) == 1  # an accepted draft reset the wait
    assert (c.drafted, c.accepted) == (27, 7)


def test_draft_lengths_fill_the_verify_size_they_fall_in() -> None:
    """With verify sizes (a CUDA runner's graphs of 4/8/16 positions: a step costs its padded size), a
    budget of k drafts becomes the most that fit the same size, capped at k_max; the state it grows and
    shrinks from is unchanged, and with no sizes (the CPU) nothing is raised."""
    assert DraftControl(k=4, k_max=15).budget(0) == 4
    c = DraftControl(k=4, k_max=15, cooldown=2, sizes=(16, 4, 8))
    assert c.budget(0) == 7  # 5 positions cost the 8-position graph
    c.update(7, 7, 8)
    assert c.k == 14 and c.budget(8) == 15
    c.update(15, 0, 9)
    c.update(7, 0, 10)
    assert c.k == 3 and c.budget(10) == 3
    c.update(3, 0, 11)
    c.update(3, 0, 12)
    assert c.k == 0 and c.budget(12) == 0 and c.budget(14) == 3  # the retry fills the 4-position graph
    assert DraftControl(k=4, k_max=6, sizes=(4, 8, 16)).budget(0) == 6
    assert DraftControl(k=20, k_max=32, sizes=(4, 8, 16)).budget(0) == 20  # beyond the sizes: as asked


def test_draft_control_is_hot_for_a_while_after_an_accepted_draft() -> None:
    """`hot` (what shortens runs of decode steps): never before a draft is accepted, however many were
    proposed and rejected; for `HOT_TOKENS` output tokens after one with tokens accepted; again after the next."""
    c = DraftControl(k=4)
    assert not c.hot(0)
    c.update(4, 0, 10)  # rejected
    assert not c.hot(10)
    c.update(2, 1, 20)
    assert c.hot(20) and c.hot(20 + c.HOT_TOKENS - 1) and not c.hot(20 + c.HOT_TOKENS)
    c.update(1, 0, 60)  # a rejection does not end it early, nor extend it
    assert not c.hot(60)
    c.update(3, 3, 70)
    assert c.hot(75)


def test_draft_control_stops_a_chain_only_with_a_budget_and_a_match() -> None:
    """Without `confirm` (the CPU's control) `stop_chain` asks for a budget and a match, nothing more."""
    c = DraftControl(k=1, cooldown=4)
    prompt = [5, 6, 7, 8]
    assert not c.stop_chain(prompt, []) and c.stop_chain(prompt, [5])  # ...5 -> 6 seen before
    c.update(1, 0, 1)  # rejected: k is 0 until 4 more tokens of output
    assert not c.stop_chain(prompt, [5, 9, 6]) and not c.stop_chain(prompt, [5, 9, 6, 7])
    assert c.stop_chain(prompt, [5, 9, 6, 7, 5])


def test_stop_chain_waits_for_a_match_to_prove_right_unless_copying() -> None:
    """`confirm` (CUDA): a match seen on reading a run stops the chain only once the token after it was the
    one it proposed (checked at the next run's reading; runs stay short meanwhile: `watching`), or at once
    while the request is `hot`; a chance match costs no stop. Without `confirm` every match stops it."""
    prompt = [10, 11, 12, 13, 14, 15]
    c = DraftControl(ngram_min=2, confirm=True)
    assert not c.stop_chain(prompt, [1, 10, 11]) and c.watching(3)  # (10, 11) -> 12: to be confirmed
    assert not c.stop_chain(prompt, [1, 10, 11, 2, 12, 13]) and c.watching(
        6
    )  # 2 came, not 12; (12, 13) -> 14
    assert c.stop_chain(prompt, [1, 10, 11, 2, 12, 13, 14, 15]) and not c.watching(8)  # 14 came: a copy
    assert not c.stop_chain(prompt, [1, 10, 11, 2, 12, 13, 14, 15, 3, 4]) and not c.watching(10)  # no match
    c.update(1, 1, 10)  # a verify step with its draft accepted: the request is copying (`hot`)
    assert c.stop_chain(
        prompt, [1, 10, 11, 2, 12, 13, 14, 15, 3, 4, 12, 13]
    )  # hot: the match stops it at once
    assert DraftControl(ngram_min=2).stop_chain(prompt, [1, 10, 11])  # no `confirm`: whenever ready
    off = DraftControl(k=1, cooldown=8, ngram_min=2, confirm=True)
    off.update(1, 0, 2)  # rejected: no budget until 8 more tokens, so no match is looked at
    assert not off.stop_chain(prompt, [1, 10, 11]) and not off.watching(3)
    assert draft_control(True).confirm and not draft_control(False).confirm
    assert draft_control(True).follow and not draft_control(False).follow


def test_follow_drafts_after_a_confirmed_stop_only_along_the_confirmed_match() -> None:
    """`follow` (with `confirm`, both on CUDA): the drafts proposed after `stop_chain` stopped for a
    confirmed match are that match's continuation, or none when the lookup now answers from another source
    (the run behind the stop left the copy) with a match no longer than its n-grams (3 tokens); a longer
    match there is drafted (the copy resumed elsewhere). Only the first proposal after the stop is checked,
    and without `follow` the lookup's answer is taken as it is."""
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 30, 31, 40, 20, 21, 22, 23, 24, 50, 51]

    def stopped(follow: bool) -> DraftControl:
        c = DraftControl(ngram_min=2, confirm=True, follow=follow)
        assert not c.stop_chain(prompt, [1, 10, 11])  # (10, 11) -> 12, from prompt[2]: to be confirmed
        assert c.stop_chain(prompt, [1, 10, 11, 12, 13])  # 12 came: stop
        return c

    assert stopped(True).propose(prompt, [1, 10, 11, 12, 13, 14, 15], 3) == [16, 17, 30]  # still the copy
    c = stopped(True)
    assert c.propose(prompt, [1, 10, 11, 12, 13, 30, 31], 3) == []  # (30, 31) -> 40: another source
    assert c.propose(prompt, [1, 10, 11, 12, 13, 30, 31], 3) == [40, 20, 21]  # checked once only
    assert stopped(False).propose(prompt, [1, 10, 11, 12, 13, 30, 31], 3) == [40, 20, 21]
    # (22, 23, 24) -> 50 from another source, but the match reaches 4 tokens back (21, 22, 23, 24): drafted
    assert stopped(True).propose(prompt, [1, 10, 11, 12, 13, 21, 22, 23, 24], 2) == [50, 51]
    # the same n-gram behind only 3 equal tokens (9, 22, 23, 24 against 21, 22, 23, 24): a chance match
    assert stopped(True).propose(prompt, [1, 10, 11, 12, 13, 9, 22, 23, 24], 2) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.integers(0, 8))
def test_ngram_match_length_is_the_longest_common_suffix(tokens: list[int], limit: int) -> None:
    """For every position: the longest n <= limit with tokens[src - n : src] == tokens[-n:] (n <= src)."""
    idx = NgramIndex()
    idx.extend(tokens)
    for src in range(len(tokens)):
        want = max(
            n for n in range(min(limit, src) + 1) if tokens[src - n : src] == tokens[len(tokens) - n :]
        )
        assert idx.match_length(src, limit) == want


def test_ngram_match_length_reads_back_from_the_source_and_the_end() -> None:
    """`NgramIndex.match_length`: the tokens before a source equal to the sequence's last ones, up to a limit
    (and never past the sequence's start)."""
    idx = NgramIndex()
    idx.extend([7, 1, 2, 3, 4, 9, 0, 2, 3, 4])
    assert idx.source() == 5  # (2, 3, 4) -> 9
    assert idx.match_length(5, 10) == 3  # 2, 3, 4 equal; 1 against 0 differs
    assert idx.match_length(5, 2) == 2
    assert idx.match_length(1, 10) == 0  # 7 against 4
    idx.extend([7, 1, 2])
    assert idx.match_length(3, 10) == 3  # 7, 1, 2 at the start: stops there


def test_a_chain_stops_only_for_a_request_that_can_still_draft_after_the_launched_run() -> None:
    """`DecodePipeline.drafts_ready`: a stop is for a request that, once it has taken the steps launched behind the
    run just read, may still generate a sample and a draft (else the next step could only decode)."""
    from types import SimpleNamespace

    from onnxgen.engine.pipeline import DecodePipeline

    req = SimpleNamespace(
        drafts=DraftControl(),
        prompt=[5, 6, 7],
        output=[5],
        max_new_tokens=10,
        context_length=100,
        num_tokens=4,
    )
    chunks = [SimpleNamespace(req=req)]
    assert DecodePipeline.drafts_ready(chunks, set(), 7)  # 10 - 1 - 7: room for a sample and a draft
    assert not DecodePipeline.drafts_ready(chunks, set(), 8)  # one token left after the launched run
    assert not DecodePipeline.drafts_ready(chunks, {0}, 0)  # finished in the run just read
    req.context_length = 12  # 12 - 4 - 7: the context leaves one position
    assert not DecodePipeline.drafts_ready(chunks, set(), 7)


@pytest.fixture(scope="module")
def smollm2_native(smollm2_dir):
    pytest.importorskip("torch")
    return onnxgen.load(str(smollm2_dir), backend="native", paged=False)


@pytest.mark.parametrize("backend", ["ort", "native"])
def test_greedy_and_sampled_output_equals_plain_decoding(request, backend) -> None:
    model = request.getfixturevalue("smollm2_ort" if backend == "ort" else "smollm2_native")
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
        plain = model.generate(EDIT, max_new_tokens=48, speculative=False, output_logits=True, **sampling)
        spec = model.generate(
            EDIT, max_new_tokens=48, speculative="prompt_lookup", output_logits=True, **sampling
        )
        assert spec.tokens == plain.tokens and spec.text == plain.text, sampling
        assert (
            spec.stats.draft_tokens
            >= spec.stats.accepted_tokens
            > (10 if sampling["temperature"] == 0 else 0)
        )
        assert plain.stats.draft_tokens == 0 and "drafts" not in plain.stats.line()
        assert f"{spec.stats.accepted_tokens}/{spec.stats.draft_tokens} drafts kept" in spec.stats.line()
        assert abs(spec.logits - plain.logits).max() <= 1e-3 * abs(plain.logits).max()


def test_limits_and_stops_hold_with_drafts(smollm2_ort) -> None:
    """max_new_tokens, stop strings and the streamed text are exactly plain decoding's."""
    for kw in ({"max_new_tokens": 5}, {"max_new_tokens": 64, "stop": "lazy"}):
        pieces: list[str] = []
        plain = smollm2_ort.generate(EDIT, temperature=0, speculative=False, **kw)
        spec = smollm2_ort.generate(
            EDIT, temperature=0, speculative="prompt_lookup", on_token=pieces.append, **kw
        )
        assert spec.tokens == plain.tokens and spec.text == plain.text == "".join(pieces)
        assert spec.finish_reason == plain.finish_reason
    assert len(spec.tokens) < 64 and spec.stats.accepted_tokens > 0


@pytest.mark.parametrize("backend", ["ort", "native"])
def test_rejected_drafts_leave_the_kv_of_the_accepted_context(request, backend) -> None:
    """A session's next turn, after a speculative turn, reuses its context and gives what a fresh run on the
    same ids gives (the rejected drafts' KV was rewound away)."""
    model = request.getfixturevalue("smollm2_ort" if backend == "ort" else "smollm2_native")
    s = model.session()
    r1 = s.generate(EDIT, max_new_tokens=40, temperature=0.8, seed=7, speculative="prompt_lookup")
    assert r1.stats.draft_tokens > r1.stats.accepted_tokens > 0  # some drafts were rejected
    turn2 = [*EDIT, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "Now in French."}]
    r2 = s.generate(turn2, max_new_tokens=8, temperature=0, speculative=False, output_logits=True)
    assert r2.stats.reused_tokens == len(r1.prompt_ids) + len(r1.tokens) - 1
    fresh = model.generate(r2.prompt_ids, max_new_tokens=8, temperature=0, reuse=False, output_logits=True)
    assert r2.tokens == fresh.tokens
    assert abs(r2.logits - fresh.logits).max() <= 1e-3 * abs(fresh.logits).max()
    s.close()


def test_bad_mode_is_a_typed_error(smollm2_ort) -> None:
    with pytest.raises(InvalidRequest) as e:
        smollm2_ort.generate("hi", max_new_tokens=2, speculative="medusa")
    assert e.value.field == "speculative" and "prompt_lookup" in str(e.value)


def test_paged_requests_speculate_alone_and_in_a_batch(smollm2_dir) -> None:
    """On the paged pool: drafts of several requests verified in one ragged batch, each request's output
    exactly its plain decoding's; the pool is consistent afterwards (rejected drafts leak no page)."""
    pytest.importorskip("torch")
    engine, paged = loaded(smollm2_dir, backend="native", max_running=4)
    assert paged.paged
    assert (
        engine.executor.verify_sizes == () and engine.draft_control(True).sizes == ()
    )  # no graphs: no padding
    prompts = [
        EDIT,
        [{"role": "user", "content": "Count from one to twenty in words."}],
        [{"role": "user", "content": "Write a haiku about rain."}],
    ]
    plain = [
        paged.generate(p, max_new_tokens=32, temperature=0, speculative="off", output_logits=True)
        for p in prompts
    ]
    pending = [paged.submit(p, max_new_tokens=32, temperature=0, output_logits=True) for p in prompts]
    batched = [p.result() for p in pending]
    for a, b in zip(batched, plain, strict=True):
        assert a.tokens == b.tokens
        assert abs(a.logits - b.logits).max() <= 1e-3 * abs(b.logits).max()
    assert batched[0].stats.accepted_tokens > 10
    kv = engine.executor.kv
    kv.allocator.check_integrity()
    kv.index.check_integrity()
    assert paged.kv_stats()["pages_used"] == len(kv.index.pages())


def test_on_cuda_requests_draft_only_while_running_alone(smollm2_dir) -> None:
    """`DecodingConfig.speculate_alone` (CUDA's setting, forced here on the CPU's paged pool): a request running alone
    drafts; two running together draft nothing (no verify step beside another's decodes), whether they
    asked for "prompt_lookup" or left it to the engine; without the setting (the CPU's) they draft in the
    batch. Every output is plain decoding's."""
    pytest.importorskip("torch")
    engine, paged = loaded(smollm2_dir, backend="native", max_running=4)
    assert not engine.speculate_alone  # the CPU's default: batches draft
    plain = paged.generate(EDIT, max_new_tokens=32, temperature=0, speculative="off")
    for alone_only in (True, False):
        engine, paged = loaded(smollm2_dir, backend="native", max_running=4, speculate_alone=alone_only)
        assert engine.draft_control(None).solo == engine.draft_control("prompt_lookup").solo == alone_only
        alone = paged.generate(EDIT, max_new_tokens=32, temperature=0)
        assert alone.tokens == plain.tokens and alone.stats.accepted_tokens > 10
        for mode in (None, "prompt_lookup"):
            pending = [
                paged.submit(EDIT, max_new_tokens=32, temperature=0, speculative=mode, reuse=False)
                for _ in range(2)
            ]  # (same prompt and length: together from first step to last)
            for r in (p.result() for p in pending):
                assert r.tokens == plain.tokens
                assert (r.stats.draft_tokens > 0) == (not alone_only), (alone_only, mode, r.stats.line())
    c = DraftControl(solo=True)
    assert c.active(1) and not c.active(2) and DraftControl().active(3)


def test_server_and_cli_expose_it(smollm2_ort, tmp_path) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from onnxgen.serve.app import RunningServer, ServerConfig, create_app

    app = create_app(smollm2_ort, ServerConfig(api_keys=("k" * 32,)))
    auth = {"Authorization": "Bearer " + "k" * 32}
    with RunningServer(app) as srv:
        mid = httpx.get(srv.url + "/v1/models", headers=auth).json()["data"][0]["id"]
        body = {"model": mid, "messages": EDIT, "max_tokens": 24, "temperature": 0}
        texts = [
            httpx.post(
                srv.url + "/v1/chat/completions",
                headers=auth,
                timeout=120,
                json={**body, "speculative": mode},
            ).json()["choices"][0]["message"]["content"]
            for mode in ("prompt_lookup", "off")
        ]
        bad = httpx.post(
            srv.url + "/v1/chat/completions", headers=auth, json={**body, "speculative": "medusa"}
        )
    assert texts[0] == texts[1] and texts[0]
    assert bad.status_code == 400 and "speculative" in bad.text
    from onnxgen.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--speculative", "off"])
    assert args.speculative == "off"


def test_cli_generate_reports_drafts_and_can_turn_them_off(smollm2_dir, capsys) -> None:
    from onnxgen.cli.main import main

    prompt = "Repeat exactly: the cat sat on the mat, the dog sat on the log, the bird sat on the word."
    outs = []
    for extra in ([], ["--speculative", "off"]):
        assert (
            main(
                [
                    "generate",
                    str(smollm2_dir),
                    "--prompt",
                    prompt,
                    "--max-new-tokens",
                    "24",
                    "--temperature",
                    "0",
                    "--backend",
                    "ort",
                    *extra,
                ]
            )
            == 0
        )
        outs.append(capsys.readouterr())
    assert outs[0].out == outs[1].out
    assert re.search(r"· \d+/\d+ drafts kept ·", outs[0].err) and "drafts" not in outs[1].err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_greedy_output_and_logits_are_plain_decodings_bits(tmp_path, dtype) -> None:
    """On the GPU (captured decode runs, verify graphs): speculative greedy decoding returns plain greedy
    decoding's tokens and the same logits bit for bit, in bf16 too — the verify rows are computed as one-token
    steps (`RunCtx.rowwise`), so no near-tie can flip a token. A random-weight model falls into loops, which
    prompt lookup drafts; a 2,000-token prompt spreads the keys over several splits."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU host)")
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(
        num_layers=3,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        vocab_size=384,
        dtype=dtype,
        context_length=4096,
    )
    engine, model = loaded(write_package(tmp_path / "pkg", cfg), backend="native", device="cuda")
    assert engine.executor.verify_sizes == (4, 8, 16)  # the verify graphs: draft lengths fill them
    rng = np.random.default_rng(3)
    for prompt in (
        [int(t) for t in rng.integers(3, 300, 40)] * 3,
        [int(t) for t in rng.integers(3, 300, 2000)],
    ):
        plain = model.generate(
            prompt, max_new_tokens=96, temperature=0, speculative=False, output_logits=True, reuse=False
        )
        spec = model.generate(
            prompt,
            max_new_tokens=96,
            temperature=0,
            speculative="prompt_lookup",
            output_logits=True,
            reuse=False,
        )
        assert spec.tokens == plain.tokens
        assert np.array_equal(spec.logits, plain.logits)
        assert spec.stats.accepted_tokens > 0, spec.stats.line()
        # without logits asked, plain decoding runs captured decode steps back to back (`decode_steps`)
        fast = model.generate(prompt, max_new_tokens=96, temperature=0, speculative=False, reuse=False)
        fast_spec = model.generate(
            prompt, max_new_tokens=96, temperature=0, speculative="prompt_lookup", reuse=False
        )
        assert fast.tokens == fast_spec.tokens == plain.tokens


def test_chance_matches_do_not_break_chains_of_decode_runs(smollm2_dir, monkeypatch) -> None:
    """With the CUDA draft policy and runs of decode steps (forced on the CPU): a text whose context only
    repeats by chance (a short explanation) runs one chain of runs from its first decode step to its last, as
    plain decoding does, instead of stopping the chain for matches gone by the next step (each stop a host
    round trip the device waits for on CUDA: 2 % of explain's plain speed on the H200); a match is still
    looked at (one short run to confirm it). The output is plain decoding's."""
    pytest.importorskip("torch")
    from onnxgen.engine import engine as engine_mod

    monkeypatch.setattr(
        engine_mod, "draft_control", lambda cuda, sizes=(), solo=False: draft_control(True, (4, 8, 16))
    )
    engine, model = loaded(smollm2_dir, backend="native", paged=True, decode_steps=8)
    runs: list[tuple[int, bool]] = []
    launch = engine.executor.launch_decodes

    def spy(chunks, k, offset=0, after=None):  # (k, whether it continues a chain: not its first run)
        runs.append((k, after is not None and offset > 1))  # offset 1: the first run behind a prompt's step
        return launch(chunks, k, offset, after)

    engine.executor.launch_decodes = spy
    msgs = [{"role": "user", "content": "In one paragraph, explain why the sky is blue to a ten-year-old."}]
    got = {}
    for mode in ("off", "prompt_lookup"):
        runs.clear()
        got[mode] = (
            model.generate(msgs, max_new_tokens=128, temperature=0, reuse=False, speculative=mode),
            list(runs),
        )
    (plain, plain_runs), (spec, spec_runs) = got["off"], got["prompt_lookup"]
    assert spec.tokens == plain.tokens
    assert [a for _, a in spec_runs].count(False) == [a for _, a in plain_runs].count(False) == 1  # one chain
    assert spec.stats.draft_tokens == 0  # no verify step
    assert (2, True) in spec_runs and {k for k, _ in plain_runs} == {8}  # a match seen, proved chance
