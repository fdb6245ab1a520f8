"""The fastest variant of a `gpu_decode_ablation.py` run, as environment settings for the runs after it.

    python3 benchmarks/pick_ablation.py ablation_output.txt   ->   ONNXGEN_FOLD_NORMS=1

Reads the run's table (`| shape | removed | decode graph ms | ...`), takes each variant's median graph time
per shape, sums them over the shapes and prints the settings of the variant with the least (`none` or `fold`;
`gpu_session.sh pick`). Exits 1 when the table has no `none` row.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict

SETTINGS = {"fold": "ONNXGEN_FOLD_NORMS"}


def pick(lines: list[str]) -> str | None:
    """The settings line of the fastest variant in the table rows of `lines`, or None without a `none` row."""
    times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[1] and not cells[0].startswith(("shape", "---")):
            try:
                times[cells[1]][cells[0]].append(float(cells[2]))
            except ValueError:
                continue
    if "none" not in times:
        return None
    shapes = set(times["none"])
    total = {v: sum(statistics.median(t[s]) for s in shapes) for v, t in times.items() if set(t) >= shapes}
    best = min(total, key=lambda v: total[v])
    parts = set(best.split("+"))
    return " ".join(f"{env}={int(name in parts)}" for name, env in SETTINGS.items())


def main() -> int:
    with open(sys.argv[1]) as f:
        got = pick(f.readlines())
    if got is None:
        print("no `none` row in the ablation table", file=sys.stderr)
        return 1
    print(got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
