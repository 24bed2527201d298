"""The package's import graph keeps the layers docs/architecture.md draws: no import circle between files, and an
import from a lower layer up to a higher one only where the table names it. Every `import` / `from ... import`
counts, at the top of a file or inside a function. Pure AST, well under a second."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "m3serve"

# docs/architecture.md, "Layers": bottom -> top; a module belongs to the longest prefix that names it.
LAYERS = (
    ("foundation", ("config", "device", "opcount", "benchmeta", "tokenizer", "keyed_noise", "quant", "kernels._jit")),
    ("model", ("model",)),
    ("kv", ("kv",)),
    ("kernels", ("kernels",)),
    ("targets", ("targets", "runtime.step_inputs")),
    ("sampling", ("engine.sampling_params", "engine.structured_params", "engine.sampler",
                  "engine.spec_rng", "engine.spec_verify")),
    ("runtime", ("runtime",)),
    ("engine", ("engine",)),
    ("distributed", ("distributed",)),
    ("api", ("llm", "")),
    ("apps", ("server", "eval", "train", "bench", "kv.calibrate")),
    ("cli", ("cli", "targets.explain_cli", "server.cli", "eval.cli", "bench.cli", "server.__main__", "eval.__main__",
             "bench.__main__", "train.__main__")),
)
# The upward imports the table lists, each with its reason there.
ALLOWED_UP = {
    ("engine.spec_runner", "distributed.vocab"),
    ("llm", "server.chat_tokens"),
}
MAX_UP = 3


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package's modules (files other than __init__) it imports."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name if name in mods else None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if pkg else []
                    base = ".".join([p for p in up if p] + ([base] if base else []))
                elif base == "m3serve" or base.startswith("m3serve."):
                    base = base[len("m3serve."):] if base != "m3serve" else ""
                else:
                    continue
                names = [f"{base}.{a.name}".lstrip(".") for a in node.names] + [base]
            else:
                continue
            for n in names:
                if isinstance(node, ast.Import):
                    if not (n == "m3serve" or n.startswith("m3serve.")):
                        continue
                    n = n[len("m3serve."):] if n != "m3serve" else ""
                t = resolve(n)
                if t is not None and t != mod and mods[t].name != "__init__.py":   # a package's __init__ re-exports
                    edges[mod].add(t)
    return edges


@functools.cache
def _package_edges() -> dict[str, set[str]]:
    return _edges(_modules())


def _layer(mod: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".") or p == "") and len(p) > depth:
                best, depth = i, len(p)
    return best


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles():
    circles = _circles(_package_edges())
    assert circles == [], "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_upward_imports_are_only_the_listed_ones():
    edges = _package_edges()
    up = {(a, b) for a, ts in edges.items() for b in ts if _layer(b) > _layer(a)}
    assert up <= ALLOWED_UP, f"imports from a lower layer up to a higher one (docs/architecture.md): {sorted(up - ALLOWED_UP)}"
    assert len(ALLOWED_UP) <= MAX_UP


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The two checks can fail: a synthetic graph with a circle and a model -> engine import."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("model.m3") < _layer("engine.engine") and _layer("engine.sampler") < _layer("runtime.decode_graphs")


def test_model_imports_nothing_above_it():
    edges = _package_edges()
    model = _layer("model.m3")
    above = sorted((a, b) for a, ts in edges.items() if a.startswith("model.") for b in ts if _layer(b) > model)
    assert above == [], above
