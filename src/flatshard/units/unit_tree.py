"""Stage-3 units: the module subtrees whose params are gathered and freed together.

The reasoning is in the notes below ([Note: units], ...)."""

# [Note: units]
#
# ``find_units(module, units)`` picks the unit modules: those of the given classes, or those
# for which the predicate ``(qualified_name, module) -> bool`` holds; by default the children
# of every ``nn.ModuleList`` (the usual list of transformer blocks), or, for a Hugging Face
# model, the modules whose class its ``_no_split_modules`` names (its decoder layers) where
# there are any. The root module is always
# a unit too: it owns every param outside the others. Units may nest.
#
# A param belongs to exactly one unit: the innermost unit that contains *every* module
# registering it, along every path to it (so a param tied between two blocks, or registered by
# a module that two blocks share, belongs to their common ancestor, which is full whenever
# either block runs). Units are listed in module pre-order (root first).
# At stage 3 the params are handed to the layout grouped by unit (in that order, registration
# order within a unit), so each unit's params are contiguous in the buffer and the root's
# few params form one bucket rather than one at each end; ``ParamSpec.unit`` carries the
# unit's index, so a bucket never holds params of two units.
#
# [Note: merged units]
#
# Each unit costs a fixed price per step whatever its size: its hooks, a gather in forward
# and one in backward, a reduce-scatter, and the schedule's bookkeeping. On a model of many
# small blocks that price, not the bytes, sets the step time. So ``merge_units`` joins
# consecutive small units into one unit of several modules, gathered, freed and reduced
# together, while their params (full, in the dtype they are gathered in) fit in
# ``unit_bytes``. Invariants:
#
# * Only *leaf* units (no unit inside them) that are *siblings* (the same enclosing unit) and
#   adjacent in pre-order merge; the root never does. So a merged unit's modules are
#   disjoint subtrees that run one after the other, and every enclosing unit stays one
#   module.
# * A merged unit never holds more than ``unit_bytes``, unless it is a single unit that
#   alone is larger: the peak of full params ([Note: stage-3 memory]) stays bounded by the
#   larger of ``unit_bytes`` and the largest unit.
# * Indices stay in pre-order of each unit's first module, so the root is still 0 and a
#   param's unit is the merged unit of the unit it had.
# * ``unit_bytes=None`` merges nothing (a unit per module, as before merging existed).
# * A merged unit is gathered for the backward of each member that holds some of its params,
#   not of a member that holds none (an activation in a ModuleList): that member's output
#   grad comes after the others' grads have freed the unit, and gathering it again there,
#   only on the ranks that ran every member (a layer dropped on some ranks), put the ranks
#   out of step.

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from flatshard.planner.offload import unit_label

UnitSpec = Iterable[type[nn.Module]] | Callable[[str, nn.Module], bool] | None


@dataclass(frozen=True)
class Unit:
    index: int  # position in pre-order; 0 is the root
    names: tuple[str, ...]  # qualified module names ("" for the root)
    modules: tuple[nn.Module, ...]  # one, or several merged siblings ([Note: merged units])
    parent: int | None  # the enclosing unit's index

    @property
    def name(self) -> str:
        """The module's name, or the first and last of merged ones ("blocks.0..blocks.5")."""
        return unit_label(self.names)


def find_units(module: nn.Module, units: UnitSpec = None) -> list[Unit]:
    """The unit modules of ``module`` in pre-order, root first (see [Note: units])."""
    match = _matcher(module, units)
    found = [Unit(0, ("",), (module,), None)]
    enclosing: dict[int, int] = {id(module): 0}  # module id -> innermost unit containing it
    for name, sub in module.named_modules():
        if sub is module:
            continue
        parent_name = name.rpartition(".")[0]
        parent = module.get_submodule(parent_name) if parent_name else module
        outer = enclosing[id(parent)]
        if match(name, sub):  # named_modules lists a shared module once
            found.append(Unit(len(found), (name,), (sub,), outer))
            enclosing[id(sub)] = len(found) - 1
        else:
            enclosing.setdefault(id(sub), outer)
    return found


def _matcher(root: nn.Module, units: UnitSpec) -> Callable[[str, nn.Module], bool]:
    if units is None:
        layers = _no_split_names(root)
        if any(type(m).__name__ in layers for m in root.modules()):
            return lambda name, m: type(m).__name__ in layers
        children = {id(c) for m in root.modules() if isinstance(m, nn.ModuleList) for c in m}
        return lambda name, m: id(m) in children
    if callable(units) and not isinstance(units, type):
        return lambda name, m: bool(units(name, m))
    classes = (units,) if isinstance(units, type) else tuple(units)  # (one class, or several)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"units must be nn.Module classes or a predicate (name, module) -> bool; got {cls!r}"
            )
    return lambda name, m: isinstance(m, classes)


def module_units(units: list[Unit]) -> dict[int, int]:
    """``{id(module): index of the innermost unit containing it}`` for every module. A module
    reachable along several paths (one shared by two blocks) belongs to the innermost unit
    that contains all of them, which is full whenever any of them runs: otherwise one block
    would read the other's placeholders ([Note: placeholders] in ``units/placeholder.py``)."""
    index_of = {name: unit.index for unit in units for name in unit.names}
    found: dict[int, set[int]] = {}
    for name, sub in units[0].modules[0].named_modules(remove_duplicate=False):
        found.setdefault(id(sub), set()).add(_innermost(index_of, name))
    return {key: _common_ancestor(units, owners) for key, owners in found.items()}


def _innermost(index_of: dict[str, int], name: str) -> int:
    """The unit of the module at ``name``: the unit whose name is its longest prefix."""
    while name not in index_of:
        name = name.rpartition(".")[0]
    return index_of[name]


def merge_units(
    units: list[Unit], unit_of: dict[int, int], nbytes: list[int], unit_bytes: int | None
) -> tuple[list[Unit], dict[int, int]]:
    """Join adjacent small sibling leaf units ([Note: merged units]); ``nbytes[i]``: the bytes
    of unit ``i``'s params. Returns the units and ``{id(param): unit index}`` after merging."""
    if unit_bytes is None:
        return units, unit_of
    inner = {u.parent for u in units}
    groups: list[list[Unit]] = []
    total = 0
    for unit in units:
        last = groups[-1][-1] if groups else None
        mergeable = unit.index not in inner and unit.parent is not None
        if (
            last is not None
            and mergeable
            and last.index not in inner
            and last.parent == unit.parent
            and total + nbytes[unit.index] <= unit_bytes
        ):
            groups[-1].append(unit)
            total += nbytes[unit.index]
        else:
            groups.append([unit])
            total = nbytes[unit.index]
    new_index = {u.index: i for i, group in enumerate(groups) for u in group}
    merged = [
        Unit(
            i,
            tuple(n for u in group for n in u.names),
            tuple(m for u in group for m in u.modules),
            None if group[0].parent is None else new_index[group[0].parent],
        )
        for i, group in enumerate(groups)
    ]
    return merged, {key: new_index[u] for key, u in unit_of.items()}


def _no_split_names(root: nn.Module) -> set[str]:
    """The class names a Hugging Face model (the root or the first module inside it that is
    one) says must not be split across devices: its transformer layers."""
    for m in root.modules():
        names = getattr(m, "_no_split_modules", None)
        if names:
            return set(names)
    return set()


def assign_params(module: nn.Module, units: list[Unit]) -> dict[int, int]:
    """``{id(param): unit index}`` for every param of ``module`` (see [Note: units])."""
    unit_of_module = module_units(units)
    owners: dict[int, set[int]] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(unit_of_module[id(sub)])
    return {key: _common_ancestor(units, found) for key, found in owners.items()}


def outer_blocks(module: nn.Module) -> list[nn.Module]:
    """The default units directly inside the root (the outermost transformer blocks), in
    pre-order: where a stage-1/2 forward waits for the params gathered after a step
    ([Note: param gather] in ``engine/param_gather.py``)."""
    units = find_units(module)
    return [u.modules[0] for u in units[1:] if u.parent == 0]


def entry_points(units: list[Unit]) -> list[nn.Module]:
    """The modules of the root unit's own (the root and its descendants outside every other
    unit) that hold params in their subtree, root first: where a forward that reads params can
    begin ([Note: forward entry points] in ``units/unshard.py``)."""
    root = units[0].modules[0]
    others = {id(m) for unit in units[1:] for m in unit.modules}
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen or next(module.parameters(), None) is None:
            continue
        seen.add(id(module))
        found.append(module)
        stack.extend(reversed([c for c in module.children() if id(c) not in others]))
    return found


def _common_ancestor(units: list[Unit], indices: set[int]) -> int:
    def chain(index: int | None) -> list[int]:
        out = []
        while index is not None:
            out.append(index)
            index = units[index].parent
        return out

    chains = [chain(i) for i in indices]
    common = set(chains[0]).intersection(*chains[1:])
    return next(i for i in chains[0] if i in common)  # the deepest shared one
