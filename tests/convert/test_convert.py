"""Checkpoint conversion (onnxruntime-genai's builder wrapped) and the default model's build protocol.

The expensive part, one conversion of a tiny random Llama, is a module fixture. Its logits are
checked against transformers on the same weights. The default model's lock-and-rename protocol is
tested with two racing processes and a fast fake builder under an `ONNXGEN_HOME` in tmp_path; the
real default model is never rebuilt here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from onnxgen.convert import checkpoint as ckpt
from onnxgen.convert import default as dflt
from onnxgen.errors import ConversionError, ModelNotBuilt
from onnxgen.package import load_spec
from onnxgen.package.home import default_model_dir

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")
torch = pytest.importorskip("torch")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_hf(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (hidden 64, SmolLM2's 49152-token vocab and tokenizer files)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src_tok = smollm2_dir  # SmolLM2's tokenizer files
    d = tmp_path_factory.mktemp("tiny_hf")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights so a dropped/misplaced norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(d)
    for name in TOKENIZER_FILES:
        shutil.copy(src_tok / name, d / name)
    return d


@pytest.fixture(scope="module")
def tiny_pkg(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "pkg"
    return ckpt.convert_checkpoint(tiny_hf, out, progress=False)


def _ort_step(sess, spec, ids: np.ndarray, past: dict[str, np.ndarray] | None):  # type: ignore[no-untyped-def]
    n_past = 0 if past is None else past[spec.present_key_names[0]].shape[2]
    t = ids.shape[0]
    feeds: dict[str, np.ndarray] = {spec.input_ids_name: ids[None].astype(np.int64)}
    if spec.attention_mask_name:
        feeds[spec.attention_mask_name] = np.ones((1, n_past + t), np.int64)
    if spec.position_ids_name:
        feeds[spec.position_ids_name] = np.arange(n_past, n_past + t, dtype=np.int64)[None]
    for i, (k, v) in enumerate(zip(spec.past_key_names, spec.past_value_names, strict=True)):
        if past is None:
            empty = np.zeros((1, spec.num_kv_heads, 0, spec.head_size), np.float32)
            feeds[k], feeds[v] = empty, empty
        else:
            feeds[k], feeds[v] = past[spec.present_key_names[i]], past[spec.present_value_names[i]]
    names = [spec.logits_name, *spec.present_key_names, *spec.present_value_names]
    outs = dict(zip(names, sess.run(names, feeds), strict=True))
    return outs[spec.logits_name], outs


def test_converted_package_matches_transformers(tiny_hf: Path, tiny_pkg: Path) -> None:
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM

    spec = load_spec(tiny_pkg)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_size) == (2, 4, 2, 16)
    assert spec.vocab_size == 49152 and spec.kv_dtype == "float32"
    # The chat template travels into the package as chat_template.jinja, unchanged.
    assert (tiny_pkg / "chat_template.jinja").read_text() == (tiny_hf / "chat_template.jinja").read_text()
    assert spec.chat_template == (tiny_hf / "chat_template.jinja").read_text()

    ref = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, 49152, size=13)
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)[None]).logits[0].numpy()
    assert np.abs(want).max() > 0.05  # the comparison below is not vacuous

    # Prefill of the first 12 tokens: every position's logits.
    sess = ort.InferenceSession(str(spec.decoder_path), providers=["CPUExecutionProvider"])
    got, presents = _ort_step(sess, spec, ids[:12], past=None)
    assert got.shape == (1, 12, 49152)
    np.testing.assert_allclose(got[0], want[:12], atol=1e-4, rtol=0)
    # One decode step on top of the presents: the 13th position.
    got13, _ = _ort_step(sess, spec, ids[12:], past=presents)
    np.testing.assert_allclose(got13[0, -1], want[12], atol=1e-4, rtol=0)


def test_refuses_non_empty_out_and_leaves_it_alone(tiny_hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        ckpt.convert_checkpoint(tiny_hf, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder left beside it


def test_overwrite_replaces_after_completion(tiny_pkg: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """overwrite=True swaps the old folder for the finished package (builder faked: copy tiny_pkg)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    seen_out_during_build: list[list[str]] = []

    def fake_run_logged(cmd, log_path, title, parser, progress, *, what):  # type: ignore[no-untyped-def]
        seen_out_during_build.append(sorted(p.name for p in out.iterdir()))
        shutil.copytree(tiny_pkg, cmd[cmd.index("-o") + 1])

    monkeypatch.setattr(ckpt, "_run_logged", fake_run_logged)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    ckpt.convert_checkpoint(hf, out, progress=False, overwrite=True)
    assert seen_out_during_build == [["stale.txt"]]  # the old folder stays until the new one is done
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tiny_pkg.iterdir())
    load_spec(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


def test_builder_failure_raises_and_leaves_no_out(tmp_path: Path) -> None:
    src = tmp_path / "broken"
    src.mkdir()
    # An architecture the builder knows, but no weights and no tokenizer: the subprocess itself fails.
    (src / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    out = tmp_path / "out"
    with pytest.raises(ConversionError) as info:
        ckpt.convert_checkpoint(src, out, progress=False)
    msg = str(info.value)
    assert "model builder failed" in msg and "exit code" in msg
    log = Path(msg.rsplit("full log: ", 1)[1].strip())
    assert (
        log.is_file() and "onnxgen.convert.builder_run" in log.read_text()
    )  # the log tail and path are real
    log.unlink()
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_unknown_architecture_fails_at_once_naming_it(tmp_path: Path) -> None:
    """An architecture the builder does not dispatch on fails before any subprocess, naming it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps({"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch"})
    )
    t0 = time.perf_counter()
    with pytest.raises(
        ConversionError, match=r"does not support the architecture NoSuchModelForCausalLM.*LlamaForCausalLM"
    ):
        ckpt.convert_checkpoint(src, tmp_path / "out", progress=False)
    assert time.perf_counter() - t0 < 5
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConversionError, match="names no architecture"):
        ckpt.convert_checkpoint(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    ("setup", "kwargs", "match"),
    [
        ("bad_json", {}, "not valid JSON"),
        ("no_config", {}, "no config.json"),
        ("missing", {}, "no such file"),
        ("ok", {"precision": "fp16", "execution_provider": "cpu"}, "valid pairs"),
        ("ok", {"precision": "int3"}, "unknown precision"),
    ],
)
def test_bad_arguments_fail_fast(tmp_path: Path, setup: str, kwargs: dict, match: str) -> None:
    src = tmp_path / "src"
    if setup != "missing":
        src.mkdir()
    if setup == "bad_json":
        (src / "config.json").write_text("{not json")
    elif setup == "ok":
        (src / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match=match):
        ckpt.convert_checkpoint(src, tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def test_missing_extra_names_install_command(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(ckpt, "missing_convert_deps", lambda gguf=False: ["onnxruntime-genai"])
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match=r"pip install 'onnxgen\[convert\]'"):
        ckpt.convert_checkpoint(src, tmp_path / "out", progress=False)

    monkeypatch.setenv("ONNXGEN_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelNotBuilt, match=r"pip install 'onnxgen\[convert\]'") as info:
        dflt.ensure_default_model(progress=False)
    assert info.value.path == default_model_dir()
    assert not default_model_dir().exists()


def test_chat_template_fallback_from_tokenizer_config(tmp_path: Path) -> None:
    hf, pkg = tmp_path / "hf", tmp_path / "pkg"
    hf.mkdir()
    pkg.mkdir()
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    ckpt.ensure_chat_template(hf, pkg)
    assert (pkg / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
    # An existing template is never replaced.
    (pkg / "chat_template.jinja").write_text("X")
    ckpt.ensure_chat_template(hf, pkg)
    assert (pkg / "chat_template.jinja").read_text() == "X"


def test_builder_progress_parser() -> None:
    p = ckpt._BuilderProgress(num_layers=30)
    assert p.feed("Reading layer 4") == ("building layers", 5, 30)
    desc, n, t = p.feed(
        "Saving lm_head.MatMul.weight (f32, [576,49152]): 100%|##########| 214/214 [00:02<00:00]"
    )
    assert (desc, n, t) == ("writing model.onnx", 214, 214)
    assert p.feed("GroupQueryAttention (GQA) is used in this model.") == (None, None, None)


# --- the default model: fast path, resolution, lock ---------------------------------------------


def test_fast_path_imports_nothing_heavy(tiny_pkg: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / default_model_dir().name).symlink_to(tiny_pkg, target_is_directory=True)
    code = textwrap.dedent("""
        import sys, time
        t = time.perf_counter()
        from onnxgen.convert.default import ensure_default_model
        p = ensure_default_model()
        heavy = sorted(m for m in ("torch", "transformers", "onnxruntime", "onnx", "rich") if m in sys.modules)
        print(p, heavy, round(time.perf_counter() - t, 3))
    """)
    res = subprocess.run(
        [sys.executable, "-c", code], env=_env(home), capture_output=True, text=True, check=True
    )
    path, rest = res.stdout.split(" ", 1)
    assert Path(path) == home / "models" / default_model_dir().name
    assert rest.startswith("[]"), res.stdout
    assert res.stderr == ""  # nothing said when nothing is built


def test_resolve_model_path(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ONNXGEN_HOME", str(tmp_path))
    calls: list[str] = []

    def ensure(progress: object = True, precision: str = "int4") -> Path:
        calls.append(precision)
        return Path("/built") / precision

    monkeypatch.setattr(dflt, "ensure_default_model", ensure)
    for alias in (None, "", "default", "default-int4"):
        assert dflt.resolve_model_path(alias) == Path("/built/int4")
        assert dflt.resolve_model_path(alias, build=False) == default_model_dir()
    assert dflt.resolve_model_path("default-fp32") == Path("/built/fp32")
    assert dflt.resolve_model_path("default-fp32", build=False) == default_model_dir("fp32")
    assert default_model_dir().name.endswith("-int4") and default_model_dir("fp32").name.endswith("-fp32")
    assert calls == ["int4"] * 4 + ["fp32"]
    assert dflt.resolve_model_path("~/m") == Path.home() / "m"
    assert dflt.resolve_model_path(str(tmp_path / "x")) == tmp_path / "x"
    assert dflt.resolve_model_path("default-fp16") == Path("default-fp16")  # not an alias: a folder name
    assert len(calls) == 5


def _env(home: Path) -> dict[str, str]:
    import os

    return dict(os.environ, ONNXGEN_HOME=str(home))


RACER = textwrap.dedent("""
    import os, shutil, sys, time
    from pathlib import Path
    from onnxgen.convert import default
    src, counter, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    def slow_copy(dest, progress):
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\\n")
        dest.mkdir()
        for p in sorted(src.iterdir()):          # one file at a time, slowly: a non-atomic
            shutil.copy(p, dest / p.name)        # install would be visible half-written
            time.sleep(0.05)
        while not go.exists():                   # hold the lock until the test says go
            time.sleep(0.02)
    print(default.build_default_model(slow_copy, progress=True))
""")


def test_two_processes_race_one_builds(tiny_pkg: Path, tmp_path: Path) -> None:
    """A builds (holding the lock); B, started meanwhile, waits; both return the same complete folder."""
    home = tmp_path / "home"
    script, counter, go = tmp_path / "racer.py", tmp_path / "builds.txt", tmp_path / "go"
    script.write_text(RACER)
    target = home / "models" / default_model_dir().name
    want = {p.name: p.stat().st_size for p in tiny_pkg.iterdir()}

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(script), str(tiny_pkg), str(counter), str(go)],
            env=_env(home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def watch(seconds: float) -> None:
        """Poll the target: whenever it is visible it must be complete."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if target.exists():
                assert {p.name: p.stat().st_size for p in target.iterdir()} == want
            time.sleep(0.005)

    a = start()
    deadline = time.monotonic() + 30
    while not counter.exists() and time.monotonic() < deadline:
        watch(0.02)
    assert counter.exists(), a.communicate()
    b = start()
    watch(1.5)  # B has started and is blocked on the lock
    assert b.poll() is None and a.poll() is None and not target.exists()
    go.touch()
    while a.poll() is None or b.poll() is None:
        watch(0.02)
    outs = [p.communicate() for p in (a, b)]
    assert (a.returncode, b.returncode) == (0, 0), outs
    assert [Path(o.strip()) for o, _ in outs] == [target, target]
    assert len(counter.read_text().split()) == 1  # exactly one process built
    assert "Waiting for another process" in outs[1][1] and "not built yet" in outs[0][1]
    assert {p.name: p.stat().st_size for p in target.iterdir()} == want
    load_spec(target)
    # No temporary folder is left behind.
    assert sorted(p.name for p in target.parent.iterdir()) == [".smollm2.lock", target.name]


def test_cli_convert_refuses_and_reports(tiny_hf: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from onnxgen.cli import convert as cli_convert

    ap = argparse.ArgumentParser(prog="onnxgen")
    cli_convert.register(ap.add_subparsers())
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    args = ap.parse_args(["convert", str(tiny_hf), str(out), "--precision", "fp32", "-q"])
    assert args.func(args) == 1
    assert "--overwrite" in capsys.readouterr().err
    args = ap.parse_args(["convert", str(tiny_hf), str(out), "--extra-option", "novalue"])
    assert args.func(args) == 2
    with pytest.raises(SystemExit):
        ap.parse_args(["convert", str(tiny_hf), str(out), "--precision", "int3"])
