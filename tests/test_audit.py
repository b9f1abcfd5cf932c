"""`policyc audit`: a deployment read back into the trainer's and the rollout's plans.

  * round trip: every shipped policy x tiny-moe / qwen3-30b-a3b, `emit` then `audit` of the emitted directory
    gives no disagreement and the trainer's plan has the emitted plan's content hash;
  * hand-written Miles-style deployments with known drift, each reported on the right tensors with its cause;
  * the readings against the engines' own code (megatron-core, SGLang, TE sources);
  * the CLI contract: exit 0 / 1 / 2, --json, --policy-out (atomic, never overwritten without --force).
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path

import pytest

from conftest import StrictCliRunner
from precision_dsl.arch import load_architecture
from precision_dsl.backends import megatron, sglang
from precision_dsl.backends.cli import emit_artifacts
from precision_dsl.backends.common import UnsupportedByBackend, write_tree_atomic
from precision_dsl.cli import app
from precision_dsl.engine.audit import audit
from precision_dsl.names import collapse_names
from precision_dsl.engine.audit_inputs import AuditError
from precision_dsl.resolve import parse_policy, resolve

REPO = Path(__file__).resolve().parents[1]
POLICIES = sorted(p.stem for p in (REPO / "policies").glob("*.policy"))
# the fast models; every bundled model: benchmarks/audit_roundtrip.py
ROUND_TRIP_MODELS = ["tiny-moe", "qwen3-30b-a3b", "qwen3-8b", "qwen3-0.6b", "llama-3.2-1b"]


@functools.lru_cache(maxsize=None)
def arch_of(name):
    return load_architecture(name)


def plan_of(policy: str, model: str):
    return resolve(REPO / "policies" / f"{policy}.policy", arch_of(model))


def plan_of_text(text: str, model: str):
    return resolve(parse_policy(text, "test.policy"), arch_of(model))


def emitted(plan, out: Path, rollout: str = "sglang") -> Path:
    from precision_dsl.backends.registry import EmitOptions

    write_tree_atomic(out, emit_artifacts(plan, options=EmitOptions(rollout=rollout)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------------------------------------------
CASES = [(p, m, r) for r in ("sglang", "vllm") for m in ROUND_TRIP_MODELS for p in POLICIES]


@pytest.mark.parametrize("policy,model,rollout", CASES, ids=[f"{p}-{m}-{r}" for p, m, r in CASES])
def test_emit_then_audit_agrees_and_recovers_the_plan(policy, model, rollout, tmp_path):
    from precision_dsl.diagnostics import PolicyError

    try:
        plan = plan_of(policy, model)
    except PolicyError as err:  # a dense recipe on an MoE model without dense layers, an MoE recipe on a dense
        assert "matches no tensor" in str(err)  # model: no plan, no deployment
        return
    try:
        out = emitted(plan, tmp_path / "out", rollout)
    except UnsupportedByBackend as err:  # a plan the backends refuse has no deployment to audit
        assert err.capability
        return
    res = audit([out], arch_of(model))
    assert res.agree, [(d.tensors[:2], d.trainer, d.rollout, d.cause) for d in res.disagreements[:3]]
    assert res.trainer.content_hash() == plan.content_hash()
    # the policy the audit writes resolves to the same plan
    assert plan_of_text(res.trainer_policy, model).content_hash() == plan.content_hash()
    assert any("policyc emit directory" in what and rollout in what for _, what in res.read_as)


# ---------------------------------------------------------------------------------------------------------------
# hand-written Miles-style deployments (miles scripts/run_qwen3_30b_a3b.py train_nvfp4 / rollout_nvfp4 style)
# ---------------------------------------------------------------------------------------------------------------
NVFP4_YAML = """\
configs:
  nvfp4:
    transformer_engine_config_type: TEQuantizationParams
    training_recipe: {fp4_quantization_recipe: nvfp4}
  bf16:
    transformer_engine_config_type: TEQuantizationParams
    training_recipe: {}
matchers:
  routed_experts_fc1_nvfp4: {type: glob, pattern: "*.mlp.experts.linear_fc1", config: nvfp4, enabled: true}
  routed_experts_fc2_nvfp4: {type: glob, pattern: "*.mlp.experts.linear_fc2", config: nvfp4, enabled: true}
  default_bf16: {type: glob, pattern: "*", config: bf16, enabled: true}
"""
TRAIN_ENV = {"NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "1", "NVTE_NVFP4_DISABLE_RHT": "1",
             "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1", "NVTE_NVFP4_ROW_SCALED_ACTIVATION": "1",
             "NVTE_BACKWARD_OVERRIDE": "high_precision"}
ROLLOUT_ENV = {"SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION": "1", "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH": "1",
               "TRTLLM_DISABLE_FP4_QUANT_FAST_MATH": "1"}


def miles_script(d: Path, *, exports: dict, train_env: dict, end_bf16: int, extra: list[str] = (),
                 sglang_args: str = "--sglang-moe-runner-backend flashinfer_trtllm_routed --sglang-kv-cache-dtype "
                                    "bf16") -> Path:
    (d / "te_precision.yaml").write_text(NVFP4_YAML)
    lines = ["#!/bin/bash", "set -ex"] + [f"export {k}={v}" for k, v in exports.items()] + [
        "python3 train.py \\",
        "   --hf-checkpoint ckpt \\",
        "   --transformer-impl transformer_engine --bf16 \\",
        "   --fp4-format e2m1 --fp4-recipe nvfp4 \\",
        "   --moe-grouped-gemm \\",
        f"   --first-last-layers-bf16 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 {end_bf16} \\",
        "   --te-precision-config-file te_precision.yaml \\",
        f"   --train-env-vars {shlex.quote(json.dumps(train_env))} \\",
        *[f"   {e} \\" for e in extra],
        f"   {sglang_args} \\",
        "   --rollout-num-gpus-per-engine 1 --advantage-estimator grpo"]
    p = d / "run_qwen3_nvfp4.sh"
    p.write_text("\n".join(lines) + "\n")
    return p


def nvfp4_checkpoint(d: Path, model: str, bf16_tail: str) -> Path:
    """A rollout checkpoint directory as `policyc convert` / Miles' convert_hf_to_nvfp4.py write it (config only)."""
    plan = plan_of_text(f'policy "c" {{\n target blackwell\n default bf16\n routed_experts: nvfp4(act_scale=per_token, '
                        f'weight_scale=per_tensor)\n share_scale routed_experts.{{gate, up}}\n {bf16_tail}\n}}', model)
    cfg = json.loads((REPO / "precision_dsl" / "models" / model / "config.json").read_text())
    cfg["quantization_config"] = sglang.rollout_config(plan).quantization_config
    ck = d / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def test_miles_deployment_that_agrees(tmp_path):
    nvfp4_checkpoint(tmp_path, "tiny-moe", "layers[-1:]: bf16")
    script = miles_script(tmp_path, exports=ROLLOUT_ENV, train_env=TRAIN_ENV, end_bf16=1)
    res = audit([script], arch_of("tiny-moe"))
    assert res.agree, [(d.tensors[:2], d.cause) for d in res.disagreements]
    kinds = {t.hf_name: t.weight.kind.value for t in res.trainer.tensors}
    assert kinds["model.layers.0.mlp.experts.3.down_proj.weight"] == "nvfp4"
    assert kinds["model.layers.3.mlp.experts.3.down_proj.weight"] == "bf16"
    whats = " ".join(w for _, w in res.read_as)
    assert "Miles launch script" in whats and "rollout checkpoint" in whats


def test_drift_missing_row_scaled_activation(tmp_path):
    nvfp4_checkpoint(tmp_path, "tiny-moe", "layers[-1:]: bf16")
    env = {k: v for k, v in TRAIN_ENV.items() if k != "NVTE_NVFP4_ROW_SCALED_ACTIVATION"}
    res = audit([miles_script(tmp_path, exports=ROLLOUT_ENV, train_env=env, end_bf16=1)], arch_of("tiny-moe"))
    assert len(res.disagreements) == 2  # gate/up (shared scale) and down
    names = {n for d in res.disagreements for n in d.tensors}
    assert names == {t.hf_name for t in arch_of("tiny-moe").tensors if t.role.startswith("routed_experts.")
                     and t.layer < 3}
    for d in res.disagreements:
        assert "NVTE_NVFP4_ROW_SCALED_ACTIVATION unset" in d.cause
        assert "A:nvfp4[1x16,per_tensor]" in d.trainer and "A:nvfp4[1x16,per_token]" in d.rollout


def test_drift_end_layers_differ_from_the_checkpoint(tmp_path):
    nvfp4_checkpoint(tmp_path, "tiny-moe", "layers[-1:]: bf16")  # the checkpoint keeps only layer 3 BF16
    res = audit([miles_script(tmp_path, exports=ROLLOUT_ENV, train_env=TRAIN_ENV, end_bf16=2)], arch_of("tiny-moe"))
    names = {n for d in res.disagreements for n in d.tensors}
    assert names == {t.hf_name for t in arch_of("tiny-moe").tensors if t.role.startswith("routed_experts.")
                     and t.layer == 2}
    assert all("--num-layers-at-end-in-bf16 2" in d.cause and d.trainer == "bf16" for d in res.disagreements)
    assert collapse_names(sorted(names), brace_single=False)[0][0].startswith("model.layers.2.mlp.experts.{0-7}.")


def test_drift_env_var_set_on_the_trainer_only(tmp_path):
    """SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION in --train-env-vars reaches the trainer actors only: the
    rollout's FlashInfer MoE then uses the checkpoint's static per-tensor input_scale."""
    nvfp4_checkpoint(tmp_path, "tiny-moe", "layers[-1:]: bf16")
    exports = {k: v for k, v in ROLLOUT_ENV.items() if k != "SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION"}
    train_env = {**TRAIN_ENV, "SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION": "1"}
    res = audit([miles_script(tmp_path, exports=exports, train_env=train_env, end_bf16=1)], arch_of("tiny-moe"))
    assert res.disagreements
    for d in res.disagreements:
        assert "SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION unset" in d.cause
        assert "per_token" in d.trainer and "A:nvfp4[1x16,per_tensor]" in d.rollout
    # the same variable exported for everyone: agreement
    ok = audit([miles_script(tmp_path, exports=ROLLOUT_ENV, train_env=train_env, end_bf16=1)], arch_of("tiny-moe"))
    assert ok.agree


def test_drift_shared_experts_fused_and_quantized_by_sglang(tmp_path):
    """DeepSeek-V3 MXFP8 with BF16 shared experts: a launch without --disable-shared-experts-fusion makes SGLang
    load each shared expert into the routed MXFP8 FusedMoE."""
    plan = plan_of("mxfp8-e2e", "deepseek-v3")
    out = emitted(plan, tmp_path / "out")
    cfg = sglang.rollout_config(plan)
    args = [a for a in cfg.server_args if a != "--disable-shared-experts-fusion"]
    launch = tmp_path / "launch_sglang.sh"
    launch.write_text("python -m sglang.launch_server --model-path ckpt " + shlex.join(args) + "\n")
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({**json.loads(
        (REPO / "precision_dsl/models/deepseek-v3/config.json").read_text()),
        "quantization_config": cfg.quantization_config}))
    res = audit([out / "megatron" / "flags.json", launch, ck], arch_of("deepseek-v3"))
    names = {n for d in res.disagreements for n in d.tensors}
    routed_q = {t.layer for t in plan.tensors if t.role.startswith("routed_experts.") and t.mtp is None
                and t.weight.is_quantized}
    assert names and all(".mlp.shared_experts." in n for n in names)
    assert len([n for n in names if ".layers.61." not in n]) == 3 * len(routed_q)
    assert all("one more expert of the routed FusedMoE" in d.cause for d in res.disagreements)
    assert all(d.trainer == "bf16" and d.rollout.startswith("W:mxfp8") for d in res.disagreements)
    # with the flag (as policyc emits it): agreement
    assert audit([out], arch_of("deepseek-v3")).agree


def test_drift_substring_list_misses_mtp_layers(tmp_path):
    """The trainer's YAML quantizes the MTP layer's experts (FP8 recipes open an MTP autocast); the Miles exception
    list meant to keep them BF16, `.mtp.layers.`, never matches: megatron names start `mtp.layers.0.`. The
    checkpoint (converted with the shipped policy) keeps the MTP layer BF16."""
    trainer_plan = plan_of_text('policy "t" {\n extends "mxfp8-e2e.policy"\n mtp.routed_experts: mxfp8 '
                                'backward=quantized\n}', "deepseek-v3")
    cfg = megatron.trainer_config(trainer_plan)
    out = emitted(plan_of("mxfp8-e2e", "deepseek-v3"), tmp_path / "out")
    flags = cfg.flags
    yaml_name = flags[flags.index("--te-precision-config-file") + 1]
    import yaml

    (tmp_path / yaml_name).write_text(yaml.safe_dump(cfg.yamls[yaml_name], sort_keys=False))
    script = tmp_path / "run_dsv3.sh"
    script.write_text("\n".join(["#!/bin/bash", *[f"export {k}={v}" for k, v in cfg.env.items()],
                                 "python3 train.py " + shlex.join(flags) + " \\",
                                 "  --extra-high-precision-layers-megatron .mtp.layers. \\",
                                 "  --sglang-disable-shared-experts-fusion --sglang-kv-cache-dtype bf16"]) + "\n")
    res = audit([script, out / "sglang" / "quantization_config.json"], arch_of("deepseek-v3"))
    names = {n for d in res.disagreements for n in d.tensors}
    assert names == {t.hf_name for t in arch_of("deepseek-v3").tensors if t.mtp is not None
                     and t.role.startswith("routed_experts.")}
    assert all("'.mtp.layers.'" in d.cause and d.rollout == "bf16" for d in res.disagreements)
    # the list written right (a substring of the megatron names) keeps the published MTP experts BF16
    script.write_text(script.read_text().replace(".mtp.layers.", "mtp.layers."))
    assert audit([script, out / "sglang" / "quantization_config.json"], arch_of("deepseek-v3")).agree


# ---------------------------------------------------------------------------------------------------------------
# the readings against the engines' own code
# ---------------------------------------------------------------------------------------------------------------
def test_megatron_reading_of_a_hand_written_yaml_is_megatron_cores(tmp_path):
    """megatron-core 0.16.1's own config + matcher code (tests/megatron_oracle.py) on a Miles-style YAML with
    pipeline stages and first/last BF16 layers: the audit's reading runs the same recipe per module."""
    import megatron_oracle as mo
    import yaml

    arch = arch_of("qwen3-30b-a3b")
    doc = NVFP4_YAML.replace('"*.mlp.experts.linear_fc2"', '"decoder.layers.1.mlp.experts.linear_fc2"')
    (tmp_path / "te.yaml").write_text(doc)
    flags = ["--transformer-impl", "transformer_engine", "--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4",
             "--moe-grouped-gemm", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "1",
             "--num-layers-at-end-in-bf16", "3", "--pipeline-model-parallel-size", "4",
             "--te-precision-config-file", "te.yaml"]
    mo.load()
    config = mo.build_config(arch, flags, tmp_path)
    modules = sorted({megatron.megatron_module(t.megatron_name) for t in arch.tensors if t.is_linear
                      and t.megatron_name and t.megatron_name.startswith("decoder.")})
    oracle = mo.read_modules(config, modules)
    ours = megatron.explain_modules(flags, {"te.yaml": yaml.safe_load(doc)}, modules, arch.num_layers)
    assert {m: r.kind for m, r in ours.items()} == {m: rd.kind for m, (_, rd) in oracle.items()}
    # stage-local matching: decoder.layers.1 is global layer 1, 13, 25 (and 37, in the BF16 tail's stage)
    fc2 = {int(m.split(".")[2]) for m, r in ours.items() if m.endswith("linear_fc2") and r.kind == "nvfp4"}
    assert fc2 == {1, 13, 25, 37} - set(range(45, 48))


def test_sglang_reading_of_a_hand_written_launch_is_sglangs(sglang_oracle, tmp_path):
    """SGLang 0.5.23's own server-args resolution, loader and quant methods (tests/oracles/sglang_oracle.py) on a
    DeepSeek-V3 MXFP8 checkpoint launched without --disable-shared-experts-fusion: the audit's rollout reading
    (shared experts fused into the routed FusedMoE) is what SGLang runs."""
    from oracles.sglang_oracle import model_dir_for

    plan = plan_of("mxfp8-e2e", "deepseek-v3")
    arch = arch_of("deepseek-v3")
    cfg = sglang.rollout_config(plan)
    args = [a for a in cfg.server_args if a != "--disable-shared-experts-fusion"]
    launch = sglang_oracle.launch(model_dir_for(plan, arch, tmp_path), args, cfg.env, arch, plan.target)
    ours = sglang.rollout_tensors(cfg.quantization_config, cfg.env, args, arch)
    assert launch.shared_experts_fused == 1
    assert launch.kinds and {n: ours[n].kind for n in launch.kinds} == launch.kinds


def test_drift_vllm_launch_without_the_per_token_override(tmp_path):
    """A hand-written `vllm serve` without the `moe.activation nvfp4_per_token` override: vLLM's ModelOpt NVFP4 MoE
    uses the checkpoint's static input_scale while the trainer scales per token."""
    from precision_dsl.backends import vllm

    plan = plan_of("miles-nvfp4", "tiny-moe")
    out = emitted(plan, tmp_path / "out", "vllm")
    args = json.loads((out / vllm.MANIFEST).read_text())["engine_args"]
    i = args.index("--quantization-config")
    launch = tmp_path / "serve.sh"
    launch.write_text("VLLM_USE_DEEP_GEMM=0 vllm serve /ckpt " + shlex.join(args[:i] + args[i + 2:]) + "\n")
    res = audit([out / "megatron" / "flags.json", launch], arch_of("tiny-moe"))
    assert res.disagreements and all("static per-tensor input_scale" in d.cause for d in res.disagreements)
    assert {n for d in res.disagreements for n in d.tensors} == {
        t.hf_name for t in plan.tensors if t.role.startswith("routed_experts.") and t.weight.is_quantized}


def test_vllm_reading_of_a_hand_written_launch_is_vllms(tmp_path):
    """vLLM 0.33's own engine-arg parser and quant methods (tests/oracles/vllm_oracle.py) on a hand-edited Hopper
    launch of a dense model whose exclusion list lost the last layer's MLP: the audit's serving reading is what
    vLLM builds, module by module (the lost entries now served in FP8-block)."""
    from oracles import vllm_oracle
    from precision_dsl.backends import vllm
    from test_vllm_judge import model_dir_for, module_of_tensor

    plan = plan_of("fp8-blockwise-hopper", "qwen3-0.6b")
    arts = {a.path: a.data() for a in vllm.emit(plan)}
    manifest = json.loads(arts[vllm.MANIFEST])
    args = list(manifest["engine_args"])
    i = args.index("--hf-overrides") + 1
    qcfg = json.loads(args[i])["quantization_config"]
    last = plan.num_layers - 1
    qcfg["ignored_layers"] = [e for e in qcfg["ignored_layers"] if f"layers.{last}.mlp" not in e]
    args[i] = json.dumps({"quantization_config": qcfg})
    modules = vllm_oracle.vllm_modules(vllm.VLLM_VERSION, model_dir_for(plan, "qwen3-0.6b"), args)
    ours = vllm.serve_tensors(qcfg, None, manifest["env"], arch_of("qwen3-0.6b"))
    where = module_of_tensor(modules, plan)
    names = [n for n in where if n in ours]  # a tied lm_head answers for model.embed_tokens.weight
    assert len(names) > 100 and {n: ours[n].weight for n in names} == {n: where[n][1].weight for n in names}
    assert ours[f"model.layers.{last}.mlp.down_proj.weight"].kind == "fp8_block"


def test_te_reads_the_env_the_trainer_reading_keys_on():
    """The NVFP4 activation scope and the backward mode are read from the variables TE itself reads."""
    import te_oracle
    from precision_dsl.backends.versions import TESTED

    version = TESTED["transformer-engine"]
    for var in ("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "NVTE_BACKWARD_OVERRIDE", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"):
        assert te_oracle.reads_env(version, var), f"TE {version} does not read {var}"


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------
def test_cli_agree_json_and_policy_out(tmp_path):
    plan = plan_of("miles-nvfp4", "tiny-moe")
    out = emitted(plan, tmp_path / "out")
    r = StrictCliRunner().invoke(app, ["audit", str(out), "--model", "tiny-moe"])
    assert r.exit_code == 0, r.output
    assert "agree" in r.output and plan.content_hash() in r.output
    r = StrictCliRunner().invoke(app, ["audit", str(out), "--model", "tiny-moe", "--json"])
    doc = json.loads(r.output)
    assert doc["agree"] is True and doc["disagreements"] == []
    assert doc["trainer"]["content_hash"] == plan.content_hash() and doc["rollout"]["tensors"]
    pol = tmp_path / "recovered.policy"
    r = StrictCliRunner().invoke(app, ["audit", str(out), "--model", "tiny-moe", "--policy-out", str(pol)])
    assert r.exit_code == 0 and pol.is_file()
    assert resolve(pol, arch_of("tiny-moe")).content_hash() == plan.content_hash()
    r = StrictCliRunner().invoke(app, ["audit", str(out), "--model", "tiny-moe", "--policy-out", str(pol)])
    assert r.exit_code == 2 and "--force" in r.output
    r = StrictCliRunner().invoke(app, ["audit", str(out), "--model", "tiny-moe", "--policy-out", str(pol), "--force"])
    assert r.exit_code == 0


def test_cli_disagreement_exits_1_with_the_cause(tmp_path):
    nvfp4_checkpoint(tmp_path, "tiny-moe", "layers[-1:]: bf16")
    script = miles_script(tmp_path, exports=ROLLOUT_ENV, train_env=TRAIN_ENV, end_bf16=2)
    r = StrictCliRunner().invoke(app, ["audit", str(script), "--model", "tiny-moe"], terminal_width=250)
    assert r.exit_code == 1, r.output
    assert "model.layers.2.mlp.experts.{0-7}" in r.output and "--num-layers-at-end-in-bf16 2" in r.output
    r = StrictCliRunner().invoke(app, ["audit", str(script), "--model", "tiny-moe", "--json"])
    doc = json.loads(r.output)
    assert doc["agree"] is False and sum(d["count"] for d in doc["disagreements"]) == 24


@pytest.mark.parametrize("content,why", [
    ("just some words\n", "cannot tell what"),
    ('{"flags": 3, "te_precision_files": []}', ""),
    ("python train.py --fp4-format e2m1 --fp4-recipe nvfp4 --te-precision-config-file missing.yaml\n",
     "missing.yaml"),
    ("python train.py --train-env-vars '{not json' --bf16\n", "--train-env-vars"),
    ("configs: {a: 1\nmatchers: [\n", "not YAML"),
])
def test_cli_unreadable_input_exits_2(tmp_path, content, why):
    p = tmp_path / "input.txt"
    p.write_text(content)
    r = StrictCliRunner().invoke(app, ["audit", str(p), "--model", "tiny-moe"])
    assert r.exit_code == 2, r.output
    assert why in r.output


def test_cli_missing_path_and_binary_file(tmp_path):
    r = StrictCliRunner().invoke(app, ["audit", str(tmp_path / "nope"), "--model", "tiny-moe"])
    assert r.exit_code == 2 and "does not exist" in r.output
    b = tmp_path / "blob.bin"
    b.write_bytes(b"\xff\xfe\x00garbage")
    r = StrictCliRunner().invoke(app, ["audit", str(b), "--model", "tiny-moe"])
    assert r.exit_code == 2 and "UTF-8" in r.output
    with pytest.raises(AuditError):
        audit([], arch_of("tiny-moe"))


def test_readme_example_finds_both_drifts():
    """The README's worked example (examples/audit/) reports exactly its two drifts."""
    r = StrictCliRunner().invoke(app, ["audit", str(REPO / "examples/audit/run_tiny_nvfp4.sh"), "--model", "tiny-moe",
                                       "--json"])
    assert r.exit_code == 1
    doc = json.loads(r.output)
    causes = [d["cause"] for d in doc["disagreements"]]
    assert sum(d["count"] for d in doc["disagreements"]) == 72
    assert sum("NVTE_NVFP4_ROW_SCALED_ACTIVATION unset" in c for c in causes) == 2
    assert sum("--num-layers-at-end-in-bf16 2" in c for c in causes) == 2
