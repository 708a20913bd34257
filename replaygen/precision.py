"""The precision choices of a shape a user can compare (`replaygen drift`): state dtype, rounding, float32 buffers."""

from __future__ import annotations

from dataclasses import replace

from replaygen.spec.model import CachedField, DType, Rounding, Spec, TargetShape

WIDE_BUFFERS = "float32-buffers"
VARIANT_NAMES = ("float32", "bfloat16", "bfloat16-stochastic", "float16", "float16-stochastic", WIDE_BUFFERS)


def precision_variant(spec: Spec, shape: TargetShape, name: str) -> TargetShape:
    """`shape` with the precision choice `name`: a state choice (float32, bfloat16 or float16, rounded to nearest or
    `-stochastic`), `float32-buffers` (the shape's own state, every field it caches in the activation dtype cached in
    float32), or both joined by `+` (e.g. `bfloat16-stochastic+float32-buffers`)."""
    state, plus, buffers = name.partition("+")
    if (state not in VARIANT_NAMES) or (plus and (buffers != WIDE_BUFFERS or state == WIDE_BUFFERS)):
        raise ValueError(
            f"unknown precision variant {name!r} (known: {', '.join(VARIANT_NAMES)}, and a state choice"
            f" joined with +{WIDE_BUFFERS}, e.g. bfloat16+{WIDE_BUFFERS})"
        )
    if state == WIDE_BUFFERS or plus:
        wide = tuple(CachedField(c.field, DType.FLOAT32) for c in spec.cache_of(shape) if c.dtype is None)
        shape = replace(shape, name=f"{shape.name}-f32buf", cache_dtypes=wide)
        if state == WIDE_BUFFERS:
            return shape
    dtype, _, rounding = state.partition("-")
    rounding_of = Rounding.STOCHASTIC if rounding else Rounding.NEAREST
    return replace(shape, name=f"{shape.name}-{state}", state_dtype=DType(dtype), rounding=rounding_of)
