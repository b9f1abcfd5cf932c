"""The embedded GRPO loop. Reads top to bottom: one RL step is

    sample prompts -> rollout engine samples n completions each -> reward -> group-normalised advantages
    -> trainer log-probs (plan-quantized forward) -> clipped policy loss (+ KL to the BF16 reference, coef 0 by
    default) -> optimizer step -> live weight update (quantize per plan, pack, hash-checked receive) -> next step

Trainer and rollout are separate model instances; the rollout only ever gets weights through the weight-update path.
Everything random is seeded from `RunConfig.seed` (prompts: random.Random; sampling: a CPU torch.Generator), so a
run is reproducible on CPU bit for bit.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable, Literal, Optional, Union

import torch
from torch.profiler import record_function  # phase ranges for benchmarks/rl_step.py --profile (no-op otherwise)
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..arch import load_architecture
from ..checks import check
from ..plan import ParallelLayout, ParallelSide
from ..precision import Precision
from . import resume
from .metrics import SpikeDetector, StepLog, StepMetrics, k3, masked_mean
from .model import load_model, resolve_model_dir
from .plans import broken_rollout_plan, load_plan
from .qlinear import TrainerExecutor
from .remote import RemoteRollout
from .rollout import LocalRollout, Rollout
from .sampling import sequence_logprobs
from .task import load_tokenizer, make_task
from .weight_path import differing
from ..errors import PolicycError


class RunConfig(BaseModel):
    """Everything a run is, validated once at construction (the CLI turns a ValidationError into a usage error)
    and immutable afterwards."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: Optional[str] = None  # None: plans.DEFAULT_POLICY
    model: str = "tiny-moe"
    task: str = "arithmetic"
    digits: int = Field(2, ge=1, le=6)
    operators: str = Field("+", pattern=r"^[+*-]+$")
    steps: int = Field(60, ge=1, le=1_000_000)
    max_new_tokens: Optional[int] = Field(None, ge=1, le=4096)  # None: the task's own limit (JSONL: 64)
    seed: int = Field(0, ge=0, le=2**63 - 1)  # torch.manual_seed's range
    device: Literal["cpu", "cuda"] = "cpu"
    # Run the rollout engine in its own process on this device (e.g. "cuda:1"; "cpu" = a CPU process over gloo);
    # weights then travel through torch.distributed (NCCL between GPUs). None: in-process rollout.
    rollout_device: Optional[str] = Field(None, pattern=r"^(cpu|cuda(:[0-9]{1,3})?)$")
    # Expert tensor parallelism as seen by the activation quantizers: routed-expert down_proj inputs are split along
    # K over `etp` ranks and per-token scales are computed inside each partition. Unequal values break the
    # per-token contract: refused (policyc check's etp-mismatch) unless force_layout.
    trainer_etp: int = Field(1, ge=1, le=1024)
    rollout_etp: int = Field(1, ge=1, le=1024)
    force_layout: bool = False
    prompts_per_step: int = Field(16, ge=1, le=65_536)
    # sequences per trainer micro-batch (forward + backward each, gradients accumulated, one optimizer step per RL
    # step): bounds the trainer's activation memory for large rollout batches. None: the whole batch at once.
    train_micro_batch: Optional[int] = Field(None, ge=1, le=1_000_000)
    # GRPO normalises rewards within a group: one sample has no group to compare with (advantage 0, no signal)
    samples_per_prompt: int = Field(8, ge=2, le=4096)
    lr: float = Field(1e-3, gt=0, le=10, allow_inf_nan=False)
    clip_eps: float = Field(0.2, gt=0, le=10, allow_inf_nan=False)
    kl_coef: float = Field(0.0, ge=0, le=1e6, allow_inf_nan=False)
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False)
    temperature: float = Field(1.0, gt=0, le=100, allow_inf_nan=False)
    broken_contract: Optional[Literal["per_tensor", "unshared"]] = None
    # rollout numerics: "independent" = its own quantizers + quantized-domain bf16 GEMMs (rollout_gemm.py);
    # "mirror" = the trainer's reference quantizers and fp32 GEMM (mismatch ~0 by construction)
    rollout_numerics: Literal["independent", "mirror"] = "independent"
    # Miles' R3: the trainer's log-prob pass uses the rollout's recorded MoE top-k experts (routing.py)
    routing_replay: bool = False
    check_weight_bytes: bool = True  # compare trainer vs rollout quantized bytes after every update
    out: Optional[Path] = None
    # checkpoint the loop into out/resume/ at most this often (resume.py; 0: after every step); None: never
    checkpoint_every_s: Optional[float] = Field(None, ge=0, le=1e6, allow_inf_nan=False)

    @field_validator("device", "rollout_device")
    @classmethod
    def _device_exists(cls, v):
        """--device cuda / --rollout-device cuda:N must exist here: refused before anything starts."""
        if v and v.startswith("cuda"):
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            idx = int(v.split(":", 1)[1]) if ":" in v else 0
            if idx >= n:
                raise ValueError(f"{v}: this machine has {n} CUDA device(s); use cpu")
        return v


class ContractViolation(PolicycError, RuntimeError):
    pass


class RunResult(BaseModel):
    config: RunConfig
    policy_name: str
    plan_hash: str
    rollout_plan_hash: str
    steps: list[StepMetrics] = Field(default_factory=list)
    wall_s: float = 0.0
    emulated: Union[tuple[str, ...], bool] = True  # the formats emulated (report.emulated_formats); True: unknown
    gemm_paths: dict[str, int] = Field(default_factory=dict)  # trainer GEMM calls per path (fastgemm.PATH_NOTES)
    rollout_gemm_paths: dict[str, int] = Field(default_factory=dict)  # in-process rollout's GEMM calls per path
    native_fp8_errors: dict[str, str] = Field(default_factory=dict)  # cuBLASLt refusals of native FP8 GEMMs, if any
    train_gemm_flops: int = 0  # trainer linears' GEMM FLOPs over the whole run (forward + backward)
    weight_update_path: str = ""  # "device" | "host" | "host (device path failed: ...)" (weight_path.LiveUpdateChannel)
    resumed_from_step: int = 0  # the checkpointed step this process resumed after (0: ran from the start)


def _bf16_plan(plan):
    bf16 = Precision.high("bf16")
    tensors = tuple(t.model_copy(update={"precision": bf16, "share_scale_group": None}) for t in plan.tensors)
    return plan.model_copy(update={"policy_name": "bf16-reference", "tensors": tensors, "share_scale_groups": ()})


def _compare_weights(trainer_q: dict, rollout_q: dict) -> int:
    """Number of quantized tensors whose stored bytes differ between trainer and rollout."""
    bad, pairs, owner = set(), [], []
    for name, q in trainer_q.items():
        r = rollout_q.get(name)
        a, b = q.tensors(), (r.tensors() if r is not None else None)
        if b is None or a.keys() != b.keys():
            bad.add(name)
            continue
        pairs += [(a[k], b[k]) for k in a]
        owner += [name] * len(a)
    return len(bad | {owner[i] for i in differing(pairs)})


def _check_layout(cfg: RunConfig, plan, arch) -> None:
    """The same static checks `policyc check --parallel` runs, for the expert-TP layout of this run."""
    if cfg.trainer_etp == 1 and cfg.rollout_etp == 1:
        return
    # the rollout's expert TP as SGLang derives it (moe_tp = tp / ep): an emulated rollout ETP of n is tp=n, ep=1
    layout = ParallelLayout(trainer=ParallelSide(etp=cfg.trainer_etp),
                            rollout=ParallelSide(tp=cfg.rollout_etp, ep=1, etp=cfg.rollout_etp))
    errors = [d for d in check(plan, arch, layout) if d.severity == "error"]
    if errors and not cfg.force_layout:
        first = errors[0]
        raise ContractViolation(f"layout refused before launch: [{first.code}] {first.message}"
                                + (f" (hint: {first.hint})" if first.hint else "")
                                + " — pass --force-layout to run it anyway and measure the mismatch")


def make_rollout(cfg: RunConfig, model_dir: Path, plan, trainer_config) -> Rollout:
    """The rollout engine of this run: in its own process on `cfg.rollout_device` (weights over torch.distributed),
    or in this process. The loop below only sees the Rollout protocol."""
    if cfg.rollout_device:
        return RemoteRollout(model_dir, plan, trainer_device="cuda:0" if cfg.device == "cuda" else cfg.device,
                             rollout_device=cfg.rollout_device, etp=cfg.rollout_etp, numerics=cfg.rollout_numerics)
    return LocalRollout(trainer_config, plan, device=cfg.device, etp=cfg.rollout_etp, numerics=cfg.rollout_numerics)


def _added(a: dict, b: dict) -> dict:
    return dict(sorted({k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}.items()))


def run(cfg: RunConfig, on_step: Optional[Callable[[StepMetrics], None]] = None,
        on_start: Optional[Callable[[RunResult], None]] = None, resume_state: Optional[dict] = None) -> RunResult:
    """resume_state: resume.read_state(cfg.out) of an interrupted run of this configuration: continue after its
    checkpointed step (the metrics of the steps before it are read back from cfg.out/metrics.jsonl)."""
    t_start = time.perf_counter()
    checkpoints = cfg.out is not None and cfg.checkpoint_every_s is not None
    if checkpoints and resume_state is None:
        resume.start(cfg.out, cfg)
    device = cfg.device
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available (hint: --device cpu)")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    sampler_gen = torch.Generator().manual_seed(cfg.seed)

    # -- set-up: model, plan(s), trainer, reference, rollout engine, weight-update path -----------------------------
    model_dir = resolve_model_dir(cfg.model)
    arch = load_architecture(str(model_dir) if Path(cfg.model).is_dir() else cfg.model)
    plan = load_plan(cfg.policy, arch)
    rollout_plan = broken_rollout_plan(plan, cfg.broken_contract) if cfg.broken_contract else plan
    tok = load_tokenizer(model_dir)
    task = make_task(cfg.task, digits=cfg.digits, operators=cfg.operators, max_new_tokens=cfg.max_new_tokens)

    _check_layout(cfg, plan, arch)
    trainer = load_model(model_dir).to(device).train()
    executor = TrainerExecutor(plan, trainer, etp=cfg.trainer_etp).install()
    reference = load_model(model_dir).to(device).requires_grad_(False).eval()
    TrainerExecutor(_bf16_plan(plan), reference).install()
    # With a broken contract the exporter is configured from the rollout side (as Miles' exporter reads the rollout
    # checkpoint's quantization_config), so the hash check on the channel passes while trainer != rollout.
    rollout = make_rollout(cfg, model_dir, rollout_plan, trainer.config)
    opt = torch.optim.AdamW(trainer.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    spikes = SpikeDetector()

    from .report import emulated_formats

    result = RunResult(config=cfg, policy_name=plan.policy_name, plan_hash=plan.content_hash(),
                       rollout_plan_hash=rollout_plan.content_hash(), emulated=emulated_formats(plan))
    done = resume_state["step"] if resume_state else 0
    counters, elapsed_before = {}, 0.0
    if done:  # everything that carries from one step to the next, as it was after step `done`
        resume.restore(cfg.out, resume_state, trainer, opt, rng, sampler_gen, spikes)
        executor.invalidate()  # nothing quantized from the weights as loaded may survive their replacement
        counters, elapsed_before = resume_state.get("counters") or {}, float(resume_state.get("elapsed_s") or 0)
        result.resumed_from_step = done
    metrics_log = StepLog(cfg.out / "metrics.jsonl", keep=done) if checkpoints else None
    if metrics_log is not None:
        result.steps = [StepMetrics(**d) for d in metrics_log.kept]
    schedule = resume.Schedule(cfg.checkpoint_every_s or 0.0, time.perf_counter())

    def counted() -> dict:
        return {"trainer": _added(counters.get("trainer", {}), executor.gemm_report()),
                "rollout": _added(counters.get("rollout", {}), rollout.gemm_report()),
                "flops": counters.get("flops", 0) + executor.stats.flops}

    if on_start:
        on_start(result)

    def weight_update() -> tuple[float, int, Optional[bool], int]:
        t0 = time.perf_counter()
        with record_function("policyc.weight_update"):
            payload = rollout.channel.send(dict(trainer.named_parameters()))
            rollout.update_weights(payload)
            identical, differing = None, 0
            if cfg.check_weight_bytes:
                differing = _compare_weights(executor.current_quantized(), rollout.received)
                identical = differing == 0
                if not identical and cfg.broken_contract is None:
                    raise ContractViolation(f"{differing} quantized weight(s) differ between trainer and rollout "
                                            f"after update {payload.version} under a consistent contract")
        return time.perf_counter() - t0, payload.nbytes, identical, differing

    weight_update()  # version 1: the rollout engine's first weights

    n = cfg.samples_per_prompt
    for step in range(done + 1, cfg.steps + 1):
        # 1. prompts, each repeated n times (one GRPO group per prompt)
        problems = task.sample(rng, cfg.prompts_per_step)
        prompts = [tok.encode_prompt(p.prompt) for p in problems for _ in range(n)]  # chat template if any

        # 2. rollout: the separate engine samples with its KV cache and its own (received) weights
        t0 = time.perf_counter()
        with record_function("policyc.rollout"):
            batch = rollout.generate(prompts, max_new_tokens=task.max_new_tokens, eos_id=tok.eos_id,
                                     pad_id=tok.pad_id, generator=sampler_gen, temperature=cfg.temperature)
        t_rollout = time.perf_counter() - t0

        # 3. reward (exact match / boxed answer) and 4. group-normalised advantages
        rewards = torch.tensor([task.reward(problems[i // n], tok.decode(r))
                                for i, r in enumerate(batch.responses())])
        grouped = rewards.view(-1, n)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        adv = adv.to(device)[:, None]

        # 5.-7. per micro-batch of sequences (gradient accumulation, as Megatron's micro-batches): trainer log-probs
        # of the sampled tokens (plan-quantized forward, autograd through the executor), the BF16 reference's, and
        # the clipped policy loss (token mean over the WHOLE batch, so the summed micro-batch gradients are the
        # full batch's), backward; then one optimizer step
        t0 = time.perf_counter()
        with record_function("policyc.train"):
            mask = batch.response_mask.float()
            tokens_total = mask.sum()
            opt.zero_grad(set_to_none=True)
            micro = cfg.train_micro_batch or len(prompts)
            chunks, routing_differ, routing_total, t_ref, loss_sum = [], 0, 0, 0.0, 0.0
            for lo in range(0, len(prompts), micro):
                mb = batch.rows(slice(lo, lo + micro))
                mb_mask, mb_adv = mask[lo:lo + micro], adv[lo:lo + micro]
                routing = None
                if mb.routing:  # compare (and with --routing-replay, replay) the rollout's MoE expert choices
                    from .routing import RoutingReplay

                    routing = RoutingReplay(mb.routing, mb.attention_mask[:, :-1], replay=cfg.routing_replay)
                trainer.routing = routing
                try:
                    logp = sequence_logprobs(trainer, mb)
                finally:
                    trainer.routing = None
                if routing is not None:
                    routing_differ, routing_total = routing_differ + routing.differ, routing_total + routing.total
                old = logp.detach()  # single update per batch: old policy = current trainer
                t1 = time.perf_counter()
                with torch.no_grad(), record_function("policyc.reference"):
                    ref_logp = sequence_logprobs(reference, mb)
                t_ref += time.perf_counter() - t1

                ratio = torch.exp(logp - old)
                pg = -torch.minimum(ratio * mb_adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * mb_adv)
                loss = (pg * mb_mask).sum() / tokens_total
                if cfg.kl_coef:
                    loss = loss + cfg.kl_coef * (k3(logp, ref_logp) * mb_mask).sum() / tokens_total
                loss.backward()
                loss_sum += float(loss.detach())
                chunks.append((old, ref_logp, ratio.detach()))
            old, ref_logp, ratio = (torch.cat(parts) for parts in zip(*chunks))
            gnorm = float(torch.nn.utils.clip_grad_norm_(trainer.parameters(), cfg.max_grad_norm))
            opt.step()
            executor.invalidate()
        t_train = time.perf_counter() - t0 - t_ref

        # 8. live weight update trainer -> rollout (+ byte-identity check of every quantized weight)
        t_update, nbytes, identical, differing = weight_update()

        m = StepMetrics(
            step=step, reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
            mismatch_abs_logp=masked_mean((old - batch.logprobs.to(device)).abs(), mask),
            mismatch_k3=masked_mean(k3(batch.logprobs.to(device), old), mask),
            kl_ref_k3=masked_mean(k3(old, ref_logp), mask),
            loss=loss_sum, grad_norm=gnorm, grad_spike=spikes(gnorm),
            clip_frac=masked_mean(((ratio - 1).abs() > cfg.clip_eps).float(), mask),
            response_tokens=batch.num_response_tokens, time_rollout_s=t_rollout, time_train_s=t_train,
            time_reference_s=t_ref, time_weight_update_s=t_update,
            rollout_tokens_per_s=batch.num_response_tokens / max(t_rollout, 1e-9), weight_update_bytes=nbytes,
            quantized_weights_identical=identical, quantized_weights_differing=differing,
            routing_disagreement=routing_differ / routing_total if routing_total else None)
        result.steps.append(m)
        if metrics_log is not None:
            metrics_log.write(m)  # before the checkpoint of this step: a resumed run finds every earlier line
            now = time.perf_counter()
            if step < cfg.steps and schedule.due(now):
                resume.save(cfg.out, cfg, step, trainer, opt, rng, sampler_gen, spikes, counted(),
                            elapsed_before + now - t_start)
                schedule.done(now, time.perf_counter())
        if on_step:
            on_step(m)
    rollout.close()
    if metrics_log is not None:
        metrics_log.close()
    total = counted()
    result.gemm_paths = total["trainer"]
    result.native_fp8_errors = {str(k): v for k, v in executor.fp8.errors.items()}
    result.rollout_gemm_paths = total["rollout"]
    result.train_gemm_flops = total["flops"]
    ch = rollout.channel
    err = getattr(ch, "device_path_error", None)
    on_gpu = device == "cuda" and getattr(ch, "device_path", False)
    result.weight_update_path = "device" if on_gpu else (f"host (device path failed: {err})" if err else "host")
    result.wall_s = elapsed_before + time.perf_counter() - t_start
    return result
