"""Code generation: deterministic, self-contained, provenance-stamped, committed modules up to date."""

import ast
import json
import os
from dataclasses import replace

import pytest

from replaygen.build import build_spec
from replaygen.codegen import reachable_source, render_module, template_hash, write_if_changed
from replaygen.configs import BATCH_BUCKETS, STATE_TILE_KINDS, BucketConfig, KernelConfig, KernelKind, bucket_config, default_configs, module_defaults
from replaygen.errors import ReplaygenError, UnsupportedShapeError
from replaygen.plan import plan_module
from replaygen.spec import load_spec, load_spec_text

from conftest import ROOT, SMALL


def default_plan(spec, shape, gpu="h100"):
    return plan_module(spec, shape, gpu, module_defaults(spec, shape), "defaults")


def header(source: str) -> dict:
    lines = [line[2:] for line in source.splitlines()[1:] if line.startswith("# ")]
    end = lines.index("}") + 1
    return json.loads("\n".join(lines[:end]))


def test_rendering_is_deterministic(mamba2):
    plan = default_plan(mamba2, mamba2.shapes[0])
    assert render_module(plan) == render_module(default_plan(mamba2, mamba2.shapes[0]))


def test_generated_module_imports_only_torch_and_triton(mamba2):
    tree = ast.parse(render_module(default_plan(mamba2, mamba2.shapes[0])))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported == {"torch", "triton"}


def test_provenance_header(mamba2):
    source = render_module(default_plan(mamba2, mamba2.shapes[0]))
    info = header(source)
    assert info["spec"] == "mamba2"
    assert info["spec_sha256"] == mamba2.source_sha256
    assert info["template_sha256"] == template_hash()
    assert info["shape"]["name"] == "nemotron-h" and info["shape"]["heads"] == 128
    assert info["gpu"] == "h100"
    assert info["config_source"] == "defaults"
    assert "replay_decode" in info["configs"]
    assert info["replaygen_version"]


def test_config_changes_the_source(mamba2):
    shape = mamba2.shapes[0]
    configs = module_defaults(mamba2, shape)
    a = render_module(plan_module(mamba2, shape, "h100", configs, "defaults"))
    configs[KernelKind.BASELINE_DECODE] = (BucketConfig(None, KernelConfig(block_v=32, num_warps=8)),)
    b = render_module(plan_module(mamba2, shape, "h100", configs, "defaults"))
    assert a != b and "'block_v': 32, 'num_warps': 8" in b


def test_shape_is_baked_in(mamba2):
    source = render_module(default_plan(mamba2, SMALL))
    assert "HEADS = tl.constexpr(4)" in source and "KEY_DIM = tl.constexpr(16)" in source
    compile(source, "small.py", "exec")


def test_build_writes_then_reports_unchanged(mamba2, tmp_path):
    first = build_spec(mamba2, mamba2.shapes[:2], "h100", tmp_path, tune_dir=tmp_path / "tune", allow_default=True)
    assert all(m.written for m in first)
    assert (tmp_path / "h100" / "mamba2_nemotron_h.py").is_file()
    assert (tmp_path / "h100" / "__init__.py").is_file()
    second = build_spec(mamba2, mamba2.shapes[:2], "h100", tmp_path, tune_dir=tmp_path / "tune", allow_default=True)
    assert not any(m.written for m in second)


COMMITTED_GPUS = sorted(path.name for path in (ROOT / "generated").iterdir() if path.is_dir() and not path.name.startswith("_"))


@pytest.mark.parametrize("gpu", COMMITTED_GPUS)
@pytest.mark.parametrize("name", ["mamba2", "gdn"])
def test_committed_modules_are_current(name, gpu, tmp_path):
    """generated/<gpu> holds exactly what `replaygen build specs/<spec>.yaml --gpu <gpu> --allow-default` writes
    (the records of tune/<gpu> where they exist, the documented defaults elsewhere)."""
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    for module in build_spec(spec, spec.shapes, gpu, tmp_path, tune_dir=ROOT / "tune", allow_default=True):
        committed = ROOT / "generated" / gpu / module.path.name
        assert committed.is_file(), f"{committed} is missing: run replaygen build specs/{name}.yaml --gpu {gpu} --allow-default"
        assert committed.read_text() == module.path.read_text(), f"{committed} is stale: rebuild it"


def test_every_gpu_with_records_has_committed_modules():
    assert {path.name for path in (ROOT / "tune").iterdir() if path.is_dir()} <= set(COMMITTED_GPUS)


def test_bad_gpu_name(mamba2, tmp_path):
    with pytest.raises(ReplaygenError, match="--gpu"):
        build_spec(mamba2, mamba2.shapes[:1], "H100 SXM", tmp_path)


def test_state_tiles_are_never_replicated_across_warps(mamba2):
    """A program that loads and stores the state may run no more warps than its state tile fills: a replicated tile
    lets a late warp read what another stored. Defaults take fewer warps where key_dim is that small."""
    tiny = replace(SMALL, name="tiny", value_dim=4, key_dim=2)
    configs = module_defaults(mamba2, tiny)
    for kind in STATE_TILE_KINDS:
        for bucket in configs[kind]:
            assert 32 * bucket.config.num_warps <= max(32, bucket.config.block_v * 2), (kind, bucket)
    assert configs[KernelKind.BASELINE_DECODE][0].config.num_warps == 1  # 16 rows x 2 keys
    plan_module(mamba2, tiny, "h100", configs, "defaults")
    for kind in STATE_TILE_KINDS:
        bad = dict(configs)
        bad[kind] = (BucketConfig(None, KernelConfig(block_v=16, num_warps=2)),)
        with pytest.raises(UnsupportedShapeError, match=rf"{kind.value}: num_warps=2 is 64 threads for a state tile of 32 elements .*at most 1 warp"):
            plan_module(mamba2, tiny, "h100", bad, "defaults")
    shape = mamba2.shapes[0]
    assert [b.config.num_warps for b in module_defaults(mamba2, shape)[KernelKind.BASELINE_DECODE]] == [4]


def test_invalid_config_rejected_before_compile(mamba2):
    shape = mamba2.shapes[0]
    configs = module_defaults(mamba2, shape)
    configs[KernelKind.REPLAY_DECODE] = (BucketConfig(None, KernelConfig(block_v=24)),)
    with pytest.raises(UnsupportedShapeError, match="power of two"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.REPLAY_DECODE] = (BucketConfig(None, KernelConfig(block_v=16, flush_at=99)),)
    with pytest.raises(UnsupportedShapeError, match="flush_at"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.REPLAY_DECODE] = (BucketConfig(8, KernelConfig(block_v=16)),)
    with pytest.raises(UnsupportedShapeError, match="open-ended"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.REPLAY_DECODE] = default_configs(KernelKind.REPLAY_DECODE, shape)
    configs[KernelKind.REPLAY_VERIFY] = (BucketConfig(None, KernelConfig(block_v=16, readout_dot=True)),)
    with pytest.raises(UnsupportedShapeError, match="readout_dot needs block_v >= 16 .tl.dot. and precompute_scores"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.REPLAY_VERIFY] = default_configs(KernelKind.REPLAY_VERIFY, shape)
    configs[KernelKind.REPLAY_DECODE] = (BucketConfig(None, KernelConfig(block_v=16, precompute_scores=True, readout_dot=True)),)
    with pytest.raises(UnsupportedShapeError, match="readout_dot applies to replay_verify only"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.REPLAY_DECODE] = (BucketConfig(None, KernelConfig(block_v=16, precompute_scores=True, window_block_v=16)),)
    with pytest.raises(UnsupportedShapeError, match="window_block_v .the split verify. applies to replay_verify"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.REPLAY_DECODE] = default_configs(KernelKind.REPLAY_DECODE, shape)
    configs[KernelKind.REPLAY_VERIFY] = (BucketConfig(None, KernelConfig(block_v=16, window_block_v=16)),)
    with pytest.raises(UnsupportedShapeError, match="precompute_scores=False"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.REPLAY_VERIFY] = (BucketConfig(None, KernelConfig(block_v=16, precompute_scores=True, window_block_v=24)),)
    with pytest.raises(UnsupportedShapeError, match="window_block_v=24 must be 0 or a power of two"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.REPLAY_VERIFY] = (BucketConfig(None, KernelConfig(block_v=16, precompute_scores=True, window_warps=2)),)
    with pytest.raises(UnsupportedShapeError, match="window_warps=2 .* 1 without window_block_v"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.REPLAY_VERIFY] = default_configs(KernelKind.REPLAY_VERIFY, shape)
    configs[KernelKind.COMMIT] = (BucketConfig(None, KernelConfig(block_v=16, early_launch=True)),)
    with pytest.raises(UnsupportedShapeError, match="commit: early_launch applies to replay_decode and replay_verify only"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.COMMIT] = (BucketConfig(None, KernelConfig(block_v=16, early_commit=True)),)
    with pytest.raises(UnsupportedShapeError, match="commit: early_commit applies to replay_verify only"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.COMMIT] = default_configs(KernelKind.COMMIT, shape)
    configs[KernelKind.BASELINE_DECODE] = (BucketConfig(None, KernelConfig(block_v=16, prefetch_fold_keys=True)),)
    with pytest.raises(UnsupportedShapeError, match="baseline_decode: prefetch_fold_keys applies to replay_decode and replay_verify only"):
        plan_module(mamba2, shape, "h100", configs, "defaults")
    configs[KernelKind.BASELINE_DECODE] = (BucketConfig(None, KernelConfig(block_v=16, flush_at=1)),)
    with pytest.raises(UnsupportedShapeError, match="baseline_decode: flush_at applies to replay_decode and replay_verify only"):
        plan_module(mamba2, shape, "h100", configs, "defaults")


def test_every_shape_of_every_shipped_spec_compiles(mamba2):
    for shape in mamba2.shapes:
        compile(render_module(default_plan(mamba2, shape)), shape.name, "exec")
    odd = replace(SMALL, value_dim=12, key_dim=20)
    compile(render_module(default_plan(mamba2, odd)), "odd", "exec")


def test_layout_option_changes_strides(mamba2):
    text = (ROOT / "specs" / "mamba2.yaml").read_text().replace("layout: value_key", "layout: key_value")
    spec = load_spec_text(text, "kv.yaml")
    source = render_module(default_plan(spec, SMALL))
    assert "STATE_STRIDE_V = tl.constexpr(1)" in source and "STATE_STRIDE_K = tl.constexpr(8)" in source
    assert "STATE_SHAPE = (4, 16, 8)" in source


def test_written_files_take_the_umask_and_keep_their_mode(tmp_path):
    """Generated modules and records are written through a temporary file; the result is readable as any file the
    process creates (not mkstemp's 0600), and a rewrite keeps the mode a user gave the file."""
    previous = os.umask(0o022)
    try:
        path = tmp_path / "module.py"
        assert write_if_changed(path, "a = 1\n")
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o640)
        assert write_if_changed(path, "a = 2\n") and path.read_text() == "a = 2\n"
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(previous)


def test_reachable_source_leaves_argument_checks_out():
    """Argument checks (`_check_*`) are not part of a trial's code: a stricter check, or one more call of a check,
    leaves the key as it was; a check's result that the code uses stays in (its call is not on its own)."""
    source = '''def _check_shape(x):
    if x.dim() != 2:
        raise ValueError("x must be 2-D")
    return x.shape[0]


def launch(x):
    n = _check_shape(x)
    return kernel(x, n)


def kernel(x, n):
    return x * n
'''
    kept = reachable_source(source, ("launch",))
    assert kept == "def launch(x):\n    n = _check_shape(x)\n    return kernel(x, n)\ndef kernel(x, n):\n    return x * n"
    stricter = source.replace("    return x.shape[0]", "    if not x.is_contiguous():\n        raise ValueError('x')\n    return x.shape[0]")
    called = stricter.replace("def launch(x):\n", "def launch(x):\n    _check_shape(\n        x)\n")
    assert reachable_source(called, ("launch",)) == kept
    assert reachable_source(source.replace("x * n", "x + n"), ("launch",)) != kept


def test_reachable_source_keeps_what_the_roots_run():
    source = '''"""module docstring"""
import os
import torch  # a comment
LIMIT = 3
UNUSED = 4


def helper(x):
    """doc"""
    return torch.add(x, LIMIT)  # trailing comment


@decorate
def entry(x):
    # a full-line comment
    return helper(x)


def other():
    return UNUSED
'''
    kept = reachable_source(source, ("entry",))
    assert kept == "import torch\nLIMIT = 3\ndef helper(x):\n    return torch.add(x, LIMIT)\n@decorate\ndef entry(x):\n    return helper(x)"
    edited = source.replace("# a comment", "# another").replace('"""doc"""', '"""other doc"""').replace("return UNUSED", "return 5")
    edited = edited.replace("import os", "import sys")
    assert reachable_source(edited, ("entry",)) == kept
    assert reachable_source(source.replace("add(x, LIMIT)", "sub(x, LIMIT)"), ("entry",)) != kept
    with pytest.raises(KeyError, match="missing"):
        reachable_source(source, ("entry", "missing"))


def test_spread_flushes_leaves_out_the_aligned_configs(tmp_path):
    """`build --spread-flushes`: the shipped records' replay-decode winners without align_flushes (the next fastest
    trial of each such bucket), the same as the plain build everywhere else; the module header says so."""
    from replaygen.tune.apply import resolve_configs

    spec = load_spec(ROOT / "specs" / "gdn.yaml")
    shape = spec.shape("qwen3.5")
    shipped = resolve_configs(spec, shape, "h100", ROOT / "tune")
    spread = resolve_configs(spec, shape, "h100", ROOT / "tune", spread_flushes=True)
    aligned = [b for b in shipped.configs[KernelKind.REPLAY_DECODE] if b.config.align_flushes]
    assert aligned, "the shipped qwen3.5 record has no aligned bucket left to test with"
    assert not any(b.config.align_flushes for b in spread.configs[KernelKind.REPLAY_DECODE])
    for batch in BATCH_BUCKETS:
        shipped_config = bucket_config(shipped.configs[KernelKind.REPLAY_DECODE], batch)
        if not shipped_config.align_flushes:
            assert bucket_config(spread.configs[KernelKind.REPLAY_DECODE], batch) == shipped_config, f"batch {batch}"
    assert {k: v for k, v in spread.configs.items() if k is not KernelKind.REPLAY_DECODE} == {k: v for k, v in shipped.configs.items() if k is not KernelKind.REPLAY_DECODE}
    assert any("align_flushes left out (--spread-flushes)" in note for note in spread.notes)
    (module,) = build_spec(spec, (shape,), "h100", tmp_path, tune_dir=ROOT / "tune", spread_flushes=True)
    assert "flushes spread (no align_flushes)" in header(module.path.read_text())["config_source"]


def test_flush_groups_set_every_aligned_config(tmp_path):
    """`build --flush-groups N`: every aligned replay-decode config of the build flushes in N groups (at most its flush
    period); 1 gives one flushing step with every row; the module header says how many. (Which trial stands for a
    bucket is test_tune's test_aligned_trials_stand_for_the_group_count_the_build_ships.)"""
    from replaygen.cli import main
    from replaygen.tune.apply import resolve_configs

    spec = load_spec(ROOT / "specs" / "gdn.yaml")
    shape = spec.shape("qwen3.5")
    shipped = resolve_configs(spec, shape, "h100", ROOT / "tune")
    table = shipped.configs[KernelKind.REPLAY_DECODE]
    assert {b.config.flush_groups for b in table if b.config.align_flushes} == {2}
    assert {b.config.flush_groups for b in table if not b.config.align_flushes} == {1}
    for groups, expected in ((1, 1), (4, 4), (99, 16)):
        regrouped = resolve_configs(spec, shape, "h100", ROOT / "tune", flush_groups=groups).configs[KernelKind.REPLAY_DECODE]
        assert {b.config.flush_groups for b in regrouped if b.config.align_flushes} == {expected}
    assert "aligned flushes in 2 groups" in shipped.source and "groups" not in resolve_configs(spec, shape, "h100", ROOT / "tune", flush_groups=1).source
    (module,) = build_spec(spec, (shape,), "h100", tmp_path, tune_dir=ROOT / "tune", flush_groups=4)
    assert "aligned flushes in 4 groups" in header(module.path.read_text())["config_source"]
    assert main(["build", str(ROOT / "specs" / "gdn.yaml"), "--shape", "qwen3.5", "--out", str(tmp_path), "--flush-groups", "0"]) != 0
