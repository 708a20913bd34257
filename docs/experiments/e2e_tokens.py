"""End-to-end decode tokens/s of HF hybrid models (issue 55, item 5): HF's own decode path beside replaygen's
baseline kernels, its replay kernels, and replay with prompt-lookup speculation in windows of T=2 and T=4.

Models: a Mamba-2 hybrid (HF `nemotron_h`) and a Gated DeltaNet hybrid (HF `qwen3_5`), each from its HF config
class's defaults (the real models' layer sizes: Nemotron-H's 128 heads of 64 with 8 groups of state 128, hidden 4096,
MLP 21504; Qwen3.5's 32 value heads and 16 key heads of 128, hidden 4096, MLP 12288) with random weights and
--layers recurrent layers: one attention layer per 6 Mamba-2 layers (Nemotron-H's ratio, an MLP after every layer)
or per 3 Gated DeltaNet layers (Qwen3.5's). --vocab sets the vocabulary (default 32768, below the real 131072 /
248320: with a few layers the LM head would otherwise take most of a step; the table's step times include it).

Paths (--paths): `hf` is `model.generate` (greedy, HF's DynamicCache, HF's own recurrent ops: mamba_ssm,
causal_conv1d or flash-linear-attention where installed, else HF's torch reference, as printed); the others are
`replaygen.integrations.transformers.attach(model, L, T, gpu, kernels).generate`: `baseline` and `replay` decode
one token per step (L=16, T=4), `replay-t2` / `replay-t4` verify windows of 2 / 4 tokens with prompt-lookup drafts
(L=30 / L=28; `baseline-t2` / `baseline-t4` do so on the baseline kernels). L and T are the shipped shapes' (nemotron-h,
-mtp2, -mtp; qwen3.5 alike), so with --gpu a layer whose spec matches a shipped shape runs its tuned configs; the
"modules" lines say which configs each path ran.

Each timing: a warm-up run, then --repeats runs between torch.cuda.synchronize calls; the decode time is the median
of generate(new + 1 tokens) minus the median of generate(1 token) (the prompt's pass and its token), and tokens/s =
batch * new tokens / that time. Speculation keeps one acceptance count per batch (the smallest row's: HF's KV cache
has one length), so its tokens per step are reported (committed tokens per verify, the bonus token included), with
the prompt-lookup drafter's host time as a share of the decode time. With random weights acceptance is what it is;
--repeat-prompt makes each prompt a random 16-token segment repeated, which prompt lookup can match.

The recurrent share of a step: --share-steps decode steps (verify + commit of a whole window for the speculative
paths, the drafts taken from the prompt) after a fresh prompt, with CUDA events recorded around every call of the
recurrent layers' conv and recurrence (replaygen: the runtime's `run_conv` / `run_recurrence`; HF: its modeling
module's conv and scan / recurrent delta rule functions, so HF's few elementwise ops between them are not counted)
and around each step; the share is the sum of the first over the sum of the second (the GPU timeline between the
events, so host launch gaps inside those calls count). CUDA graph: the recurrent kernels of one decode step (the
conv and recurrence calls of every layer, recorded from a real step) are captured and replayed, timed beside the
same calls run eagerly; the end-to-end steps themselves run eagerly (HF's DynamicCache grows a tensor per step, which a
captured whole-model step cannot do without HF's StaticCache path and a runtime built around it).

The step's profile: --profile-steps more steps of the same kind under torch.profiler: the device kernels a step
launches, the device's busy time per step (the kernels' own times summed, so an eager step's host gaps are what
remains of its step time) and the kernels of most device time; a step bound by the host launches many kernels into
an idle device.

    python docs/experiments/e2e_tokens.py --gpu h200 --out e2e_tokens.json
    python docs/experiments/e2e_tokens.py --gpu h200 --repeat-prompt --paths replay,replay-t2,replay-t4
    python docs/experiments/e2e_tokens.py --tiny --device cpu --batch 2 --new-tokens 3 --repeats 1   # a CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

SEGMENT = 16  # tokens of the segment a --repeat-prompt prompt repeats


@dataclass(frozen=True)
class DecodePath:
    """One way to decode: HF's own (`kernels` None) or replaygen's runtime on `kernels` ("replay" or "baseline", the
    runtime's Kernels values) at ring capacity L and window T, with `drafts` prompt-lookup drafts per step."""

    name: str
    kernels: str | None
    capacity: int = 16
    window: int = 4
    drafts: int = 0


PATHS = {
    path.name: path
    for path in (
        DecodePath("hf", None),
        DecodePath("baseline", "baseline"),
        DecodePath("replay", "replay"),
        DecodePath("replay-t2", "replay", capacity=30, window=2, drafts=1),
        DecodePath("replay-t4", "replay", capacity=28, window=4, drafts=3),
        DecodePath("baseline-t2", "baseline", capacity=30, window=2, drafts=1),
        DecodePath("baseline-t4", "baseline", capacity=28, window=4, drafts=3),
    )
}


@dataclass(frozen=True)
class ModelCase:
    """A hybrid HF model: its config class's defaults (the real model's sizes) with `recurrent` recurrent layers,
    an attention layer after every `attention_every` of them (at least one), layer kinds given to the config as
    `layers_key` (`layers_value` joins the kinds); `tiny` overrides the sizes for a CPU run. `hf_recurrence`: the
    modeling module's functions HF's decode step runs the conv and the recurrence in."""

    name: str
    config_class: str
    model_class: str
    recurrent_layer: str
    attention_layer: str
    attention_every: int
    layers_key: str
    layers_value: Callable[[list[str]], object]
    tiny: dict
    hf_recurrence: tuple[str, ...]

    def layer_kinds(self, recurrent: int) -> list[str]:
        kinds = []
        for i in range(recurrent):
            kinds.append(self.recurrent_layer)
            if (i + 1) % self.attention_every == 0:
                kinds.append(self.attention_layer)
        return kinds if self.attention_layer in kinds else [*kinds, self.attention_layer]

    def config(self, recurrent: int, vocab: int, tiny: bool) -> dict:
        kinds = self.layer_kinds(recurrent)
        sizes = {"vocab_size": vocab, **(self.tiny if tiny else {})}
        tokens = {"eos_token_id": None, "pad_token_id": 0, "bos_token_id": None}
        return {**sizes, **tokens, "num_hidden_layers": len(kinds), self.layers_key: self.layers_value(kinds)}


TINY_ATTENTION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}

MODELS = {
    case.name: case
    for case in (
        ModelCase(
            "nemotron_h", "NemotronHConfig", "NemotronHForCausalLM", "M-", "*-", 6, "hybrid_override_pattern", "".join,
            {**TINY_ATTENTION, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 8},
            ("causal_conv1d_forward", "mamba2_scan_forward"),
        ),
        ModelCase(
            "qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "linear_attention", "full_attention", 3, "layer_types", list,
            {**TINY_ATTENTION, "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
            ("causal_conv1d_forward", "torch_recurrent_gated_delta_rule"),
        ),
    )
}


@dataclass(frozen=True)
class Row:
    """One path at one batch size. tokens_per_s: batch * new_tokens / decode_s; tokens_per_step: committed tokens
    per decode or verify step; drafter_share: the drafter's host time over decode_s; recurrent_share: the recurrent
    layers' share of a step (step_ms: that step's time); graph_*: the recurrent kernels of one decode step eager and
    as a CUDA graph (ms), or why not; same_as_hf: the share of rows whose tokens are HF's path's."""

    model: str
    path: str
    batch: int
    new_tokens: int
    decode_s: float
    tokens_per_s: float
    tokens_per_step: float
    drafter_share: float | None
    recurrent_share: float | None
    step_ms: float | None
    graph_eager_ms: float | None
    graph_ms: float | None
    graph_note: str
    kernels_per_step: float | None
    busy_ms: float | None
    top_kernels: str
    same_as_hf: float | None
    modules: str


class Clock:
    """Marks on the device's timeline: CUDA events on a GPU, the host's clock on a CPU (the device is the host)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        import torch

        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def median_s(run: Callable[[], object], repeats: int, clock: Clock) -> float:
    """Median wall seconds of `run` over `repeats` runs after one warm-up, the device drained around each."""
    run()
    samples = []
    for _ in range(repeats):
        clock.wait()
        start = time.perf_counter()
        run()
        clock.wait()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@contextlib.contextmanager
def wrapped(owner: object, names: tuple[str, ...], wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """`owner`'s attributes `names` (functions of a module, or methods of an object) replaced by wrap(original)."""
    saved = {name: (getattr(owner, name), name in vars(owner)) for name in names}
    try:
        for name, (original, _) in saved.items():
            setattr(owner, name, wrap(original))
        yield
    finally:
        for name, (original, own) in saved.items():
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def timed_calls(clock: Clock, spans: list) -> Callable[[Callable], Callable]:
    """A `wrapped` wrapper appending a (start, end) mark pair per call to `spans`."""

    def wrap(original: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = clock.mark()
            out = original(*args, **kwargs)
            spans.append((start, clock.mark()))
            return out

        return timed

    return wrap


def recorded_calls(calls: list) -> Callable[[Callable], Callable]:
    """A `wrapped` wrapper appending each call as a callable that repeats it to `calls`."""

    def wrap(original: Callable) -> Callable:
        def recorded(*args, **kwargs):
            calls.append(lambda: original(*args, **kwargs))
            return original(*args, **kwargs)

        return recorded

    return wrap


class HFSteps:
    """HF's own decode step on its DynamicCache after the prompts [b, n]: one greedy token per sequence."""

    def __init__(self, model, prompts):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.logits = model(input_ids=prompts, cache=self.cache, use_cache=True).logits[:, -1]

    def __call__(self) -> None:
        tokens = self.logits.argmax(-1)[:, None]
        self.logits = self.model(input_ids=tokens, cache=self.cache, use_cache=True).logits[:, -1]


class SessionSteps:
    """replaygen's step after the prompts [b, n]: a greedy decode, or (tokens > 1) a verify of the greedy token and
    tokens - 1 drafts taken from the prompt, all kept (`commit`)."""

    def __init__(self, runtime, prompts, tokens: int):
        self.session = runtime.start(prompts)
        self.tokens = tokens
        self.drafts = prompts[:, : tokens - 1]

    def __call__(self) -> None:
        import torch

        last = self.session.logits.argmax(-1)
        if self.tokens == 1:
            self.session.logits = self.session.decode(last)
            return
        logits = self.session.verify(torch.cat([last[:, None], self.drafts], dim=1))
        self.session.commit(self.tokens)
        self.session.logits = logits[:, -1]


@dataclass(frozen=True)
class Share:
    """The recurrent layers' share of a step and the step's mean time (ms)."""

    recurrent: float
    step_ms: float


def recurrent_share(step: Callable[[], None], recurrent: list[tuple[object, tuple[str, ...]]], steps: int, clock: Clock) -> Share:
    """`steps` steps (after one warm-up step) with marks around each and around every call of the recurrent
    functions, given as (owner, attribute names)."""
    step()
    calls, spans = [], []
    with contextlib.ExitStack() as stack:
        for owner, names in recurrent:
            stack.enter_context(wrapped(owner, names, timed_calls(clock, calls)))
        for _ in range(steps):
            start = clock.mark()
            step()
            spans.append((start, clock.mark()))
    clock.wait()
    total = sum(clock.ms(start, end) for start, end in spans)
    return Share(sum(clock.ms(start, end) for start, end in calls) / total, total / steps)


@dataclass(frozen=True)
class StepProfile:
    """A step's device kernels (per step), the device's busy time per step (ms) and its TOP_KERNELS kernels of most
    device time ("name xcount ms", per step), or None and an empty text without a CUDA device."""

    kernels: float | None
    busy_ms: float | None
    top: str


TOP_KERNELS = 3


def profile_steps(make_step: Callable[[], Callable[[], None]], steps: int, device) -> StepProfile:
    """`steps` calls of the step `make_step` builds (after one warm-up) under torch.profiler, its device kernels
    (copies and fills included) summed per step; nothing is built or run without a CUDA device or with `steps` 0."""
    import torch

    if device.type != "cuda" or steps < 1:
        return StepProfile(None, None, "")
    step = make_step()
    step()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [event for event in profiler.key_averages() if event.device_type == torch.autograd.DeviceType.CUDA]
    ranked = sorted(kernels, key=lambda event: -event.self_device_time_total)[:TOP_KERNELS]
    top = "; ".join(f"{event.key[:48]} x{event.count / steps:g} {event.self_device_time_total / steps / 1e3:.3f}" for event in ranked)
    return StepProfile(sum(event.count for event in kernels) / steps, sum(event.self_device_time_total for event in kernels) / steps / 1e3, top)


def hf_share(case: ModelCase, model, prompts, steps: int, clock: Clock) -> Share:
    """The recurrent share of HF's own decode step: its modeling module's conv and recurrence functions."""
    return recurrent_share(HFSteps(model, prompts), [(sys.modules[type(model).__module__], case.hf_recurrence)], steps, clock)


def runtime_share(runtime, prompts, tokens: int, steps: int, clock: Clock) -> Share:
    """The recurrent share of replaygen's step of `tokens` tokens: the runtime's conv and recurrence calls, and
    a verified window's `commit` (the recurrent and conv cursors; HF's KV crop in it is a view)."""
    session_steps = SessionSteps(runtime, prompts, tokens)
    recurrent = [(runtime, ("run_conv", "run_recurrence"))] + ([(session_steps.session, ("commit",))] if tokens > 1 else [])
    return recurrent_share(session_steps, recurrent, steps, clock)


@dataclass(frozen=True)
class GraphTiming:
    """The recurrent kernels of one decode step, eager and as a CUDA graph (ms, medians), or why no graph."""

    eager_ms: float | None
    graph_ms: float | None
    note: str


def recurrent_graph(runtime, steps: SessionSteps, repeats: int) -> GraphTiming:
    """Record the conv and recurrence calls of one decode step of `steps`, then time them eagerly and captured."""
    import torch

    from replaygen.integrations.transformers import Mode
    from replaygen.measure import capture, time_callable

    if not torch.cuda.is_available():
        return GraphTiming(None, None, "no CUDA")
    calls: list[Callable[[], object]] = []
    with wrapped(runtime, ("run_conv", "run_recurrence"), recorded_calls(calls)):
        steps()

    def run_calls() -> None:
        for call in calls:
            call()

    with runtime.stepping(steps.session, Mode.DECODE):
        eager = time_callable(run_calls, repeats=repeats).median_ms
        try:
            graph = capture(run_calls)
        except Exception as error:  # a capture that fails is a result to report, the eager timing stands
            return GraphTiming(eager, None, f"capture failed: {type(error).__name__}: {str(error)[:120]}")
        return GraphTiming(eager, time_callable(graph.replay, repeats=repeats).median_ms, f"captured: {len(calls)} calls")


def hf_ops() -> str:
    """Which of HF's fast recurrent-op packages this Python has (HF falls back to its torch reference without)."""
    import importlib.util

    packages = (("mamba_ssm", "mamba_ssm"), ("causal_conv1d", "causal_conv1d"), ("flash-linear-attention", "fla"))
    return ", ".join(f"{name} {'installed' if importlib.util.find_spec(module) else 'absent'}" for name, module in packages)


def module_configs(runtime) -> str:
    """The configs each of the runtime's modules was built with (its header's `# configs` line)."""
    lines = set()
    for layer in runtime.layers:
        with open(layer.module.__file__) as source:
            lines.update(line.removeprefix("# configs").strip() for line in source if line.startswith("# configs"))
    return "; ".join(sorted(lines))


def build_model(case: ModelCase, args, device, dtype):
    """A randomly initialised model of `case` on `device` in `dtype`, in eval mode."""
    import torch
    import transformers

    config = getattr(transformers, case.config_class)(**case.config(args.layers, args.vocab, args.tiny))
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, case.model_class)(config)
    return model.to(dtype).eval()


def make_prompts(batch: int, length: int, vocab: int, repeat: bool, device):
    """Prompts [batch, length] of random tokens (1..vocab-1), or of a random SEGMENT-token segment repeated."""
    import torch

    generator = torch.Generator().manual_seed(1)
    if not repeat:
        return torch.randint(1, vocab, (batch, length), generator=generator).to(device)
    segment = torch.randint(1, vocab, (batch, SEGMENT), generator=generator)
    return segment.repeat(1, -(-length // SEGMENT))[:, :length].to(device)


@dataclass(frozen=True)
class Decoded:
    """A generation's new tokens [b, n] and the decode or verify steps after the prompt's pass that made them."""

    tokens: object
    steps: int


def hf_generate(model, prompts, new_tokens: int) -> Decoded:
    import torch

    mask = torch.ones_like(prompts)
    out = model.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return Decoded(out[:, prompts.shape[1] :], new_tokens - 1)


class TimedDrafter:
    """Prompt-lookup drafts (the runtime's default drafter) with their host seconds summed in `seconds`."""

    def __init__(self):
        from replaygen.integrations.transformers import prompt_lookup_drafts

        self.drafts = prompt_lookup_drafts
        self.seconds = 0.0

    def __call__(self, sequences: list[list[int]], count: int) -> list[list[int]]:
        start = time.perf_counter()
        drafts = self.drafts(sequences, count)
        self.seconds += time.perf_counter() - start
        return drafts


@dataclass(frozen=True)
class Measured:
    """A path's row and the new tokens [b, new + 1] of its last generation (HF's are the others' reference)."""

    row: Row
    tokens: object


def measure(case: ModelCase, path: DecodePath, model, prompts, args, clock: Clock, hf_tokens) -> Measured:
    """Tokens/s, tokens per step, the recurrent share of a step and the recurrent kernels' graph timing of `path`."""
    from replaygen.integrations.transformers import attach

    new = args.new_tokens
    drafter = TimedDrafter()
    if path.kernels is None:

        def generate(n: int) -> Decoded:
            return hf_generate(model, prompts, n)

        share = hf_share(case, model, prompts, args.share_steps, clock)
        profile = profile_steps(lambda: HFSteps(model, prompts), args.profile_steps, prompts.device)
        graph, modules = GraphTiming(None, None, "HF's path"), f"HF ({hf_ops()})"
    else:
        runtime = attach(model, path.capacity, path.window, args.gpu, path.kernels)

        def generate(n: int) -> Decoded:
            out = runtime.generate(prompts, n, draft_tokens=path.drafts, drafter=drafter)
            return Decoded(out.tokens, out.steps)

        share = runtime_share(runtime, prompts, path.drafts + 1, args.share_steps, clock)
        profile = profile_steps(lambda: SessionSteps(runtime, prompts, path.drafts + 1), args.profile_steps, prompts.device)
        if path.drafts or args.no_graph:
            graph = GraphTiming(None, None, "not tried" if args.no_graph else "verify steps: not captured")
        else:
            graph = recurrent_graph(runtime, SessionSteps(runtime, prompts, 1), args.graph_repeats)
        modules = module_configs(runtime)
    decode_s = median_s(lambda: generate(new + 1), args.repeats, clock) - median_s(lambda: generate(1), args.repeats, clock)
    drafter.seconds = 0.0
    decoded = generate(new + 1)
    same = None if hf_tokens is None else float((decoded.tokens == hf_tokens).all(dim=1).float().mean())
    batch = prompts.shape[0]
    row = Row(
        case.name, path.name, batch, new, decode_s, batch * new / decode_s, new / max(decoded.steps, 1),
        drafter.seconds / decode_s if path.drafts else None, share.recurrent, share.step_ms,
        graph.eager_ms, graph.graph_ms, graph.note, profile.kernels, profile.busy_ms, profile.top, same, modules,
    )
    return Measured(row, decoded.tokens)


def cell(value: float | None, text: str) -> str:
    """`value` formatted by `text`, or "-" where there is none."""
    return "-" if value is None else text.format(value)


def format_table(rows: list[Row]) -> str:
    """The rows as a markdown table; `vs hf` is tokens/s over the HF path's at the same model and batch; `w/o
    drafter` is tokens/s with the drafter's host time taken out of the decode time."""
    hf = {(r.model, r.batch): r.tokens_per_s for r in rows if r.path == "hf"}
    lines = [
        "| model | batch | path | tokens/s | vs hf | tokens/step | drafter | w/o drafter | recurrent share | step ms | kernels/step | device busy ms | recurrent kernels eager / graph ms | same as hf |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r.tokens_per_s / hf[(r.model, r.batch)] if (r.model, r.batch) in hf else None
        kernels = "-" if r.graph_eager_ms is None else f"{r.graph_eager_ms:.3f} / {cell(r.graph_ms, '{:.3f}')}"
        undrafted = None if r.drafter_share is None else r.tokens_per_s / (1 - r.drafter_share)
        lines.append(
            f"| {r.model} | {r.batch} | {r.path} | {r.tokens_per_s:,.0f} | {cell(ratio, '{:.2f}x')} | {r.tokens_per_step:.2f} | "
            f"{cell(r.drafter_share, '{:.0%}')} | {cell(undrafted, '{:,.0f}')} | {cell(r.recurrent_share, '{:.0%}')} | {cell(r.step_ms, '{:.2f}')} | "
            f"{cell(r.kernels_per_step, '{:.0f}')} | {cell(r.busy_ms, '{:.2f}')} | {kernels} | "
            f"{cell(r.same_as_hf, '{:.0%}')} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} (default all)")
    parser.add_argument("--paths", default="hf,baseline,replay,replay-t2,replay-t4", help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--batch", default="1,32,256", help="comma-separated batch sizes (default 1,32,256)")
    parser.add_argument("--layers", type=int, default=6, help="recurrent layers per model (default 6)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default 32768; 64 with --tiny)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded after the prompt's own (default 64)")
    parser.add_argument("--repeat-prompt", action="store_true", help=f"prompts of a random {SEGMENT}-token segment repeated (prompt lookup can match)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, after one warm-up (default 3)")
    parser.add_argument("--share-steps", type=int, default=8, help="steps timed for the recurrent share (default 8)")
    parser.add_argument("--profile-steps", type=int, default=4, help="steps under torch.profiler per path (default 4; 0: none)")
    parser.add_argument("--graph-repeats", type=int, default=20, help="timings of the recurrent kernels, eager and graph (default 20)")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA graph of the recurrent kernels")
    parser.add_argument("--gpu", default="h200", help="tuning records for attach (default h200; 'none': documented defaults)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton's interpreter; use with --tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="model and activation dtype (default bfloat16)")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized layers (hidden 32, 4 heads of 16): a check that the script runs")
    parser.add_argument("--out", type=Path, help="write the rows and setup as JSON to this file")
    args = parser.parse_args(argv)
    args.models = _choices(parser, "--models", args.models, MODELS)
    args.paths = _choices(parser, "--paths", args.paths, PATHS)
    try:
        args.batch = [int(b) for b in args.batch.split(",")]
    except ValueError:
        parser.error(f"--batch {args.batch!r}: comma-separated integers")
    if min(args.batch) < 1 or args.new_tokens < 1 or args.layers < 1 or args.repeats < 1 or args.prompt_tokens < 2:
        parser.error("--batch, --new-tokens, --layers and --repeats must be at least 1, --prompt-tokens at least 2")
    args.gpu = None if args.gpu.lower() == "none" or args.device == "cpu" else args.gpu
    args.vocab = args.vocab or (64 if args.tiny else 32768)
    return args


def _choices(parser: argparse.ArgumentParser, option: str, value: str, known: dict) -> list:
    names = [name for name in value.split(",") if name]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"{option}: unknown {', '.join(unknown) or 'empty'}; choose from {', '.join(known)}")
    return [known[name] for name in names]


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    clock = Clock(device)
    prompt_kind = f"a random {SEGMENT}-token segment repeated" if args.repeat_prompt else "random tokens"
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; {args.dtype}; {args.layers} recurrent layers; "
          f"vocab {args.vocab}; prompts of {args.prompt_tokens} tokens ({prompt_kind}); {args.new_tokens} new tokens; "
          f"medians of {args.repeats}; HF's recurrent ops: {hf_ops()}", flush=True)
    rows = []
    with torch.no_grad():
        for case in args.models:
            model = build_model(case, args, device, dtype)
            for batch in args.batch:
                prompts = make_prompts(batch, args.prompt_tokens, args.vocab, args.repeat_prompt, device)
                hf_tokens = None
                for path in sorted(args.paths, key=lambda path: path.kernels is not None):  # HF's first: the others' reference
                    measured = measure(case, path, model, prompts, args, clock, hf_tokens)
                    hf_tokens = measured.tokens if path.kernels is None else hf_tokens
                    row = measured.row
                    rows.append(row)
                    print(f"{case.name} b{batch} {path.name}: {row.tokens_per_s:,.0f} tokens/s, {row.tokens_per_step:.2f} tokens/step; "
                          f"recurrent share {cell(row.recurrent_share, '{:.0%}')} of a {cell(row.step_ms, '{:.2f}')} ms step; recurrent kernels eager / graph "
                          f"{cell(row.graph_eager_ms, '{:.3f}')} / {cell(row.graph_ms, '{:.3f}')} ms ({row.graph_note}); {cell(row.kernels_per_step, '{:.0f}')} kernels "
                          f"a step, device busy {cell(row.busy_ms, '{:.2f}')} ms ({row.top_kernels or 'no device profile'}); modules: {row.modules}", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            del model
    print()
    print(format_table(rows))
    print(f"\nrecurrent share: {'CUDA events' if clock.cuda else 'host clock marks'} around the recurrent layers' conv and recurrence "
          f"calls (and a window's commit) over marks around each step ({args.share_steps} steps; a verify + commit of a whole window for "
          "-t paths). recurrent kernels eager / graph: one decode step's recurrent calls, eager and as a captured CUDA graph (medians); "
          f"the end-to-end steps run eagerly (HF's DynamicCache grows per step). kernels/step, device busy ms: {args.profile_steps} steps "
          "under torch.profiler, the device kernels launched and their own times summed, per step.")
    if args.out:
        setup = {key: value for key, value in vars(args).items() if key not in ("models", "paths", "out")}
        setup.update(models=[case.name for case in args.models], paths=[asdict(path) for path in args.paths], prompts=prompt_kind, hf_ops=hf_ops())
        environment = {"torch": torch.__version__, "device": str(device)}
        if device.type == "cuda":
            from replaygen.bench import environment as gpu_environment

            environment = gpu_environment(device)
        args.out.write_text(json.dumps({"environment": environment, "setup": setup, "rows": [asdict(row) for row in rows]}, indent=2))
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
