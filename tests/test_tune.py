"""The autotuner on the CPU: spaces and pruning, record keys and files, build with records, the search loop (fake timer)."""

import itertools
import json
import math
import os
import shutil
import types
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import torch

from replaygen import measure
from replaygen.build import build_spec
from replaygen.cli import main
from replaygen.configs import BATCH_BUCKETS, BucketConfig, KernelConfig, KernelKind, Route, SpecTraits, bucket_range, bucket_variants, module_defaults, replay_decode_structures, replay_verify_structures, spec_traits
from replaygen.errors import TuningRecordError, UnsupportedShapeError
from replaygen.measure import Timing
from replaygen.offline import architecture
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec_text
from replaygen.tune import records as rec
from replaygen.tune.apply import Mismatch, dispatch_table, resolve_configs, skipped_lines
from replaygen.tune.objective import CheckResult, Evaluator, ReferenceChecker, TuneAborted, WorkloadTimer
from replaygen.keys import render_candidate
from replaygen.tune.records import RecordStore, TrialStatus, TrialTiming, latest_trials, read_records, record_path
from replaygen.tune.report import describe, format_summary, summary_rows
from replaygen.tune.run import gpu_name_of
from replaygen.tune.space import PruneRule, default_config, derive_space
from replaygen.tune.study import Mode, Progress, Tuner, TuneSettings, distributions, encode_params, make_storage, plan_tasks, tune

from conftest import ROOT, SMALL
from records_helpers import env, trial, write

BD, RD, RV, BV = KernelKind.BASELINE_DECODE, KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY, KernelKind.BASELINE_VERIFY
SHAPE = replace(SMALL, value_dim=16)  # block_v=16 fits every kernel kind


# --- search space -------------------------------------------------------------------------------


def test_space_of_the_main_shape(mamba2):
    shape = mamba2.shape("nemotron-h")
    space = derive_space(RD, shape, batch=128)
    choices = {p.name: p.choices for p in space.parameters}
    both = (False, True)
    assert choices == {
        "block_v": (8, 16, 32, 64),
        "num_warps": (1, 2, 4, 8),
        "num_stages": (1, 2, 3),
        "max_registers": (0, 128),
        "route": ("output_only", "state_and_output"),
        "flush_at": tuple(range(1, 17)),
        "precompute_scores": both,
        "fused_flush": both,
        "prefetch_ring": both,
        "fold_chunk": (1, 2, 4, 8),
        "fold_dot": both,
        "fold_precision": ("tf32x3", "tf32", "key_buffer"),
        "block_k": (0, 32, 64),
        "readout_dot": (False,),
        "readout_precision": ("tf32x3",),
        "evict_state": both,
        "overlap_scores": both,
        "align_flushes": both,
        "flush_groups": (1, 2, 4),
        "window_block_v": (0,),
        "window_warps": (1,),
        "early_launch": both,
        "prefetch_fold_keys": both,
        "early_commit": (False,),
    }
    assert space.size == 4 * 4 * 3 * 2 * 2 * 16 * 2 * 2 * 2 * 4 * 2 * 3 * 3 * 2 * 2 * 2 * 3 * 2 * 2
    assert space.default == KernelConfig(  # the default's 0 written as L
        block_v=32, num_warps=1, flush_at=16, prefetch_ring=False, precompute_scores=True, overlap_scores=True, evict_state=True, align_flushes=True,
        flush_groups=2,
    )
    assert next(space.iter_candidates()) == space.default
    assert derive_space(RD, shape, batch=1).default == KernelConfig(block_v=32, num_warps=4, flush_at=16)
    assert {p.name for p in derive_space(RD, shape, 128, SpecTraits(channel_decay=True)).free} == set(choices) - {"precompute_scores", "readout_dot", "readout_precision", "overlap_scores",
                                                                                                    "align_flushes", "flush_groups", "window_block_v", "window_warps",
                                                                                                    "early_commit"}
    baseline = derive_space(BD, shape, batch=8)
    assert [p.name for p in baseline.free] == ["block_v", "num_warps", "evict_state"]  # no loop, route, flush or register cap
    assert len(baseline.candidates()) == 30  # 32 points, block_v=64 on one warp spills
    verify = {"block_v", "num_warps", "num_stages", "max_registers", "route", "flush_at", "prefetch_ring", "fold_chunk", "fold_dot", "fold_precision", "block_k",
              "precompute_scores", "readout_dot", "readout_precision", "evict_state", "overlap_scores", "window_block_v", "window_warps", "early_launch", "prefetch_fold_keys",
              "early_commit", "fused_flush"}
    assert {p.name for p in derive_space(RV, shape, 8).free} == verify
    assert dict((p.name, p.choices) for p in derive_space(RV, shape, 8).parameters)["window_block_v"] == (0, 16, 32, 64)
    assert dict((p.name, p.choices) for p in derive_space(RV, shape, 8).parameters)["flush_at"] == (0, 1)  # the flush rule alone, or every step
    assert dict((p.name, p.choices) for p in derive_space(RV, shape, 8).parameters)["block_k"] == (0, 32, 64)
    assert {p.name for p in derive_space(RV, shape, 8, SpecTraits(channel_decay=True)).free} == verify - {"precompute_scores", "overlap_scores", "window_block_v", "window_warps", "fused_flush"}


def test_pruning_rules(mamba2):
    shape = mamba2.shape("nemotron-h")
    space = derive_space(RD, shape, batch=8)
    assert space.prune_reason(KernelConfig(block_v=64, num_warps=1, flush_at=8)) is PruneRule.SPILLS  # 64*128/32 = 256 per thread
    assert space.prune_reason(KernelConfig(block_v=64, num_warps=2, flush_at=8)) is None  # 128 per thread
    assert space.prune_reason(KernelConfig(block_v=16, flush_at=1, route=Route.STATE_AND_OUTPUT)) is PruneRule.UNUSED_ROUTE
    every_step = KernelConfig(block_v=16, flush_at=1, fold_chunk=1, evict_state=True)
    assert space.prune_reason(every_step) is None
    for knob in (dict(precompute_scores=True), dict(precompute_scores=True, overlap_scores=True), dict(fused_flush=False), dict(prefetch_ring=False),
                 dict(fold_dot=True), dict(precompute_scores=True, align_flushes=True)):
        assert space.prune_reason(replace(every_step, **knob)) is PruneRule.UNUSED_AT_EVERY_STEP
    assert space.prune_reason(replace(every_step, flush_at=2, precompute_scores=True)) is None
    assert space.prune_reason(KernelConfig(block_v=24, flush_at=8)) is PruneRule.INVALID
    assert space.prune_reason(KernelConfig(block_v=8, flush_at=8, fold_dot=True)) is PruneRule.INVALID  # tl.dot needs 16 rows
    assert space.prune_reason(KernelConfig(block_v=8, flush_at=8, overlap_scores=True)) is PruneRule.INVALID  # no scores kernel
    assert space.prune_reason(KernelConfig(block_v=8, flush_at=8, align_flushes=True)) is PruneRule.INVALID  # no scores kernel to advance the clock
    assert space.prune_reason(KernelConfig(block_v=8, flush_at=8, precompute_scores=True, fused_flush=False, align_flushes=True)) is PruneRule.INVALID
    aligned = KernelConfig(block_v=8, flush_at=2, precompute_scores=True, align_flushes=True)
    assert space.prune_reason(replace(aligned, flush_groups=2)) is None
    assert space.prune_reason(replace(aligned, flush_groups=4)) is PruneRule.INVALID  # more groups than steps in the flush period
    assert space.prune_reason(replace(aligned, flush_groups=2, align_flushes=False)) is PruneRule.INVALID  # groups of what clock?
    state_route = KernelConfig(block_v=16, flush_at=8, route=Route.STATE_AND_OUTPUT)
    assert space.prune_reason(replace(state_route, precompute_scores=True)) is PruneRule.UNUSED_SCORES
    assert space.prune_reason(replace(state_route, fused_flush=False)) is PruneRule.REFOLD
    assert space.prune_reason(KernelConfig(block_v=16, flush_at=8, fused_flush=False, fold_dot=True)) is PruneRule.UNUSED_DOT
    assert space.prune_reason(KernelConfig(block_v=16, flush_at=8, fused_flush=False, precompute_scores=True)) is None
    tiled = KernelConfig(block_v=64, block_k=64, num_warps=1, num_stages=3, flush_at=8, route=Route.STATE_AND_OUTPUT, fold_dot=True, fold_precision="key_buffer")
    assert space.prune_reason(tiled) is None  # 64 x 64 slices: 128 per thread
    assert space.prune_reason(replace(tiled, block_v=128)) is PruneRule.INVALID  # above value_dim=64
    assert space.prune_reason(replace(tiled, block_k=0)) is PruneRule.SPILLS  # the whole key axis at once
    assert space.prune_reason(replace(tiled, block_k=0, block_v=16)) is PruneRule.NO_KEY_LOOP  # nothing to pipeline
    assert space.prune_reason(replace(tiled, prefetch_ring=False)) is PruneRule.UNUSED_BY_KEY_TILES
    assert space.prune_reason(replace(tiled, prefetch_fold_keys=True)) is PruneRule.UNUSED_BY_KEY_TILES
    assert space.prune_reason(replace(tiled, flush_at=1)) is PruneRule.INVALID  # no flush-every-step path over key tiles
    assert space.prune_reason(replace(tiled, fold_dot=False)) is PruneRule.INVALID  # fold_precision sets the product's operands
    small = derive_space(BD, SMALL, batch=8)  # tile 8 x 16 = 128 elements
    assert small.prune_reason(KernelConfig(block_v=8, num_warps=8)) is PruneRule.INVALID  # 256 threads: a replicated tile
    assert small.prune_reason(KernelConfig(block_v=8, num_warps=4)) is None
    # The whole space has 170 million points (hours to walk); seven knobs fixed keep the walk to 196,608.
    walked = space.fix("max_registers", "0").fix("evict_state", "True").fix("early_launch", "False").fix("fold_chunk", "4")
    walked = walked.fix("num_stages", "1").fix("fold_precision", "tf32x3").fix("block_k", "0")
    candidates = walked.candidates()
    assert all(walked.prune_reason(c) is None for c in candidates) and len(set(candidates)) == len(candidates)
    assert len(candidates) == walked.size - sum(1 for c in walked.points() if walked.prune_reason(c) is not None)
    assert walked.count_candidates(10**9) == len(candidates) and walked.count_candidates(5) == 5
    assert tuple(itertools.islice(walked.iter_candidates(), 5)) == candidates[:5]


def test_default_is_never_pruned():
    space = derive_space(BD, replace(SMALL, value_dim=32, key_dim=256), batch=8)
    rule_would = KernelConfig(block_v=32, num_warps=1)  # 8,192 tile elements, 32 threads
    assert space.prune_reason(rule_would) is PruneRule.SPILLS
    space = replace(space, default=rule_would)  # as on a shape whose documented default breaks a rule
    assert space.prune_reason(rule_would) is None and space.candidates()[0] == rule_would


def test_fix_and_space_key(mamba2):
    shape = mamba2.shape("nemotron-h")
    space = derive_space(RD, shape, batch=128)
    assert space.key() == derive_space(RD, shape, batch=128).key()
    fixed = space.fix("flush_at", "16").fix("route", "output_only").fix("fold_dot", "False")
    assert fixed.size == 4 * 4 * 3 * 2 * 2 * 2 * 2 * 4 * 3 * 3 * 2 * 2 * 2 * 3 * 2 * 2 and fixed.key() != space.key()
    early = space.fix("early_launch", "True")  # recorded mode with --fix early_launch=True: the winners, launched early
    assert early.fit(space.default) == replace(space.default, early_launch=True)
    assert derive_space(RD, replace(shape, capacity=8), batch=128).key() != space.key()
    with pytest.raises(Exception, match="flush_at in 1"):
        space.fix("flush_at", "99")
    with pytest.raises(Exception, match="no parameter 'tile'"):
        space.fix("tile", "3")


def test_plan_tasks_is_batch_major_and_checks_fix(mamba2):
    shape = mamba2.shape("nemotron-h")
    tasks = plan_tasks(mamba2, (shape,), (BD, RD), (1, 8), fixed=(("flush_at", "4"),))
    assert [(t.batch, t.kind) for t in tasks] == [(1, BD), (1, RD), (8, BD), (8, RD)]
    assert tasks[1].space.parameter("flush_at").choices == (4,)
    with pytest.raises(Exception, match="--fix flush_at=4"):
        plan_tasks(mamba2, (shape,), (BD,), (1,), fixed=(("flush_at", "4"),))


# --- record keys -------------------------------------------------------------------------------


def test_what_changes_a_kernel_key(mamba2, monkeypatch, tmp_path):
    """A trial's key is the code it ran: the spec's description, another kernel's template or a comment leave it as
    it was; the shape's sizes, the config and the kernel's own text change it. The environment is not part of it."""
    config = KernelConfig(block_v=16, num_warps=2, flush_at=3)

    def key(spec=mamba2, shape=SHAPE, kind=RD, candidate=config):
        return render_candidate(spec, shape, kind, candidate).key.code

    base = key()
    text = (ROOT / "specs" / "mamba2.yaml").read_text()
    assert key(load_spec_text(text.replace("description:", "description: (edited)"), "mamba2.yaml")) == base
    assert key(load_spec_text(text.replace("activations: [bfloat16, float16, float32]", "activations: [bfloat16, float32]"), "mamba2.yaml")) != base
    assert key(shape=replace(SHAPE, capacity=5)) != base
    assert key(candidate=replace(config, num_warps=4)) != base
    baseline = key(kind=BD, candidate=KernelConfig(block_v=16))
    variant = tmp_path / "templates"
    shutil.copytree(ROOT / "replaygen" / "templates", variant)
    module = variant / "module.py.j2"
    module.write_text(module.read_text().replace("import torch\n", "import torch  # variant\n", 1))
    monkeypatch.setenv("REPLAYGEN_TEMPLATES", str(variant))
    assert key() == base
    kernel = variant / "kernels" / "replay_decode.py.j2"
    kernel.write_text(kernel.read_text().replace("    if EARLY_WAIT:\n        gdc_wait()\n{{ m.program_prologue() }}\n", "    if EARLY_WAIT:\n        gdc_wait()\n{{ m.program_prologue() }}\n    i_unused = 0\n", 1))
    assert key() != base
    assert key(kind=BD, candidate=KernelConfig(block_v=16)) == baseline


def test_candidate_runs_the_config_everywhere_and_defaults_elsewhere(mamba2):
    config = KernelConfig(block_v=16, num_warps=2, flush_at=3)
    source = render_candidate(mamba2, SHAPE, RD, config).source
    assert "_REPLAY_DECODE_CONFIGS = (\n    (None, " + repr(config.as_dict(RD)) + ")," in source
    assert "\n# gpu        any\n" in source


# --- record files ------------------------------------------------------------------------------


def test_append_merges_and_round_trips(mamba2, tmp_path):
    a = trial(mamba2, SHAPE, RD, KernelConfig(block_v=16, flush_at=2), 8, 1.0)
    b = trial(mamba2, SHAPE, BD, KernelConfig(block_v=8), 8, 2.0, status=TrialStatus.OUT_OF_RESOURCES)
    path = write(tmp_path, mamba2, SHAPE, [a])
    write(tmp_path, mamba2, SHAPE, [a, b])  # a again: kept once
    loaded = read_records(path)
    assert loaded.trials == (a, b)
    assert (loaded.spec, loaded.shape, loaded.gpu) == ("mamba2", "small", "h100")
    assert b.value == math.inf and a.value == 1.0
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp files left


def test_every_config_field_survives_merged_writes(mamba2, tmp_path):
    """Each write merges with the file on disk: a trial written first must keep every knob (a reader that dropped
    the newer fields once reset them to their defaults on every later write)."""
    first = trial(mamba2, SHAPE, RD, KernelConfig(block_v=16, num_warps=1, flush_at=3, precompute_scores=True, fused_flush=False,
                                                   max_registers=128, fold_chunk=2, fold_dot=True, prefetch_ring=False, evict_state=True, overlap_scores=True), 8, 1.0)
    write(tmp_path, mamba2, SHAPE, [first])
    path = write(tmp_path, mamba2, SHAPE, [trial(mamba2, SHAPE, RD, KernelConfig(block_v=16, flush_at=3), 8, 2.0)])
    assert read_records(path).trials[0] == first


def test_interrupted_write_keeps_the_old_file(mamba2, tmp_path, monkeypatch):
    path = write(tmp_path, mamba2, SHAPE, [trial(mamba2, SHAPE, BD, KernelConfig(block_v=8), 8, 1.0)])
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write(tmp_path, mamba2, SHAPE, [trial(mamba2, SHAPE, BD, KernelConfig(block_v=8, num_warps=2), 8, 1.0)])
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_corrupt_file_is_named_and_nothing_else_is_lost(mamba2, tmp_path):
    other = replace(SHAPE, name="other")
    good = write(tmp_path, mamba2, SHAPE, [trial(mamba2, SHAPE, BD, KernelConfig(block_v=8), 8, 1.0)])
    bad = write(tmp_path, mamba2, other, [trial(mamba2, other, BD, KernelConfig(block_v=8), 8, 1.0)])
    bad.write_text(bad.read_text()[:100])  # truncated
    truncated = bad.read_bytes()
    with pytest.raises(TuningRecordError, match=f"{bad}: corrupt or truncated"):
        read_records(bad)
    with pytest.raises(TuningRecordError, match=str(bad)):
        write(tmp_path, mamba2, other, [trial(mamba2, other, BD, KernelConfig(block_v=8, num_warps=2), 8, 1.0)])
    with pytest.raises(TuningRecordError, match=str(bad)):
        RecordStore(bad, spec="mamba2", shape="other", gpu="h100")
    assert bad.read_bytes() == truncated
    write(tmp_path, mamba2, SHAPE, [trial(mamba2, SHAPE, BD, KernelConfig(block_v=8, num_warps=2), 8, 1.0)])
    assert len(read_records(good).trials) == 2


def test_malformed_trial_is_located(mamba2, tmp_path):
    path = write(tmp_path, mamba2, SHAPE, [trial(mamba2, SHAPE, BD, KernelConfig(block_v=8), 8, 1.0)] * 1)
    raw = json.loads(path.read_text())
    status = rec.COLUMNS.index("status")
    raw["trials"][0][status] = "great"
    path.write_text(json.dumps(raw))
    with pytest.raises(TuningRecordError, match=r"trial 0 \(.*'great' is not a valid TrialStatus"):
        read_records(path)
    raw["trials"][0][status] = "ok"
    raw["trials"][0][rec.COLUMNS.index("config")][1] = True  # num_warps
    path.write_text(json.dumps(raw))
    with pytest.raises(TuningRecordError, match=r"trial 0 \(.*knob num_warps must be int, got True"):
        read_records(path)
    raw["trials"][0][rec.COLUMNS.index("config")][1] = 4
    raw["knobs"][1] = "num_threads"
    path.write_text(json.dumps(raw))
    with pytest.raises(TuningRecordError, match=r"unknown knob\(s\) num_threads"):
        read_records(path)
    path.write_text(json.dumps({"format": 3, "trials": []}))
    with pytest.raises(TuningRecordError, match=r"not a tuning record of format 4 \(format 3\); records of earlier formats are in git history"):
        read_records(path)


def test_record_files_hold_one_header_and_a_line_per_trial(mamba2, tmp_path):
    """The environment and each kernel key's definitions once per file; a trial is one short line."""
    trials = [trial(mamba2, SHAPE, RD, KernelConfig(block_v=16, flush_at=f), 8, 1.0 + f) for f in (1, 2, 3)]
    path = write(tmp_path, mamba2, SHAPE, trials)
    text = path.read_text()
    assert text.count("NVIDIA H100 80GB HBM3") == 1
    lines = text.splitlines()
    rows = lines[lines.index(' "trials": [') + 1 : -2]
    assert len(rows) == 3 and all(len(line) < 400 for line in rows)
    assert len(lines) < 120  # the definitions' digests once each, not once per trial
    assert read_records(path).trials == tuple(trials)


def test_records_survive_edits_that_change_no_kernel(mamba2, tmp_path):
    """A shape added to the spec, a comment or the description edited: the spec's records still apply."""
    shape = mamba2.shape("nemotron-h")
    config = KernelConfig(block_v=32, num_warps=8, flush_at=8)
    write(tmp_path, mamba2, shape, [trial(mamba2, shape, RD, config, 8, 0.1)])
    text = (ROOT / "specs" / "mamba2.yaml").read_text()
    extended = text.replace("shapes:\n", "shapes:\n  # a user's own split\n  nemotron-h-tp16: {heads: 8, key_heads: 1, value_dim: 64, key_dim: 128}\n", 1)
    extended = extended.replace("description:", "description: (edited)")
    spec = load_spec_text(extended, "mamba2.yaml")
    assert spec.shape("nemotron-h-tp16").heads == 8 and spec.source_sha256 != mamba2.source_sha256
    assert resolve_configs(spec, shape, "h100", tmp_path).configs[RD] == (BucketConfig(None, config),)


def test_aligned_trials_stand_for_the_group_count_the_build_ships(mamba2, tmp_path):
    """The build sets every aligned config to its flush_groups: an aligned trial of another group count stands for that
    regrouped config only where no applicable trial timed it; a trial that did competes with its own timing."""
    shape = mamba2.shape("nemotron-h")
    aligned = KernelConfig(block_v=32, num_warps=1, flush_at=16, precompute_scores=True, overlap_scores=True, align_flushes=True)
    spread = replace(aligned, align_flushes=False)
    write(tmp_path, mamba2, shape, [
        trial(mamba2, shape, RD, aligned, 32, 0.050),  # one group: fastest, but not what a two-group build ships
        trial(mamba2, shape, RD, replace(aligned, flush_groups=2), 32, 0.056),
        trial(mamba2, shape, RD, spread, 32, 0.053),
        trial(mamba2, shape, RD, aligned, 256, 0.40),  # no two-group trial: the one-group timing stands for it
        trial(mamba2, shape, RD, spread, 256, 0.42),
    ])
    two = resolve_configs(mamba2, shape, "h100", tmp_path, flush_groups=2)
    assert two.configs[RD] == (BucketConfig(32, spread), BucketConfig(None, replace(aligned, flush_groups=2)))
    assert "b32 53.0 us" in " ".join(two.lines)
    one = resolve_configs(mamba2, shape, "h100", tmp_path, flush_groups=1)
    assert one.configs[RD] == (BucketConfig(None, aligned),)


def test_timings_that_cannot_be_are_refused(mamba2, tmp_path):
    """A record whose times are not finite positive numbers, or that holds no list of trials, is named as malformed
    instead of being applied (a NaN or negative time would win every bucket) or read as empty."""
    path = write(tmp_path, mamba2, SHAPE, [trial(mamba2, SHAPE, BD, KernelConfig(block_v=8), 8, 1.0)])
    good = json.loads(path.read_text())
    median = rec.COLUMNS.index("median_ms")
    for value, message in ((float("nan"), "finite and positive"), (-1.0, "finite and positive"), (0, "finite and positive"), ("fast", "median_ms must be a number")):
        raw = json.loads(json.dumps(good))
        raw["trials"][0][median] = value
        path.write_text(json.dumps(raw))
        with pytest.raises(TuningRecordError, match=rf"trial 0 \(.*{message}"):
            read_records(path)
    raw = json.loads(json.dumps(good))
    raw["trials"][0][median] = None
    path.write_text(json.dumps(raw))
    with pytest.raises(TuningRecordError, match=r"trial 0 \(.*a trial that ran \(status ok\) has no timing"):
        read_records(path)
    for trials in (5, None):
        raw = dict(good, trials=trials)
        path.write_text(json.dumps(raw))
        with pytest.raises(TuningRecordError, match=r"'trials' must be a list"):
            read_records(path)
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "trials"}))
    with pytest.raises(TuningRecordError, match=r"its keys must be"):
        read_records(path)
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(TuningRecordError, match=r"not UTF-8 text at byte 0"):
        read_records(path)


def table(module_path: Path, kind: KernelKind) -> list:
    ns: dict = {}
    source = module_path.read_text()
    start = source.index(f"_{kind.value.upper()}_CONFIGS = (")
    exec(source[start : source.index("\n)\n", start) + 3], ns)
    return list(ns[f"_{kind.value.upper()}_CONFIGS"])


def test_dispatch_table_buckets_and_merges():
    a, b = KernelConfig(block_v=8), KernelConfig(block_v=16)
    assert dispatch_table({1: a, 8: b, 32: b, 128: a}) == (
        BucketConfig(1, a), BucketConfig(32, b), BucketConfig(None, a)
    )
    assert dispatch_table({8: a}) == (BucketConfig(None, a),)


def test_bucket_variants_run_every_config_once():
    """`check --gpu` splits the dispatch tables into single-bucket sets: set i runs each kind's i-th bucket (a
    shorter table's last), so every baked config is checked; bucket_range names the batch sizes each serves."""
    a, b, c = KernelConfig(block_v=8), KernelConfig(block_v=16), KernelConfig(block_v=32)
    tables = {RD: (BucketConfig(1, a), BucketConfig(8, b), BucketConfig(None, c)), BD: (BucketConfig(None, b),)}
    variants = bucket_variants(tables)
    assert [(v[RD][0].config, v[BD][0].config) for v in variants] == [(a, b), (b, b), (c, b)]
    assert all(v[kind][0].max_batch is None for v in variants for kind in v)
    assert [bucket_range(tables[RD], i) for i in range(3)] == ["batch 1", "batch 2-8", "batch > 8"]
    assert bucket_range(tables[BD], 0) == "every batch"


def test_build_without_records_stops_unless_allowed(mamba2, tmp_path, capsys):
    shape = mamba2.shape("nemotron-h")
    with pytest.raises(TuningRecordError, match="--allow-default"):
        build_spec(mamba2, (shape,), "h100", tmp_path / "gen", tune_dir=tmp_path / "tune")
    assert not (tmp_path / "gen").exists()
    built = build_spec(mamba2, (shape,), "h100", tmp_path / "gen", tune_dir=tmp_path / "tune", allow_default=True)
    assert built[0].plan.config_source == "defaults" and "documented defaults" in built[0].resolved.lines[0]
    spec_file = str(ROOT / "specs" / "mamba2.yaml")
    assert main(["build", spec_file, "--shape", "nemotron-h", "--gpu", "h100", "--out", str(tmp_path / "gen"), "--tune-dir", str(tmp_path / "tune")]) == 2
    assert "no tuning records for mamba2/nemotron-h on h100" in capsys.readouterr().err


def test_build_bakes_winners_per_bucket(mamba2, tmp_path, capsys):
    shape = mamba2.shape("nemotron-h")
    fast1 = KernelConfig(block_v=32, num_warps=2, flush_at=1)
    fast8 = KernelConfig(block_v=32, num_warps=4, flush_at=16, route=Route.STATE_AND_OUTPUT)
    wrong = KernelConfig(block_v=64, num_warps=8, flush_at=16)
    base = KernelConfig(block_v=16, num_warps=8)
    trials = [
        trial(mamba2, shape, RD, fast1, 1, 0.010),
        trial(mamba2, shape, RD, fast8, 1, 0.020),
        trial(mamba2, shape, RD, fast8, 8, 0.030),
        trial(mamba2, shape, RD, fast1, 8, 0.050),
        trial(mamba2, shape, RD, wrong, 8, 0.001, status=TrialStatus.WRONG),
        trial(mamba2, shape, RD, fast8, 512, 0.300),
        trial(mamba2, shape, BD, base, 512, 0.500),
    ]
    path = write(tmp_path / "tune", mamba2, shape, trials)
    out = tmp_path / "gen"
    spec_file = str(ROOT / "specs" / "mamba2.yaml")
    assert main(["build", spec_file, "--shape", "nemotron-h", "--gpu", "h100", "--out", str(out), "--tune-dir", str(tmp_path / "tune")]) == 0
    text = capsys.readouterr().out
    assert "replay_decode: tuned (b1 10.0 us, b8 30.0 us, b512 300.0 us)" in text
    assert "replay_verify: documented defaults (not tuned in this file)" in text and "commit: documented defaults (never tuned)" in text
    module = out / "h100" / "mamba2_nemotron_h.py"
    assert table(module, RD) == [(1, fast1.as_dict(RD)), (None, fast8.as_dict(RD))]  # b8 and b512 share one winner
    assert table(module, BD) == [(None, base.as_dict(BD))]
    assert table(module, KernelKind.COMMIT) == [(None, KernelConfig(block_v=64, num_warps=4).as_dict(KernelKind.COMMIT))]
    assert f"# configs    tune/h100/{path.name}; defaults for baseline_verify, commit, load, materialize, replay_verify" in module.read_text()


def test_mismatched_records_are_never_applied_silently(mamba2, tmp_path, monkeypatch):
    shape = mamba2.shape("nemotron-h")
    config = KernelConfig(block_v=32, num_warps=8, flush_at=8)
    tune_dir = tmp_path / "tune"
    write(tune_dir, mamba2, shape, [trial(mamba2, shape, RD, config, 8, 0.1, environment=env(triton="0.0.1"))])
    with pytest.raises(TuningRecordError, match=r"made with another triton version \(triton 0.0.1 then"):
        resolve_configs(mamba2, shape, "h100", tune_dir)
    soft = resolve_configs(mamba2, shape, "h100", tune_dir, accept_env_mismatch=True)
    assert soft.configs[RD] == (BucketConfig(None, config),)
    assert any("applied although made with another triton version" in n for n in soft.notes)
    defaulted = resolve_configs(mamba2, shape, "h100", tune_dir, allow_default=True)
    assert defaulted.configs[RD][-1].config.flush_at == 0 and "replay_decode: documented defaults (no trial applies, --allow-default)" in defaulted.lines

    shutil.rmtree(tune_dir)
    write(tune_dir, mamba2, shape, [trial(mamba2, shape, RD, config, 8, 0.1, environment=env(gpu="a100", device_name="NVIDIA A100-SXM4-80GB"))])
    with pytest.raises(TuningRecordError, match=r"made for another GPU \('a100'"):
        resolve_configs(mamba2, shape, "h100", tune_dir, accept_env_mismatch=True)

    shutil.rmtree(tune_dir)
    write(tune_dir, mamba2, shape, [trial(mamba2, shape, RD, config, 8, 0.1)])
    edited = load_spec_text((ROOT / "specs" / "mamba2.yaml").read_text().replace("activations: [bfloat16, float16, float32]", "activations: [bfloat16, float32]"), "mamba2.yaml")
    with pytest.raises(TuningRecordError, match=r"the code it ran has changed since \(ACTIVATION_DTYPES changed\)"):
        resolve_configs(edited, shape, "h100", tune_dir)

    shutil.rmtree(tune_dir)
    stale = replace(trial(mamba2, shape, RD, config, 8, 0.1), key=replace(render_candidate(mamba2, shape, RD, config).key, code="0" * 64))
    write(tune_dir, mamba2, shape, [stale])
    with pytest.raises(TuningRecordError, match="the code it ran has changed since"):
        resolve_configs(mamba2, shape, "h100", tune_dir)

    shutil.rmtree(tune_dir)
    write(tune_dir, mamba2, shape, [trial(mamba2, shape, RD, config, 8, 0.1)])
    variant = tmp_path / "templates"
    shutil.copytree(ROOT / "replaygen" / "templates", variant)
    (variant / "module.py.j2").write_text((variant / "module.py.j2").read_text() + "# variant\n")
    monkeypatch.setenv("REPLAYGEN_TEMPLATES", str(variant))
    assert resolve_configs(mamba2, shape, "h100", tune_dir).configs[RD] == (BucketConfig(None, config),)  # a comment
    decode = variant / "kernels" / "replay_decode.py.j2"
    whole_key_prologue = "    if EARLY_WAIT:\n        gdc_wait()\n{{ m.program_prologue(plan=plan) }}\n"
    assert decode.read_text().count(whole_key_prologue) == 1
    decode.write_text(decode.read_text().replace(whole_key_prologue, whole_key_prologue + "    i_unused = 0\n"))
    with pytest.raises(TuningRecordError, match=r"the code it ran has changed since \(_replay_decode_kernel changed\)"):
        resolve_configs(mamba2, shape, "h100", tune_dir)


def test_batch_sizes_whose_trials_all_went_stale_stop_the_build(mamba2, tmp_path):
    """A kernel re-timed at some batch sizes only (e.g. `tune --recorded` on a few buckets after a kernel change) must not
    let its other tuned sizes silently run a neighbouring bucket's config; --allow-default builds them with the
    documented default at their size (a neighbour's winner was chosen for another size)."""
    shape = mamba2.shape("nemotron-h")
    small, large = KernelConfig(block_v=16, num_warps=8, flush_at=1), KernelConfig(block_v=32, num_warps=1, flush_at=16)
    earlier = trial(mamba2, shape, RD, large, 512, 0.8)
    earlier = replace(earlier, key=replace(earlier.key, code="0" * 64))
    tune_dir = tmp_path / "tune"
    write(tune_dir, mamba2, shape, [trial(mamba2, shape, RD, small, 1, 0.005), earlier])
    with pytest.raises(TuningRecordError, match=r"(?s)no trial applies any more: replay_decode at batch 512 .*--kernels replay_decode --recorded 2 --batch 512`"):
        resolve_configs(mamba2, shape, "h100", tune_dir)
    allowed = resolve_configs(mamba2, shape, "h100", tune_dir, allow_default=True)
    default_large = module_defaults(mamba2, shape)[RD][-1].config
    assert allowed.configs[RD][0] == BucketConfig(1, small) and allowed.configs[RD][-1] == BucketConfig(None, default_large)
    assert any("replay_decode at batch 512: the documented default at that size (--allow-default)" in n for n in allowed.notes)


def test_a_kernel_tuned_short_of_the_others_stops_the_build(mamba2, tmp_path):
    """A tune cut short (the device's time ran out) leaves one kernel's largest tuned batch below another kernel's: its
    open-ended bucket must not silently stretch a small batch's winner over the large batches."""
    shape = mamba2.shape("nemotron-h")
    small, large = KernelConfig(block_v=16, num_warps=8, flush_at=1), KernelConfig(block_v=32, num_warps=1, flush_at=16)
    base = KernelConfig(block_v=16, num_warps=8)
    tune_dir = tmp_path / "tune"
    trials = [trial(mamba2, shape, BD, base, b, 0.01 * b) for b in (1, 32, 512)]
    write(tune_dir, mamba2, shape, trials + [trial(mamba2, shape, RD, small, 1, 0.005), trial(mamba2, shape, RD, large, 32, 0.05)])
    with pytest.raises(TuningRecordError, match=r"(?s)replay_decode up to batch 32, not at 512 .*--kernels replay_decode --batch 512`"):
        resolve_configs(mamba2, shape, "h100", tune_dir)
    allowed = resolve_configs(mamba2, shape, "h100", tune_dir, allow_default=True)
    default_large = module_defaults(mamba2, shape)[RD][-1].config
    assert allowed.configs[RD] == (BucketConfig(1, small), BucketConfig(32, large), BucketConfig(None, default_large))
    assert any("replay_decode up to batch 32, not at 512: the documented defaults there (--allow-default)" in n for n in allowed.notes)
    write(tune_dir, mamba2, shape, [trial(mamba2, shape, RD, large, 512, 0.4)])
    assert resolve_configs(mamba2, shape, "h100", tune_dir).configs[RD][-1] == BucketConfig(None, large)


def test_a_winner_that_no_longer_validates_is_skipped(mamba2, tmp_path, monkeypatch):
    import replaygen.plan

    shape = mamba2.shape("nemotron-h")
    config = KernelConfig(block_v=32, num_warps=8, flush_at=8)
    write(tmp_path / "tune", mamba2, shape, [trial(mamba2, shape, RD, config, 8, 0.1)])
    strict = replaygen.plan.validate_config

    def stricter(kind, shape, candidate):
        if kind is RD and candidate.block_v == 32:
            raise UnsupportedShapeError("replay_decode: block_v=32 is not allowed any more")
        strict(kind, shape, candidate)

    monkeypatch.setattr(replaygen.plan, "validate_config", stricter)
    with pytest.raises(TuningRecordError, match=r"its config is no longer valid \(replay_decode: block_v=32 is not allowed"):
        resolve_configs(mamba2, shape, "h100", tmp_path / "tune")


def test_build_of_a_corrupt_record_names_it(mamba2, tmp_path):
    shape = mamba2.shape("nemotron-h")
    path = write(tmp_path / "tune", mamba2, shape, [trial(mamba2, shape, BD, KernelConfig(block_v=8), 8, 0.1)])
    path.write_text("{")
    with pytest.raises(TuningRecordError, match=str(path)):
        build_spec(mamba2, (shape,), "h100", tmp_path / "gen", tune_dir=tmp_path / "tune", allow_default=True)


# --- the search loop ---------------------------------------------------------------------------


def fake_ms(config: KernelConfig) -> float:
    """A smooth landscape: best at block_v=32, 4 warps, 1 stage, flush_at=L, output_only."""
    ms = 1.0 + 0.1 * abs(config.block_v.bit_length() - 6) + 0.05 * abs(config.num_warps.bit_length() - 3) + 0.01 * (config.num_stages - 1)
    ms += 0.02 * (16 - config.flush_at) if config.flush_at else 0.0
    return ms + (0.03 if config.route is Route.STATE_AND_OUTPUT else 0.0)


WRONG = KernelConfig(block_v=32, num_warps=4, num_stages=1)  # would be the fastest baseline
RAISES = KernelConfig(block_v=64, num_warps=4, num_stages=1)


class FakeGPU:
    """Fake checker and timer: WRONG disagrees with the reference, RAISES fails to compile."""

    def __init__(self):
        self.timed = []
        self.checked = []

    def checker(self, module, candidate):
        self.checked.append(candidate.config)
        if candidate.config == RAISES:
            raise RuntimeError("compile error: out of registers\n  at line 3")
        return CheckResult(candidate.config != WRONG, "replay_decode max rel err 1e+00 FAIL")

    def timer(self, module, candidate, batch):
        self.timed.append((candidate.config, batch))
        ms = fake_ms(candidate.config) * batch
        return TrialTiming(ms, ms, ms, 20)

    def health(self):
        pass

    def evaluator(self, shape=None):
        return Evaluator(checker=self.checker, timer=self.timer, loader=lambda candidate: types.SimpleNamespace(), health=self.health)


def run(mamba2, tmp_path, kinds, batches, *, trials=12, mode=Mode.OPTUNA, fixed=(), fake=None, seed=0, storage=None, warm=None, retime=False, recorded=1):
    shape = mamba2.shape("nemotron-h")
    fake = fake or FakeGPU()
    store = RecordStore(record_path(tmp_path, "h100", mamba2, shape), spec="mamba2", shape=shape.name, gpu="h100")
    settings = TuneSettings(trials=trials, mode=mode, journal=tmp_path / "h100" / "optuna.journal", seed=seed, storage=storage, retime=retime, recorded=recorded)
    results = tune(
        plan_tasks(mamba2, (shape,), kinds, batches, fixed),
        evaluator_for=fake.evaluator,
        store_for=lambda s: store,
        environment=env(),
        settings=settings,
        progress=Progress(),
        warm=warm,
    )
    return results, store, fake


def test_optuna_search_records_every_trial_and_failures_never_win(mamba2, tmp_path):
    results, store, fake = run(mamba2, tmp_path, (BD,), (8,), trials=100)
    (result,) = results
    assert result.mode is Mode.OPTUNA and result.study.startswith("replaygen:mamba2:nemotron-h:baseline_decode:b8:h100:")
    assert result.measured == result.trials == 30  # stopped once all 30 candidates were seen
    assert result.measured == len(store.trials) == len(fake.timed) + sum(t.status is not TrialStatus.OK for t in store.trials)
    assert result.default.config == derive_space(BD, mamba2.shape("nemotron-h"), 8).default  # enqueued first
    by_config = {t.config: t for t in store.trials}
    assert store.trials[0].config == result.default.config
    assert by_config[WRONG].status is TrialStatus.WRONG and by_config[WRONG].timing is None and "FAIL" in by_config[WRONG].error
    assert by_config[RAISES].status is TrialStatus.FAILED and by_config[RAISES].error.startswith("RuntimeError: compile error: out of registers at line 3")
    assert result.best.config not in (WRONG, RAISES) and result.best.status is TrialStatus.OK
    assert result.best.value == min(t.value for t in store.trials)
    on_disk = read_records(store.path)
    assert on_disk.trials == store.trials  # written as they ended


def test_resume_continues_the_study(mamba2, tmp_path):
    first, store, _ = run(mamba2, tmp_path, (RD,), (32,), trials=6)
    assert first[0].trials == 6
    again, store, fake = run(mamba2, tmp_path, (RD,), (32,), trials=10)
    assert again[0].study == first[0].study
    assert again[0].trials == 10 and again[0].measured <= 4 and len(fake.timed) <= 4
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "h100" / "optuna.journal")))
    study = optuna.load_study(study_name=first[0].study, storage=storage)
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len({tuple(sorted(t.params.items())) for t in complete}) == 10  # repeated proposals are told, not counted
    assert len(read_records(store.path).trials) == len({(t.config, t.batch) for t in store.trials})
    assert again[0].best.value <= first[0].best.value
    changed_space, _, _ = run(mamba2, tmp_path, (RD,), (32,), trials=2, fixed=(("route", "output_only"),))
    assert changed_space[0].study != first[0].study  # a changed space starts a fresh study


def test_any_storage_url(mamba2, tmp_path):
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    first, _, _ = run(mamba2, tmp_path, (BD,), (8,), trials=3, storage=url)
    again, _, _ = run(mamba2, tmp_path, (BD,), (8,), trials=5, storage=url)
    assert again[0].trials == 5 and again[0].study == first[0].study
    assert optuna.load_study(study_name=first[0].study, storage=url).trials and not (tmp_path / "h100" / "optuna.journal").exists()


def test_a_trial_left_running_by_a_killed_run_does_not_hide_the_default(mamba2, tmp_path):
    shape = mamba2.shape("nemotron-h")
    (task,) = plan_tasks(mamba2, (shape,), (BD,), (8,))
    store = RecordStore(record_path(tmp_path, "h100", mamba2, shape), spec="mamba2", shape=shape.name, gpu="h100")
    settings = TuneSettings(trials=3, journal=tmp_path / "h100" / "optuna.journal")
    name = Tuner(shape=shape, evaluator=FakeGPU().evaluator(), store=store, environment=env(), settings=settings, progress=Progress()).study_name(task)
    study = optuna.create_study(study_name=name, storage=make_storage(settings))
    study.enqueue_trial(encode_params(task.space, task.space.default))
    assert study.ask(distributions(task.space)).params == encode_params(task.space, task.space.default)  # then killed
    results, _, _ = run(mamba2, tmp_path, (BD,), (8,), trials=3)
    assert results[0].default is not None and results[0].default.config == task.space.default


def test_exhaustive_mode_and_optuna_on_an_enumerable_space(mamba2, tmp_path):
    fixed = (("flush_at", "16"), ("route", "output_only"), ("max_registers", "0"), ("precompute_scores", "False"), ("fused_flush", "True"),
             ("prefetch_ring", "True"), ("fold_chunk", "4"), ("fold_dot", "False"), ("evict_state", "False"),
             ("overlap_scores", "False"), ("align_flushes", "False"), ("flush_groups", "1"), ("early_launch", "False"),
             ("prefetch_fold_keys", "False"), ("num_stages", "1"), ("fold_precision", "tf32x3"), ("block_k", "0"))
    exhaustive, store, _ = run(mamba2, tmp_path / "ex", (RD,), (128,), mode=Mode.EXHAUSTIVE, fixed=fixed)
    space = derive_space(RD, mamba2.shape("nemotron-h"), 128)
    for name, value in fixed:
        space = space.fix(name, value)
    (ex,) = exhaustive
    assert ex.trials == ex.measured == len(space.candidates()) == 16 - ex.pruned
    assert ex.best.config == KernelConfig(block_v=32, num_warps=4, num_stages=1, flush_at=16)
    assert ex.best.value == min(fake_ms(c) * 128 for c in space.candidates())
    assert {t.study for t in store.trials} == {"exhaustive"}
    optuna_results, _, _ = run(mamba2, tmp_path / "opt", (RD,), (128,), trials=8, fixed=fixed)
    (opt,) = optuna_results
    assert opt.trials == 8 and opt.measured <= 8 and opt.best.value >= ex.best.value
    rows = summary_rows([ex, opt])
    assert [r.mode for r in rows] == ["exhaustive", "optuna"] and rows[0].trials == ex.trials


def test_exhaustive_searches_tell_the_warmer_every_candidate_before_the_first(mamba2, tmp_path):
    fake, told = FakeGPU(), []
    warm = lambda searches: told.append(([(task.kind, task.batch, list(configs)) for task, configs in searches], len(fake.timed)))  # noqa: E731
    fixed = (("evict_state", "False"),)
    results, store, _ = run(mamba2, tmp_path, (BD,), (8, 32), mode=Mode.EXHAUSTIVE, fixed=fixed, fake=fake, warm=warm)
    space = derive_space(BD, mamba2.shape("nemotron-h"), 8).fix("evict_state", "False")
    ((searches, timed_before),) = told
    assert timed_before == 0 and [(kind, batch) for kind, batch, _ in searches] == [(BD, 8), (BD, 32)]
    assert searches[0][2] == list(space.candidates())
    timed = [c for c, b in fake.timed if b == 8]
    assert timed == [c for c in space.candidates() if c in timed] and len(timed) >= len(space.candidates()) - 2  # in the order told
    run(mamba2, tmp_path, (BD,), (8, 32, 128), mode=Mode.EXHAUSTIVE, fixed=fixed, fake=FakeGPU(), warm=warm)
    searches = told[1][0]
    assert [len(configs) for _, _, configs in searches] == [1, 1, len(space.candidates())]  # the raiser is tried again
    run(mamba2, tmp_path / "optuna", (BD,), (8,), trials=3, warm=warm)
    assert len(told) == 2  # Optuna proposes one config at a time: nothing to compile ahead


def test_recorded_searches_tell_the_warmer_only_what_they_will_time(mamba2, tmp_path):
    run(mamba2, tmp_path, (BD,), (8, 32), mode=Mode.EXHAUSTIVE, fixed=(("evict_state", "False"),))
    told = []
    warm = lambda searches: told.append([list(configs) for _, configs in searches])  # noqa: E731
    run(mamba2, tmp_path, (BD,), (8, 32), mode=Mode.RECORDED, recorded=2, warm=warm)
    assert not told  # every recorded config's trial is known: nothing to compile
    _, _, fake = run(mamba2, tmp_path, (BD,), (8, 32), mode=Mode.RECORDED, recorded=2, retime=True, warm=warm)
    ((per_search),) = told
    assert [len(configs) for configs in per_search] == [2, 2]
    assert [c for c, _ in fake.timed] == [c for configs in per_search for c in configs]


def test_the_warmer_leaves_configs_that_do_not_render_to_the_search(mamba2, monkeypatch):
    from replaygen.tune import warm

    started = []
    monkeypatch.setattr(warm, "CompileRun", lambda jobs, workers: started.append(jobs))
    shape = mamba2.shape("nemotron-h")
    (task,) = plan_tasks(mamba2, (shape,), (BD,), (8,))
    good = KernelConfig(block_v=16, num_warps=4)
    warmer = warm.CacheWarmer(architecture("sm_90"), "bfloat16", workers=2)
    warmer([(task, (KernelConfig(block_v=24), good)), (task, ())])
    assert [job.plan.configs[BD][0].config for job in started[0]] == [good]
    assert all(job.kinds == (BD,) and job.arch.name == "sm_90" for job in started[0])


def test_the_cache_warmer_compiles_for_the_tuning_gpu(capsys):
    from replaygen.tune.run import cache_warmer

    warmer = cache_warmer("9.0", "bfloat16")
    assert warmer.arch.name == "sm_90" and warmer.workers >= 1
    assert cache_warmer("9.0", "bfloat16", 3).workers == 3 and cache_warmer("9.0", "bfloat16", 0) is None
    assert cache_warmer("8.7", "bfloat16") is None
    assert "candidates compile one at a time: unknown architecture '8.7'" in capsys.readouterr().err


def test_a_rerun_reuses_recorded_outcomes_and_retries_failures(mamba2, tmp_path):
    fixed = (("evict_state", "False"),)
    first, store, _ = run(mamba2, tmp_path, (BD,), (8,), mode=Mode.EXHAUSTIVE, fixed=fixed)
    assert first[0].measured == 15
    again, store, fake = run(mamba2, tmp_path, (BD,), (8,), mode=Mode.EXHAUSTIVE, fixed=fixed)
    assert again[0].measured == 1 and fake.checked == [RAISES]  # WRONG is taken as recorded, the compile error tried again
    assert again[0].best == first[0].best and len(store.trials) == 16


def test_retime_measures_known_code_again_and_the_latest_timing_counts(mamba2, tmp_path):
    fixed = (("evict_state", "False"),)
    first, store, _ = run(mamba2, tmp_path, (BD,), (8,), mode=Mode.EXHAUSTIVE, fixed=fixed)
    winner = first[0].best.config

    class WinnerSlowedDown(FakeGPU):
        def timer(self, module, candidate, batch):
            timing = super().timer(module, candidate, batch)
            return TrialTiming(*(10 * t for t in (timing.median_ms, timing.p20_ms, timing.p80_ms)), 20) if candidate.config == winner else timing

    again, store, fake = run(mamba2, tmp_path, (BD,), (8,), mode=Mode.EXHAUSTIVE, fixed=fixed, fake=WinnerSlowedDown(), retime=True)
    assert again[0].measured == 15 and len(fake.checked) == 15 and len(store.trials) == 30  # every candidate, WRONG included
    assert again[0].best.config != winner
    latest = latest_trials(read_records(store.path).trials)
    assert len(latest) == 15 and {t.id for t in latest} == {t.id for t in store.trials[15:]}
    assert resolve_configs(mamba2, mamba2.shape("nemotron-h"), "h100", tmp_path, allow_default=True).configs[BD] == dispatch_table({8: again[0].best.config})


def test_a_tiny_space_ends_when_exhausted(mamba2, tmp_path):
    fixed = (("block_v", "16"), ("evict_state", "False"))
    results, store, fake = run(mamba2, tmp_path, (BD,), (1,), trials=50, fixed=fixed)
    assert results[0].measured == len(derive_space(BD, mamba2.shape("nemotron-h"), 1).fix("block_v", "16").fix("evict_state", "False").candidates()) == 4
    assert len(fake.timed) == 4 and results[0].trials == 4  # the space is exhausted before 50


def test_summary_speedups(mamba2, tmp_path):
    results, _, _ = run(mamba2, tmp_path, (BD, RD), (8,), trials=8)
    base, replay = summary_rows(results)
    assert base.vs_baseline is None and replay.vs_baseline == pytest.approx(results[0].best.value / results[1].best.value)
    assert replay.vs_default == pytest.approx(results[1].default.value / results[1].best.value) and replay.vs_default >= 1
    text = format_summary([base, replay])
    assert "vs baseline" in text and f"{replay.vs_baseline:.3f}x" in text


def test_a_trial_line_names_the_key_tiles_and_the_fold_operands(mamba2):
    """The key-tiled structures differ from the whole-key kernels by block_k, num_stages and the fold's operands: a
    progress line that drops them shows two different kernels as the same config."""
    shape = mamba2.shape("nemotron-h-mtp")
    state_route, readout_product, output_only, in_loop, flush_launch = replay_verify_structures(shape, spec_traits(mamba2, shape))
    tiled = describe(state_route, RV)
    assert f"bk={state_route.block_k}" in tiled and f"stages={state_route.num_stages}" in tiled
    assert f"dot {state_route.fold_precision}" in tiled
    assert "bk=" not in describe(replace(output_only, block_k=0), RV) and "stages=2" in describe(output_only, RV)
    assert "readout-dot key_buffer" in describe(readout_product, RV)
    assert "scores" not in describe(in_loop, RV) and "flush-launch" not in describe(in_loop, RV)
    assert describe(flush_launch, RV) == describe(in_loop, RV).replace(" readout-dot", " flush-launch readout-dot")


# --- the evaluator -----------------------------------------------------------------------------


def test_evaluator_statuses(mamba2):
    candidate = render_candidate(mamba2, SHAPE, RD, KernelConfig(block_v=16, flush_at=2))
    calls = []

    def checker(module, c):
        calls.append(c)
        return CheckResult(True, "")

    def oom(module, c, batch):
        raise torch.OutOfMemoryError("CUDA out of memory")

    evaluator = Evaluator(checker=checker, timer=lambda m, c, b: TrialTiming(1.0, 1.0, 1.0, 3), loader=lambda c: None)
    assert evaluator.evaluate(candidate, 1).status is TrialStatus.OK
    assert evaluator.evaluate(candidate, 8).status is TrialStatus.OK and len(calls) == 1  # checked once per module
    assert Evaluator(checker=checker, timer=oom, loader=lambda c: None).evaluate(candidate, 1).status is TrialStatus.OUT_OF_RESOURCES
    from triton.runtime.errors import OutOfResources

    def shared(module, c, batch):
        raise OutOfResources(300000, 232448, "shared memory")

    assert Evaluator(checker=checker, timer=shared, loader=lambda c: None).evaluate(candidate, 1).status is TrialStatus.OUT_OF_RESOURCES

    def dead():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    broken = Evaluator(checker=checker, timer=lambda m, c, b: 1 / 0, loader=lambda c: None, health=dead)
    lost = broken.evaluate(candidate, 1)
    assert lost.status is TrialStatus.CRASHED and lost.device_lost and "illegal memory access" in lost.error


def test_a_crash_stops_the_tune_and_is_never_retried(mamba2, tmp_path):
    crash = KernelConfig(block_v=16, num_warps=8)

    class Crashing(FakeGPU):
        lost = False

        def timer(self, module, candidate, batch):
            if candidate.config == crash:
                self.lost = True
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().timer(module, candidate, batch)

        def health(self):
            if self.lost:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(TuneAborted, match="recorded as crashed"):
        run(mamba2, tmp_path, (BD,), (8,), mode=Mode.EXHAUSTIVE, fake=Crashing())
    crashed = [t for t in read_records(record_path(tmp_path, "h100", mamba2, mamba2.shape("nemotron-h"))).trials if t.status is TrialStatus.CRASHED]
    assert [t.config for t in crashed] == [crash]
    again, _, fake = run(mamba2, tmp_path, (BD,), (8,), mode=Mode.EXHAUSTIVE, fake=Crashing())
    assert crash not in fake.checked and not fake.lost and again[0].best is not None
    retimed, _, fake = run(mamba2, tmp_path, (BD,), (8,), mode=Mode.EXHAUSTIVE, fake=Crashing(), retime=True)
    assert crash not in fake.checked and not fake.lost and retimed[0].measured == len(fake.checked) > 0


def test_reference_checker_on_a_real_candidate(mamba2):
    shape = replace(SHAPE, capacity=4, window=2)
    checker = ReferenceChecker(mamba2, shape, "cpu", torch.float32)
    evaluator = Evaluator(checker=checker, timer=lambda m, c, b: TrialTiming(1.0, 1.0, 1.0, 3))
    for kind, config in ((RD, KernelConfig(block_v=16, num_warps=2, flush_at=3, route=Route.STATE_AND_OUTPUT)), (RV, KernelConfig(block_v=16))):
        outcome = evaluator.evaluate(render_candidate(mamba2, shape, kind, config), 4)
        assert outcome.status is TrialStatus.OK, outcome.error


def test_reference_checker_catches_a_wrong_kernel(mamba2):
    """A replay kernel that appends to the wrong ring position is recorded WRONG and never timed."""
    shape = replace(SHAPE, capacity=4, window=2)
    candidate = render_candidate(mamba2, shape, RD, KernelConfig(block_v=16, flush_at=4))
    correct = "r_new = ((start + count).to(tl.uint32) % RING)"
    assert correct in candidate.source
    broken = replace(candidate, source=candidate.source.replace(correct, "r_new = ((start + count + 1).to(tl.uint32) % RING)"))
    timed = []
    evaluator = Evaluator(checker=ReferenceChecker(mamba2, shape, "cpu", torch.float32), timer=lambda m, c, b: timed.append(c) or TrialTiming(1.0, 1.0, 1.0, 3))
    outcome = evaluator.evaluate(broken, 4)
    assert outcome.status is TrialStatus.WRONG and "replay_decode" in outcome.error and not timed


def test_reference_checker_runs_verify_through_its_flushes(mamba2):
    """A verify kernel that drops its flush's state store is recorded WRONG: with every draft accepted, the check runs
    until each sequence has flushed. At the -mtp shapes' capacity and window, the few windows of random acceptance
    the check also runs never flush, and pass this kernel."""
    shape = replace(SHAPE, capacity=28, window=4)
    candidate = render_candidate(mamba2, shape, RV, KernelConfig(block_v=16))
    store = "mask=m_s & flush, eviction_policy"
    assert candidate.source.count(store) == 2 and candidate.source.index(store) < candidate.source.index("def _replay_verify_key_tiles_kernel(")
    broken = replace(candidate, source=candidate.source.replace(store, "mask=m_s & flush & (b_s != b_s), eviction_policy", 1))  # the whole-key kernel's
    timed = []
    evaluator = Evaluator(checker=ReferenceChecker(mamba2, shape, "cpu", torch.float32), timer=lambda m, c, b: timed.append(c) or TrialTiming(1.0, 1.0, 1.0, 3))
    outcome = evaluator.evaluate(broken, 4)
    assert outcome.status is TrialStatus.WRONG and "accept=all" in outcome.error and not timed


def test_workload_timer_times_the_candidate_as_bench_does(mamba2, monkeypatch):
    calls = []
    t = Timing(median_ms=1.0, p20_ms=0.9, p80_ms=1.1, samples=5)
    monkeypatch.setattr(measure, "l2_bytes", lambda device: 1 << 12)
    monkeypatch.setattr(measure.DecodeWorkload, "time_baseline", lambda self, steps, repeats=20: calls.append((self.module, "base", steps)) or t)
    monkeypatch.setattr(measure.DecodeWorkload, "time_replay", lambda self, route, flush_at, repeats=20: calls.append((self.module, route, flush_at)) or t)
    monkeypatch.setattr(measure.VerifyWorkload, "time_replay", lambda self, accept, steps, repeats=20: calls.append((self.module, "verify", accept, steps)) or t)
    shape = replace(SHAPE, capacity=8, window=2)
    timer = WorkloadTimer(mamba2, shape, "cpu", torch.float32, repeats=5, with_verify_baseline=False)
    real = load_kernels(mamba2, shape)  # two candidates' modules: the workloads allocate with the first, then swap
    module_a, module_b = types.ModuleType("a"), types.ModuleType("b")
    for module in (module_a, module_b):
        module.__dict__.update({n: getattr(real, n) for n in ("allocate", "allocate_baseline", "allocate_snapshots")})
    replay = render_candidate(mamba2, shape, RD, KernelConfig(block_v=16, flush_at=5, route=Route.STATE_AND_OUTPUT))
    assert timer(module_a, replay, 2) == TrialTiming(1.0, 0.9, 1.1, 5)
    timer(module_b, render_candidate(mamba2, shape, BD, KernelConfig(block_v=16)), 2)
    timer(module_a, render_candidate(mamba2, shape, RV, KernelConfig(block_v=16)), 2)
    assert calls == [(module_a, "state_and_output", 5), (module_b, "base", 8), (module_a, "verify", "all", 3)]  # one flush cycle: h = 2, 4, 6


# --- command line ------------------------------------------------------------------------------


def test_tune_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["tune", str(ROOT / "specs" / "mamba2.yaml"), "--shape", "nemotron-h"]) == 2
    assert "tune needs a CUDA GPU" in capsys.readouterr().err


def test_tune_command_end_to_end_on_a_fake_gpu(tmp_path, monkeypatch, capsys):
    """CLI -> run_tune -> driver -> records -> summary -> build, with the device and the evaluator faked."""
    from replaygen.tune import run as tune_run

    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props.name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(tune_run, "gpu_evaluator", lambda spec, shape, device, dtype, kinds: FakeGPU().evaluator())
    spec_file = str(ROOT / "specs" / "mamba2.yaml")
    out = tmp_path / "records"
    args = ["tune", spec_file, "--shape", "nemotron-h", "--kernels", "baseline_decode,replay_decode", "--batch", "1,64", "--trials", "4", "--out", str(out)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "[4/4] nemotron-h replay_decode b=64 #4/4" in captured.err
    assert "vs baseline" in captured.out and f"records: {out}/h100/mamba2_nemotron_h.json" in captured.out
    saved = read_records(out / "h100" / "mamba2_nemotron_h.json")
    assert {t.environment.device_name for t in saved.trials} == {props.name} and {t.batch for t in saved.trials} == {1, 64}
    assert (out / "h100" / "optuna.journal").is_file()
    assert main(["build", spec_file, "--shape", "nemotron-h", "--gpu", "h100", "--out", str(tmp_path / "gen"), "--tune-dir", str(out)]) == 0
    built = capsys.readouterr().out
    assert "baseline_decode: tuned (b1 " in built and "replay_decode: tuned (b1 " in built
    assert main(["tune", spec_file, "--kernels", "commit"]) == 2
    assert "--kernels takes" in capsys.readouterr().err
    assert main(["tune", spec_file, "--exhaustive", "--compile-workers", "-1"]) == 2
    assert "--compile-workers must be at least 0, got -1" in capsys.readouterr().err
    assert main(["tune", spec_file, "--retime"]) == 2
    assert "--retime needs --exhaustive or --recorded" in capsys.readouterr().err
    assert main(["tune", spec_file, "--recorded", "2", "--exhaustive"]) == 2
    assert "--recorded and --exhaustive exclude each other" in capsys.readouterr().err
    assert main(["tune", spec_file, "--recorded", "-1"]) == 2
    assert "--recorded must be at least 0, got -1" in capsys.readouterr().err
    args = ["tune", spec_file, "--shape", "nemotron-h", "--kernels", "replay_decode", "--batch", "1,64", "--recorded", "1", "--compile-workers", "0", "--out", str(out)]
    assert main(args) == 0
    assert "the 1 fastest recorded configs each, timed again" in capsys.readouterr().out
    args = ["tune", spec_file, "--shape", "nemotron-h-tp2", "--kernels", "replay_decode", "--batch", "64", "--recorded", "1", "--recorded-from", "nemotron-h",
            "--compile-workers", "0", "--out", str(out)]
    assert main(args) == 0
    assert "the 1 fastest recorded configs each of nemotron-h at the same batch and the batch of equal work, timed at each shape" in capsys.readouterr().out
    assert read_records(out / "h100" / "mamba2_nemotron_h_tp2.json").trials
    assert main(["tune", spec_file, "--recorded-from", "nemotron-h"]) == 2
    assert "--recorded-from needs --recorded K" in capsys.readouterr().err
    assert main(["tune", spec_file, "--recorded", "1", "--recorded-from", "nemotron-x", "--out", str(out)]) == 2
    assert "--recorded-from nemotron-x: " in capsys.readouterr().err
    assert main(["tune", spec_file, "--recorded", "1", "--recorded-from", "nemotron-h-l8", "--out", str(out)]) == 2
    assert "--recorded-from nemotron-h-l8: no records of nemotron-h-l8 at" in capsys.readouterr().err
    args = ["tune", spec_file, "--shape", "nemotron-h", "--kernels", "replay_decode", "--batch", "64", "--recorded", "1", "--recorded-gpu", "h100",
            "--gpu", "h200", "--compile-workers", "0", "--out", str(out)]
    assert main(args) == 0
    assert "the 1 fastest recorded configs each on h100 at the same batch, timed at each shape" in capsys.readouterr().out
    assert {t.environment.gpu for t in read_records(out / "h200" / "mamba2_nemotron_h.json").trials} == {"h200"}
    assert main(["tune", spec_file, "--recorded-gpu", "h100"]) == 2
    assert "--recorded-gpu needs --recorded K" in capsys.readouterr().err
    assert main(["tune", spec_file, "--recorded", "1", "--recorded-gpu", "h 100", "--out", str(out)]) == 2
    assert "--recorded-gpu 'h 100' must be letters" in capsys.readouterr().err
    assert main(["tune", spec_file, "--shape", "nemotron-h", "--shape", "nemotron-h-l8", "--recorded", "1", "--recorded-gpu", "h100", "--gpu", "h200", "--out", str(out)]) == 2
    assert "--recorded-gpu h100: no records of nemotron-h-l8 at" in capsys.readouterr().err
    assert main(["tune", spec_file, "--shape", "nemotron-h", "--kernels", "baseline_decode", "--fix", "flush_at=3", "--out", str(out)]) == 2
    assert "--fix flush_at=3" in capsys.readouterr().err


def test_gpu_names():
    assert gpu_name_of("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_name_of("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_name_of("NVIDIA H200") == "h200"
    with pytest.raises(Exception, match="--gpu"):
        gpu_name_of("NVIDIA GeForce RTX 4090")


def test_replay_search_starts_from_the_baselines_step_in_its_best_launch_shape(mamba2, tmp_path):
    """After the baseline's search at a batch, replay decode enqueues flush_at=1 (the baseline's step on the checkpoint)
    in the baseline winner's block_v, warps and state eviction policy, then with the other policy, with the one-entry
    fold loop, right after its default and the kernel structures. Searched alone, from no records, it starts from
    the baseline's documented launch shape instead."""
    shape = mamba2.shape("nemotron-h")
    structures = [replace(c, flush_at=c.flush_at or shape.capacity) for c in replay_decode_structures(shape, spec_traits(mamba2, shape))]
    results, store, _ = run(mamba2, tmp_path, (BD, RD), (8,), trials=8)
    base, replay = results
    replay_trials = [t.config for t in store.trials if t.key.kind is RD]
    others = [c for c in structures if c != replay.default.config]
    best = base.best.config
    seed = KernelConfig(block_v=best.block_v, num_warps=best.num_warps, flush_at=1, fold_chunk=1, evict_state=best.evict_state)
    assert replay_trials[: 3 + len(others)] == [replay.default.config, *others, seed, replace(seed, evict_state=not best.evict_state)]
    alone, store_alone, _ = run(mamba2, tmp_path / "alone", (RD,), (8,), trials=8)
    default = default_config(BD, shape, 8)
    seed = KernelConfig(block_v=default.block_v, num_warps=default.num_warps, flush_at=1, fold_chunk=1, evict_state=default.evict_state)
    assert [t.config for t in store_alone.trials][1 + len(others) : 3 + len(others)] == [seed, replace(seed, evict_state=not default.evict_state)]


@pytest.mark.parametrize("batch", [1, 32])
def test_replay_search_starts_from_every_kernel_structure(mamba2, tmp_path, batch):
    """At every batch size, replay decode times the documented default, then each kernel structure the default is not
    (configs.replay_decode_structures: the key-tiled state route, the key-tiled output-only route, the whole-key
    output-only step), before the sampler proposes anything."""
    shape = mamba2.shape("nemotron-h")
    structures = [replace(c, flush_at=c.flush_at or shape.capacity) for c in replay_decode_structures(shape, spec_traits(mamba2, shape))]
    assert len(structures) == 3 and {c.block_k for c in structures} == {0, 64} and structures[0].route is Route.STATE_AND_OUTPUT
    results, store, _ = run(mamba2, tmp_path, (RD,), (batch,), trials=6)
    (replay,) = results
    replay_trials = [t.config for t in store.trials if t.key.kind is RD]
    assert replay_trials[0] == replay.default.config
    others = [c for c in structures if c != replay.default.config]  # the default is one of them: enqueued once
    assert replay_trials[1 : 1 + len(others)] == others and len(others) == (2 if batch > 8 else 3)


def test_a_fixed_parameter_is_set_in_the_structures_a_search_starts_from(mamba2, tmp_path):
    """--fix block_k=32 keeps the key-tiled structures as starting points, each with 32-column slices, instead of
    leaving the sampler to find a key-tiled config among pruned ones; a whole-key structure that the fix would give a
    key loop it does not pipeline (num_stages 1) is skipped."""
    shape = mamba2.shape("nemotron-h")
    structures = [replace(c, flush_at=c.flush_at or shape.capacity) for c in replay_decode_structures(shape, spec_traits(mamba2, shape))]
    results, store, _ = run(mamba2, tmp_path, (RD,), (32,), trials=4, fixed=(("block_k", "32"),))
    tiled = [replace(c, block_k=32) for c in structures if c.block_k]
    assert [t.config for t in store.trials][: len(tiled)] == tiled and len(tiled) == 2


@pytest.mark.parametrize("batch", [1, 32])
def test_every_search_also_starts_from_the_other_buckets_defaults(mamba2, tmp_path, batch):
    """Replay verify at a batch size times its own bucket's documented default, then its key-tiled structures, then
    the other buckets' defaults (the state route of batch 1, the output-only step of batch 2-8, the large batches'
    step), before the sampler proposes anything: a structure documented for one batch size is tried at every other."""
    shape = mamba2.shape("nemotron-h")
    traits = spec_traits(mamba2, shape)
    defaults = list(dict.fromkeys(default_config(RV, shape, b, traits) for b in BATCH_BUCKETS))
    structures = replay_verify_structures(shape, traits)
    assert len(defaults) == 3 and len(structures) == 5
    results, store, _ = run(mamba2, tmp_path, (RV,), (batch,), trials=8)
    (verify,) = results
    own = default_config(RV, shape, batch, traits)
    assert verify.default.config == own
    assert [t.config for t in store.trials if t.key.kind is RV][:8] == [own, *structures, *(c for c in defaults if c != own)]


def as_earlier_code(trials):
    """The trials as if timed on kernel code that has changed since (another kernel key)."""
    return [replace(t, id=uuid.uuid4().hex, key=replace(t.key, code=t.key.code[::-1])) for t in trials]


def test_recorded_mode_times_the_fastest_recorded_configs_of_earlier_code_again(mamba2, tmp_path):
    fixed = (("route", "output_only"), ("fused_flush", "True"), ("fold_dot", "False"), ("max_registers", "0"), ("precompute_scores", "False"),
             ("overlap_scores", "False"), ("fold_chunk", "1"), ("evict_state", "False"), ("num_warps", "4"), ("block_v", "32"))
    first, store, _ = run(mamba2, tmp_path / "old", (RD,), (8,), mode=Mode.EXHAUSTIVE, fixed=fixed)
    old = sorted((t for t in store.trials if math.isfinite(t.value)), key=rec.speed_rank)
    shape = mamba2.shape("nemotron-h")
    write(tmp_path / "new", mamba2, shape, as_earlier_code(store.trials))
    results, new_store, fake = run(mamba2, tmp_path / "new", (RD,), (8,), mode=Mode.RECORDED, recorded=2)
    assert [c for c, _ in fake.timed] == [old[0].config, old[1].config]  # the two fastest, nothing searched
    assert results[0].measured == 2 and results[0].best.config == old[0].config
    again, _, fake = run(mamba2, tmp_path / "new", (RD,), (8,), mode=Mode.RECORDED, recorded=2)
    assert again[0].measured == 0 and not fake.timed  # timed under this code already: taken from the records
    fixed, _, fake = run(mamba2, tmp_path / "new", (RD,), (8,), mode=Mode.RECORDED, recorded=1, fixed=(("evict_state", "True"),))
    assert [c for c, _ in fake.timed] == [replace(old[0].config, evict_state=True)]  # --fix sets its parameter in them


def test_recorded_mode_ranks_each_config_by_its_latest_trial(mamba2, tmp_path):
    """A config timed fast on old code and slower since must not be retimed in place of one that is faster now."""
    fixed = (("route", "output_only"), ("fused_flush", "True"), ("fold_dot", "False"), ("max_registers", "0"), ("precompute_scores", "False"),
             ("overlap_scores", "False"), ("fold_chunk", "1"), ("evict_state", "False"), ("num_warps", "4"), ("block_v", "32"))
    _, store, _ = run(mamba2, tmp_path / "old", (RD,), (8,), mode=Mode.EXHAUSTIVE, fixed=fixed)
    fastest, second = sorted((t for t in store.trials if math.isfinite(t.value)), key=rec.speed_rank)[:2]
    older = as_earlier_code([fastest, second])
    newer = [replace(fastest, id=uuid.uuid4().hex, key=replace(fastest.key, code="b" * 64), timing=replace(fastest.timing, median_ms=second.value * 2))]
    write(tmp_path / "new", mamba2, mamba2.shape("nemotron-h"), [*older, *newer])
    _, _, fake = run(mamba2, tmp_path / "new", (RD,), (8,), mode=Mode.RECORDED, recorded=1)
    assert [c for c, _ in fake.timed] == [second.config]


def tune_from(mamba2, tmp_path, source, shape, batches):
    """Recorded mode (2 configs per search) for `shape`'s replay decode from another shape's records `source`, on a
    fake GPU: (results, the shape's records, the fake)."""
    fake = FakeGPU()
    target = RecordStore(record_path(tmp_path, "h100", mamba2, shape), spec="mamba2", shape=shape.name, gpu="h100")
    results = tune(
        plan_tasks(mamba2, (shape,), (RD,), batches),
        evaluator_for=fake.evaluator,
        store_for=lambda s: target,
        environment=env(),
        settings=TuneSettings(mode=Mode.RECORDED, recorded=2),
        progress=Progress(),
        source_for=lambda s: source,
    )
    return results, target, fake


def test_recorded_mode_from_another_shape_times_its_winners_at_this_shape(mamba2, tmp_path):
    """--recorded-from: the fastest configs of a neighbour shape's records (those this shape's space does not hold
    left out), timed at this shape and written to this shape's records; the neighbour's records stay as they were."""
    fixed = (("route", "output_only"), ("fused_flush", "True"), ("fold_dot", "False"), ("max_registers", "0"), ("precompute_scores", "False"),
             ("overlap_scores", "False"), ("fold_chunk", "1"), ("evict_state", "False"), ("num_warps", "4"), ("flush_at", "16"))
    _, source, _ = run(mamba2, tmp_path, (RD,), (8,), mode=Mode.EXHAUSTIVE, fixed=fixed)
    source_trials = source.trials
    ranked = [t.config for t in sorted((t for t in source_trials if math.isfinite(t.value)), key=rec.speed_rank)]
    small = replace(mamba2.shape("nemotron-h-tp8"), value_dim=16)
    fits = [c for c in ranked if c.block_v <= 16][:2]
    assert fits != ranked[:2]  # the source's fastest include a block_v beyond this shape's value_dim
    results, target, fake = tune_from(mamba2, tmp_path, source, small, (8,))
    assert [c for c, _ in fake.timed] == fits and results[0].measured == 2
    assert [t.config for t in target.trials] == fits and source.trials == source_trials


def test_recorded_mode_from_another_shape_also_takes_the_batch_of_equal_work(mamba2, tmp_path):
    """--recorded-from a shape with 8x the heads: a search at batch 8 also times the neighbour's fastest configs at
    batch 1 (as many state values per step), ranked within that batch, after those of its own batch; a batch whose
    equal-work batch is not whole (4 -> 1/2) takes only its own."""
    full, split = mamba2.shape("nemotron-h"), mamba2.shape("nemotron-h-tp8")
    configs = [KernelConfig(block_v=bv, num_warps=w, flush_at=16) for bv in (16, 32) for w in (1, 2)]
    ms_b8 = dict(zip(configs, (4.0, 1.0, 3.0, 2.0)))
    ms_b1 = dict(zip(configs, (0.1, 0.4, 0.2, 0.3)))
    records = [trial(mamba2, full, RD, c, 8, ms) for c, ms in ms_b8.items()] + [trial(mamba2, full, RD, c, 1, ms) for c, ms in ms_b1.items()]
    records += [trial(mamba2, full, RD, c, 4, ms) for c, ms in ms_b8.items()]
    source = RecordStore(write(tmp_path, mamba2, full, records), spec="mamba2", shape=full.name, gpu="h100")
    _, _, fake = tune_from(mamba2, tmp_path, source, split, (8, 4))
    b8, b4 = [c for c, b in fake.timed if b == 8], [c for c, b in fake.timed if b == 4]
    assert b8 == [configs[1], configs[3], configs[0], configs[2]]
    assert b4 == [configs[1], configs[3]]


def test_recorded_mode_from_another_gpu_times_its_winners_on_this_one(mamba2, tmp_path):
    """--recorded-gpu: the fastest configs of another GPU's records of the shape, of those made with this Triton and
    replaygen (a faster trial made with another Triton left out), timed on this GPU and written to its records."""
    shape = mamba2.shape("nemotron-h")
    configs = [KernelConfig(block_v=bv, num_warps=w, flush_at=16) for bv in (16, 32) for w in (1, 2)]
    records = [trial(mamba2, shape, RD, c, 8, ms) for c, ms in zip(configs, (4.0, 1.0, 3.0, 2.0))]
    other_triton = KernelConfig(block_v=64, num_warps=1, flush_at=16)
    records.append(trial(mamba2, shape, RD, other_triton, 8, 0.5, environment=env(triton="0.0.1")))
    source = RecordStore(write(tmp_path, mamba2, shape, records), spec="mamba2", shape=shape.name, gpu="h100")
    fake = FakeGPU()
    target = RecordStore(record_path(tmp_path, "h200", mamba2, shape), spec="mamba2", shape=shape.name, gpu="h200")
    results = tune(
        plan_tasks(mamba2, (shape,), (RD,), (8,)),
        evaluator_for=fake.evaluator,
        store_for=lambda s: target,
        environment=env(gpu="h200", device_name="NVIDIA H200"),
        settings=TuneSettings(mode=Mode.RECORDED, recorded=2),
        progress=Progress(),
        source_for=lambda s: source,
    )
    assert [c for c, _ in fake.timed] == [configs[1], configs[3]] and results[0].measured == 2
    assert [(t.config, t.environment.gpu) for t in target.trials] == [(configs[1], "h200"), (configs[3], "h200")]
    assert source.trials == tuple(records)


def test_recorded_mode_without_records_times_nothing(mamba2, tmp_path, caplog):
    told = []
    results, store, fake = run(mamba2, tmp_path, (RD,), (8,), mode=Mode.RECORDED, recorded=3, warm=told.append)
    assert not fake.timed and not told and results[0].best is None and not store.trials
    assert "no passing trial" in caplog.text


def test_kinds_with_the_same_module_are_measured_separately(mamba2, tmp_path):
    """A candidate renders every other kernel with its default, so the baseline-decode default and the baseline-verify
    default are the same module: each kind's trial must still be timed, not taken from the other's."""
    shape = mamba2.shape("nemotron-h")
    default = derive_space(BD, shape, 8).default
    assert render_candidate(mamba2, shape, BD, default).source == render_candidate(mamba2, shape, BV, derive_space(BV, shape, 8).default).source
    results, store, fake = run(mamba2, tmp_path, (BD, BV), (8,), trials=2)
    assert [(t.key.kind, t.config) for t in store.trials][:1] == [(BD, default)]
    assert (BV, default) in [(t.key.kind, t.config) for t in store.trials]
    assert [c for c, _ in fake.timed].count(default) == 2


def test_trials_left_out_are_summed_per_reason():
    """The build names the trials it leaves out in one line per reason, with the count of all of them and the
    distinct details."""
    skipped = Counter({(Mismatch.CODE, "decode changed"): 2, (Mismatch.CODE, "_replay_decode_kernel changed"): 1, (Mismatch.GPU, "'h200'"): 3})
    assert skipped_lines(skipped) == [
        "3 trial(s) not applied: the code it ran has changed since (2 distinct, e.g. _replay_decode_kernel changed)",
        "3 trial(s) not applied: made for another GPU ('h200')",
    ]
