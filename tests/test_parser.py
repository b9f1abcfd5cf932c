"""Grammar and parser: every construct, and every syntax / structural error path (file:line:col, caret, hint)."""

from __future__ import annotations

import pytest

from precision_dsl.diagnostics import PolicyError
from precision_dsl.lang import ast
from precision_dsl.lang.parser import parse_policy
from precision_dsl.resources import grammar_path

TOUR = '''policy "miles-nvfp4" {
    target blackwell                       # hopper | blackwell
    default bf16
    routed_experts: nvfp4(act_scale=per_token, weight_scale=per_tensor) backward=dequantized
    share_scale routed_experts.{gate, up}  # one global scale over gate+up
    shared_experts: bf16
    layers[-15%:]: bf16
    attn.kv_b: bf16
    optional mtp: bf16
    name("model.layers.*.mlp.gate.weight"): bf16
    layers[0:3].attn: fp8_block(scales=pow2)
    routed_experts.down: weight=nvfp4(weight_block=16x16), act=bf16
    layers[0, 3, -1]: mxfp8(e4m3,
        weight_block=32x32)
    mtp.eh_proj: bf16; mtp.attn.kv_b: bf16
    optional share_scale mtp.routed_experts.{gate, up}
    import "base.policy"
    extends "other.policy"
    layers[12.5%:-1].name("*.q_proj.weight"): fp8(hybrid)
}
'''


def err(text: str, filename: str = "t.policy") -> PolicyError:
    with pytest.raises(PolicyError) as ei:
        parse_policy(text, filename)
    return ei.value


def test_grammar_is_bundled():
    assert grammar_path().is_file()


def test_tour_parses_every_construct():
    p = parse_policy(TOUR, "tour.policy")
    assert p.name == "miles-nvfp4" and p.source == TOUR
    kinds = [type(s).__name__ for s in p.statements]
    assert kinds == ["Target", "Default", "Rule", "ShareScale", "Rule", "Rule", "Rule", "Rule", "Rule", "Rule",
                     "Rule", "Rule", "Rule", "Rule", "ShareScale", "Import", "Import", "Rule"]
    tgt, dflt, nv, share, shared, tail, kvb, mtp, glob, first3, down, idx, eh, mtpkvb, mtpshare, imp, ext, mix = \
        p.statements
    assert tgt.hardware == "blackwell" and not tgt.emulate
    assert dflt.precision.base.name == "bf16"
    assert nv.selector.role.group == "routed_experts" and nv.selector.role.members == ()
    assert [(a.key, a.value) for a in nv.precision.base.args] == [("act_scale", "per_token"),
                                                                  ("weight_scale", "per_tensor")]
    assert nv.precision.backward == "dequantized" and nv.precision.backward_span.line == 4
    assert nv.text.startswith("routed_experts: nvfp4(") and nv.span.line == 4 and nv.span.col == 5
    assert share.selector.role.members == ("gate", "up") and not share.optional
    assert tail.selector.layers.is_range and tail.selector.layers.start.value == -15
    assert tail.selector.layers.start.percent and tail.selector.layers.stop is None
    assert kvb.selector.role.group == "attn" and kvb.selector.role.members == ("kv_b",)
    assert mtp.optional and mtp.selector.mtp and mtp.selector.role is None
    assert glob.selector.name.pattern == "model.layers.*.mlp.gate.weight"
    assert first3.selector.layers.start.value == 0 and first3.selector.layers.stop.value == 3
    assert first3.selector.role.group == "attn"
    assert down.precision.base is None and down.precision.weight.name == "nvfp4"
    assert down.precision.weight.args[0].value == "16x16" and down.precision.act.name == "bf16"
    assert [b.value for b in idx.selector.layers.indices] == [0, 3, -1] and not idx.selector.layers.is_range
    assert [(a.key, a.value) for a in idx.precision.base.args] == [("_0", "e4m3"), ("weight_block", "32x32")]
    assert eh.selector.mtp and eh.selector.role.group == "mtp" and eh.selector.role.members == ("eh_proj",)
    assert mtpkvb.selector.mtp and mtpkvb.selector.role.group == "attn" and mtpkvb.span.line == 15
    assert mtpshare.optional and mtpshare.selector.mtp
    assert imp.kind == "import" and imp.path == "base.policy"
    assert ext.kind == "extends" and ext.path == "other.policy"
    assert mix.selector.layers.start.value == 12.5 and mix.selector.layers.stop.value == -1
    assert mix.selector.name.pattern == "*.q_proj.weight"
    assert mix.precision.base.args[0].value == "hybrid"


def test_empty_policy_and_separators():
    assert parse_policy('policy "e" {}').statements == ()
    p = parse_policy('\n# c\npolicy "e" {\n\n ; default bf16 ;; attn: bf16 ;\n}\n# trailing\n')
    assert [type(s).__name__ for s in p.statements] == ["Default", "Rule"]


def test_target_hopper_emulate():
    p = parse_policy('policy "h" {\n target hopper emulate\n}')
    assert p.statements[0].hardware == "hopper" and p.statements[0].emulate


def test_string_escapes_and_number_values():
    p = parse_policy('policy "a\\"b" { name("x\\\\y"): bf16 }')
    assert p.name == 'a"b' and p.statements[0].selector.name.pattern == "x\\y"


def test_duplicate_members_are_collapsed():
    p = parse_policy('policy "x" { attn.{q, k, q}: bf16 }')
    assert p.statements[0].selector.role.members == ("q", "k")


def test_spans_are_one_based_and_cover_the_statement():
    p = parse_policy('policy "x" {\n  attn.kv_b: bf16\n}', "f.policy")
    r = p.statements[0]
    assert (r.span.file, r.span.line, r.span.col, r.span.end_col) == ("f.policy", 2, 3, 18)
    assert isinstance(r, ast.Rule) and r.text == "attn.kv_b: bf16"


# ---- syntax errors -------------------------------------------------------------------------------------------------
def test_missing_colon_says_what_was_expected():
    e = err('policy "x" {\n    attn.kv_b bf16\n}')
    out = e.render()
    assert out.splitlines()[0].startswith("t.policy:2:15: error: unexpected 'bf16'; expected")
    assert "expected '.' or ':'" in out and "add ':'" in e.hint
    assert "    2 |     attn.kv_b bf16" in out or "  2 |     attn.kv_b bf16" in out
    assert out.splitlines()[2].endswith("^^^^") and "hint:" in out


def test_unquoted_policy_name():
    e = err("policy x {}")
    assert e.location == "t.policy:1:8" and "quoted string" in e.message and "hint:" in e.render()


def test_missing_policy_header():
    e = err("default bf16")
    assert e.location == "t.policy:1:1" and "'policy'" in e.message
    assert 'policy "name"' in e.hint


def test_unclosed_block():
    e = err('policy "x" {\n  default bf16\n')
    assert "end of file" in e.message and "'}'" in e.hint


def test_single_quotes_hint():
    e = err("policy \"x\" { name('a'): bf16 }")
    assert e.location == "t.policy:1:19" and "double quotes" in e.hint


def test_bare_glob_hint():
    e = err('policy "x" { model.layers.*: bf16 }')
    assert "name(" in e.hint and "^" in e.render()


def test_two_statements_on_one_line():
    e = err('policy "x" { attn: bf16 mlp: bf16 }')
    assert e.location == "t.policy:1:28" and "':'" in e.message


def test_missing_format():
    e = err('policy "x" {\n  attn:\n}')
    assert e.location.startswith("t.policy:2:") and "format" in e.hint


def test_keyword_misuse():
    e = err('policy "x" { default: bf16 }')
    assert "':'" in e.message


def test_bad_layer_slice_syntax():
    e = err('policy "x" { layers[1:2:3]: bf16 }')
    assert "']'" in e.message and "layers[" in e.hint


def test_unknown_character():
    e = err('policy "x" { attn: bf16 @ }')
    assert "'@'" in e.message and e.location == "t.policy:1:25"


# ---- structural errors found by the parser -------------------------------------------------------------------------
@pytest.mark.parametrize("text,loc,msg,hint", [
    ('policy "x" { routed_expert: bf16 }', "1:14", "unknown role group 'routed_expert'", "routed_experts"),
    ('policy "x" { experts: bf16 }', "1:14", "unknown role group 'experts'", "routed_experts"),
    ('policy "x" { attn.kvb: bf16 }', "1:19", "'attn' has no member 'kvb'", "kv_b"),
    ('policy "x" { attn.{q, kk}: bf16 }', "1:23", "'attn' has no member 'kk'", "did you mean 'k'"),
    ('policy "x" { embedding.x: bf16 }', "1:24", "'embedding' has no members", "on its own"),
    ('policy "x" {\n target hoper\n}', "2:9", "unknown target 'hoper'", "hopper"),
    ('policy "x" { target hopper emulat }', "1:28", "unknown target modifier", "emulate"),
    ('policy "x" { layers[1.5]: bf16 }', "1:21", "must be an integer", "percentage"),
    ('policy "x" { layers[150%:]: bf16 }', "1:21", "outside -100%..100%", "layers[-15%:]"),
    ('policy "x" { layers: bf16 }', "1:20", "expected '['", "layers[-15%:]"),
    ('policy "x" { attn.layers[0]: bf16 }', "1:19", "must come first", "layers[0:3].attn"),
    ('policy "x" { name("a").attn: bf16 }', "1:14", "must come last", "name("),
    ('policy "x" { name(""): bf16 }', "1:14", "empty name pattern", "name("),
    ('policy "x" { layers[0].mtp: bf16 }', "1:24", "cannot be combined", "MTP"),
    ('policy "x" { attn.q.k: bf16 }', "1:21", "too many parts", "group.member"),
    ('policy "x" { {q}: bf16 }', "1:14", "needs a role group", "routed_experts.{gate, up}"),
    ('policy "x" { mtp.eh_proj.x: bf16 }', "1:26", "has no members", "single role"),
    ('policy "x" { attn: bf16 wieght=nvfp4 }', "1:25", "unknown rule key 'wieght='", "weight"),
    ('policy "x" { attn: bf16, backward=dequantized backward=quantized }', "1:47", "given twice", "remove"),
    ('policy "x" { attn: bf16 mxfp8 }', "1:25", "a second format", "weight="),
    ('policy "x" { attn: mxfp8 backward=quantized(x) }', "1:35", "takes a mode", "high_precision"),
    ('policy "x" { import "" }', "1:21", "empty import path", "base.policy"),
])
def test_structural_errors(text, loc, msg, hint):
    e = err(text)
    assert e.location == f"t.policy:{loc}", e.render()
    assert msg in e.message, e.render()
    assert hint in e.hint, e.render()
    rendered = e.render()
    assert rendered.splitlines()[0] == f"t.policy:{loc}: error: {e.message}"
    assert "^" in rendered.splitlines()[2] and rendered.splitlines()[-1].startswith("hint: ")


def test_caret_width_matches_span():
    e = err('policy "x" { routed_expert: bf16 }')
    caret_line = e.render().splitlines()[2]
    assert caret_line.count("^") == len("routed_expert")
    # caret starts under the offending token
    src_line = e.render().splitlines()[1]
    assert src_line.index("routed_expert") == caret_line.index("^")


def test_render_never_raises_without_source():
    e = PolicyError("boom", None, "do x")
    assert e.render() == "error: boom\nhint: do x"
    e2 = PolicyError("boom", ast.Span(file="f", line=99, col=3, end_line=99, end_col=4), "", "one line")
    assert e2.render().startswith("f:99:3: error: boom")


@pytest.mark.parametrize("text,loc,expected_words,hint", [
    ('policy "x" { attn. : bf16 }', "1:20", "expected 'layers', 'name', '{' or a name", "member set"),
    ('policy "x" { attn: nvfp4(a=) }', "1:28", "a block shape like 16x16", "argument value is missing"),
    ('policy "x" { attn: nvfp4(a=b }', "1:30", "expected ')' or ','", "nvfp4(act_scale=per_token"),
    ('policy "x" { import base }', "1:21", 'expected a quoted string ("...")', 'import "base.policy"'),
    ('policy "x" { layers[0]: bf16 ', "1:30", "unexpected end of file", "close the policy block"),
])
def test_expected_tokens_in_words(text, loc, expected_words, hint):
    e = err(text)
    assert e.location == f"t.policy:{loc}" and expected_words in e.message and hint in e.hint, e.render()
    assert "__ANON" not in e.message and "_NL" not in e.message
