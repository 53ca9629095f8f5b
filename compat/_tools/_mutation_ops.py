"""The mutation operators ``make mutate`` applies: a curated set of cosmic-ray's core
operators (the *token* families: one token changed) plus the *realistic* ones it lacks,
each the shape of a bug that survives token mutation: a statement left out (a check, a
mark, a record), a keyword argument dropped, an ``if`` condition forced ``True`` or
``False``, a function returning early, two adjacent statements swapped (a step in the
wrong place), a slice bound shifted by one.

cosmic-ray's full set crosses every binary and comparison operator with every other one
(a ``+`` becomes eleven mutants) and adds random variable replacements; most of those are
killed by any test that runs the line and only slow the run down. The set here is one
natural mistake per operator: ``+``/``-`` swapped, ``<`` for ``<=``, ``and`` for ``or``,
a constant one too large, a check or a call left out. No operator touches a string, so
docstrings and error messages are never mutated, and nothing inside an f-string or a
type annotation is mutated (an annotation is never evaluated here).
"""

from __future__ import annotations

from collections.abc import Iterator

import parso.python.tree as tree
from cosmic_ray.operators import (
    binary_operator_replacement,
    boolean_replacer,
    break_continue,
    comparison_operator_replacement,
    number_replacer,
    unary_operator_replacement,
    zero_iteration_for_loop,
)
from cosmic_ray.operators.operator import Example, Operator

# cosmic-ray's class names of the operators kept, per module of theirs
_KEPT = {
    binary_operator_replacement: (
        "Add_Sub",
        "Sub_Add",
        "Mul_Div",
        "Div_Mul",
        "FloorDiv_Div",
        "Mod_FloorDiv",
        "Pow_Mul",
        "LShift_RShift",
        "RShift_LShift",
        "BitAnd_BitOr",
        "BitOr_BitAnd",
        "BitXor_BitOr",
    ),
    comparison_operator_replacement: (
        "Eq_NotEq",
        "NotEq_Eq",
        "Lt_LtE",
        "LtE_Lt",
        "Gt_GtE",
        "GtE_Gt",
        "Is_IsNot",
        "IsNot_Is",
    ),
    unary_operator_replacement: ("Delete_Not", "Delete_USub"),
}


_STAR_PARENTS = (
    "parameters",
    "param",
    "argument",
    "star_expr",
    "lambdef",
    "import_from",
    "dictorsetmaker",
    "arglist",
)

# the node types holding an annotation, and the operator before it
_ANNOTATED = {"tfpdef": ":", "annassign": ":", "funcdef": "->"}


def _guarded(node: tree.NodeOrLeaf) -> bool:
    """Whether ``node`` sits in an f-string or a type annotation, or is a star of a
    signature, an unpacking or an import (cosmic-ray reads those as ``*`` and ``**``)."""
    if node.type == "operator" and node.parent.type in _STAR_PARENTS:
        return True
    child, parent = node, node.parent
    while parent is not None:
        if parent.type == "fstring":
            return True
        if parent.type in _ANNOTATED:
            previous = child.get_previous_sibling()
            if (
                previous is not None
                and previous.type == "operator"
                and previous.value == _ANNOTATED[parent.type]
            ):
                return True
        child, parent = parent, parent.parent
    return False


def _unguarded(core: type[Operator], name: str) -> type[Operator]:
    """``core`` with its mutation positions outside f-strings and annotations."""

    def mutation_positions(self: Operator, node: tree.NodeOrLeaf) -> Iterator[tuple]:
        if not _guarded(node):
            yield from core.mutation_positions(self, node)

    return type(name, (core,), {"mutation_positions": mutation_positions})


def _call_statement(node: tree.NodeOrLeaf) -> bool:
    """A statement made for its effect: a call, ``raise``, ``assert``, ``del``, an augmented
    assignment, or an assignment to an attribute or item (``store.mark = ...``: a plain
    name's assignment dropped is only a ``NameError``)."""
    first = node.children[0]
    if first.type in ("raise_stmt", "assert_stmt", "del_stmt"):
        return True
    if first.type == "expr_stmt":
        operators = [c.value for c in first.children if c.type == "operator" and c.value.endswith("=")]
        target = first.children[0]
        into = target.type == "atom_expr" and target.children[-1].type == "trailer"
        return any(op != "=" for op in operators) or (
            operators == ["="] and into and target.children[-1].children[0].value in (".", "[")
        )
    last = first.children[-1] if first.type == "atom_expr" else None
    return last is not None and last.type == "trailer" and last.children[0].value == "("


class AddNot(boolean_replacer.AddNot):
    """cosmic-ray's ``AddNot``, but not where the condition already starts with ``not``
    (``not not x`` is the mutant that removing that ``not`` makes)."""

    def mutation_positions(self, node):
        if _guarded(node):
            return
        for start, end in super().mutation_positions(node):
            condition = node.children[2] if node.type == "test" else node.children[1]
            if condition.type != "not_test":
                yield start, end


class NumberPlusOne(number_replacer.NumberReplacer):
    """A number one more than written (cosmic-ray's ``NumberReplacer`` also makes one less,
    which on these modules fails where the plus-one mutant fails: it doubled the run)."""

    def mutation_positions(self, node):
        if not _guarded(node):
            yield from list(super().mutation_positions(node))[:1]

    @classmethod
    def examples(cls):
        return (Example("x = 1", "x = 2"), Example("x = 4.2", "x = 5.2"))


class RemoveStatement(Operator):
    """A call made for its effect, a ``raise``, an ``assert``, a ``del`` or an augmented
    assignment left out (replaced by ``pass``)."""

    def mutation_positions(self, node):
        if node.type == "simple_stmt" and _call_statement(node):
            yield (node.children[0].start_pos, node.children[0].end_pos)

    def mutate(self, node, index):
        first = node.children[0]
        node.children[0] = tree.Keyword("pass", first.start_pos, prefix=first.get_first_leaf().prefix)
        return node

    @classmethod
    def examples(cls):
        return (
            Example("f(x)\n", "pass\n"),
            Example("if x:\n    raise ValueError('x')\n", "if x:\n    pass\n"),
            Example("n += 1\n", "pass\n"),
        )


def _conditions(node: tree.NodeOrLeaf) -> list[int]:
    """Indices, among an ``if`` statement's children, of its conditions (after ``if``/``elif``)."""
    return [
        i + 1
        for i, child in enumerate(node.children)
        if child.type == "keyword" and child.value in ("if", "elif")
    ]


class _ForceCondition(Operator):
    """An ``if`` or ``elif`` condition replaced by a constant: the check always (or never) taken."""

    value = "True"

    def mutation_positions(self, node):
        if node.type == "if_stmt" and not _guarded(node):
            yield from [(node.children[i].start_pos, node.children[i].end_pos) for i in _conditions(node)]

    def mutate(self, node, index):
        i = _conditions(node)[index]
        condition = node.children[i]
        node.children[i] = tree.Keyword(
            self.value, condition.start_pos, prefix=condition.get_first_leaf().prefix
        )
        return node


class ConditionTrue(_ForceCondition):
    """An ``if``/``elif`` condition replaced by ``True``."""

    @classmethod
    def examples(cls):
        return (Example("if a < b:\n    f()\n", "if True:\n    f()\n"),)


class ConditionFalse(_ForceCondition):
    """An ``if``/``elif`` condition replaced by ``False``."""

    value = "False"

    @classmethod
    def examples(cls):
        return (
            Example(
                "if a:\n    f()\nelif b:\n    g()\n", "if a:\n    f()\nelif False:\n    g()\n", occurrence=1
            ),
        )


def _is_docstring(statement: tree.NodeOrLeaf) -> bool:
    return statement.type == "simple_stmt" and statement.children[0].type == "string"


def _body(node: tree.NodeOrLeaf) -> int | None:
    """Index, in a function's suite, of its first statement after the docstring (None: a one-line body)."""
    suite = node.children[-1]
    if suite.type != "suite":
        return None
    statements = [i for i, child in enumerate(suite.children) if child.type != "newline"]
    statements = statements[1:] if statements and _is_docstring(suite.children[statements[0]]) else statements
    return statements[0] if statements else None


class ReturnEarly(Operator):
    """A ``return`` before a function's first statement (after its docstring): a check that
    reports nothing, a step never taken."""

    def mutation_positions(self, node):
        if node.type == "funcdef" and not _guarded(node) and _body(node) is not None:
            first = node.children[-1].children[_body(node)]
            yield (first.start_pos, first.end_pos)

    def mutate(self, node, index):
        suite = node.children[-1]
        i = _body(node)
        indent = suite.children[i].get_first_leaf().prefix.rsplit("\n", 1)[-1]
        position = suite.children[i].start_pos
        early = tree.PythonNode(
            "simple_stmt", [tree.Keyword("return", position, prefix=indent), tree.Newline("\n", position)]
        )
        suite.children.insert(i, early)
        return node

    @classmethod
    def examples(cls):
        return (
            Example(
                'def f(x):\n    """Doc."""\n    check(x)\n',
                'def f(x):\n    """Doc."""\n    return\n    check(x)\n',
            ),
        )


def _effectful(statement: tree.NodeOrLeaf) -> bool:
    return statement.type == "if_stmt" or (statement.type == "simple_stmt" and _call_statement(statement))


def _swappable(node: tree.NodeOrLeaf) -> list[int]:
    """Indices ``i`` of a suite's children where statement ``i`` and the next may trade places:
    neither a docstring, and one of them an effect (a call, a check, a mark) or an ``if``."""
    out = []
    children = node.children
    for i in range(len(children) - 1):
        a, b = children[i], children[i + 1]
        if a.type == "newline" or b.type == "newline" or _is_docstring(a) or _is_docstring(b):
            continue
        if (_effectful(a) or _effectful(b)) and a.get_code().strip() != b.get_code().strip():
            out.append(i)
    return out


class SwapStatements(Operator):
    """Two adjacent statements of a block in the other order, one of them an effect or a
    check: a mark set before the write it follows, a check after the step it guards."""

    def mutation_positions(self, node):
        if node.type == "suite" and not _guarded(node):
            yield from [(node.children[i].start_pos, node.children[i + 1].end_pos) for i in _swappable(node)]

    def mutate(self, node, index):
        i = _swappable(node)[index]
        a, b = node.children[i], node.children[i + 1]
        first_a, first_b = a.get_first_leaf(), b.get_first_leaf()
        first_a.prefix, first_b.prefix = first_b.prefix, first_a.prefix
        node.children[i], node.children[i + 1] = b, a
        return node

    @classmethod
    def examples(cls):
        return (Example("def f():\n    a()\n    b = 1\n", "def f():\n    b = 1\n    a()\n"),)


def _bounds(node: tree.NodeOrLeaf) -> list[tuple[int, str]]:
    """(index, shift) of a slice's bounds: its lower one moved up by one, its upper one down."""
    children = node.children
    colons = [i for i, c in enumerate(children) if c.type == "operator" and c.value == ":"]
    if not colons:
        return []
    first = colons[0]
    out = [(first - 1, "+ 1")] if first > 0 else []
    if first + 1 < len(children) and children[first + 1].type != "sliceop":
        out.append((first + 1, "- 1"))
    return out


class ShiftSliceBound(Operator):
    """A slice bound off by one: ``a[i:j]`` read as ``a[i + 1:j]`` or ``a[i:j - 1]``."""

    def mutation_positions(self, node):
        if node.type == "subscript" and not _guarded(node):
            yield from [(node.children[i].start_pos, node.children[i].end_pos) for i, _ in _bounds(node)]

    def mutate(self, node, index):
        i, shift = _bounds(node)[index]
        bound = node.children[i]
        code = bound.get_code(include_prefix=False)
        node.children[i] = tree.Name(
            f"({code}) {shift}", bound.start_pos, prefix=bound.get_first_leaf().prefix
        )
        return node

    @classmethod
    def examples(cls):
        return (
            Example("x = a[i:j]", "x = a[(i) + 1:j]"),
            Example("x = a[i:j]", "x = a[i:(j) - 1]", occurrence=1),
            Example("x = a[:n]", "x = a[:(n) - 1]"),
        )


def _keyword_arguments(node: tree.NodeOrLeaf) -> list[int]:
    """Indices, among ``node``'s children, of its ``name=value`` arguments."""
    return [
        i
        for i, child in enumerate(node.children)
        if child.type == "argument" and len(child.children) == 3 and child.children[1].value == "="
    ]


class RemoveKeywordArgument(Operator):
    """A ``name=value`` argument of a call left out (the callee's default used)."""

    def mutation_positions(self, node):
        if node.type in ("arglist", "trailer") and not _guarded(node):
            # a list: the visitor mutates the node before this generator resumes
            yield from [
                (node.children[i].start_pos, node.children[i].end_pos) for i in _keyword_arguments(node)
            ]

    def mutate(self, node, index):
        i = _keyword_arguments(node)[index]
        children = node.children
        if node.type == "trailer":
            del children[i]
        elif i + 1 < len(children):  # the argument and the comma after it
            children[i + 2].get_first_leaf().prefix = children[i].get_first_leaf().prefix
            del children[i : i + 2]
        else:  # the last one: the comma before it
            del children[i - 1 : i + 1]
        return node

    @classmethod
    def examples(cls):
        return (
            Example("f(a, b=1)", "f(a)"),
            Example("f(b=1, c=2)", "f(c=2)"),
            Example("f(b=1, c=2)", "f(b=1)", occurrence=1),
            Example("f(b=1)", "f()"),
        )


def _operators() -> dict[str, type[Operator]]:
    kept: dict[str, type[Operator]] = {}
    for module, suffixes in _KEPT.items():
        by_name = {op.__name__: op for op in module.operators()}
        for suffix in suffixes:
            core = next(op for name, op in by_name.items() if name.split("_", 1)[1] == suffix)
            kept[core.__name__] = _unguarded(core, core.__name__)
    for core in (
        boolean_replacer.ReplaceTrueWithFalse,
        boolean_replacer.ReplaceFalseWithTrue,
        boolean_replacer.ReplaceAndWithOr,
        boolean_replacer.ReplaceOrWithAnd,
        break_continue.ReplaceBreakWithContinue,
        break_continue.ReplaceContinueWithBreak,
        zero_iteration_for_loop.ZeroIterationForLoop,
    ):
        kept[core.__name__] = _unguarded(core, core.__name__)
    kept["AddNot"] = AddNot
    kept["NumberPlusOne"] = NumberPlusOne
    kept["RemoveStatement"] = RemoveStatement
    kept["RemoveKeywordArgument"] = RemoveKeywordArgument
    for realistic in (ConditionTrue, ConditionFalse, ReturnEarly, SwapStatements, ShiftSliceBound):
        kept[realistic.__name__] = realistic
    return kept


# Each operator's family, as the report counts them: the token families change one token;
# the realistic ones leave out or misplace a whole step.
REALISTIC = {
    "RemoveStatement": "removed statement",
    "RemoveKeywordArgument": "dropped keyword argument",
    "ConditionTrue": "condition forced",
    "ConditionFalse": "condition forced",
    "ReturnEarly": "early return",
    "SwapStatements": "swapped statements",
    "ShiftSliceBound": "slice bound off by one",
}


def family_of(operator_name: str) -> str:
    """The family of an operator (by its name, as cosmic-ray records it)."""
    name = operator_name.split("/")[-1]
    if name in REALISTIC:
        return REALISTIC[name]
    if name in ("ReplaceBreakWithContinue", "ReplaceContinueWithBreak", "ZeroIterationForLoop"):
        return "loop"
    if name.startswith(("ReplaceTrue", "ReplaceFalse", "ReplaceAnd", "ReplaceOr", "AddNot")) or name.endswith(
        "Delete_Not"
    ):
        return "boolean"
    if name == "NumberPlusOne":
        return "constant"
    if any(op in name for op in ("Eq_", "NotEq_", "Lt_", "LtE_", "Gt_", "GtE_", "Is_", "IsNot_")):
        return "comparison"
    return "arithmetic"


class OperatorProvider:
    """cosmic-ray's operator-provider interface over the set above."""

    def __init__(self) -> None:
        self._operators = _operators()

    def __iter__(self) -> Iterator[str]:
        return iter(self._operators)

    def __getitem__(self, name: str) -> type[Operator]:
        return self._operators[name]
