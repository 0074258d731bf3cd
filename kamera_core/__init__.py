"""kamera_core: the Kamera operator as pure functions on tensors (no state, models or files).

Layout: token-major `[tokens, num_kv_heads, head_dim]` per layer; MLA `[tokens, kv_lora_rank]`
and `[tokens, rope_dim]`. See rope.py for the RoPE families, relocate/ for the math of moving
keys, segment/ for attention over KV read where it lies, backends.py for which implementation runs.
"""

from kamera_core.budget import allocate_ranks, budget_mixed, bytes_per_rank, mixed_bytes
from kamera_core.patch import (
    ChunkPatch,
    Factors,
    LayerPatch,
    apply_patch,
    build_patch,
    exact_patch,
    identity_factors,
    deficit,
    fit,
    fit_with_gains,
    gains,
    orbit_deficit,
    quantize,
)
from kamera_core.fit_metric import (
    OUTPUT_FITS,
    attention_mass,
    layer_normaliser,
    output_metric,
    projection_metric,
    query_second_moment,
    value_spread,
)
from kamera_core.mixed import mixed_patch, quantisation_errors
from kamera_core.relocate import (
    phases,
    relocate_keys,
    relocate_mla,
    relocate_patch,
    rotate_reference,
)
from kamera_core.rope import KVLayout, RopeSpec, UnsupportedModelError, kv_layout, model_name, rope_specs

__all__ = [
    "KVLayout",
    "RopeSpec",
    "UnsupportedModelError",
    "kv_layout",
    "model_name",
    "phases",
    "relocate_keys",
    "relocate_mla",
    "relocate_patch",
    "rope_specs",
    "rotate_reference",
    "ChunkPatch",
    "Factors",
    "LayerPatch",
    "allocate_ranks",
    "apply_patch",
    "attention_mass",
    "build_patch",
    "exact_patch",
    "identity_factors",
    "budget_mixed",
    "bytes_per_rank",
    "mixed_bytes",
    "mixed_patch",
    "quantisation_errors",
    "deficit",
    "fit",
    "fit_with_gains",
    "gains",
    "orbit_deficit",
    "output_metric",
    "layer_normaliser",
    "OUTPUT_FITS",
    "query_second_moment",
    "quantize",
    "value_spread",
    "projection_metric",
]
