"""A generated module on the CPU: replay decode through two buffer flushes, beside the recurrent baseline.

    replaygen build examples/tiny.yaml --gpu cpu --allow-default --out kernels
    python examples/try_on_cpu.py            # from the folder that holds kernels/

Triton's interpreter runs the kernels with numpy (slowly); on a GPU, drop TRITON_INTERPRET and use device "cuda".
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
sys.path.insert(0, os.getcwd())  # the folder kernels/ was built into

import torch  # noqa: E402

from kernels.cpu import tiny_toy as m  # noqa: E402

torch.manual_seed(0)
slots = torch.tensor([0, 2], dtype=torch.int32)  # two sequences in slots 0 and 2 of 4; -1 would be a padding row
batch = len(slots)
heads, key_heads, value_dim, key_dim = (m.SHAPE[k] for k in ("heads", "key_heads", "value_dim", "key_dim"))

replay = m.allocate(4, "cpu", torch.float32)  # checkpoints, ring buffers, cursors
baseline = m.allocate_baseline(4, "cpu")  # one full state per slot, written every step
prefill = 0.1 * torch.randn(batch, *m.STATE_SHAPE)  # e.g. the prefill's final states
m.load(replay, slots, prefill)
baseline[slots.long()] = prefill
weights = {"A_log": torch.zeros(heads), "dt_bias": torch.full((heads,), -2.0), "D": torch.ones(heads)}

worst = 0.0
for step in range(2 * m.SHAPE["capacity"] + 1):  # past two flushes of the L-entry buffer
    inputs = {
        "x": torch.randn(batch, heads, value_dim),
        "dt": torch.randn(batch, heads),
        "B": torch.randn(batch, key_heads, key_dim),
        "C": torch.randn(batch, key_heads, key_dim),
    }
    y = m.decode(replay, slots, **inputs, **weights)
    y_base = m.baseline_decode(baseline, slots, **inputs, **weights)
    worst = max(worst, float((y - y_base).abs().max() / y_base.abs().max()))
state_error = float((m.materialize(replay, slots) - baseline[slots.long()]).abs().max())
print(f"{step + 1} decode steps: outputs within {worst:.1e} of the baseline (relative), states within {state_error:.1e}")
assert worst < 1e-4 and state_error < 1e-4
