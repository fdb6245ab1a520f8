"""Draft-control settings compared on the CPU (issue 13): how a request's draft length grows after an accepted
draft (doubling, or +1) and whether the wait after rejected retries grows (to 256 tokens, as on CUDA) or stays
at 16, on the four workloads of `speculative.py`.

    .venv/bin/python benchmarks/draft_control_variants.py [MODEL] [--threads 2]

ort backend, greedy, 128 new tokens, one run per variant and workload (the drafts kept are deterministic; the
seconds are indicative, the settings chosen are then measured properly by `speculative.py`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import onnxgen
from onnxgen.convert.default import resolve_model_path
from onnxgen.engine import drafts
from speculative import WORKLOADS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = onnxgen.load(str(resolve_model_path(args.model)), backend="ort", threads=args.threads)
    base_update, base_init = drafts.DraftControl.update, drafts.DraftControl.__init__

    def plus_one(self: drafts.DraftControl, proposed: int, accepted: int, generated: int) -> None:
        k0 = self.k
        base_update(self, proposed, accepted, generated)
        if proposed and accepted == proposed:
            self.k = min(self.k_max, max(k0, proposed) + 1)

    print("| growth | wait after rejections | " + " | ".join(WORKLOADS) + " |")
    print("|---|---|" + "---|" * len(WORKLOADS))
    for growth in ("doubling", "+1"):
        for wait_max in (16, 256):

            def init(self: drafts.DraftControl, *a: object, _w: int = wait_max, **k: object) -> None:
                base_init(self, *a, **k)  # type: ignore[arg-type]
                self.cooldown_max = _w

            drafts.DraftControl.update = plus_one if growth == "+1" else base_update  # type: ignore[method-assign]
            drafts.DraftControl.__init__ = init  # type: ignore[method-assign]
            cells = []
            for text in WORKLOADS.values():
                t0 = time.perf_counter()
                r = model.generate(
                    [{"role": "user", "content": text}],
                    max_new_tokens=128,
                    temperature=0,
                    reuse=False,
                    speculative="prompt_lookup",
                )
                cells.append(
                    f"{r.stats.accepted_tokens}/{r.stats.draft_tokens}, {time.perf_counter() - t0:.2f} s"
                )
            print(f"| {growth} | {'16 fixed' if wait_max == 16 else 'to 256'} | " + " | ".join(cells) + " |")
    drafts.DraftControl.update, drafts.DraftControl.__init__ = base_update, base_init  # type: ignore[method-assign]
    return 0


if __name__ == "__main__":
    sys.exit(main())
