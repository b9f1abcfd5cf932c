"""Run Miles' OWN argument parser (miles.utils.arguments.parse_args, which chains Megatron-LM's parse_args and
SGLang's ServerArgs.add_cli_args) on the `python train.py ...` argv of a policyc Miles launch script.

Miles and Megatron-LM's training package are GitHub-only, so CI cannot run this; run it by hand:

    MILES_SRC=/path/to/miles MEGATRON_LM_SRC=/path/to/Megatron-LM SGLANG_SITE=/path/with/sglang \
        python benchmarks/miles_args_check.py OUT_DIR/launch_miles.sh [more scripts...] [-- USER ARGS]

`--miles-model NAME` prepends Miles' own model arguments (scripts/models/NAME.py model_args()) to USER ARGS.
USER ARGS stand for what the script leaves to its caller ("$@": data, batch sizes, model shape), e.g.
`-- --rollout-batch-size 32 --num-layers 48 ...`.

SGLANG_SITE (optional) is a directory on sys.path holding the sglang package and its import-time dependencies.
The script substitutes the launch script's shell variables ($HERE, $ROLLOUT_CKPT, $REF_LOAD, ...) with concrete
paths, calls Miles' parse_args up to (not including) its filesystem/cluster checks, and prints, per script, either
`accepted` with the values Miles derived for the settings policyc relies on (rollout GPUs per engine, SGLang TP/EP,
TE precision file) or the parser's error. Exit status 0 only if every script is accepted.

Harness shims (documented, nothing else is patched):
  * no TransformerEngine here: megatron-core's cached TE version is set to the launch's declared minimum, so
    Megatron-LM's TE-version checks judge the declared version;
  * no GPU here: torch.cuda.get_device_capability/properties answer (10, 0) (Blackwell, the NVFP4/MXFP8 target);
  * Miles' validation reads config.json of --hf-checkpoint and wants --ref-load to exist: a temp directory with the
    bundled config.json of the script's --model, and an empty temp directory, stand in for them;
  * miles/utils/chat_template_utils/deepseek.py imports sglang.srt.entrypoints.openai.encoding_dsv4, which Miles'
    own newer SGLang has and SGLang 0.5.23 does not; a placeholder module is registered under that name only when
    the real import fails (chat templates play no part in argument parsing).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import types
from pathlib import Path


def train_argv(script: Path) -> list[str]:
    """The argv of the `python train.py \\ ...` command of a policyc launch script, shell variables expanded."""
    text = script.read_text()
    m = re.search(r"^python train\.py \\\n(.*?)\n  \"\$@\"", text, re.S | re.M)
    if not m:
        raise SystemExit(f"{script}: no `python train.py` command found")
    body = m.group(1).replace("\\\n", " ").rstrip().rstrip("\\")
    here = str(script.resolve().parent)
    import tempfile

    env = {"HERE": here, "ROLLOUT_CKPT": f"{here}/rollout-ckpt",
           "REF_LOAD": os.environ.get("REF_LOAD") or tempfile.mkdtemp(prefix="miles-check-ref-"),
           "MILES_DIR": os.environ.get("MILES_SRC", "/miles")}
    for k, v in re.findall(r"^([A-Z_]+)=\"?\$\{[A-Z_]+:-([^}]*)\}\"?$", text, re.M):
        env.setdefault(k, v.replace("$HERE", here))
    for k, v in re.findall(r"^([A-Z_]+)=([^$\n]+)$", text, re.M):
        env.setdefault(k, shlex.split(v)[0] if v.strip() else "")
    ckpt = _stand_in_checkpoint(text)
    if ckpt:
        env["ROLLOUT_CKPT"] = ckpt
    body = re.sub(r"\$\{?([A-Z_]+)\}?", lambda mm: env.get(mm.group(1), f"/{mm.group(1).lower()}"), body)
    return shlex.split(body)


def _stand_in_checkpoint(text: str):
    """Miles' validation reads the rollout checkpoint's config.json (--hf-checkpoint). Before `policyc convert` has
    run there is none: stand in a directory holding the bundled config.json of the script's --model."""
    import tempfile

    m = re.search(r"policyc convert .*?--model (\S+)", text)
    if not m:
        return None
    model = m.group(1).strip("'\"")
    cfg = Path(model) / "config.json" if Path(model).is_dir() else \
        Path(__file__).resolve().parents[1] / "precision_dsl" / "models" / model / "config.json"
    if not cfg.is_file():
        return None
    d = Path(tempfile.mkdtemp(prefix="miles-check-ckpt-"))
    (d / "config.json").write_text(cfg.read_text())
    return str(d)


def _paths() -> None:
    for var in ("SGLANG_SITE", "MEGATRON_LM_SRC", "MILES_SRC"):
        v = os.environ.get(var)
        if v:
            sys.path.insert(0, v)
    if not os.environ.get("MILES_SRC"):
        raise SystemExit("set MILES_SRC to a Miles checkout (radixark/miles)")


def _shim_sglang_chat_templates() -> None:
    try:
        from sglang.srt.entrypoints.openai import encoding_dsv4  # noqa: F401
    except ImportError:
        import sglang.srt.entrypoints.openai as pkg

        mod = types.ModuleType("sglang.srt.entrypoints.openai.encoding_dsv4")
        sys.modules[mod.__name__] = mod
        pkg.encoding_dsv4 = mod


def _declare_te(script_text: str) -> str:
    """There is no TransformerEngine on this machine: make megatron-core answer its TE-version questions
    (is_te_min_version, e.g. `--fp4-format requires TE >= 2.7`) with the TE version the launch DECLARES."""
    import megatron.core.utils as mu
    from packaging.version import Version

    m = re.search(r"transformer-engine>=([0-9.]+)", script_text)
    v = m.group(1) if m else "2.13.0"
    mu._te_version = Version(v)
    import torch

    if not torch.cuda.is_available():  # validate_args asks the GPU's compute capability for grouped GEMM
        cap = (9, 0) if "target hopper" in script_text else (10, 0)
        torch.cuda.get_device_capability = lambda *a, **k: cap
        torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=cap[0], minor=cap[1])
    return v


def check(script: Path, user_args: list[str]) -> tuple[bool, str]:
    from miles.utils import arguments as ma

    _declare_te(script.read_text())
    script_argv = train_argv(script)
    argv = script_argv + user_args  # user_args stand for the script's "$@" (data / model-shape flags)
    old = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        # parse_args = Megatron-LM parse_args(extra_args_provider=Miles) + set_default_megatron_args + validations;
        # the validations that need the checkpoints/cluster to exist are what stops it here.
        args = ma.parse_args()
    except SystemExit as err:
        return False, f"argparse exit {err.code}"
    except Exception as err:  # noqa: BLE001 - report what Miles said
        return False, f"{type(err).__name__}: {err}"
    finally:
        sys.argv = old
    over = overridden(script_argv, args)
    # fields the plan decides but the script may leave at Megatron's default: a caller's flag must not change them
    if getattr(args, "moe_router_dtype", None) != (script_argv[script_argv.index("--moe-router-dtype") + 1]
                                                   if "--moe-router-dtype" in script_argv else None):
        over.append(f"moe_router_dtype -> {args.moe_router_dtype} (the plan's router precision is not fp32)")
    got = {k: getattr(args, k, None) for k in ("rollout_num_gpus_per_engine", "sglang_tp_size", "sglang_ep_size",
                                                "te_precision_config_file", "tensor_model_parallel_size",
                                                "pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                                                "decoder_last_pipeline_num_layers")}
    if over:
        return False, f"parsed, but the caller's arguments override emitted flags: {over}; derived {got}"
    return True, f"accepted {got}"


def miles_model_args(name: str) -> list[str]:
    import importlib

    src = Path(os.environ["MILES_SRC"])
    sys.path[:0] = [str(src / "scripts" / "models"), str(src / "miles" / "utils" / "external_utils")]
    return shlex.split(importlib.import_module(name).model_args())


def overridden(script_argv: list[str], args) -> list[str]:
    """Emitted flags whose parsed value is not what the script says (a later "$@" flag overrode it)."""
    out = []
    for i, a in enumerate(script_argv):
        if not a.startswith("--") or a.startswith("--sglang-") or a == "--train-env-vars":
            continue
        val = script_argv[i + 1] if i + 1 < len(script_argv) and not script_argv[i + 1].startswith("--") else None
        dest = a[2:].replace("-", "_")
        if val is None or not hasattr(args, dest):
            continue
        got = getattr(args, dest)
        if str(got) != val and not (isinstance(got, float) and float(val) == got):
            out.append(f"{a} {val} -> {got}")
    return out


def main(argv: list[str]) -> int:
    _paths()
    _shim_sglang_chat_templates()
    user_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, user_args = argv[:i], argv[i + 1:]
    if "--miles-model" in argv:  # Miles' own scripts/models/<NAME>.py model_args() as the model-shape "$@"
        i = argv.index("--miles-model")
        name = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
        user_args = miles_model_args(name) + user_args
    ok = True
    for s in argv:
        good, msg = check(Path(s), user_args)
        ok &= good
        print(f"{s}: {msg}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
