"""Kernel keys: what a trial timed, apart from how the code is written down."""

import pytest

from replaygen.configs import KernelConfig, KernelKind, module_defaults
from replaygen.keys import canonical, kernel_key, reached_definitions, render_candidate
from replaygen.tune.apply import changed_definitions

from conftest import SMALL

SOURCE = '''"""module docstring"""
import os
import torch  # a comment
LIMIT = 3
UNUSED = 4


def _check_shape(x):
    if x.dim() != 2:
        raise ValueError("x must be 2-D")
    return x.shape[0]


def helper(x):
    """doc"""
    return torch.add(x, LIMIT)  # trailing comment


@decorate
def entry(x):
    # a full-line comment
    _check_shape(x)
    n = _check_shape(x)
    return helper(x) * n


def other():
    return UNUSED
'''


def test_reached_definitions_follow_names_from_the_roots():
    names = [name for name, _ in reached_definitions(SOURCE, ("entry",))]
    assert names == ["LIMIT", "entry", "helper", "torch"]
    with pytest.raises(KeyError, match="missing"):
        reached_definitions(SOURCE, ("entry", "missing"))


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.replace("# a comment", "# another comment"),
        lambda s: s.replace('"""doc"""', '"""other doc"""'),
        lambda s: s.replace("return UNUSED", "return 5"),  # not reached
        lambda s: s.replace("import os", "import sys"),  # not reached
        lambda s: s.replace("torch.add(x, LIMIT)", "torch.add(\n        x,\n        LIMIT,\n    )"),  # line breaks, a trailing comma
        lambda s: s.replace("return helper(x) * n", "return helper( x )*n"),  # spacing
        lambda s: s.replace("    _check_shape(x)\n    n =", "    n ="),  # one call of a check fewer
        lambda s: s.replace('raise ValueError("x must be 2-D")', 'raise TypeError("2-D please")'),  # a stricter check
        lambda s: s.replace("LIMIT = 3\n", "") + "LIMIT = 3\n",  # definition order
    ],
    ids=["comment", "docstring", "unreached code", "unreached import", "line breaks", "spacing", "check call", "check body", "order"],
)
def test_key_ignores_what_does_not_run(edit):
    assert kernel_key_of(edit(SOURCE)) == kernel_key_of(SOURCE)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.replace("torch.add(x, LIMIT)", "torch.sub(x, LIMIT)"),
        lambda s: s.replace("LIMIT = 3", "LIMIT = 4"),
        lambda s: s.replace("n = _check_shape(x)", "n = _check_shape(x) + 1"),  # a check's result the code uses
        lambda s: s.replace("@decorate\n", "@decorate(noinline=True)\n"),
        lambda s: s.replace("    return helper(x) * n", "    if n:\n        return helper(x) * n\n    return helper(x)"),
    ],
    ids=["call", "constant", "check result", "decorator", "indentation"],
)
def test_key_follows_what_runs(edit):
    assert kernel_key_of(edit(SOURCE)) != kernel_key_of(SOURCE)


def kernel_key_of(source):
    return "|".join(f"{name}:{text}" for name, text in reached_definitions(source, ("entry",)))


def test_canonical_form_is_pinned():
    """The canonical text must read the same under every Python version that keys or checks records (the GPU machine
    runs 3.12, CI 3.11): empty fields (3.12's type_params) and contexts are left out."""
    import ast

    node = ast.parse("def f(a, *, b=1):\n    return a + b\n").body[0]
    assert canonical(node) == (
        "FunctionDef(name='f',args=arguments(args=[arg(arg='a')],kwonlyargs=[arg(arg='b')],kw_defaults=[Constant(value=1)]),"
        "body=[Return(value=BinOp(left=Name(id='a'),op=Add(),right=Name(id='b')))])"
    )


def test_candidate_keys_follow_their_config_and_name_the_changed_definitions(mamba2):
    kind = KernelKind.REPLAY_DECODE
    default = module_defaults(mamba2, SMALL)[kind][-1].config
    a = render_candidate(mamba2, SMALL, kind, default).key
    assert a == render_candidate(mamba2, SMALL, kind, default).key
    b = render_candidate(mamba2, SMALL, kind, KernelConfig(block_v=8, num_warps=1)).key
    assert a.code != b.code and a.kind is b.kind is kind
    assert changed_definitions(a, b) == "_REPLAY_DECODE_CONFIGS changed"
    source = render_candidate(mamba2, SMALL, kind, default).source
    edited = source.replace("b_ct = b_ch + b_lg", "b_ct = b_lg + b_ch", 1)  # the first: _replay_decode_kernel's
    assert "_replay_decode_kernel changed" in changed_definitions(a, kernel_key(edited, kind))
    other_kinds = render_candidate(mamba2, SMALL, KernelKind.BASELINE_DECODE, module_defaults(mamba2, SMALL)[KernelKind.BASELINE_DECODE][0].config).key
    assert "_replay_decode_kernel" not in dict(other_kinds.parts)
