"""What the replay state's identity check (issue 58: a state of another module refused) costs an eager call.

At batch 1 a decode step is bound by the host's launch path, so a host-side check shows there first. For each --shape
(SPEC/SHAPE) the module built for --gpu is called eagerly in a loop, as shipped and with its `_check_replay_state`
replaced by a no-op, alternating the two in rounds on the same state and inputs: replay decode, and for a shape with
a window verify + commit. Prints the median µs per call of each and the check alone (host, no launch). CUDA-graph
replays never run the check (it is Python around the launches).

    python docs/experiments/state_check_cost.py --gpu h200 --shape mamba2/nemotron-h-mtp --shape gdn/qwen3.5-mtp
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from replaygen.harness import InputFactory
from replaygen.runtime import import_path
from replaygen.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


def per_call_us(call, calls: int) -> float:
    """Mean wall µs of `calls` back-to-back eager calls, the device drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def compare(name: str, module, call, calls: int, rounds: int) -> None:
    """`call` timed with the module's check as shipped and as a no-op, alternating, `rounds` times."""
    shipped_check = module._check_replay_state
    times = {"checked": [], "unchecked": []}
    call()
    for _ in range(rounds):
        for label, check in (("checked", shipped_check), ("unchecked", lambda state: None)):
            module._check_replay_state = check
            times[label].append(per_call_us(call, calls))
    module._check_replay_state = shipped_check
    checked, unchecked = (statistics.median(times[k]) for k in ("checked", "unchecked"))
    spread = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in times.items()}
    print(f"  {name:<16} checked {checked:7.2f} us ({spread['checked']})   unchecked {unchecked:7.2f} us ({spread['unchecked']})   "
          f"ratio {checked / unchecked:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", required=True, help="SPEC/SHAPE (repeatable)")
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda")
    for target in args.shape:
        spec_name, shape_name = target.split("/")
        spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
        shape = spec.shape(shape_name)
        module = import_path(ROOT / "generated" / args.gpu / f"{spec.name}_{shape.ident}.py")
        factory = InputFactory(spec, shape, device, torch.bfloat16, seed=0)
        weights = factory.weights()
        state = module.allocate(1, device, torch.bfloat16)
        slots = torch.zeros(1, dtype=torch.int32, device=device)
        step = factory.step(1, use_gate=False)
        start = time.perf_counter()
        for _ in range(10000):
            module._check_replay_state(state)
        print(f"{target} on {torch.cuda.get_device_name()}: the check alone {(time.perf_counter() - start) / 10000 * 1e6:.3f} us per call")
        compare("decode b1", module, lambda: module.decode(state, slots, **step, **weights), args.calls, args.rounds)
        if shape.window > 1:
            window = factory.window(1, shape.window, use_gate=False)
            accepted = torch.full((1,), shape.window, dtype=torch.int32, device=device)

            def verify_commit():
                module.verify(state, slots, **window, **weights)
                module.commit(state, slots, accepted)

            compare("verify+commit b1", module, verify_commit, max(1, args.calls // 2), args.rounds)


if __name__ == "__main__":
    main()
