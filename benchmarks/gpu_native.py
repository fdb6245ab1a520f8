"""GPU check + benchmark of the native backend on one H200, in one run.

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_native.py [--sections kernels,parity,bench,memory,profile]

Sections (each runs even when an earlier one failed; errors are logged):
- env: copy bandwidth (device-to-device, bytes read + written) measured on this card;
- kernels: the Triton kernels against their torch references on random data (bf16 and fp32);
  if one fails, Triton is disabled for the rest of the run (the torch fallbacks take over);
- parity: native bf16 (and fp32) vs transformers fp32 on the same random weights (4-layer Llama,
  grouped KV heads), teacher-forced over 32 decode steps (CUDA-graph path) after a 64-token prefill;
- bench: for the 1B and 8B shapes (bf16 synthetic packages written under /tmp on this host):
  load-to-first-token, TTFT at 512/4096 prompt tokens, batch-1 decode tok/s, and the same with
  transformers eager (cuDNN SDPA off, logits_to_keep=1) on the same shapes; decode vs bandwidth floor;
- memory: peak GPU memory beyond weights + KV during an 8k-token prefill on the 8B shape, both;
- profile: per-kernel breakdown of one 8B decode step (torch.profiler over graph replays).
Full logs and a JSON of every number go to $OUT (default /tmp/gpu_native_out); a short table prints last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

OUT = Path(os.environ.get("OUT") or "/tmp/gpu_native_out")
OUT.mkdir(parents=True, exist_ok=True)
LOG = open(OUT / "gpu_native.log", "a", buffering=1)
RESULTS: dict[str, Any] = {}


def log(*a: Any) -> None:
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    LOG.write(msg + "\n")


def section(name: str):
    def deco(fn):
        def run(*a, **k):
            log(f"\n=== {name} ===")
            t0 = time.perf_counter()
            try:
                fn(*a, **k)
            except Exception:
                log(f"!!! section {name} failed:\n{traceback.format_exc()}")
                RESULTS.setdefault("errors", []).append(f"{name}: {traceback.format_exc().splitlines()[-1]}")
            log(f"--- {name}: {time.perf_counter() - t0:.1f}s")
            _free()

        return run

    return deco


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def cuda_time(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median wall time (ms) of fn() with CUDA syncs around each run."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# --- env --------------------------------------------------------------------------------------------


@section("env")
def env() -> None:
    log("python", sys.version.split()[0], "torch", torch.__version__, "device", torch.cuda.get_device_name())
    try:
        import triton

        log("triton", triton.__version__)
    except Exception as exc:
        log("triton import failed", exc)
    n = 1 << 30  # 1 GiB per buffer
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), reps=20, warmup=3)
    bw = 2 * n / (ms / 1e3)
    RESULTS["copy_bw_TBps"] = bw / 1e12
    log(f"d2d copy: {ms:.3f} ms per GiB -> {bw / 1e12:.2f} TB/s (read + write)")


# --- kernels ----------------------------------------------------------------------------------------


@section("kernels")
def kernels_check() -> None:
    from onnxgen.backends.native import kernels as K
    from onnxgen.kv.buffers import KVBuffers

    torch.manual_seed(0)
    ok = True
    for dt in (torch.bfloat16, torch.float32):
        tol = 1e-2 if dt == torch.bfloat16 else 1e-5
        for n, hkv, d, cap, L, m, sc, win in [
            (32, 8, 128, 8192, 5000, 1, 0.0, -1),
            (32, 8, 64, 512, 300, 1, 0.0, -1),
            (8, 2, 64, 1024, 700, 1, 30.0, 100),
            (12, 4, 80, 256, 1, 1, 0.0, -1),
            (32, 8, 128, 8192, 8000, 64, 0.0, -1),
            (32, 8, 128, 8192, 7000, 256, 0.0, -1),
            (8, 2, 64, 1024, 500, 37, 30.0, 100),
            (32, 8, 128, 512, 0, 512, 0.0, -1),
        ]:
            q = torch.randn(1, n, m, d, dtype=dt, device="cuda")
            kb = torch.randn(1, hkv, cap, d, dtype=dt, device="cuda")
            vb = torch.randn(1, hkv, cap, d, dtype=dt, device="cuda")
            past = torch.tensor([L - 1 if m == 1 else L], device="cuda")
            ref = K.cache_attention_ref(q.double(), kb.double(), vb.double(), past, 0.1, sc, win)
            out = K.cache_attention(q, kb, vb, past, 0.1, sc, win)
            e = rel(out, ref)
            ok &= e < tol
            log(
                f"cache_attention {dt} n={n} hkv={hkv} d={d} cap={cap} past={int(past)} m={m} softcap={sc} win={win}: err {e:.2e}"
            )
        if (
            dt == torch.bfloat16
        ):  # prefill-chunk attention speed: the Triton kernel's configs vs flash attention
            for m, past in ((64, 8000), (512, 7600), (1024, 7100)):
                cap, total = 8192, past + m
                q = torch.randn(1, 32, m, 128, dtype=dt, device="cuda")
                kb = torch.randn(1, 8, cap, 128, dtype=dt, device="cuda")
                vb = torch.randn(1, 8, cap, 128, dtype=dt, device="cuda")
                p = torch.tensor([past], device="cuda")
                flops = 4 * 32 * m * (past + (m + 1) / 2) * 128
                fa = cuda_time(
                    lambda q=q, kb=kb, vb=vb, total=total: torch.ops.aten._scaled_dot_product_flash_attention(
                        q, kb[:, :, :total], vb[:, :, :total], 0.0, is_causal=True, scale=0.1
                    ),
                    reps=20,
                    warmup=3,
                )
                cells = [f"flash {fa:.3f} ms ({flops / fa / 1e9:.0f} TFLOP/s)"]
                for cfg in (
                    None,
                    (64, 64, 4, 2),
                    (64, 64, 4, 3),
                    (128, 64, 8, 3),
                    (128, 128, 8, 3),
                    (128, 64, 4, 3),
                    (64, 128, 4, 3),
                    (128, 128, 8, 2),
                ):
                    try:
                        ms = cuda_time(
                            lambda q=q, kb=kb, vb=vb, p=p, cfg=cfg: K.cache_attention(
                                q, kb, vb, p, 0.1, config=cfg
                            ),
                            reps=20,
                            warmup=3,
                        )
                        cells.append(f"{cfg or 'default'} {ms:.3f} ms ({flops / ms / 1e9:.0f})")
                    except Exception as exc:  # a config that does not compile
                        cells.append(f"{cfg} failed: {type(exc).__name__}")
                log(f"cache_attention speed m={m} past={past}: " + "; ".join(cells))
        x = torch.randn(7, 4096, dtype=dt, device="cuda")
        s = torch.randn_like(x)
        w = torch.randn(4096, dtype=dt, device="cuda")
        y, ss = K.rms_norm(x, s, w, 1e-5)
        yr, sr = K.rms_norm_ref(x.double(), s.double(), w.double(), 1e-5)
        e = max(rel(y, yr), rel(ss, sr))
        ok &= e < tol
        log(f"rms_norm {dt}: err {e:.2e}")
        g, u = torch.randn(3, 14336, dtype=dt, device="cuda"), torch.randn(3, 14336, dtype=dt, device="cuda")
        e = rel(K.silu_mul(g, u), torch.nn.functional.silu(g.double()) * u.double())
        ok &= e < tol
        log(f"silu_mul {dt}: err {e:.2e}")
        n, hkv, d = 32, 8, 128
        qkv = torch.randn(1, 1, (n + 2 * hkv) * d, dtype=dt, device="cuda")
        cos = torch.randn(4096, d // 2, dtype=dt, device="cuda")
        sin = torch.randn(4096, d // 2, dtype=dt, device="cuda")
        pos = torch.tensor([1234], device="cuda")
        for inter in (False, True):
            kv1 = KVBuffers(1, hkv, d, dt, "cuda", floor=2048)
            kv2 = KVBuffers(1, hkv, d, dt, "cuda", floor=2048)
            kv1.reserve(2048), kv2.reserve(2048)
            q1 = K.rope_qkv_write(qkv, cos, sin, pos, kv1, 0, n, hkv, d, inter)
            K.DISABLE_TRITON = True
            q2 = K.rope_qkv_write(qkv, cos, sin, pos, kv2, 0, n, hkv, d, inter)
            K.DISABLE_TRITON = False
            e = max(
                rel(q1, q2),
                rel(kv1.keys[0][:, :, 1234], kv2.keys[0][:, :, 1234]),
                rel(kv1.values[0][:, :, 1234], kv2.values[0][:, :, 1234]),
            )
            ok &= e < tol
            log(f"rope_qkv_write {dt} interleaved={inter}: err {e:.2e}")
    RESULTS["kernels_ok"] = bool(ok)
    if not ok:
        log("!!! a Triton kernel failed its check: disabling Triton for the rest of the run")
        K.DISABLE_TRITON = True


# --- parity -------------------------------------------------------------------------------------------


def _hf_model(cfg: Any, weights: dict[str, np.ndarray] | None, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from onnxgen.convert.synthetic import to_hf_llama_config

    conf = LlamaConfig(**to_hf_llama_config(cfg))
    conf._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(conf)
    finally:
        torch.set_default_dtype(old)
    if weights is not None:
        sd = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dtype) for k, v in weights.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [
            m for m in missing if "rotary" not in m and not (cfg.tie_embeddings and m == "lm_head.weight")
        ]
        assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


@section("parity")
def parity() -> None:
    import dataclasses

    from onnxgen.backends.native.decoder import NativeDecoder
    from onnxgen.convert.synthetic import SyntheticConfig, random_weights, reference_weights, write_package
    from onnxgen.package.spec import load_spec

    torch.backends.cuda.enable_cudnn_sdp(False)
    base = SyntheticConfig(
        num_layers=4,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1024,
        vocab_size=4096,
        context_length=2048,
        rope_theta=10000.0,
    )
    w32 = random_weights(base, seed=7)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, base.vocab_size, 64).tolist()
    steps = 32
    for dtype, tol in (("bfloat16", 2e-2), ("float32", 1e-4)):
        cfg = dataclasses.replace(base, dtype=dtype)
        pkg = write_package(Path("/tmp/onnxgen_parity") / dtype, cfg, w32)
        ref_w = reference_weights(cfg, w32)
        hf = _hf_model(cfg, ref_w, torch.float32)
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")
            gen = hf.generate(ids, max_new_tokens=steps, do_sample=False, attention_mask=torch.ones_like(ids))
            seq = gen[0].tolist()
            ref_logits = hf(gen).logits[0].float()  # [T, V], teacher-forced
        for graphs in (True, False):
            dec = NativeDecoder(load_spec(pkg), "cuda", cuda_graphs=graphs, kv_floor=64)
            errs, agree, clear = [], 0, 0
            out = dec.forward(prompt, 0)
            errs.append(rel(out, ref_logits[len(prompt) - 1]))
            for i in range(steps - 1):
                t = seq[len(prompt) + i]
                out = dec.forward([t], dec.kv_len())
                r = ref_logits[len(prompt) + i]
                errs.append(rel(out, r))
                top2 = torch.topk(r, 2).values
                margin = 0.05 if dtype == "bfloat16" else 1e-3
                if float(top2[0] - top2[1]) > margin:
                    clear += 1
                    agree += int(out.argmax() == r.argmax())
            key = f"parity_{dtype}_{'graphs' if graphs else 'eager'}"
            RESULTS[key] = {
                "max_err": max(errs),
                "mean_err": float(np.mean(errs)),
                "argmax_agree": f"{agree}/{clear}",
                "pass": max(errs) <= tol and agree == clear,
                "cuda_graphs": dec.info["cuda_graphs"],
            }
            log(key, RESULTS[key])
            dec.close()
            del dec
        del hf
        _free()


# --- benchmarks ----------------------------------------------------------------------------------------


def _write(name: str, cfg: Any) -> Path:
    from onnxgen.convert.synthetic import write_package

    out = Path("/tmp/onnxgen_bench") / name
    if (out / "genai_config.json").is_file():
        return out
    t0 = time.perf_counter()
    write_package(out, cfg, seed=0)
    log(f"wrote {name} package in {time.perf_counter() - t0:.1f}s")
    return out


def _floor_ms(cfg: Any, ctx_len: int, bw: float) -> float:
    from onnxgen.convert.synthetic import hf_weight_shapes

    shapes = hf_weight_shapes(cfg)
    params = sum(int(np.prod(s)) for k, s in shapes.items() if k != "model.embed_tokens.weight")
    if cfg.tie_embeddings:
        params += int(np.prod(shapes["model.embed_tokens.weight"]))  # the lm_head reads the whole table
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * ctx_len * 2
    return (params * 2 + kv) / bw * 1e3


def _native_decode_tps(dec: Any, prompt: list[int], n: int) -> float:
    dec.reset()
    out = dec.forward(prompt, 0)
    tok = int(out.argmax())
    for _ in range(8):  # warm up (captures the bucket's graph)
        tok = int(dec.forward([tok], dec.kv_len()).argmax())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(dec.forward([tok], dec.kv_len()).argmax())
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def _hf_ttft(model: Any, ids: torch.Tensor) -> float:
    from transformers import DynamicCache

    def run() -> None:
        with torch.no_grad():
            model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)

    return cuda_time(run, reps=5, warmup=1)


def _hf_decode_tps(model: Any, ids: torch.Tensor, n: int) -> float:
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(4):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = torch.tensor([[int(out.logits[0, -1].argmax())]], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = torch.tensor([[int(out.logits[0, -1].argmax())]], device="cuda")
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


@section("bench")
def bench(shapes: list[str], with_hf: bool) -> None:
    from onnxgen.backends.native.decoder import NativeDecoder
    from onnxgen.convert.synthetic import LLAMA_1B, LLAMA_8B
    from onnxgen.package.spec import load_spec

    torch.backends.cuda.enable_cudnn_sdp(False)
    bw = RESULTS.get("copy_bw_TBps", 4.3) * 1e12
    rng = np.random.default_rng(1)
    for name in shapes:
        cfg = {"1b": LLAMA_1B, "8b": LLAMA_8B}[name]
        pkg = _write(name, cfg)
        r: dict[str, Any] = {}
        _free()
        t0 = time.perf_counter()
        dec = NativeDecoder(load_spec(pkg), "cuda")
        t_load = time.perf_counter() - t0
        first = dec.forward(rng.integers(0, 32000, 16).tolist(), 0)
        int(first.argmax())
        r["load_to_first_token_s"] = time.perf_counter() - t0
        r["load_s"] = t_load
        log(
            name,
            "native load",
            f"{t_load:.1f}s",
            "to first token",
            f"{r['load_to_first_token_s']:.1f}s",
            dec.info,
        )
        for plen in (512, 4096):
            prompt = rng.integers(0, 32000, plen).tolist()

            def pre(prompt: list[int] = prompt, dec: Any = dec) -> None:
                dec.reset()
                dec.forward(prompt, 0)

            r[f"native_ttft_{plen}_ms"] = cuda_time(pre, reps=5, warmup=2)
            tps = _native_decode_tps(dec, prompt, 128)
            r[f"native_decode_{plen}_tps"] = tps
            floor = _floor_ms(cfg, plen + 128, bw)
            r[f"floor_{plen}_ms"] = floor
            r[f"native_decode_{plen}_floor_frac"] = floor / (1e3 / tps)
            log(
                name,
                plen,
                f"native TTFT {r[f'native_ttft_{plen}_ms']:.1f} ms, decode {tps:.1f} tok/s "
                f"({1e3 / tps:.2f} ms/tok, floor {floor:.2f} ms -> {floor / (1e3 / tps):.0%})",
            )
        dec.close()
        del dec, first
        _free()
        if with_hf:
            model = _hf_model(cfg, None, torch.bfloat16)
            for plen in (512, 4096):
                ids = torch.tensor([rng.integers(0, 32000, plen).tolist()], device="cuda")
                r[f"hf_ttft_{plen}_ms"] = _hf_ttft(model, ids)
                r[f"hf_decode_{plen}_tps"] = _hf_decode_tps(model, ids, 32)
                log(
                    name,
                    plen,
                    f"transformers eager TTFT {r[f'hf_ttft_{plen}_ms']:.1f} ms, "
                    f"decode {r[f'hf_decode_{plen}_tps']:.1f} tok/s",
                )
            del model
            _free()
        RESULTS[f"bench_{name}"] = r


@section("memory")
def memory(with_hf: bool) -> None:
    from onnxgen.backends.native.decoder import NativeDecoder
    from onnxgen.convert.synthetic import LLAMA_8B
    from onnxgen.package.spec import load_spec

    torch.backends.cuda.enable_cudnn_sdp(False)
    plen = 8000
    prompt = np.random.default_rng(2).integers(0, 32000, plen).tolist()
    pkg = _write("8b", LLAMA_8B)
    dec = NativeDecoder(load_spec(pkg), "cuda")
    dec.kv.reserve(plen)
    _free()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dec.forward(prompt, 0)
    torch.cuda.synchronize()
    nat = torch.cuda.max_memory_allocated() - base
    RESULTS["mem_native_8k_beyond_GB"] = nat / 1e9
    log(f"native 8k prefill: peak beyond weights+KV {nat / 1e9:.3f} GB (weights+KV {base / 1e9:.2f} GB)")
    dec.close()
    del dec
    _free()
    if with_hf:
        from transformers import DynamicCache

        model = _hf_model(LLAMA_8B, None, torch.bfloat16)
        _free()
        ids = torch.tensor([prompt], device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            cache = DynamicCache()
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        kv = 2 * LLAMA_8B.num_layers * LLAMA_8B.num_kv_heads * LLAMA_8B.head_dim * plen * 2
        hf = torch.cuda.max_memory_allocated() - base - kv
        RESULTS["mem_hf_8k_beyond_GB"] = hf / 1e9
        log(
            f"transformers 8k prefill: peak beyond weights+KV {hf / 1e9:.3f} GB; ratio native/hf {nat / hf:.2f}"
        )
        del model, cache
        _free()


@section("profile")
def profile() -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from onnxgen.backends.native.decoder import NativeDecoder
    from onnxgen.convert.synthetic import LLAMA_8B
    from onnxgen.package.spec import load_spec

    dec = NativeDecoder(load_spec(_write("8b", LLAMA_8B)), "cuda")
    prompt = np.random.default_rng(3).integers(0, 32000, 512).tolist()
    tok = int(dec.forward(prompt, 0).argmax())
    for _ in range(4):
        tok = int(dec.forward([tok], dec.kv_len()).argmax())
    reps = 10
    for mode in ("graph", "eager-static"):
        if mode == "eager-static":
            dec._use_graphs, dec._static_steps = False, True
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                tok = int(dec.forward([tok], dec.kv_len()).argmax())
            torch.cuda.synchronize()
        rows = []
        for ev in prof.key_averages():
            dev_t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if dev_t and ev.device_type == torch.autograd.DeviceType.CUDA:
                rows.append((ev.key, dev_t / reps / 1e3, ev.count / reps))
        rows.sort(key=lambda r: -r[1])
        total = sum(r[1] for r in rows)
        (OUT / f"profile_{mode}.txt").write_text(
            prof.key_averages().table(sort_by="self_device_time_total", row_limit=60)
        )
        log(f"per-kernel breakdown of one 8B decode step ({mode}); kernel time {total:.3f} ms/step")
        for k, ms, cnt in rows[:14]:
            log(f"  {ms:8.3f} ms  {cnt:6.1f}x  {k[:90]}")
        RESULTS[f"profile_{mode}"] = {
            "kernel_ms_per_step": total,
            "top": [(k[:80], ms, cnt) for k, ms, cnt in rows[:20]],
        }
        if rows:
            break
    dec.close()


def table() -> None:
    log("\n================ summary ================")
    log(
        f"copy bandwidth {RESULTS.get('copy_bw_TBps', float('nan')):.2f} TB/s; kernels ok: {RESULTS.get('kernels_ok')}"
    )
    for k, v in RESULTS.items():
        if k.startswith("parity_"):
            log(
                f"{k:32s} max err {v['max_err']:.2e} argmax {v['argmax_agree']} pass={v['pass']} graphs={v['cuda_graphs']}"
            )
    log(
        f"{'shape':5s} {'prompt':>6s} {'TTFT native':>12s} {'TTFT hf':>9s} {'tok/s native':>13s} {'tok/s hf':>9s} {'floor%':>7s}"
    )
    for name in ("1b", "8b"):
        r = RESULTS.get(f"bench_{name}")
        if not r:
            continue
        for plen in (512, 4096):
            log(
                f"{name:5s} {plen:6d} {r.get(f'native_ttft_{plen}_ms', float('nan')):10.1f}ms "
                f"{r.get(f'hf_ttft_{plen}_ms', float('nan')):7.1f}ms {r.get(f'native_decode_{plen}_tps', float('nan')):13.1f} "
                f"{r.get(f'hf_decode_{plen}_tps', float('nan')):9.1f} {r.get(f'native_decode_{plen}_floor_frac', float('nan')):7.0%}"
            )
        log(
            f"{name}: load {r.get('load_s', float('nan')):.1f}s, load-to-first-token {r.get('load_to_first_token_s', float('nan')):.1f}s"
        )
    if "mem_native_8k_beyond_GB" in RESULTS:
        log(
            f"8k prefill (8B) peak beyond weights+KV: native {RESULTS['mem_native_8k_beyond_GB']:.3f} GB, "
            f"transformers {RESULTS.get('mem_hf_8k_beyond_GB', float('nan')):.3f} GB"
        )
    for e in RESULTS.get("errors", []):
        log("ERROR", e)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="env,kernels,parity,bench,memory,profile")
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    sec = args.sections.split(",")
    t0 = time.perf_counter()
    env()
    if "kernels" in sec:
        kernels_check()
    if "parity" in sec:
        parity()
    if "bench" in sec:
        bench(args.shapes.split(","), not args.no_hf)
    if "memory" in sec:
        memory(not args.no_hf)
    if "profile" in sec:
        profile()
    RESULTS["wall_s"] = time.perf_counter() - t0
    (OUT / "results.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    table()


if __name__ == "__main__":
    main()
