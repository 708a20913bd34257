"""Kernel launch configurations, per kernel kind and batch bucket.

Until a tuning record exists for a GPU, `build --allow-default` uses
`default_configs`: hand-picked values documented here.

- baseline/replay decode, materialize, load: one program per
  (value block, head, batch row); `block_v` value rows of the state each,
  the whole key dimension in one tile.
- replay decode also picks the route of non-flush steps (output-only reads
  the checkpoint at the query; state-and-output rebuilds the state first) and
  the flush threshold: a sequence flushes when its buffer would hold
  `flush_at` entries after the step (1 = flush every step = the baseline's
  traffic; the capacity L = the least traffic at large batch). With
  `align_flushes` every sequence also flushes on every flush_at-th step of
  the layer's step clock, so after its first flush a sequence flushes on the
  same steps as every other (docs/perf.md entry 28); with `flush_groups` G
  the slots form G groups (slot % G) that flush on G evenly spaced steps of
  the clock, so each flushing step folds 1/G of the rows (entry 29).
- replay verify folds a sequence's h committed entries into its checkpoint when
  h + 2T > L (the flush rule); with `flush_at` f >= 1 also when h >= f, so at
  f = 1 every step that follows an accepted token folds at most a window's
  entries and stores the state (short dependent chains for small batches,
  where the state's bytes cost little; docs/perf.md entry 55).
- `early_launch` (replay decode and verify, compute capability 9.0 and newer): the step's scores kernel and replay
  kernel launch as programmatic dependents of the kernel before them, so their launch overlaps its last programs;
  each waits for it before its first memory access (docs/perf.md entry 42). Off in every default, so the modules
  and records of configs without it read as before it existed.
- `prefetch_fold_keys` (replay decode and verify, CUDA): right before a program folds its buffer, it prefetches the
  live ring rows' keys into L1 (`prefetch.global.L1`, no registers held), so the fold loop's key loads hit L1
  instead of waiting on L2 once per chunk of entries (docs/perf.md entry 48). Off in every default, like
  early_launch; under the Triton interpreter (CPU tensors) the module passes it as off.
- `early_commit` (replay verify, compute capability 9.0 and newer): the `commit` after a verify of that bucket launches
  as a programmatic dependent of the kernel before it and waits for it before its first memory access, so its launch
  overlaps that kernel's last programs (a step of verify + commit is a chain of short launches at small batches;
  docs/perf.md entry 57). Off in every default, like early_launch.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, replace

from replaygen.errors import UnsupportedShapeError
from replaygen.spec.model import DecayGranularity, Spec, TargetShape, UpdateKind


# Groups of slots whose aligned flushes fall on different steps of the clock, unless `build --flush-groups` says
# otherwise: with 2 each flushing step folds half the rows and costs about one baseline step (docs/perf.md entry 29).
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


# tl.dot's smallest operand side (the fold_dot option).
MIN_DOT = 16

# The separate flush launch (configs without fused_flush) streams whole states like the baseline decode; it keeps
# this launch shape whatever the decode's: 16 value rows, 4 warps (about 100-170 registers with the fold loop),
# FLUSH_PROGRAMS_PER_SM persistent programs per multiprocessor.
FLUSH_BLOCK_V = 16
FLUSH_NUM_WARPS = 4
FLUSH_PROGRAMS_PER_SM = 4

# Value rows per cursor copy; block_v must be a multiple (each program owns whole copies).
CURSOR_GRAIN = 8

# Kernel kinds whose programs load a state tile and store to the same state memory (the checkpoint, or a slot's
# snapshots). A tile of fewer elements than the program's threads is replicated across its warps by Triton's layout
# (each copy loaded, one stored); a warp that loaded late could then read what another warp already stored and pass
# it on through a cross-warp reduction, so validate_config rejects such configs instead.
STATE_TILE_KINDS = (KernelKind.BASELINE_DECODE, KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY, KernelKind.BASELINE_VERIFY)

# Batch sizes `tune` and `bench` use by default: the upper edges of the dispatch buckets. Serving engines capture
# one CUDA graph per padded batch size (1, 2, 4, 8, then steps of 8 or more), so the small sizes get buckets of
# their own: a config tuned at 8 also runs batches 2-7 otherwise, and a winner at 8 can lose at 2 (docs/perf.md 20).
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 32, 128, 256, 512)


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    route: Route = Route.OUTPUT_ONLY  # replay kernels (verify: state_and_output folds on every step)
    flush_at: int = 0  # replay decode: flush threshold; replay verify: also fold at h >= flush_at; 0 means the capacity L
    prefetch_ring: bool = True  # replay kernels: load every ring position without waiting for the cursor
    fold_chunk: int = 4  # replay kernels: buffered entries loaded together per step of the fold loop
    fold_dot: bool = False  # replay kernels: fold the ring by one tensor-core product (tf32x3) instead of a loop
    precompute_scores: bool = False  # replay kernels: entry (and window) scores once per key head in a small kernel first
    fused_flush: bool = True  # replay decode: fold full buffers in the decode kernel, or in a second launch
    readout_dot: bool = False  # replay verify: read the state and ring at every window token by tensor-core products (tf32x3)
    max_registers: int = 0  # per-thread register cap (ptxas maxnreg; more programs per SM); 0 = the compiler's choice
    evict_state: bool = False  # state loads and stores evict-first in L2, so small data (cursors, inputs) stays cached
    overlap_scores: bool = False  # replay kernels: launched as a programmatic dependent of the scores kernel (sm90+)
    align_flushes: bool = False  # replay decode: every row also flushes on every flush_at-th step of the layer's step clock
    flush_groups: int = 1  # replay decode with align_flushes: slot % flush_groups picks the clock step its rows flush on
    window_block_v: int = 0  # replay verify: 0 = one kernel; else the checkpoint readouts and the window's work split (see below)
    window_warps: int = 1  # replay verify with window_block_v: warps of the window launch (max_registers caps the other only)
    early_launch: bool = False  # replay decode and verify: the step's kernels launch early, each waiting for the kernel before (sm90+)
    prefetch_fold_keys: bool = False  # replay decode and verify: a folding program prefetches the ring's keys into L1 first (CUDA)
    early_commit: bool = False  # replay verify: the commit after it launches early, waiting for the kernel before (sm90+)

    # window_block_v > 0 splits replay verify into two launches of its kernel: the checkpoint half (fold, state
    # store, the checkpoint read at every window token) over block_v value rows per program writes the readouts
    # [batch, heads, names, T, V] to a scratch buffer; the window half (ring and window terms, outputs, appends,
    # cursor) reads them over window_block_v rows per program, so its per-head work is not repeated per block_v rows.

    def fields(self) -> dict[str, object]:
        """Every field by name, the route as its value."""
        return {**asdict(self), "route": self.route.value}

    def as_dict(self) -> dict[str, object]:
        """The written form: every field; align_flushes, flush_groups, the window split, early_launch, prefetch_fold_keys and early_commit only where they are set, so the
        configs that do not use them (and the tuning records and module tables of every kind written before they existed) read as they did."""
        return {
            "block_v": self.block_v,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "route": self.route.value,
            "flush_at": self.flush_at,
            "prefetch_ring": self.prefetch_ring,
            "fold_chunk": self.fold_chunk,
            "fold_dot": self.fold_dot,
            "precompute_scores": self.precompute_scores,
            "fused_flush": self.fused_flush,
            "readout_dot": self.readout_dot,
            "max_registers": self.max_registers,
            "evict_state": self.evict_state,
            "overlap_scores": self.overlap_scores,
        } | ({"align_flushes": True} if self.align_flushes else {}) | ({"flush_groups": self.flush_groups} if self.flush_groups != 1 else {}) | (
            {"window_block_v": self.window_block_v, "window_warps": self.window_warps} if self.window_block_v else {}) | (
            {"early_launch": True} if self.early_launch else {}) | ({"prefetch_fold_keys": True} if self.prefetch_fold_keys else {}) | (
            {"early_commit": True} if self.early_commit else {})


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


def validate_config(kind: KernelKind, shape: TargetShape, config: KernelConfig) -> None:
    """Reject configs no kernel can run, before anything is compiled."""
    if config.block_v < CURSOR_GRAIN or config.block_v & (config.block_v - 1):
        raise UnsupportedShapeError(f"{kind.value}: block_v={config.block_v} must be a power of two >= {CURSOR_GRAIN}")
    if config.block_v > max(16, _next_pow2(shape.value_dim)):
        raise UnsupportedShapeError(f"{kind.value}: block_v={config.block_v} exceeds value_dim={shape.value_dim} rounded up")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise UnsupportedShapeError(f"{kind.value}: num_warps={config.num_warps} must be 1, 2, 4, 8 or 16")
    warps_cap = max_state_warps(shape, config.block_v)
    if kind in STATE_TILE_KINDS and config.num_warps > warps_cap:
        raise UnsupportedShapeError(
            f"{kind.value}: num_warps={config.num_warps} is {32 * config.num_warps} threads for a state tile of"
            f" {state_tile_elements(shape, config.block_v)} elements (block_v={config.block_v} x key_dim={shape.key_dim} rounded up),"
            f" so its warps would hold the same state elements; at most {warps_cap} warp(s) here"
        )
    if not 1 <= config.num_stages <= 4:
        raise UnsupportedShapeError(f"{kind.value}: num_stages={config.num_stages} must be 1..4")
    if config.fold_chunk not in (1, 2, 4, 8):
        raise UnsupportedShapeError(f"{kind.value}: fold_chunk={config.fold_chunk} must be 1, 2, 4 or 8")
    if config.fold_dot and (config.block_v < MIN_DOT or shape.key_dim < MIN_DOT):
        raise UnsupportedShapeError(f"{kind.value}: fold_dot needs block_v and key_dim >= {MIN_DOT} (tl.dot), got {config.block_v}, {shape.key_dim}")
    if config.readout_dot and kind is not KernelKind.REPLAY_VERIFY:
        raise UnsupportedShapeError(f"{kind.value}: readout_dot applies to replay_verify only")
    if config.readout_dot and (config.block_v < MIN_DOT or not config.precompute_scores):
        raise UnsupportedShapeError(f"{kind.value}: readout_dot needs block_v >= {MIN_DOT} (tl.dot) and precompute_scores, got block_v={config.block_v}, precompute_scores={config.precompute_scores}")
    if config.overlap_scores and not config.precompute_scores:
        raise UnsupportedShapeError(f"{kind.value}: overlap_scores overlaps the scores kernel, so it needs precompute_scores")
    if config.align_flushes and (kind is not KernelKind.REPLAY_DECODE or not config.precompute_scores or not config.fused_flush):
        raise UnsupportedShapeError(
            f"{kind.value}: align_flushes applies to replay_decode with precompute_scores and fused_flush (the scores kernel advances the step clock"
            f" the decode kernel's flushes read), got precompute_scores={config.precompute_scores}, fused_flush={config.fused_flush}"
        )
    if config.flush_groups < 1 or (config.flush_groups > 1 and not config.align_flushes):
        raise UnsupportedShapeError(f"{kind.value}: flush_groups={config.flush_groups} must be 1, or more with align_flushes (groups of rows flushing on different steps of the clock)")
    if config.flush_groups > (config.flush_at or shape.capacity):
        raise UnsupportedShapeError(f"{kind.value}: flush_groups={config.flush_groups} exceeds the flush period {config.flush_at or shape.capacity} (one clock step per group)")
    if config.window_block_v:
        if kind is not KernelKind.REPLAY_VERIFY or not config.precompute_scores or config.route is not Route.OUTPUT_ONLY or config.readout_dot:
            raise UnsupportedShapeError(
                f"{kind.value}: window_block_v (the split verify) applies to replay_verify on the output-only route with precompute_scores and"
                f" without readout_dot, got route={config.route.value}, precompute_scores={config.precompute_scores}, readout_dot={config.readout_dot}"
            )
        if config.window_block_v < CURSOR_GRAIN or config.window_block_v & (config.window_block_v - 1) or config.window_block_v > max(16, _next_pow2(shape.value_dim)):
            raise UnsupportedShapeError(f"{kind.value}: window_block_v={config.window_block_v} must be 0 or a power of two from {CURSOR_GRAIN} to value_dim={shape.value_dim} rounded up")
    if config.window_warps not in (1, 2, 4, 8, 16) or (config.window_warps != 1 and not config.window_block_v):
        raise UnsupportedShapeError(f"{kind.value}: window_warps={config.window_warps} must be 1, 2, 4, 8 or 16, and 1 without window_block_v")
    if config.early_launch and kind not in (KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY):
        raise UnsupportedShapeError(f"{kind.value}: early_launch applies to replay_decode and replay_verify only (the baselines launch as they always did)")
    if config.prefetch_fold_keys and kind not in (KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY):
        raise UnsupportedShapeError(f"{kind.value}: prefetch_fold_keys applies to replay_decode and replay_verify only (no other kernel folds a ring)")
    if config.early_commit and kind is not KernelKind.REPLAY_VERIFY:
        raise UnsupportedShapeError(f"{kind.value}: early_commit applies to replay_verify only (it launches the commit that follows a verify of its bucket)")
    if config.max_registers and not 24 <= config.max_registers <= 255:
        raise UnsupportedShapeError(f"{kind.value}: max_registers={config.max_registers} must be 0 (no cap) or 24..255")
    if not 0 <= config.flush_at <= shape.capacity:
        raise UnsupportedShapeError(f"{kind.value}: flush_at={config.flush_at} must be 0 (= L) or 1..L={shape.capacity}")
    if config.flush_at and kind not in (KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY):
        raise UnsupportedShapeError(f"{kind.value}: flush_at applies to replay_decode and replay_verify only (no other kernel flushes a buffer)")


def state_tile_elements(shape: TargetShape, block_v: int) -> int:
    """Elements of a program's state tile [block_v, key_dim rounded up to a power of two]."""
    return block_v * _next_pow2(shape.key_dim)


def max_state_warps(shape: TargetShape, block_v: int) -> int:
    """The most warps a program over `block_v` value rows of the state may run without replicating its state tile
    across warps (STATE_TILE_KINDS; at least 1)."""
    return max(1, state_tile_elements(shape, block_v) // 32)


def default_configs(kind: KernelKind, shape: TargetShape, *, channel_decay: bool = False, delta_rule: bool = False) -> tuple[BucketConfig, ...]:
    """Hand-picked defaults for one kernel kind (used when no tuning record is applied; `channel_decay`: the spec
    decays per channel, so the scores cannot be precomputed once per key head; `delta_rule`: the spec's update is the
    delta rule, whose verify window carries a triangular solve and the key readouts).

    Distilled from the H100 tuning records (docs/perf.md, entries 13-15); a tuning record replaces them per GPU:
    - replay decode: up to batch 8, 32 value rows, 4 warps, the flush fused into the decode kernel, flush every L
      steps (whether flushing every step wins at small batch is the tuner's call: it depends on the GPU's latency);
      above, one warp per 32 value rows, the ring read only where live, precomputed scores overlapped with the decode
      kernel (programmatic dependent launch, sm90+), the state streamed evict-first, every row's flush on the same
      steps (align_flushes, where the scores kernel runs) in two groups of slots half a period apart (flush_groups), so a
      flushing step folds half the rows and costs about a baseline step (docs/perf.md entry 29).
    - replay verify: batch 1, the state route over 8 value rows and one warp, no scores launch (the fewest
      launches); up to batch 8, one warp per 16 value rows, output-only with precomputed scores overlapped,
      evict-first; above, the same with the fold two entries at a time and, for the delta rule, the verify split
      (its window half over 64 value rows, one warp, the ring read only where live) or otherwise a 128-register cap
      (key_dim <= 128, where the tile fits in it). Over the H100 records of windows 2-8 these came within 7% of each
      bucket's winner from batch 32, where the up-to-batch-8 config was up to 32% (GDN) and 30% (Mamba-2) slower
      (docs/perf.md entry 38).
    - the others: 16 value rows, 4 warps (the baseline streams the state at the copy bandwidth so).
    Where the state tile is smaller than 4 warps' threads (key_dim below 8), the 4-warp defaults take fewer warps
    (max_state_warps).
    """
    cap = max(16, _next_pow2(shape.value_dim))
    scores = not channel_decay
    if kind is KernelKind.REPLAY_DECODE:
        return (
            BucketConfig(8, KernelConfig(block_v=min(32, cap), num_warps=min(4, max_state_warps(shape, min(32, cap))))),
            BucketConfig(
                None,
                KernelConfig(
                    block_v=min(32, cap), num_warps=1, prefetch_ring=False, precompute_scores=scores, overlap_scores=scores, evict_state=True,
                    align_flushes=scores, flush_groups=min(DEFAULT_FLUSH_GROUPS, shape.capacity) if scores else 1,
                ),
            ),
        )
    if kind is KernelKind.REPLAY_VERIFY:
        single = BucketConfig(1, KernelConfig(block_v=CURSOR_GRAIN, num_warps=1, route=Route.STATE_AND_OUTPUT, evict_state=True))
        small = KernelConfig(block_v=min(16, cap), num_warps=1, precompute_scores=scores, overlap_scores=scores, evict_state=True)
        if not scores:
            return (single, BucketConfig(None, small))
        if delta_rule:
            large = replace(small, fold_chunk=2, prefetch_ring=False, window_block_v=min(64, cap), window_warps=1)
        else:
            large = replace(small, fold_chunk=2, max_registers=128 if shape.key_dim <= 128 else 0)
        return (single, BucketConfig(8, small), BucketConfig(None, large))
    if kind is KernelKind.COMMIT:
        return (BucketConfig(None, KernelConfig(block_v=max(CURSOR_GRAIN, _next_pow2(shape.value_dim)), num_warps=4)),)
    return (BucketConfig(None, KernelConfig(block_v=16, num_warps=min(4, max_state_warps(shape, 16)))),)


def module_defaults(spec: Spec, shape: TargetShape) -> dict[KernelKind, tuple[BucketConfig, ...]]:
    """`default_configs` of every kernel kind for `shape` of `spec`."""
    channel = spec.decay.granularity is DecayGranularity.CHANNEL
    delta = spec.update.kind is UpdateKind.DELTA
    return {kind: default_configs(kind, shape, channel_decay=channel, delta_rule=delta) for kind in KernelKind}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
