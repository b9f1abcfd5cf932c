"""A resumable `policyc run`: the run directory keeps the loop's state after its last checkpointed step, and the same
command run again continues from there, producing the metrics an uninterrupted run would have (bit for bit on the
same box and thread count: every random stream and the optimizer's moments are restored exactly).

<out>/resume/ holds
  state.json                  the step, the run's configuration, Python's prompt RNG, the spike detector's history,
                              the GEMM counters so far, the elapsed time, and the name of the tensors file
  state-<step>.safetensors    the trainer's parameters, AdamW's moments and step counts, the sampler's and torch's
                              RNG states (safetensors only: a checkpoint is data, never unpickled)

Every file is written to a temporary name, fsynced and renamed; state.json goes last and names its tensors file,
so an interrupt at any moment leaves the previous checkpoint intact. A finished run removes resume/ (its results are
final). A checkpoint is resumed only by a run whose configuration equals the one it was written by (everything but
the output directory and the checkpoint interval)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from ..errors import PolicycError

DIR = "resume"
STATE = "state.json"
VERSION = 1
# never spend more than ~1/OVERHEAD_FACTOR of the run's time writing checkpoints, and checkpoint at least this often
OVERHEAD_FACTOR = 20
DEFAULT_EVERY_S = 10.0


class ResumeError(PolicycError, RuntimeError):
    """A run directory's resume state cannot be used (unreadable, damaged, or not this version's)."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def config_key(cfg) -> dict:
    """What a checkpoint must agree on with the run resuming it."""
    return cfg.model_dump(mode="json", exclude={"out", "checkpoint_every_s"})


def read_state(out: Path) -> Optional[dict]:
    """The state.json of `out`'s checkpoint, or None when there is none. Raises ResumeError when it is unreadable."""
    path = Path(out) / DIR / STATE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ResumeError(f"{path}: the resume state is unreadable ({err})",
                          "pass --overwrite to start the run over, or a new --out") from None
    if not isinstance(meta, dict) or meta.get("version") != VERSION or not isinstance(meta.get("step"), int):
        raise ResumeError(f"{path}: not a resume state of this policyc version",
                          "pass --overwrite to start the run over, or a new --out")
    return meta


def mismatch(meta: dict, cfg) -> Optional[str]:
    """None when the checkpoint was written by this configuration; else the first setting that differs."""
    saved, now = meta.get("config") or {}, config_key(cfg)
    for k in now:
        if saved.get(k) != now[k]:
            return f"{k}: {saved.get(k)!r} there, {now[k]!r} now"
    return None


def _fsynced_replace(tmp: Path, path: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(obj) + "\n")
    _fsynced_replace(tmp, path)


def start(out: Path, cfg) -> None:
    """A step-0 state: the directory belongs to this configuration even before its first checkpoint, so a run
    interrupted during set-up is picked up (from the start) by the same command."""
    d = Path(out) / DIR
    d.mkdir(parents=True, exist_ok=True)
    _write_json(d / STATE, {"version": VERSION, "step": 0, "config": config_key(cfg), "tensors": None,
                            "elapsed_s": 0.0})


def save(out: Path, cfg, step: int, trainer, opt, rng, sampler_gen, spikes, counters: dict,
         elapsed_s: float) -> None:
    """Checkpoint the loop after `step` (see the module docstring for what and how)."""
    import torch
    from safetensors.torch import save_file

    d = Path(out) / DIR
    d.mkdir(parents=True, exist_ok=True)
    tensors = {f"param.{n}": p.detach().to("cpu", copy=True).contiguous() for n, p in trainer.named_parameters()}
    names = {id(p): n for n, p in trainer.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors[f"adamw.{names[id(p)]}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().to(
                "cpu", copy=True).contiguous()
    tensors["rng.sampler"] = sampler_gen.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    name = f"state-{step}.safetensors"
    tmp = d / f".{name}.tmp"
    save_file(tensors, str(tmp))
    _fsynced_replace(tmp, d / name)
    version, internal, gauss = rng.getstate()
    _write_json(d / STATE, {"version": VERSION, "step": step, "config": config_key(cfg), "tensors": name,
                            "python_rng": [version, list(internal), gauss], "spike_history": list(spikes.history),
                            "counters": counters, "elapsed_s": elapsed_s})
    for old in [*d.glob("state-*.safetensors"), *d.glob(".state-*.tmp")]:  # superseded, or cut off by a Ctrl-C
        if old.name != name:
            old.unlink(missing_ok=True)


def restore(out: Path, meta: dict, trainer, opt, rng, sampler_gen, spikes) -> None:
    """Put the loop's state back as checkpointed in `meta` (read_state's result, step > 0)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(out) / DIR / str(meta.get("tensors"))
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as err:
        raise ResumeError(f"{path}: the checkpoint is unreadable ({err})",
                          "pass --overwrite to start the run over, or a new --out") from None
    params = dict(trainer.named_parameters())
    missing = [n for n in params if f"param.{n}" not in tensors]
    if missing:
        raise ResumeError(f"{path}: the checkpoint has no tensor for parameter {missing[0]}",
                          "pass --overwrite to start the run over, or a new --out")
    with torch.no_grad():
        for n, p in params.items():
            src = tensors[f"param.{n}"]
            if src.shape != p.shape or src.dtype != p.dtype:
                raise ResumeError(f"{path}: parameter {n} is {src.dtype} {tuple(src.shape)} there, "
                                  f"{p.dtype} {tuple(p.shape)} in this model", "pass --overwrite to start over")
            p.copy_(src)
    moments: dict = {}
    for key, v in tensors.items():
        if key.startswith("adamw."):
            n, k = key[len("adamw."):].rsplit(".", 1)  # AdamW's state names (step, exp_avg, ...) have no dot
            if n not in params:
                raise ResumeError(f"{path}: optimizer state for {n}, which this model does not have",
                                  "pass --overwrite to start over")
            # AdamW keeps `step` on the host (not capturable) and the moments beside the parameter
            moments.setdefault(n, {})[k] = v if k == "step" else v.to(params[n].device)
    for n, st in moments.items():
        opt.state[params[n]] = st
    sampler_gen.set_state(tensors["rng.sampler"])
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("rng.cuda.")),
                                       key=lambda k: int(k.rsplit(".", 1)[1]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    try:
        version, internal, gauss = meta["python_rng"]
        rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        spikes.history = [float(x) for x in meta["spike_history"]]
    except (KeyError, TypeError, ValueError) as err:
        raise ResumeError(f"{path.parent / STATE}: the resume state is damaged ({err})",
                          "pass --overwrite to start the run over") from None


def finish(out: Path) -> None:
    """The run is complete and its results written: nothing is left to resume."""
    shutil.rmtree(Path(out) / DIR, ignore_errors=True)


class Schedule:
    """When to checkpoint: after a step once `every_s` has passed since the last checkpoint (0: after every step), and no more often
    than OVERHEAD_FACTOR x the last checkpoint's own write time (a large model's checkpoint stays a small share of
    the run)."""

    def __init__(self, every_s: float, now: float):
        self.every_s, self.last, self.cost = every_s, now, 0.0

    def due(self, now: float) -> bool:
        if self.every_s == 0:  # asked for after every step
            return True
        return now - self.last >= max(self.every_s, OVERHEAD_FACTOR * self.cost)

    def done(self, started: float, now: float) -> None:
        self.last, self.cost = now, now - started
