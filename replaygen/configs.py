"""Kernel launch configurations, per kernel kind and batch bucket.

A `KernelConfig` holds every tuning knob; each knob names the kernel kinds that read it (`KNOB_KINDS`), and a
config of a kind leaves the other kinds' knobs at their defaults (`validate_config`). A module's dispatch table of
a kind holds, per batch bucket, the knobs of that kind. Where no tuning record applies, `build --allow-default`
uses `default_configs`. What each knob does and why it exists: docs/design.md, "Tuning knobs".
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields, replace

from replaygen.errors import UnsupportedShapeError
from replaygen.spec.model import DecayGranularity, Spec, TargetShape, UpdateKind, VectorTransform

# Groups of slots whose aligned flushes fall on different steps of the clock, unless `build --flush-groups` says
# otherwise: with 2, each flushing step folds half the rows and costs about one baseline step.
DEFAULT_FLUSH_GROUPS = 2


class KernelKind(enum.Enum):
    BASELINE_DECODE = "baseline_decode"
    REPLAY_DECODE = "replay_decode"
    MATERIALIZE = "materialize"
    LOAD = "load"
    REPLAY_VERIFY = "replay_verify"
    COMMIT = "commit"
    BASELINE_VERIFY = "baseline_verify"


class Route(enum.Enum):
    OUTPUT_ONLY = "output_only"
    STATE_AND_OUTPUT = "state_and_output"


# tl.dot's smallest operand side (the fold_dot and readout_dot knobs).
MIN_DOT = 16

# The separate flush launch (configs without fused_flush) streams whole states like the baseline decode; it keeps
# this launch shape whatever the decode's: 16 value rows, 4 warps, FLUSH_PROGRAMS_PER_SM persistent programs per
# multiprocessor.
FLUSH_BLOCK_V = 16
FLUSH_NUM_WARPS = 4
FLUSH_PROGRAMS_PER_SM = 4

# Value rows per cursor copy; block_v must be a multiple (each program owns whole copies).
CURSOR_GRAIN = 8

# Operand precisions of the fold's tensor-core product (fold_precision) and of the verify's readout products
# (readout_precision): Triton's tf32x3 (three tf32 products, about fp32) and tf32 (one), or both operands in the key
# buffer's dtype where the key and value buffers hold 16-bit values (bf16 activations: the keys exactly, the weighted
# values, or the state slice read, rounded once more), tf32x3 where they hold float32 ones.
FOLD_PRECISIONS = ("tf32x3", "tf32", "key_buffer")

# Kernel kinds whose programs load a state tile and store to the same state memory (the checkpoint, or a slot's
# snapshots). A tile of fewer elements than the program's threads is replicated across its warps by Triton's layout
# (each copy loaded, one stored); a warp that loaded late could then read what another warp already stored and pass
# it on through a cross-warp reduction, so validate_config rejects such configs instead.
STATE_TILE_KINDS = (KernelKind.BASELINE_DECODE, KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY, KernelKind.BASELINE_VERIFY)

# Batch sizes `tune` and `bench` use by default: the upper edges of the dispatch buckets. Serving engines capture
# one CUDA graph per padded batch size (1, 2, 4, 8, then steps of 8 or more), so the small sizes get buckets of
# their own.
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 32, 128, 256, 512)

ALL_KINDS = frozenset(KernelKind)
REPLAY_KINDS = frozenset({KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY})
DECODE = frozenset({KernelKind.REPLAY_DECODE})
VERIFY = frozenset({KernelKind.REPLAY_VERIFY})
STATE_STREAMING_KINDS = frozenset(STATE_TILE_KINDS)


@dataclass(frozen=True, kw_only=True)
class SpecTraits:
    """What a spec's recurrence allows one shape's kernel configs, derived from the spec once (`spec_traits`)."""

    channel_decay: bool = False  # the decay is per key channel: no scores kernel, key tiles on the state routes only
    delta_rule: bool = False  # the delta rule: a verify window's triangular solve; corrected values cached at the buffers' precision
    shared_scores: bool = True  # one key per key head and step, no carried entry, rank 1 (`shares_scores`)
    whole_head_baseline: bool = False  # the baselines run one program per head (they rewrite a carried key and angle)
    one_factor_transforms: bool = True  # the key and query transforms scale the raw vector by one factor (none, or l2norm alone)

    @property
    def scores(self) -> bool:
        """The scores kernel (precompute_scores) applies."""
        return self.shared_scores and not self.channel_decay

    @property
    def key_tiles(self) -> bool:
        """The key-tiled decode's state route (block_k) applies: one key per key head and step with no carried entry
        (shares_scores), and key and query slices that are the raw slices times one factor."""
        return self.shared_scores and self.one_factor_transforms

    @property
    def output_only_key_tiles(self) -> bool:
        """Key tiles on the output-only routes too: `key_tiles` with a per-head decay (those routes read the entries
        through their scores, which for a decay per key channel are sums over the whole key axis)."""
        return self.key_tiles and not self.channel_decay


def _knob(default: object, kinds: frozenset[KernelKind], doc: str) -> object:
    return field(default=default, metadata={"kinds": kinds, "doc": doc})


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """One launch configuration. Every knob but block_v has a default that switches its feature off."""

    block_v: int = field(metadata={"kinds": ALL_KINDS, "doc": "value rows of the state per program"})
    num_warps: int = _knob(4, ALL_KINDS, "warps per program")
    num_stages: int = _knob(1, ALL_KINDS, "Triton's software-pipelining stages")
    max_registers: int = _knob(0, ALL_KINDS, "per-thread register cap (ptxas maxnreg); 0 = the compiler's choice")
    route: Route = _knob(Route.OUTPUT_ONLY, REPLAY_KINDS, "non-flush steps: read the checkpoint at the query, or rebuild the state first")
    flush_at: int = _knob(0, REPLAY_KINDS, "decode: flush threshold; verify: also fold at h >= flush_at; 0 means the capacity L")
    prefetch_ring: bool = _knob(True, REPLAY_KINDS, "load every ring position without waiting for the cursor")
    fold_chunk: int = _knob(4, REPLAY_KINDS | {KernelKind.MATERIALIZE}, "buffered entries loaded together per step of the fold loop")
    fold_dot: bool = _knob(False, REPLAY_KINDS, "fold the ring by one tensor-core product instead of the loop")
    fold_precision: str = _knob("tf32x3", REPLAY_KINDS, "the fold product's operands: tf32x3 (about fp32), tf32, or key_buffer (16-bit buffers' dtype; tf32x3 on float32 ones)")
    block_k: int = _knob(0, REPLAY_KINDS, "0: the whole key axis in one tile; else key columns per pass of the program's key loop")
    precompute_scores: bool = _knob(False, REPLAY_KINDS, "entry and window scores once per key head, in a small kernel first")
    fused_flush: bool = _knob(True, REPLAY_KINDS, "decode: fold full buffers in the decode kernel, or in a second launch; key-tiled verify: the flushing rows in the same launch, or in a second one")
    readout_dot: bool = _knob(False, VERIFY, "read the state and ring at every window token by tensor-core products")
    readout_precision: str = _knob("tf32x3", VERIFY, "the readout products' operands (readout_dot): tf32x3 (about fp32), tf32, or key_buffer (16-bit buffers' dtype; tf32x3 on float32 ones); the outputs only, never the state")
    evict_state: bool = _knob(False, STATE_STREAMING_KINDS, "state loads and stores evict-first in L2")
    overlap_scores: bool = _knob(False, REPLAY_KINDS, "launched as a programmatic dependent of the scores kernel (sm90+)")
    align_flushes: bool = _knob(False, DECODE, "every row also flushes on every flush_at-th step of the layer's step clock")
    flush_groups: int = _knob(1, DECODE, "with align_flushes: slot % flush_groups picks the clock step its rows flush on")
    window_block_v: int = _knob(0, VERIFY, "0: one kernel; else the split verify's window half over this many value rows")
    window_warps: int = _knob(1, VERIFY, "with window_block_v: warps of the window half")
    early_launch: bool = _knob(False, REPLAY_KINDS, "the step's kernels launch early, each waiting for the kernel before (sm90+)")
    prefetch_fold_keys: bool = _knob(False, REPLAY_KINDS, "a folding program prefetches the ring's keys into L1 first (CUDA)")
    early_commit: bool = _knob(False, VERIFY, "the commit after the verify launches early, waiting for the kernel before (sm90+)")

    def fields(self) -> dict[str, object]:
        """Every knob by name, the route as its value."""
        return {**asdict(self), "route": self.route.value}

    def as_dict(self, kind: KernelKind | None = None) -> dict[str, object]:
        """The knobs `kind` reads (every knob without a kind), the route as its value: a dispatch table's entry."""
        values = self.fields()
        return values if kind is None else {name: values[name] for name in KNOB_KINDS if kind in KNOB_KINDS[name]}

    @classmethod
    def from_fields(cls, values: dict[str, object]) -> KernelConfig:
        """A config from knob values by name (the route by its value); a knob left out takes its default."""
        unknown = sorted(set(values) - set(KNOB_KINDS))
        if unknown:
            raise ValueError(f"unknown knob(s) {', '.join(unknown)}")
        return cls(**{name: Route(value) if name == "route" else value for name, value in values.items()})


# Which kernel kinds read each knob.
KNOB_KINDS: dict[str, frozenset[KernelKind]] = {f.name: f.metadata["kinds"] for f in fields(KernelConfig)}
KNOB_DEFAULTS: dict[str, object] = {f.name: f.default for f in fields(KernelConfig) if f.name != "block_v"}


@dataclass(frozen=True)
class BucketConfig:
    """The config used for batch sizes up to `max_batch` (None: any larger batch)."""

    max_batch: int | None
    config: KernelConfig


def bucket_config(table: tuple[BucketConfig, ...], batch: int) -> KernelConfig:
    """The config a dispatch table runs at `batch` (what the generated modules' `_pick` chooses)."""
    return next(b.config for b in table if b.max_batch is None or batch <= b.max_batch)


def bucket_range(table: tuple[BucketConfig, ...], index: int) -> str:
    """The batch sizes bucket `index` of a dispatch table runs, e.g. 'batch 5-8', 'batch > 256', 'every batch'."""
    low = table[index - 1].max_batch + 1 if index else 1
    high = table[index].max_batch
    if high is None:
        return "every batch" if low == 1 else f"batch > {low - 1}"
    return f"batch {low}" if low == high else f"batch {low}-{high}"


def bucket_variants(tables: dict[KernelKind, tuple[BucketConfig, ...]]) -> tuple[dict[KernelKind, tuple[BucketConfig, ...]], ...]:
    """The dispatch tables split into single-bucket sets that run every config of every table at least once: set i
    gives each kind its i-th bucket's config (a shorter table's last) for every batch size."""
    depth = max(len(table) for table in tables.values())
    return tuple(
        {kind: (BucketConfig(None, table[min(i, len(table) - 1)].config),) for kind, table in tables.items()}
        for i in range(depth)
    )


def _kinds_text(kinds: frozenset[KernelKind]) -> str:
    names = [kind.value for kind in KernelKind if kind in kinds]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def validate_config(kind: KernelKind, shape: TargetShape, config: KernelConfig) -> None:
    """Reject configs no kernel can run, before anything is compiled."""
    for name, kinds in KNOB_KINDS.items():
        if kind not in kinds and getattr(config, name) != KNOB_DEFAULTS[name]:
            raise UnsupportedShapeError(f"{kind.value}: {name} applies to {_kinds_text(kinds)} only (no other kernel reads it)")
    if config.block_v < CURSOR_GRAIN or config.block_v & (config.block_v - 1):
        raise UnsupportedShapeError(f"{kind.value}: block_v={config.block_v} must be a power of two >= {CURSOR_GRAIN}")
    if config.block_v > whole_head_rows(shape):
        raise UnsupportedShapeError(f"{kind.value}: block_v={config.block_v} exceeds value_dim={shape.value_dim} rounded up")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise UnsupportedShapeError(f"{kind.value}: num_warps={config.num_warps} must be 1, 2, 4, 8 or 16")
    warps_cap = max_state_warps(shape, config.block_v, config.block_k)
    if kind in STATE_TILE_KINDS and config.num_warps > warps_cap:
        raise UnsupportedShapeError(
            f"{kind.value}: num_warps={config.num_warps} is {32 * config.num_warps} threads for a state tile of"
            f" {state_tile_elements(shape, config.block_v, config.block_k)} elements (block_v={config.block_v} x {f'block_k={config.block_k}' if config.block_k else f'key_dim={shape.key_dim} rounded up'}),"
            f" so its warps would hold the same state elements; at most {warps_cap} warp(s) here"
        )
    if not 1 <= config.num_stages <= 4:
        raise UnsupportedShapeError(f"{kind.value}: num_stages={config.num_stages} must be 1..4")
    if config.fold_chunk not in (1, 2, 4, 8):
        raise UnsupportedShapeError(f"{kind.value}: fold_chunk={config.fold_chunk} must be 1, 2, 4 or 8")
    if config.fold_dot and (config.block_v < MIN_DOT or shape.key_dim < MIN_DOT):
        raise UnsupportedShapeError(f"{kind.value}: fold_dot needs block_v and key_dim >= {MIN_DOT} (tl.dot), got {config.block_v}, {shape.key_dim}")
    if config.fold_precision not in FOLD_PRECISIONS:
        raise UnsupportedShapeError(f"{kind.value}: fold_precision={config.fold_precision!r} must be one of {', '.join(FOLD_PRECISIONS)}")
    if config.fold_precision != KNOB_DEFAULTS["fold_precision"] and not config.fold_dot:
        raise UnsupportedShapeError(f"{kind.value}: fold_precision={config.fold_precision} sets the fold product's operands, so it needs fold_dot")
    if config.readout_precision not in FOLD_PRECISIONS:
        raise UnsupportedShapeError(f"{kind.value}: readout_precision={config.readout_precision!r} must be one of {', '.join(FOLD_PRECISIONS)}")
    if config.readout_precision != KNOB_DEFAULTS["readout_precision"] and not config.readout_dot:
        raise UnsupportedShapeError(f"{kind.value}: readout_precision={config.readout_precision} sets the readout products' operands, so it needs readout_dot")
    if config.block_k:
        if config.block_k < MIN_DOT or config.block_k & (config.block_k - 1) or config.block_k >= _next_pow2(shape.key_dim):
            raise UnsupportedShapeError(
                f"{kind.value}: block_k={config.block_k} must be 0 (the whole key axis) or a power of two from {MIN_DOT} below key_dim={shape.key_dim} rounded up"
            )
        if kind is KernelKind.REPLAY_DECODE and config.flush_at == 1:
            raise UnsupportedShapeError(f"{kind.value}: block_k runs buffering steps; flush_at=1 runs the baseline's step on the whole key axis (block_k=0)")
        if kind is KernelKind.REPLAY_VERIFY and config.window_block_v:
            raise UnsupportedShapeError(f"{kind.value}: block_k runs the verify in one launch; window_block_v (the split verify) runs the whole key axis")
        if kind is KernelKind.REPLAY_VERIFY and config.route is Route.OUTPUT_ONLY and not (config.precompute_scores or config.readout_dot):
            raise UnsupportedShapeError(
                f"{kind.value}: the key-tiled output-only verify reads the entries' scores precomputed or by the readout products:"
                " block_k needs precompute_scores, readout_dot or the state_and_output route"
            )
    if kind is KernelKind.REPLAY_VERIFY and not config.fused_flush:
        if not config.block_k:
            raise UnsupportedShapeError(f"{kind.value}: a separate flush launch (fused_flush off) runs the key-tiled verify: it needs block_k")
        if config.route is not Route.OUTPUT_ONLY:
            raise UnsupportedShapeError(f"{kind.value}: a separate flush launch (fused_flush off) runs the output-only route; the state route folds in every launch")
    if config.readout_dot and (config.block_v < MIN_DOT or (not config.block_k and not config.precompute_scores)):
        raise UnsupportedShapeError(
            f"{kind.value}: readout_dot needs block_v >= {MIN_DOT} (tl.dot) and, on the whole key axis (block_k=0), precompute_scores,"
            f" got block_v={config.block_v}, precompute_scores={config.precompute_scores}"
        )
    if config.overlap_scores and not config.precompute_scores:
        raise UnsupportedShapeError(f"{kind.value}: overlap_scores overlaps the scores kernel, so it needs precompute_scores")
    if config.align_flushes and (not config.precompute_scores or not config.fused_flush):
        raise UnsupportedShapeError(
            f"{kind.value}: align_flushes needs precompute_scores and fused_flush (the scores kernel advances the step clock"
            f" the decode kernel's flushes read), got precompute_scores={config.precompute_scores}, fused_flush={config.fused_flush}"
        )
    if config.flush_groups < 1 or (config.flush_groups > 1 and not config.align_flushes):
        raise UnsupportedShapeError(f"{kind.value}: flush_groups={config.flush_groups} must be 1, or more with align_flushes (groups of rows flushing on different steps of the clock)")
    if config.flush_groups > (config.flush_at or shape.capacity):
        raise UnsupportedShapeError(f"{kind.value}: flush_groups={config.flush_groups} exceeds the flush period {config.flush_at or shape.capacity} (one clock step per group)")
    if config.window_block_v:
        if not config.precompute_scores or config.route is not Route.OUTPUT_ONLY or config.readout_dot:
            raise UnsupportedShapeError(
                f"{kind.value}: window_block_v (the split verify) runs the output-only route with precompute_scores and"
                f" without readout_dot, got route={config.route.value}, precompute_scores={config.precompute_scores}, readout_dot={config.readout_dot}"
            )
        if config.window_block_v < CURSOR_GRAIN or config.window_block_v & (config.window_block_v - 1) or config.window_block_v > whole_head_rows(shape):
            raise UnsupportedShapeError(f"{kind.value}: window_block_v={config.window_block_v} must be 0 or a power of two from {CURSOR_GRAIN} to value_dim={shape.value_dim} rounded up")
    if config.window_warps not in (1, 2, 4, 8, 16) or (config.window_warps != 1 and not config.window_block_v):
        raise UnsupportedShapeError(f"{kind.value}: window_warps={config.window_warps} must be 1, 2, 4, 8 or 16, and 1 without window_block_v")
    if config.max_registers and not 24 <= config.max_registers <= 255:
        raise UnsupportedShapeError(f"{kind.value}: max_registers={config.max_registers} must be 0 (no cap) or 24..255")
    if not 0 <= config.flush_at <= shape.capacity:
        raise UnsupportedShapeError(f"{kind.value}: flush_at={config.flush_at} must be 0 (= L) or 1..L={shape.capacity}")


def state_tile_elements(shape: TargetShape, block_v: int, block_k: int = 0) -> int:
    """Elements of a program's state tile [block_v, block_k, or key_dim rounded up to a power of two]."""
    return block_v * (block_k or _next_pow2(shape.key_dim))


def max_state_warps(shape: TargetShape, block_v: int, block_k: int = 0) -> int:
    """The most warps a program over `block_v` value rows (and `block_k` key columns at a time, 0: all) of the state
    may run without replicating its state tile across warps (STATE_TILE_KINDS; at least 1)."""
    return max(1, state_tile_elements(shape, block_v, block_k) // 32)


def default_configs(kind: KernelKind, shape: TargetShape, traits: SpecTraits = SpecTraits()) -> tuple[BucketConfig, ...]:
    """Hand-picked defaults for one kernel kind, used where no tuning record applies (`traits`: what the spec's
    recurrence allows, `spec_traits`). Distilled from the H100's tuning records; docs/design.md, "Defaults", says
    which and why:
    - replay decode: up to batch 8, 32 value rows, 4 warps, the flush fused into the decode kernel, flush every L
      steps; above, for the delta rule where key tiles run, the key-tiled state route (`key_tiled_state_route`);
      for a decay per key channel the baseline's step (`flush_every_step`), for keys per head the output-only step
      over the whole head in two warps (`whole_head_output_only`), at rank > 1 the baseline's step over the whole head
      in two warps; otherwise one warp per 32 value rows, the ring read only where live, precomputed scores
      overlapped with the decode kernel, the state streamed evict-first, every row's flush on the same steps
      (align_flushes, where the scores kernel runs) in two groups of slots half a period apart.
    - replay verify: batch 1, the state route over 8 value rows and one warp, no scores launch; above, for a decay
      per key channel, the key-tiled state route (for the delta rule reading each slice by one product in the
      buffers' dtype, as its fold; the additive rule keeps float32 readouts); where neither a scores kernel nor key
      tiles run (keys per head: a carried entry, ranks; a per-channel decay at a key size key tiles cannot take), the
      batch-1 state route at every batch; up to batch 8, one
      warp per 16 value rows, output-only with precomputed scores overlapped, evict-first; above, the same with the
      fold two entries at a time and, for the delta rule, the split verify (its window half over 64 value rows, one
      warp, the ring read only where live) or otherwise a 128-register cap (key_dim <= 128).
    - the others: 16 value rows, 4 warps (the baseline streams the state at the copy bandwidth so).
    Where the state tile is smaller than 4 warps' threads (key_dim below 8), the 4-warp defaults take fewer warps
    (max_state_warps).
    """
    cap = whole_head_rows(shape)
    scores = traits.scores
    if kind is KernelKind.REPLAY_DECODE:
        tiled = key_tiled_state_route(shape, traits) if traits.delta_rule and not traits.channel_decay else None
        return (
            BucketConfig(8, KernelConfig(block_v=min(32, cap), num_warps=min(4, max_state_warps(shape, min(32, cap))))),
            BucketConfig(None, tiled or _large_batch_replay_decode(shape, traits)),
        )
    if kind is KernelKind.REPLAY_VERIFY:
        single = BucketConfig(1, KernelConfig(block_v=CURSOR_GRAIN, num_warps=1, route=Route.STATE_AND_OUTPUT, evict_state=True))
        small = KernelConfig(block_v=min(16, cap), num_warps=1, precompute_scores=scores, overlap_scores=scores, evict_state=True)
        tiled = key_tiled_state_route(shape, traits) if traits.channel_decay else None
        if tiled is not None:
            by_product = replace(tiled, readout_dot=True, readout_precision="key_buffer") if traits.delta_rule else tiled
            return (single, BucketConfig(None, by_product))
        if not scores:
            return (BucketConfig(None, single.config),)
        if traits.delta_rule:
            large = replace(small, fold_chunk=2, prefetch_ring=False, window_block_v=min(64, cap), window_warps=1)
        else:
            large = replace(small, fold_chunk=2, max_registers=128 if shape.key_dim <= 128 else 0)
        return (single, BucketConfig(8, small), BucketConfig(None, large))
    if kind is KernelKind.COMMIT:
        return (BucketConfig(None, KernelConfig(block_v=max(CURSOR_GRAIN, _next_pow2(shape.value_dim)), num_warps=4)),)
    if traits.whole_head_baseline and kind in (KernelKind.BASELINE_DECODE, KernelKind.BASELINE_VERIFY):
        return (BucketConfig(None, KernelConfig(block_v=cap, num_warps=min(4, max_state_warps(shape, cap)))),)
    return (BucketConfig(None, KernelConfig(block_v=16, num_warps=min(4, max_state_warps(shape, 16)))),)


def _large_batch_replay_decode(shape: TargetShape, traits: SpecTraits) -> KernelConfig:
    """Replay decode's default above batch 8 where key tiles do not run: the baseline's step where the decay is per key
    channel, as the H100's searches found at KDA's sizes; where the keys differ per head (no scores kernel to share
    them), the output-only step over the whole head (`whole_head_output_only`), the H100's winner at Mamba-3's sizes,
    or at rank > 1, whose readouts score each entry's R keys against the R queries, the baseline's step over the
    whole head; otherwise the whole-key output-only step."""
    if traits.channel_decay:
        return flush_every_step(shape)
    if not traits.shared_scores and shape.rank > 1:
        return replace(flush_every_step(shape), block_v=whole_head_rows(shape), num_warps=min(2, max_state_warps(shape, whole_head_rows(shape))))
    if not traits.shared_scores:
        return whole_head_output_only(shape)
    return whole_key_output_only(shape, traits)


def whole_head_output_only(shape: TargetShape) -> KernelConfig:
    """Replay decode's output-only step with one program per head (where keys differ per head and no scores kernel
    runs, a program over part of the head scores every entry again): two warps, every ring position loaded without
    waiting for the cursor, the state streamed evict-first, the flush fused at L."""
    block_v = whole_head_rows(shape)
    return KernelConfig(block_v=block_v, num_warps=min(2, max_state_warps(shape, block_v)), evict_state=True)


def whole_key_output_only(shape: TargetShape, traits: SpecTraits = SpecTraits()) -> KernelConfig:
    """Replay decode's buffering step on the whole key axis, output-only: one warp per 32 value rows, the ring read
    only where live, precomputed scores overlapped with the decode kernel, the state streamed evict-first, the rows'
    flushes aligned in two groups of slots half a period apart (the last three where the scores kernel runs)."""
    scores = traits.scores
    return KernelConfig(
        block_v=min(32, whole_head_rows(shape)), num_warps=1, prefetch_ring=False, precompute_scores=scores, overlap_scores=scores,
        evict_state=True, align_flushes=scores, flush_groups=min(DEFAULT_FLUSH_GROUPS, shape.capacity) if scores else 1,
    )


def whole_key_state_route(shape: TargetShape) -> KernelConfig:
    """Replay decode's buffering step on the whole key axis, the state route: 16 value rows over 4 warps, each step
    folding the buffered entries into the state tile one at a time, the ring read only where live, the state streamed
    evict-first. Where the decay is per key channel, the output-only route's ring readouts weigh every key channel of
    every entry, two [ring, key] tiles beside the state tile: this route holds 64 registers against 244-255 at Kimi
    Linear's sizes (offline for sm_90), and ran 2.1x faster on the H100 (design.md "Defaults")."""
    return KernelConfig(block_v=16, num_warps=min(4, max_state_warps(shape, 16)), route=Route.STATE_AND_OUTPUT, prefetch_ring=False, evict_state=True)


def flush_every_step(shape: TargetShape) -> KernelConfig:
    """Replay decode running the baseline's step (flush_at=1: the state read and written every step, the ring never
    read): 16 value rows over 4 warps, evict-first. The default above batch 8 where the decay is per key channel: on
    the H100 at Kimi Linear's sizes both buffering routes were slower than it at b32-512 (the state route at L=16 1.9x,
    the output-only route 4x; design.md "Defaults")."""
    return KernelConfig(block_v=16, num_warps=min(4, max_state_warps(shape, 16)), flush_at=1, fold_chunk=1, evict_state=True)


def key_tiled_state_route(shape: TargetShape, traits: SpecTraits = SpecTraits()) -> KernelConfig | None:
    """Replay decode's buffering step over key tiles on the state route (block_k): one warp per 64 value rows, key
    slices of half the key axis in a loop of three pipeline stages, each slice of the state formed by one
    tensor-core product, in the 16-bit buffers' dtype for the delta rule (its corrected values are cached at that
    precision, so its state is no more exact than the buffer) and in tf32x3 otherwise (the additive rule caches raw
    inputs and keeps a float32-exact fold). None where block_k cannot run: not `traits.key_tiles`, a key axis below 32
    (slices of at least 16) or value rows below 16 (the product's smallest side)."""
    top_k = _next_pow2(shape.key_dim)
    if not traits.key_tiles or top_k < 2 * MIN_DOT or shape.value_dim < MIN_DOT:
        return None
    block_v = min(64, whole_head_rows(shape))
    return KernelConfig(
        block_v=block_v, block_k=top_k // 2, num_warps=1, num_stages=3, route=Route.STATE_AND_OUTPUT, fold_dot=True,
        fold_precision="key_buffer" if traits.delta_rule else "tf32x3",
    )


def replay_decode_structures(shape: TargetShape, traits: SpecTraits = SpecTraits()) -> tuple[KernelConfig, ...]:
    """Replay decode's buffering kernel structures, each in a launch shape that won on the H200
    (design.md, "Key tiles"): the key-tiled state route, the key-tiled output-only route (two slices of half the key
    axis, 64 value rows, two stages), and the whole-key output-only step; for a decay per key channel the key-tiled
    and the whole-key state routes (the output-only routes weigh every key channel of every entry, design.md,
    "Defaults"); where key tiles cannot run, the whole-key output-only step and the whole-key state route, and where
    the keys differ per head (no scores kernel) the output-only step over the whole head too, whose one program per
    head scores each entry once (over 32 rows, two programs score it twice). A search
    starts from each, at every batch size (a search over the knobs alone rarely finds a structure the default does
    not have)."""
    tiled = key_tiled_state_route(shape, traits)
    if tiled is None and not traits.shared_scores:
        return (whole_key_output_only(shape, traits), whole_head_output_only(shape), whole_key_state_route(shape))
    if tiled is None:
        return (whole_key_output_only(shape, traits), whole_key_state_route(shape))
    if not traits.output_only_key_tiles:
        return (tiled, whole_key_state_route(shape))
    output_only = replace(tiled, route=Route.OUTPUT_ONLY, fold_dot=False, fold_precision=KNOB_DEFAULTS["fold_precision"], num_stages=2)
    return (tiled, output_only, whole_key_output_only(shape, traits))


def replay_verify_structures(shape: TargetShape, traits: SpecTraits = SpecTraits()) -> tuple[KernelConfig, ...]:
    """Replay verify's key-tiled structures (block_k), which a search starts from beside the documented defaults: the
    state route in the launch shape of the key-tiled decode's (`key_tiled_state_route`: the committed entries folded
    into each state slice by one product, the window's scores computed in the kernel); the same with every token's
    readouts of each slice by one product in the 16-bit buffers' dtype (the vLLM ReplaySSM PR's verify reads its
    state so); the output-only route on precomputed scores overlapped with the verify kernel, two pipeline stages
    (a flush folds by the same product); and the output-only route with no scores kernel, its entries scored in the
    key loop and every readout by one product in the buffers' dtype, in one launch and with the flushing rows in a
    second launch (fused_flush off: the PR's verify structure); for a decay per key channel the two state routes
    alone. None where key tiles cannot run."""
    tiled = key_tiled_state_route(shape, traits)
    if tiled is None:
        return ()
    state_routes = (tiled, replace(tiled, readout_dot=True, readout_precision="key_buffer"))
    if not traits.output_only_key_tiles:
        return state_routes
    output_only = replace(tiled, route=Route.OUTPUT_ONLY, num_stages=2)
    in_loop = replace(output_only, readout_dot=True, readout_precision="key_buffer")
    return (*state_routes, replace(output_only, precompute_scores=True, overlap_scores=True), in_loop, replace(in_loop, fused_flush=False))


def module_defaults(spec: Spec, shape: TargetShape) -> dict[KernelKind, tuple[BucketConfig, ...]]:
    """`default_configs` of every kernel kind for `shape` of `spec`."""
    traits = spec_traits(spec, shape)
    return {kind: default_configs(kind, shape, traits) for kind in KernelKind}


def shares_scores(spec: Spec, shape: TargetShape) -> bool:
    """Whether the scores kernel (precompute_scores) applies to `shape` of `spec`, decay granularity aside: one key
    per key head and step, shared by its heads, and no carried entry (whose scores it does not compute)."""
    return not spec.keys_per_head and not spec.carries and shape.rank == 1


def spec_traits(spec: Spec, shape: TargetShape) -> SpecTraits:
    """What `spec`'s recurrence allows the kernels of `shape`."""
    return SpecTraits(
        channel_decay=spec.decay.granularity is DecayGranularity.CHANNEL,
        delta_rule=spec.update.kind is UpdateKind.DELTA,
        shared_scores=shares_scores(spec, shape),
        whole_head_baseline=spec.carries,
        one_factor_transforms=all(v.transform in (VectorTransform.NONE, VectorTransform.L2NORM) and v.weight is None and v.bias is None for v in (spec.key, spec.query)),
    )


def whole_head_rows(shape: TargetShape) -> int:
    """The largest block_v: a head's value rows rounded up to a power of two, at least 16."""
    return max(16, _next_pow2(shape.value_dim))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
