#!/usr/bin/env python3
"""Every precondition message of the library and the tests that provoke it, read from the source.

    python3 tools/precondition_table.py            the markdown table (docs/preconditions.md)
    python3 tools/precondition_table.py --check    exit 1 listing every message no test covers
    python3 tools/precondition_table.py --json     one record per message
    python3 tools/precondition_table.py --write-docs   the table into docs/preconditions.md (between its markers)

Messages come from every place that raises one:
  * C++: `fail(arg, <message>)` and `throw ArgumentError(<message>)` in cpp/src/checks.hpp, validate.cpp (the
    attention ops, their FP8 output included), moe_finalize_validate.cpp, all_reduce_validate.cpp and plan.cpp.
    A message is its concatenation of string literals (a `+` term that is not a literal is a value, shown as
    <...>). A check whose argument is a parameter (`arg`) is listed once per literal argument a validator of a
    family calls it with (e.g. check.layout("rows", ...)) plus once for its calls with computed arguments
    (shown as <arg>); a shared check no validator of a family calls is not listed for that family.
  * Python: `raise ...(f"...")` and `_argument_error(arg, f"...")` in python/attnres/_tensors.py, ops.py,
    _attn_ops.py, options.py, planning.py, fp8.py, moe_ops.py, moe_tail.py, all_reduce.py and _all_reduce_ops.py.
Three families: the attention ops, moe_finalize, and the all-reduce ops (all_reduce, moe_finalize_all_reduce,
all_reduce_attn_res_add_rmsnorm: their communicator and exchange rules; the fused epilogue's own rules are
listed under its family).
The rule shown is the condition the message is raised under (the `if` around it).

A test covers a message when one of its string literals (an f-string's fields, a `.format` field or a `.*` of
a regex count as "anything") can be the start of that message: tests compare with startswith / `match="^..."`,
so a literal may stop anywhere. Literals are read from tests/**/*.py and cpp/tests/*.cpp; one naming an op
(`moe_finalize: ...`, `attn_res...: ...`, `all_reduce: ...`) counts for that op family, one without a prefix
for the family of its file (named after what it tests). A literal counts only with at least 10 characters of its own (a bare "{message}" says nothing).
The test named is the test function (Python) or GoogleTest case (C++) the literal belongs to, following
module-level tables into the parametrized tests that read them.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PH = "\x00"  # a test literal's "anything" (an f-string field)
ATTN_OPS = ("attn_res_add_rmsnorm_persistent", "attn_res_add_rmsnorm", "attn_res_rmsnorm", "attn_res")
ALL_REDUCE_OPS = ("all_reduce_attn_res_add_rmsnorm", "moe_finalize_all_reduce", "all_reduce", "register_communicator")
FAMILIES = {"attention": "attention ops", "moe": "moe_finalize", "all_reduce": "all-reduce ops"}
DTYPES = ("bfloat16", "float32", "float16", "float64", "int32", "int64", "uint8", "an unsupported dtype")
CPP_SOURCES = {"cpp/src/checks.hpp": None, "cpp/src/validate.cpp": "attention", "cpp/src/plan.cpp": "attention",
               "cpp/src/moe_finalize_validate.cpp": "moe", "cpp/src/all_reduce_validate.cpp": "all_reduce"}
PY_SOURCES = {"python/attnres/_tensors.py": "attention", "python/attnres/ops.py": "attention",
              "python/attnres/_attn_ops.py": "attention", "python/attnres/options.py": "attention",
              "python/attnres/planning.py": "attention", "python/attnres/fp8.py": "attention",
              "python/attnres/moe_ops.py": "moe", "python/attnres/moe_tail.py": "moe",
              "python/attnres/all_reduce.py": "all_reduce", "python/attnres/_all_reduce_ops.py": "all_reduce"}
MIN_LITERAL = 10
DOC = ROOT / "docs" / "preconditions.md"  # the generated page (--write-docs), read by tests/tools/test_precondition_table.py

# Messages the parser lists but no call can raise, with the reason (checked: each must still be listed).
# presence() is called for every argument; only some are ever required.
UNREACHABLE = {
    ("attention", "layer_residual_add2", "layer_residual_add2 is required"):
        "no op requires layer_residual_add2 (validate.cpp op_table: optional or refused)",
    ("attention", "mixture", "mixture is required"): "the tap is optional in every op (op_table)",
    ("attention", "rsigma", "rsigma is required"): "the diagnostics are optional in every op (op_table)",
    ("attention", "probs", "probs is required"): "the diagnostics are optional in every op (op_table)",
    ("attention", "logits", "logits is required"): "the diagnostics are optional in every op (op_table)",
    ("attention", "layer_residual", "layer_residual is not an argument of this op"): "required by every op",
    ("attention", "block_residual", "block_residual is not an argument of this op"): "required by every op",
    ("attention", "res_weight", "res_weight is not an argument of this op"): "required by every op",
    ("attention", "rms_weight", "rms_weight is not an argument of this op"): "required by every op",
    ("attention", "layer_residual", "layer_residual must have shape <...> = <...>, got <...>"):
        "layer_residual is checked against [*, *] (T and H are read from it): only its rank can be wrong",
}


# ================================================================================= message templates
# A template is a list of parts: ("lit", text), ("var", kind) with kind "any", "arg", "dtype".
@dataclass
class Message:
    family: str  # a key of FAMILIES
    source: str  # file:line
    arg: str  # the argument named ("<arg>" when computed)
    parts: list  # the rule's template, after "<arg> "
    rule: str  # the condition it is raised under
    language: str
    tests: list = field(default_factory=list)
    unreachable: str = ""  # why no call can raise it (UNREACHABLE)
    by_wording: bool = False  # covered only by tests of the same wording for another (computed) argument

    def text(self) -> str:
        body = "".join(p[1] if p[0] == "lit" else f"<{'dtype' if p[1] == 'dtype' else '...'}>" for p in self.parts)
        return f"{self.arg} {body}" if self.arg else body

    def key(self) -> tuple:
        return (self.family, self.arg, self.text())


def _cpp_literal(term: str) -> str | None:
    """The text of a term made only of adjacent string literals (optionally wrapped in std::string())."""
    t = term.strip()
    m = re.fullmatch(r"std::string\((.*)\)", t, re.S)
    if m:
        t = m.group(1).strip()
    lits = re.findall(r'"((?:[^"\\]|\\.)*)"', t)
    if lits and re.fullmatch(r'(?:\s*"(?:[^"\\]|\\.)*"\s*)+', t):
        return "".join(bytes(x, "utf-8").decode("unicode_escape") for x in lits)
    return None


def _split_top(expr: str, sep: str) -> list[str]:
    """Splits at `sep` outside parentheses, brackets and string literals."""
    out, depth, cur, i = [], 0, [], 0
    while i < len(expr):
        c = expr[i]
        if c == '"':
            j = i + 1
            while expr[j] != '"':
                j += 2 if expr[j] == "\\" else 1
            cur.append(expr[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    out.append("".join(cur))
    return out


def _cpp_template(expr: str) -> list:
    parts = []
    for term in _split_top(expr, "+"):
        lit = _cpp_literal(term)
        if lit is not None:
            parts.append(("lit", lit))
        else:
            # ref_arg names the reference argument, which may be a phrase ("the communicator").
            kind = "dtype" if "dtype_name" in term else "ref" if term.strip() == "ref_arg" else "any"
            parts.append(("var", kind))
    return parts


def _call_args(text: str, open_paren: int) -> tuple[list[str], int]:
    """The top-level arguments of the call whose '(' is at open_paren, and the index after its ')'."""
    depth, i = 0, open_paren
    while True:
        c = text[i]
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return _split_top(text[open_paren + 1:i], ","), i + 1
        i += 1


def _enclosing_function(text: str, pos: int) -> str | None:
    """The name of the C++ function (or method) whose body holds pos, if it takes a parameter named arg."""
    for m in reversed(list(re.finditer(r"^\s*(?:\[\[noreturn\]\]\s*)?[\w:<>,&\*\s]*?\b(\w+)\(([^;{]*?)\)\s*(?:const\s*)?\{",
                                       text[:pos], re.M))):
        return m.group(1) if re.search(r"\barg\b", m.group(2)) else None
    return None


def _cpp_condition(text: str, pos: int) -> str:
    """The if-condition the call at pos sits in (same statement), or ''."""
    start = text.rfind(";", 0, pos)
    start = max(start, text.rfind("{", 0, pos), text.rfind("}", 0, pos))
    stmt = text[start + 1:pos]
    m = re.search(r"\bif\s*\(", stmt)
    if not m:
        return ""
    args, _ = _call_args(stmt + ")" * 8, m.end() - 1)
    return " ".join(",".join(args).split())


def cpp_messages() -> list[Message]:
    out = []
    texts = {path: (ROOT / path).read_text() for path in CPP_SOURCES}
    for path, family in CPP_SOURCES.items():
        text = texts[path]
        for m in re.finditer(r"\b(?:c\.|check\.)?fail\s*\(|\bthrow ArgumentError\s*\(", text):
            if text[max(0, m.start() - 24):m.start()].rstrip().endswith("void"):
                continue  # the definition of fail itself
            args, _ = _call_args(text, m.end() - 1)
            line = text.count("\n", 0, m.start()) + 1
            cond = _cpp_condition(text, m.start())
            if m.group(0).startswith("throw"):
                if args[0].strip().startswith("op_"):
                    continue  # Checker::fail itself: "<op>: " + arg + " " + rule
                parts = _cpp_template(args[0])
                # "<op>: ..." built from op_name(): drop the op prefix, the family says which ops.
                if parts and parts[0][0] == "var" and len(parts) > 1 and parts[1][0] == "lit" and \
                        parts[1][1].startswith(": "):
                    parts = [("lit", parts[1][1][2:])] + parts[2:]
                if parts and parts[0][0] == "lit" and parts[0][1].startswith("attnres: "):
                    continue  # "attnres: unknown op": an enum value no caller can name, not a precondition
                if parts and parts[0][0] == "lit" and ": " in parts[0][1] and parts[0][1].split(": ")[0] == "make_ref":
                    continue
                out.append(Message(family, f"{path}:{line}", "", parts, cond, "C++"))
                continue
            if len(args) != 2 or args[1].strip() == "rule":
                continue  # a forwarding wrapper (moe_finalize_validate.cpp's fail)
            arg_lit = _cpp_literal(args[0])
            parts = _cpp_template(args[1])
            func = _enclosing_function(text, m.start()) if arg_lit is None else None
            if arg_lit is not None:
                out.append(Message(family, f"{path}:{line}", arg_lit, parts, cond, "C++"))
                continue
            # A check taking its argument's name: one row per literal name it is called with, one for the rest.
            families = [family] if family else list(FAMILIES)
            for fam in families:
                callers = [p for p, f in CPP_SOURCES.items() if f == fam]
                names, computed = set(), False
                for p in callers:
                    for call in re.finditer(rf"(?<![\w.])(?:c\.|check\.)?{func}\s*\(", texts[p]):
                        if re.match(r"\s*(?:void|bool)\b", texts[p][max(0, call.start() - 6):call.start()]):
                            continue
                        if texts[p][:call.start()].rstrip().endswith(("void", "bool")):
                            continue
                        cargs, _ = _call_args(texts[p], call.end() - 1)
                        lit = _cpp_literal(cargs[0])
                        if lit is None:
                            computed = True
                        else:
                            names.add(lit)
                for name in sorted(names):
                    out.append(Message(fam, f"{path}:{line}", name, parts, cond, "C++"))
                # A shared check no validator of this family calls raises nothing for it.
                if computed or (not names and family):
                    out.append(Message(fam, f"{path}:{line}", "<arg>", parts, cond, "C++"))
    return out


def _py_template(node: ast.AST) -> list:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [("lit", node.value)]
    if isinstance(node, ast.JoinedStr):
        return [("lit", v.value) if isinstance(v, ast.Constant) else ("var", "any") for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _py_template(node.left) + _py_template(node.right)
    return [("var", "any")]


def py_messages() -> list[Message]:
    out = []
    for path, family in PY_SOURCES.items():
        tree = ast.parse((ROOT / path).read_text())
        parents = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node

        def condition(node):
            while node in parents:
                node = parents[node]
                if isinstance(node, (ast.If, ast.While)):
                    return ast.unparse(node.test)
                if isinstance(node, ast.FunctionDef):
                    return ""
            return ""

        for node in ast.walk(tree):
            call = None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                call = node.exc
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_argument_error":
                call = node
            if call is None or not call.args:
                continue
            fname = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
            if fname == "_argument_error":
                arg = call.args[0].value if isinstance(call.args[0], ast.Constant) else "<arg>"
                parts = _py_template(call.args[1])
            else:
                parts = _py_template(call.args[0])
                if not any(p[0] == "lit" for p in parts):
                    continue  # re-raising a message built elsewhere
                arg = ""
                # "function: {name} rule" (no op of a family): the prefix goes, the name is the argument
                if parts and parts[0][0] == "lit" and re.fullmatch(r"[\w.]+: ", parts[0][1]) and len(parts) > 2 \
                        and parts[1] == ("var", "any") and parts[2][0] == "lit" and parts[2][1].startswith(" "):
                    parts = parts[1:]
                # f"{op}: {name} rule" / f"{OP}: ...": the op prefix goes (the family says which ops)
                if len(parts) >= 2 and parts[0] == ("var", "any") and parts[1][0] == "lit" and parts[1][1].startswith(": "):
                    parts = [("lit", parts[1][1][2:])] + parts[2:]
                if parts and parts[0][0] == "lit" and parts[0][1].startswith(OP_PREFIX_MOE):
                    parts = [("lit", parts[0][1][len(OP_PREFIX_MOE):])] + parts[1:]
                if len(parts) >= 2 and parts[0] == ("lit", "") and parts[1] == ("var", "any"):
                    parts = parts[1:]
                if parts and parts[0] == ("var", "any") and len(parts) > 1 and parts[1][0] == "lit" and \
                        parts[1][1].startswith(" "):
                    arg, parts = "<arg>", [("lit", parts[1][1][1:])] + parts[2:]
            if parts and parts[0][0] == "lit" and parts[0][1].startswith(" "):
                parts = [("lit", parts[0][1][1:])] + parts[1:]
            out.append(Message(family, f"{path}:{node.lineno}", arg, parts, condition(node), "Python"))
    return out


OP_PREFIX_MOE = "moe_finalize: "


# ================================================================================= test literals
@dataclass
class TestLiteral:
    text: str  # PH for fields
    family: str | None  # from an op prefix, else the file's
    where: str  # the test it belongs to


def _strip_op(s: str) -> tuple[str, str | None]:
    if s.startswith(PH + ": "):
        return s[3:], None
    for op in ALL_REDUCE_OPS:  # before the others: "moe_finalize_all_reduce: " is not "moe_finalize: "
        if s.startswith(op + ": "):
            return s[len(op) + 2:], "all_reduce"
    if s.startswith(OP_PREFIX_MOE):
        return s[len(OP_PREFIX_MOE):], "moe"
    for op in ATTN_OPS:
        if s.startswith(op + ": "):
            return s[len(op) + 2:], "attention"
    return s, None


def _py_test_strings(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.sub(r"\{[^{}]*\}", PH, node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else PH for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _py_test_strings(node.left), _py_test_strings(node.right)
        return (left if left is not None else PH) + (right if right is not None else PH)
    return None


def _unregex(s: str) -> str:
    s = s.replace(".*", PH).replace(".+", PH).lstrip("^")
    return re.sub(r"\\([\[\]().*+?])", r"\1", s)


def _py_owner_tests(tree: ast.Module, path: str) -> dict:
    """top-level statement -> the test functions it is (or feeds, through module-level names)."""
    tops = tree.body
    names_of = {}
    for st in tops:
        if isinstance(st, (ast.FunctionDef, ast.ClassDef)):
            names_of[st] = {st.name}
        elif isinstance(st, (ast.Assign, ast.AnnAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            names_of[st] = {t.id for t in targets if isinstance(t, ast.Name)}
        else:
            names_of[st] = set()
    used = {st: {n.id for n in ast.walk(st) if isinstance(n, ast.Name)} for st in tops}

    def tests_for(st, seen=()):
        if isinstance(st, ast.FunctionDef) and st.name.startswith("test_"):
            return {st.name}
        out = set()
        for other in tops:
            if other is st or other in seen:
                continue
            if names_of[st] & used[other]:
                out |= tests_for(other, seen + (st,))
        return out

    return {st: sorted(tests_for(st)) for st in tops}


def _py_literals(path: Path, family: str) -> list[TestLiteral]:
    src = path.read_text()
    tree = ast.parse(src)
    owners = _py_owner_tests(tree, str(path))
    out = []
    rel = path.relative_to(ROOT)
    for st in tree.body:
        tests = owners[st]
        for node in ast.walk(st):
            if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                s = _py_test_strings(node)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                s = _py_test_strings(node)
            else:
                continue
            if s is None:
                continue
            s, fam = _strip_op(_unregex(s))
            if len(s.replace(PH, "")) < MIN_LITERAL:
                continue
            case = ""
            if not (isinstance(st, ast.FunctionDef) and st.name.startswith("test_")):
                before = src[:sum(len(x) + 1 for x in src.splitlines()[:node.lineno - 1]) + node.col_offset]
                m = list(re.finditer(r'\(\s*"([A-Za-z_][\w]*)"\s*,', before[-600:]))
                case = f"[{m[-1].group(1)}]" if m else ""
            where = ", ".join(f"{t}{case}" for t in tests) if tests else f"{st.__class__.__name__} at line {st.lineno}"
            out.append(TestLiteral(s, fam or family, f"py {rel.name}::{where}"))
    return out


def _cpp_literals(path: Path, family: str) -> list[TestLiteral]:
    text = path.read_text()
    rel = path.name
    # GoogleTest names: TEST/TEST_P blocks, and the suites instantiated from a table function.
    instantiations = {m.group(3): (m.group(1), m.group(2)) for m in re.finditer(
        r"INSTANTIATE_TEST_SUITE_P\(\s*(\w+),\s*(\w+),\s*::testing::ValuesIn\((\w+)\(\)\)", text)}
    test_p = {m.group(1): m.group(2) for m in re.finditer(r"TEST_P\((\w+),\s*(\w+)\)", text)}
    blocks = [(m.start(), f"{m.group(1)}.{m.group(2)}") for m in re.finditer(r"\bTEST(?:_F)?\((\w+),\s*(\w+)\)", text)]
    funcs = [(m.start(), m.group(1)) for m in re.finditer(r"^std::vector<\w+> (\w+)\(\) \{", text, re.M)]
    # The rejection tables' builders (set_shape("Case", op, "arg", ..., "rule text")) prefix "arg " themselves.
    builder_arg = {}
    for m in re.finditer(r'\b(?:set_shape|set_dtype|set_device|set_strides|add_arg|alias)\(\s*"\w+",\s*\w+,\s*"(\w+)"', text):
        line = text.count("\n", 0, m.start()) + 1
        builder_arg[line] = m.group(1)
        if ")," not in text[m.end():text.find("\n", m.end())]:
            builder_arg[line + 1] = m.group(1)  # the rule text continues on the next line
    out = []
    for line_no, line in enumerate(text.splitlines(), 1):
        pieces = list(re.finditer(r'"((?:[^"\\]|\\.)*)"', line))
        if not pieces:
            continue
        # Literals joined by `+ name +` (a value in between) or adjacent: one pattern.
        groups, cur = [], None
        for i, p in enumerate(pieces):
            if cur is None:
                cur = p.group(1)
            else:
                gap = line[pieces[i - 1].end():p.start()]
                if re.fullmatch(r"\s*", gap):
                    cur += p.group(1)
                elif re.fullmatch(r"\s*\+\s*[\w.:()]+\s*\+\s*", gap):
                    cur += PH + p.group(1)
                else:
                    groups.append(cur)
                    cur = p.group(1)
        groups.append(cur)
        pos = sum(len(x) + 1 for x in text.splitlines()[:line_no - 1])
        owner = ""
        for start, name in blocks:
            if start < pos:
                owner = name
        for start, name in funcs:
            if start < pos and start > max((b for b, _ in blocks if b < pos), default=-1):
                prefix_suite = instantiations.get(name)
                if prefix_suite:
                    prefix, suite = prefix_suite
                    m = list(re.finditer(r'[({]\s*"([A-Za-z_]\w*)"', text[max(0, pos - 600):pos + len(line)]))
                    case = m[-1].group(1) if m else "*"
                    owner = f"{prefix}/{suite}.{test_p.get(suite, '*')}/{case}"
        if line_no in builder_arg:
            groups += [f"{builder_arg[line_no]} {g}" for g in groups if g != builder_arg[line_no]]
        for g in groups:
            s, fam = _strip_op(bytes(g, "utf-8").decode("unicode_escape"))
            if len(s.replace(PH, "")) < MIN_LITERAL:
                continue
            out.append(TestLiteral(s, fam or family, f"C++ {rel}::{owner or f'line {line_no}'}"))
    return out


def _file_family(name: str) -> str:
    """The family of a test file's literals that name no op (the file is named after what it tests)."""
    if "all_reduce" in name:
        return "all_reduce"
    return "moe" if "moe" in name else "attention"


def test_literals() -> list[TestLiteral]:
    out = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "test_precondition_table.py":
            continue  # names messages to look them up, provokes none
        out += _py_literals(path, _file_family(path.name))
    for path in sorted((ROOT / "cpp" / "tests").glob("*.cpp")):
        out += _cpp_literals(path, _file_family(path.name))
    return out


# ================================================================================= matching
_VAR = {
    "any": r"(?:\x00|\[[^\]]*\]|\([^)]*\)|[^\x00\s\[\]()])*?",
    "arg": r"(?:\x00|[\w.]+)",
    "ref": r"(?:\x00|[\w.:]+(?: [\w.:]+)*?)",
    "dtype": "(?:\x00|" + "|".join(re.escape(d) for d in DTYPES) + ")",
}


def _prefix_regex(parts: list, required: int = 0) -> str:
    """A regex matching the prefixes of the messages the template can produce (a PH in the test literal may
    stand for any value). The first `required` literal parts must be present: all of each but the last, and
    of the last at least its first 12 characters (a test may stop anywhere after that)."""
    if not parts:
        return ""
    kind, val = parts[0]
    rest = _prefix_regex(parts[1:], required - (kind == "lit"))
    if kind == "var":
        var = _VAR.get(val) or f"(?:\x00|{re.escape(val)})"  # a named argument, or a field standing for it
        return f"(?:{var}{rest})" if required > 0 else f"(?:{var}(?:{rest})?)"
    chars = [re.escape(c) for c in val]
    full = "".join(chars)
    if required > 1:
        return f"(?:{full}{rest})"
    shortest = min(12, len(chars)) if required == 1 else 0
    partial = "|".join("".join(chars[:k]) for k in range(shortest, len(chars)))
    tail = f"(?:{rest})?" if required <= 1 else rest
    return f"(?:{full}{tail}|(?:{partial}))" if partial else f"(?:{full}{tail})"


def coverage(messages: list[Message], literals: list[TestLiteral]) -> None:
    """msg.tests: the tests whose literal names the argument and can start the message. Where none does, the
    tests of the same wording with a computed argument (a field, or the rule alone) are listed instead and
    msg.by_wording is set: the wording is tested, this argument maybe not."""
    for msg in messages:
        # A literal must reach through the rule's first piece of text: a bare argument name says nothing.
        rule_re = re.compile(_prefix_regex(msg.parts, 1), re.S)
        named = msg.arg not in ("", "<arg>")
        if not msg.arg:
            full_parts = msg.parts
        else:
            full_parts = [("var", "arg" if msg.arg == "<arg>" else msg.arg), ("lit", " ")] + msg.parts
        full_re = re.compile(_prefix_regex(full_parts, 2 if msg.arg else 1), re.S)
        strict, loose = [], []
        for lit in literals:
            if lit.family != msg.family:
                continue
            exact = full_re.fullmatch(lit.text) and not (named and lit.text.startswith(PH))
            if exact:
                strict.append(lit.where) if lit.where not in strict else None
            elif full_re.fullmatch(lit.text) or (msg.arg and rule_re.fullmatch(lit.text)
                                                 and len(lit.text.replace(PH, "")) >= MIN_LITERAL + 5):
                loose.append(lit.where) if lit.where not in loose else None
        msg.tests = strict or loose
        msg.by_wording = bool(named and not strict and loose)


def collect() -> list[Message]:
    messages = cpp_messages() + py_messages()
    seen, unique = set(), []
    for m in messages:
        if m.key() not in seen:
            seen.add(m.key())
            unique.append(m)
    coverage(unique, test_literals())
    for m in unique:
        m.unreachable = UNREACHABLE.get((m.family, m.arg, m.text()), "")
    return unique


def _short_test(where: str) -> str:
    """The first test of a literal's owners (a module-level table may feed several), without the "py "/"C++ "
    prefix (the file's extension says which)."""
    first = where.split(", ")[0]
    return first.split(" ", 1)[1] if first.startswith(("py ", "C++ ")) else first


def markdown(messages: list[Message]) -> str:
    """One table per family. Compact on purpose (the page stays under 40 KB): the source without its folder, the
    first covering test and how many more; the condition each is raised under and every test are in `--json`."""
    out = []
    for family, title in FAMILIES.items():
        rows = [m for m in messages if m.family == family]
        out += [f"### {title} ({len(rows)} messages)", "", "| source | message | tests |", "|---|---|---|"]
        for m in rows:
            if m.unreachable:
                tests = f"unreachable: {m.unreachable}"
            elif not m.tests:
                tests = "**none**"
            else:
                more = f" (+{len(m.tests) - 1})" if len(m.tests) > 1 else ""
                tests = ("by wording: " if m.by_wording else "") + _short_test(m.tests[0]) + more
            text = m.text().replace("|", "\\|")
            source = m.source.split("/")[-1]
            out.append(f"| `{source}` | `{text}` | {tests.replace('|', '/')} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a message has no covering test")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write-docs", action="store_true", help="replace the table in docs/preconditions.md")
    args = p.parse_args(argv)
    messages = collect()
    uncovered = [m for m in messages if not m.tests and not m.unreachable]
    stale = [key for key in UNREACHABLE if not any((m.family, m.arg, m.text()) == key for m in messages)]
    if args.json:
        print(json.dumps([{"family": m.family, "source": m.source, "arg": m.arg, "message": m.text(), "rule": m.rule,
                           "language": m.language, "tests": m.tests, "by_wording": m.by_wording,
                           "unreachable": m.unreachable}
                          for m in messages], indent=1))
    elif args.check:
        for m in uncovered:
            print(f"no test: {m.family} {m.source}: {m.text()!r}")
        for key in stale:
            print(f"stale UNREACHABLE entry (no such message, or it has a test now): {key}")
        unreachable = sum(1 for m in messages if m.unreachable)
        wording = sum(1 for m in messages if m.by_wording and not m.unreachable)
        named = sum(1 for m in messages if m.tests and not m.by_wording and not m.unreachable)
        print(f"{len(messages)} messages: {named} covered by a test naming the argument, {wording} by the wording "
              f"only, {unreachable} unreachable, {len(uncovered)} without a test")
    elif args.write_docs:
        doc = DOC
        text = doc.read_text()
        begin, end = "<!-- precondition-table:begin -->\n", "<!-- precondition-table:end -->"
        i, j = text.index(begin) + len(begin), text.index(end)
        doc.write_text(text[:i] + markdown(messages) + "\n" + text[j:])
        print(f"{doc}: {len(messages)} messages")
    else:
        print(markdown(messages))
    return 1 if (args.check and (uncovered or stale)) else 0


if __name__ == "__main__":
    sys.exit(main())
