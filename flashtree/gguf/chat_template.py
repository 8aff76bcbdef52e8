"""Chat templates rendered with bounded work: a GGUF's template is code that came with the file.

jinja2's sandbox keeps a template away from Python internals, not from spending unbounded time or memory:
two nested `range(99999)` loops never return, `'x' * 10**10` asks for 10 GB. `BoundedSandbox` counts the
steps of a render (each loop item, call and arithmetic operation) and stops it past a budget, refuses a
string or list longer than MAX_TEXT before building it with `*`, `+` or `~` (and after, from a call or a
filter), and `render` turns every way a render can fail into one FlashtreeError.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

from jinja2 import TemplateError, nodes, pass_context
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from flashtree.errors import FlashtreeError

MAX_STEPS = 200_000  # a render's loop items, calls and operations: real templates take ~20 a message
STEPS_PER_ITEM = 1_000  # more for each message and tool the template is given
MAX_TEXT = 32 << 20  # characters (or items) of any string or list a template builds, its output included
MAX_INT_BITS = 4096  # integers a template computes: enough for any arithmetic a chat prompt needs

_BUDGET = "flashtree steps"  # the render variable holding its _Budget (not a name a template can write)
_STEPS_FILTER, _SIZE_FILTER = "flashtree_steps", "flashtree_size"


class _Budget:
    """The steps one render may still take."""

    def __init__(self, steps: int):
        self.left = steps

    def tick(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise TemplateError("the chat template takes too many steps (an endless or huge loop?)")


def _budget(context: Context) -> _Budget:
    return context.parent[_BUDGET]  # render variables: a template's own `set` cannot replace them


def _counted(budget: _Budget, items: Iterable) -> Iterator:
    for item in items:
        budget.tick()
        yield item


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_TEXT:
        raise TemplateError(f"the chat template builds a value of {len(value)} items (at most {MAX_TEXT})")
    return value


def _join(pieces: Iterable[str]) -> str:
    """`concat` of captured blocks and macro output, with its size checked as it grows."""
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > MAX_TEXT:
            raise TemplateError(f"the chat template writes more than {MAX_TEXT} characters")
        out.append(piece)
    return "".join(out)


class _Bounded(NodeTransformer):
    """Wraps every loop's items in the step counter and every `~` concatenation in the size check."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _STEPS_FILTER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return nodes.Filter(node, _SIZE_FILTER, [], [], None, None, lineno=node.lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with a step budget and size limits; render templates with `render`."""

    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])
    concat = staticmethod(_join)

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.filters = {name: _size_checked(f) for name, f in self.filters.items()}
        self.filters[_STEPS_FILTER] = pass_context(lambda context, items: _counted(_budget(context), items))
        self.filters[_SIZE_FILTER] = _check_size

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Bounded().visit(super()._parse(source, name, filename))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget(__context)
        budget.tick()
        if isinstance(__obj, LoopContext) and args:  # `loop(children)` of a recursive loop
            args = (_counted(budget, args[0]), *args[1:])
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _budget(context).tick()
        _check_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right))


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `*`, `+` and `**` whose result would be too large, before computing it."""
    sizes = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
    ints = [x for x in (left, right) if isinstance(x, int)]
    if operator == "*" and len(sizes) == 1 and len(ints) == 1:
        size = sizes[0] * ints[0]
    elif operator == "+" and len(sizes) == 2:
        size = sum(sizes)
    elif operator in ("*", "**") and len(ints) == 2:
        bits = left.bit_length() * (max(right, 0) if operator == "**" else 1) + right.bit_length()
        if bits > MAX_INT_BITS:
            raise TemplateError(f"the chat template computes an integer of about {bits} bits")
        return
    else:
        return
    if size > MAX_TEXT:
        raise TemplateError(f"the chat template builds a value of {size} items (at most {MAX_TEXT})")


def _size_checked(f):
    @functools.wraps(f)  # keeps jinja's pass_context/pass_eval_context marks
    def checked(*args: Any, **kwargs: Any) -> Any:
        return _check_size(f(*args, **kwargs))

    return checked


def render(template, variables: dict[str, Any]) -> str:
    """The text of `template` (compiled by a BoundedSandbox) for `variables`; any failure, a limit
    exceeded included, is a FlashtreeError."""
    items = sum(len(variables.get(k) or ()) for k in ("messages", "tools"))
    budget = _Budget(MAX_STEPS + STEPS_PER_ITEM * items)
    try:
        return _join(template.generate(**variables, **{_BUDGET: budget}))
    except FlashtreeError:
        raise
    except TemplateError as e:
        raise FlashtreeError(f"chat template: {e}") from None
    except (
        Exception
    ) as e:  # whatever else the template's own code raises: ZeroDivisionError, RecursionError, ...
        raise FlashtreeError(f"chat template failed: {type(e).__name__}: {e}") from None
