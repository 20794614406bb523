"""scripts/offline_sass.py: an EvoFlash kernel compiled for sm_90a on this CPU host."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_sass.py"


def test_forward_kernel_report():
    # CI runs under TRITON_INTERPRET=1; the script compiles regardless
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "fwd", "--block", "64", "32", "--s-group", "2",
         "--stages", "2", "--shape", "1,4,64,2,24", "--json"],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["kernel"] == "fwd" and report["block"] == [64, 32]
    assert report["head_dim"] == 24 and report["shape"] == [1, 4, 64, 2, 24]
    assert 0 < report["registers"] <= 255
    # the forward's tensor-core dots and its exponentials are in the SASS
    assert report["sass_ops"].get("MUFU", 0) > 0
    assert any(op.startswith(("HGMMA", "HMMA")) for op in report["sass_ops"])
    assert report["sass_instructions"] == sum(report["sass_ops"].values())
    # the key loop: a 64 x 32 tile of two S slices over 4 warps, 32 elements a
    # thread, with an exponential each (a few more for the rescaling factors)
    loop = report["loop"]
    assert loop["elements_per_thread"] == 32
    assert 32 <= loop["ops"].get("MUFU", 0) <= 48
    assert 0 < loop["instructions"] < report["sass_instructions"]
    # specialised as the launch is (16-byte aligned rows), the shared pair-bias tile
    # is read in the logits' layout: no conversion (session 14's unhinted compile
    # converted it, through shared memory)
    assert not [line for line in report["convert_layout"] if line.startswith("%bias")]


def test_transition_input_kernel_report():
    # The fused transition's input-gradient kernel (with the "gemm" path's stores):
    # a and b come out of two dots in the accumulator layout, so its main loop has
    # no warp shuffles (session 19: the split of one interleaved product had 48).
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "transition-bwd", "--block", "64", "32",
         "--warps", "4", "--stages", "2", "--channels", "64", "--json"],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["kernel"] == "transition-bwd" and report["shape"][1:] == [64, 256]
    loop = report["loop"]
    assert loop["elements_per_thread"] == 16
    # three products per hidden chunk (a, b, dh), two more into dxn: tensor-core dots
    assert any(op.startswith(("HGMMA", "HMMA")) for op in loop["ops"])
    assert loop["ops"].get("MUFU", 0) >= 16  # one sigmoid per element
    assert "SHFL" not in loop["ops"]
