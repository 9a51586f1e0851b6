"""The package's import graph (every import statement, at module level or inside a function;
those under `if TYPE_CHECKING:` never run and do not count): no circles, no layer importing
one above it, and the worker never sees the core's live Request (its door is data:
jaxllm/contracts). The layers are docs/architecture.md's."""
import ast
import os
import importlib.util
import pkgutil
import subprocess
import sys

import jaxllm

# Bottom to top. A module may import its own group and any lower layer; the groups of one layer
# (the scheduler's core and the runner's worker) may not import each other.
LAYERS = [
    {"base": ["jaxllm.utils", "jaxllm.typecheck", "jaxllm.sharding", "jaxllm.distributed", "jaxllm.compilation",
              "jaxllm.kernels", "jaxllm.models", "jaxllm.sampling_params", "jaxllm.pooling_params",
              "jaxllm.structured_output", "jaxllm.outputs", "jaxllm.sample.logits_processor", "jaxllm.lora"]},
    {"config": ["jaxllm.config", "jaxllm.model_source", "jaxllm.dtypes", "jaxllm.device_facts", "jaxllm.model_hub",
                "jaxllm.tokenizer", "jaxllm.profiling", "jaxllm.speculative_config"]},
    {"contracts": ["jaxllm.contracts"]},
    {"sample": ["jaxllm.sample"]},
    {"core": ["jaxllm.core", "jaxllm.request", "jaxllm.spec_decode"], "worker": ["jaxllm.worker", "jaxllm.lora.slots"]},
    {"executor": ["jaxllm.executor"]},
    {"engine": ["jaxllm.engine"]},
    {"front": ["jaxllm.entrypoints", "jaxllm.benchmarks", "jaxllm.cli", "jaxllm"]},  # "jaxllm": the package's own names
]


def modules() -> dict[str, str]:
    """Every module of the package: name -> source file."""
    found = {"jaxllm": jaxllm.__file__}
    for info in pkgutil.walk_packages(jaxllm.__path__, "jaxllm."):
        found[info.name] = importlib.util.find_spec(info.name).origin
    return found


def _under_type_checking(node, parents) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    known = modules()
    graph = {}
    for name, path in known.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from jaxllm import compilation` imports the module jaxllm.compilation
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                         for a in node.names]
            else:
                continue
            if not _under_type_checking(node, parents):
                targets.update(n for n in names if n in known and n != name)
        graph[name] = targets
    return graph


def place(module: str) -> tuple[int, str]:
    """(layer, group) of a module: the longest prefix that names it."""
    best = None
    for layer, groups in enumerate(LAYERS):
        for group, prefixes in groups.items():
            for prefix in prefixes:
                if (module == prefix or (prefix != "jaxllm" and module.startswith(prefix + "."))) and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), layer, group)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)"
    return best[1], best[2]


def test_no_module_imports_a_layer_above_it_or_a_sibling():
    bad = []
    for module, targets in import_graph().items():
        layer, group = place(module)
        for target in targets:
            t_layer, t_group = place(target)
            if t_layer > layer or (t_layer == layer and t_group != group):
                bad.append(f"{module} ({group}) imports {target} ({t_group})")
    assert not bad, "\n".join(sorted(bad))


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_worker_never_imports_the_request_class():
    graph = import_graph()
    offenders = [m for m, targets in graph.items() if m.startswith("jaxllm.worker") and "jaxllm.request" in targets]
    assert offenders == []


def loaded_after(statement: str) -> set[str]:
    """The top-level packages a fresh interpreter holds after `statement`."""
    code = f"import sys; {statement}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_import_jaxllm_loads_no_jax_and_the_front_end_no_flax():
    """`import jaxllm` is nearly free, and the caller's process, which only resolves the config,
    tokenizes and detokenizes, never loads the model code (flax): the engine core's process does."""
    assert "jax" not in loaded_after("import jaxllm")
    assert "flax" not in loaded_after("from jaxllm import LLM, AsyncLLM, SamplingParams, EngineArgs")
    tiny = os.path.join(os.path.dirname(__file__), "fixtures", "tiny", "llama")
    assert "flax" not in loaded_after(f"from jaxllm import EngineArgs; EngineArgs(model={tiny!r}).create_config()")
