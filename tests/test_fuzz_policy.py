"""Fuzz: random and mutated policy text never produces anything but a Plan or a PolicyError whose render() works.

Three generators: (1) raw random text over the language's alphabet, (2) grammar-shaped random statements mixing
valid and invalid names/arguments, (3) random character edits of the shipped policies. Each input is parsed,
resolved against tiny-moe (and an MTP model for the mtp selectors), and a successful plan is statically checked."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_dsl.arch import load_architecture
from precision_dsl.checks import check
from precision_dsl.diagnostics import PolicyError
from precision_dsl.plan import ParallelLayout, ParallelSide, Plan
from precision_dsl.resolve import parse_policy, resolve
from precision_dsl.resources import policies_dir

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
# Policies live next to the bundled dir so that `import "keep-bf16.policy"` and relative imports both resolve.
FILENAME = str(policies_dir() / "__fuzz__.policy")


@lru_cache(maxsize=None)
def _arch(name):
    return load_architecture(name)


def _run(text: str) -> None:
    for model in ("tiny-moe",):
        try:
            policy = parse_policy(text, FILENAME)
            plan = resolve(policy, _arch(model))
        except PolicyError as e:
            out = e.render()
            assert isinstance(out, str) and out
            if e.span is not None:
                assert out.startswith(f"{e.span.file}:{e.span.line}:{e.span.col}: error: ")
            assert e.hint, out  # every error carries a fix hint
            return
        assert isinstance(plan, Plan) and len(plan.tensors) == len(_arch(model).tensors)
        par = ParallelLayout(trainer=ParallelSide(tp=2, etp=2, pp=2), rollout=ParallelSide(tp=4, etp=1))
        for d in check(plan, _arch(model), par):
            assert d.render()


ALPHABET = st.sampled_from(list('policy"{}[]():;,.=%#-+*x\n 0123456789abcdefghijklmnopqrstuvwxyz_\\\'\t') +
                           ["layers", "name", "optional", "share_scale", "import", "extends", "target", "default",
                            "bf16", "mxfp8", "nvfp4", "fp8_block", "routed_experts", "attn", "mtp", "backward="])


@SETTINGS
@given(st.lists(ALPHABET, max_size=80))
def test_random_text(pieces):
    _run("".join(pieces))


@SETTINGS
@given(st.lists(ALPHABET, max_size=40))
def test_random_body_inside_a_policy_block(pieces):
    _run('policy "fz" {\n' + "".join(pieces) + "\n}\n")


GROUPS = ["routed_experts", "shared_experts", "attn", "mlp", "norm", "router", "embedding", "lm_head", "mtp",
          "expert", "atn"]
MEMBERS = ["gate", "up", "down", "q", "k", "v", "o", "kv_b", "eh_proj", "input", "weight", "bogus"]
BOUNDS = ["0", "1", "-1", "3", "-15%", "50%", "12.5%", "100%", "-100%", "7", "1e3", "2.5", ""]
FORMATS = ["bf16", "fp16", "fp32", "fp8", "fp8_block", "mxfp8", "nvfp4", "nvfp5", "int4"]
ARGS = ["act_scale=per_token", "act_scale=per_tensor", "weight_scale=per_expert", "weight_block=16x16",
        "weight_block=32x32", "scales=fp32", "scales=pow2", "elem=e5m2", "grad_elem=e5m2", "hybrid", "e4m3",
        "format=hybrid", "bogus=1", "act_scale=3", 'x="s"']
BACKWARDS = ["quantized", "high_precision", "dequantized", "sideways"]


@st.composite
def selector(draw):
    parts = []
    if draw(st.booleans()):
        lo, hi = draw(st.sampled_from(BOUNDS)), draw(st.sampled_from(BOUNDS))
        parts.append(f"layers[{lo}:{hi}]" if draw(st.booleans()) else f"layers[{lo or 0}, {hi or -1}]")
    if draw(st.integers(0, 3)):
        g = draw(st.sampled_from(GROUPS))
        m = draw(st.sampled_from([None, None] + MEMBERS + ["{gate, up}", "{q, k, v}"]))
        parts.append(g if m is None else f"{g}.{m}")
    if draw(st.integers(0, 4)) == 0 or not parts:
        parts.append(draw(st.sampled_from(['name("model.layers.*.mlp.gate.weight")', 'name("*")', 'name("x*")'])))
    return ".".join(parts)


@st.composite
def fmt(draw):
    name = draw(st.sampled_from(FORMATS))
    args = draw(st.lists(st.sampled_from(ARGS), max_size=3))
    return f"{name}({', '.join(args)})" if args or draw(st.booleans()) else name


@st.composite
def spec(draw):
    items = []
    if draw(st.integers(0, 3)):
        items.append(draw(fmt()))
    for key in ("weight", "act", "grad"):
        if draw(st.integers(0, 4)) == 0:
            items.append(f"{key}={draw(fmt())}")
    if draw(st.booleans()):
        items.append(f"backward={draw(st.sampled_from(BACKWARDS))}")
    return draw(st.sampled_from([" ", ", "])).join(items) or "bf16"


@st.composite
def statement(draw):
    kind = draw(st.integers(0, 9))
    opt = "optional " if draw(st.integers(0, 3)) == 0 else ""
    if kind == 0:
        return f"target {draw(st.sampled_from(['hopper', 'blackwell', 'hopper emulate', 'volta']))}"
    if kind == 1:
        return f"default {draw(spec())}"
    if kind == 2:
        return f"{opt}share_scale {draw(selector())}"
    if kind == 3:
        path = draw(st.sampled_from(["keep-bf16.policy", "bf16.policy", "missing.policy", "__fuzz__.policy"]))
        return f'import "{path}"'
    return f"{opt}{draw(selector())}: {draw(spec())}"


@SETTINGS
@given(st.lists(statement(), max_size=8))
def test_grammar_shaped_policies(stmts):
    _run('policy "g" {\n    ' + "\n    ".join(stmts) + "\n}\n")


SHIPPED = [p.read_text() for p in sorted(Path(policies_dir()).glob("*.policy"))]


@SETTINGS
@given(st.sampled_from(SHIPPED), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 2),
                                                     st.sampled_from(list(':;{}[]()"=.,%#\n x-*0a'))), max_size=4))
def test_mutated_shipped_policies(text, edits):
    for pos, op, ch in edits:
        i = pos % (len(text) + 1)
        if op == 0:
            text = text[:i] + text[i + 1:]
        elif op == 1:
            text = text[:i] + ch + text[i:]
        else:
            text = text[:i] + ch + text[i + 1:]
    _run(text)
