"""A split step's part compiled on only the arrays it reads, handing back unchanged the ones it
only passes through.

Every part of a split step (`split_step.py`) takes the whole parameter tuple and the whole device
state, because the step functions are written against them, though (with an EAGLE3 drafter, for
instance) the draft part passes the target's KV pools through untouched, and of the target's
weights the draft and verify parts read only the embedding. A call costs the host time per
argument array, most of all per donated one, and the host launches a constrained step's parts
while the device waits for them (bench/README.md, "Structured output"). So each part is
traced once to a jaxpr, and compiled as a function of the input arrays its equations read: those
it updates are donated; an output that is one of its inputs unchanged is not an output of the
program at all, the caller hands the input array back in its place.

`lower(fn, args, ...)` -> a `SlimLowered`, whose `compile` gives a `SlimPart` called with the
original arguments and returning the original output tree. Its `Plan` (plain data and pytree
definitions) travels with the executable through the executable cache.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.extend.core import Literal, jaxpr_as_fun
from jax.sharding import Sharding


def _none_leaf(x) -> bool:
    return x is None


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a part's original arguments and outputs map onto its compiled program's.

    Input leaves are numbered as `jax.tree.flatten(args)` numbers them; output positions as the
    output tree flattened with None as a leaf (`out_tree`), so that a position can hold None."""

    in_tree: jax.tree_util.PyTreeDef  # of the argument tuple
    in_avals: tuple  # ((shape, dtype), ...) per input leaf: `args_info`
    arg_leaves: tuple  # leaves per positional argument
    read: tuple  # input leaves the program takes, not donated
    donated: tuple  # input leaves the program takes and donates (it writes them)
    out_tree: jax.tree_util.PyTreeDef  # of the output, None a leaf
    computed: tuple  # output positions the program returns, in its order
    passed: tuple  # ((output position, input leaf), ...) handed back unchanged


def _array_positions(out_shape) -> list:
    """The output positions (None a leaf) that hold arrays, in the order a jaxpr returns them."""
    return [k for k, x in enumerate(jax.tree.leaves(out_shape, is_leaf=_none_leaf)) if x is not None]


def _leaf_shardings(out_shardings, out_shape) -> list:
    """One sharding (or None: unspecified) per array of out_shape, from a prefix tree of them."""
    leaves = []

    def per_leaf(s, sub):
        leaves.extend([s] * len(jax.tree.leaves(sub)))

    jax.tree.map(per_leaf, out_shardings, out_shape, is_leaf=lambda x: x is None or isinstance(x, Sharding))
    return leaves


def make_plan(fn, args: tuple, donate_argnums: tuple) -> tuple[Plan, object, object]:
    """(plan, closed jaxpr, output shapes) of fn traced on args (arrays or shapes)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    leaves, in_tree = jax.tree.flatten(args)
    counts = tuple(len(jax.tree.leaves(a)) for a in args)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    donatable = {i for k in donate_argnums for i in range(starts[k], starts[k] + counts[k])}
    jaxpr = closed.jaxpr
    index = {v: i for i, v in enumerate(jaxpr.invars)}
    used = {index[v] for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, Literal) and v in index}
    out_tree = jax.tree.structure(out_shape, is_leaf=_none_leaf)
    arrays = _array_positions(out_shape)
    assert len(arrays) == len(jaxpr.outvars), (len(arrays), len(jaxpr.outvars))
    computed, passed = [], []
    for k, v in zip(arrays, jaxpr.outvars):
        if not isinstance(v, Literal) and v in index:
            passed.append((k, index[v]))
        else:
            computed.append(k)
    handed_back = {i for _, i in passed}
    donated = tuple(sorted(i for i in used if i in donatable and i not in handed_back))
    read = tuple(sorted(used - set(donated)))
    plan = Plan(in_tree=in_tree, in_avals=tuple((tuple(x.shape), x.dtype) for x in leaves), arg_leaves=counts,
                read=read, donated=donated, out_tree=out_tree, computed=tuple(computed), passed=tuple(passed))
    return plan, closed, out_shape


def lower(fn, args: tuple, *, donate_argnums: tuple, out_shardings) -> SlimLowered:
    """fn(*args) lowered as its slim program: what `jax.jit(fn, donate_argnums=...,
    out_shardings=...).lower(*args)` would give, less the arrays it does not read or write."""
    plan, closed, out_shape = make_plan(fn, args, donate_argnums)
    run = jaxpr_as_fun(closed)
    n = len(plan.in_avals)
    arrays = _array_positions(out_shape)

    def slim(read, donated):
        full = [None] * n  # the arrays the equations never read stay None
        for i, x in zip(plan.read, read):
            full[i] = x
        for i, x in zip(plan.donated, donated):
            full[i] = x
        by_position = dict(zip(arrays, run(*full)))
        return tuple(by_position[k] for k in plan.computed)

    leaves = jax.tree.leaves(args)
    sharding_at = dict(zip(arrays, _leaf_shardings(out_shardings, out_shape)))
    lowered = jax.jit(slim, donate_argnums=(1,), keep_unused=True,
                      out_shardings=tuple(sharding_at[k] for k in plan.computed)).lower(
        tuple(leaves[i] for i in plan.read), tuple(leaves[i] for i in plan.donated))
    return SlimLowered(lowered, plan)


class SlimLowered:
    """A lowered slim part; `compile` as a `jax.stages.Lowered`'s."""

    def __init__(self, lowered, plan: Plan):
        self.lowered, self.plan = lowered, plan

    def compile(self, compiler_options=None) -> SlimPart:
        return SlimPart(self.lowered.compile(compiler_options), self.plan)


class SlimPart:
    """A compiled slim part, called as the original function: fn(*args) -> its output tree."""

    def __init__(self, compiled, plan: Plan):
        self.compiled, self.plan = compiled, plan
        self._first = (None, ())  # the first argument (the parameters) and its leaves, kept
        shapes = [jax.ShapeDtypeStruct(s, d) for s, d in plan.in_avals]
        self.args_info = (plan.in_tree.unflatten(shapes), {})  # shapes of the original arguments

    def memory_analysis(self):
        return self.compiled.memory_analysis()

    def _leaves(self, args: tuple) -> list:
        first, kept = self._first
        if args[0] is not first:  # the same parameter tuple every step: flattened once
            kept = tuple(jax.tree.leaves(args[0]))
            self._first = (args[0], kept)
        leaves = list(kept)
        for a in args[1:]:
            leaves.extend(jax.tree.leaves(a))
        return leaves

    def __call__(self, *args):
        p = self.plan
        if len(args) != len(p.arg_leaves):
            raise TypeError(f"slim part takes {len(p.arg_leaves)} arguments, got {len(args)}")
        leaves = self._leaves(args)
        if len(leaves) != len(p.in_avals):
            raise TypeError(f"slim part takes {len(p.in_avals)} arrays, got {len(leaves)}")
        outs = self.compiled(tuple(leaves[i] for i in p.read), tuple(leaves[i] for i in p.donated))
        full = [None] * p.out_tree.num_leaves
        for k, x in zip(p.computed, outs):
            full[k] = x
        for k, i in p.passed:
            full[k] = leaves[i]
        return p.out_tree.unflatten(full)
