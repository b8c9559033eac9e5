"""Logical axes of Qwen2's base weights by NNX path (`parallel.sharding` maps them onto the mesh;
LoRA factors follow their kernel's axes, `registry.Family.param_rules`)."""

PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed", ("vocab", "embed")),
    (r"lm_head", ("embed", "vocab")),
    (r".*norm\.weight", ("norm",)),
    (r".*attn\.(q|k|v)\.kernel", ("embed", "heads")),
    (r".*attn\.(q|k|v)\.bias", ("heads",)),
    (r".*attn\.o\.kernel", ("heads", "embed")),
    (r".*mlp\.(gate|up)\.kernel", ("embed", "mlp")),
    (r".*mlp\.down\.kernel", ("mlp", "embed")),
)
