"""Linear layers as the frontends spell them, for passes that rewrite weights.

aot_autograd writes ``x @ W^T (+ b)`` as ``aten.t(W)`` -> ``aten.mm(view(x, [M, K]), t)``
(or ``aten.addmm(b, ...)``) -> a view back to ``[..., N]``; torch.export keeps
``aten.linear``. ``match_linear`` reads all of them into one ``Linear`` record, so the
gated-MLP, QKV-merge and INT4 passes share one notion of "a linear against a constant weight".
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt import ir, lazy_weights
from graphopt.rewrite import GEMM_OPS, VIEW_OPS, expect, expect_op, is_op, scalar, val

aten = torch.ops.aten



@dataclass
class Linear:
    """``y = x @ weight^T + bias`` as found in the graph."""

    gemm: fx.Node  # aten.mm, aten.addmm or aten.linear
    x2d: fx.Node  # what the GEMM reads: x itself, or aot's flattening view(x, [M, K])
    weight: fx.Node  # [N, K], nn.Linear layout
    bias: fx.Node | None  # [N]
    out: fx.Node  # what the model reads: view(gemm, [..., N]) or the GEMM itself

    @property
    def width(self) -> int:
        return val(self.weight).shape[0]

    @property
    def source(self) -> fx.Node:
        """The tensor the GEMM reads, looking through the view aot puts before it."""
        return self.x2d.args[0] if is_op(self.x2d, *VIEW_OPS) else self.x2d

    @property
    def spelling(self) -> str:
        return "linear" if self.gemm.target is aten.linear.default else "mm"


def input_mismatch(a: Linear, b: Linear, a_what: str, b_what: str) -> str | None:
    """Why ``a`` and ``b`` do not multiply the very same matrix (None when they do)."""
    if a.source is not b.source:
        return f"{a_what} and {b_what} read different inputs"
    if val(a.x2d).shape[-1] != val(b.x2d).shape[-1]:
        return (f"{b_what} reads {b.source.name} as {list(val(b.x2d).shape)}, {a_what} as "
                f"{list(val(a.x2d).shape)} (a different K)")
    # Two 2-D views of one tensor with the same K are the same matrix; aten.linear
    # keeps the leading dims, so there only the same node will do.
    if "linear" in (a.spelling, b.spelling) and a.x2d is not b.x2d:
        return f"{a_what} and {b_what} read different inputs"
    return None


def match_linear(gemm: fx.Node, what: str) -> Linear:
    """A linear layer ending at ``gemm``; raise NoMatch naming ``what`` when it is not one."""
    expect_op(gemm, GEMM_OPS, what)
    if gemm.target is aten.linear.default:
        x2d, weight = gemm.args[0], gemm.args[1]
        bias = gemm.args[2] if len(gemm.args) > 2 else gemm.kwargs.get("bias")
    else:
        if gemm.target is aten.addmm.default:
            bias, x2d, weight_t = gemm.args[:3]
            beta, alpha = gemm.kwargs.get("beta", 1), gemm.kwargs.get("alpha", 1)
            expect(scalar(beta) == 1 and scalar(alpha) == 1, f"{what} {gemm.name} scales by alpha/beta", gemm)
        else:
            bias, (x2d, weight_t) = None, gemm.args[:2]
        transposed = is_op(weight_t, aten.t.default) or (
            is_op(weight_t, aten.permute.default) and list(weight_t.args[1]) == [1, 0])
        expect(transposed, f"{what} {gemm.name} does not multiply by a transposed weight t(W)", weight_t)
        weight = weight_t.args[0]
    expect(isinstance(val(weight), torch.Tensor) and val(weight).dim() == 2, f"{what} weight is not 2-D", gemm)
    width = val(weight).shape[0]
    if bias is not None:
        shape = tuple(val(bias).shape)
        expect(shape == (width,), f"{what} bias has shape {shape}, expected ({width},)", bias)
    out = gemm
    user = next(iter(gemm.users)) if len(gemm.users) == 1 else None
    if gemm.target is not aten.linear.default and is_op(user, *VIEW_OPS) and val(user).shape[-1] == width:
        out = user  # the view back to [..., N]
    return Linear(gemm, x2d, weight, bias, out)


def linear_producing(value: fx.Node, what: str, readers: tuple[fx.Node, ...] = ()) -> Linear:
    """The linear layer whose output ``value`` is (through the view back to [..., N]).
    ``readers``: the nodes of the pattern that read ``value`` (``g * sigmoid(g)`` reads it twice)."""
    gemm = value.args[0] if is_op(value, *VIEW_OPS) and is_op(value.args[0], *GEMM_OPS) else value
    lin = match_linear(gemm, what)
    allowed = {value} if gemm is not value else set(readers)
    expect(len(gemm.users) == 1 or set(gemm.users) <= allowed,
           f"{what} GEMM {gemm.name} has {len(gemm.users)} users; a fusion would lose the others", gemm)
    expect(lin.out is value, f"{what} output {value.name} is not the GEMM's [..., {lin.width}] result", value)
    return lin


def expect_constant_params(lin: Linear, what: str) -> None:
    expect(ir.get_constant(lin.weight) is not None,
           f"{what} weight is not a constant (freeze_weights=False?)", lin.weight)
    expect(lin.bias is None or ir.get_constant(lin.bias) is not None,
           f"{what} bias is not a constant (freeze_weights=False?)", lin.bias)


def param_name(node: fx.Node) -> str:
    return node.meta.get(ir.PARAM_NAME) or str(node.target)


def merged_param_name(names: list[str]) -> str:
    """A readable name for concatenated parameters, from the names of the parts:
    ``...mlp.gate_proj.weight`` + ``...mlp.up_proj.weight`` -> ``...mlp.gate_up_proj.weight``;
    q/k/v_proj -> qkv_proj; query/key/value -> query_key_value."""
    parts = [n.split(".") for n in names]
    if len({len(p) for p in parts}) != 1:
        return "+".join(names)
    differ = [i for i, atoms in enumerate(zip(*parts)) if len(set(atoms)) > 1]
    if len(differ) != 1:
        return "+".join(names)
    i = differ[0]
    atoms = [p[i] for p in parts]
    head = _common_prefix(atoms)
    tail = _common_prefix([a[len(head):][::-1] for a in atoms])[::-1]
    stems = [a[len(head):len(a) - len(tail)] for a in atoms]
    joined = "".join(stems) if all(len(s) == 1 for s in stems) else "_".join(stems)
    return ".".join(parts[0][:i] + [head + joined + tail] + parts[0][i + 1:])


def _common_prefix(words: list[str]) -> str:
    out = ""
    for chars in zip(*words):
        if len(set(chars)) != 1:
            break
        out += chars[0]
    return out


# cat(parts) made for an earlier graph, by where the parts live: a recompile of the same model
# (dynamo's graph for a new shape) merges the same weights again, and without this each graph
# would keep its own copy (224 MB of q/k/v and gate/up weights on llama-small).
_concatenated: dict[tuple, weakref.ref] = {}


def _parts_key(parts: list[torch.Tensor]) -> tuple:
    return tuple((p.device, p.dtype, p.data_ptr(), tuple(p.shape), p.stride()) for p in parts)


def _earlier_concat(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor an earlier graph made of these same parts, if it is alive and still equals
    them (a freed part's address may hold other values now: compared, never assumed)."""
    ref = _concatenated.get(_parts_key(parts))
    made = ref() if ref is not None else None
    if made is None:
        return None
    rows = [p.shape[0] for p in parts]
    if made.shape[0] != sum(rows) or not all(torch.equal(m, p) for m, p in zip(made.split(rows), parts)):
        return None
    return made


def _remember_concat(parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
    for dead in [key for key, ref in _concatenated.items() if ref() is None]:
        del _concatenated[dead]
    _concatenated[_parts_key(parts)] = weakref.ref(tensor)


def concat_constant(gm: fx.GraphModule, parts: list[torch.Tensor], name: str) -> fx.Node:
    """A frozen constant ``cat(parts, 0)`` named after the parameter it stands for; the same
    tensor as an earlier graph's when that graph concatenated the same, unchanged parts."""
    with torch.no_grad():
        parts = [p.detach() for p in parts]
        # A meta or lazy (fake) tensor has no address; a lazy one's data is read when written out.
        shareable = all(p.device.type != "meta" and not lazy_weights.is_lazy(p) for p in parts)
        tensor = _earlier_concat(parts) if shareable else None
        if tensor is None:
            tensor = lazy_weights.derive(torch.cat, parts, 0)
            if shareable:
                _remember_concat(parts, tensor)
    node = ir.add_constant(gm, "w_" + name.replace(".", "_"), tensor)
    node.meta[ir.PARAM_NAME] = name
    return node


def concat_params(gm: fx.GraphModule, linears: list[Linear]) -> tuple[fx.Node, fx.Node | None]:
    """get_attr nodes for the row-concatenated weights and biases (missing biases are zeros)."""
    weights = [ir.get_constant(lin.weight) for lin in linears]
    name = merged_param_name([param_name(lin.weight) for lin in linears])
    weight = concat_constant(gm, weights, name)
    if all(lin.bias is None for lin in linears):
        return weight, None
    biases = [ir.get_constant(lin.bias) if lin.bias is not None else w.new_zeros(w.shape[0])
              for lin, w in zip(linears, weights)]
    stem = name[:-len("weight")] if name.endswith("weight") else name + "."
    return weight, concat_constant(gm, biases, stem + "bias")


def expect_same_params(linears: list[Linear], names: list[str]) -> None:
    """Weights and biases of one dtype and device: they become one tensor."""
    first = val(linears[0].weight)
    for lin, name in zip(linears, names):
        for param in (lin.weight, lin.bias):
            if param is None:
                continue
            v = val(param)
            expect(v.dtype == first.dtype and v.device == first.device,
                   f"{name} {param.name} is {v.dtype} on {v.device}, {names[0]} weight {first.dtype} on "
                   f"{first.device}", param)


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, also for symbolic sizes (without adding guards)."""
    return a.dim() == b.dim() and all(statically_known_true(p == q) for p, q in zip(a.shape, b.shape))
