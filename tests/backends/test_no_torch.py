"""An ort-only run never imports torch (the native extra is optional)."""

from __future__ import annotations

import subprocess
import sys


def test_ort_backend_runs_without_importing_torch(tiny_dir):
    code = (
        "import sys, onnxgen\n"
        f"m = onnxgen.load({str(tiny_dir)!r}, backend='ort')\n"
        "r = m.generate('hello there', max_new_tokens=4)\n"
        "assert r.tokens, r\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers', 'onnx_ir'))\n"
        "print('LOADED', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LOADED []" in proc.stdout
