"""Policy (files) + Architecture (+ ParallelLayout) -> Plan. Pure functions, no global state.

Semantics (docs/LANGUAGE.md is the reference):
* Statements are flattened first: `import "f"` inlines f's statements at that point, `extends "f"` inlines f at the
  top of the importing file. Paths resolve relative to the importing file, then the bundled policies/ dir.
* The last `target` and the last `default` win. `default` is the baseline under every rule (it is not positional).
* Rules apply in order and the LATER matching rule wins. Quantized formats apply to linear weights only: on a mixed
  selection the non-linear tensors keep what they had; a selection with no linear weight at all is an error.
* A rule (or share_scale) that matches nothing is an error unless `optional`.

Error policy: everything that is wrong with the POLICY (syntax, unknown names, formats, unmatched selectors,
format/target mismatch, share_scale groups that get different formats) raises `PolicyError` from `resolve`.
Problems that come from the MODEL or the PARALLEL LAYOUT (block divisibility, TP shards, fused siblings that a policy
split, ETP mismatch, pipeline stages) are reported by `checks.check(plan, arch, parallel)` as Diagnostics.

Performance: selector matching is done once per (role, layer, is-mtp) group, not per tensor (only `name(...)` globs
are evaluated per tensor), and TensorPlans are built without re-validation (`plan.new_tensor_plan`: the inputs
are validated already).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Optional, Union

from . import __version__
from .arch.base import Architecture, LINEAR_ROLES, ROLES, gc_paused
from .diagnostics import PolicyError
from .lang import ast
from .lang.formats import precision_from_spec
from .lang.parser import parse_policy as _parse_text
from .plan import ParallelLayout, Plan, RuleRef, TensorPlan, new_share_scale_group, new_tensor_plan
from .precision import (BLACKWELL_ONLY_KINDS, CHECKPOINT_DTYPES, ELEMENT_BITS, SOURCE_DTYPE_OF_FORMAT, FormatError,
                        Precision, source_bytes, storage_bytes)
from .resources import find_policy, policies_dir, policy_hint

PolicySource = Union[str, Path, ast.Policy]

# Roles that exist only inside MTP modules: a plain role selector may name them (no `mtp.` prefix needed).
MTP_ONLY_ROLES = frozenset(r for r in ROLES if r.startswith("mtp.")) | {"norm.mtp"}


# ---- parsing and imports -------------------------------------------------------------------------------------------
def parse_policy(text: str, filename: str = "<policy>") -> ast.Policy:
    """Parse one file's text (imports are not followed; see `load_policy_statements`)."""
    return _parse_text(text, filename)


MAX_POLICY_BYTES = 1 << 20  # the shipped policies are < 2 KiB


def load_policy(path: Union[str, Path], imported: bool = False) -> ast.Policy:
    """Read and parse one policy file. A missing/unreadable file is a PolicyError (no traceback).

    `imported`: the file was named by an `import`/`extends`, not by the user. If it does not even start like a
    policy (`policy "name" {`), its content is never shown: an import of /proc/self/environ or a key file must not
    print secrets into logs, so the error names the file and position only."""
    p = find_policy(path) or Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_POLICY_BYTES + 1)
    except FileNotFoundError:
        raise PolicyError(f"policy file not found: {path}", hint=policy_hint()) from None
    except OSError as e:
        raise PolicyError(f"cannot read policy file {path}: {e.strerror or type(e).__name__}",
                          hint="policy files are UTF-8 text") from None
    if len(raw) > MAX_POLICY_BYTES:
        raise PolicyError(f"policy file {path} is larger than {MAX_POLICY_BYTES} bytes",
                          hint="policy files are small text files; is this the right path?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError(f"policy file {path} is not UTF-8 text (byte {e.start})",
                          hint="policy files are UTF-8 text") from None
    if imported and not _HEADER_RE.match(text):
        raise PolicyError(f"imported file {path} is not a policy file (it does not start with "
                          f'`policy "name" {{`); its content is not shown', hint="import only .policy files")
    return _parse_text(text, str(path))


# optional comments / blank lines, then `policy "...` (the grammar's first tokens)
_HEADER_RE = re.compile(r'\A(?:[ \t\f\r\n;]|#[^\n]*)*policy[ \t\f\r]*"')


@dataclass
class FlatPolicy:
    """A root policy with every import inlined, in application order."""

    root: ast.Policy
    statements: list  # ast.Statement, imports removed
    files: list[str]  # root first, then imported files in resolution order
    sources: dict[str, str] = field(default_factory=dict)  # file -> text (for caret diagnostics)
    imported_from: dict[str, str] = field(default_factory=dict)  # file -> "importer:line:col"


def _resolve_import_path(imp: ast.Import, importer_file: str) -> Path:
    rel = Path(imp.path)
    cands = [rel] if rel.is_absolute() else [Path(importer_file).parent / rel]
    try:
        cands.append(policies_dir() / rel)
    except FileNotFoundError:  # pragma: no cover
        pass
    for c in cands:
        if c.is_file():
            return c
    raise PolicyError(f"cannot find {imp.kind}ed policy '{imp.path}'", imp.span,
                      f"looked in {', '.join(str(c.parent) for c in cands)}; " + policy_hint())


def flatten(root: PolicySource) -> FlatPolicy:
    """Load `root` (path or parsed Policy) and inline its imports. Import cycles are errors.

    Each file is read, parsed and flattened once per call (memoised by resolved path), and a statement inlined
    twice keeps only its LAST occurrence: under "later statement wins" an earlier copy of the very same statement
    can never decide anything the later copy does not, so dropping it changes no result, while keeping both made a
    diamond of imports cost 2^depth (30 levels: days; now linear)."""
    policy = root if isinstance(root, ast.Policy) else load_policy(root)
    flat = FlatPolicy(root=policy, statements=[], files=[policy.span.file],
                      sources={policy.span.file: policy.source})
    memo: dict[str, tuple] = {}
    flat.statements = list(_inline(policy, flat, stack=[_key(policy.span.file)], memo=memo))
    return flat


def _key(file: str) -> str:
    try:
        return str(Path(file).resolve())
    except OSError:  # pragma: no cover
        return file


def _last_occurrences(stmts: list) -> tuple:
    seen: set[int] = set()
    out = []
    for st in reversed(stmts):
        if id(st) not in seen:
            seen.add(id(st))
            out.append(st)
    return tuple(reversed(out))


def _inline(policy: ast.Policy, flat: FlatPolicy, stack: list[str], memo: dict) -> tuple:
    stmts = list(policy.statements)
    out: list = []
    # `extends` = import at the top of the file
    ordered = [s for s in stmts if isinstance(s, ast.Import) and s.kind == "extends"] + \
              [s for s in stmts if not (isinstance(s, ast.Import) and s.kind == "extends")]
    for st in ordered:
        if not isinstance(st, ast.Import):
            out.append(st)
            continue
        try:
            path = _resolve_import_path(st, policy.span.file)
        except PolicyError as e:
            e.source = policy.source
            raise
        key = _key(str(path))
        if key in stack:
            chain = " -> ".join(Path(k).name for k in stack[stack.index(key):] + [key])
            raise PolicyError(f"import cycle: {chain}", st.span, "remove one of the imports; a policy cannot "
                              "(directly or indirectly) import itself", policy.source)
        where = f"{st.span.file}:{st.span.line}:{st.span.col}"
        if key in memo:  # already flattened (its own imports included): a file's expansion never depends on
            out.extend(memo[key])  # who imports it, and it cannot close a cycle (that was checked when it was built)
            continue
        try:
            child = load_policy(path, imported=True)
        except PolicyError as e:
            raise e.with_note(f"imported from {where}")
        if child.span.file not in flat.sources:
            flat.files.append(child.span.file)
            flat.sources[child.span.file] = child.source
            flat.imported_from[child.span.file] = where
        try:
            memo[key] = _inline(child, flat, stack + [key], memo)
        except PolicyError as e:
            raise e.with_note(f"imported from {where}")
        out.extend(memo[key])
    return _last_occurrences(out)


# ---- compiled rules ------------------------------------------------------------------------------------------------
@dataclass
class _Matcher:
    """A selector compiled against one architecture."""

    layers: Optional[frozenset[int]]  # decoder block indices, None = any
    mtp: bool  # restricted to MTP modules
    roles: Optional[frozenset[str]]  # None = any role
    name_re: Optional[re.Pattern]

    def matches_key(self, role: str, layer: Optional[int], is_mtp: bool) -> bool:
        if self.mtp and not is_mtp:
            return False
        if self.layers is not None and (is_mtp or layer not in self.layers):
            return False
        if self.roles is not None:
            if role not in self.roles:
                return False
            if is_mtp and not self.mtp and role not in MTP_ONLY_ROLES:
                return False  # plain role selectors do not reach into MTP modules
        return True


@dataclass
class _Rule:
    index: int
    node: ast.Rule
    ref: RuleRef
    precision: Precision
    quantized: bool
    matcher: _Matcher
    source: str
    # True when the selector addresses non-linear tensors on purpose (a name glob, or only non-linear roles such as
    # `norm`, `router.bias`): then a high-precision rule applies to them as written. Otherwise (layers[...], mtp,
    # mixed role groups) it may widen but never narrow them, like `default`.
    explicit_nonlinear: bool = False
    matched: int = 0
    matched_linear: int = 0


def _ref(node, text: str) -> RuleRef:
    return RuleRef(file=node.span.file, line=node.span.line, col=node.span.col, text=text)


def _format_error(e: FormatError, node_span: ast.Span, source: str) -> PolicyError:
    span = getattr(e, "span", None) or node_span
    return PolicyError(str(e), span, e.hint, source)


def _compile_precision(spec: ast.PrecisionSpec, source: str) -> Precision:
    try:
        return precision_from_spec(spec)
    except FormatError as e:
        raise _format_error(e, spec.span, source) from None


def _position(b: ast.LayerBound, n: int, rounding) -> int:
    """Slice bound -> index. Percent p: fractional position p/100*N (negative = from the end), START floored,
    STOP ceiled, so a percent slice selects every layer overlapping the fractional range. Exact arithmetic
    (Fraction of the written decimal) so 10% of 30 layers is exactly 3, not 3.0000000000000004."""
    if b.percent:
        x = Fraction(repr(b.value)) / 100 * n
        if b.value < 0:
            x = n + x
        pos = rounding(x)
    else:
        pos = int(b.value)
        if pos < 0:
            pos += n
    return min(max(pos, 0), n)


def layer_indices(sl: ast.LayerSlice, num_layers: int, source: str = "", optional: bool = False) -> list[int]:
    """Decoder-block indices selected by a `layers[...]` slice for a model with `num_layers` blocks.
    Ranges follow Python slice semantics for integers (negative from the end, clamped); single indices must exist
    (an out-of-range index is an error unless the rule is optional)."""
    n = num_layers
    if sl.is_range:
        start = 0 if sl.start is None else _position(sl.start, n, math.floor)
        stop = n if sl.stop is None else _position(sl.stop, n, math.ceil)
        return list(range(start, stop))
    out = []
    for b in sl.indices:
        if b.percent:
            x = Fraction(repr(b.value)) / 100 * n
            i = math.floor(n + x if b.value < 0 else x)
        else:
            i = int(b.value)
            i = i + n if i < 0 else i
        if not 0 <= i < n:
            if optional:
                continue
            raise PolicyError(f"layer index {b.value:g}{'%' if b.percent else ''} is out of range: the model has "
                              f"{n} decoder layers (0..{n - 1})", b.span,
                              "use an index in range, a negative index from the end, or mark the rule `optional`",
                              source)
        if i not in out:
            out.append(i)
    return out


def _compile_selector(sel: ast.Selector, arch: Architecture, source: str, optional: bool) -> _Matcher:
    layers = None
    if sel.layers is not None:
        layers = frozenset(layer_indices(sel.layers, arch.num_layers, source, optional))
    roles = None
    if sel.role is not None:
        g, members = sel.role.group, sel.role.members
        if members:
            roles = frozenset(f"{g}.{m}" for m in members)
        else:
            roles = frozenset(r for r in ROLES if r == g or r.startswith(g + "."))
    name_re = re.compile(fnmatch.translate(sel.name.pattern)) if sel.name is not None else None
    return _Matcher(layers=layers, mtp=sel.mtp, roles=roles, name_re=name_re)


# ---- resolution ------------------------------------------------------------------------------------------------------
def _ckpt_precision(dtype: str, cache: dict) -> Precision:
    p = cache.get(dtype)
    if p is None:
        p = cache[dtype] = Precision.high(CHECKPOINT_DTYPES.get(dtype, ("bf16", 2))[0])
    return p


def _ckpt_bits(dtype: str) -> int:
    return ELEMENT_BITS[CHECKPOINT_DTYPES.get(dtype, ("bf16", 2))[0]]


def _nonlinear_default(default: Optional[Precision], dtype: str, cache: dict) -> Precision:
    """Non-linear tensors take only the high-precision part of `default`, and `default` never narrows them
    (an fp32 router bias stays fp32 under `default bf16`); an explicit rule can."""
    ck = _ckpt_precision(dtype, cache)
    if default is None or default.weight.is_quantized:
        return ck
    if ELEMENT_BITS[default.weight.kind.value] >= ELEMENT_BITS[ck.weight.kind.value]:
        return default
    return ck


@dataclass
class Compiled:
    """A flattened policy compiled against one architecture (the resolver's working state; used by explain)."""

    flat: FlatPolicy
    rules: list[_Rule]
    shares: list[tuple[ast.ShareScale, _Matcher, RuleRef]]
    default: Optional[Precision]
    default_ref: Optional[RuleRef]
    target: str
    emulate: bool


def compile_policy(policy: PolicySource, arch: Architecture) -> Compiled:
    flat = flatten(policy)
    rules: list[_Rule] = []
    shares = []
    default = default_ref = None
    target, emulate = "blackwell", False
    target_node: Optional[ast.Target] = None
    try:
        for st in flat.statements:
            src = flat.sources.get(st.span.file, "")
            if isinstance(st, ast.Target):
                target, emulate, target_node = st.hardware, st.emulate, st
            elif isinstance(st, ast.Default):
                default = _compile_precision(st.precision, src)
                default_ref = _ref(st, _span_text(src, st.span) or "default")
                default_node = st
            elif isinstance(st, ast.Rule):
                prec = _compile_precision(st.precision, src)
                matcher = _compile_selector(st.selector, arch, src, st.optional)
                explicit = matcher.name_re is not None or (matcher.roles is not None
                                                           and not (matcher.roles & LINEAR_ROLES))
                rules.append(_Rule(index=len(rules), node=st, ref=_ref(st, st.text), precision=prec,
                                   quantized=prec.is_quantized, matcher=matcher, source=src,
                                   explicit_nonlinear=explicit))
            elif isinstance(st, ast.ShareScale):
                shares.append((st, _compile_selector(st.selector, arch, src, st.optional), _ref(st, st.text)))
    except PolicyError as e:
        _add_import_note(e, flat)
        raise
    # target hardware: MX/NV formats run natively only on Blackwell
    if target == "hopper" and not emulate:
        offenders = [(r.node.precision, r.precision, r.source) for r in rules]
        if default is not None:
            offenders.insert(0, (default_node.precision, default, flat.sources.get(default_node.span.file, "")))
        for spec, prec, src in offenders:
            kinds = {f.kind for f in (prec.weight, prec.activation, prec.grad)} & BLACKWELL_ONLY_KINDS
            if kinds:
                k = sorted(x.value for x in kinds)[0]
                err = PolicyError(f"{k} runs natively only on Blackwell, but the policy targets hopper", spec.span,
                                  "use `target blackwell`, or `target hopper emulate` to run it by exact emulation "
                                  "(quantize -> dequantize -> bf16 GEMM; no speed-up), or fp8 / fp8_block", src)
                if target_node is not None:
                    err.with_note(f"target set at {target_node.span.file}:{target_node.span.line}:"
                                  f"{target_node.span.col}")
                _add_import_note(err, flat)
                raise err
    return Compiled(flat=flat, rules=rules, shares=shares, default=default, default_ref=default_ref, target=target,
                    emulate=emulate)


def _span_text(src: str, span: ast.Span) -> str:
    lines = src.splitlines(keepends=True)

    def off(line: int, col: int) -> int:
        return sum(len(x) for x in lines[: line - 1]) + col - 1

    return " ".join(src[off(span.line, span.col):off(span.end_line, span.end_col)].split())


def _add_import_note(e: PolicyError, flat: FlatPolicy) -> None:
    if e.span is not None and e.span.file in flat.imported_from:
        e.with_note(f"imported from {flat.imported_from[e.span.file]}")


def _decide(rules: list[_Rule], base: Precision, linear: bool, ckpt_bits: int = 16):
    """Walk the matching rules in order (later wins). Returns (precision, decided_by, overridden, applied)."""
    prec, by, over, applied = base, None, [], []
    for r in rules:
        if not linear:
            if r.quantized:
                continue  # quantized formats do not apply to non-linear tensors: they keep what they had
            if not r.explicit_nonlinear and ELEMENT_BITS[r.precision.weight.kind.value] < ckpt_bits:
                continue  # e.g. `layers[-15%:]: bf16` does not narrow an fp32 router bias
        if by is not None:
            over.append(by)
        prec, by = r.precision, r.ref
        applied.append(r)
    return prec, by, tuple(over), applied


def resolve(policy_path: PolicySource, arch: Architecture, parallel: Optional[ParallelLayout] = None) -> Plan:
    """Resolve a policy (path, or an already parsed `ast.Policy`) against an architecture. Raises PolicyError for
    policy-level errors; run `checks.check(plan, arch, parallel)` for model/layout checks."""
    with gc_paused():  # one TensorPlan per tensor, no cycles
        return _resolve(policy_path, arch, parallel)


def _resolve(policy_path: PolicySource, arch: Architecture, parallel: Optional[ParallelLayout]) -> Plan:
    comp = compile_policy(policy_path, arch)
    tensors = arch.tensors
    n = len(tensors)
    precs: list[Optional[Precision]] = [None] * n
    decided: list[Optional[RuleRef]] = [None] * n
    overridden: list[tuple] = [()] * n
    dt_cache: dict = {}

    # Group tensors by everything a selector can look at: (role, layer, is-mtp) and, for rules with a name glob,
    # which of those globs match (a per-tensor regex only for the few glob rules). Each group is decided once.
    name_rules = [r for r in comp.rules if r.matcher.name_re is not None]
    glob_pos = {id(r): k for k, r in enumerate(name_rules)}
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        sig = tuple(r.matcher.name_re.match(t.hf_name) is not None for r in name_rules) if name_rules else ()
        key = (t.role, t.layer, t.mtp is not None, sig)
        idxs = groups.get(key)
        if idxs is None:
            idxs = groups[key] = []
        idxs.append(i)

    for (role, layer, is_mtp, sig), idxs in groups.items():
        linear = role in LINEAR_ROLES
        matching = [r for r in comp.rules if r.matcher.matches_key(role, layer, is_mtp)
                    and (r.matcher.name_re is None or sig[glob_pos[id(r)]])]
        if not matching:
            for i in idxs:
                t = tensors[i]
                precs[i] = (comp.default or _ckpt_precision(t.dtype, dt_cache)) if linear else \
                    _nonlinear_default(comp.default, t.dtype, dt_cache)
            continue
        for r in matching:
            r.matched += len(idxs)
            if linear:
                r.matched_linear += len(idxs)
        by_dtype: dict[str, tuple] = {}
        for i in idxs:
            t = tensors[i]
            res = by_dtype.get(t.dtype)
            if res is None:
                base = (comp.default or _ckpt_precision(t.dtype, dt_cache)) if linear else \
                    _nonlinear_default(comp.default, t.dtype, dt_cache)
                res = by_dtype[t.dtype] = _decide(matching, base, linear, _ckpt_bits(t.dtype))
            precs[i], decided[i], overridden[i] = res[0], res[1], res[2]

    for r in comp.rules:
        _check_rule_matched(r, arch, comp.flat)

    share_groups, group_of, notes = _share_scale_groups(comp, arch, precs, decided, groups)

    notes = list(notes)
    distinct = list({id(p): p for p in precs}.values())
    used_kinds = {p.weight.kind for p in distinct} | {p.activation.kind for p in distinct}
    if comp.emulate and comp.target == "hopper" and used_kinds & BLACKWELL_ONLY_KINDS:
        names = ", ".join(sorted(k.value for k in used_kinds & BLACKWELL_ONLY_KINDS))
        notes.append(f"target hopper emulate: {names} are not native on Hopper; they run by exact emulation "
                     "(quantize -> dequantize -> bf16/fp32 GEMM): same numerics, no speed-up")

    plans = _tensor_plans(tensors, precs, decided, overridden, group_of)
    if arch.source_quantization and not any(t.source_format for t in tensors):
        notes.append(f"the checkpoint's quantization_config says quant_method '{arch.source_quantization}', which "
                     "policyc cannot describe: bytes before are counted in torch_dtype and `convert` will refuse it")
    return Plan.model_construct(
        policy_name=comp.flat.root.name, policy_files=tuple(comp.flat.files), model=arch.name,
        model_type=arch.model_type, num_layers=arch.num_layers, target=comp.target, emulate=comp.emulate,
        parallel=parallel, tensors=tuple(plans), share_scale_groups=tuple(share_groups), policyc_version=__version__,
        notes=tuple(notes))


def _tensor_plans(tensors, precs: list, decided: list, overridden: list, group_of: dict) -> list[TensorPlan]:
    """One TensorPlan per checkpoint tensor, in HF order (46k on DeepSeek-V3: fields read from the TensorInfo's
    `__dict__`, a dict literal in TensorPlan's field order). Byte counts are computed once per distinct (shape,
    format): DeepSeek-V3 has a few dozen."""
    storage: dict = {}
    source: dict = {}
    plans = []
    append = plans.append
    linear_roles = LINEAR_ROLES
    group = group_of.get
    for i, (t, p, by, over) in enumerate(zip(tensors, precs, decided, overridden)):
        d = t.__dict__
        shape, dtype, sf = d["shape"], d["dtype"], d["source_format"]
        after = storage.get((shape, id(p)))  # precisions are shared objects, alive for the whole call
        if after is None:
            after = storage[shape, id(p)] = storage_bytes(p.weight, shape)
        # sf: a quantized source (FP8-block release) is stored as float8_e4m3fn + a scale grid
        before = source.get((shape, dtype, id(sf)))  # source formats are shared objects of the architecture
        if before is None:
            before = source[shape, dtype, id(sf)] = source_bytes(dtype, shape, sf)
        append(new_tensor_plan({
            "hf_name": d["hf_name"], "megatron_name": d["megatron_name"], "megatron_part": d["megatron_part"],
            "sglang_prefix": d["sglang_prefix"], "role": d["role"], "layer": d["layer"], "expert": d["expert"],
            "mtp": d["mtp"], "shape": shape, "is_linear": d["role"] in linear_roles, "precision": p,
            "share_scale_group": group(i), "bytes_before": before, "bytes_after": after, "decided_by": by,
            "overridden": over, "fused_group": d["fused_group"],
            "source_dtype": dtype if sf is None else SOURCE_DTYPE_OF_FORMAT[sf.element], "source_format": sf}))
    return plans


def _describe_selector(sel: ast.Selector, arch: Architecture) -> str:
    if sel.layers is not None:
        return f"the model has {arch.num_layers} decoder layers (0..{arch.num_layers - 1})"
    if sel.mtp:
        return f"'{arch.name}' has {arch.num_mtp_layers} MTP modules"
    if sel.role is not None:
        present = sorted({t.role.split('.')[0] for t in arch.tensors})
        return f"'{arch.name}' has role groups: {', '.join(present)}"
    return "no HF tensor name matches the pattern"


def _check_rule_matched(r: _Rule, arch: Architecture, flat: FlatPolicy) -> None:
    sel = r.node.selector
    if r.matched == 0 and not r.node.optional:
        err = PolicyError(f"selector `{_sel_text(r)}` matches no tensor of '{arch.name}'", sel.span,
                          f"{_describe_selector(sel, arch)}; mark the rule `optional` if it may match nothing",
                          r.source)
        _add_import_note(err, flat)
        raise err
    if r.quantized and r.matched > 0 and r.matched_linear == 0:
        err = PolicyError(f"quantized format {r.precision.short()} on `{_sel_text(r)}`, which selects no linear "
                          "weight", r.node.precision.span,
                          "quantized formats apply only to linear (GEMM) weights; norms, embeddings, routers and "
                          "biases may only be bf16 / fp16 / fp32", r.source)
        _add_import_note(err, flat)
        raise err


def _sel_text(r: _Rule) -> str:
    txt = r.node.text
    if r.node.optional:
        txt = txt[len("optional"):].strip()
    return _before_spec(txt).strip()


def _before_spec(rule_text: str) -> str:
    """The selector part of `selector: spec`: up to the first ':' outside brackets, parentheses and strings (a
    layer slice `layers[5:2]` or a name glob `name("a:b")` has colons of its own)."""
    depth, quote, escaped = 0, None, False
    for i, ch in enumerate(rule_text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == ":" and depth == 0:
            return rule_text[:i]
    return rule_text


def _group_id(names: tuple[str, ...]) -> str:
    """e.g. model.layers.3.mlp.experts.17.{gate_proj,up_proj}"""
    parts = [n.rsplit(".", 2) for n in names]  # [prefix, module leaf, "weight"]
    prefix = parts[0][0]
    if all(len(p) == 3 and p[0] == prefix for p in parts):
        return prefix + ".{" + ",".join(p[1] for p in parts) + "}"
    return "{" + ",".join(n.rsplit(".", 1)[0] for n in names) + "}"  # TensorInfo.module of each member


@dataclass
class _ShareInstance:
    """One fused-sibling instance (one layer's q/k/v, one expert's gate/up) selected by share_scale statements."""

    members: set[int]  # tensor indices
    st: ast.ShareScale  # the first statement that selected it
    ref: RuleRef
    src: str


def _share_instances(comp: Compiled, arch: Architecture, keyed: dict) -> dict[tuple, _ShareInstance]:
    """Fused-sibling instance key (CheckpointTensor.fused_key) -> the tensors share_scale statements select in it.
    Selectors are matched per (role, layer, is-mtp) group like rules; a selected tensor without fused siblings and
    a non-optional statement selecting nothing are PolicyErrors."""
    tensors = arch.tensors
    instances: dict[tuple, _ShareInstance] = {}
    for st, matcher, ref in comp.shares:
        src = comp.flat.sources.get(st.span.file, "")
        name_re = matcher.name_re
        hits = [i for (role, layer, is_mtp, _sig), idxs in keyed.items() if matcher.matches_key(role, layer, is_mtp)
                for i in idxs if name_re is None or name_re.match(tensors[i].hf_name)]
        if not hits:
            if st.optional:
                continue
            err = PolicyError("share_scale selector matches no tensor of " f"'{arch.name}'", st.selector.span,
                              "mark it `optional share_scale ...` if the model may lack these tensors", src)
            _add_import_note(err, comp.flat)
            raise err
        hits.sort()  # error messages name the first offender in HF order
        for i in hits:
            t = tensors[i]
            key = t.fused_key
            if key is None:
                err = PolicyError(f"share_scale selects '{t.hf_name}' ({t.role}), which has no fused siblings",
                                  st.selector.span, "share_scale groups fused siblings: q/k/v, gate/up (dense, "
                                  "routed or shared experts), q_a/kv_a; narrow the selector, e.g. "
                                  "routed_experts.{gate, up}", src)
                _add_import_note(err, comp.flat)
                raise err
            inst = instances.get(key)
            if inst is None:
                inst = instances[key] = _ShareInstance(members=set(), st=st, ref=ref, src=src)
            inst.members.add(i)
    return instances


def _share_scale_groups(comp: Compiled, arch: Architecture, precs: list, decided: list, keyed: dict):
    """The plan's share-scale groups (in order of first selection), the group id of each member's index, and notes.
    Members of a group get one shared Precision object whose weight has global_scale 'group' (`precs` is updated in
    place). Members with different formats are a PolicyError."""
    tensors = arch.tensors
    notes: list[str] = []
    if not comp.shares:
        return [], {}, notes
    out, group_of = [], {}
    noted: set = set()
    shared_of: dict[int, tuple] = {}  # id(member precision) -> (it, its group-scaled copy); held: ids stay valid
    for inst in _share_instances(comp, arch, keyed).values():
        idxs = sorted(inst.members)
        st, src = inst.st, inst.src
        if len(idxs) < 2:
            err = PolicyError(f"share_scale group of '{tensors[idxs[0]].hf_name}' has a single member",
                              st.selector.span, "select all fused siblings, e.g. routed_experts.{gate, up}", src)
            _add_import_note(err, comp.flat)
            raise err
        first = precs[idxs[0]]
        for i in idxs[1:]:
            if precs[i] is not first and precs[i] != first:
                a, b = tensors[idxs[0]], tensors[i]
                err = PolicyError(
                    f"share_scale members get different formats: '{a.hf_name}' is {first.short()} "
                    f"(by {_by(decided[idxs[0]])}) but '{b.hf_name}' is {precs[i].short()} (by {_by(decided[i])})",
                    st.span, "one shared scale needs one format: give all members the same rule", src)
                _add_import_note(err, comp.flat)
                raise err
        w = first.weight
        if not w.is_quantized:
            continue  # high-precision members (e.g. the BF16 final layers) have no scale to share: no group
        if w.global_scale not in ("tensor", "expert", "group"):
            if id(st) not in noted:
                noted.add(id(st))
                notes.append(f"share_scale at {inst.ref}: some members are {first.short()}, which has no "
                             "second-level (per-tensor) scale, so they form no share-scale group")
            continue
        if id(first) not in shared_of:
            shared_of[id(first)] = (first, first.model_copy(
                update={"weight": w.model_copy(update={"global_scale": "group"})}))
        shared = shared_of[id(first)][1]
        names = tuple([tensors[i].hf_name for i in idxs])
        gid = _group_id(names)
        out.append(new_share_scale_group({"id": gid, "members": names, "declared_at": inst.ref}))
        for i in idxs:
            precs[i] = shared
            group_of[i] = gid
    return out, group_of, notes


def _by(ref: Optional[RuleRef]) -> str:
    return f"{ref} `{ref.text}`" if ref is not None else "default"


# ---- explain ---------------------------------------------------------------------------------------------------------
ExplainStep = tuple[Optional[RuleRef], Precision, bool]


def explain(policy_path: PolicySource, arch: Architecture, tensor_name_or_glob: str) -> list[ExplainStep]:
    """The decision chain of ONE tensor: the tensor named `tensor_name_or_glob`, or the first (HF order) tensor the
    glob matches. See `explain_all` for the step semantics."""
    return next(iter(explain_all(policy_path, arch, tensor_name_or_glob).values()))


def explain_all(policy_path: PolicySource, arch: Architecture,
                tensor_name_or_glob: str) -> dict[str, list[ExplainStep]]:
    """For every tensor whose HF name equals / glob-matches `tensor_name_or_glob` (in HF order): the chain of
    (rule, precision, won) that decided it. The first step is the baseline: the `default` statement's RuleRef (or
    None when the policy has no default: checkpoint dtype); later steps are the matching rules in source order; exactly
    one step has won=True. Quantized rules that do not apply to a non-linear tensor are omitted. Share-scale groups
    are reflected in the precision of the winning step (weight global_scale='group')."""
    plan = resolve(policy_path, arch)
    comp = compile_policy(policy_path, arch)
    pat = tensor_name_or_glob
    if any(c in pat for c in "*?["):
        rx = re.compile(fnmatch.translate(pat))
        idxs = [i for i, t in enumerate(arch.tensors) if rx.match(t.hf_name)]
    else:
        idxs = [i for i, t in enumerate(arch.tensors) if t.hf_name == pat]
    if not idxs:
        names = [t.hf_name for t in arch.tensors if abs(len(t.hf_name) - len(pat)) <= 4]
        close = difflib.get_close_matches(pat, names, n=1, cutoff=0.7)
        hint = f"did you mean '{close[0]}'?" if close else "use a full HF name or a glob, e.g. 'model.layers.0.*'"
        raise PolicyError(f"no tensor of '{arch.name}' matches '{pat}'", hint=hint)
    out: dict[str, list[ExplainStep]] = {}
    dt_cache: dict = {}
    for i in idxs:
        t = arch.tensors[i]
        linear = t.role in LINEAR_ROLES
        is_mtp = t.mtp is not None
        base = (comp.default or _ckpt_precision(t.dtype, dt_cache)) if linear else \
            _nonlinear_default(comp.default, t.dtype, dt_cache)
        mine = [r for r in comp.rules if r.matcher.matches_key(t.role, t.layer, is_mtp)
                and (r.matcher.name_re is None or r.matcher.name_re.match(t.hf_name))]
        _, _, _, applied = _decide(mine, base, linear, _ckpt_bits(t.dtype))
        steps: list[ExplainStep] = [(comp.default_ref if (comp.default is not None and base is comp.default) else None,
                                     base, False)]
        steps += [(r.ref, r.precision, False) for r in applied]
        final = plan.tensors[i].precision
        last = steps[-1]
        steps[-1] = (last[0], final, True)
        out[t.hf_name] = steps
    return out
