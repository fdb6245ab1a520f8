"""The command line: generate, show, chat (piped), errors."""

from __future__ import annotations

import io
import json
import re

import pytest

import onnxgen
from onnxgen.cli.chat import Repl
from onnxgen.cli.main import main


def test_generate_streams_text_and_prints_stats(tiny_dir, capsys):
    rc = main(["generate", str(tiny_dir), "--prompt", "hello", "--max-new-tokens", "6", "--threads", "1"])
    out, err = capsys.readouterr()
    assert rc == 0
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    ref = m.generate([{"role": "user", "content": "hello"}], max_new_tokens=6)
    assert out == ref.text + "\n"
    assert re.search(r"\d+ prompt tokens · \d+ generated · ttft \d+ ms · [\d.]+ tok/s", err)


def test_generate_messages_file_system_and_raw(tiny_dir, tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    assert (
        main(
            ["generate", str(tiny_dir), "--messages", str(f), "--system", "be brief", "--max-new-tokens", "3"]
        )
        == 0
    )
    assert (
        main(
            [
                "generate",
                str(tiny_dir),
                "--prompt",
                "raw text",
                "--raw",
                "--max-new-tokens",
                "3",
                "--no-stream",
            ]
        )
        == 0
    )
    capsys.readouterr()
    f.write_text("{not json")
    assert main(["generate", str(tiny_dir), "--messages", str(f)]) == 2
    assert "cannot read a JSON list" in capsys.readouterr().err


def test_bad_model_path_is_one_clear_line(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "no such model folder" in err and "Traceback" not in err


def test_show_lists_every_load_option_and_environment_variable(capsys):
    """`onnxgen show --options --env`: each config field (a flat `load()` option) and each registered
    `ONNXGEN_*` variable, by name."""
    import onnxgen.envs as envs
    from onnxgen.config import Config

    assert main(["show", "--options", "--env"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in Config.options())
    assert all(name in out for name, _, _ in envs.describe())


def test_show_describes_the_package(tiny_dir, capsys):
    assert main(["show", str(tiny_dir)]) == 0
    out = capsys.readouterr().out
    assert "GroupQueryAttention" not in out and "layers" in out and "2 /" in out


def test_chat_repl_reuses_history_and_commands(tiny_dir):
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    script = "hello there\nhow are you\n/stats\n/system be terse\nagain\n/stats\n/reset\n/stats\nhi\n/exit\nignored\n"
    out = io.StringIO()
    repl = Repl(m, {"max_new_tokens": 6}, "You are helpful.", io.StringIO(script), out, io.StringIO())
    assert repl.loop() == 0
    lines = out.getvalue().splitlines()
    stats = [ln for ln in lines if ln.startswith("[ ") and " in · " in ln]
    # turn 2 reused the whole of turn 1 (everything but the last generated token)
    first, second_after_edit = stats[0], stats[1]
    reused = int(re.search(r"· (\d+) reused", first).group(1))
    assert reused > 10
    # after /system changed the first message, the next turn reuses only up to the edit
    reused_edit = int(re.search(r"· (\d+) reused", second_after_edit).group(1))
    n_in = int(re.search(r"\[ (\d+) in", second_after_edit).group(1))
    assert 0 < reused_edit < n_in - 10
    ids_a = m.encode([{"role": "system", "content": "You are helpful."}])
    ids_b = m.encode([{"role": "system", "content": "be terse"}])
    lcp = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=False)) if a != b)
    assert reused_edit == lcp
    assert "[ conversation and KV cache cleared ]" in lines
    assert any("session retains 0 tokens" in ln for ln in lines)
    assert len(repl.history) == 2  # /reset, then one turn: "hi" + reply


def test_chat_keyboard_interrupt_keeps_session_consistent(tiny_dir):
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    repl = Repl(m, {"max_new_tokens": 12}, None, io.StringIO(""), io.StringIO(), io.StringIO())
    calls = {"n": 0}
    real = repl.session.generate

    def interrupted(prompt, **kw):
        def on_token(piece):
            calls["n"] += 1
            kw_on(piece)
            if calls["n"] == 3:
                raise KeyboardInterrupt

        kw_on = kw.pop("on_token")
        return real(prompt, on_token=on_token, **kw)

    repl.session.generate = interrupted  # type: ignore[method-assign]
    repl.turn("tell me a story")
    assert repl.session.retained_tokens == 0
    assert repl.history[-1]["role"] == "assistant"
    repl.session.generate = real  # type: ignore[method-assign]
    repl.turn("go on")
    fresh = m.generate(repl.messages()[:-1], max_new_tokens=12, reuse=False)
    assert repl.history[-1]["content"] == fresh.text
    assert repl.last.stats.reused_tokens == 0


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["chat", "--help"], ["show", "--help"]])
def test_help_works(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: onnxgen" in capsys.readouterr().out


def test_generate_structured_output_flags(tiny_dir, tmp_path, capsys):
    pytest.importorskip("llguidance")
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["x", "y"]}},
                "required": ["ok", "c"],
                "additionalProperties": False,
            }
        )
    )
    base = [
        "generate",
        str(tiny_dir),
        "--prompt",
        "json:",
        "--max-new-tokens",
        "60",
        "--threads",
        "1",
        "--temperature",
        "1.0",
        "--seed",
        "3",
        "--no-stream",
    ]
    assert main([*base, "--json-schema", str(schema)]) == 0
    out = capsys.readouterr()
    value = json.loads(out.out)
    assert set(value) == {"ok", "c"} and value["c"] in ("x", "y") and "finish stop" in out.err
    assert main([*base, "--regex", "[0-9]{3}"]) == 0
    text = capsys.readouterr().out.strip()
    assert len(text) == 3 and text.isdigit()
    grammar = tmp_path / "yn.lark"
    grammar.write_text('start: "yes" | "no"')
    assert main([*base, "--grammar", str(grammar)]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    # bad constraints: one clear line, exit 2, nothing generated
    assert main([*base, "--regex", "(unclosed"]) == 2
    assert main([*base, "--json-schema", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "missing.json" in err and "cannot read" in err
    with pytest.raises(SystemExit):  # one constraint at a time
        main([*base, "--json", "--regex", "a"])


def test_serve_replicas_starts_the_cluster_with_the_servers_options(tiny_dir, monkeypatch, capsys):
    pytest.importorskip("ray.serve")
    from onnxgen.serve.cluster import deployment

    seen = {}
    monkeypatch.setattr(
        deployment, "run_local", lambda model, config, host, port, progress: seen.update(locals())
    )
    argv = [
        "serve",
        str(tiny_dir),
        "--replicas",
        "2",
        "--router",
        "round_robin",
        "--api-key",
        "k1",
        "--max-queue",
        "7",
        "--threads",
        "1",
        "--port",
        "9",
    ]
    assert main(argv) == 0
    config = seen["config"]
    assert seen["model"] == str(tiny_dir) and seen["port"] == 9 and config.replicas == 2
    assert config.mode == "round_robin" and config.num_gpus == 0.0
    assert config.server["api_keys"] == ("k1",) and config.server["max_queue"] == 7
    assert config.server["model_id"] == tiny_dir.name
    assert config.load == {
        "backend": "auto",
        "device": "cpu",
        "chunk_size": 512,
        "max_sessions": 8,
        "threads": 1,
    }
    assert "2 replica(s)" in capsys.readouterr().err
    seen["progress"]("waiting for onnxgen (15 s): ...")
    assert "waiting for onnxgen (15 s)" in capsys.readouterr().err  # what replicas wait for reaches the user
    assert main(["serve", str(tiny_dir), "--replicas", "0"]) != 0


def test_replicas_share_the_visible_cards_by_default(monkeypatch):
    """`--replicas N --device cuda` without `--replica-gpus`: a card each where there are N, else the cards
    shared evenly, so that N replicas on one card can all be placed; nothing on the CPU."""
    pytest.importorskip("ray.serve")
    import torch

    from onnxgen.serve.cluster.deployment import replica_gpus

    assert replica_gpus("cpu", 2) == 0.0
    for cards, replicas, each in ((1, 2, 0.5), (1, 4, 0.25), (4, 2, 1.0), (2, 2, 1.0)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=cards: n)
        assert replica_gpus("cuda", replicas) == each


def test_generate_with_tensor_parallel_equals_one_process(tiny_dir, capsys):
    """`--tensor-parallel 2` shards the native backend over two processes (gloo on the CPU) and prints what one
    process prints; `--backend auto` becomes native (the only backend that shards); the ort backend is refused
    by name."""
    argv = ["generate", str(tiny_dir), "--prompt", "hello", "--max-new-tokens", "6", "--no-stream"]
    assert main([*argv, "--backend", "native"]) == 0
    one = capsys.readouterr().out
    assert main([*argv, "--tensor-parallel", "2"]) == 0
    assert capsys.readouterr().out == one
    assert main([*argv, "--backend", "ort", "--tensor-parallel", "2"]) == 2
    assert "tensor_parallel=2 needs the native backend" in capsys.readouterr().err
