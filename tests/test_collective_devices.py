"""Every tensor the code hands to a torch.distributed collective is on the group's device (static, no imports run).

On CUDA the default group and megatron's groups are NCCL, which takes CUDA tensors only
(torch/distributed/distributed_c10d.py maps the backend to its devices): a host tensor in an all-reduce raises
on the first GPU run and on no CPU run (gloo takes both). So the check reads the source (AST) of every module of
every project package but tests/ (planner/ and modelspec/ have no collective today; scanning them costs nothing
and keeps a future one covered) and fails on a tensor that reaches a collective from

- a tensor factory (``torch.tensor``/``zeros``/``ones``/``empty``/``full``/``arange``/... ) without ``device=``
  or with a literal ``"cpu"`` device, or
- ``.cpu()``,

directly, through a local name (a list of them included), or through a project function whose parameter reaches
a collective (found to a fixed point: e.g. ``megatron_backend/logprobs.py::_all_reduce``). ``*_like`` and
``new_*`` factories take their input's device and are not host tensors. Object collectives
(``all_gather_object``, ``broadcast_object_list``, ``gather_object``...) are exempt: torch moves their pickled
bytes to the group's device itself (``_get_object_coll_device``). The analysis is per function and
flow-insensitive: a name bound once to a host tensor counts everywhere in that function.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = (
    "rl", "run", "telemetry", "checkpointing", "weight_sync", "megatron_backend", "rollout", "planner", "modelspec",
    "colocation", "tools",
)

FACTORIES = {
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "eye",
    "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor", "from_numpy",
}  # fmt: skip
# collective -> positional indices of its tensor arguments (and the keyword names that may carry them)
TENSOR_COLLECTIVES = {
    "all_reduce": (0,), "reduce": (0,), "broadcast": (0,), "all_gather": (0, 1), "all_gather_into_tensor": (0, 1),
    "reduce_scatter": (0, 1), "reduce_scatter_tensor": (0, 1), "all_to_all": (0, 1), "all_to_all_single": (0, 1),
    "gather": (0, 1), "scatter": (0, 1), "send": (0,), "recv": (0,), "isend": (0,), "irecv": (0,),
    "all_reduce_coalesced": (0,), "all_gather_coalesced": (0, 1), "P2POp": (1,),
}  # fmt: skip
TENSOR_KEYWORDS = {
    "tensor", "tensor_list", "output", "input", "output_tensor", "input_tensor", "output_tensor_list",
    "input_tensor_list", "scatter_list", "gather_list",
}  # fmt: skip
DIST_MODULES = {"dist", "torch.distributed"}

# (module path, function, name) -> why the host tensor is right there. Empty today: every collective's tensor is
# on its group's device. An entry belongs here only for a group made for host tensors (a gloo group built with
# backend="gloo" next to the NCCL one, e.g. for CPU-side metadata), never to silence a default-group call.
HOST_TENSOR_ALLOWLIST: dict[tuple[str, str, str], str] = {}


@dataclass(frozen=True)
class Hit:
    path: str
    line: int
    function: str
    name: str
    collective: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.function}: host tensor `{self.name}` reaches {self.collective}"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _callee(call: ast.Call) -> tuple[str, str]:
    """(the callee's dotted prefix, its last name): ``dist.all_reduce`` -> ("dist", "all_reduce")."""
    if isinstance(call.func, ast.Attribute):
        return _dotted(call.func.value), call.func.attr
    if isinstance(call.func, ast.Name):
        return "", call.func.id
    return "", ""


def _is_host_factory(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    prefix, name = _callee(node)
    if name == "cpu" and isinstance(node.func, ast.Attribute) and not node.args:
        return True
    if prefix != "torch" or name not in FACTORIES:
        return False
    device = next((kw.value for kw in node.keywords if kw.arg == "device"), None)
    if device is None:
        return True
    literal = device.args[0] if isinstance(device, ast.Call) and _dotted(device.func) == "torch.device" else device
    return isinstance(literal, ast.Constant) and literal.value == "cpu"


def _is_host(node: ast.AST, host_names: set[str]) -> bool:
    """A host tensor or a list of host tensors."""
    if isinstance(node, ast.Name):
        return node.id in host_names
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_host(e, host_names) for e in node.elts)
    if isinstance(node, ast.ListComp):
        return _is_host(node.elt, host_names)
    if isinstance(node, ast.Call) and _callee(node)[1] == "contiguous" and isinstance(node.func, ast.Attribute):
        return _is_host(node.func.value, host_names)
    return _is_host_factory(node)


def _functions(tree: ast.Module):
    """(qualified name, node) of every function, nested ones included, and the module body as "<module>"."""
    yield "<module>", tree

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{child.name}"
                yield qual, child
                yield from walk(child, f"{qual}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _own_nodes(fn: ast.AST):
    """The nodes of ``fn``'s body, not of the functions nested in it (they are analysed on their own)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _tensor_args(call: ast.Call, positions: tuple[int, ...], keywords: set[str]) -> list[ast.AST]:
    args = [call.args[i] for i in positions if i < len(call.args)]
    return args + [kw.value for kw in call.keywords if kw.arg in keywords]


def _collective_positions(call: ast.Call, wrappers: dict[str, tuple[int, ...]]) -> tuple[str, tuple[int, ...]]:
    prefix, name = _callee(call)
    if prefix in DIST_MODULES and name in TENSOR_COLLECTIVES:
        return f"{prefix}.{name}", TENSOR_COLLECTIVES[name]
    if name in wrappers and prefix not in DIST_MODULES:
        return f"{name} (a collective wrapper)", wrappers[name]
    return "", ()


def _params(fn: ast.AST) -> list[str]:
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _parsed(paths: list[Path]) -> dict[str, ast.Module]:
    return {str(p.relative_to(REPO)): ast.parse(p.read_text(), filename=str(p)) for p in paths}


def collective_wrappers(trees: dict[str, ast.Module]) -> dict[str, tuple[int, ...]]:
    """Project functions (by name) -> the positional indices (``self`` not counted) of the parameters that reach a
    torch.distributed tensor collective, directly or through another wrapper (to a fixed point)."""
    wrappers: dict[str, tuple[int, ...]] = {}
    while True:
        found = dict(wrappers)
        for tree in trees.values():
            for qual, fn in _functions(tree):
                params = _params(fn)
                reaching = set(found.get(qual.rsplit(".", 1)[-1], ()))
                for node in _own_nodes(fn):
                    if isinstance(node, ast.Call):
                        _, positions = _collective_positions(node, found)
                        for arg in _tensor_args(node, positions, TENSOR_KEYWORDS):
                            if isinstance(arg, ast.Name) and arg.id in params:
                                reaching.add(params.index(arg.id))
                if reaching:
                    found[qual.rsplit(".", 1)[-1]] = tuple(sorted(reaching))
        if found == wrappers:
            return wrappers
        wrappers = found


def host_tensors_in_collectives(trees: dict[str, ast.Module]) -> list[Hit]:
    wrappers = collective_wrappers(trees)
    hits = []
    for path, tree in trees.items():
        for qual, fn in _functions(tree):
            host_names: set[str] = set()
            nodes = list(_own_nodes(fn))
            for node in nodes:  # names bound to host tensors anywhere in the function
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if _is_host(node.value, set()):
                        host_names.update(t.id for t in targets if isinstance(t, ast.Name))
            for node in nodes:
                if not isinstance(node, ast.Call):
                    continue
                collective, positions = _collective_positions(node, wrappers)
                for arg in _tensor_args(node, positions, TENSOR_KEYWORDS):
                    if _is_host(arg, host_names):
                        name = arg.id if isinstance(arg, ast.Name) else ast.unparse(arg)
                        if (path, qual, name) not in HOST_TENSOR_ALLOWLIST:
                            hits.append(Hit(path, node.lineno, qual, name, collective))
    return hits


def project_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def test_no_host_tensor_reaches_a_collective():
    hits = host_tensors_in_collectives(_parsed(project_modules()))
    assert not hits, "on NCCL these raise (CUDA tensors only); build them with device=<the group's device>:\n" + (
        "\n".join(map(str, hits))
    )


def test_the_check_sees_each_way_a_host_tensor_reaches_a_collective():
    """The analysis itself, on a module written to hold each case once (so a blind check cannot pass)."""
    source = """
import torch
import torch.distributed as dist

def direct(values, group):
    dist.all_reduce(torch.tensor(values), group=group)

def named(values):
    bad = torch.tensor([float(v) for v in values])
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)

def listed(x, n):
    parts = [torch.empty(3) for _ in range(n)]
    dist.all_gather(parts, x)

def moved(x):
    dist.broadcast(x.cpu(), src=0)

def explicit_cpu():
    flag = torch.zeros(1, device="cpu")
    dist.all_reduce(flag)

def reduce_helper(tensor, group):
    dist.all_reduce(tensor, group=group)

def outer_helper(t):
    return reduce_helper(t, None)

def through_helpers():
    count = torch.ones(1)
    outer_helper(count)

def on_device(x, device):
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)
    dist.all_gather([torch.empty_like(x)], x)
    dist.all_gather_object([None], torch.tensor(1))
"""
    hits = host_tensors_in_collectives({"example.py": ast.parse(source)})
    assert sorted((h.function, h.name) for h in hits) == [
        ("direct", "torch.tensor(values)"),
        ("explicit_cpu", "flag"),
        ("listed", "parts"),
        ("moved", "x.cpu()"),
        ("named", "bad"),
        ("through_helpers", "count"),
    ]
