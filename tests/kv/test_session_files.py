"""Session files (`Session.save`, `Model.restore_session`): a restored session's next turn equals the retained
session's on every executor (ort shared and concat KV, native paged and per-request decoders), across a fresh
model and a fresh process; a file that does not fit (truncated, flipped bytes, another package, backend or
salt) is a `SessionFileError` naming why, and nothing of it is attached."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnxgen
from onnxgen.errors import InvalidRequest, SessionFileError
from tests.conftest import native_available

MODES = {
    "ort-shared": {"backend": "ort"},
    "ort-concat": {"backend": "ort", "kv_mode": "concat"},
    "native-paged": {"backend": "native"},
    "native-decoder": {"backend": "native", "paged": False},
}
NATIVE = pytest.mark.skipif(not native_available(), reason="the native backend needs torch")


def _modes() -> list:
    return [pytest.param(k, marks=NATIVE) if k.startswith("native") else k for k in MODES]


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _turn(session, ids: list[int], new: int = 6):
    return session.generate(ids, max_new_tokens=new, temperature=0, output_logits=True)


def _context(result) -> list[int]:
    return [*result.prompt_ids, *result.tokens]


@pytest.fixture(scope="module")
def models(tiny_dir):
    loaded: dict[str, onnxgen.Model] = {}

    def get(mode: str) -> onnxgen.Model:
        if mode not in loaded:
            loaded[mode] = onnxgen.load(str(tiny_dir), device="cpu", **MODES[mode])
        return loaded[mode]

    yield get
    for m in loaded.values():
        m.close()


@pytest.mark.parametrize("mode", _modes())
def test_a_restored_session_continues_exactly_as_the_retained_one(models, tiny_dir, tmp_path, mode):
    model = models(mode)
    vocab = model.spec.vocab_size
    s = model.session()
    first = _turn(s, _ids(300, 1, vocab))
    path = tmp_path / "s.onnxgen"
    size = s.save(path)
    assert path.stat().st_size == size and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    held = s.retained_tokens  # the fed tokens: the context but its last generated token
    assert held == len(_context(first)) - 1 and s.history == tuple(_context(first)[:-1])
    follow = [*_context(first), *_ids(20, 2, vocab)]
    kept = _turn(s, follow)
    assert kept.stats.reused_tokens == held

    fresh = onnxgen.load(str(tiny_dir), device="cpu", **MODES[mode])  # another model: nothing cached
    try:
        r = fresh.restore_session(path)
        assert r.retained_tokens == held and r.history == tuple(_context(first)[:-1])
        restored = _turn(r, follow)
        assert restored.stats.reused_tokens == held, restored.stats
        assert restored.tokens == kept.tokens
        np.testing.assert_allclose(restored.logits, kept.logits, rtol=0, atol=1e-5)
        cold = fresh.generate(follow, max_new_tokens=6, temperature=0, reuse=False)  # both equal a cold start
        assert cold.stats.reused_tokens == 0 and cold.tokens == kept.tokens
    finally:
        fresh.close()


@pytest.mark.parametrize("mode", ["ort-shared", pytest.param("native-paged", marks=NATIVE)])
def test_a_session_file_survives_a_process_restart(models, tiny_dir, tmp_path, mode):
    """Save here, restore in another process: the next turn reuses the file and equals the retained turn here
    (identical tokens, logits within 1e-5)."""
    code = """
import json, sys, numpy as np, onnxgen
path, follow = sys.argv[1], json.loads(sys.argv[2])
m = onnxgen.load(sys.argv[3], device="cpu", backend=sys.argv[4])
s = m.restore_session(path)
held = s.retained_tokens
r = s.generate(json.loads(s.note) + follow, max_new_tokens=5, temperature=0, output_logits=True)
logits = np.asarray(r.logits, dtype=np.float64).tolist()
print(json.dumps({"tokens": r.tokens, "reused": r.stats.reused_tokens, "held": held, "logits": logits}))
m.close()  # NOTE: the engine loop and the native backend's threads stop before the interpreter does
"""
    model = models(mode)
    vocab = model.spec.vocab_size
    s = model.session()
    ctx = _context(s.generate(_ids(200, 5, vocab), max_new_tokens=5, temperature=0))
    path = tmp_path / "s.onnxgen"
    s.save(path, note=json.dumps(ctx))  # the note: the conversation as the application keeps it
    follow = _ids(30, 6, vocab)
    kept = s.generate(ctx + follow, max_new_tokens=5, temperature=0, output_logits=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(onnxgen.__file__).parents[1]), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), json.dumps(follow), str(tiny_dir), MODES[mode]["backend"]],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    restored = json.loads(proc.stdout.strip().splitlines()[-1])
    assert restored["tokens"] == kept.tokens
    np.testing.assert_allclose(restored["logits"], np.asarray(kept.logits), rtol=0, atol=1e-5)
    assert restored["reused"] == restored["held"] == kept.stats.reused_tokens == len(ctx) - 1 > 200
    s.close()


# --- files that do not fit: typed errors, nothing attached -----------------------------------------------


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    """One saved session of the ort model: (model, path, the context's ids)."""
    model = models("ort-shared")
    s = model.session()
    r = _turn(s, _ids(64, 7, model.spec.vocab_size))
    path = tmp_path_factory.mktemp("files") / "good.onnxgen"
    s.save(path)
    return model, path, _context(r)


def _restore_fails(model, path, reason: str, **kw) -> SessionFileError:
    before = model.kv_stats()
    with pytest.raises(SessionFileError) as info:
        model.restore_session(path, **kw)
    assert info.value.reason == reason, (info.value.reason, str(info.value))
    assert str(path) in str(info.value)
    after = model.kv_stats()
    assert after["retained_kv_bytes"] == before["retained_kv_bytes"]  # nothing attached
    return info.value


def _flipped(path: Path, tmp_path: Path, at: int, bit: int = 4) -> Path:
    """A copy of `path` with one bit of byte `at` flipped."""
    data = bytearray(path.read_bytes())
    data[at] ^= 1 << bit
    out = tmp_path / f"flipped_{path.stem}_{at}.onnxgen"
    out.write_bytes(bytes(data))
    return out


def test_a_truncated_file_is_refused(saved, tmp_path):
    model, path, _ = saved
    data = path.read_bytes()
    for cut in (0, 5, 8, 40, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.onnxgen"
        bad.write_bytes(data[:cut])
        with pytest.raises(SessionFileError) as info:
            model.restore_session(bad)
        assert info.value.reason in ("truncated", "format"), (cut, info.value.reason)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_is_refused(saved, tmp_path, at, bit):
    model, path, _ = saved
    data = bytearray(path.read_bytes())
    i = int(at * len(data))
    data[i] ^= 1 << bit
    bad = tmp_path / "flipped.onnxgen"
    bad.write_bytes(bytes(data))
    with pytest.raises(SessionFileError) as info:
        model.restore_session(bad)
    assert info.value.reason in ("truncated", "format", "checksum")


def test_edited_token_ids_are_refused_by_the_checksum(saved, tmp_path):
    model, path, ctx = saved
    data = path.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8 : 8 + hlen])
    head["__metadata__"]["tokens"] = json.dumps([*ctx[:-1], (ctx[-1] + 1) % model.spec.vocab_size])
    new = json.dumps(head).encode()
    new += b" " * (-len(new) % 8)
    bad = tmp_path / "edited.onnxgen"
    bad.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + hlen :])
    _restore_fails(model, bad, "checksum")


def test_another_salt_is_refused(saved, models, tmp_path):
    model, path, _ = saved
    _restore_fails(model, path, "salt", salt="tenant-b")
    s = model.session(salt="tenant-a")
    _turn(s, _ids(40, 9, model.spec.vocab_size))
    salted = tmp_path / "salted.onnxgen"
    s.save(salted)
    assert b"tenant-a" not in salted.read_bytes()  # the salt itself never reaches the disk
    _restore_fails(model, salted, "salt")  # no salt is another salt
    model.restore_session(salted, salt="tenant-a").close()


def test_another_package_and_backend_are_refused(saved, models, tmp_path):
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    _, path, _ = saved
    other = write_package(
        tmp_path / "other", SyntheticConfig(num_layers=2, context_length=1024), seed=1
    )  # other weights
    m = onnxgen.load(str(other), device="cpu", backend="ort")
    try:
        _restore_fails(m, path, "package")
    finally:
        m.close()
    if native_available():
        _restore_fails(models("native-paged"), path, "backend")


def test_saving_needs_a_retained_context_and_a_failed_save_leaves_nothing(models, tmp_path):
    model = models("ort-shared")
    s = model.session()
    with pytest.raises(InvalidRequest):
        s.save(tmp_path / "none.onnxgen")
    _turn(s, _ids(30, 3, model.spec.vocab_size))
    (tmp_path / "dir.onnxgen").mkdir()
    with pytest.raises(OSError):
        s.save(tmp_path / "dir.onnxgen")  # a folder in the way: the rename fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.onnxgen"]
    assert s.retained_tokens > 0  # the session keeps its context


def test_the_file_is_a_safetensors_file(saved):
    safetensors = pytest.importorskip("safetensors.numpy")
    model, path, ctx = saved
    tensors = safetensors.load_file(str(path))
    spec = model.spec
    assert sorted(tensors) == sorted(f"{kv}.{i}" for i in range(spec.num_layers) for kv in "kv")
    assert tensors["k.0"].shape == (spec.num_kv_heads, len(ctx) - 1, spec.head_size)  # the fed tokens


# --- random orders of turns, saves, evictions and restores ----------------------------------------------


@pytest.mark.parametrize("mode", _modes())
def test_random_save_evict_restore_orders_equal_cold_runs(models, tmp_path, mode):
    """Whatever happened to a conversation's KV (kept, evicted, saved and restored into a new session, restored
    twice), each turn's tokens equal a cold run of the same context."""
    model = models(mode)
    vocab = model.spec.vocab_size
    rng = np.random.default_rng(11)
    s, ctx, files = model.session(), _ids(40, 12, vocab), []
    for step in range(14):
        op = rng.choice(["turn", "turn", "save", "evict", "restore"])
        if op == "save" and s.retained_tokens:
            files.append((tmp_path / f"f{step}.onnxgen", list(ctx)))
            s.save(files[-1][0])
            assert list(s.history) == ctx[:-1]  # the session holds the context but its last token
        elif op == "evict":
            s.evict()
        elif op == "restore" and files:
            path, ctx = files[int(rng.integers(len(files)))]
            s.close()
            s = model.restore_session(path)
            assert list(s.history) == ctx[:-1] and s.retained_tokens == len(ctx) - 1
        else:
            prompt = [*ctx, *_ids(int(rng.integers(1, 40)), step, vocab)]
            warm = s.generate(prompt, max_new_tokens=4, temperature=0)
            cold = model.generate(prompt, max_new_tokens=4, temperature=0, reuse=False)
            assert warm.tokens == cold.tokens, (step, op)
            ctx = _context(warm)
    s.close()


# --- the CLI's chat and the server ----------------------------------------------------------------------


def test_chat_save_and_resume_continue_the_conversation(tiny_dir, tmp_path, capsys):
    """`onnxgen chat --save FILE`, then `--resume FILE`: the messages come back and the next turn reuses the
    saved KV whole."""
    import io

    from onnxgen.cli.chat import Repl

    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    try:
        first = Repl(
            m, {"max_new_tokens": 6}, "Be brief.", io.StringIO("hello there\n"), io.StringIO(), io.StringIO()
        )
        first.loop()
        path = tmp_path / "chat.onnxgen"
        first.save(path)
        kept = first.session.retained_tokens
        again = Repl(m, {"max_new_tokens": 6}, None, io.StringIO("and then?\n"), io.StringIO(), io.StringIO())
        again.resume(path)
        assert again.system == "Be brief." and again.history == first.history and len(again.history) == 2
        again.loop()
        assert (
            again.last.stats.reused_tokens >= kept - 1
        )  # the reply's text may end its last token differently
        assert len(again.history) == 4
    finally:
        m.close()


def test_the_server_saves_sessions_and_restores_them_by_id_after_a_restart(tiny_dir, tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from onnxgen.serve.app import RunningServer, ServerConfig, create_app

    key = "key-0123456789abcdef"
    auth = {"Authorization": f"Bearer {key}"}
    conv = [{"role": "user", "content": "remember this conversation"}]

    def chat(url: str, sid: str, messages: list) -> dict:
        body = {"model": "pkg", "messages": messages, "max_tokens": 5, "temperature": 0}
        r = httpx.post(
            url + "/v1/chat/completions", json=body, headers={**auth, "X-Session-Id": sid}, timeout=60
        )
        assert r.status_code == 200, r.text
        return r.json()

    config = ServerConfig(api_keys=(key,), kv_dir=str(tmp_path / "kv"), model_id="pkg", metrics_keys=(key,))
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    with RunningServer(create_app(m, config)) as srv:
        no_dir = ServerConfig(api_keys=(key,), model_id="pkg")
        sid = httpx.post(srv.url + "/v1/sessions", headers=auth).json()["id"]
        first = chat(srv.url, sid, conv)
        saved = httpx.post(f"{srv.url}/v1/sessions/{sid}/save", headers=auth)
        assert saved.status_code == 200 and saved.json()["tokens"] > 0, saved.text
        stats = m.kv_stats()
        assert (
            stats["session_files_saved"] == 1 and stats["session_files_saved_bytes"] == saved.json()["bytes"]
        )
        other = httpx.post(f"{srv.url}/v1/sessions/{sid}/save", headers={"Authorization": "Bearer nope"})
        assert other.status_code == 401
        assert httpx.post(f"{srv.url}/v1/sessions/{'0' * 32}/save", headers=auth).status_code == 404
    m.close()
    with RunningServer(create_app(onnxgen.load(str(tiny_dir), backend="ort", threads=1), no_dir)) as srv:
        sid2 = httpx.post(srv.url + "/v1/sessions", headers=auth).json()["id"]
        r = httpx.post(f"{srv.url}/v1/sessions/{sid2}/save", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "kv_dir_not_set"
    follow = [*conv, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    follow.append({"role": "user", "content": "and now?"})
    m2 = onnxgen.load(str(tiny_dir), backend="ort", threads=1)  # the restarted server
    with RunningServer(create_app(m2, config)) as srv:
        again = chat(srv.url, sid, follow)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
        d = httpx.delete(f"{srv.url}/v1/sessions/{sid}", headers=auth)
        assert d.status_code == 200
        metrics = httpx.get(srv.url + "/metrics", headers=auth).text
    assert "onnxgen_session_files_restored 1" in metrics
    assert list((tmp_path / "kv").iterdir()) == []  # the file went with the session
    m2.close()


def test_host_copies_round_trip_every_kv_dtype_bit_for_bit():
    """`kv.storage.host_copy` / `from_host`, the file's storage types: torch (bfloat16 as raw uint16, strided
    sources) and numpy (ml_dtypes' bfloat16, onnxruntime's), each a copy that shares no memory."""
    torch = pytest.importorskip("torch")
    import ml_dtypes

    from onnxgen.kv.storage import from_host, host_copy

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        src = torch.randn(3, 40, 8).to(dtype)[:, 5:30]  # a strided view, as a buffer's first positions are
        host = host_copy(src)
        assert host.flags["C_CONTIGUOUS"] and host.shape == (3, 25, 8)
        back = from_host(host, src)
        assert back.dtype == dtype and torch.equal(back, src)
        host[...] = 0
        assert not torch.equal(src, torch.zeros_like(src))  # a copy
    arr = np.random.default_rng(0).standard_normal((2, 9, 4)).astype(ml_dtypes.bfloat16)[:, 1:]
    host = host_copy(arr)
    assert host.dtype == np.uint16 and host.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(from_host(host, arr).view(np.uint16), arr.view(np.uint16))
    host[...] = 0
    assert arr.view(np.uint16).any()


def _next_turn(model, path, ctx):
    s = model.restore_session(path)
    try:
        return _turn(s, ctx + [5, 6, 7]).tokens
    finally:
        s.close()


def test_a_file_of_many_pieces_read_by_many_threads_and_one_in_another_order_restore_alike(
    models, saved, tmp_path, monkeypatch
):
    """A file is hashed piece by piece as its pieces are read, on several threads at once: a file saved with
    pieces far smaller than itself, read by 4 threads, restores as the one-piece file does, and a flipped
    byte in its last piece is still refused; a file whose tensors lie in another order than the header's
    layers (any safetensors writer may) restores too (its checksum is over the tensors in layer order)."""
    import onnxgen.kv.files as files

    model, path, ctx = saved
    want = _next_turn(model, path, ctx)
    monkeypatch.setattr(files, "CHUNK", 4096)
    monkeypatch.setattr(files, "READERS", 4)
    small = tmp_path / "small_pieces.onnxgen"
    s = model.restore_session(path)
    s.save(small)
    s.close()
    raw = small.read_bytes()
    meta = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])["__metadata__"]
    assert meta["chunk"] == "4096" and small.stat().st_size > 8 * 4096
    assert _next_turn(model, small, ctx) == want
    _restore_fails(model, _flipped(small, tmp_path, -3), "checksum")
    bad = tmp_path / "edited_piece_size.onnxgen"
    data = bytearray(small.read_bytes())
    hlen = struct.unpack("<Q", data[:8])[0]
    edited = data[: 8 + hlen].replace(b'"chunk":"4096"', b'"chunk":"8"') + data[8 + hlen :]
    bad.write_bytes(bytes(edited))
    _restore_fails(model, bad, "format")  # a piece size no writer uses: refused before any read

    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8 : 8 + hlen])
    body = raw[8 + hlen :]
    names = [n for n in table if n != "__metadata__"]
    blobs = {n: body[table[n]["data_offsets"][0] : table[n]["data_offsets"][1]] for n in names}
    out, offset = b"", 0
    for n in [names[1], names[0], *names[2:]]:  # the first layer's values before its keys
        table[n]["data_offsets"] = [offset, offset + len(blobs[n])]
        out += blobs[n]
        offset += len(blobs[n])
    head = json.dumps(table, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    moved = tmp_path / "reordered.onnxgen"
    moved.write_bytes(struct.pack("<Q", len(head)) + head + out)
    assert _next_turn(model, moved, ctx) == want


def test_a_format_1_file_still_restores_and_its_checksum_still_holds(saved, tmp_path):
    """Files of the first format (SHA-256 over the metadata and the tensors' bytes) are still read: the same
    KV rewritten as one restores to the same next turn, and an edited byte is refused."""
    import hashlib

    model, path, ctx = saved
    want = _next_turn(model, path, ctx)
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8 : 8 + hlen])
    body = raw[8 + hlen :]
    meta = table["__metadata__"]
    meta["format"] = "onnxgen-session/1"
    del meta["chunk"], meta["checksum"]
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    h.update(body)  # one writer's tensors: in layer order, end to end
    meta["checksum"] = h.hexdigest()
    head = json.dumps(table, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    old = tmp_path / "format1.onnxgen"
    old.write_bytes(struct.pack("<Q", len(head)) + head + body)
    assert _next_turn(model, old, ctx) == want
    _restore_fails(model, _flipped(old, tmp_path, -5), "checksum")


@pytest.mark.gpu
def test_on_cuda_a_file_goes_straight_to_the_device_and_continues_as_the_retained_session(
    tiny_dir, tmp_path, monkeypatch
):
    """A paged pool on CUDA reads a session file through the pinned ring (`kv/staging.py`): with pieces far
    smaller than the file and a ring of two slots (each reused many times, copies in flight while the next
    pieces are read), the restored session's next turn equals the retained one's, and a file with a flipped
    byte is refused with nothing attached."""
    import onnxgen.kv.files as files
    import onnxgen.kv.staging as staging

    monkeypatch.setattr(files, "CHUNK", 4096)
    monkeypatch.setattr(staging, "DEFAULT_SLOTS", 2)
    finished = []
    finish = staging.DeviceSink.finish
    monkeypatch.setattr(staging.DeviceSink, "finish", lambda self: finished.append(1) or finish(self))
    model = onnxgen.load(str(tiny_dir), device="cuda", backend="native")
    other = onnxgen.load(str(tiny_dir), device="cuda", backend="native")
    try:
        vocab = model.spec.vocab_size
        s = model.session()
        first = _turn(s, _ids(300, 1, vocab))
        path = tmp_path / "s.onnxgen"
        s.save(path)
        assert path.stat().st_size > 16 * 4096
        follow = [*_context(first), *_ids(20, 2, vocab)]
        kept = _turn(s, follow)
        r = other.restore_session(path)
        assert finished, "the file was not read through the device sink"
        restored = _turn(r, follow)
        assert restored.stats.reused_tokens == kept.stats.reused_tokens == len(_context(first)) - 1
        assert restored.tokens == kept.tokens
        np.testing.assert_allclose(restored.logits, kept.logits, rtol=0, atol=1e-5)
        r.close()
        _restore_fails(other, _flipped(path, tmp_path, -100), "checksum")
    finally:
        model.close()
        other.close()
