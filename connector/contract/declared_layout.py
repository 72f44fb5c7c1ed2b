"""A declared layout against the one vLLM built: every field in which they differ.

The operator renders the layout a ``MooncakeKVPool`` declares for a consumer (and
its fingerprint) into that consumer's connector settings; at start-up the
connector compares the declaration with the layout vLLM really built. Any
difference keeps the connector out of the pool, so a wrong declaration never
mixes layouts. Compared is exactly what the fingerprint covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.connector.contract.identity import stage_independent
from kvpool.connector.contract.layout import KVLayout, Problem, canonical_payload, fingerprint


@dataclass(frozen=True)
class LayoutDifference:
    """One field of the layout: what the declaration says, what vLLM built."""

    field: str
    declared: Any
    built: Any

    def __str__(self) -> str:
        return f"{self.field}: declared {_show(self.declared)}, vLLM built {_show(self.built)}"


def _show(value: Any) -> str:
    return "(none)" if value is None else repr(value)


INCOMPLETE = "declared-layout-incomplete"
PRINT_IT = "declare the layout kvpool-layout prints, whole"


def incomplete(layout: KVLayout) -> list[Problem]:
    """What a declaration leaves at a default that a layout vLLM builds never has: the model,
    a concrete dtype (never ``auto``), the cache block size, each group's page size. Such a
    declaration differs from every built layout, so its engines would stay out of the pool."""
    problems = []
    if not layout.model:
        problems.append(Problem(field="model", rule=INCOMPLETE, message=f"not set: {PRINT_IT}"))
    if layout.dtype == "auto":
        problems.append(
            Problem(
                field="dtype",
                rule=INCOMPLETE,
                message=f"'auto' is never the dtype vLLM builds (e.g. bfloat16, uint8 for fp8): {PRINT_IT}",
            )
        )
    if layout.cache_block_size is None:
        problems.append(Problem(field="cache_block_size", rule=INCOMPLETE, message=f"not set: {PRINT_IT}"))
    for index, group in enumerate(layout.groups):
        if group.page_size_bytes is None:
            problems.append(
                Problem(
                    field=f"groups[{index}].page_size_bytes", rule=INCOMPLETE, message=f"not set: {PRINT_IT}"
                )
            )
    return problems


def canonical(layout: KVLayout) -> dict[str, Any]:
    """The layout as the fingerprint sees it (``layout.canonical_payload``)."""
    return canonical_payload(layout)


def differences(
    built: KVLayout,
    declared: KVLayout | None = None,
    declared_fingerprint: str = "",
    *,
    per_stage: bool = False,
) -> list[LayoutDifference]:
    """Every field in which ``declared`` (or only its fingerprint) differs from ``built``.

    Empty when they agree, or when nothing is declared. ``per_stage``: ``built`` is one
    pipeline stage's view, whose groups count only that stage's layers; layer counts
    are then not compared, nor a fingerprint alone (it covers them).
    """
    out: list[LayoutDifference] = []
    if declared is not None:
        if per_stage:
            declared, built = stage_independent(declared), stage_independent(built)
        out = _diff("", canonical(declared), canonical(built))
        if not out and fingerprint(declared) != fingerprint(built):
            out = [LayoutDifference("fingerprint", fingerprint(declared), fingerprint(built))]
    elif declared_fingerprint and not per_stage and declared_fingerprint != fingerprint(built):
        out = [LayoutDifference("fingerprint", declared_fingerprint, fingerprint(built))]
    return out


def _diff(path: str, declared: Any, built: Any) -> list[LayoutDifference]:
    if isinstance(declared, dict) and isinstance(built, dict):
        out: list[LayoutDifference] = []
        for key in sorted(declared.keys() | built.keys()):
            where = f"{path}.{key}" if path else key
            out += _diff(where, declared.get(key), built.get(key))
        return out
    if isinstance(declared, list) and isinstance(built, list):
        out = []
        if len(declared) != len(built):
            out.append(LayoutDifference(f"{path} (count)", len(declared), len(built)))
        for index, (d, b) in enumerate(zip(declared, built)):
            out += _diff(f"{path}[{index}]", d, b)
        return out
    return [] if declared == built else [LayoutDifference(path, declared, built)]


def mismatch_message(built: KVLayout, found: list[LayoutDifference]) -> str:
    """The error a consumer logs when its declared layout is not the one vLLM built."""
    lines = "\n".join(f"  - {d}" for d in found)
    return (
        f"KVPoolConnector: the declared KV layout is not the one vLLM built (fingerprint "
        f"{fingerprint(built)}); staying out of the pool. Differences:\n{lines}\n"
        "Fix the consumer's layout in the MooncakeKVPool (kvpool-layout prints the block)."
    )
