"""Images through the server on the tiny Qwen2.5-VL: OpenAI `image_url` content parts (data: URLs; remote URLs
refused unless the operator allows them, then fetched) and Anthropic image blocks, each answering what the
Python API answers for the same image; a session's follow-up with the same image reports its cached tokens."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("PIL")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from onnxgen.serve.app import RunningServer, ServerConfig, create_app  # noqa: E402
from tests.harness import loaded  # noqa: E402


def png(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
        buf, format="PNG"
    )
    return buf.getvalue()


IMG = png(112, 140, 3)
DATA_URL = "data:image/png;base64," + base64.b64encode(IMG).decode()


def parts(url: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]


@pytest.fixture(scope="module")
def model(qwen_vl_dir):
    _, m = loaded(qwen_vl_dir, backend="ort", threads=2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def expected(model):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    return model.generate(msgs, images=[IMG], max_new_tokens=6, reuse=False)


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server holding the image at /img.png (what a remote URL points to)."""
    handler = functools.partial(_Handler, IMG)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/img.png"
    httpd.shutdown()


class _Handler(http.server.BaseHTTPRequestHandler):
    def __init__(self, body: bytes, *args, **kwargs):
        self.body = body
        super().__init__(*args, **kwargs)

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def serve(model, **config):
    return RunningServer(create_app(model, ServerConfig(**config)))


def test_openai_image_url_parts_answer_as_the_python_api(model, expected):
    with serve(model) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        mid = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=mid, messages=[{"role": "user", "content": parts(DATA_URL)}], max_tokens=6, temperature=0
        )
        assert r.choices[0].message.content == expected.text
        assert r.usage.prompt_tokens == expected.stats.prompt_tokens
        # a follow-up in a session with the same image finds the first turn's KV, image included
        sid = httpx.post(srv.url + "/v1/sessions").json()["id"]
        body = {"model": mid, "messages": [{"role": "user", "content": parts(DATA_URL)}], "max_tokens": 4}
        first = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": sid}).json()
        body["messages"] += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And?"},
        ]
        second = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": sid}).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] - 1


def test_remote_image_urls_are_refused_unless_allowed(model, expected, image_host):
    body = {"model": "pkg", "messages": [{"role": "user", "content": parts(image_host)}], "max_tokens": 6}
    with serve(model) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert "remote image URLs are refused" in err["message"] and err["param"].endswith("image_url")
        bad = {**body, "messages": [{"role": "user", "content": parts("data:image/png;base64,AAAA")}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=bad, timeout=60)
        assert r.status_code == 400 and "could not be decoded" in r.json()["error"]["message"]
    with serve(model, allow_remote_images=True) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected.text


def test_anthropic_image_blocks_answer_as_the_python_api(model, expected):
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": DATA_URL.split(",")[1]},
    }
    body = {
        "model": "pkg",
        "max_tokens": 6,
        "messages": [{"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}],
    }
    with serve(model) as srv:
        r = httpx.post(srv.url + "/v1/messages", content=json.dumps(body), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == expected.text
        count = httpx.post(srv.url + "/v1/messages/count_tokens", json=body, timeout=60).json()
        assert count["input_tokens"] == expected.stats.prompt_tokens
        url_block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
        body["messages"][0]["content"][0] = url_block
        r = httpx.post(srv.url + "/v1/messages", json=body, timeout=60)
        assert r.status_code == 400 and "remote image URLs are refused" in r.text
