"""A torchtitan 0.3 override for the CPU tests (``--override.imports
titan_cpu.sdpa_attention``): FlexAttention has no backward on the CPU, so the debug
models attend with scaled_dot_product_attention (causal; the tests' batches are one
document a row, as torchtitan's block-causal mask would see them)."""

from torchtitan.config.override import override
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention


@override(target=FlexAttention.Config, description="SDPA for CPU tests")
def sdpa_attention(cfg: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    return ScaledDotProductAttention.Config()
