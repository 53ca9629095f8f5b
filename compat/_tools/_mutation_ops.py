"""The mutation operators ``make mutate`` applies: a curated set of cosmic-ray's core
operators plus two it lacks (a removed statement, a removed keyword argument).

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
    first = node.children[0]
    if first.type in ("raise_stmt", "assert_stmt", "del_stmt"):
        return True
    if first.type == "expr_stmt":  # x += 1 (a plain assignment dropped is only a NameError)
        return any(
            child.type == "operator" and child.value.endswith("=") and child.value != "="
            for child in first.children
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
    return kept


class OperatorProvider:
    """cosmic-ray's operator-provider interface over the set above."""

    def __init__(self) -> None:
        self._operators = _operators()

    def __iter__(self) -> Iterator[str]:
        return iter(self._operators)

    def __getitem__(self, name: str) -> type[Operator]:
        return self._operators[name]
