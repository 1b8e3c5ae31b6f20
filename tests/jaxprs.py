"""Walking a jaxpr, for tests that assert what a traced program does (its primitives, its loops)."""

from collections.abc import Iterator

from jax.extend.core import Jaxpr, JaxprEqn


def inner_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """The jaxprs in one equation's parameters: a jit's, a custom rule's, a loop's body."""
    for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
            inner = getattr(sub, "jaxpr", sub)
            if isinstance(inner, Jaxpr):
                yield inner


def equations(jaxpr: Jaxpr) -> Iterator[JaxprEqn]:
    """Every equation of a jaxpr and of the jaxprs inside its equations, nested included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in inner_jaxprs(eqn):
            yield from equations(inner)
