"""Which layout describes a given key."""

from __future__ import annotations

from .model import LayoutError, Layout


def select_layout(layouts: list[Layout], model: str | None, group: int | None,
                  for_all: bool) -> Layout | None:
    """The layout for a key with parsed ``model`` and ``group``, or None when none applies.

    ``for_all``: the layouts describe every key whatever its model name (keys with no parsed
    model, or a deployment that renamed the model). A key with no ``@group:`` field (vLLM
    releases before it) is group 0. A layout with group None matches any group; one with the
    key's exact group wins over it. Two equally good matches are ambiguous: a LayoutError.
    """
    candidates = [layout for layout in layouts if for_all or layout.model == model]
    key_group = 0 if group is None else group
    for wanted in (key_group, None):
        matches = [layout for layout in candidates if layout.group == wanted]
        if len(matches) > 1:
            which = "any group" if wanted is None else f"group {wanted}"
            raise LayoutError(f"{len(matches)} layouts match model {model!r} {which} "
                              f"(TP sizes {sorted(layout.tp_size for layout in matches)}); "
                              f"keep one per model and group")
        if matches:
            return matches[0]
    return None
