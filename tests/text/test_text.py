"""text/: tokenizer, streaming detokenizer and chat templates against independent references.

References: transformers' `AutoTokenizer` (encode, decode, `apply_chat_template`) loaded from the
default SmolLM2 package folder itself (it has tokenizer.json + tokenizer_config.json +
chat_template.jinja, which transformers reads directly), and `tokenizers`' own full decode for
the streaming contract.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnxgen.errors import InvalidRequest, MissingTokenizer, TemplateError
from onnxgen.package.home import default_model_dir
from onnxgen.text import ChatTemplate, IncrementalDetokenizer, Tokenizer

PROP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def smollm2_dir() -> Path:
    """The default SmolLM2 fp32 package (the lead will replace this with the `smollm2_dir` fixture)."""
    d = default_model_dir("fp32")
    if not (d / "tokenizer.json").is_file():
        pytest.skip(f"default model package not built at {d}")
    return d


@pytest.fixture(scope="module")
def pkg() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def spec(pkg: Path) -> Any:
    from onnxgen.package.spec import load_spec

    return load_spec(pkg)


@pytest.fixture(scope="module")
def tok(spec: Any) -> Tokenizer:
    return Tokenizer.from_spec(spec)


@pytest.fixture(scope="module")
def hf(pkg: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(pkg))


def stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> tuple[str, list[str]]:
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [d.push(i) for i in ids]
    pieces.append(d.flush())
    assert d.text == "".join(pieces)
    assert d.resyncs == 0  # the O(1) window path alone was exact
    return "".join(pieces), pieces


TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "line one\nline two\n\n  indented\n\ttab",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦!",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "mixed  中 文 with ▁ metaspace glyph and é / é (combining)",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
    "   ",
    "\n",
]


# --- tokenizer ------------------------------------------------------------------------------


def test_special_tokens_match_transformers(tok: Tokenizer, hf: Any, spec: Any) -> None:
    assert tok.bos_token == hf.bos_token and tok.eos_token == hf.eos_token
    assert tok.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in tok.eos_token_ids
    assert set(spec.eos_token_ids) <= set(tok.eos_token_ids)
    assert tok.special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert tok.vocab_size == len(hf)
    assert tok.token_to_id(hf.eos_token) == hf.eos_token_id
    assert tok.id_to_token(hf.eos_token_id) == hf.eos_token
    assert tok.token_to_id("definitely not a token \u2603\u2603") is None


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special", [True, False])
def test_encode_decode_match_transformers(tok: Tokenizer, hf: Any, text: str, add_special: bool) -> None:
    ids = tok.encode(text, add_special_tokens=add_special)
    assert ids == hf.encode(text, add_special_tokens=add_special)
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@PROP
@given(text=st.text(max_size=60))
def test_encode_matches_transformers_random_text(tok: Tokenizer, hf: Any, text: str) -> None:
    assert tok.encode(text) == hf.encode(text)


def test_from_dir_post_processor_and_eos_union(tmp_path: Path, pkg: Path) -> None:
    """tokenizer.json's post-processor decides what encode adds (transformers v5 ignores
    tokenizer_config's add_bos_token then); EOS ids are the union of tokenizer_config's and
    genai_config's."""
    transformers = pytest.importorskip("transformers")
    tj = json.loads((pkg / "tokenizer.json").read_text())
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    cfg = json.loads((pkg / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=False, add_eos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "genai_config.json").write_text(
        json.dumps({"model": {"eos_token_id": [0, 2, 5], "bos_token_id": 1}})
    )
    ours = Tokenizer.from_dir(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("Hello there", " x", ""):
        assert ours.encode(text) == ref.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.encode("Hi")[0] == ours.bos_token_id == 1
    eos_cfg = ours.token_to_id(cfg["eos_token"])
    assert ours.eos_token_ids[0] == eos_cfg and set(ours.eos_token_ids) == {eos_cfg, 0, 2, 5}


def test_from_dir_errors(tmp_path: Path, pkg: Path) -> None:
    with pytest.raises(MissingTokenizer, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(MissingTokenizer, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(pkg / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(MissingTokenizer, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(tmp_path)


# --- streaming detokenization on SmolLM2 (byte-level BPE) -----------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_stream_equals_full_decode(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    out, pieces = stream(tok, ids, skip)
    assert out == tok.decode(ids, skip_special_tokens=skip)
    # valid text never streams a broken character
    assert all("\ufffd" not in p for p in pieces)


def test_stream_holds_partial_utf8(tok: Tokenizer) -> None:
    """A 4-byte emoji split over byte-level tokens comes out whole, only once complete."""
    text = "😀"
    ids = tok.encode(text)
    assert len(ids) >= 2, "need an emoji that spans tokens for this test"
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == text
    assert d.flush() == ""


def test_stream_truly_invalid_tail(tok: Tokenizer) -> None:
    """An incomplete character at the end is U+FFFD at flush, as in the full decode."""
    ids = tok.encode("ok 😀")
    cut = ids[:-1]  # drop the final byte token of the emoji
    full = tok.decode(cut)
    assert full.endswith("\ufffd")
    out, pieces = stream(tok, cut)
    assert out == full and pieces[-1].endswith("\ufffd")


@PROP
@given(data=st.data())
def test_stream_random_ids(tok: Tokenizer, data: st.DataObject) -> None:
    special = sorted(tok.special_ids)
    idx = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(special))
    ids = data.draw(st.lists(idx, max_size=40))
    skip = data.draw(st.booleans())
    assert stream(tok, ids, skip)[0] == tok.decode(ids, skip_special_tokens=skip)


@PROP
@given(text=st.text(max_size=80), skip=st.booleans())
def test_stream_random_text(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    assert stream(tok, ids, skip)[0] == tok.decode(ids, skip_special_tokens=skip)


# SmolLM2's byte-level vocab lacks a few byte symbols (some C0 controls, 0xF1/0xF2 lead bytes of
# planes 4-11, ...), so only text without those bytes round-trips; the BMP minus controls does.
BMP_TEXT = st.text(st.characters(max_codepoint=0xFFFF, blacklist_categories=("Cc", "Cs")), max_size=60)


@PROP
@given(text=BMP_TEXT | st.text(alphabet="ab \n\t中文😀🎉é\u0301", max_size=40))
def test_stream_round_trips_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    out, pieces = stream(tok, ids)
    assert out == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


class _CountingTokenizer:
    """Forwards to a Tokenizer and records the size of every decode window."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.special_ids = inner.special_ids
        self.byte_fallback_ids = inner.byte_fallback_ids
        self.windows: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.windows.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)


def test_stream_window_is_bounded(tok: Tokenizer) -> None:
    """O(1) per token: decode windows stay a few tokens long however long the text is."""
    text = " ".join(TEXTS) * 20
    ids = tok.encode(text)
    assert len(ids) > 1000
    counting = _CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
    out = "".join(d.push(i) for i in ids) + d.flush()
    assert out == tok.decode(ids)
    assert max(counting.windows) <= 8, max(counting.windows)
    assert len(counting.windows) <= 2 * len(ids) + 2


# --- streaming on sentencepiece-style (metaspace, byte fallback) tokenizers -----------------


def _metaspace_tokenizer(style: str) -> Tokenizer:
    """A tiny Unigram with byte fallback that adds `<s>`. `llama`: Prepend/Replace normalizer and the Llama decoder
    (Replace ▁, ByteFallback, Fuse, Strip one leading space); `metaspace`: Metaspace pre-tokenizer
    and decoder (prepend_scheme="first") after ByteFallback."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    words = [
        "▁",
        "▁the",
        "▁hello",
        "▁world",
        "▁a",
        "he",
        "llo",
        "wor",
        "ld",
        "▁▁",
        "▁\n",
        "\n",
        "中",
        "▁中",
        "文",
    ]
    pieces += [(w, -1.0 - 0.1 * i) for i, w in enumerate(words)]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz.,!?'"]
    backend = Backend(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    if style == "llama":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace("▁", prepend_scheme="first")]
        )
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    backend.add_tokens([AddedToken("<tool>", special=False)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def sp_tok(request: pytest.FixtureRequest) -> Tokenizer:
    return _metaspace_tokenizer(request.param)


def test_metaspace_leading_spaces(sp_tok: Tokenizer) -> None:
    text = "the hello  world\n a 中文 😀 zq"
    ids = sp_tok.encode(text)
    assert ids[0] == sp_tok.bos_token_id
    assert sp_tok.byte_fallback_ids and set(ids) & sp_tok.byte_fallback_ids  # 😀 goes through bytes
    for skip in (False, True):
        out, pieces = stream(sp_tok, ids, skip)
        assert out == sp_tok.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in p for p in pieces)
    assert stream(sp_tok, ids, True)[0] == text  # the prepended ▁ of the first word is stripped once


SP_ALPHABET = "ab hello world the\n中文😀é▁\t"


@PROP
@given(data=st.data())
def test_metaspace_stream_random_ids(sp_tok: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, sp_tok.vocab_size - 1), max_size=40))
    skip = data.draw(st.booleans())
    assert stream(sp_tok, ids, skip)[0] == sp_tok.decode(ids, skip_special_tokens=skip)


@PROP
@given(text=st.text(alphabet=SP_ALPHABET, max_size=40) | st.text(max_size=20), skip=st.booleans())
def test_metaspace_stream_random_text(sp_tok: Tokenizer, text: str, skip: bool) -> None:
    ids = sp_tok.encode(text)
    assert stream(sp_tok, ids, skip)[0] == sp_tok.decode(ids, skip_special_tokens=skip)


def test_byte_fallback_run_invalidated_later() -> None:
    """ByteFallback turns a whole byte run into U+FFFD when a later byte makes it invalid, so bytes
    that already decode ('X8') must not be streamed before the run closes."""
    t = _metaspace_tokenizer("llama")
    ids = [t.token_to_id(f"<0x{b:02X}>") for b in (0x58, 0x38, 0x89)] + [t.token_to_id("he")]
    assert None not in ids
    full = t.decode(ids)  # type: ignore[arg-type]
    assert full.startswith("\ufffd\ufffd\ufffd")
    assert stream(t, ids)[0] == full  # type: ignore[arg-type]


# --- chat templates -------------------------------------------------------------------------

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Bleu."},
        {"role": "user", "content": "Another one, with émojis 😀 and 中文?"},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  and 3+3?\n"},
        {"role": "assistant", "content": "6"},
    ],
]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(spec: Any, tok: Tokenizer, hf: Any, conv: int, gen: bool) -> None:
    msgs = CONVERSATIONS[conv]
    ct = ChatTemplate.from_spec(spec, tok)
    assert ct is not None
    ours = ct.render(msgs, add_generation_prompt=gen)
    ref = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert ours == ref
    assert tok.encode(ours, add_special_tokens=False) == hf.encode(ref, add_special_tokens=False)


# A template of our own that exercises what HF's environment adds: namespace, loop controls,
# tojson with indent and non-ASCII, trim/lstrip blocks, tools, extra kwargs, generation blocks.
RICH_TEMPLATE = """\
{%- set ns = namespace(system=none, turns=0) -%}
{%- if messages[0].role == 'system' -%}
  {%- set ns.system = messages[0].content -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set loop_messages = messages -%}
{%- endif %}
{{ bos_token }}
{% if ns.system is not none %}
[SYS] {{ ns.system | trim }}
{% endif %}
{% if tools %}
[TOOLS] {{ tools | tojson }}
  {% for t in tools %}
- {{ t.function.name }}: {{ t.function | tojson(indent=2) }}
  {% endfor %}
{% endif %}
{% for m in loop_messages %}
  {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}
  {% if m.content == 'STOP' %}{% break %}{% endif %}
  {% if m.content == 'SKIP' %}{% continue %}{% endif %}
  {% set ns.turns = ns.turns + 1 %}
<{{ m.role }} n={{ loop.index }}{{ ' last' if loop.last }}>
    {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}

{{ eos_token if m.role == 'assistant' }}
{% endfor %}
turns={{ ns.turns }}{{ ' /no_think' if enable_thinking is defined and not enable_thinking }}
{% if add_generation_prompt %}<assistant>{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "météo",
            "description": "Weather in a city — 天气",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_rich_template_matches_transformers(tok: Tokenizer, hf: Any, conv: int, gen: bool) -> None:
    msgs = [
        *CONVERSATIONS[conv],
        {"role": "user", "content": "SKIP"},
        {"role": "user", "content": "after skip"},
    ]
    if conv % 2:
        msgs += [{"role": "user", "content": "STOP"}, {"role": "user", "content": "never shown"}]
    ct = ChatTemplate(RICH_TEMPLATE, **tok.special_tokens())
    extra: dict[str, Any] = {"tools": TOOLS} if conv % 2 == 0 else {"enable_thinking": False}
    ours = ct.render(msgs, add_generation_prompt=gen, **extra)
    ref = hf.apply_chat_template(
        msgs, chat_template=RICH_TEMPLATE, tokenize=False, add_generation_prompt=gen, **extra
    )
    assert ours == ref
    assert "never shown" not in ours and "SKIP" not in ours


def test_content_parts_are_joined(spec: Any, tok: Tokenizer) -> None:
    ct = ChatTemplate.from_spec(spec, tok)
    assert ct is not None
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ct.render(parts) == ct.render([{"role": "user", "content": "a\nb"}])


def test_from_spec_without_template(spec: Any, tok: Tokenizer) -> None:
    assert ChatTemplate.from_spec(dataclasses.replace(spec, chat_template=None), tok) is None


def test_strftime_now_and_defaults() -> None:
    from datetime import datetime

    ct = ChatTemplate(
        "{{ strftime_now('%Y') }}|{{ bos_token }}|{{ pad_token }}|{{ messages | length }}", bos_token="<s>"
    )
    year = datetime.now().year
    assert ct.render([{"role": "user", "content": "x"}]) in (f"{year}|<s>||1", f"{year + 1}|<s>||1")


@pytest.mark.parametrize(
    "bad",
    [
        "not a list",
        [],
        ["not a dict"],
        [{"content": "no role"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 42}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": 1}]}],
    ],
)
def test_invalid_messages(bad: Any) -> None:
    ct = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(InvalidRequest) as info:
        ct.render(bad)
    assert info.value.field == "messages"


def test_tools_validated() -> None:
    ct = ChatTemplate("{{ tools | length }}")
    assert ct.render([{"role": "user", "content": "x"}], tools=TOOLS) == "1"
    with pytest.raises(InvalidRequest) as info:
        ct.render([{"role": "user", "content": "x"}], tools="nope")
    assert info.value.field == "tools"


def test_raise_exception_is_template_error() -> None:
    ct = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    )
    assert ct.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="Conversation must start with user"):
        ct.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__ }}",
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages[0].items.__self__ }}",
        "{{ (messages | first).__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{% set x = messages.append({'role': 'x'}) %}",
        "{% set x = messages[0].update({'role': 'x'}) %}",
        "{% set ns = namespace() %}{% set ns._hidden = 1 %}",
        "{{ namespace(_x=1) }}",
    ],
)
def test_sandbox_blocks_escapes(source: str) -> None:
    ct = ChatTemplate(source)
    with pytest.raises(TemplateError):
        ct.render([{"role": "user", "content": "x"}])


def test_template_errors_name_the_problem() -> None:
    with pytest.raises(TemplateError, match="line 2"):
        ChatTemplate("ok\n{% for m in messages %}{{ m.content }")
    with pytest.raises(TemplateError, match="undefined"):
        ChatTemplate("{{ nothing.here }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


def test_render_does_not_touch_caller_messages(spec: Any, tok: Tokenizer) -> None:
    ct = ChatTemplate.from_spec(spec, tok)
    assert ct is not None
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}], "name": None}]
    snapshot = json.dumps(msgs)
    ct.render(msgs)
    assert json.dumps(msgs) == snapshot


def test_random_conversations_match_transformers(spec: Any, tok: Tokenizer, hf: Any) -> None:
    rng = random.Random(1234)
    ct = ChatTemplate.from_spec(spec, tok)
    assert ct is not None
    words = ["hi", "Paris", " spaced ", "中文", "😀", "\n", "line\nbreak", "<|im_end|>"]
    for _ in range(20):
        msgs = [{"role": "system", "content": rng.choice(words)}] if rng.random() < 0.5 else []
        for turn in range(rng.randint(1, 4)):
            msgs.append(
                {
                    "role": "user" if turn % 2 == 0 else "assistant",
                    "content": "".join(rng.choices(words, k=3)),
                }
            )
        gen = rng.random() < 0.5
        assert ct.render(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen
        )
