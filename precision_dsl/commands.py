"""`policyc plan / explain / check / diff`: the compiler's front half, usable without a GPU.

Rendering is split from I/O: `plan_rows`, `summarize` and `diff_plans` are pure functions over a Plan (tested
directly); the typer commands only load, call and print. Everything user-facing goes through `console.guard`, so bad
input prints a diagnostic and an exit code, never a traceback.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import typer

from .console import UserError, console, guard
from .names import collapse_names, index_ranges
from .plan import Plan, TensorPlan
from .precision import BLACKWELL_ONLY_KINDS

EMULATION_NOTE = ("MXFP8/NVFP4 GEMMs are Blackwell-only: on Hopper and CPU policyc runs them by exact emulation "
                  "(quantize -> dequantize -> BF16/FP32 GEMM); FP8 per-tensor/blockwise run natively on Hopper.")


# ---------------------------------------------------------------------------------------------------------------
# loading with user-facing errors
# ---------------------------------------------------------------------------------------------------------------
def load_arch(model: str):
    from .arch import load_architecture

    return load_architecture(model)


def policy_not_found(policy: Path) -> UserError:
    """The error for a policy argument that is no policy file: say what the path is when it is something."""
    from .resources import policy_hint

    p = Path(policy)
    if p.is_dir():
        what = "is a directory"
    elif p.exists():
        what = "is not a regular file"
    else:
        what = "does not exist"
    return UserError(f"policy file '{policy}' {what}", policy_hint())


def build_plan(policy: Path, model: str, parallel: Optional[str] = None) -> Plan:
    return build_plan_and_arch(policy, model, parallel)[0]


def build_plan_and_arch(policy: Path, model: str, parallel: Optional[str] = None):
    """(plan, architecture): for commands that also check the plan against the model (check, emit), which would
    otherwise enumerate the architecture twice (DeepSeek-V3: 46k tensors, ~0.1 s)."""
    from .parallel import parse_parallel
    from .resolve import resolve

    from .resources import find_policy

    layout = parse_parallel(parallel)
    path = find_policy(policy)
    if path is None:
        raise policy_not_found(policy)
    # A CLI process keeps the architecture and the plan (~1M objects for DeepSeek-V3, no reference cycles) until it
    # exits. Build them with the cyclic GC off and move them to its permanent generation before turning it back on:
    # otherwise the first collection after the build scans them all once (~50 ms), and every full collection
    # triggered while the backends build their per-tensor manifests rescans them (~40% of `policyc emit` with the
    # collector left on).
    import gc

    gc.disable()
    try:
        arch = load_arch(model)
        plan = resolve(path, arch, layout)
    finally:
        gc.freeze()
        gc.enable()
    return plan, arch


# ---------------------------------------------------------------------------------------------------------------
# plan table: one row per (layer, module group), routed experts collapsed
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanRow:
    layers: str  # "3", "3-50", "-" for global tensors, "mtp0"
    tensors: str  # e.g. mlp.experts[0-127].{gate_proj,up_proj}
    shape: str
    weight: str
    activation: str
    grad: str
    backward: str
    rule: str
    count: int


def _local_name(t: TensorPlan) -> str:
    """Name relative to its decoder block, with `.weight` dropped: `self_attn.q_proj`, `mlp.experts.E.gate_proj`."""
    name = t.hf_name
    if name.endswith(".weight"):
        name = name[: -len(".weight")]
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers":
        parts = parts[3:]
    if t.expert is not None and "experts" in parts:
        i = parts.index("experts")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            parts[i + 1] = "E"
    return ".".join(parts)


def _layer_key(t: TensorPlan) -> str:
    if t.mtp is not None:
        return f"mtp{t.mtp}"
    return "-" if t.layer is None else str(t.layer)


def _rule(t: TensorPlan) -> str:
    return "default" if t.decided_by is None else f"{Path(t.decided_by.file).name}:{t.decided_by.line}"


def _fmt_cell(t: TensorPlan) -> tuple[str, str, str, str]:
    p = t.precision
    if not t.is_linear:
        return p.weight.short(), "", "", ""
    bwd = p.backward.value if p.is_quantized else ""
    return p.weight.short(), p.activation.short(), p.grad.short(), bwd


def _layer_rows(tensors: list[TensorPlan]) -> list[tuple]:
    """Rows of one layer, experts collapsed: key = (local name pattern, formats, rule) -> expert ids."""
    # First bucket on cheap identity keys (routed experts are ~99% of DeepSeek-V3's 46k tensors and share their
    # name pattern per role), then derive display strings once per bucket.
    # Precision / RuleRef by identity: the plan holds them (shared by thousands of tensors) and hashing the nested
    # pydantic models by value was a third of `policyc plan`'s table time.
    buckets: "OrderedDict[tuple, list[TensorPlan]]" = OrderedDict()
    for t in tensors:
        ident = (t.role, t.shape, id(t.precision), id(t.decided_by), t.is_linear) if t.expert is not None \
            else (t.hf_name,)
        bucket = buckets.get(ident)
        if bucket is None:
            bucket = buckets[ident] = []
        bucket.append(t)
    groups: "OrderedDict[tuple, list[TensorPlan]]" = OrderedDict()
    for ts in buckets.values():
        t = ts[0]
        key = (_local_name(t), "x".join(map(str, t.shape))) + _fmt_cell(t) + (_rule(t),)
        groups.setdefault(key, []).extend(ts)
    # merge gate/up (and q/k/v) members that share everything but the leaf name into one row `{gate_proj,up_proj}`
    merged: "OrderedDict[tuple, tuple[list[str], list[TensorPlan]]]" = OrderedDict()
    for key, ts in groups.items():
        local = key[0]
        head, _, leaf = local.rpartition(".")
        experts = tuple(sorted({t.expert for t in ts if t.expert is not None}))
        mkey = (head, experts) + key[1:]
        leaves, members = merged.setdefault(mkey, ([], []))
        leaves.append(leaf)
        members.extend(ts)
    rows = []
    for mkey, (leaves, members) in merged.items():
        head, experts = mkey[0], mkey[1]
        if experts:
            head = head.replace(".E", f"[{index_ranges(experts)}]") if ".E" in head else head
        leaf = leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}"
        label = f"{head}.{leaf}" if head else leaf
        rows.append((label,) + mkey[2:] + (len(members),))
    return rows


def plan_rows(plan: Plan, tensor_glob: Optional[str] = None, expand: bool = False) -> list[PlanRow]:
    by_layer: "OrderedDict[str, list[TensorPlan]]" = OrderedDict()
    for t in plan.tensors:
        if tensor_glob and not fnmatch.fnmatchcase(t.hf_name, tensor_glob):
            continue
        by_layer.setdefault(_layer_key(t), []).append(t)
    per_layer = [(k, _layer_rows(ts)) for k, ts in by_layer.items()]
    # Merge runs of consecutive decoder layers whose rows are identical (unless --expand).
    out: list[PlanRow] = []
    i = 0
    while i < len(per_layer):
        key, rows = per_layer[i]
        j = i
        if not expand and key.isdigit():
            while (j + 1 < len(per_layer) and per_layer[j + 1][0].isdigit()
                   and int(per_layer[j + 1][0]) == int(per_layer[j][0]) + 1 and per_layer[j + 1][1] == rows):
                j += 1
        label = key if j == i else f"{key}-{per_layer[j][0]}"
        for r in rows:
            name, shape, w, a, g, b, rule, count = r
            out.append(PlanRow(label, name, shape, w, a, g, b, rule, count * (j - i + 1)))
        i = j + 1
    return out


def _short_by_identity():
    """`fmt.short()` memoised by object for one pass over a plan (TensorFormat.short's own cache hashes the model by
    value on every call; a plan shares a few format objects among all its tensors and keeps them alive)."""
    memo: dict[int, str] = {}

    def short(fmt) -> str:
        s = memo.get(id(fmt))
        if s is None:
            s = memo[id(fmt)] = fmt.short()
        return s

    return short


def summarize(plan: Plan) -> list[tuple[str, int, float, int, int]]:
    """(weight format, params, % of params, bytes before, bytes after) per weight format, largest first."""
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    total = 0
    short = _short_by_identity()
    for t in plan.tensors:
        n = t.numel
        a = acc[short(t.weight)]
        a[0] += n
        a[1] += t.bytes_before
        a[2] += t.bytes_after
        total += n
    rows = [(k, v[0], 100.0 * v[0] / total if total else 0.0, v[1], v[2]) for k, v in acc.items()]
    return sorted(rows, key=lambda r: -r[1])


ROLE_GROUP_ORDER = ("routed_experts", "shared_experts", "mlp", "attn", "embedding", "lm_head", "router", "norm")


def role_summary(plan: Plan) -> tuple[list[tuple[str, int, float, str]], int, int]:
    """Parameters per role group of the main model (MTP modules counted apart, as model cards do: DeepSeek-V3 is
    "671B" without its 14B MTP module). Returns ([(group, params, % of main model, weight formats)], main total,
    MTP total)."""
    acc: dict[str, int] = defaultdict(int)
    fmts: dict[str, set] = defaultdict(set)
    main = mtp = 0
    short = _short_by_identity()
    for t in plan.tensors:
        if t.mtp is not None:
            mtp += t.numel
            continue
        group = t.role.split(".")[0]
        acc[group] += t.numel
        fmts[group].add(short(t.weight))
        main += t.numel
    order = [g for g in ROLE_GROUP_ORDER if g in acc] + sorted(g for g in acc if g not in ROLE_GROUP_ORDER)
    rows = [(g, acc[g], 100.0 * acc[g] / main if main else 0.0, ", ".join(sorted(fmts[g]))) for g in order]
    return rows, main, mtp


def _human(n: float, unit: str = "") -> str:
    for s in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{s}{unit}" if s else f"{n:.0f}{unit}"
        n /= 1000.0
    return f"{n:.1f}P{unit}"


def _params(n: float, scale: float, digits: int = 1) -> str:
    """A parameter count in the unit that fits `scale` (the largest number printed next to it, so that "x of y"
    share one unit): 656.5B of 671.0B, 1.6M of 1.8M; never 0.0B for a tiny model."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if scale >= div:
            return f"{n / div:.{digits}f}{unit}"
    return f"{n:.0f}"


def plan_hints(plan: Plan) -> list[str]:
    """What `policyc check` will refuse that the plan table does not say, with the fix. A quantized lm_head (e.g.
    from `default mxfp8`): megatron-core 0.16's output_layer is no TransformerEngine module and SGLang's / vLLM's
    ParallelLMHead is not quantized by their checkpoint methods, so every trainer and rollout backend refuses it."""
    heads = [t for t in plan.tensors if t.role == "lm_head" and t.is_linear and t.weight.is_quantized]
    if not heads:
        return []
    t = heads[0]
    fix = "add the rule `lm_head: bf16`" if t.decided_by is None else \
        f"add `lm_head: bf16` after `{t.decided_by.text}` ({_rule(t)})"
    dense = not any(u.role.startswith("routed_experts.") for u in plan.tensors)
    return [f"{t.hf_name} is {t.weight.short()}: no trainer or rollout backend quantizes lm_head, so `policyc check` "
            f"refuses it; {fix}" + (" or start from the shipped mxfp8-dense / nvfp4-dense" if dense else "")]


def sglang_module(policy: Path, arch, tensor) -> str:
    """The SGLang module that loads `tensor` (an arch TensorInfo) when this policy's plan is served. The IR's
    sglang_prefix is the module with shared-expert fusion off; only the SGLang backend knows whether its launch lets
    SGLang fuse a shared expert into the routed-experts FusedMoE (backends/sglang.py `serving_prefix`), so shared
    experts are asked there (it resolves the plan; rollout ep 1, as `explain` has no layout)."""
    unfused = tensor.sglang_prefix or tensor.hf_name.rsplit(".", 1)[0]
    if not tensor.role.startswith("shared_experts.") or tensor.mtp is not None:
        return unfused
    from .backends import sglang
    from .backends.common import UnsupportedByBackend
    from .resolve import resolve

    plan = resolve(policy, arch)
    try:
        fused = sglang.serving_prefix(plan, plan.by_name()[tensor.hf_name])
    except UnsupportedByBackend:
        return f"{unfused} (the SGLang backend refuses this plan: `policyc check`)"
    if fused == unfused:
        return unfused
    return (f"{fused} (SGLang {sglang.SGLANG_VERSION} fuses the shared expert into the routed-experts FusedMoE as "
            f"one more expert; unfused module {unfused})")


def _print_plan(plan: Plan, tensor_glob: Optional[str], expand: bool) -> None:
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    con = console()
    rows = plan_rows(plan, tensor_glob, expand)
    if tensor_glob and not rows:
        raise UserError(f"--tensor '{tensor_glob}' matches no tensor of {plan.model}",
                        "globs match HF names, e.g. 'model.layers.3.mlp.experts.*'")
    title = Text.assemble("policy ", (plan.policy_name, "bold"), " on ", (plan.model, "bold"),
                          f" ({plan.model_type}, {plan.num_layers} layers) · target {plan.target}"
                          f"{' (emulated)' if plan.emulate else ''}")
    table = Table(title=title, title_justify="left", show_lines=False, header_style="bold")
    for col in ("layers", "tensors", "shape", "weight", "activation", "grad", "backward", "rule"):
        table.add_column(col, overflow="fold", no_wrap=col != "tensors")
    prev = None
    for r in rows:
        style = "dim" if r.weight in ("bf16", "fp16", "fp32") else None
        cells = (r.layers if r.layers != prev else "", r.tensors, r.shape, r.weight, r.activation, r.grad,
                 r.backward, r.rule)
        table.add_row(*cells, style=style)  # plain strings: the console never parses markup
        prev = r.layers
    con.print(table)
    summary = Table(title="summary (weights)", title_justify="left", header_style="bold")
    for col in ("format", "params", "% params", "bytes before", "bytes after"):
        summary.add_column(col, justify="right" if col != "format" else "left")
    total_p = total_b = total_a = 0
    for fmt, n, pct, b, a in summarize(plan):
        summary.add_row(fmt, _human(n), f"{pct:.1f}%", _human(b, "B"), _human(a, "B"))
        total_p, total_b, total_a = total_p + n, total_b + b, total_a + a
    summary.add_row(Text("total", style="bold"), _human(total_p), "100.0%", _human(total_b, "B"), _human(total_a, "B"))
    con.print(summary)
    src = {}
    for t in plan.tensors:
        if t.source_precision is not None and t.source_precision.is_quantized:
            src[t.source_precision.short()] = src.get(t.source_precision.short(), 0) + 1
    for fmt, n in src.items():
        con.print(f"source: {n} linears are stored {escape(fmt)} in the checkpoint (config.json quantization_config); "
                  "bytes before count them as stored")
    roles, main, mtp = role_summary(plan)
    by_role = Table(title="parameters by role (main model" + (", MTP apart" if mtp else "") + ")",
                    title_justify="left", header_style="bold")
    for col in ("role", "params", "% of model", "weight formats"):
        by_role.add_column(col, justify="right" if col in ("params", "% of model") else "left")
    for g, n, pct, f in roles:
        by_role.add_row(g, _human(n), f"{pct:.1f}%", f)
    by_role.add_row(Text("model", style="bold"), _human(main), "100.0%", "")
    if mtp:
        by_role.add_row("MTP modules", _human(mtp), "(apart)", "")
    con.print(by_role)
    experts = sum(n for g, n, _, _ in roles if g in ("routed_experts", "shared_experts"))
    if experts:
        con.print(f"routed+shared experts: {_params(experts, main)} of {_params(main, main)} parameters "
                  f"({100.0 * experts / main:.1f}%)")
    groups = len(plan.share_scale_groups)
    if groups:
        con.print(f"share-scale groups: {groups} (one global scale per group)")
    con.print(f"plan hash: {plan.content_hash()}")
    for note in plan.notes:
        con.print(f"[yellow]note:[/] {escape(note)}", markup=True)
    if any(t.weight.kind in BLACKWELL_ONLY_KINDS or t.activation.kind in BLACKWELL_ONLY_KINDS
           for t in plan.tensors if t.is_linear):
        con.print(f"[yellow]note:[/] {escape(EMULATION_NOTE)}", markup=True)
    for hint in plan_hints(plan):
        con.print(f"[cyan]hint:[/] {escape(hint)}", markup=True)


# ---------------------------------------------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------------------------------------------
def _print_families() -> None:
    from rich.markup import escape
    from rich.table import Table

    from .arch.families import FAMILIES

    table = Table(title="supported model families (dispatch: config.json `architectures` first, `model_type` second)",
                  title_justify="left", header_style="bold")
    for col in ("family", "HF architectures", "model_type", "example (bundled)", "public models covered"):
        table.add_column(col, overflow="fold")
    for f in FAMILIES:
        table.add_row(*map(escape, (f.model_type, ", ".join(f.architectures), ", ".join((f.model_type, *f.aliases)),
                                    f.example or "-", f.models)))
    console().print(table)
    console().print("policyc arch MODEL lists a model's tensors; MODEL is a bundled name, a config.json or a "
                     "checkpoint directory")


def diff_plans(a: Plan, b: Plan) -> list[tuple[str, str, str]]:
    """(hf_name, precision in A, precision in B) for every tensor whose precision or share group differs."""
    bmap = b.by_name()
    out = []
    for t in a.tensors:
        u = bmap.get(t.hf_name)
        if u is None:
            continue
        if t.precision != u.precision or t.share_scale_group != u.share_scale_group:
            sa = t.precision.short() + (" +shared" if t.share_scale_group else "")
            sb = u.precision.short() + (" +shared" if u.share_scale_group else "")
            out.append((t.hf_name, sa, sb))
    return out


# ---------------------------------------------------------------------------------------------------------------
# typer commands
# ---------------------------------------------------------------------------------------------------------------
POLICY_ARG = typer.Argument(..., help="policy file (.policy)", show_default=False)
MODEL_OPT = typer.Option("tiny-moe", "--model", "-m",
                         help="bundled model name (tiny-moe, qwen3-30b-a3b, deepseek-v3, ...), a config.json or a "
                              "checkpoint directory")
PARALLEL_OPT = typer.Option(None, "--parallel", "-p",
                            help="parallel layout, e.g. 'trainer:tp=2,etp=1,ep=8,pp=2 rollout:tp=8,ep=8'")


def register(app: typer.Typer) -> None:
    from .backends.cli import backend_help, rollout_help, vllm_version_help  # choices from the backend registry

    @app.command("plan")
    def plan_cmd(policy: Path = POLICY_ARG, model: str = MODEL_OPT,
                 parallel: Optional[str] = PARALLEL_OPT,
                 as_json: bool = typer.Option(False, "--json", help="print the full plan as JSON"),
                 tensor: Optional[str] = typer.Option(None, "--tensor", "-t", help="only tensors matching this glob"),
                 expand: bool = typer.Option(False, "--expand", help="one row group per layer (no merging of "
                                                                     "identical consecutive layers)")) -> None:
        """Resolve POLICY against a model and show the per-tensor precision plan."""

        def body():
            plan = build_plan(policy, model, parallel)
            if as_json:
                if tensor:
                    keep = tuple(t for t in plan.tensors if fnmatch.fnmatchcase(t.hf_name, tensor))
                    data = json.loads(plan.to_json())
                    data["tensors"] = [json.loads(t.model_dump_json()) for t in keep]
                    sys.stdout.write(json.dumps(data, indent=2) + "\n")
                else:
                    for piece in plan.json_pieces():  # DeepSeek-V3: 55 MB, never held whole
                        sys.stdout.write(piece)
                    sys.stdout.write("\n")
            else:
                _print_plan(plan, tensor, expand)

        guard(body)

    @app.command("explain")
    def explain_cmd(policy: Path = POLICY_ARG,
                    tensor: str = typer.Argument(..., help="HF tensor name (or glob; first match is explained)"),
                    model: str = MODEL_OPT) -> None:
        """Show every rule that matched TENSOR, in order, and which one won."""

        def body():
            from .resolve import explain

            if not Path(policy).is_file():
                raise policy_not_found(policy)
            arch = load_arch(model)
            names = [t.hf_name for t in arch.tensors]
            if tensor in names:
                target = tensor
            else:
                hits = [n for n in names if fnmatch.fnmatchcase(n, tensor)]
                if not hits:
                    import difflib

                    close = difflib.get_close_matches(tensor, names, n=3)
                    raise UserError(f"no tensor named '{tensor}' in {arch.name}",
                                    ("did you mean " + ", ".join(close)) if close else
                                    "run `policyc plan --json` to list tensor names")
                target = hits[0]
            from rich.markup import escape
            from rich.text import Text

            matches = explain(policy, arch, target)
            con = console()
            con.print(Text(target, style="bold"))
            info = next(t for t in arch.tensors if t.hf_name == target)
            if info.megatron_name:
                con.print(Text(f"  megatron: {info.megatron_name}" + (f" [{info.megatron_part}]" if info.megatron_part
                                                                       else ""), style="dim"))
            con.print(Text(f"  sglang:   {sglang_module(policy, arch, info)}", style="dim"))
            if not matches:
                con.print("  no rule matched; the policy's default applies")
            for ref, prec, won in matches:
                mark = "[green]✔ wins[/]" if won else "[dim]overridden[/]"
                where = "default" if ref is None else str(ref)
                text = "" if ref is None else ref.text
                con.print(f"  {mark}  {escape(where)}  {escape(prec.short())}", markup=True)
                if text:
                    con.print(Text(f"          {text}", style="dim"))

        guard(body)

    @app.command("check")
    def check_cmd(policy: Path = POLICY_ARG, model: str = MODEL_OPT,
                  parallel: Optional[str] = PARALLEL_OPT,
                  backend: Optional[List[str]] = typer.Option(None, "--backend", "-b", help=backend_help()),
                  te_version: Optional[str] = typer.Option(None, "--te-version",
                                                           help="installed TransformerEngine version"),
                  rollout: Optional[str] = typer.Option(None, "--rollout", help=rollout_help()),
                  vllm_version: Optional[str] = typer.Option(None, "--vllm-version", help=vllm_version_help()),
                  strict: bool = typer.Option(False, "--strict", help="treat warnings as errors")) -> None:
        """Run all static checks (block divisibility, fused siblings, share-scale groups, hardware, parallel layout)
        and every backend emitter (the gate `policyc emit` runs): what check accepts, emit emits. Exit code 0 when
        clean, 1 when any error is found; all problems are reported together."""

        def body():
            from .backends.cli import chosen_backends, emit_options, print_diagnostics
            from .engine.gate import run_gate

            chosen = chosen_backends(backend)
            options = emit_options(te_version, rollout, vllm_version)
            plan, arch = build_plan_and_arch(policy, model, parallel)
            res = run_gate(plan, arch, chosen, options)
            diags = res.diagnostics
            con = console()
            n_err = sum(1 for d in diags if d.severity == "error")
            n_warn = len(diags) - n_err
            print_diagnostics(diags, con)
            status = "ok" if res.ok(strict) else "failed"
            con.print(f"{plan.policy_name} on {plan.model}: {n_err} error(s), {n_warn} warning(s) — {status}")
            if status != "ok":
                raise typer.Exit(1)

        guard(body)

    @app.command("arch")
    def arch_cmd(model: Optional[str] = typer.Argument(
                     None, help="bundled name, config.json or checkpoint directory; omit to list the families"),
                 as_json: bool = typer.Option(False, "--json", help="every tensor as JSON lines"),
                 name: Optional[str] = typer.Option(None, "--name", help="only tensors whose HF name matches")) -> None:
        """List the supported model families (no argument), or the checkpoint tensors of a model: HF name, shape,
        role, Megatron name, SGLang prefix."""

        def body():
            from rich.table import Table

            if model is None:
                _print_families()
                return
            arch = load_arch(model)
            ts = [t for t in arch.tensors if not name or fnmatch.fnmatchcase(t.hf_name, name)]
            if name and not ts:
                raise UserError(f"--name '{name}' matches no tensor of {arch.name}")
            if as_json:
                for t in ts:
                    sys.stdout.write(t.model_dump_json() + "\n")
                return
            how = arch.model_type
            if arch.architecture or arch.source_model_type:
                how += " via " + " / ".join(x for x in (arch.architecture, arch.source_model_type and
                                                       f"model_type {arch.source_model_type}") if x)
            fp8 = [t.source_format for t in arch.tensors if t.source_format is not None]
            src = f"; the release stores {len(fp8)} linears as {fp8[0].short()}" if fp8 else ""
            table = Table(title=f"{arch.name} ({how}): {len(arch.tensors)} tensors, "
                                f"{_params(arch.total_params, arch.total_params, 2)} parameters{src}",
                          title_justify="left",
                          header_style="bold")
            for col in ("hf name", "shape", "role", "megatron", "sglang prefix"):
                table.add_column(col, overflow="fold")
            for t in ts[:2000]:
                meg = (t.megatron_name or "") + (f" [{t.megatron_part}]" if t.megatron_part else "")
                table.add_row(t.hf_name, "x".join(map(str, t.shape)), t.role, meg, t.sglang_prefix or "")
            console().print(table)
            if len(ts) > 2000:
                console().print(f"... {len(ts) - 2000} more (use --name GLOB or --json)")
            from .engine.plans import default_policy, fitting_policies, is_dense

            console().print(f"shipped policies that fit {arch.name} ({'dense' if is_dense(arch) else 'MoE'}): "
                            f"{', '.join(fitting_policies(arch))}; `policyc run` default: {default_policy(arch)}")

        guard(body)

    @app.command("diff")
    def diff_cmd(policy_a: Path = typer.Argument(..., help="first policy"),
                 policy_b: Path = typer.Argument(..., help="second policy"),
                 model: str = MODEL_OPT,
                 full: bool = typer.Option(False, "--full", help="list every tensor instead of collapsed patterns")
                 ) -> None:
        """Which tensors change format between two policies."""

        def body():
            from rich.table import Table

            a = build_plan(policy_a, model)
            b = build_plan(policy_b, model)
            changes = diff_plans(a, b)
            con = console()
            if not changes:
                con.print(f"no tensor of {a.model} changes format between {policy_a} and {policy_b}")
                return
            table = Table(title=f"{len(changes)} tensor(s) change format", title_justify="left", header_style="bold")
            table.add_column("tensors", overflow="fold")
            table.add_column("count", justify="right")
            table.add_column(str(policy_a.name))
            table.add_column(str(policy_b.name))
            by_pair: "OrderedDict[tuple[str, str], list[str]]" = OrderedDict()
            for name, sa, sb in changes:
                by_pair.setdefault((sa, sb), []).append(name)
            for (sa, sb), names in by_pair.items():
                items = [(n, 1) for n in names] if full else collapse_names(names)
                for text, n in items:
                    table.add_row(text, str(n), sa, sb)
            con.print(table)

        guard(body)
