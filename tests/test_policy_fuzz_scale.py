"""Policy fuzzing at scale: 10,000+ generated policies per CI run, counting tracebacks and hangs (both must be 0).

A seeded generator (reproducible: the failing case's index and text are printed) mixes five families:
  * token soup over the language's vocabulary and punctuation;
  * grammar-shaped policies: random statements with valid and invalid selectors, formats, arguments, numbers
    (huge, negative, percentages, 5000-digit literals), optional/share_scale/target/default/backward;
  * character-level mutations (insert/delete/replace/swap) of the shipped policies;
  * hostile strings: rich markup (`[/x]`, `[bold`), control characters, NUL, unicode, very long lines, deep
    brackets, escapes;
  * import graphs: cycles, diamonds and fan-outs, imports of non-policy files (/proc/self/environ, /dev/null,
    a directory, a binary file), missing files.
Every case goes through the real front end (parse -> imports -> resolve against tiny-moe -> static checks) and,
for errors, through the CLI's renderer (`console.fail`, which must not interpret markup). Outcome per case: a Plan,
or a PolicycError whose rendering works; anything else is a traceback. A case taking more than HANG_S is a hang
(interrupted by SIGALRM so the suite itself never hangs).

Fast path: resolution is memoised per distinct text (a mutation often yields an already-seen text), the static checks
run on the first 500 plans only, and the CLI renderer on every error of the hostile family plus 500 others.
"""

from __future__ import annotations

import io
import random
import signal
import time
from contextlib import redirect_stderr

import pytest

from precision_dsl.arch import load_architecture
from precision_dsl.checks import check
from precision_dsl.console import fail
from precision_dsl.errors import PolicycError
from precision_dsl.plan import ParallelLayout, ParallelSide, Plan
from precision_dsl.resolve import parse_policy, resolve
from precision_dsl.resources import policies_dir

N_CASES = 10_000
HANG_S = 5.0
SEED = 20261201

WORDS = ["policy", "import", "extends", "target", "default", "optional", "share_scale", "layers", "name", "mtp",
         "hopper", "blackwell", "emulate", "bf16", "fp16", "fp32", "mxfp8", "nvfp4", "fp8", "fp8_block",
         "routed_experts", "shared_experts", "attn", "mlp", "norm", "router", "embed", "lm_head", "gate", "up",
         "down", "q", "k", "v", "o", "kv_b", "q_a", "backward", "dequantized", "quantized", "weight", "act", "grad",
         "act_scale", "weight_scale", "per_token", "per_tensor", "scales", "pow2", "weight_block", "e4m3", "e5m2"]
PUNCT = list('{}[]():;,.=%#-+*"\n\t ') + ["16x16", "1x32", "128x128", "-15%", "0:3", "\\", "'"]
HOSTILE = ["[/x]", "[bold]", "[/]", "[link=file:///etc/passwd]x[/link]", "\x00", "\x1b[31m", "\u202e", "é", "🙂",
           "\r", "\x0c", "[" * 200, "{" * 200, "9" * 5000, "1e999", "-0", "0x10", "..", "$(rm -rf /)",
           "%s%n", "\\\\\\", '\\"', "x" * 5000]
SELECTORS = ["routed_experts", "routed_experts.{gate, up}", "routed_experts.down", "attn", "attn.kv_b", "mlp",
             "shared_experts", "norm", "mtp", "mtp.attn", "layers[0:3]", "layers[-15%:]", "layers[0, 3, -1]",
             'name("model.layers.*.mlp.gate.weight")', "layers[2:1]", "layers[99]", "bogus.role", "layers[50%:]"]
FORMATS = ["bf16", "fp16", "fp32", "mxfp8", "nvfp4", "fp8", "fp8_block", "fp8_block(scales=fp32)",
           "nvfp4(act_scale=per_token, weight_scale=per_tensor)", "mxfp8(e4m3)", "nvfp4(weight_block=16x16)",
           "weight=nvfp4, act=bf16", "fp8_block(scales=pow2)", "mxfp8(e9m9)", "nvfp4(nope=1)", "int4", "bf16()"]


def _shipped() -> list[str]:
    return [p.read_text() for p in sorted(policies_dir().glob("*.policy"))]


def _statement(r: random.Random) -> str:
    k = r.random()
    opt = "optional " if r.random() < 0.3 else ""
    if k < 0.55:
        s = f"{opt}{r.choice(SELECTORS)}: {r.choice(FORMATS)}"
        if r.random() < 0.2:
            s += f" backward={r.choice(['dequantized', 'quantized', 'hp', 'bogus'])}"
        return s
    if k < 0.65:
        return f"{opt}share_scale {r.choice(SELECTORS)}"
    if k < 0.75:
        return f"target {r.choice(['hopper', 'blackwell', 'hopper emulate', 'ampere'])}"
    if k < 0.85:
        return f"default {r.choice(FORMATS)}"
    if k < 0.92:
        return f'import "{r.choice(["keep-bf16.policy", "bf16.policy", "nope.policy", "miles-nvfp4.policy"])}"'
    return r.choice(HOSTILE)


def _grammar_shaped(r: random.Random) -> str:
    name = r.choice(["p", "[/x]", "[bold]red", "a\\\"b", "é🙂", "x" * 300, ""])
    body = "\n    ".join(_statement(r) for _ in range(r.randint(0, 8)))
    return f'policy "{name}" {{\n    {body}\n}}\n'


def _token_soup(r: random.Random) -> str:
    return "".join(r.choice(WORDS + PUNCT + HOSTILE[:8]) + r.choice(["", " "]) for _ in range(r.randint(0, 60)))


def _mutated(r: random.Random, shipped: list[str]) -> str:
    s = list(r.choice(shipped))
    for _ in range(r.randint(1, 6)):
        if not s:
            break
        i = r.randrange(len(s))
        op = r.random()
        if op < 0.3:
            del s[i]
        elif op < 0.6:
            s.insert(i, r.choice(PUNCT + ["a", "1", "%"]))
        elif op < 0.8:
            s[i] = r.choice(PUNCT + ["z", "0"])
        else:
            j = r.randrange(len(s))
            s[i], s[j] = s[j], s[i]
    return "".join(s)


def _hostile(r: random.Random) -> str:
    h = r.choice(HOSTILE)
    return r.choice([h, f'policy "{h}" {{ default bf16 }}', f'policy "p" {{ {h} }}',
                     f'policy "p" {{ default bf16\n    {r.choice(SELECTORS)}: {h} }}',
                     f'policy "p" {{ layers[{h}]: bf16 }}', f'policy "p" {{ name("{h}"): bf16 }}'])


def generate(n: int, seed: int = SEED):
    r = random.Random(seed)
    shipped = _shipped()
    families = [("grammar", _grammar_shaped), ("soup", _token_soup), ("mutated", lambda r: _mutated(r, shipped)),
                ("hostile", _hostile)]
    weights = [0.45, 0.2, 0.25, 0.1]
    for i in range(n):
        fam, gen = r.choices(families, weights)[0]
        yield i, fam, gen(r)


class _Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise _Hang()


@pytest.fixture(scope="module")
def arch():
    return load_architecture("tiny-moe")


def _outcome(text: str, arch, filename: str, checks_left: list[int], hostile: bool = True) -> str:
    try:
        plan = resolve(parse_policy(text, filename), arch)
    except PolicycError as err:
        out = err.render() if hasattr(err, "render") else str(err)
        assert isinstance(out, str) and out
        if hostile or checks_left[1] > 0:  # the CLI renderer (must not interpret markup); ~1 ms, so sampled
            checks_left[1] -= 1
            with redirect_stderr(io.StringIO()):
                fail(err)
        return "error"
    assert isinstance(plan, Plan) and len(plan.tensors) == len(arch.tensors)
    if checks_left[0] > 0:
        checks_left[0] -= 1
        par = ParallelLayout(trainer=ParallelSide(tp=2, etp=2, pp=2), rollout=ParallelSide(tp=4, etp=1))
        for d in check(plan, arch, par):
            assert d.render()
    return "plan"


def test_ten_thousand_generated_policies_no_traceback_no_hang(arch, record_figure):
    filename = str(policies_dir() / "__fuzz__.policy")  # bundled-relative imports resolve
    seen: dict[str, str] = {}
    counts = {"plan": 0, "error": 0, "traceback": 0, "hang": 0}
    failures: list[str] = []
    checks_left = [500, 500]  # static checks on 500 plans; CLI rendering of 500 errors + hostile ones
    old = signal.signal(signal.SIGALRM, _alarm)
    t0 = time.perf_counter()
    slowest = 0.0
    try:
        for i, fam, text in generate(N_CASES):
            if text in seen:
                counts[seen[text]] += 1
                continue
            t = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, HANG_S)
            try:
                res = _outcome(text, arch, filename, checks_left, hostile=fam == "hostile")
            except _Hang:
                res = "hang"
            except Exception as err:  # noqa: BLE001 - counting tracebacks is the point
                res = "traceback"
                failures.append(f"case {i} ({fam}): {type(err).__name__}: {err!s:.200} | text={text[:200]!r}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            slowest = max(slowest, time.perf_counter() - t)
            if res == "hang":
                failures.append(f"case {i} ({fam}): hang > {HANG_S}s | text={text[:200]!r}")
            counts[res] += 1
            seen[text] = res
    finally:
        signal.signal(signal.SIGALRM, old)
    wall = time.perf_counter() - t0
    record_figure("policy_fuzz", {"cases": N_CASES, "distinct": len(seen), **counts, "seconds": round(wall, 1),
                                  "slowest_case_s": round(slowest, 3)})
    assert counts["traceback"] == 0 and counts["hang"] == 0, "\n".join(failures[:20])
    assert sum(counts.values()) == N_CASES and counts["plan"] > 100 and counts["error"] > 1000


def test_import_graphs_and_non_policy_imports(arch, tmp_path, record_figure):
    """Cycles, diamonds, fan-outs up to 30 levels (2^30 paths: must be linear) and imports of files that are not
    policies: never a traceback, never an echo of the imported file's content."""
    secret = tmp_path / "secret.env"
    secret.write_text("API_TOKEN=hunter2-very-secret\n")
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "adir").mkdir()
    targets = [str(secret), "/proc/self/environ", "/dev/null", str(tmp_path / "adir"), str(tmp_path / "binary.bin"),
               "missing.policy", "../../../../etc/hostname"]
    for j, t in enumerate(targets):
        p = tmp_path / f"imp{j}.policy"
        p.write_text(f'policy "i" {{\n    default bf16\n    import "{t}"\n}}\n')
        with pytest.raises(PolicycError) as info:
            resolve(p, arch)
        assert "hunter2" not in info.value.render() and "API_TOKEN" not in info.value.render()
    # a cycle
    (tmp_path / "a.policy").write_text('policy "a" { import "b.policy" }')
    (tmp_path / "b.policy").write_text('policy "b" { import "a.policy" }')
    with pytest.raises(PolicycError, match="import cycle"):
        resolve(tmp_path / "a.policy", arch)
    # a 30-level fan-out: each file imports the next one twice
    n = 30
    for i in range(n):
        nxt = f'    import "f{i + 1}.policy"\n    import "f{i + 1}.policy"\n' if i < n - 1 else ""
        (tmp_path / f"f{i}.policy").write_text(f'policy "f{i}" {{\n    default bf16\n    optional layers[{i % 4}]: '
                                               f'{"mxfp8" if i % 2 else "bf16"}\n{nxt}}}\n')
    t0 = time.perf_counter()
    plan = resolve(tmp_path / "f0.policy", arch)
    dt = time.perf_counter() - t0
    assert len(plan.policy_files) == n and dt < 5, dt
    record_figure("import_fanout_30_levels", {"seconds": round(dt, 3), "files": n})
