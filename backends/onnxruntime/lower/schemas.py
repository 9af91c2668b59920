"""Teach onnx (and so onnxscript) the ONNX Runtime operators graphopt emits.

onnxscript builds a node from the op's ``onnx.defs.OpSchema``: it maps positional
arguments to inputs and keywords to attributes with it, and refuses an op it has no
schema for. ONNX Runtime's fused ops (``com.microsoft`` contrib ops, and
``SimplifiedLayerNormalization``, which ORT registers in the default domain) are not in
onnx's registry, so we register them, built from the schemas ORT itself ships
(``get_all_operator_schema()``): inputs, optional outputs, type constraints and
attribute defaults are then exactly what the runtime that executes the model expects.
"""

from __future__ import annotations

import functools

import onnx
from onnx.defs import OpSchema

MS_DOMAIN = "com.microsoft"

# (domain, name) of every ORT operator a translation may emit that onnx does not define.
ORT_OPS: tuple[tuple[str, str], ...] = (
    ("", "SimplifiedLayerNormalization"),
    (MS_DOMAIN, "SkipSimplifiedLayerNormalization"),
    (MS_DOMAIN, "SkipLayerNormalization"),
    (MS_DOMAIN, "BiasGelu"),
    (MS_DOMAIN, "FastGelu"),
    (MS_DOMAIN, "Gelu"),
    (MS_DOMAIN, "RotaryEmbedding"),
    (MS_DOMAIN, "MultiHeadAttention"),
    (MS_DOMAIN, "GroupQueryAttention"),
    (MS_DOMAIN, "MatMulNBits"),
    (MS_DOMAIN, "GatherBlockQuantized"),
    (MS_DOMAIN, "FusedMatMul"),  # a block-quantized weight's offsets (translations/quant_blocks.py)
    (MS_DOMAIN, "MoE"),
    (MS_DOMAIN, "QMoE"),
)
# Standard ONNX ops a graphopt op lowers to (graphopt.layer_norm) that still count as fused.
STANDARD_FUSED_OPS: tuple[str, ...] = ("LayerNormalization",)
# Every fused op as ``OnnxModel.op_histogram`` spells it (``com.microsoft::MatMulNBits``): the
# fused-op counts of an exported model read this set, so a new ORT op is one entry above.
FUSED_OP_NAMES: frozenset[str] = frozenset(
    {f"{domain}::{name}" if domain else name for domain, name in ORT_OPS} | set(STANDARD_FUSED_OPS))


@functools.cache
def register_ort_schemas() -> tuple[str, ...]:
    """Register ORT_OPS with onnx.defs (once per process); returns the names registered."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

    wanted = set(ORT_OPS)
    shipped = {}
    for schema in ort_c.get_all_operator_schema():
        key = (schema.domain, schema.name)
        # ORT ships several versions of some ops; the newest is what its kernels implement.
        if key in wanted and (key not in shipped or schema.since_version > shipped[key].since_version):
            shipped[key] = schema
    missing = sorted(wanted - set(shipped))
    if missing:
        import onnxruntime

        names = ", ".join(f"{d or 'ai.onnx'}::{n}" for d, n in missing)
        raise RuntimeError(f"onnxruntime {onnxruntime.__version__} lacks {names}; upgrade: pip install -U onnxruntime")
    registered = []
    for (domain, name), ort_schema in sorted(shipped.items()):
        if onnx.defs.has(name, domain):
            continue  # registered earlier in this process (or a future onnx defines it)
        onnx.defs.register_schema(_to_onnx_schema(ort_schema))
        registered.append(f"{domain or 'ai.onnx'}::{name}")
    return tuple(registered)


def _to_onnx_schema(ort_schema) -> OpSchema:
    def param(p) -> OpSchema.FormalParameter:
        option = getattr(OpSchema.FormalParameterOption, p.option.name)
        return OpSchema.FormalParameter(p.name, p.typeStr, param_option=option)

    attributes = []
    for name, attr in ort_schema.attributes.items():
        default = attr._default_value
        if default:
            proto = onnx.AttributeProto()
            proto.ParseFromString(default)
            attributes.append(OpSchema.Attribute(name, proto))
        else:
            attributes.append(OpSchema.Attribute(name, getattr(OpSchema.AttrType, attr.type.name), required=attr.required))
    return OpSchema(
        ort_schema.name,
        ort_schema.domain,
        ort_schema.since_version,
        inputs=[param(p) for p in ort_schema.inputs],
        outputs=[param(p) for p in ort_schema.outputs],
        type_constraints=[(c.type_param_str, list(c.allowed_type_strs), "") for c in ort_schema.type_constraints],
        attributes=attributes,
    )
