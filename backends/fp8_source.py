"""FP8-block SOURCE checkpoints for the converter: DeepSeek-V3 / R1 / V3.1, Kimi-K2 releases (E4M3 + weight_scale_inv).

Source format (deepseek-ai/DeepSeek-V3 `README_WEIGHTS.md`, inference/fp8_cast_bf16.py): a quantized linear `X` is
`X.weight` float8_e4m3fn [N, K] and `X.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)] with (bn, bk) =
quantization_config.weight_block_size = (128, 128); everything else (embeddings, lm_head, norms, router, the FP32
`e_score_correction_bias`, MTP eh_proj / shared_head.head, `modules_to_not_convert`) is stored in torch_dtype. Which
tensors are FP8 is in the plan (`TensorPlan.source_precision`, from config.json); `check_source` holds the
checkpoint's own headers to it, tensor by tensor, before any work.

Dequantization (exact and deterministic; DeepSeek `inference/fp8_cast_bf16.py` `weight_dequant` semantics):

    w[i, j] = RN_fp32( fp32(q[i, j]) * scale_inv[i // bn, j // bk] )

  * fp32(q) decodes the E4M3 byte exactly (every E4M3 value, subnormals included, is an fp32);
  * one IEEE fp32 multiplication, round-to-nearest-even (the product of a 4-bit and a 24-bit significand can need
    28 bits, so it is rounded once, like the reference kernel's fp32 math);
  * edge blocks: the last block row / column covers only the remaining N % bn rows / K % bk columns; it uses its
    own scale_inv entry like any other block (the grid has ceil() entries), nothing is padded into the weight;
  * cast rule: the fp32 result is rounded once to BF16 (RN-even), the dtype every FP8 release declares as
    torch_dtype and the dtype the trainer's weights start from (DeepSeek's fp8_cast_bf16 writes BF16). The plan's
    format is then applied to that BF16 tensor exactly as for a BF16 source, so the converted checkpoint equals
    what the live weight-update path produces from the trainer's initial weights.

Pass-through: a tensor the plan keeps in the SAME format as the source (fp8_block, e4m3, same block, same scale
kind: `fp32` for DeepSeek-V3 / Kimi-K2 scales, `pow2` for `scale_fmt: ue8m0`) is written byte for byte (weight and
weight_scale_inv copied, no dequantize/requantize round trip).

Non-parameter buffers some releases carry (`*.rotary_emb.inv_freq`: Kimi-K2-Instruct has one per layer) are not
weights; they are accepted in the source and not written (SGLang skips them on load too).
"""

from __future__ import annotations

from typing import Optional, Sequence

from precision_dsl.plan import Plan, TensorPlan
from precision_dsl.precision import FormatKind, TensorFormat

from precision_dsl.backends.common import module_of
from precision_dsl.backends.safetensors_io import SOURCE_DTYPES, CheckpointError

SCALE_SUFFIX = "weight_scale_inv"
IGNORED_BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)
CAST_DTYPE = "bfloat16"  # see the cast rule above


# The quantized source formats this module reads (dequantizes exactly or passes through), by kind.
READABLE_SOURCE_KINDS = frozenset({FormatKind.FP8_BLOCK})


def is_fp8_block_source(t: TensorPlan) -> bool:
    sp = t.source_precision
    return sp is not None and sp.kind in READABLE_SOURCE_KINDS


def scale_name(t: TensorPlan) -> str:
    return f"{module_of(t.hf_name)}.{SCALE_SUFFIX}"


def scale_shape(t: TensorPlan) -> tuple[int, int]:
    n, k = t.shape
    bn, bk = t.source_precision.block
    return (-(-n // bn), -(-k // bk))


def passes_through(t: TensorPlan) -> bool:
    """The plan keeps this FP8-block source tensor in exactly its source format: copy bytes, do not requantize."""
    if not is_fp8_block_source(t) or not t.is_linear:
        return False
    w: TensorFormat = t.precision.weight
    sp = t.source_precision
    return (w.kind == sp.kind and w.element == sp.element and w.block == sp.block
            and (w.scale_dtype or "fp32") == (sp.scale_dtype or "fp32") and w.global_scale is None)


def auxiliary_names(plan: Plan) -> set[str]:
    """Source tensors that are not plan tensors but belong to one (the scale_inv grids)."""
    return {scale_name(t) for t in plan.tensors if is_fp8_block_source(t)}


def is_ignored_buffer(name: str) -> bool:
    return name.endswith(IGNORED_BUFFER_SUFFIXES)


def check_tensor(srcc, t: TensorPlan) -> None:
    """The checkpoint stores `t` the way the plan (its config's quantization_config) says, or a CheckpointError
    names the tensor."""
    name = t.hf_name
    dt = srcc.dtypes[name]
    hint = ("compile the plan from this checkpoint's own config.json: its quantization_config says which tensors "
            "are FP8")
    if is_fp8_block_source(t):
        sp = t.source_precision
        if sp.block is None or len(t.shape) != 2:
            raise CheckpointError(f"tensor '{name}': FP8-block source needs a 2-D weight and a block size")
        if dt != "F8_E4M3":
            raise CheckpointError(f"tensor '{name}' is {dt} in the source checkpoint, but config.json "
                                  f"quantization_config says it is stored {sp.short()} (E4M3 + weight_scale_inv)",
                                  hint)
        sname = scale_name(t)
        if sname not in srcc.where:
            raise CheckpointError(f"tensor '{name}' is FP8 but the source has no '{sname}'",
                                  "an FP8-block release stores one weight_scale_inv grid per FP8 weight")
        if srcc.dtypes[sname] != "F32":
            raise CheckpointError(f"'{sname}' is {srcc.dtypes[sname]}; DeepSeek-style FP8 scales are float32",
                                  "MXFP8 (uint8 E8M0) sources are not FP8-block checkpoints")
        if tuple(srcc.shapes[sname]) != scale_shape(t):
            raise CheckpointError(f"'{sname}' has shape {tuple(srcc.shapes[sname])}; a {t.shape} weight in "
                                  f"{sp.block[0]}x{sp.block[1]} blocks needs {scale_shape(t)}",
                                  "check quantization_config.weight_block_size")
        return
    if dt == "F8_E4M3":
        raise CheckpointError(f"tensor '{name}' is stored FP8 (E4M3) in the source checkpoint, but the plan says "
                              f"its source is {t.source_precision.short() if t.source_precision else 'BF16'}", hint)
    if dt not in SOURCE_DTYPES:
        raise CheckpointError(f"tensor '{name}' is {dt} in the source; the converter reads BF16/FP16/FP32 and "
                              "FP8-block (E4M3 + float32 weight_scale_inv) checkpoints",
                              "dequantize the checkpoint to BF16 first")


def dequantize_fp8_block(q, scale_inv, block: tuple[int, int] = (128, 128)):
    """fp32 [N, K] = fp32(q) * scale_inv broadcast over (bn x bk) blocks; edge blocks use their own entry (module
    docstring). `q`: float8_e4m3fn (or its uint8 bytes) [N, K]; `scale_inv`: float32 [ceil(N/bn), ceil(K/bk)]."""
    import torch

    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    n, k = q.shape
    bn, bk = block
    if tuple(scale_inv.shape) != (-(-n // bn), -(-k // bk)):
        raise CheckpointError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match a {(n, k)} weight "
                              f"in {bn}x{bk} blocks")
    s = scale_inv.to(torch.float32).repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return q.to(torch.float32) * s


def load_dequantized(reader, t: TensorPlan, device: str = "cpu"):
    """The source tensor as the trainer sees it: BF16 after exact dequantization (FP8-block) or as stored."""
    import torch

    # non_blocking: from the converter's pinned arena the copy overlaps; the arena is recycled only after the unit's
    # results are back on the host (same stream), and from pageable memory CUDA copies synchronously anyway
    x = reader.get(t.hf_name).to(device, non_blocking=True)
    if not is_fp8_block_source(t):
        return x
    s = reader.get(scale_name(t)).to(device, non_blocking=True)
    return dequantize_fp8_block(x, s, t.source_precision.block).to(getattr(torch, CAST_DTYPE))


def unit_tensors(units: Sequence[TensorPlan], reader, backend: str, device: str = "cpu",
                 quantize_fn=None) -> dict:
    """Output tensors (name -> tensor) of one work unit: pass-through members copied byte for byte, all others
    loaded (dequantized if FP8) and handed to `backends.quantize.checkpoint_tensors` together (share-scale groups
    need all members at once)."""
    from precision_dsl.backends.quantize import checkpoint_tensors

    quantize_fn = quantize_fn or checkpoint_tensors
    out: dict = {}
    members = []
    for t in units:
        if passes_through(t):
            mod = module_of(t.hf_name)
            out[f"{mod}.weight"] = reader.get(t.hf_name).to(device, non_blocking=True)
            out[f"{mod}.{SCALE_SUFFIX}"] = reader.get(scale_name(t)).to(device, non_blocking=True)
        else:
            members.append((t, load_dequantized(reader, t, device)))
    if members:
        out.update(quantize_fn(members, backend))
    return out


def source_summary(plan: Plan) -> Optional[str]:
    """One line for reports: how many tensors come from an FP8 source and how many pass through."""
    fp8 = [t for t in plan.tensors if is_fp8_block_source(t)]
    if not fp8:
        return None
    through = sum(1 for t in fp8 if passes_through(t))
    return (f"FP8-block source: {len(fp8)} tensors stored E4M3 + weight_scale_inv; {through} passed through "
            f"byte for byte, {len(fp8) - through} dequantized exactly (to BF16) and re-quantized to the plan")
