"""`policyc audit` inputs: the files of an existing deployment, each recognised by its content (never by its name
alone) and read into what the engines read: the trainer's Megatron flags, TE precision YAMLs and env; the rollout's
server args, env and the checkpoint's quantization config.

Recognised (each path a file or a directory):
  * a Miles launch script: the `python ... train.py ...` line (shell continuations joined), the `export K=V` /
    leading `K=V` env around it (both sides: Miles forwards the driver's env), `--train-env-vars '{json}'` (trainer
    actors only, miles/ray/train/actor_factory.py), `--sglang-*` passthrough flags (SGLang's own names,
    miles/backends/sglang_utils/arguments.py), `--extra-high-precision-layers-hf/-megatron` (miles/utils/
    arguments.py, nargs="*"), `--te-precision-config-file` and `--hf-checkpoint` (read when the path exists);
  * a Megatron argument file (flags such as --fp8-format / --fp4-format / --te-precision-config-file);
  * a TE precision YAML (`configs` + `matchers`, megatron/core/quantization/quant_config.py);
  * an env file (`export K=V` lines): NVTE_* go to the trainer, SGLANG_/FLASHINFER_/TRTLLM_/VLLM_* to the rollout;
  * SGLang server arguments (`python -m sglang.launch_server ...` or a bare argv fragment with SGLang flags);
  * vLLM engine arguments (`vllm serve ...`), with `--quantization-config` / `--hf-overrides`;
  * a rollout checkpoint directory: config.json `quantization_config`, hf_quant_config.json, and the dtypes of its
    safetensors headers (backends/safetensors_io.read_header only: no tensor data is read);
  * a directory written by `policyc emit` or `policyc run --engine miles` (megatron/, sglang/, vllm/, converter/).
Anything else is an AuditError naming the path (exit 2).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..backends.common import argv_value
from ..errors import PolicycError

MAX_TEXT_BYTES = 4 << 20  # launch scripts, argument files and configs are small
TRAINER_ENV = ("NVTE_",)
ROLLOUT_ENV = ("SGLANG_", "FLASHINFER_", "TRTLLM_", "VLLM_")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_MEGATRON_MARKS = ("--fp8-format", "--fp4-format", "--te-precision-config-file", "--transformer-impl",
                   "--first-last-layers-bf16", "--fp8-recipe", "--fp4-recipe")
_SGLANG_MARKS = ("--moe-runner-backend", "--kv-cache-dtype", "--quantization", "--disable-shared-experts-fusion",
                 "--ep-size", "--tp-size", "--fp8-gemm-backend")
# Miles' own list flags (nargs="*"): they end at the next flag.
_MILES_LISTS = ("--extra-high-precision-layers-hf", "--extra-high-precision-layers-megatron")


class AuditError(PolicycError):
    """An input of `policyc audit` that cannot be read or recognised (exit 2)."""

    code = 2

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint or ("pass a Miles launch script, Megatron argument file, TE precision YAML, env file, "
                             "SGLang / vLLM server arguments, a rollout checkpoint directory or a `policyc emit` "
                             "directory")


@dataclass
class Side:
    """One side's inputs as its engine reads them."""

    present: bool = False
    flags: list[str] = field(default_factory=list)  # trainer: Megatron argv; rollout: server / engine args
    env: dict[str, str] = field(default_factory=dict)
    yamls: dict[str, dict] = field(default_factory=dict)  # trainer: TE precision YAMLs by file name
    extra_hf: tuple[str, ...] = ()
    extra_megatron: tuple[str, ...] = ()
    engine: Optional[str] = None  # rollout: sglang | vllm
    quant_config: Optional[dict] = None  # rollout: the checkpoint's quantization config
    quant_from: Optional[str] = None
    online: Optional[dict] = None  # vLLM --quantization-config
    checkpoint_dtypes: dict[str, str] = field(default_factory=dict)  # safetensors name -> dtype


@dataclass
class Deployment:
    trainer: Side = field(default_factory=Side)
    rollout: Side = field(default_factory=Side)
    read_as: list[tuple[str, str]] = field(default_factory=list)  # (path, what it was read as)
    pending_yaml: list[str] = field(default_factory=list)  # --te-precision-config-file values not found yet


# ---------------------------------------------------------------------------------------------------------------
# low-level readers (bounded, no traceback)
# ---------------------------------------------------------------------------------------------------------------
def _text(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TEXT_BYTES + 1)
    except OSError as err:
        raise AuditError(f"cannot read {path}: {err.strerror or type(err).__name__}") from None
    if len(raw) > MAX_TEXT_BYTES:
        raise AuditError(f"{path} is larger than {MAX_TEXT_BYTES} bytes: not a deployment file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise AuditError(f"{path} is not UTF-8 text") from None


def _json(text: str, where: str):
    from ..jsonsafe import loads_bounded

    return loads_bounded(text, where, AuditError, max_bytes=MAX_TEXT_BYTES)


def _yaml(text: str, where: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise AuditError(f"{where} is not YAML: {str(err).splitlines()[0]}") from None


def _shell_words(text: str, where: str) -> list[list[str]]:
    """Shell lines (continuations joined, comments dropped) split into words."""
    joined = re.sub(r"\\\r?\n", " ", text)
    out = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            out.append(shlex.split(line, comments=True))
        except ValueError as err:
            raise AuditError(f"{where}: cannot split a shell line ({err}): {line.strip()[:80]}") from None
    return [w for w in out if w]


def _env_of_words(words: list[str], env: dict[str, str]) -> None:
    for w in (words[1:] if words[0] == "export" else words):
        m = _ASSIGN.match(w)
        if m:
            env[m.group(1)] = m.group(2)


def _is_env_line(words: list[str]) -> bool:
    body = words[1:] if words[0] == "export" else words
    return bool(body) and all(_ASSIGN.match(w) for w in body)


def _route_env(env: dict[str, str], dep: Deployment, both: bool = False) -> None:
    for k, v in env.items():
        if both or k.startswith(TRAINER_ENV):
            dep.trainer.env[k] = v
        if both or k.startswith(ROLLOUT_ENV):
            dep.rollout.env[k] = v


# ---------------------------------------------------------------------------------------------------------------
# one input
# ---------------------------------------------------------------------------------------------------------------
def read_deployment(paths: list[Path]) -> Deployment:
    dep = Deployment()
    if not paths:
        raise AuditError("no input given")
    for p in paths:
        p = Path(p)
        if p.is_dir():
            _read_dir(p, dep)
        elif p.is_file():
            _read_file(p, dep)
        else:
            raise AuditError(f"{p} does not exist" if not p.exists() else f"{p} is not a file or directory")
    for name in dep.pending_yaml:
        if not any(Path(name).name == Path(k).name for k in dep.trainer.yamls):
            raise AuditError(f"--te-precision-config-file {name} is not readable from here",
                             "pass the TE precision YAML as another PATH")
    return dep


def _read_dir(d: Path, dep: Deployment) -> None:
    if (d / "megatron" / "flags.json").is_file() or (d / "sglang" / "server_args.json").is_file() \
            or (d / "vllm" / "serve_args.json").is_file():
        _read_emitted(d, dep)
        return
    if (d / "config.json").is_file():
        _read_checkpoint(d, dep)
        return
    files = sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise AuditError(f"{d} is an empty directory")
    for f in files:
        _read_file(f, dep)


def _read_emitted(d: Path, dep: Deployment) -> None:
    what = []
    flags_json = d / "megatron" / "flags.json"
    if flags_json.is_file():
        doc = _json(_text(flags_json), str(flags_json))
        if not isinstance(doc, dict):
            raise AuditError(f"{flags_json} is not a policyc megatron/flags.json")
        dep.trainer.present = True
        dep.trainer.flags = _strings(doc.get("flags"), f"{flags_json}: flags")
        dep.trainer.env.update(_mapping(doc.get("env"), "env"))
        for name in _strings(doc.get("te_precision_files"), f"{flags_json}: te_precision_files"):
            y = d / "megatron" / str(name)
            if not y.is_file():
                raise AuditError(f"{y} (named by {flags_json}) is missing")
            dep.trainer.yamls[str(name)] = _yaml(_text(y), str(y))
        what.append("trainer (megatron/flags.json + TE YAML)")
    sg = d / "sglang" / "server_args.json"
    vl = d / "vllm" / "serve_args.json"
    if sg.is_file():
        doc = _json(_text(sg), str(sg))
        if not isinstance(doc, dict):
            raise AuditError(f"{sg} is not a policyc sglang/server_args.json")
        _set_rollout(dep, "sglang", _strings(doc.get("server_args"), "server_args"), _mapping(doc.get("env"), "env"))
        dep.rollout.quant_config, dep.rollout.quant_from = doc.get("quantization_config"), str(sg)
        what.append("rollout (sglang/server_args.json)")
    elif vl.is_file():
        doc = _json(_text(vl), str(vl))
        if not isinstance(doc, dict):
            raise AuditError(f"{vl} is not a policyc vllm/serve_args.json")
        _read_vllm_argv(dep, _strings(doc.get("engine_args"), "engine_args"), _mapping(doc.get("env"), "env"), str(vl))
        what.append("rollout (vllm/serve_args.json)")
    dep.read_as.append((str(d), "policyc emit directory: " + ", ".join(what)))


def _set_rollout(dep: Deployment, engine: str, args: list[str], env: dict) -> None:
    if dep.rollout.engine not in (None, engine):
        raise AuditError(f"both {dep.rollout.engine} and {engine} rollout arguments given",
                         "audit one rollout engine at a time")
    dep.rollout.present, dep.rollout.engine = True, engine
    dep.rollout.flags += args
    dep.rollout.env.update({str(k): str(v) for k, v in env.items()})


def _read_vllm_argv(dep: Deployment, argv: list[str], env: dict, where: str) -> None:
    _set_rollout(dep, "vllm", argv, env)
    over = argv_value(argv, "--hf-overrides")
    if over:
        q = _json(over, f"{where}: --hf-overrides")
        if isinstance(q, dict) and q.get("quantization_config") is not None:
            dep.rollout.quant_config, dep.rollout.quant_from = q["quantization_config"], f"{where} --hf-overrides"
    online = argv_value(argv, "--quantization-config")
    if online:
        dep.rollout.online = _json(online, f"{where}: --quantization-config")


def _read_checkpoint(d: Path, dep: Deployment) -> None:
    from ..backends.safetensors_io import read_header

    cfg = _json(_text(d / "config.json"), str(d / "config.json"))
    if not isinstance(cfg, dict):
        raise AuditError(f"{d / 'config.json'} is not a model config")
    q = cfg.get("quantization_config")
    src = f"{d / 'config.json'} quantization_config"
    if q is None and (d / "hf_quant_config.json").is_file():
        hq = _json(_text(d / "hf_quant_config.json"), str(d / "hf_quant_config.json"))
        q = dict(hq.get("quantization") or {}) if isinstance(hq, dict) else None
        if q is not None:
            q.setdefault("quant_method", "modelopt")
        src = str(d / "hf_quant_config.json")
    if q is not None or not dep.rollout.quant_config:
        dep.rollout.quant_config, dep.rollout.quant_from = q, (src if q is not None else f"{d}: unquantized")
    dep.rollout.present = True
    n = 0
    for s in sorted(d.glob("*.safetensors")):
        for name, info in read_header(s).items():
            dep.rollout.checkpoint_dtypes[name] = str(info["dtype"])
            n += 1
    dep.read_as.append((str(d), f"rollout checkpoint ({src if q is not None else 'no quantization_config'}; "
                                f"{n} safetensors headers)"))


def _read_file(p: Path, dep: Deployment) -> None:
    text = _text(p)
    stripped = text.lstrip()
    if stripped.startswith("{"):
        _read_json_file(p, _json(text, str(p)), dep)
        return
    lines = _shell_words(text, str(p))
    train = next((w for w in lines if any(x.endswith("train.py") for x in w)), None)
    if train is not None:
        _read_miles(p, lines, train, dep)
        return
    if re.search(r"^\s*(configs|matchers)\s*:", text, re.M):
        doc = _yaml(text, str(p))
        if isinstance(doc, dict) and "matchers" in doc and "configs" in doc:
            dep.trainer.present = True
            dep.trainer.yamls[p.name] = doc
            dep.read_as.append((str(p), "trainer: TE precision YAML (--te-precision-config-file)"))
            return
    words = [w for line in lines for w in line]
    if "vllm" in words[:3] and "serve" in words[:4]:
        env: dict[str, str] = {}
        argv = _argv_after(lines, lambda w: w == "serve", env)
        _read_vllm_argv(dep, argv, env, str(p))
        dep.read_as.append((str(p), "rollout: vLLM engine arguments"))
        return
    if any("sglang.launch_server" in w for w in words) or (
            any(w in _SGLANG_MARKS for w in words) and not any(w in _MEGATRON_MARKS for w in words)):
        env = {}
        argv = _argv_after(lines, lambda w: "launch_server" in w, env)
        _set_rollout(dep, "sglang", argv, env)
        dep.read_as.append((str(p), "rollout: SGLang server arguments"))
        return
    if any(w.split("=", 1)[0] in _MEGATRON_MARKS for w in words):
        dep.trainer.present = True
        dep.trainer.flags += [w for w in words if not _ASSIGN.match(w)]
        _take_yaml_paths(p, dep)
        dep.read_as.append((str(p), "trainer: Megatron argument file"))
        return
    if lines and all(_is_env_line(w) for w in lines):
        env = {}
        for w in lines:
            _env_of_words(w, env)
        _route_env(env, dep)
        sides = sorted({"trainer" for k in env if k.startswith(TRAINER_ENV)}
                       | {"rollout" for k in env if k.startswith(ROLLOUT_ENV)})
        dep.read_as.append((str(p), f"env file ({' + '.join(sides) or 'no engine variables'})"))
        return
    raise AuditError(f"cannot tell what {p} is")


def _argv_after(lines: list[list[str]], starts, env: dict) -> list[str]:
    """The argv after the word `starts` accepts (or every flag of a bare fragment); leading K=V words are env."""
    for w in lines:
        if _is_env_line(w):
            _env_of_words(w, env)
            continue
        idx = next((i for i, x in enumerate(w) if starts(x)), None)
        head = w[:idx] if idx is not None else []
        _env_of_words(["export", *[x for x in head if _ASSIGN.match(x)]], env)
        if idx is not None:
            return w[idx + 1:]
    return [x for w in lines if not _is_env_line(w) for x in w]


def _read_json_file(p: Path, doc, dep: Deployment) -> None:
    if not isinstance(doc, dict):
        raise AuditError(f"cannot tell what {p} is (a JSON value that is not an object)")
    if "flags" in doc and "te_precision_files" in doc:
        dep.trainer.present = True
        dep.trainer.flags += _strings(doc.get("flags"), f"{p}: flags")
        dep.trainer.env.update(_mapping(doc.get("env"), "env"))
        _take_yaml_paths(p, dep)
        dep.read_as.append((str(p), "trainer: megatron flags.json"))
    elif "server_args" in doc:
        _set_rollout(dep, "sglang", _strings(doc["server_args"], f"{p}: server_args"), _mapping(doc.get("env"), "env"))
        if doc.get("quantization_config") is not None:
            dep.rollout.quant_config, dep.rollout.quant_from = doc["quantization_config"], str(p)
        dep.read_as.append((str(p), "rollout: SGLang server_args.json"))
    elif "engine_args" in doc:
        _read_vllm_argv(dep, _strings(doc["engine_args"], f"{p}: engine_args"), _mapping(doc.get("env"), "env"), str(p))
        dep.read_as.append((str(p), "rollout: vLLM serve_args.json"))
    elif "quant_method" in doc or isinstance(doc.get("quantization_config"), dict) or (
            isinstance(doc.get("quantization"), dict)):
        q = doc.get("quantization_config") if "quantization_config" in doc else doc
        if "quantization" in doc and "quant_method" not in doc:
            q = {**doc["quantization"], "quant_method": "modelopt"}
        dep.rollout.present = True
        dep.rollout.quant_config, dep.rollout.quant_from = q, str(p)
        dep.read_as.append((str(p), "rollout: checkpoint quantization config"))
    else:
        raise AuditError(f"cannot tell what {p} is (JSON without flags, server/engine args or a quantization "
                         "config)")


def _take_yaml_paths(p: Path, dep: Deployment) -> None:
    name = argv_value(dep.trainer.flags, "--te-precision-config-file")
    if name is None:
        return
    for cand in (Path(name), p.parent / name, p.parent / Path(name).name):
        if cand.is_file():
            doc = _yaml(_text(cand), str(cand))
            if isinstance(doc, dict) and "matchers" in doc:
                dep.trainer.yamls[cand.name] = doc
                return
    dep.pending_yaml.append(name)


def _strings(v, where: str) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, (str, int, float)) for x in v):
        raise AuditError(f"{where} is not a list of arguments")
    return [str(x) for x in v]


def _mapping(v, where: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise AuditError(f"{where} is not an object of environment variables")
    return {str(k): str(x) for k, x in v.items()}




def _read_miles(p: Path, lines: list[list[str]], train: list[str], dep: Deployment) -> None:
    """A Miles launch: env around the train.py line, its argv split into Megatron flags, --sglang-* server args,
    Miles' own lists and paths."""
    both: dict[str, str] = {}
    for w in lines:
        if w is not train and _is_env_line(w):
            _env_of_words(w, both)
    i = next(i for i, x in enumerate(train) if x.endswith("train.py"))
    _env_of_words(["export", *[x for x in train[:i] if _ASSIGN.match(x)]], both)
    argv = [a for a in train[i + 1:] if a != '"$@"' and a != "$@"]
    flags: list[str] = []
    sg: list[str] = []
    train_env: dict[str, str] = {}
    extra: dict[str, list[str]] = {k: [] for k in _MILES_LISTS}
    j = 0
    while j < len(argv):
        a = argv[j]
        if a in _MILES_LISTS:
            j += 1
            while j < len(argv) and not argv[j].startswith("--"):
                extra[a].append(argv[j])
                j += 1
            continue
        if a == "--train-env-vars" and j + 1 < len(argv):
            doc = _json(argv[j + 1], f"{p}: --train-env-vars")
            if not isinstance(doc, dict):
                raise AuditError(f"{p}: --train-env-vars is not a JSON object")
            train_env.update({str(k): str(v) for k, v in doc.items()})
            j += 2
            continue
        if a.startswith("--sglang-"):
            sg.append("--" + a[len("--sglang-"):])
            j += 1
            while j < len(argv) and not argv[j].startswith("--"):
                sg.append(argv[j])
                j += 1
            continue
        flags.append(a)
        j += 1
    dep.trainer.present = True
    dep.trainer.flags += flags
    dep.trainer.extra_hf += tuple(extra["--extra-high-precision-layers-hf"])
    dep.trainer.extra_megatron += tuple(extra["--extra-high-precision-layers-megatron"])
    _route_env(both, dep, both=True)
    dep.trainer.env.update(train_env)
    if sg:
        _set_rollout(dep, "sglang", sg, {})
    dep.read_as.append((str(p), "Miles launch script: trainer (train.py Megatron flags"
                        + (", --train-env-vars" if train_env else "") + ")" + (", rollout (--sglang-* args)" if sg
                                                                              else "")))
    _take_yaml_paths(p, dep)
    ckpt = argv_value(flags, "--hf-checkpoint")
    if ckpt and not ckpt.startswith("$") and (p.parent / ckpt).is_dir():
        _read_checkpoint(p.parent / ckpt, dep)
