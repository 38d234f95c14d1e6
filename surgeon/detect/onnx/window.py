"""Between a projection and its core: which columns of the projection each role and head owns (Split,
Slice, Gather, Reshape to (..., heads, head_dim)), followed forward from the projection's output."""

from __future__ import annotations

from .found import Pending, Proj
from .graph import Fail, Graph


class WindowWalk:
    """The columns of a projection's output that reach one operand of the core (ProjectionWalk's last step)."""

    g: Graph

    def _window(self, p: Proj, path: list[tuple[int, str, str]], role: str) -> None:
        """Walk forward from the projection to the core and read what the ops say about its output.

        While the last axis holds the projection's features: a Split/Slice of it narrows the
        columns of this role (fused QKV), an Add of a 1-D initializer is the bias. The first
        Reshape that splits the features into (a, b) is either the head split (heads, head_dim),
        or, when a Gather/Split later picks one index of ``a`` (``unflatten(-1, (3, E))`` of
        nn.MultiheadAttention's packed projection), a choice of one chunk of b features; the
        axis of ``a`` is followed through Unsqueeze/Transpose/Squeeze to tell which.
        """
        g = self.g
        pending: Pending | None = None  # a Reshape that split the features, not yet explained
        heads_shape: list[int | None] | None = None
        for n, t_in, t_out in path:
            node = g.nodes[n]
            op = node.op_type
            if heads_shape is not None:
                # after the head split, only the head_dim axis may be cut (rotary halves)
                if op in ("Split", "Slice", "Gather") and not self._cuts_last_axis(n, t_in):
                    raise Fail(
                        f"{role} is cut by {g.describe(n)} after its head split, a QKV packing surgeon does not follow"
                    )
                continue
            if pending is not None:
                if op == "Reshape":
                    heads_shape = pending.shape
                elif self._pending_step(pending, p, n, t_in, t_out, role):
                    # a chunk was chosen: the last axis holds features again, or (timm) the chunk's heads
                    heads_shape, pending = pending.heads, None
                continue
            if op == "Add" and p.bias is None:
                other = [i for i in node.input if i != t_in]
                bias, via = g.initializer(other[0] if other else "")
                if bias is not None and list(g.inits[bias].dims) == [p.width]:
                    p.bias, p.bias_base, p.bias_nodes = bias, p.base, {n, *via}
                continue
            if op == "Split":
                self._split(p, n, t_in, t_out, role)
            elif op == "Slice":
                self._slice(p, n, t_in, role)
            elif op == "Gather":
                raise Fail(f"{role} is selected by {g.describe(n)}, a QKV packing surgeon does not follow")
            elif op == "Reshape":
                found = g.target_shape(node.input[1])
                shape, complete = found if found else ([], False)
                if shape and shape[-1] == p.width:
                    continue  # merges or splits leading axes only
                pending = _feature_split(shape, len(shape) if complete else g.rank(t_out), p.width)
            elif op == "Transpose":
                perm = g.attr(n, "perm")
                if perm is None or perm[-1] != len(perm) - 1:
                    raise Fail(f"{role} has its feature axis moved by {g.describe(n)} before any head split")
        if pending is not None:
            heads_shape = pending.shape
        if heads_shape is not None:
            _read_head_split(p, heads_shape, role)

    def _pending_step(self, pending: Pending, p: Proj, n: int, t_in: str, t_out: str, role: str) -> bool:
        """Follow the first axis of a feature split through one op; True when it picked one chunk."""
        g = self.g
        node = g.nodes[n]
        op = node.op_type
        axis, rank = pending.axis, pending.rank
        if op in ("Unsqueeze", "Squeeze"):
            axes = g.ints(node.input[1]) if len(node.input) > 1 and node.input[1] else list(g.attr(n, "axes", []))
            if axis is None or rank is None or not axes:
                pending.axis = pending.rank = None
                return False
            if op == "Unsqueeze":
                rank += len(axes)
                for a in sorted(a % rank for a in axes):
                    axis += a <= axis
            else:
                norm = [a % rank for a in axes]
                if axis in norm:  # a split into (1, features): nothing to choose
                    pending.axis = None
                axis -= sum(a < axis for a in norm)
                rank -= len(axes)
            pending.axis, pending.rank = (axis if pending.axis is not None else None), rank
        elif op == "Transpose" and axis is not None:
            perm = g.attr(n, "perm") or list(range(rank or 0))[::-1]
            pending.axis = perm.index(axis) if axis < len(perm) else None
        elif op in ("Gather", "Split", "Slice"):
            if op == "Slice":
                cut = g.ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            else:
                cut = [g.attr(n, "axis", 0)]
            on_pending = axis is not None and rank is not None and cut is not None and axis in [a % rank for a in cut]
            if on_pending:
                return self._pick_chunk(pending, p, n, t_out, role)
            if on_pending or (op != "Slice" and not self._cuts_last_axis(n, t_in)):
                raise Fail(f"{role} is cut by {g.describe(n)}, a QKV packing surgeon does not follow")
        return False

    def _pick_chunk(self, pending: Pending, p: Proj, n: int, t_out: str, role: str) -> bool:
        """A Gather of one index, or a Split into ones, of the first axis of a feature split."""
        g = self.g
        node = g.nodes[n]
        count, size = pending.shape[-2:] if len(pending.shape) > 1 else (None, None)
        if node.op_type == "Gather":
            index = g.value(node.input[1])
            picked = int(index) if index is not None and index.ndim == 0 else None
        elif node.op_type == "Slice":  # one index of the chunk axis, [i, i + 1) (unbind by the dynamo exporter)
            picked = self._slice_one(pending, n, count)
        else:
            sizes = g.ints(node.input[1]) if len(node.input) > 1 and node.input[1] else g.attr(n, "split")
            picked = list(node.output).index(t_out) if not sizes or set(sizes) == {1} else None
        if picked is None or not isinstance(size, int) or not isinstance(count, int) or count * size != p.width:
            raise Fail(f"{role} is selected by {g.describe(n)} in a way surgeon does not follow")
        p.base += (picked % count) * size
        p.width = size
        return True

    def _slice_one(self, pending: Pending, n: int, count: int | None) -> int | None:
        g = self.g
        node = g.nodes[n]
        starts, ends, axes = g.ints(node.input[1]), g.ints(node.input[2]), g.ints(node.input[3])
        steps = g.ints(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if (
            starts is None
            or ends is None
            or axes is None
            or pending.rank is None
            or pending.axis is None
            or not isinstance(count, int)
        ):
            return None
        i = [a % pending.rank for a in axes].index(pending.axis)
        if steps and steps[i] != 1:
            return None
        start = starts[i] + count if starts[i] < 0 else starts[i]
        end = min(count, ends[i] + count if ends[i] < 0 else ends[i])
        return start if 0 <= start and end - start == 1 else None

    def _cuts_last_axis(self, n: int, t_in: str) -> bool:
        g = self.g
        node = g.nodes[n]
        if node.op_type == "Slice":
            axes = g.ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            if axes is None:
                return False
        else:
            axes = [g.attr(n, "axis", 0)]
        rank = g.rank(t_in)
        return all(a == -1 or (rank is not None and a == rank - 1) for a in axes)

    def _split(self, p: Proj, n: int, t_in: str, t_out: str, role: str) -> None:
        g = self.g
        node = g.nodes[n]
        axis = g.attr(n, "axis", 0)
        sizes = g.ints(node.input[1]) if len(node.input) > 1 and node.input[1] else g.attr(n, "split")
        if not sizes:
            count = g.attr(n, "num_outputs") or len(node.output)
            sizes = [p.width // count] * count if p.width % count == 0 else None
        rank = g.rank(t_in)
        on_features = (
            axis == -1
            or (rank is not None and axis == rank - 1)
            or (rank is None and sizes is not None and sum(sizes) == p.width)
        )
        if not on_features:
            raise Fail(f"{role} goes through {g.describe(n)}, which splits an axis other than the features")
        if not sizes or sum(sizes) != p.width:
            raise Fail(f"cannot read the split sizes of {g.describe(n)} for the {p.width} features of {role}")
        k = list(node.output).index(t_out)
        p.base += sum(sizes[:k])
        p.width = sizes[k]

    def _slice(self, p: Proj, n: int, t_in: str, role: str) -> None:
        g = self.g
        node = g.nodes[n]
        starts, ends = g.ints(node.input[1]), g.ints(node.input[2])
        axes = g.ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        steps = g.ints(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if starts is None or ends is None:
            raise Fail(f"{role} goes through {g.describe(n)} whose bounds are not constant")
        rank = g.rank(t_in)
        axes = axes if axes is not None else list(range(len(starts)))
        last = [i for i, a in enumerate(axes) if a == -1 or (rank is not None and a == rank - 1)]
        if not last:
            if rank is None:
                raise Fail(f"cannot tell which axis {g.describe(n)} cuts on the way to {role}")
            return  # cuts batch or sequence: the projection's columns are unchanged
        i = last[0]
        if steps and steps[i] != 1:
            raise Fail(f"{role} goes through {g.describe(n)} with step {steps[i]}")
        start, end = starts[i], ends[i]
        start = max(0, start + p.width if start < 0 else start)
        end = min(p.width, end + p.width if end < 0 else end)
        p.base += start
        p.width = end - start


def _feature_split(shape: list[int | None], rank: int | None, width: int) -> Pending:
    """The Reshape that splits a projection's ``width`` features into (..., a, b), or at once into
    (..., 3, heads, head_dim) (timm's fused qkv: a chunk of 3 is picked later, its heads split already)."""
    last3 = shape[-3:] if len(shape) >= 3 else []
    if len(last3) == 3 and all(isinstance(x, int) and x > 1 for x in last3) and last3[0] * last3[1] * last3[2] == width:  # type: ignore[operator]
        return Pending([*shape[:-3], last3[0], last3[1] * last3[2]], rank - 3 if rank else None, rank, last3[1:])  # type: ignore[operator]
    return Pending(shape, rank - 2 if rank else None, rank)


def _read_head_split(p: Proj, shape: list[int | None], role: str) -> None:
    """(heads, head_dim) of a projection from the shape of the Reshape that splits its features."""
    d = shape[-1] if shape and isinstance(shape[-1], int) and shape[-1] > 0 else None
    h = shape[-2] if len(shape) > 1 and isinstance(shape[-2], int) and shape[-2] > 0 else None
    if d and p.width % d == 0:
        p.head_dim, p.heads = d, p.width // d
        if h and h != p.heads:
            raise Fail(f"{role} has {p.width} features but is reshaped to (..., {h}, {d})")
    elif h and p.width % h == 0 and not d:
        p.heads, p.head_dim = h, p.width // h
