"""Spec loading: every validation rule rejects bad input with file, line and YAML path."""

import textwrap
from pathlib import Path

import pytest

from replaygen.errors import SpecError
from replaygen.spec.loader import API_PARAMETERS
from replaygen.spec import load_spec, load_spec_text
from replaygen.spec.model import CacheField, DecayForm, DType, Rounding, UpdateKind

ROOT = Path(__file__).resolve().parent.parent
MAMBA2 = (ROOT / "specs" / "mamba2.yaml").read_text()
GDN = (ROOT / "specs" / "gdn.yaml").read_text()


def edit(old: str, new: str, text: str = MAMBA2) -> str:
    assert old in text, f"fixture text not found: {old!r}"
    return text.replace(old, new, 1)


def rejects(text: str, path: str, message: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "bad.yaml")
    err = info.value
    assert err.file == "bad.yaml"
    assert err.path == path, str(err)
    assert message in err.message, str(err)
    assert err.line is not None and err.line >= 1
    assert str(err).startswith(f"bad.yaml:{err.line}: at '{path}'")
    return err


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_shipped_spec_loads(mamba2):
    assert mamba2.name == "mamba2"
    assert mamba2.update.kind is UpdateKind.ADDITIVE
    assert mamba2.decay.form is DecayForm.NEG_EXP_SOFTPLUS
    assert {c.field for c in mamba2.cache} == {CacheField.VALUE, CacheField.KEY, CacheField.LOG_DECAY, CacheField.WEIGHT}
    main = mamba2.shape("nemotron-h")
    assert (main.heads, main.key_heads, main.value_dim, main.key_dim) == (128, 8, 64, 128)
    assert [s.heads for s in mamba2.shapes[:4]] == [128, 64, 32, 16]


def test_unknown_key_top_level():
    text = edit("spec_version: 1", "spec_version: 1\nflavour: spicy")
    err = rejects(text, "flavour", "unknown key 'flavour'")
    assert err.line == line_of(text, "flavour")


def test_unknown_key_nested():
    text = edit("  granularity: head", "  granularity: head\n  speed: 3")
    err = rejects(text, "decay.speed", "unknown key 'speed'")
    assert err.line == line_of(text, "speed: 3")


def test_missing_field():
    rejects(edit("  form: neg_exp_softplus\n", ""), "decay", "missing required key 'form'")


def test_wrong_type():
    text = edit("capacity: 16      # L", "capacity: sixteen")
    err = rejects(text, "replay.capacity", "expected an integer, got a string")
    assert err.line == line_of(text, "capacity: sixteen")


def test_boolean_is_not_an_integer():
    rejects(edit("capacity: 16      # L", "capacity: true"), "replay.capacity", "expected an integer, got a boolean")


def test_name_must_be_identifier():
    rejects(edit("value: x          # [batch, H, P]", "value: x-1"), "inputs.value", "not a valid name")


def test_name_must_not_be_keyword():
    rejects(edit("value: x          # [batch, H, P]", "value: lambda"), "inputs.value", "not a valid name")


@pytest.mark.parametrize("name", sorted(API_PARAMETERS))
def test_name_must_not_be_an_api_parameter(name):
    """The generated functions take these beside the spec's inputs and weights, as keywords of the same call."""
    text = edit("value: v          # [batch, HV, V]", f"value: {name}", GDN)
    err = rejects(text, "inputs.value", f"'{name}' cannot name an input or weight: the generated functions take a parameter '{name}' of their own")
    assert err.line == line_of(text, f"value: {name}")


def test_names_must_be_distinct():
    rejects(edit("skip: D           # [H]", "skip: x"), "readout.skip", "already used at inputs.value")


def test_duplicate_yaml_key():
    text = edit("  key: B            # [batch, G, N]", "  key: B\n  key: C2")
    rejects(text, "inputs.key", "duplicate key 'key'")


def test_yaml_syntax_error_has_line():
    with pytest.raises(SpecError) as info:
        load_spec_text("name: [unclosed\nspec_version: 1\n", "broken.yaml")
    assert info.value.line is not None and "invalid YAML" in info.value.message


def test_heads_multiple_of_key_heads():
    text = edit("nemotron-h-tp2: {heads: 64, key_heads: 4,", "nemotron-h-tp2: {heads: 64, key_heads: 5,")
    err = rejects(text, "shapes.nemotron-h-tp2.key_heads", "heads=64 is not a multiple of key_heads=5")
    assert err.line == line_of(text, "nemotron-h-tp2")


def test_key_sharing_head_needs_equal_heads():
    rejects(edit("key_sharing: key_head", "key_sharing: head"), "shapes.nemotron-h.key_heads", "key_heads must equal heads")


def test_capacity_too_small_for_window():
    rejects(edit("capacity: 16      # L", "capacity: 6"), "replay.capacity", "flush rule h + 2T > L needs L >= 2T=8")


def test_shape_capacity_too_small_for_window():
    text = edit("nemotron-h-l8:  {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128, capacity: 8}", "nemotron-h-l8:  {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128, capacity: 5}")
    rejects(text, "shapes.nemotron-h-l8.capacity", "L >= 2T=8")


def test_state_dtype_and_rounding_per_spec_and_per_shape():
    """The spec's state dtype and rounding are its shapes' defaults; a shape may set its own, and its own cached-field
    dtypes. float32 activations with a 16-bit state, and a float16 state, are the user's choice."""
    text = edit("state: {dtype: float32, layout: value_key}", "state: {dtype: bfloat16, layout: value_key, rounding: stochastic}")
    text = edit(
        "nemotron-h-l8:  {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128, capacity: 8}",
        "nemotron-h-l8:  {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128, capacity: 8, state_dtype: float16, rounding: nearest,"
        " cache: {key: float32, value: float32}}",
        text,
    )
    tp2 = "nemotron-h-tp2: {heads: 64, key_heads: 4, value_dim: 64, key_dim: 128"
    text = edit(tp2, tp2 + ", state_dtype: float32", text)
    spec = load_spec_text(text, "ok.yaml")
    main, l8, fp32 = spec.shape("nemotron-h"), spec.shape("nemotron-h-l8"), spec.shape("nemotron-h-tp2")
    assert (main.state_dtype, main.rounding) == (DType.BFLOAT16, Rounding.STOCHASTIC) and spec.cache_of(main) == spec.cache
    assert (l8.state_dtype, l8.rounding) == (DType.FLOAT16, Rounding.NEAREST)
    assert {c.field: c.dtype for c in spec.cache_of(l8)} == {CacheField.VALUE: DType.FLOAT32, CacheField.KEY: DType.FLOAT32, CacheField.LOG_DECAY: DType.FLOAT32, CacheField.WEIGHT: DType.FLOAT32}
    assert [c.field for c in spec.cache_of(l8)] == [c.field for c in spec.cache]
    assert (fp32.state_dtype, fp32.rounding) == (DType.FLOAT32, Rounding.NEAREST)  # a float32 state has no rounding to inherit


def test_stochastic_rounding_needs_a_16_bit_state():
    rejects(edit("state: {dtype: float32, layout: value_key}", "state: {dtype: float32, layout: value_key, rounding: stochastic}"), "state.rounding", "stochastic rounding is for a 16-bit state")
    shape = "nemotron-h-l8:  {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128, capacity: 8"
    rejects(edit(shape, shape + ", rounding: stochastic"), "shapes.nemotron-h-l8.rounding", "stochastic rounding is for a 16-bit state")
    rejects(edit(shape, shape + ", rounding: sometimes"), "shapes.nemotron-h-l8.rounding", "unknown value 'sometimes'")
    rejects(edit(shape, shape + ", state_dtype: float64"), "shapes.nemotron-h-l8.state_dtype", "unknown value 'float64'")


def test_shape_cache_sets_only_the_dtypes_of_the_spec_fields():
    shape = "nemotron-h-l8:  {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128, capacity: 8"
    rejects(edit(shape, shape + ", cache: {corrected_value: float32}"), "shapes.nemotron-h-l8.cache.corrected_value", "is not in replay.cache")
    rejects(edit(shape, shape + ", cache: {keys: float32}"), "shapes.nemotron-h-l8.cache.keys", "unknown cached field 'keys'")
    rejects(edit(shape, shape + ", cache: {log_decay: activation}"), "shapes.nemotron-h-l8.cache.log_decay", "must be cached as float32")
    rejects(edit(shape, shape + ", cache: [key]"), "shapes.nemotron-h-l8.cache", "expected a mapping of field -> dtype")


def test_unknown_enum_value():
    rejects(edit("kind: additive", "kind: multiplicative"), "update.kind", "unknown value 'multiplicative'")


MAMBA3 = (ROOT / "specs" / "mamba3.yaml").read_text()


def m3(old: str, new: str) -> str:
    return edit(old, new, MAMBA3)


@pytest.mark.parametrize(
    "old, new, path, message",
    [
        ("  mix_input: trap   # [batch, H]\n", "", "update", "the trapezoid update needs 'mix_input'"),
        ("kind: trapezoid", "kind: additive", "update.mix_input", "'mix_input' belongs to the trapezoid update"),
        ("  rate_activation: heavy_tail\n", "", "decay", "form 'neg_rate_softplus' needs 'rate_input' and 'rate_activation'"),
        ("  rate_floor: 1.0e-4\n", "  rate_floor: 1.0e-4\n  rate: A_log\n", "decay.rate", "takes its rate per token from 'rate_input'"),
        ("rate_activation: heavy_tail", "rate_activation: cubic", "decay.rate_activation", "unknown value 'cubic' (allowed: heavy_tail, exp)"),
        ("rate_floor: 1.0e-4", "rate_floor: -1", "decay.rate_floor", "must be between 0.0 and"),
        ("    carry_weight: float32  # (1 - l) dt': what the step adds to the previous entry\n", "", "replay.cache", "the trapezoid update with a rotary transform needs cached fields carry_weight"),
        ("    angle: float32\n", "", "replay.cache", "needs cached fields angle"),
        ("    angle: float32\n", "    angle: bfloat16\n", "replay.cache.angle", "must be cached as float32"),
        ("    carry_weight: float32  #", "    carry_weight: activation  #", "replay.cache.carry_weight", "must be cached as float32"),
        ("  angle_input: angles   # [batch, int(N * fraction) / 2]\n", "", "rotary", "missing required key 'angle_input'"),
        ("fraction: 0.5", "fraction: 1.5", "rotary.fraction", "must be between"),
        ("pairing: adjacent", "pairing: spiral", "rotary.pairing", "unknown value 'spiral'"),
        ("  value_scale: mimo_x   # [H, R, P]\n", "", "ranks", "missing required key 'value_scale'"),
        ("gate: {input: z, activation: silu, optional: true}", "gate: null", "ranks.gate_scale", "readout has no gate"),
        ("key: {transform: rmsnorm, eps: 1.0e-5, weight: B_norm,", "key: {transform: none, weight: B_norm,", "key.weight", "only applies to a normalising transform"),
        ("bias: C_bias}", "bias: B_bias}", "query.bias", "name 'B_bias' is already used at key.bias"),
        ("angle_input: angles", "angle_input: x", "rotary.angle_input", "name 'x' is already used at inputs.value"),
        ("mamba3:          {heads: 64, key_heads: 1, value_dim: 64, key_dim: 128}", "mamba3: {heads: 64, key_heads: 1, value_dim: 64, key_dim: 128, rank: 0}", "shapes.mamba3.rank", "must be between 1 and 16"),
        ("mamba3:          {heads: 64, key_heads: 1, value_dim: 64, key_dim: 128}", "mamba3: {heads: 64, key_heads: 1, value_dim: 64, key_dim: 3}", "shapes.mamba3.key_dim", "leaves no pair of channels to rotate"),
        ("mamba3:          {heads: 64, key_heads: 1, value_dim: 64, key_dim: 128}", "mamba3: {heads: 64, key_heads: 1, value_dim: 64, key_dim: 65, rotary_pairing: halves}", "shapes.mamba3.rotary_pairing", "must be even"),
        ("rotary_pairing: halves}\n  mamba3-mimo-n64", "rotary_pairing: twisted}\n  mamba3-mimo-n64", "shapes.mamba3-mimo.rotary_pairing", "unknown value 'twisted'"),
    ],
)
def test_mamba3_language_rules(old, new, path, message):
    rejects(m3(old, new), path, message)


def test_rank_needs_the_ranks_weights():
    text = m3("ranks:\n  value_scale: mimo_x   # [H, R, P]\n  gate_scale: mimo_z    # [H, R, P]\n  output_scale: mimo_o  # [H, R, P]\n", "")
    rejects(text, "shapes.mamba3-mimo.rank", "a shape of rank > 1 needs the spec's 'ranks'")


def test_rotary_needs_a_softplus_decay_per_head():
    with_rotary = edit("spec_version: 1", "spec_version: 1\nrotary: {angle_input: theta, fraction: 1.0}", GDN)
    rejects(with_rotary, "rotary", "a rotary angle advances by pi * tanh(angle_input) * dt' each step")
    direct = with_rotary.replace("  form: neg_exp_softplus\n", "  form: direct\n").replace("  rate: A_log       # [HV]\n  bias: dt_bias     # [HV]\n  direct_input: g   # [batch, HV] log decay, instead of a\n", "")
    rejects(direct, "rotary", "decay.form must be 'neg_exp_softplus' or 'neg_rate_softplus' at granularity 'head'")


def test_rotary_pairing_needs_rotary():
    text = edit("nemotron-h:     {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128}", "nemotron-h: {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128, rotary_pairing: halves}")
    rejects(text, "shapes.nemotron-h.rotary_pairing", "'rotary_pairing' needs the spec's 'rotary'")


def test_ranks_refuse_the_delta_rule():
    rejects(edit("spec_version: 1", "spec_version: 1\nranks: {value_scale: sv, output_scale: so}", GDN), "ranks", "not by the delta rule")


def test_rank_refuses_a_conv():
    text = m3("state: {dtype", "conv: {width: 4, channels: [value]}\nstate: {dtype")
    rejects(text, "shapes.mamba3-mimo.rank", "a spec with a conv has shapes of rank 1 only")


def test_trapezoid_decays_per_head():
    text = edit("kind: delta", "kind: trapezoid\n  mix_input: lam", (ROOT / "specs" / "kda.yaml").read_text())
    rejects(text, "update.kind", "the trapezoid update decays per head")


def test_cache_missing_field():
    rejects(edit("    weight: float32\n", ""), "replay.cache", "needs cached fields weight")


def test_cache_field_not_used_by_rule():
    rejects(edit("    value: activation", "    corrected_value: activation"), "replay.cache.corrected_value", "not replayed by the additive update")


def test_cache_scalar_fields_are_float32():
    rejects(edit("    log_decay: float32", "    log_decay: bfloat16"), "replay.cache.log_decay", "must be cached as float32")


def test_weight_decay_dt_needs_softplus_form():
    text = edit("  form: neg_exp_softplus\n  input: dt         # [batch, H]\n  rate: A_log       # [H]\n  bias: dt_bias     # [H]", "  form: direct\n  input: dt")
    rejects(text, "update.weight", "decay.form must be 'neg_exp_softplus'")


def test_weight_decay_dt_needs_head_granularity():
    rejects(edit("granularity: head", "granularity: channel"), "update.weight", "decay.granularity must be 'head'")


def test_direct_form_takes_no_rate():
    text = edit("  form: neg_exp_softplus", "  form: direct")
    rejects(text, "decay.rate", "remove 'rate' and 'bias'")


def test_spec_version_checked():
    rejects(edit("spec_version: 1", "spec_version: 2"), "spec_version", "unsupported spec_version 2")


def test_shape_name_rules():
    rejects(edit("nemotron-h-tp8:", "Nemotron_TP8:"), "shapes.Nemotron_TP8", "lowercase letters")


def test_shape_name_has_no_trailing_newline():
    rejects(edit("  nemotron-h-tp8:", '  "nemotron-h-tp8\\n":'), "shapes.nemotron-h-tp8\n", "lowercase letters")


def test_shape_identifiers_must_be_distinct():
    sizes = "{heads: 16, key_heads: 1, value_dim: 64, key_dim: 128}"
    text = edit("  nemotron-h-tp8:", f"  s-2: {sizes}\n  s.2: {sizes}\n  nemotron-h-tp8:")
    err = rejects(text, "shapes.s.2", f"shapes 's-2' (line {line_of(text, 's-2:')}) and 's.2' both become 's_2'")
    assert err.line == line_of(text, "s.2:")


def test_dimension_out_of_range():
    rejects(edit("nemotron-h-tp8: {heads: 16, key_heads: 1, value_dim: 64, key_dim: 128}", "nemotron-h-tp8: {heads: 16, key_heads: 1, value_dim: 64, key_dim: 512}"), "shapes.nemotron-h-tp8.key_dim", "must be between 1 and 256")


def test_leading_zero_is_decimal():
    spec = load_spec_text(edit("capacity: 16      # L", "capacity: 016"), "a.yaml")
    assert spec.shape("nemotron-h").capacity == 16  # YAML 1.1 reads 016 as octal 14


def test_no_sexagesimal_numbers():
    rejects(edit("nemotron-h:     {heads: 128,", "nemotron-h:     {heads: 1:00,"), "shapes.nemotron-h.heads", "expected an integer, got a string")


def test_floats_of_yaml_1_2():
    for written, value in (("1e-6", 1e-6), (".5", 0.5), ("5E-1", 0.5), ("+1.", 1.0)):
        assert load_spec_text(edit("eps: 1.0e-6}", f"eps: {written}}}", GDN), "a.yaml").key.eps == value
    rejects(edit("eps: 1.0e-6}", "eps: -.inf}", GDN), "key.eps", "must be between 0.0 and 1.0, got -inf")


def test_yaml_1_1_booleans_are_strings():
    rejects(edit("optional: true", "optional: yes"), "readout.gate.optional", "expected true or false, got a string")


def test_anchors_and_aliases_rejected():
    text = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
    err = rejects(text, "", "anchor &a: anchors and aliases are not allowed")
    assert err.line == 1
    text = edit("capacity: 16      # L", "capacity: *L")
    err = rejects(text, "", "alias *L: anchors and aliases are not allowed")
    assert err.line == line_of(text, "capacity: *L")


def test_deep_nesting_rejected():
    err = rejects("[" * 5000, "", "nested deeper than 32 levels")
    assert err.line == 1


def test_nul_byte_has_line():
    text = edit("spec_version: 1", "spec_version: 1\x00")
    err = rejects(text, "", "character #x0000 is not allowed")
    assert err.line == line_of(text, "spec_version")


def test_empty_file():
    with pytest.raises(SpecError, match="empty"):
        load_spec_text("", "empty.yaml")


def test_unreadable_file(tmp_path):
    with pytest.raises(SpecError, match="cannot read spec file"):
        load_spec(tmp_path / "missing.yaml")


def test_spec_file_must_be_utf8(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"spec_version: 1\nname: \xe9\n")
    with pytest.raises(SpecError) as info:
        load_spec(bad)
    assert info.value.file == str(bad) and info.value.line == 2
    assert "not UTF-8 text: byte 0xe9 at offset 22" in info.value.message


def test_values_are_never_evaluated():
    text = edit("value: x          # [batch, H, P]", "value: __import__('os')")
    rejects(text, "inputs.value", "not a valid name")


def test_source_hash_tracks_content():
    a = load_spec_text(MAMBA2, "a.yaml")
    b = load_spec_text(MAMBA2 + "\n# comment\n", "a.yaml")
    assert a.source_sha256 != b.source_sha256


def test_spec_error_text(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent(edit("capacity: 16      # L", "capacity: 1")))
    with pytest.raises(SpecError) as info:
        load_spec(bad)
    assert str(bad) in str(info.value) and "replay.capacity" in str(info.value)


@pytest.mark.parametrize("spec_name,changes,message", [
    ("mamba2", dict(rotary_pairing="adjacent"), "a rotary pairing needs the spec's 'rotary'"),
    ("mamba2", dict(rank=2), "rank 2 needs the spec's 'ranks' weights and no conv"),
    ("gdn", dict(heads=3), "heads=3 is not a multiple of key_heads=2"),
    ("mamba2", dict(rounding="stochastic"), "stochastic rounding is for a 16-bit state"),
    ("mamba2", dict(capacity=3, window=2), "the flush rule h \\+ 2T > L needs T >= 1 and L >= 2T"),
    ("mamba3", dict(key_dim=15, rotary_pairing="halves"), "key_dim=15 must be even"),
    ("mamba3", dict(key_dim=2), "leaves no pair of channels to rotate"),
])
def test_a_shape_built_in_python_must_fit_its_spec(spec_name, changes, message):
    """A TargetShape the loader never saw (built in Python) is checked where a module or a reference is made from it,
    with an error naming the shape and the spec, not rendered into kernels that disagree with the reference."""
    from dataclasses import replace

    from replaygen.configs import module_defaults
    from replaygen.errors import UnsupportedShapeError
    from replaygen.plan import plan_module
    from replaygen.reference import Reference
    from replaygen.spec.model import RotaryPairing, TargetShape

    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    enums = {"rotary_pairing": RotaryPairing, "rounding": Rounding}
    shape = replace(TargetShape("mine", heads=4, key_heads=2, value_dim=8, key_dim=16, capacity=4, window=1),
                    **{name: enums[name](value) if name in enums else value for name, value in changes.items()})
    for make in (lambda: plan_module(spec, shape, "any", module_defaults(spec, shape), "test"), lambda: Reference(spec, shape, 2)):
        with pytest.raises(UnsupportedShapeError, match=f"shape 'mine' does not fit spec '{spec_name}': .*{message}"):
            make()


def test_a_shape_built_in_python_takes_the_specs_rotary_pairing():
    """A rotary spec's pairing fills in a Python-built shape's None, for the kernels and the reference alike."""
    from replaygen.spec.model import RotaryPairing, TargetShape

    spec = load_spec(ROOT / "specs" / "mamba3.yaml")
    shape = TargetShape("mine", heads=4, key_heads=1, value_dim=8, key_dim=16, capacity=4, window=1)
    resolved = spec.resolve(shape)
    assert resolved.rotary_pairing is spec.rotary.pairing is RotaryPairing.ADJACENT
    assert spec.resolve(resolved) == resolved
