"""Policy text -> AST (`lang.ast.Policy`).

Two stages: lark (LALR(1), grammar/policy.lark) builds a parse tree; `_Builder` turns it into the frozen AST and
validates everything that does not need an architecture (selector structure, role names, target names, keyed
spec items). Format calls are validated in `lang.formats` (also architecture-free) by `resolve`.

Every failure is a `PolicyError` with file:line:col, caret and hint; lark exceptions never escape.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterator, Optional

from lark import Lark, Token, Tree
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from ..arch.base import ROLE_GROUPS, ROLES
from ..diagnostics import PolicyError, did_you_mean
from ..resources import grammar_path
from . import ast

TARGETS = ("hopper", "blackwell")
SPEC_KEYS = ("weight", "act", "grad", "backward")
# Members of each role group, e.g. "routed_experts" -> {"gate", "up", "down"}.
GROUP_MEMBERS: dict[str, tuple[str, ...]] = {
    g: tuple(r.split(".", 1)[1] for r in ROLES if r.startswith(g + ".")) for g in ROLE_GROUPS
}
# Common alternative spellings -> the role group they probably meant (only used for hints).
_ROLE_ALIASES = {
    "experts": "routed_experts", "moe": "routed_experts", "expert": "routed_experts",
    "shared_expert": "shared_experts", "attention": "attn", "self_attn": "attn", "embed": "embedding",
    "embed_tokens": "embedding", "head": "lm_head", "gate": "router", "layer": "layers",
}

# Terminal names -> words for "expected ..." messages.
_TERMINAL_WORDS = {
    "NAME": "a name", "STRING": 'a quoted string ("...")', "SIGNED_NUMBER": "a number",
    "DIMS": "a block shape like 16x16",
    "_NL": "end of line", "SEMICOLON": "';'", "COLON": "':'", "COMMA": "','", "DOT": "'.'", "EQUAL": "'='",
    "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'", "LBRACE": "'{'", "RBRACE": "'}'", "PERCENT": "'%'",
    "$END": "end of file",
}
_KEYWORDS = ("policy", "target", "default", "import", "extends", "share_scale", "layers", "name", "optional")


class _ParenNewlines:
    """Post-lexer: drop newline tokens inside (...) and [...] so format calls and layer lists may span lines."""

    always_accept = ("_NL",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth = 0
        for tok in stream:
            if tok.type in ("LPAR", "LSQB"):
                depth += 1
            elif tok.type in ("RPAR", "RSQB"):
                depth = max(depth - 1, 0)
            elif tok.type == "_NL" and depth > 0:
                continue
            yield tok


@lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(grammar_path().read_text(), parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=False, postlex=_ParenNewlines())


def parse_policy(text: str, filename: str = "<policy>") -> ast.Policy:
    """Parse one policy file's text. Imports are NOT followed here (see resolve.load_policy)."""
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, filename) from None
    except LarkError as e:  # pragma: no cover - defensive: any other lark failure is still a clean error
        raise PolicyError(f"could not parse policy: {e}", _span_at(filename, 1, 1), "check the file syntax",
                          text) from None
    return _Builder(text, filename).policy(tree)


# ---- syntax errors -------------------------------------------------------------------------------------------------
def _span_at(filename: str, line: int, col: int, width: int = 1) -> ast.Span:
    line, col = max(line, 1), max(col, 1)
    return ast.Span(file=filename, line=line, col=col, end_line=line, end_col=col + width)


def _words(expected: set[str]) -> str:
    names = sorted({_TERMINAL_WORDS.get(t, _describe_anon(t)) for t in expected})
    if not names:
        return "nothing"
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _describe_anon(t: str) -> str:
    # anonymous keyword terminals are named after the keyword in upper case (POLICY, SHARE_SCALE), or __ANON_n
    # when that name is taken (`name` collides with the NAME terminal): look the literal up in the grammar
    for term in _lark().terminals:
        if term.name == t and term.pattern.type == "str":
            return f"'{term.pattern.value}'"
    return t.lower()


def _syntax_error(e: UnexpectedInput, text: str, filename: str) -> PolicyError:
    line = getattr(e, "line", None)
    col = getattr(e, "column", None)
    at_eof = isinstance(e, UnexpectedToken) and e.token.type == "$END"
    if not isinstance(line, int) or line < 1 or at_eof:
        # EOF: point just past the last character
        lines = text.splitlines() or [""]
        line, col = len(lines), len(lines[-1]) + 1
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if 0 <= e.pos_in_stream < len(text) else "?"
        hint = "remove it; comments start with '#'"
        if ch in "'`":
            hint = 'strings use double quotes, e.g. import "base.policy"'
        elif ch == "*":
            hint = 'a glob needs the raw-name escape hatch: name("model.layers.*.mlp.gate.weight")'
        elif ch == "-":
            hint = "names use '_' not '-' (e.g. fp8_block, per_token); negative numbers have no space after '-'"
        allowed = _words(set(e.allowed or ()))
        return PolicyError(f"unexpected character {ch!r}; expected {allowed}", _span_at(filename, line, col),
                           hint, text)
    if isinstance(e, UnexpectedToken):
        tok = e.token
        # `accepts` is what the parser could shift here (lark >= 1.1); `expected` may include lexer-only terminals
        expected = set(getattr(e, "accepts", None) or e.expected or ())
        if tok.type == "$END":
            found = "end of file"
            width = 1
        elif tok.type == "_NL":
            found = "end of line"
            width = 1
        else:
            found = f"{tok.type.lower()!r}" if tok.type.lower() in _KEYWORDS and str(tok) == tok.type.lower() \
                else repr(str(tok))
            width = max(len(str(tok)), 1)
        hint = _syntax_hint(tok, expected)
        return PolicyError(f"unexpected {found}; expected {_words(expected)}", _span_at(filename, line, col, width),
                           hint, text)
    if isinstance(e, UnexpectedEOF):
        return PolicyError(f"unexpected end of file; expected {_words(set(e.expected or ()))}",
                           _span_at(filename, line, col), "the policy block must be closed with '}'", text)
    return PolicyError(f"syntax error: {e}", _span_at(filename, line, col), "check the syntax", text)


def _syntax_hint(tok: Token, expected: set[str]) -> str:
    value = str(tok)
    end_like = ("_NL", "$END", "RBRACE", "SEMICOLON")
    if "POLICY" in expected:
        return 'a policy file starts with: policy "name" { ... }'
    if tok.type == "$END":
        return "close the policy block with '}'"
    if {"STRING", "SIGNED_NUMBER"} <= expected:
        return "an argument value is missing, e.g. act_scale=per_token, weight_block=16x16"
    if "STRING" in expected:
        return 'policy names and import paths are quoted: policy "my-policy" { ... }, import "base.policy"'
    if "RSQB" in expected:
        return "layer slices look like layers[0:3], layers[-15%:], layers[0, 5, -1]"
    if expected == {"LSQB"}:
        return ('`layers` takes a slice, e.g. layers[-15%:]; to match raw HF names use '
                'name("model.layers.*.mlp.gate.weight")')
    if "COLON" in expected and tok.type != "COLON":
        return "a rule is `<selector>: <format>`: add ':' after the selector, e.g. `attn.kv_b: bf16`"
    if "LBRACE" in expected and "NAME" in expected:
        return ("after '.' comes a role or member (routed_experts.gate), a member set ({gate, up}), layers[...] "
                'or name("...")')
    if "NAME" in expected and tok.type in end_like:
        return "a format is missing, e.g. `bf16`, `mxfp8`, `nvfp4(act_scale=per_token)`"
    if tok.type == "COLON":
        return "only one ':' per rule; a format follows the selector, e.g. `attn.kv_b: bf16`"
    if tok.type == "NAME" and ("_NL" in expected or "SEMICOLON" in expected):
        return "put one statement per line (or separate statements with ';')"
    if "RPAR" in expected:
        return "format arguments look like nvfp4(act_scale=per_token, weight_block=16x16)"
    if value.lower() in _KEYWORDS:
        return f"'{value.lower()}' is a reserved word and cannot be used here"
    return "see docs/LANGUAGE.md for the statement forms"


# ---- tree -> AST ---------------------------------------------------------------------------------------------------
class _Builder:
    def __init__(self, text: str, filename: str):
        self.text = text
        self.file = filename

    # spans ------------------------------------------------------------------------------------------------------
    def span(self, node) -> ast.Span:
        if isinstance(node, Token):
            end_line = node.end_line if node.end_line is not None else node.line
            end_col = node.end_column if node.end_column is not None else node.column + len(node)
            return ast.Span(file=self.file, line=node.line, col=node.column, end_line=end_line, end_col=end_col)
        m = node.meta
        if getattr(m, "empty", True):
            return _span_at(self.file, 1, 1)
        return ast.Span(file=self.file, line=m.line, col=m.column, end_line=m.end_line, end_col=m.end_column)

    def span_between(self, a: ast.Span, b: ast.Span) -> ast.Span:
        return ast.Span(file=self.file, line=a.line, col=a.col, end_line=b.end_line, end_col=b.end_col)

    def source_text(self, node) -> str:
        if isinstance(node, Token):
            return str(node)
        m = node.meta
        return " ".join(self.text[m.start_pos:m.end_pos].split())

    def error(self, message: str, span: ast.Span, hint: str) -> PolicyError:
        return PolicyError(message, span, hint, self.text)

    # policy -----------------------------------------------------------------------------------------------------
    def policy(self, tree: Tree) -> ast.Policy:
        (pol,) = [c for c in tree.children if isinstance(c, Tree) and c.data == "policy"]
        name_tok = pol.children[0]
        stmts = tuple(self.statement(c) for c in pol.children[1:] if isinstance(c, Tree))
        return ast.Policy(span=self.span(pol), name=self.string(name_tok), statements=stmts, source=self.text)

    def string(self, tok: Token) -> str:
        raw = str(tok)[1:-1]
        out, i = [], 0
        while i < len(raw):  # minimal escapes: \" and \\ (policy files are data, never eval'd)
            if raw[i] == "\\" and i + 1 < len(raw):
                out.append(raw[i + 1])
                i += 2
            else:
                out.append(raw[i])
                i += 1
        return "".join(out)

    def statement(self, t: Tree) -> ast.Statement:
        return getattr(self, "st_" + t.data)(t)

    def st_target(self, t: Tree) -> ast.Target:
        hw = t.children[0]
        if str(hw) not in TARGETS:
            raise self.error(f"unknown target '{hw}'", self.span(hw), did_you_mean(str(hw), TARGETS, "target"))
        emulate = False
        if len(t.children) > 1:
            mod = t.children[1]
            if str(mod) != "emulate":
                raise self.error(f"unknown target modifier '{mod}'", self.span(mod),
                                 "the only modifier is `emulate`: `target hopper emulate` runs MX/NV formats by "
                                 "exact emulation")
            emulate = True
        return ast.Target(span=self.span(t), hardware=str(hw), emulate=emulate)  # type: ignore[arg-type]

    def st_default(self, t: Tree) -> ast.Default:
        return ast.Default(span=self.span(t), precision=self.spec(t.children[0]))

    def st_import_stmt(self, t: Tree) -> ast.Import:
        return self._import(t, "import")

    def st_extends_stmt(self, t: Tree) -> ast.Import:
        return self._import(t, "extends")

    def _import(self, t: Tree, kind: str) -> ast.Import:
        tok = t.children[0]
        path = self.string(tok)
        if not path.strip():
            raise self.error(f"empty {kind} path", self.span(tok), f'give a file, e.g. {kind} "base.policy"')
        return ast.Import(span=self.span(t), path=path, kind=kind)  # type: ignore[arg-type]

    def st_rule(self, t: Tree, optional: bool = False) -> ast.Rule:
        sel_tree, spec_tree = t.children
        selector = self.selector(sel_tree)
        return ast.Rule(span=self.span(t), selector=selector, precision=self.spec(spec_tree), optional=optional,
                        text=self.source_text(t))

    def st_optional_rule(self, t: Tree) -> ast.Rule:
        return self.st_rule(t, optional=True)

    def st_share_scale(self, t: Tree, optional: bool = False) -> ast.ShareScale:
        return ast.ShareScale(span=self.span(t), selector=self.selector(t.children[0]), optional=optional,
                              text=self.source_text(t))

    def st_optional_share_scale(self, t: Tree) -> ast.ShareScale:
        return self.st_share_scale(t, optional=True)

    # selectors --------------------------------------------------------------------------------------------------
    def selector(self, t: Tree) -> ast.Selector:
        atoms = list(t.children)
        layers: Optional[ast.LayerSlice] = None
        name: Optional[ast.NameGlob] = None
        mtp = False
        role_parts: list = []  # NAME tokens / member_set trees, in order
        for i, atom in enumerate(atoms):
            if isinstance(atom, Tree) and atom.data == "layer_slice":
                if i != 0:
                    raise self.error("`layers[...]` must come first in a selector", self.span(atom),
                                     "write e.g. `layers[0:3].attn`, not `attn.layers[0:3]`")
                layers = self.layer_slice(atom)
            elif isinstance(atom, Tree) and atom.data == "name_glob":
                if i != len(atoms) - 1:
                    raise self.error("`name(...)` must come last in a selector", self.span(atom),
                                     'write e.g. `layers[0:3].name("*.q_proj.weight")`')
                name = ast.NameGlob(span=self.span(atom), pattern=self.string(atom.children[0]))
                if not name.pattern:
                    raise self.error("empty name pattern", self.span(atom),
                                     'e.g. name("model.layers.*.mlp.gate.weight")')
            elif isinstance(atom, Token) and str(atom) == "mtp" and not role_parts and not mtp:
                if layers is not None:
                    raise self.error("`layers[...]` and `mtp` cannot be combined", self.span(atom),
                                     "MTP modules are not decoder layers: use `mtp` or `mtp.<role>` on its own")
                mtp = True
            else:
                role_parts.append(atom)
        role = self.role(role_parts, mtp) if role_parts else None
        if mtp and role is None:
            pass  # `mtp` alone: every tensor of the MTP modules
        return ast.Selector(span=self.span(t), layers=layers, role=role, name=name, mtp=mtp)

    def role(self, parts: list, mtp: bool) -> ast.RoleSelector:
        first = parts[0]
        if isinstance(first, Tree):
            raise self.error("a member set `{...}` needs a role group before it", self.span(first),
                             "write e.g. `routed_experts.{gate, up}`")
        group = str(first)
        start_span = self.span(first)
        if mtp and group in GROUP_MEMBERS.get("mtp", ()):
            # `mtp.eh_proj`, `mtp.lm_head`, `mtp.embedding`: the MTP-only roles
            members: tuple[str, ...] = (group,)
            if len(parts) > 1:
                raise self.error(f"'mtp.{group}' has no members", self.span(parts[1]),
                                 f"'mtp.{group}' is already a single role")
            return ast.RoleSelector(span=start_span, group="mtp", members=members)
        if group == "layers":
            raise self.error("`layers` needs a slice", start_span, "write e.g. `layers[0:3]` or `layers[-15%:]`")
        if group not in GROUP_MEMBERS:
            alias = _ROLE_ALIASES.get(group)
            hint = f"did you mean '{alias}'?" if alias else did_you_mean(group, list(GROUP_MEMBERS), "role group")
            raise self.error(f"unknown role group '{group}'", start_span, hint)
        members = ()
        end_span = start_span
        if len(parts) > 2:
            raise self.error(f"too many parts in role selector after '{group}'", self.span(parts[2]),
                             "a role selector is `group`, `group.member` or `group.{a, b}`")
        if len(parts) == 2:
            m = parts[1]
            end_span = self.span(m)
            valid = GROUP_MEMBERS[group]
            if not valid:
                raise self.error(f"role '{group}' has no members", end_span, f"use `{group}` on its own")
            toks = list(m.children) if isinstance(m, Tree) else [m]
            out = []
            for tok in toks:
                if str(tok) not in valid:
                    raise self.error(f"'{group}' has no member '{tok}'", self.span(tok),
                                     did_you_mean(str(tok), valid, f"{group}.*"))
                if str(tok) not in out:
                    out.append(str(tok))
            members = tuple(out)
        return ast.RoleSelector(span=self.span_between(start_span, end_span), group=group, members=members)

    def layer_slice(self, t: Tree) -> ast.LayerSlice:
        body = t.children[0]
        span = self.span(t)
        if body.data == "slice_range":
            start = stop = None
            for c in body.children:
                if c.data == "lo":
                    start = self.bound(c.children[0], index=False)
                else:
                    stop = self.bound(c.children[0], index=False)
            return ast.LayerSlice(span=span, start=start, stop=stop, is_range=True)
        return ast.LayerSlice(span=span, indices=tuple(self.bound(c, index=True) for c in body.children))

    def bound(self, t: Tree, index: bool) -> ast.LayerBound:
        num = t.children[0]
        percent = t.data == "bound_percent"
        span = self.span(t)
        try:
            value = float(str(num))
        except ValueError:  # pragma: no cover - the lexer only produces numbers here
            raise self.error(f"invalid number '{num}'", span, "use an integer layer index or a percentage") from None
        if not math.isfinite(value):
            raise self.error(f"layer bound '{num}' is not a finite number", span, "use e.g. 3, -1 or 15%")
        if percent:
            if abs(value) > 100:
                raise self.error(f"percentage {num}% is outside -100%..100%", span,
                                 "a percent bound is a position in the decoder stack, e.g. layers[-15%:]")
        elif value != int(value) or any(ch in str(num) for ch in ".eE"):
            raise self.error(f"layer index '{num}' must be an integer", span,
                             "use an integer, or a percentage like 15%")
        elif abs(value) > 1_000_000:
            raise self.error(f"layer index '{num}' is out of range", span, "models have at most a few hundred layers")
        return ast.LayerBound(span=span, value=value, percent=percent)

    # precision specs --------------------------------------------------------------------------------------------
    def spec(self, t: Tree) -> ast.PrecisionSpec:
        base = weight = act = grad = None
        backward = None
        backward_span = None
        seen: dict[str, ast.Span] = {}
        for item in t.children:
            if item.data == "spec_base":
                call = self.format_call(item.children[0])
                if "base" in seen:
                    raise self.error(f"a second format '{call.name}' in one rule", call.span,
                                     "give one format, or per-operand formats with weight= / act= / grad=")
                seen["base"] = call.span
                base = call
                continue
            key_tok, call_tree = item.children
            key = str(key_tok)
            kspan = self.span(key_tok)
            if key not in SPEC_KEYS:
                raise self.error(f"unknown rule key '{key}='", kspan,
                                 did_you_mean(key, SPEC_KEYS, "rule key") + " (format arguments go inside the "
                                 "parentheses, e.g. nvfp4(act_scale=per_token))")
            if key in seen:
                raise self.error(f"'{key}=' given twice", kspan, "remove one of them")
            seen[key] = kspan
            call = self.format_call(call_tree)
            if key == "backward":
                if call.args:
                    raise self.error("backward= takes a mode, not arguments", call.span,
                                     "backward=quantized | high_precision | dequantized")
                backward = call.name
                backward_span = self.span_between(kspan, call.span)
            elif key == "weight":
                weight = call
            elif key == "act":
                act = call
            else:
                grad = call
        if base is None and weight is None and act is None and grad is None:
            raise self.error("a rule needs a format", self.span(t),
                             "e.g. `: mxfp8 backward=high_precision` or `: weight=nvfp4, act=bf16`")
        return ast.PrecisionSpec(span=self.span(t), base=base, weight=weight, act=act, grad=grad,
                                 backward=backward, backward_span=backward_span)

    def format_call(self, t: Tree) -> ast.FormatCall:
        name_tok = t.children[0]
        args = []
        pos = 0
        for a in t.children[1:]:
            if a.data == "arg_keyed":
                key_tok, value_tree = a.children
                key = str(key_tok)
            else:
                value_tree = a.children[0]
                key = f"_{pos}"
                pos += 1
            args.append(ast.FormatArg(span=self.span(a), key=key, value=self.value(value_tree)))
        return ast.FormatCall(span=self.span(t), name=str(name_tok), args=tuple(args))

    def value(self, t: Tree):
        tok = t.children[0]
        if tok.type == "STRING":
            return self.string(tok)
        if tok.type == "SIGNED_NUMBER":
            try:
                f = float(str(tok))
            except ValueError:  # pragma: no cover
                return str(tok)
            if math.isfinite(f) and f == int(f) and not any(ch in str(tok) for ch in ".eE"):
                return int(f)
            return f if math.isfinite(f) else str(tok)
        return str(tok)
