"""Shared vocabulary of the backends: the error a backend records when it cannot express a plan exactly, the
collector of those errors, the artifact container every emitter returns, atomic writing of artifact directories, and
small plan helpers.

Design rule (like sqlglot's dialect generators): each backend (backends/registry.py `Backend`) either expresses the
plan EXACTLY or records `UnsupportedByBackend(backend, tensor, capability)` in a `Problems` - every problem it finds,
not only the first. There is no "closest approximation" mode: an RL loop whose trainer and rollout silently disagree
on one tensor's format is the bug policyc exists to prevent.

Every artifact carries the plan's content hash (`plan_stamp`) so a consumer can refuse a mismatched contract.
No torch import here (the CLI imports this module's users lazily, but keep it light anyway).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional, TypeVar, Union

from precision_dsl.plan import Plan, TensorPlan
from precision_dsl.precision import FormatKind, TensorFormat, spec_of
from precision_dsl.errors import PolicycError

_T = TypeVar("_T")

# File every backend writes next to its artifacts: the full plan JSON (with content_hash) so a consumer can verify.
PLAN_FILE = "policyc_plan.json"


class UnsupportedByBackend(PolicycError):
    """`backend` cannot express the plan for `tensor` exactly because it lacks `capability`.

    Exit code 1 at the CLI (the policy is valid; this consumer cannot honour it)."""

    code = 1

    def __init__(self, backend: str, tensor: str, capability: str, hint: str = ""):
        self.backend = backend
        self.tensor = tensor
        self.capability = capability
        self.hint = hint or "change the policy for this tensor, or emit only the other backends with --backend"
        super().__init__(f"backend '{backend}' cannot express the plan for tensor '{tensor}': {capability}")


def unsupported_kind(backend: str, tensor: str, kind: FormatKind) -> UnsupportedByBackend:
    """The refusal for a format kind missing from a backend's format table."""
    return UnsupportedByBackend(backend, tensor, f"{kind.value} is unsupported by {backend}")


def argv_value(argv: list[str], flag: str) -> Optional[str]:
    """The value of `flag` in an engine's argv (`--flag VALUE` or `--flag=VALUE`), None when it is absent."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def kind_handler(table: Mapping[FormatKind, _T], kind: FormatKind, backend: str, tensor: str) -> _T:
    """`table[kind]`: a backend's handler for one format kind; a kind the table lacks raises `unsupported_kind`."""
    try:
        return table[kind]
    except KeyError:
        raise unsupported_kind(backend, tensor, kind) from None


class Problems:
    """Collects every UnsupportedByBackend of an emitter instead of stopping at the first (sqlglot's
    ErrorLevel.IMMEDIATE vs RAISE: here always RAISE, all problems reported together). A backend either `add`s a
    finding or calls a check through `run`; the caller (the gate) reads `folded()`, a raising API calls
    `raise_if_any()`. Findings with one cause (same backend + capability) over many tensors are folded into one,
    naming the first tensor and how many more share it."""

    def __init__(self):
        self.items: list[UnsupportedByBackend] = []

    def add(self, err: "UnsupportedByBackend") -> None:
        for e in getattr(err, "errors", None) or [err]:
            self.items.append(e)

    def run(self, fn, *args, **kwargs):
        """Call fn; an UnsupportedByBackend it raises is recorded and None returned."""
        try:
            return fn(*args, **kwargs)
        except UnsupportedByBackend as err:
            self.add(err)
            return None

    def folded(self) -> list["UnsupportedByBackend"]:
        groups: dict[tuple, list[UnsupportedByBackend]] = {}
        for e in self.items:
            groups.setdefault((e.backend, e.capability), []).append(e)
        out = []
        for (backend, capability), es in groups.items():
            more = len({e.tensor for e in es}) - 1
            cap = capability + (f" (and {more} more tensor{'s' if more > 1 else ''} like it)" if more else "")
            out.append(UnsupportedByBackend(backend, es[0].tensor, cap, es[0].hint))
        return out

    def raise_if_any(self) -> None:
        errs = self.folded()
        if len(errs) == 1:
            raise errs[0]
        if errs:
            raise BackendErrors(errs)


class BackendErrors(UnsupportedByBackend):
    """Several UnsupportedByBackend at once. Behaves like the first one (backend/tensor/capability/hint) so callers
    that handle a single error keep working; `errors` holds all of them and str() lists every one."""

    def __init__(self, errors: list[UnsupportedByBackend]):
        first = errors[0]
        super().__init__(first.backend, first.tensor, first.capability, first.hint)
        self.errors = list(errors)
        Exception.__init__(self, f"{len(errors)} problems:\n" + "\n".join(f"  - {e}" for e in errors))


class PlanMismatch(PolicycError):
    """A consumer was handed an artifact / payload produced for a different plan (content hash differs)."""

    code = 1

    def __init__(self, where: str, expected: str, got: Optional[str], hint: str = ""):
        self.expected, self.got = expected, got
        self.hint = hint or "re-run `policyc emit` / `policyc convert` with the same policy and model on both ends"
        super().__init__(f"{where}: plan content hash mismatch: expected {expected}, got {got or '<none>'}")


@dataclass(frozen=True)
class Artifact:
    """One file an emitter produces. `path` is relative to the output directory (e.g. `megatron/args.txt`).
    `content`: text, bytes, or a function producing the text piece by piece when the file is written (the plan file:
    55 MB on DeepSeek-V3, written without ever holding it whole)."""

    path: str
    content: Union[str, bytes, Callable[[], Iterable[str]]]
    description: str = ""

    def chunks(self) -> Iterator[bytes]:
        if callable(self.content):
            for piece in self.content():
                yield piece.encode()
        else:
            yield self.content.encode() if isinstance(self.content, str) else self.content

    def data(self) -> bytes:
        return b"".join(self.chunks())


def plan_json_pieces(plan: Plan) -> Iterator[str]:
    """policyc_plan.json: the plan's compact JSON (its content hash first) and a newline, in pieces."""
    yield from plan.json_pieces(plan.content_hash())
    yield "\n"


def plan_json_bytes(plan: Plan) -> bytes:
    """policyc_plan.json as bytes, encoded piece by piece: DeepSeek-V3's 55 MB are copied once, not three times
    (join, + newline, encode)."""
    return b"".join([piece.encode() for piece in plan_json_pieces(plan)])


def plan_artifact(plan: Plan, description: str) -> Artifact:
    """policyc_plan.json as an artifact written piece by piece (never held whole)."""
    return Artifact(PLAN_FILE, lambda: plan_json_pieces(plan), description)


def plan_stamp(plan: Plan) -> dict:
    """The header every artifact carries: enough to identify the contract and refuse a mismatch."""
    return {
        "policyc_version": plan.policyc_version,
        "policy": plan.policy_name,
        "model": plan.model,
        "content_hash": plan.content_hash(),
    }


def dump_json(obj, compact: bool = False) -> str:
    """Indented JSON for small files; compact (C encoder, ~10x faster) for manifests with one entry per tensor."""
    if compact:
        return json.dumps(obj, separators=(",", ":")) + "\n"
    return json.dumps(obj, indent=2, sort_keys=False) + "\n"


def argv_file(args: list[str]) -> str:
    """An argv fragment file users paste whole (`launch_server $(cat launch_args.txt)`): the words alone, one line,
    no comment (the engine would read `#` as an argument) and no shell quoting (`$(cat)` word-splits its output
    but never removes quotes). Every word must therefore survive word splitting and pathname expansion unchanged;
    the plan hash lives in the JSON / env.sh / YAML artifacts `check_artifacts` scans."""
    import re

    bad = [a for a in args if not a or re.search(r"[\s*?\[]", a)]
    if bad:  # pragma: no cover - an emitter bug, not a user error
        raise AssertionError(f"argv words {bad} do not survive $(cat) word splitting")
    return " ".join(args) + "\n"


def write_tree_atomic(out_dir: Path, files: Iterable[Artifact], force: bool = False) -> Path:
    """Write `files` under `out_dir` atomically: everything goes to a temp dir next to `out_dir`, which is then
    renamed into place. An existing `out_dir` is replaced only with `force` (it is moved aside first and removed
    after the rename, so a crash never leaves a half-written directory under the final name)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        from precision_dsl.backends.durable import OutputExists

        raise OutputExists(f"output directory '{out_dir}' already exists (pass --force to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for art in files:
            dest = tmp / art.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "wb") as f:
                for chunk in art.chunks():
                    f.write(chunk)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory `src` to `dst`, replacing an existing `dst` (caller checked --force)."""
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, dst)


# ---------------------------------------------------------------------------------------------------------------
# plan helpers
# ---------------------------------------------------------------------------------------------------------------
def is_quantized(t: TensorPlan) -> bool:
    return t.is_linear and t.precision.weight.is_quantized


def module_of(hf_name: str) -> str:
    """HF module path of a parameter name (drop the trailing `.weight` / `.bias`)."""
    return hf_name.rsplit(".", 1)[0]


def check_artifacts(out_dir: Path, plan: Plan) -> list[str]:
    """Consumer-side contract check: every plan hash found in the emitted artifacts under `out_dir` must be this
    plan's. Returns the artifact paths checked; raises PlanMismatch naming the first file that disagrees."""
    import re

    want = plan.content_hash()
    checked = []
    for p in sorted(Path(out_dir).rglob("*")):
        if not p.is_file() or p.suffix not in (".json", ".yaml", ".sh"):
            continue
        found = set(re.findall(r"sha256:[0-9a-f]{64}", p.read_text(errors="replace")))
        other = sorted(found - {want})
        if other:
            raise PlanMismatch(str(p), want, other[0])
        if found:
            checked.append(str(p.relative_to(out_dir)))
    return checked


# ---------------------------------------------------------------------------------------------------------------
# derive_formats helpers: the format an engine reads, as the plan writes it (TensorFormat.short())
# ---------------------------------------------------------------------------------------------------------------
def engine_format(kind: str, *, block: Optional[tuple[int, int]] = None, scale_dtype: Optional[str] = None,
                  shared: bool = False) -> str:
    """`TensorFormat.short()` of a weight an engine reads as `kind` (a FormatKind or its name): the fields the
    engines fix for that kind and those read from the artifacts (`block`, the FP8-block `scale_dtype`, an NVFP4
    global scale `shared` by a fused module); `FormatSpec.engine_weight` has the facts."""
    return TensorFormat(**spec_of(kind).engine_weight(block, scale_dtype, shared)).short()


def fused_module_sizes(arch) -> dict[str, int]:
    """{hf_name: how many checkpoint tensors its fused module holds} (1 outside fused modules): q/k/v, gate/up, one
    expert's gate/up, q_a/kv_a are one GEMM weight in the engines (FUSED_SIBLINGS)."""
    count: dict[tuple, int] = {}
    for t in arch.tensors:
        if t.fused_key is not None:
            count[t.fused_key] = count.get(t.fused_key, 0) + 1
    return {t.hf_name: count.get(t.fused_key, 1) if t.fused_key is not None else 1 for t in arch.tensors}


class ArtifactError(PolicycError):
    """An emitted artifact a backend reads back (derive_formats) is missing or unreadable."""

    code = 2

    def __init__(self, message: str, hint: str = "re-run `policyc emit` for this backend"):
        super().__init__(message)
        self.hint = hint


def read_json_artifact(artifacts: Mapping[str, bytes], path: str):
    """The JSON document of one emitted artifact (derive_formats reads files we wrote, but an audit may be handed
    edited or partial ones: ArtifactError naming the file, never a traceback)."""
    raw = artifacts.get(path)
    if raw is None:
        raise ArtifactError(f"artifact {path} is missing")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ArtifactError(f"artifact {path} is not JSON: {err}") from None
