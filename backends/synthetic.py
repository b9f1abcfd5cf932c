"""Random HF safetensors checkpoints for an architecture (tests and benchmarks/convert.py), and the Megatron-core
trainer state the same weights make (`megatron_weights`, `megatron_shard`: the sharded-update test and benchmark).

`write_synthetic_checkpoint(arch, dst, shards=3)` writes every tensor of `arch` with the catalog's shapes, split
over `shards` files (+ model.safetensors.index.json, config.json, a tokenizer stand-in). Tensors are assigned to
shards in catalog order by cumulative size, so gate/up of one expert can straddle a shard boundary (the converter
must handle that). Deterministic for a given seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def write_synthetic_checkpoint(arch, dst: Path, shards: int = 3, seed: int = 0, dtype: str = "bfloat16",
                               scale: float = 0.05, split_after: Optional[str] = None) -> Path:
    """Write a random checkpoint for `arch` into `dst`. `split_after`: force a shard boundary right after this
    tensor name (used to put gate and up of one expert into different shards)."""
    import torch
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)
    total = sum(t.numel for t in arch.tensors)
    per = max(total // shards, 1)
    groups: list[list] = [[]]
    acc = 0
    for t in arch.tensors:
        if (acc >= per * len(groups) and len(groups) < shards) and groups[-1]:
            groups.append([])
        groups[-1].append(t)
        acc += t.numel
        if split_after is not None and t.hf_name == split_after and len(groups) < shards:
            groups.append([])
    groups = [grp for grp in groups if grp]
    n = len(groups)
    weight_map = {}
    for i, grp in enumerate(groups):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for t in grp:
            if t.role.startswith("norm."):
                x = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
            else:
                x = torch.randn(t.shape, generator=g) * scale
            tensors[t.hf_name] = x.to(tdt).contiguous()
            weight_map[t.hf_name] = fname
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
        del tensors
    if n > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=2))
    (dst / "config.json").write_text(json.dumps(arch.config, indent=2))
    (dst / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (dst / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    return dst


def write_fp8_block_checkpoint(arch, dst: Path, shards: int = 2, seed: int = 0, scale: float = 0.05,
                               inv_freq: bool = False) -> Path:
    """Write a random FP8-block RELEASE of `arch` (DeepSeek-V3 / Kimi-K2 layout): every tensor whose
    `source_format` is fp8_block (from config.json quantization_config) as `X.weight` float8_e4m3fn +
    `X.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)] (quantized with precision_dsl.formats' FP8-block reference,
    which produces the DeepSeek checkpoint convention: dequant = q * scale_inv); everything else in its logical
    dtype. The scale grid is written right after its weight, in the same shard. `inv_freq`: also write a
    `model.layers.N.self_attn.rotary_emb.inv_freq` buffer per decoder layer, as the Kimi-K2-Instruct release does."""
    import torch
    from safetensors.torch import save_file

    from precision_dsl.backends.fp8_source import READABLE_SOURCE_KINDS
    from precision_dsl.formats import quantize

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    names = [t.hf_name for t in arch.tensors]
    per = -(-len(names) // shards)
    weight_map = {}
    n_files = -(-len(names) // per)
    for i in range(n_files):
        fname = "model.safetensors" if n_files == 1 else f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        tensors = {}
        for t in arch.tensors[i * per:(i + 1) * per]:
            if t.role.startswith("norm."):
                x = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
            else:
                x = torch.randn(t.shape, generator=g) * scale
            x = x.to(getattr(torch, t.dtype))
            sf = t.source_format
            if sf is not None and sf.kind in READABLE_SOURCE_KINDS:  # the source formats the converter reads
                q = quantize(x, sf, axis="row")
                n, k = t.shape
                mod = t.hf_name.rsplit(".", 1)[0]
                tensors[t.hf_name] = q.data.reshape(n, k).view(torch.float8_e4m3fn).contiguous()
                tensors[f"{mod}.weight_scale_inv"] = q.scale[:-(-n // sf.block[0]), :-(-k // sf.block[1])] \
                    .to(torch.float32).contiguous()
                weight_map[f"{mod}.weight_scale_inv"] = fname
            else:
                tensors[t.hf_name] = x.contiguous()
            weight_map[t.hf_name] = fname
            if inv_freq and t.hf_name.endswith("self_attn.kv_a_layernorm.weight"):
                name = t.hf_name.replace("kv_a_layernorm.weight", "rotary_emb.inv_freq")
                tensors[name] = torch.rand(8, generator=g).to(torch.bfloat16)
                weight_map[name] = fname
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
    if n_files > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=2))
    (dst / "config.json").write_text(json.dumps(arch.config, indent=2))
    return dst


def megatron_weights(plan, config: dict, hf: dict) -> dict:
    """The full Megatron-core weights of HF tensors `hf`, by the plan's Megatron names: linear_fc1 = cat([gate, up])
    along rows, linear_qkv grouped per KV head ([q heads of the group, k, v] per group, as megatron-core's
    SelfAttention splits it), everything else as is."""
    import torch

    hd, ng = config["head_dim"], config["num_key_value_heads"]
    parts_of: dict = {}
    for t in plan.tensors:
        parts_of.setdefault(t.megatron_name, {})[t.megatron_part] = hf[t.hf_name]
    out = {}
    for name, parts in parts_of.items():
        if set(parts) == {None}:
            out[name] = parts[None]
        elif set(parts) == {"gate", "up"}:
            out[name] = torch.cat([parts["gate"], parts["up"]], 0)
        else:
            h = parts["q"].shape[1]
            out[name] = torch.cat([parts[p].reshape(ng, -1, hd, h) for p in ("q", "k", "v")], 1).reshape(-1, h)
    return out


def megatron_shard(meg: dict, layout, rank: int, num_experts: int) -> dict:
    """What trainer rank `rank` of `layout` (weight_update.sharded.ShardedLayout) holds of `meg`: dense weights split
    over tp (row-parallel linear_proj / linear_fc2 along K, column-parallel ones along rows with gate and up split
    separately), routed experts over ep (renumbered locally) then etp the same way."""
    import torch

    tr, er, xr = layout.trainer_coords(rank)
    tp, etp = layout.trainer_tp, layout.trainer_etp
    e_local = num_experts // layout.trainer_ep
    st = {}
    for n, x in meg.items():
        if ".mlp.experts.linear_fc" in n:
            base, e = n.rsplit("weight", 1)
            if int(e) // e_local != er:
                continue
            if "linear_fc2" in n:
                y = x.chunk(etp, 1)[xr]
            else:
                g, u = x.chunk(2, 0)
                y = torch.cat([g.chunk(etp, 0)[xr], u.chunk(etp, 0)[xr]], 0)
            st[f"{base}weight{int(e) % e_local}"] = y.contiguous()
        elif n.endswith(("linear_proj.weight", "linear_fc2.weight")):
            st[n] = x.chunk(tp, 1)[tr].contiguous()
        elif n.endswith("linear_fc1.weight"):
            g, u = x.chunk(2, 0)
            st[n] = torch.cat([g.chunk(tp, 0)[tr], u.chunk(tp, 0)[tr]], 0)
        elif n.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            st[n] = x.chunk(tp, 0)[tr].contiguous()
        else:
            st[n] = x
    return st
