"""ONNX initializers that the chosen projections share with other nodes: refuse, or give them a copy.

An initializer the plan changes may also be read by nodes the plan leaves alone (an exporter merges
equal tensors into one). Changing it would change those too, so :func:`plan_sharing` refuses, or, where
exact, has the chosen projections' nodes read a new copy of it: a :class:`SharedCopy` of the write plan,
which ``OnnxWeights.save`` writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SharedInitializerError, opt
from ..vocab.change import PlanView
from .onnx_checks import aliased, refuse_aliased
from .write_plan import SharedCopy, WritePlan

if TYPE_CHECKING:
    from ..vocab.detection import Detection, GraphFacts, GraphView
    from .onnx_model import OnnxModel

# nodes that pass an initializer's values on to others (a copy read through them must reach only the chosen projections)
PASS_ON = frozenset(
    (
        "Identity",
        "Transpose",
        "Cast",
        "CastLike",
        "Reshape",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Split",
        "Slice",
        "Gather",
        "Concat",
        "Expand",
        "Tile",
        "DequantizeLinear",
    )
)


def plan_sharing(weights: OnnxModel, plan: PlanView, detection: Detection) -> WritePlan:
    """Refuse to change an initializer that nodes outside the plan read too (``detection.graph``:
    the graph facts of surgeon.detect.onnx), unless the chosen projections can read a copy of their
    own. Zeroing a bias that is all zero bytes already (an untrained model's biases, which exporters
    merge into one initializer with every other zero vector of that size) leaves it as it is: no
    change, so no conflict. Returns the notes and the copies."""
    found = detection.graph
    if found is None:
        return WritePlan()
    weight_names = {c.projection.weight.tensor for c in plan.changes}
    allowed = _chosen_readers(plan, found)
    refuse_aliased(
        plan.tensors(),
        aliased(
            weights.folder,
            [(n, st.file, st.offset, st.length) for n, st in weights.stored.items() if st.file != weights.path.name],
        ),
    )
    copies: dict[str, SharedCopy] = {}
    notes: list[str] = []
    unchanged: list[str] = []
    behind = unchosen_readers(plan, detection)
    for name in plan.tensors():
        shared = _other_readers(name, allowed.get(name, set()), behind.get(name, {}), found)
        if shared is None:
            continue
        if name not in weight_names and weights.all_zero_bytes(name):
            unchanged.append(name)
            continue
        what, leak = shared
        notes.append(_share(weights, plan, copies, name, what, leak, allowed.get(name, set()), found.graph))
    return WritePlan(tuple(notes + _already_zero(unchanged)), tuple(copies.values()))


def _chosen_readers(plan: PlanView, found: GraphFacts) -> dict[str, set[int]]:
    """initializer -> the nodes through which the chosen projections read it (biases only when zeroed)."""
    allowed: dict[str, set[int]] = {}
    for change in plan.changes:
        proj, users = change.projection, found.users[(change.block.module, change.role)]
        allowed.setdefault(proj.weight.tensor, set()).update(users["weight"])
        if plan.options.bias_policy != "keep" and proj.bias is not None:  # zeroed, or SOURCE's (a restore)
            allowed.setdefault(proj.bias.tensor, set()).update(users["bias"])
    return allowed


def _other_readers(
    name: str, allowed: set[int], behind: dict[str, set[int]], found: GraphFacts
) -> tuple[list[str], str | None] | None:
    """Who reads initializer ``name`` besides the chosen projections (``allowed``: their nodes;
    ``behind``: the unchosen projections' nodes that read it), as labels, and where one of the chosen
    nodes passes it on to others (None: none does); None when no one else reads it."""
    graph = found.graph
    others = [n for n in graph.consumers.get(name, []) if n not in allowed]
    # a node on the way to a chosen projection (an Identity the exporter put there) that feeds another too
    through = [label for label, nodes in behind.items() if nodes & allowed]
    leak = None if others or through else passed_on(name, allowed, graph)
    if not others and not through and not leak and name not in graph.outputs:
        return None
    what = through + [
        f"block {found.owners[n][0]} ({found.owners[n][1]})" if n in found.owners else graph.describe(n) for n in others
    ]
    return list(dict.fromkeys(what)) + (["a graph output"] if name in graph.outputs else []), leak


def _share(
    weights: OnnxModel,
    plan: PlanView,
    copies: dict[str, SharedCopy],
    name: str,
    what: list[str],
    leak: str | None,
    readers: set[int],
    graph: GraphView,
) -> str:
    """The note for a shared initializer the chosen projections (``readers``) get a copy of (made in
    ``copies``); a SharedInitializerError where they cannot have one."""
    if leak:  # read only by the chosen projections' nodes, but one of those passes it on to others
        raise SharedInitializerError(
            f"initializer {name!r} is read through nodes that feed more than the projections chosen ({leak}), "
            "so changing it would change those too; leave those projections out"
        )
    shown = ", ".join(what[:3]) + (f" and {len(what) - 3} more" if len(what) > 3 else "")
    why = _copy(weights, copies, name, readers, graph)
    if why is None:
        copy = copies[name].copy
        return f"initializer {name!r} is shared with {shown}: the chosen projections read a new copy of it, {copy!r}, and the others keep the original"
    is_bias = any(c.projection.bias is not None and c.projection.bias.tensor == name for c in plan.changes)
    fix = f"select them too ({opt('layers')}/{opt('stack')}/{opt('attention')})" + (
        f", or keep the biases ({opt('bias', 'keep')})" if is_bias else ""
    )
    raise SharedInitializerError(
        f"initializer {name!r} is shared: besides the projections chosen, {shown} read{'s' if len(what) == 1 else ''} it, "
        f"so changing it would change them too, and the chosen ones cannot have a copy of their own ({why}); {fix}, or leave those projections out"
    )


def _already_zero(unchanged: list[str]) -> list[str]:
    """The note on shared biases left as they are because they are zero already."""
    if not unchanged:
        return []
    shown = ", ".join(unchanged[:3]) + (f" and {len(unchanged) - 3} more" if len(unchanged) > 3 else "")
    return [
        f"bias initializer{'s' if len(unchanged) > 1 else ''} {shown}, shared with other nodes, "
        f"{'are' if len(unchanged) > 1 else 'is'} zero already: zeroing the chosen heads' biases leaves {'them' if len(unchanged) > 1 else 'it'} as {'they were' if len(unchanged) > 1 else 'it was'}"
    ]


def _copy(
    weights: OnnxModel, copies: dict[str, SharedCopy], name: str, readers: set[int], graph: GraphView
) -> str | None:
    """Give the chosen projections' nodes (``readers``) their own copy of initializer ``name``:
    None when that is exact (recorded in ``copies``), else why not. Exact: the nodes that read
    ``name`` directly are renamed, and whatever passes its value on (Identity, Transpose, Split, ...)
    feeds only the chosen projections."""
    direct = [n for n in graph.consumers.get(name, []) if n in readers]
    if len(weights.layout.nodes) != len(graph.nodes):
        return "its nodes could not be located in the file"
    if not direct:
        return "no node of theirs reads it directly"
    for n in direct:
        if name not in graph.nodes[n].input:
            return f"{graph.describe(n)} reads it inside a subgraph"
    leak = passed_on(name, readers, graph)
    if leak:
        return leak
    extra = sum(weights.tensors[n].nbytes for n in copies) + weights.tensors[name].nbytes
    if weights.layout.size + extra >= 2**31 - 2**20:
        return "the copy would take the .onnx past protobuf's 2 GiB"
    made = {c.copy for c in copies.values()}
    copy, i = f"{name}.surgeon_copy", 1
    while copy in weights.names or copy in graph.inits or copy in made:
        i += 1
        copy = f"{name}.surgeon_copy{i}"
    copies[name] = SharedCopy(name, copy, tuple(direct))
    return None


def passed_on(name: str, readers: set[int], graph: GraphView) -> str | None:
    """Where a node among ``readers`` that passes initializer ``name`` on (Identity, Transpose,
    Split, ...) feeds a node outside them or a graph output, so that changing what it reads changes
    more than the chosen projections; None where it does not."""
    todo = [n for n in graph.consumers.get(name, []) if n in readers]
    seen = set(todo)
    while todo:
        n = todo.pop()
        if graph.nodes[n].op_type not in PASS_ON:
            continue
        for out in graph.nodes[n].output:
            if out in graph.outputs:
                return f"{graph.describe(n)} passes it on to a graph output"
            for c in graph.consumers.get(out, []):
                if c not in readers:
                    return f"{graph.describe(n)} passes it on to {graph.describe(c)} too"
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
    return None


def unchosen_readers(plan: PlanView, detection: Detection) -> dict[str, dict[str, set[int]]]:
    """initializer -> {"block X (role)": the nodes through which that unchosen projection reads it}."""
    found = detection.graph
    assert found is not None  # plan_sharing's caller: it returns before this for a detection without a graph
    chosen = {(c.block.module, c.role) for c in plan.changes}
    out: dict[str, dict[str, set[int]]] = {}
    for block in detection.blocks:
        for proj in block.projections:
            users = found.users.get((block.module, proj.role))
            if (block.module, proj.role) in chosen or users is None:
                continue
            label = f"block {block.label} ({proj.role})"
            out.setdefault(proj.weight.tensor, {}).setdefault(label, set()).update(users["weight"])
            if proj.bias is not None:
                out.setdefault(proj.bias.tensor, {}).setdefault(label, set()).update(users["bias"])
    return out
