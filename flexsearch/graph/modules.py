"""Facts about a model's module tree that sharding rules need, read from the model.

:func:`module_facts` lists the model's top-level modules that hold parameters and,
for plain containers (``nn.ModuleList``, ``nn.ModuleDict``), their items, recursively,
in module order: each with its path, whether it is a container, and the canonical
names of the parameters under it (by identity, so a weight tied between two modules
has the same name in both). The tracer records them in the graph
(:attr:`~flexsearch.graph.opgraph.OpGraph.modules`); the emitter reads the same facts
from the model it wraps, so both sides apply one rule
(:func:`flexsearch.strategy.fsdp.fsdp_units`) to one set of facts.
"""

from __future__ import annotations

from torch import nn

from flexsearch.graph.opgraph import ModuleFacts

CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def module_facts(model: nn.Module) -> tuple[ModuleFacts, ...]:
    """The model's sharding-relevant modules (module docstring)."""
    canon: dict[int, str] = {}
    for name, p in model.named_parameters():
        canon.setdefault(id(p), name)
    out: list[ModuleFacts] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            params = tuple(dict.fromkeys(canon[id(p)] for _, p in child.named_parameters(remove_duplicate=False)
                                         if id(p) in canon))
            if not params:
                continue
            container = isinstance(child, CONTAINERS)
            out.append(ModuleFacts(path=path, container=container, params=params))
            if container:
                visit(child, path + ".")

    visit(model, "")
    return tuple(out)
