"""The precision choices of a shape a user can compare (`replaygen drift`): state dtype, rounding, float32 buffers."""

from __future__ import annotations

from dataclasses import replace

from replaygen.spec.model import CachedField, DType, Rounding, Spec, TargetShape

VARIANT_NAMES = ("float32", "bfloat16", "bfloat16-stochastic", "float16", "float16-stochastic", "float32-buffers")


def precision_variant(spec: Spec, shape: TargetShape, name: str) -> TargetShape:
    """`shape` with the precision choice `name` (one of VARIANT_NAMES): a float32, bfloat16 or float16 state rounded
    to nearest or stochastically, or the shape's own state with every field it caches in the activation dtype cached in
    float32."""
    if name not in VARIANT_NAMES:
        raise ValueError(f"unknown precision variant {name!r} (known: {', '.join(VARIANT_NAMES)})")
    if name == "float32-buffers":
        wide = tuple(CachedField(c.field, DType.FLOAT32) for c in spec.cache_of(shape) if c.dtype is None)
        return replace(shape, name=f"{shape.name}-f32buf", cache_dtypes=wide)
    dtype, _, rounding = name.partition("-")
    rounding_of = Rounding.STOCHASTIC if rounding else Rounding.NEAREST
    return replace(shape, name=f"{shape.name}-{name}", state_dtype=DType(dtype), rounding=rounding_of)
