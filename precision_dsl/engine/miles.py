"""`policyc run --engine miles`: emit the complete Miles launch for a plan (and optionally execute it).

Everything precision-related comes from the plan through the project's backends, so trainer, converter, rollout and
live update read ONE contract (radixark/miles at 31f1ca9: miles/utils/arguments.py, tools/convert_hf_to_*.py,
miles/backends/megatron_utils/actor.py for the live update):

  megatron/   Megatron-LM flags + TE per-module precision YAML + NVTE_* env      (precision_dsl.backends.megatron.emit)
  sglang/     SGLang server args (passed to Miles as --sglang-*), quantization_config, env (precision_dsl.backends.sglang.emit)
  policyc_plan.json   the plan (with content hash) the converter, trainer and rollout check against
  launch_miles.sh     1) env  2) `policyc convert HF --policy P --out CKPT` -> rollout checkpoint (the live exporter
                      reads ITS quantization_config)  3) Miles train.py with the flags above + live-update settings,
                      --rollout-num-gpus-per-engine = rollout TP (Miles overwrites SGLang's tp_size with it) and the
                      TE env also in --train-env-vars (Miles builds the trainer actors' env from it)
  launch_args.txt     the train.py argv (plan hash in its header)

Absolute paths throughout ($HERE is the script's directory, resolved at run time; the policy path is absolute).
The gate of `policyc check`/`emit` runs first: a plan it refuses gets no launch.

`--launch` runs the script only where Miles is importable; otherwise a clear error (the script is still written).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
from pathlib import Path
from typing import Optional
from ..errors import PolicycError

from ..arch import load_architecture
from ..backends import megatron, sglang, versions
from ..backends.common import plan_artifact
from ..backends.registry import EmitOptions
from ..parallel import parse_parallel
from .gate import run_gate
from .plans import load_plan, policy_path


class MilesError(PolicycError, RuntimeError):
    def __init__(self, message: str, hint: str = "", code: int = 2):
        super().__init__(message)
        self.hint, self.code = hint, code


# GRPO settings of the ablation in the Miles MXFP8/NVFP4 RL blog (lmsys.org/blog/2026-07-29-mxfp8-nvfp4-rl): 8 samples
# per prompt, KL diagnostic with coef 0, R3.
RL_FLAGS = [
    "--advantage-estimator", "grpo",
    "--n-samples-per-prompt", "8",
    "--use-kl-loss", "--kl-loss-coef", "0.0",
    "--use-rollout-routing-replay",
    "--weight-decay", "0.0",  # blog: 0 weight decay on low-precision weights (Miles has no per-tensor switch)
]
# Live weight update (miles/utils/arguments.py): broadcast from Megatron to SGLang, then the post-update equality
# check of Miles; the exporter quantizes with the ROLLOUT checkpoint's quantization_config (= policyc convert).
LIVE_UPDATE_FLAGS = ["--update-weight-transfer-mode", "broadcast", "--check-weight-update-equal",
                     "--check-weight-update-selector", "all"]


MILES_COMMIT = "31f1ca961a"  # radixark/miles commit this emitter was written against (benchmarks/miles_args_check.py)


def _sglang_passthrough(server_args: list[str]) -> list[str]:
    """SGLang server args -> Miles `--sglang-*` passthrough flags (Miles prefixes SGLang's own names)."""
    out = []
    for a in server_args:
        out.append("--sglang-" + a[2:] if a.startswith("--") else a)
    return out


def _fix_te_yaml_path(flags: list[str], base: str) -> list[str]:
    out = list(flags)
    for i, a in enumerate(out[:-1]):
        if a == "--te-precision-config-file":
            out[i + 1] = f"{base}/megatron/{out[i + 1]}"
    return out


def _flag(args: list[str], name: str) -> Optional[str]:
    return args[args.index(name) + 1] if name in args else None


def build_launch(plan, policy_file: Path, model: str, parallel: Optional[str] = None,
                 te_version: Optional[str] = None) -> tuple[str, dict[str, str], list]:
    """(script text, env, artifacts). Pure: nothing is written. Raises UnsupportedByBackend like `policyc emit`."""
    import json

    
    mcfg = megatron.trainer_config(plan, te_version)
    scfg = sglang.rollout_config(plan)
    arts = list(megatron.emit(plan, te_version)) + list(sglang.emit(plan))
    arts.append(plan_artifact(plan, "the plan (content hash checked by consumers)"))
    env = dict(mcfg.env)
    env.update(scfg.env)
    rollout = plan.parallel.rollout if plan.parallel else None
    gpus_per_engine = str(rollout.tp if rollout else int(_flag(scfg.server_args, "--tp-size") or 1))
    # Miles overwrites SGLang's tp_size with --rollout-num-gpus-per-engine (miles/backends/sglang_utils/arguments.py
    # validate_args); passing both, equal, keeps SGLang's own tp/ep check satisfied.
    sg_args = _sglang_passthrough(scfg.server_args)
    if _flag(sg_args, "--sglang-tp-size") not in (None, gpus_per_engine):
        raise MilesError(f"rollout TP {_flag(sg_args, '--sglang-tp-size')} differs from the GPUs per engine "
                         f"{gpus_per_engine}")
    # Miles starts the trainer actors with its own env dict plus --train-env-vars (miles/ray/train/
    # actor_factory.py): the TE settings travel there too, not only through the driver's environment.
    train_env = json.dumps(dict(sorted(mcfg.env.items())), separators=(",", ":"))
    train_flags = (["--hf-checkpoint", '"$ROLLOUT_CKPT"', "--ref-load", '"$REF_LOAD"',
                    "--rollout-num-gpus-per-engine", gpus_per_engine, "--train-env-vars", shlex.quote(train_env)]
                   + _fix_te_yaml_path(mcfg.flags, '"$HERE"') + sg_args + RL_FLAGS + LIVE_UPDATE_FLAGS)
    q = shlex.quote
    policy_abs = str(Path(policy_file).resolve())
    convert = ["policyc", "convert", '"$HF_CKPT"', "--policy", q(policy_abs), "--model", q(_model_ref(model)),
               "--out", '"$ROLLOUT_CKPT"']
    if parallel:
        convert += ["--parallel", q(parallel)]
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by policyc for policy {plan.policy_name!r} on {plan.model} -- plan {plan.content_hash()}",
        f"# Targets: Miles radixark/miles@{MILES_COMMIT} (its argument parser), Megatron-LM core_v0.16.1 / "
        f"{versions.header(mcfg.requires)}, SGLang {versions.TESTED['sglang']} (Miles passthrough --sglang-*).",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'HF_CKPT="${HF_CKPT:?set HF_CKPT to the BF16 HF checkpoint directory of ' + plan.model + '}"',
        'ROLLOUT_CKPT="${ROLLOUT_CKPT:-$HERE/rollout-ckpt}"',
        'REF_LOAD="${REF_LOAD:?set REF_LOAD to the Megatron torch_dist checkpoint of the model}"',
        'MILES_DIR="${MILES_DIR:?set MILES_DIR to a Miles checkout}"',
        "",
        "# 1. environment: TE numerics (trainer) and FlashInfer/SGLang numerics (rollout) must agree",
    ]
    lines += [f"export {k}={q(v)}" for k, v in sorted(env.items())]
    lines += [f"unset {' '.join(megatron.UNSET_ENV)}  # TE's defaults are the exact behaviour"]
    lines += [
        "",
        "# 2. rollout checkpoint converted under the SAME plan (its quantization_config drives SGLang and the exporter)",
        'if [ ! -d "$ROLLOUT_CKPT" ]; then',
        "  " + " ".join(convert),
        "fi",
        "",
        "# 3. RL: Megatron trainer + SGLang rollout with live weight updates",
        'cd "$MILES_DIR"',
        "python train.py \\",
    ]
    grouped: list[str] = []  # one "--flag value..." per line
    for a in train_flags:
        if a.startswith("--") or not grouped:
            grouped.append(a)
        else:
            grouped[-1] += " " + a
    lines += [f"  {g} \\" for g in grouped] + ['  "$@"']
    notes = mcfg.notes + scfg.notes
    if notes:
        lines += ["", "# notes:"] + [f"#   {n}" for n in notes]
    return "\n".join(lines) + "\n", env, arts


def _model_ref(model: str) -> str:
    """A bundled model name stays a name; a path becomes absolute (the script runs from $MILES_DIR)."""
    p = Path(model)
    return str(p.resolve()) if p.exists() else model


def emit_miles_launch(policy: Optional[str], model: str, parallel: Optional[str], out_dir: Path,
                      launch: bool = False, te_version: Optional[str] = None) -> Path:
    """Write the Miles launch for a plan the check/emit gate accepts (same gate as `policyc emit`)."""
    path = policy_path(policy)
    arch = load_architecture(model)
    plan = load_plan(str(path), arch, parse_parallel(parallel))
    res = run_gate(plan, arch, ["megatron", "sglang"], EmitOptions(te_version=te_version))
    if not res.ok():
        msgs = "; ".join(d.message for d in res.errors()[:3])
        raise MilesError(f"the plan does not pass `policyc check` ({len(res.errors())} error(s)): {msgs}",
                         f"run `policyc check {path} --model {model}" + (f" --parallel '{parallel}'" if parallel
                                                                          else "") + "` for the full list",
                         code=1)  # valid input the gate refuses: 1, as from check / emit (2 is bad usage)
    script, _, arts = build_launch(plan, path, model, parallel, te_version)
    out_dir = Path(out_dir).resolve()
    for a in arts:
        dest = out_dir / a.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name("." + dest.name + ".tmp")
        tmp.write_bytes(a.data())
        os.replace(tmp, dest)
    spath = out_dir / "launch_miles.sh"
    tmp = spath.with_name(".launch_miles.sh.tmp")
    tmp.write_text(script)
    os.chmod(tmp, 0o755)
    os.replace(tmp, spath)
    (out_dir / "launch_args.txt").write_text(f"# policyc {plan.content_hash()} ({plan.policy_name} on {plan.model})\n"
                                             + _train_argv_text(script))
    if launch:
        if importlib.util.find_spec("miles") is None:
            raise MilesError(f"--launch: Miles is not installed here (wrote {spath} anyway)",
                             "run the script on a Miles node (HF_CKPT, REF_LOAD, MILES_DIR set), or drop --launch")
        subprocess.run(["bash", str(spath)], check=True)
    return spath


def _train_argv_text(script: str) -> str:
    """The `python train.py` argv of the script, one flag per line (what Miles' parser receives)."""
    start = script.index("python train.py \\\n") + len("python train.py \\\n")
    body = script[start:script.index('  "$@"', start)]
    return "".join(line.strip().rstrip("\\").rstrip() + "\n" for line in body.splitlines())
