"""Offline compilation: every kernel a module launches, compiled for a GPU architecture with no GPU at hand."""

from dataclasses import replace

import pytest

from replaygen import codegen
from replaygen.cli import main
from replaygen.configs import BucketConfig, KernelKind, Route, module_defaults
from replaygen.errors import ReplaygenError
from replaygen.offline import CALLS, Architecture, CompileRun, architecture, bucket_batches, compile_job, compile_modules
from replaygen.spec import load_spec, load_spec_text
from replaygen.spec.model import StateLayout
from replaygen.tune.apply import resolve_configs
from replaygen.keys import candidate_tables, render_candidate

from conftest import ODD, ROOT, SMALL

SM90 = architecture("sm_90")
EVERY_KERNEL = {
    "_baseline_decode_kernel", "_replay_decode_kernel", "_materialize_kernel", "_load_kernel", "_replay_verify_kernel",
    "_commit_kernel", "_baseline_verify_kernel", "_baseline_commit_kernel",
}


def assert_compiled(report):
    assert report.ok, "\n".join(report.lines())
    assert {k.kernel for k in report.kernels} >= EVERY_KERNEL
    assert all(k.registers > 0 and k.instructions > k.shuffles >= 0 and k.launched_by for k in report.kernels)


SPECS = {name: load_spec(ROOT / "specs" / f"{name}.yaml") for name in ("mamba2", "gdn")}
SHIPPED = [(name, shape.name) for name, spec in SPECS.items() for shape in spec.shapes]


def h100_tables(spec, shape):
    return resolve_configs(spec, shape, "h100", ROOT / "tune", allow_default=True).configs


@pytest.fixture(scope="module")
def shipped_reports():
    """Every shipped module as `build --gpu h100` writes it, compiled for sm_90 (all in one call: worker processes)."""
    jobs = []
    for name, shape_name in SHIPPED:
        spec = SPECS[name]
        shape = spec.shape(shape_name)
        jobs.append(compile_job(spec, shape, h100_tables(spec, shape), SM90, "bfloat16"))
    return dict(zip(SHIPPED, compile_modules(jobs)))


@pytest.mark.slow
@pytest.mark.parametrize("name, shape_name", SHIPPED)
def test_every_shipped_module_compiles_for_the_h100(shipped_reports, name, shape_name):
    """Every bucket of every dispatch table launched, every kernel compiled for sm_90 within its shared memory and
    threads per block."""
    report = shipped_reports[(name, shape_name)]
    assert_compiled(report)
    spec = SPECS[name]
    launched = {call for k in report.kernels for call in k.launched_by}
    for kind, table in h100_tables(spec, spec.shape(shape_name)).items():
        for batch in bucket_batches(table):
            assert f"{CALLS[kind]} b{batch}" in launched, f"{CALLS[kind]} b{batch} launched nothing"


GDN_TEXT = (ROOT / "specs" / "gdn.yaml").read_text()
MAMBA2_TEXT = (ROOT / "specs" / "mamba2.yaml").read_text()
VARIANTS = {
    "mamba2-key_value": (MAMBA2_TEXT.replace("layout: value_key", "layout: key_value"), replace(SMALL, layout=StateLayout.KEY_VALUE)),
    "gdn": (GDN_TEXT, replace(SMALL, capacity=8, window=2)),
    "gdn-key_value": (GDN_TEXT.replace("layout: value_key", "layout: key_value"), replace(SMALL, capacity=8, window=4, layout=StateLayout.KEY_VALUE)),
    "kda-channel_decay": (GDN_TEXT.replace("granularity: head", "granularity: channel"), replace(SMALL, capacity=8, window=2)),
    "mamba2-odd": (MAMBA2_TEXT, ODD),
    "gdn-odd": (GDN_TEXT, ODD),
}


VARIANT_CASES = [(variant, arch, dtype) for variant in sorted(VARIANTS) for arch in ("sm_90", "sm_80") for dtype in ("bfloat16", "float32")]


@pytest.fixture(scope="module")
def variant_reports():
    jobs = []
    for variant, arch, dtype in VARIANT_CASES:
        text, shape = VARIANTS[variant]
        spec = load_spec_text(text, f"{variant}.yaml")
        jobs.append(compile_job(spec, shape, module_defaults(spec, shape), architecture(arch), dtype))
    return dict(zip(VARIANT_CASES, compile_modules(jobs)))


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda case: "-".join(case))
def test_spec_variants_compile(variant_reports, case):
    """What the interpreter runs in the CPU suite also compiles for the GPU: state layouts, per-channel decay, sizes
    that are not powers of two; sm_80 without the programmatic dependent launch."""
    assert_compiled(variant_reports[case])


def compile_one(spec, shape, arch=SM90):
    (report,) = compile_modules([compile_job(spec, shape, module_defaults(spec, shape), arch, "bfloat16")])
    return report


@pytest.mark.parametrize("name", ["mamba2", "gdn"])
def test_early_launch_compiles_for_the_h100(name):
    """Configs that launch early (early_launch): the scores, replay decode and replay verify kernels compiled for
    sm_90 with their wait for the kernel before them (griddepcontrol), launched as programmatic dependents, in one
    launch and split, with and without overlapped scores; the commit after a batch-1 verify too (early_commit)."""
    spec = SPECS[name]
    tables = module_defaults(spec, SMALL)
    decode = tables[KernelKind.REPLAY_DECODE][-1].config
    verify = tables[KernelKind.REPLAY_VERIFY][-1].config
    tables[KernelKind.REPLAY_DECODE] = (BucketConfig(1, replace(decode, early_launch=True, flush_at=1, align_flushes=False, flush_groups=1)), BucketConfig(None, replace(decode, early_launch=True, precompute_scores=True, overlap_scores=True)))
    tables[KernelKind.REPLAY_VERIFY] = (BucketConfig(1, replace(verify, early_launch=True, early_commit=True, precompute_scores=False, overlap_scores=False, window_block_v=0, window_warps=1)), BucketConfig(None, replace(verify, early_launch=True, precompute_scores=True, overlap_scores=True, window_block_v=8)))
    (report,) = compile_modules([compile_job(spec, SMALL, tables, SM90, "bfloat16")])
    assert_compiled(report)
    launched = {call for k in report.kernels for call in k.launched_by}
    assert {"decode b1", "decode b2", "verify b1", "verify b2", "commit b1"} <= launched


@pytest.mark.parametrize("name", ["mamba2", "gdn"])
def test_fold_key_prefetch_compiles_for_the_h100(name):
    """prefetch_fold_keys (inline PTX the interpreter never runs): the replay decode and verify kernels compiled for
    sm_90 with the prefetch before their fold, on the output-only and state routes, verify in one launch and split."""
    spec = SPECS[name]
    tables = module_defaults(spec, SMALL)
    decode = replace(tables[KernelKind.REPLAY_DECODE][-1].config, prefetch_fold_keys=True)
    verify = replace(tables[KernelKind.REPLAY_VERIFY][-1].config, prefetch_fold_keys=True)
    tables[KernelKind.REPLAY_DECODE] = (BucketConfig(1, replace(decode, route=Route.STATE_AND_OUTPUT, precompute_scores=False, overlap_scores=False, align_flushes=False, flush_groups=1)), BucketConfig(None, decode))
    tables[KernelKind.REPLAY_VERIFY] = (BucketConfig(1, replace(verify, window_block_v=0, window_warps=1)), BucketConfig(None, replace(verify, precompute_scores=True, overlap_scores=True, window_block_v=8)))
    (report,) = compile_modules([compile_job(spec, SMALL, tables, SM90, "bfloat16")])
    assert_compiled(report)
    launched = {call for k in report.kernels for call in k.launched_by}
    assert {"decode b1", "decode b2", "verify b1", "verify b2"} <= launched


def test_shared_memory_beyond_the_architecture_fails_the_call(mamba2):
    report = compile_one(mamba2, SMALL, Architecture("sm_90", 90, max_shared_bytes=64))
    assert not report.ok
    assert any("shared memory" in f.error for f in report.failures)
    assert all(k.shared_bytes <= 64 for k in report.kernels)
    assert any(line.startswith("  FAILED ") for line in report.lines())


def test_a_compile_error_names_the_call_and_the_rest_still_compiles(mamba2, monkeypatch):
    """A kernel the compiler rejects (here the commit kernel, by an injected static assertion) fails its calls only."""
    render = codegen.render_module
    commit_body = "    BLOCK_H: tl.constexpr,\n    EARLY_WAIT: tl.constexpr,\n):\n"

    def broken(plan):
        source = render(plan)
        assert source.count(commit_body) == 1
        return source.replace(commit_body, commit_body + '    tl.static_assert(BLOCK_V < 0, "injected")\n')

    monkeypatch.setattr(codegen, "render_module", broken)
    report = compile_one(mamba2, SMALL)
    assert [f.call for f in report.failures] == ["commit b1"]
    assert "injected" in report.failures[0].error
    assert "_replay_verify_kernel" in {k.kernel for k in report.kernels}


def test_a_module_without_the_expected_launch_code_stops_the_worker(mamba2):
    job = compile_job(mamba2, SMALL, module_defaults(mamba2, SMALL), SM90, "bfloat16")
    with pytest.raises(ReplaygenError, match="worker exited with 1.*has no _dependent_launch or _on_gpu"):
        compile_modules([replace(job, source="import torch\n")])


def test_a_job_runs_the_calls_of_its_kinds_only(mamba2):
    job = compile_job(mamba2, SMALL, module_defaults(mamba2, SMALL), SM90, "bfloat16", kinds=(KernelKind.REPLAY_VERIFY,))
    (report,) = compile_modules([job])
    assert report.ok and {k.kernel for k in report.kernels} == {"_scores_kernel", "_replay_verify_kernel"}
    assert {call.split()[0] for k in report.kernels for call in k.launched_by} == {"verify"}


def test_a_second_process_finds_the_candidates_kernels_compiled(mamba2, tmp_path, monkeypatch):
    """What a warmer's worker compiled is in Triton's on-disk cache for the module the tuner renders for the same
    candidate (another header, another file): the second process compiles nothing new."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    config = module_defaults(mamba2, SMALL)[KernelKind.REPLAY_DECODE][-1].config
    tables = candidate_tables(mamba2, SMALL, KernelKind.REPLAY_DECODE, config)
    job = compile_job(mamba2, SMALL, tables, SM90, "bfloat16", kinds=(KernelKind.REPLAY_DECODE,))
    compile_modules([job])
    cached = sorted(p.name for p in (tmp_path / "triton").rglob("*.cubin"))
    assert cached
    candidate = render_candidate(mamba2, SMALL, KernelKind.REPLAY_DECODE, config)
    assert candidate.source != job.source
    (report,) = compile_modules([replace(job, source=candidate.source)])
    assert report.ok and sorted(p.name for p in (tmp_path / "triton").rglob("*.cubin")) == cached


def test_a_cancelled_run_stops_its_workers(mamba2):
    jobs = [compile_job(mamba2, shape, module_defaults(mamba2, shape), SM90, "bfloat16") for shape in (SMALL, ODD)]
    run = CompileRun(jobs, workers=2)
    assert run.running
    run.cancel()
    assert not run.running


def test_architecture_names():
    assert architecture("sm_90") is architecture("sm90") is architecture("9.0") is SM90
    assert architecture("8.0").max_shared_bytes < SM90.max_shared_bytes
    assert not architecture("sm_80").dependent_launch and SM90.dependent_launch
    with pytest.raises(ReplaygenError, match="unknown architecture 'sm_42'.*sm_90"):
        architecture("sm_42")


def test_threads_per_block_follow_the_registers():
    assert SM90.threads_for(255) == 256
    assert SM90.threads_for(128) == 512
    assert SM90.threads_for(32) == 1024


def test_compile_command(capsys):
    assert main(["compile", str(ROOT / "specs" / "mamba2.yaml"), "--shape", "nemotron-h-tp8", "--gpu", "h100", "--tune-dir", str(ROOT / "tune")]) == 0
    out = capsys.readouterr().out
    assert "mamba2/nemotron-h-tp8 for sm_90" in out and "configs of h100" in out and "every kernel compiled" in out
    assert main(["compile", str(ROOT / "specs" / "mamba2.yaml"), "--arch", "sm_42"]) == 2
    assert "unknown architecture 'sm_42'" in capsys.readouterr().err
