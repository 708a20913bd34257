"""Search spaces: the launch configs of one kernel kind worth timing at one batch size.

Derived from the shape (and whether the spec's decay is per channel); every parameter is a knob the kernel
templates read (nothing else is invented):

    block_v           value rows per program: powers of two from CURSOR_GRAIN to max(16, next_pow2(value_dim))
                      (the bound of `configs.validate_config`)
    num_warps         1, 2, 4, 8
    max_registers     replay kernels: 0 (the compiler's choice) or 128 per thread (more programs per
                      multiprocessor; the baselines stream their state at the copy bandwidth without a cap)
    route             replay kernels: output_only, state_and_output (verify: fold the buffer on every step and read
                      the formed state)
    flush_at          replay_decode: 1..L; replay_verify: 0 (the flush rule alone) or 1 (also fold the committed
                      entries on every step that has any: a state store per step, a fold of at most T entries)
    precompute_scores replay kernels, per-head decay only: entry (and window) scores once per key head in a small
                      kernel
    fused_flush       replay_decode: fold full buffers in the decode kernel, or in a persistent second launch;
                      replay_verify on the key-tiled output-only route: the flushing rows in the verify's launch, or
                      in a second launch of it
    prefetch_ring     replay kernels: read every ring position without waiting for the cursor
    fold_chunk        replay kernels: 1, 2, 4, 8 buffered entries loaded together per step of the fold loop
    fold_dot          replay kernels: fold by one tensor-core product instead of the loop
    fold_precision    replay kernels with fold_dot: the product's operands in tf32x3, tf32, or the 16-bit buffers'
                      dtype (key_buffer)
    block_k           replay kernels: 0 (the whole key axis in one tile) or the key columns per pass of a key loop,
                      powers of two from max(16, next_pow2(key_dim) / 4) to half of it; with a decay per key
                      channel on the state routes only
    readout_dot       replay_verify only, with a per-head decay or key tiles: the window's readouts of the state
                      and ring as tensor-core products; needs 16 value rows and, on the whole key axis,
                      precompute_scores (the key-tiled output-only route without it scores the entries by one
                      more product per key slice)
    readout_precision replay_verify with readout_dot: the readout products' operands in tf32x3, tf32, or the 16-bit
                      buffers' dtype (key_buffer: the outputs rounded once more, the state never)
    evict_state       every tuned kernel: the state's loads and stores evict-first in L2 (the state streams; the
                      cursors, rings and inputs stay cached), or the default policy
    overlap_scores    replay kernels, per-head decay only: launched as a programmatic dependent of the scores
                      kernel (overlapped with it; needs precompute_scores and compute capability 9.0)
    align_flushes     replay_decode only, per-head decay only: every row also flushes on every flush_at-th step of
                      the layer's step clock (advanced by the scores kernel), so all rows flush on the same steps;
                      needs precompute_scores and fused_flush
    flush_groups      replay_decode with align_flushes: 1, 2 or 4 groups of slots (slot % groups) flushing on evenly
                      spaced steps of the clock (`build --flush-groups` sets the count the modules ship with)
    window_block_v    replay_verify only, per-head decay only: 0 (one kernel) or the value rows per program of the
                      split verify's window half (16 and up; the checkpoint half keeps block_v)
    window_warps      replay_verify with window_block_v: warps of the window half (1, 2, 4, 8)
    early_launch      replay kernels: the step's kernels launch as programmatic dependents of the kernel before
                      them, each waiting for it before its first memory access (compute capability 9.0)
    prefetch_fold_keys replay kernels: a program that folds its buffer prefetches the ring's keys into L1 first
    early_commit      replay_verify only: the commit after the verify launches as a programmatic dependent of the
                      kernel before it, waiting for it first (compute capability 9.0)

num_stages is 1, 2 or 3 for the replay kernels (their key loop, block_k, is what Triton's pipeliner prefetches) and
1 elsewhere: no other loop has loads the pipeliner could issue ahead (the fold's loads are unrolled by fold_chunk).

Pruning rules, applied to a point before anything is rendered or compiled:

    INVALID        `configs.validate_config` rejects it (e.g. fold_dot below 16 value rows, or a state tile with
                   fewer elements than the program has threads)
    SPILLS         the fp32 state tile [block_v, block_k or next_pow2(key_dim)] needs more than
                   MAX_TILE_VALUES_PER_THREAD values per thread (32 * num_warps threads): the
                   tile, its update and the loads cannot stay in 255 registers, so it spills
    UNUSED_ROUTE   flush_at=1 flushes on every step, so the route of non-flush steps never runs:
                   only output_only is kept
    UNUSED_AT_EVERY_STEP  flush_at=1 runs the baseline's step on the checkpoint: no scores kernel, no ring tile,
                   no flush launch, the loop fold; precompute_scores, overlap_scores, prefetch_ring, fused_flush,
                   fold_dot, align_flushes and prefetch_fold_keys keep their defaults (False, False, True, True,
                   False, False, False)
    UNUSED_SCORES  the state-and-output route reads the rebuilt state, never the precomputed scores
    REFOLD         the state-and-output route already forms the state: a separate flush launch would
                   read the checkpoint again to form it once more
    UNUSED_DOT     without fused_flush the decode kernel never folds (the flush launch uses the loop), so
                   fold_dot and prefetch_fold_keys stay off
    NO_KEY_LOOP    num_stages above 1 pipelines the key loop of block_k; without it there is no loop to pipeline
    UNUSED_BY_KEY_TILES  the key-tiled kernels read their entries' ring positions from the cursor and issue no key
                   prefetch: prefetch_ring and prefetch_fold_keys keep their defaults (True, False)
    CHANNEL_KEY_TILES  with a decay per key channel only the state routes run key tiles (the output-only route
                   reads the entries through their scores, sums over the whole key axis)

The kind's documented default (`configs.default_configs`, its bucket for this batch) is the
reference point of the summary: it is always a candidate, whatever the rules say.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace

from replaygen.configs import CURSOR_GRAIN, FOLD_PRECISIONS, REPLAY_KINDS, SpecTraits, KernelConfig, KernelKind, Route, bucket_config, default_configs, state_tile_elements, validate_config, whole_head_rows
from replaygen.errors import ReplaygenError, UnsupportedShapeError
from replaygen.spec.model import TargetShape

# The kernels `replaygen tune` times; materialize, load and commit keep their defaults.
TUNABLE_KINDS: tuple[KernelKind, ...] = (
    KernelKind.BASELINE_DECODE,
    KernelKind.REPLAY_DECODE,
    KernelKind.REPLAY_VERIFY,
    KernelKind.BASELINE_VERIFY,
)
NUM_WARPS: tuple[int, ...] = (1, 2, 4, 8)
MAX_REGISTERS: tuple[int, ...] = (0, 128)
FOLD_CHUNKS: tuple[int, ...] = (1, 2, 4, 8)
FLUSH_GROUPS: tuple[int, ...] = (1, 2, 4)
MAX_TILE_VALUES_PER_THREAD = 128


class Scale(enum.Enum):
    """How a sampler should treat a parameter's ordered choices."""

    LOG2 = "log2"  # consecutive powers of two
    LINEAR = "linear"  # consecutive integers
    CATEGORICAL = "categorical"  # unordered


class PruneRule(enum.Enum):
    INVALID = "rejected by configs.validate_config"
    SPILLS = f"state tile needs more than {MAX_TILE_VALUES_PER_THREAD} fp32 values per thread"
    UNUSED_ROUTE = "flush_at=1 never runs the route of non-flush steps"
    UNUSED_AT_EVERY_STEP = "flush_at=1 launches no scores kernel or flush launch, reads no ring tile, folds by the loop"
    UNUSED_SCORES = "the state-and-output route never reads precomputed scores"
    REFOLD = "the state-and-output route forms the state anyway: a separate flush would form it again"
    UNUSED_DOT = "without fused_flush the decode kernel never folds"
    NO_KEY_LOOP = "num_stages above 1 needs the key loop of block_k"
    UNUSED_BY_KEY_TILES = "the key-tiled kernels read neither prefetch_ring nor prefetch_fold_keys"
    CHANNEL_KEY_TILES = "a decay per key channel runs key tiles on the state routes only"


@dataclass(frozen=True)
class Parameter:
    name: str  # a KernelConfig field
    choices: tuple[int, ...] | tuple[str, ...] | tuple[bool, ...]  # route values are Route.value strings
    scale: Scale

    def as_config(self, choice: int | str | bool) -> int | str | bool | Route:
        """`choice` as KernelConfig holds it (a route is a Route; its choices here are the values)."""
        return Route(choice) if self.name == "route" else choice


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The configs of `kind` for `shape` at one batch size: the product of the parameters' choices."""

    kind: KernelKind
    shape: TargetShape
    parameters: tuple[Parameter, ...]  # every KernelConfig field; fixed ones have one choice
    default: KernelConfig  # the documented default for this batch, flush_at made explicit
    state_route_key_tiles_only: bool = False  # block_k runs on the state route alone (a decay per key channel)

    def parameter(self, name: str) -> Parameter:
        for parameter in self.parameters:
            if parameter.name == name:
                return parameter
        raise KeyError(name)

    @property
    def free(self) -> tuple[Parameter, ...]:
        """The parameters a search chooses (more than one choice)."""
        return tuple(p for p in self.parameters if len(p.choices) > 1)

    @property
    def size(self) -> int:
        """Points in the space before pruning."""
        total = 1
        for parameter in self.parameters:
            total *= len(parameter.choices)
        return total

    def config(self, values: Mapping[str, int | str]) -> KernelConfig:
        """The config at `values` (free parameters by name; fixed ones take their only choice)."""
        chosen = {p.name: values[p.name] if p.name in values else p.choices[0] for p in self.parameters}
        for parameter in self.parameters:
            if chosen[parameter.name] not in parameter.choices:
                raise ValueError(f"{self.kind.value}: {parameter.name}={chosen[parameter.name]!r} is not one of {parameter.choices}")
        return KernelConfig(**{p.name: p.as_config(chosen[p.name]) for p in self.parameters})

    def values(self, config: KernelConfig) -> dict[str, int | str]:
        """The free parameters' values of `config` (inverse of `config`)."""
        raw = config.fields()
        return {p.name: raw[p.name] for p in self.free}

    def contains(self, config: KernelConfig) -> bool:
        raw = config.fields()
        return all(raw[p.name] in p.choices for p in self.parameters)

    def fit(self, config: KernelConfig) -> KernelConfig:
        """`config` with every parameter that has one choice (fixed by the kind, or by --fix) set to it."""
        return replace(config, **{p.name: p.as_config(p.choices[0]) for p in self.parameters if len(p.choices) == 1})

    def points(self) -> Iterator[KernelConfig]:
        """Every point, pruned or not, in a fixed order (the product's values are choices by construction, so
        they are not checked again as `config` checks them)."""
        names = [p.name for p in self.parameters]
        choices = [tuple(p.as_config(c) for c in p.choices) for p in self.parameters]
        for combo in itertools.product(*choices):
            yield KernelConfig(**dict(zip(names, combo)))

    def prune_reason(self, config: KernelConfig) -> PruneRule | None:
        """Why `config` is not worth compiling, or None (the default is never pruned)."""
        if config == self.default:
            return None
        try:
            validate_config(self.kind, self.shape, config)
        except UnsupportedShapeError:
            return PruneRule.INVALID
        if state_tile_elements(self.shape, config.block_v, config.block_k) > MAX_TILE_VALUES_PER_THREAD * 32 * config.num_warps:
            return PruneRule.SPILLS
        if config.num_stages > 1 and not config.block_k:
            return PruneRule.NO_KEY_LOOP
        if config.block_k and (not config.prefetch_ring or config.prefetch_fold_keys):
            return PruneRule.UNUSED_BY_KEY_TILES
        if config.block_k and self.state_route_key_tiles_only and config.route is Route.OUTPUT_ONLY:
            return PruneRule.CHANNEL_KEY_TILES
        if self.kind is KernelKind.REPLAY_DECODE:
            state_route = config.route is Route.STATE_AND_OUTPUT
            if config.flush_at == 1 and state_route:
                return PruneRule.UNUSED_ROUTE
            idle_knobs = config.precompute_scores or not config.fused_flush or not config.prefetch_ring or config.fold_dot or config.prefetch_fold_keys  # overlap needs precompute
            if config.flush_at == 1 and idle_knobs:
                return PruneRule.UNUSED_AT_EVERY_STEP
            if state_route and config.precompute_scores:
                return PruneRule.UNUSED_SCORES
            if state_route and not config.fused_flush:
                return PruneRule.REFOLD
            if (config.fold_dot or config.prefetch_fold_keys) and not config.fused_flush:
                return PruneRule.UNUSED_DOT
        return None

    def iter_candidates(self) -> Iterator[KernelConfig]:
        """The default (when in the space) first, then every unpruned point, each as it is reached."""
        if self.contains(self.default):
            yield self.default
        for config in self.points():
            if config != self.default and self.prune_reason(config) is None:
                yield config

    def candidates(self) -> tuple[KernelConfig, ...]:
        """Every candidate (`iter_candidates`): the whole product is walked, millions of points for a replay decode."""
        return tuple(self.iter_candidates())

    def count_candidates(self, limit: int) -> int:
        """min(limit, the number of candidates), walking the product only as far as the limit-th candidate."""
        return sum(1 for _ in itertools.islice(self.iter_candidates(), limit))

    def key(self) -> str:
        """sha256 of the space (kind, shape, parameters, default): names its Optuna studies."""
        payload = {
            "kind": self.kind.value,
            "shape": asdict(self.shape),
            "parameters": [[p.name, list(p.choices), p.scale.value] for p in self.parameters],
            "default": self.default.as_dict(),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=lambda value: value.value).encode()).hexdigest()  # enums by value

    def fix(self, name: str, value: str) -> SearchSpace:
        """This space with parameter `name` restricted to `value` (given as text, e.g. from --fix)."""
        try:
            parameter = self.parameter(name)
        except KeyError:
            raise ReplaygenError(f"--fix {name}={value}: no parameter '{name}' (one of {', '.join(p.name for p in self.parameters)})") from None
        matches = [c for c in parameter.choices if str(c) == value]
        if not matches:
            raise ReplaygenError(f"--fix {name}={value}: {self.kind.value} takes {name} in {', '.join(map(str, parameter.choices))}")
        fixed = replace(parameter, choices=(matches[0],))
        return replace(self, parameters=tuple(fixed if p.name == name else p for p in self.parameters))


def derive_space(kind: KernelKind, shape: TargetShape, batch: int, traits: SpecTraits = SpecTraits()) -> SearchSpace:
    """The search space of `kind` for `shape` at batch size `batch` (`traits`: what the spec's recurrence allows,
    `configs.spec_traits`)."""
    top = whole_head_rows(shape)
    block_v = tuple(1 << e for e in range(CURSOR_GRAIN.bit_length() - 1, top.bit_length()))
    decode = kind is KernelKind.REPLAY_DECODE
    verify = kind is KernelKind.REPLAY_VERIFY
    replay = kind in REPLAY_KINDS
    if traits.whole_head_baseline and kind in (KernelKind.BASELINE_DECODE, KernelKind.BASELINE_VERIFY):
        block_v = (top,)
    scores = traits.scores
    both = (False, True)
    top_k = _next_pow2(shape.key_dim)
    key_tiles = tuple(b for b in (16, 32, 64, 128, 256) if max(16, top_k // 4) <= b < top_k) if traits.key_tiles else ()
    readouts = verify and (scores or bool(key_tiles))
    parameters = (
        Parameter("block_v", block_v, Scale.LOG2),
        Parameter("num_warps", NUM_WARPS, Scale.LOG2),
        Parameter("num_stages", (1, 2, 3) if replay and key_tiles else (1,), Scale.LINEAR),
        Parameter("max_registers", MAX_REGISTERS if replay else (0,), Scale.CATEGORICAL),
        Parameter("route", tuple(r.value for r in Route) if replay else (Route.OUTPUT_ONLY.value,), Scale.CATEGORICAL),
        Parameter("flush_at", tuple(range(1, shape.capacity + 1)) if decode else (0, 1) if verify else (0,), Scale.LINEAR),
        Parameter("precompute_scores", both if replay and scores else (False,), Scale.CATEGORICAL),
        Parameter("fused_flush", both if decode or (verify and key_tiles and traits.output_only_key_tiles) else (True,), Scale.CATEGORICAL),
        Parameter("prefetch_ring", both if replay else (True,), Scale.CATEGORICAL),
        Parameter("fold_chunk", FOLD_CHUNKS if replay else (4,), Scale.LOG2),
        Parameter("fold_dot", both if replay and shape.rank == 1 else (False,), Scale.CATEGORICAL),
        Parameter("fold_precision", FOLD_PRECISIONS if replay and shape.rank == 1 else (FOLD_PRECISIONS[0],), Scale.CATEGORICAL),
        Parameter("block_k", (0, *key_tiles) if replay else (0,), Scale.CATEGORICAL),
        Parameter("readout_dot", both if readouts else (False,), Scale.CATEGORICAL),
        Parameter("readout_precision", FOLD_PRECISIONS if readouts else (FOLD_PRECISIONS[0],), Scale.CATEGORICAL),
        Parameter("evict_state", both, Scale.CATEGORICAL),
        Parameter("overlap_scores", both if replay and scores else (False,), Scale.CATEGORICAL),
        Parameter("align_flushes", both if decode and scores else (False,), Scale.CATEGORICAL),
        Parameter("flush_groups", FLUSH_GROUPS if decode and scores else (1,), Scale.LOG2),
        Parameter("window_block_v", (0, *(b for b in block_v if b >= 16)) if verify and scores else (0,), Scale.CATEGORICAL),
        Parameter("window_warps", NUM_WARPS if verify and scores else (1,), Scale.LOG2),
        Parameter("early_launch", both if replay else (False,), Scale.CATEGORICAL),
        Parameter("prefetch_fold_keys", both if replay else (False,), Scale.CATEGORICAL),
        Parameter("early_commit", both if verify else (False,), Scale.CATEGORICAL),
    )
    default = default_config(kind, shape, batch, traits)
    return SearchSpace(kind=kind, shape=shape, parameters=parameters, default=default, state_route_key_tiles_only=not traits.output_only_key_tiles)


def default_config(kind: KernelKind, shape: TargetShape, batch: int, traits: SpecTraits = SpecTraits()) -> KernelConfig:
    """The documented default for `batch` (its bucket of `default_configs`), flush_at 0 written as L."""
    tables = default_configs(kind, shape, traits)
    config = bucket_config(tables, batch)
    if kind is KernelKind.REPLAY_DECODE and config.flush_at == 0:
        config = replace(config, flush_at=shape.capacity)
    return config


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
