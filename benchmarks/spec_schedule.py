"""A model of speculative decoding's schedule on CUDA, replayed on real greedy tokens: predictions, not
measurements (what to try when device time is scarce; a GPU run of `speculative.py` is the measurement).

    .venv/bin/python benchmarks/spec_schedule.py [MODEL] [--decode-ms 0.448] [--verify-ms 4:0.78,8:1.24,16:2.17]
        [--verify-host-ms 0.15] [--runs 8,4,2] [--backend ort|native] [--replay TOKENS.json] [--save-tokens FILE]

Speculation is exact, so which drafts are accepted depends only on the plain greedy tokens: each workload of
`speculative.py` is decoded once, greedy, on the CPU (ort, the default model unless MODEL), and the engine's
CUDA schedule is replayed on those tokens with the engine's own draft control (`drafts.draft_control(True,
sizes)`): decode runs of R steps while the request is copying or confirming a match
(`DraftControl.watching`, else 8; `Ro`: without `drafts.CUDA_CONFIRM`; `Rf`: with `drafts.CUDA_FOLLOW`), each
read after the next one is
launched, so a match found on reading a run is verified after the run behind it (`Engine._decode_run`); a
stopped chain costs `--break-ms`; a verify of n positions costs the verify graph of the next size up
(`--verify-ms`, GPU) plus `--verify-host-ms`; a decode step costs `--decode-ms`.
The defaults are the H200's on SmolLM2-135M bf16 (docs/benchmarks/speculative-gpu.md, 2026-12-05). Printed
per workload and policy: predicted speedup over plain decoding (decode phase only), accepted/drafted, verify
steps. Calibration: with runs of 8 and no size filling it predicts the bf16 edit workload's 78 accepted
drafts (measured: 78) and 1.70x (measured: 1.51x, prefill and host costs not modelled).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).parent))

from onnxgen.engine import drafts
from onnxgen.engine.drafts import DraftControl, draft_control


def simulate(
    prompt: Sequence[int],
    greedy: Sequence[int],
    ctrl: DraftControl,
    run: int,
    decode_ms: float,
    verify_ms: dict[int, float],
    verify_host_ms: float,
    break_ms: float,
    full: int = 8,
) -> tuple[float, int, int]:
    """Predicted decode-phase milliseconds, verify steps and chains of decode runs for `greedy` (its first
    token from the prefill), as `Engine._decode_run` schedules them: each run is launched before the one in
    flight is read (`run` steps while the request is copying or confirming a match,
    `DraftControl.watching`, else `full`); on reading a run the request may stop the chain
    (`DraftControl.stop_chain`, with room for a sample and a draft after the launched run), which then ends
    after the run launched behind it and costs `break_ms` (the device waits for the host)."""
    sizes = sorted(verify_ms)
    out = [greedy[0]]
    n = len(greedy)
    t, verifies, chains = 0.0, 0, 0

    def length() -> int:  # `Engine._run_steps`
        return run if ctrl.watching(len(out)) else full

    while len(out) < n:
        k = min(ctrl.budget(len(out)), n - len(out))
        drafts = ctrl.propose(prompt, out, k) if k > 0 else []
        if drafts:  # a verify step: the drafts kept up to the first that differs from the greedy token
            pos, taken = len(out), 1
            while (
                taken <= len(drafts) and pos + taken - 1 < n and drafts[taken - 1] == greedy[pos + taken - 1]
            ):
                taken += 1
            taken = min(taken, n - pos)
            out.extend(greedy[pos : pos + taken])
            ctrl.update(len(drafts), taken - 1, len(out))
            t += verify_ms[next(s for s in sizes if s >= len(drafts) + 1)] + verify_host_ms
            verifies += 1
            continue
        chains += 1
        flight = min(length(), n - len(out))  # the chain's first run
        while True:
            nxt = min(length(), n - len(out) - flight)  # launched before the run in flight is read
            out.extend(greedy[len(out) : len(out) + flight])
            t += flight * decode_ms
            if nxt == 0:
                break
            if n - len(out) - nxt >= 2 and ctrl.stop_chain(prompt, out):
                out.extend(greedy[len(out) : len(out) + nxt])
                t += nxt * decode_ms + break_ms
                break
            flight = nxt
    return t, verifies, chains


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--decode-ms", type=float, default=0.448)
    ap.add_argument("--verify-ms", default="4:0.78,8:1.24,16:2.17")
    ap.add_argument("--verify-host-ms", type=float, default=0.15)
    ap.add_argument("--break-ms", type=float, default=0.3, help="what stopping a chain of runs costs")
    ap.add_argument(
        "--runs",
        default="8,4,2",
        help="decode steps per run while copying, to compare; a trailing "
        "o: without `drafts.CUDA_CONFIRM` (every match stops a chain), f: with `drafts.CUDA_FOLLOW`",
    )
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument(
        "--replay",
        type=Path,
        default=None,
        help="the prompts and greedy tokens a GPU run saved "
        "(`speculative.py --save-tokens`) instead of decoding on the CPU",
    )
    ap.add_argument(
        "--backend",
        default="ort",
        help="what decodes the greedy tokens on the CPU: ort, or native "
        "(e.g. a bf16 package, whose CPU tokens stay closer to a GPU's bf16 ones)",
    )
    ap.add_argument(
        "--save-tokens",
        type=Path,
        default=None,
        help="write the prompts and greedy tokens decoded on the CPU (the format `--replay` reads)",
    )
    a = ap.parse_args()
    import onnxgen
    from onnxgen.convert.default import resolve_model_path
    from speculative import DEFAULTS, WORKLOADS, run_policy

    verify = {int(s): float(ms) for s, ms in (p.split(":") for p in a.verify_ms.split(","))}
    saved = json.loads(a.replay.read_text())["workloads"] if a.replay is not None else None
    model = None if saved is not None else onnxgen.load(str(resolve_model_path(a.model)), backend=a.backend)
    decoded: dict[str, dict[str, list[int]]] = {}
    print("| workload | tokens | policy | predicted speedup | accepted/drafted | verify steps | chains |")
    print("|---|---|---|---|---|---|---|")
    for name, text in WORKLOADS.items():
        if saved is not None:
            prompt, greedy = saved[name]["prompt"], saved[name]["greedy"]
        else:
            assert model is not None
            msgs = [{"role": "user", "content": text}]
            prompt = model.encode_prompt(msgs)
            greedy = model.generate(
                msgs, max_new_tokens=a.tokens, temperature=0, reuse=False, speculative=False
            ).tokens
            decoded[name] = {"prompt": list(prompt), "greedy": list(greedy)}
        plain = (len(greedy) - 1) * a.decode_ms
        policies = [("runs of 8, drafts as budgeted", (8, DEFAULTS, ""), ())]
        policies += [(f"{p[2]} while copying", p, tuple(verify)) for p in map(run_policy, a.runs.split(","))]
        for label, (run, settings, *_), sizes in policies:
            for key, value in settings.items():
                setattr(drafts, key, value)
            ctrl = draft_control(True, sizes)
            ms, verifies, chains = simulate(
                prompt, greedy, ctrl, run, a.decode_ms, verify, a.verify_host_ms, a.break_ms
            )
            print(
                f"| {name} | {len(greedy)} | {label} | {plain / ms:.2f}x | {ctrl.accepted}/{ctrl.drafted} | "
                f"{verifies} | {chains} |"
            )
    if a.save_tokens is not None and decoded:
        a.save_tokens.write_text(
            json.dumps({"model": str(a.model), "device": "cpu", "backend": a.backend, "workloads": decoded})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
