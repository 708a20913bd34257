"""The package's shape: imports that go one way, templates inside the package, no log entries cited from code, and
spec names that cannot collide with the generated code."""

import ast
import re
from pathlib import Path

import pytest

from replaygen.harness import check_decode, check_speculative
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec, load_spec_text
from replaygen.spec.loader import API_PARAMETERS

from conftest import DEVICE, ROOT, SMALL

PACKAGE = ROOT / "replaygen"
# The layers, lowest first: a module may import from its own layer and the ones before it only.
LAYERS = (
    {"errors", "spec", "spec.model", "spec.nodes", "spec.loader", "files", "paths"},
    {"configs", "precision"},
    {"plan"},
    {"codegen"},
    {"keys"},
    {"reference", "traffic", "runtime", "harness", "measure"},
    {"tune.records"},
    {"tune.space", "offline", "tune.objective", "tune.warm", "tune.study", "tune.report", "tune.apply", "tune.run", "tune"},
    {"bench", "plots", "build", "drift", "integrations.transformers"},
    {"cli", "__main__"},
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def _imports(path: Path) -> set[str]:
    """The replaygen modules a file imports (at any depth: imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("replaygen"):
            found.add(node.module.removeprefix("replaygen").lstrip("."))
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("replaygen").lstrip(".") for alias in node.names if alias.name.startswith("replaygen")}
    return {name for name in found if name}


def _layer(name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    raise AssertionError(f"replaygen.{name} is in no layer of tests/test_layout.py: add it")


def test_imports_go_one_way():
    """spec -> plan -> codegen -> keys -> records -> tune -> build -> cli: no module imports one of a later layer."""
    backwards = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name == "__init__":
            continue
        for imported in _imports(path):
            if _layer(imported) > _layer(name):
                backwards.append(f"replaygen.{name} imports replaygen.{imported}")
    assert not backwards


def test_the_record_store_renders_nothing():
    assert not _imports(PACKAGE / "tune" / "records.py") & {"codegen", "plan"}
    assert not any(_imports(path) & {"build", "cli"} for path in (PACKAGE / "tune").glob("*.py"))


def test_code_cites_the_design_not_log_entries():
    """Code and templates cite docs/design.md by section; docs/perf.md is the log and is not cited from code."""
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.j2")]:
        text = path.read_text()
        assert not re.search(r"perf\.md|\bentr(y|ies) \d", text), path
        for section in re.findall(r'design\.md, "([^"]+)"', text):
            assert f"## {section}\n" in (ROOT / "docs" / "design.md").read_text(), (path, section)


def test_templates_are_package_data():
    toml = (ROOT / "pyproject.toml").read_text()
    assert '"replaygen.templates" = ["*.j2", "kernels/*.j2"]' in toml
    assert sorted(p.name for p in (PACKAGE / "templates" / "kernels").glob("*.j2")) == [
        "baseline_decode.py.j2", "baseline_verify.py.j2", "commit.py.j2", "conv.py.j2", "load.py.j2", "materialize.py.j2", "replay_decode.py.j2",
        "replay_verify.py.j2", "scores.py.j2",
    ]


def test_the_api_parameters_spec_names_may_not_take_are_all_of_them():
    """The loader refuses spec names equal to a parameter that the generated functions taking the spec's names as
    keywords have beside them: that list must name every such parameter."""
    for name in ("mamba2", "gdn"):
        spec = load_spec(ROOT / "specs" / f"{name}.yaml")
        module = load_kernels(spec, SMALL)
        source = Path(module.__file__).read_text()
        spec_names = {a.arg for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef) and f.name == "decode" for a in f.args.kwonlyargs} - {"out", "route", "flush_at"}
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name in ("decode", "baseline_decode", "verify", "baseline_verify"):
                names = {a.arg for a in (*node.args.args, *node.args.kwonlyargs)}
                assert names - spec_names <= API_PARAMETERS, (node.name, names - spec_names - API_PARAMETERS)


# Inputs named like identifiers of the generated code (kernel locals and parameters, host locals, module globals,
# builtins, imported modules): the prefix the plan spells spec names with keeps them apart.
CLASHING = {
    "value: x ": "value: cursor ", "key: B ": "key: scores ", "query: C ": "query: batch ", "input: dt ": "input: torch ",
    "rate: A_log ": "rate: max ", "bias: dt_bias ": "bias: inputs ", "skip: D ": "skip: tl ", "input: z,": "input: config,",
}


def test_spec_names_like_generated_identifiers_still_decode_and_verify(mamba2):
    text = (ROOT / "specs" / "mamba2.yaml").read_text()
    for old, new in CLASHING.items():
        assert old in text, old
        text = text.replace(old, new, 1)
    spec = load_spec_text(text, "clashing.yaml")
    assert (spec.inputs.value, spec.decay.rate, spec.readout.skip) == ("cursor", "max", "tl")
    module = load_kernels(spec, SMALL)
    report = check_decode(module, spec, SMALL, device=DEVICE, cycles=1, seed=3)
    assert report.ok, "\n".join(report.lines())
    report = check_speculative(module, spec, SMALL, device=DEVICE, steps=4, seed=4)
    assert report.ok, "\n".join(report.lines())


@pytest.mark.parametrize("other", ["nemotron-h-mtp-tp8"])
def test_a_state_of_another_module_is_refused(mamba2, other):
    """A model and its MTP head hold states of one STATE_SHAPE and other buffer capacities side by side: every entry
    point of one module refuses the other's state, naming both; a copy of a module (loaded twice) takes its own."""
    import torch

    from replaygen.runtime import import_source

    mine, theirs = (load_kernels(mamba2, mamba2.shape(name)) for name in ("nemotron-h-tp8", other))
    assert mine.STATE_SHAPE == theirs.STATE_SHAPE
    state = theirs.allocate(2, DEVICE, torch.float32)
    slots = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    calls = {
        "decode": lambda: mine.decode(state, slots, x=None, dt=None, B=None, C=None, A_log=None, dt_bias=None, D=None),
        "verify": lambda: mine.verify(state, slots, x=None, dt=None, B=None, C=None, A_log=None, dt_bias=None, D=None),
        "commit": lambda: mine.commit(state, slots, torch.ones(1, dtype=torch.int32, device=DEVICE)),
        "materialize": lambda: mine.materialize(state, slots),
        "load": lambda: mine.load(state, slots, torch.zeros((1, *mine.STATE_SHAPE), device=DEVICE)),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=r"this module \(mamba2/nemotron-h-tp8: .*L=16 T=4.*\) cannot use a replay state of mamba2/nemotron-h-mtp-tp8: .*L=28 T=4"):
            call()
    copy = import_source(Path(mine.__file__).read_text() + "\n# a vendored copy\n", "copy")
    assert copy is not mine
    own = mine.allocate(1, DEVICE, torch.float32)
    assert copy.materialize(own, slots).shape == (1, *mine.STATE_SHAPE)
    with pytest.raises(TypeError, match="cannot use ReplayState|cannot use a replay state|cannot use tensor"):
        mine.materialize(torch.zeros(1), slots)
