"""What to check in each key besides its bytes: its layout and its producer block-table entry."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from audit.blocktables import BlockTables
from audit.errors import AuditError
from audit.layouts import Layout, LayoutError, select_layout
from audit.records import KeyInfo


_HEX = re.compile(r"[0-9a-fA-F]+")


@dataclass
class CheckPlan:
    layouts: list[Layout] = field(default_factory=list)
    layout_for_all: bool = False       # the layouts describe every vLLM key, whatever its model name
    tables: BlockTables | None = None
    keep_regions: bool = False         # per-region results for every key, not only findings
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        seen = set()
        for layout in self.layouts:
            slot = (None if self.layout_for_all else layout.model, layout.group)
            if slot in seen:
                raise AuditError(f"two layouts for model {layout.model!r} group {layout.group}: keep one "
                                 f"per model and group (one TP size per scan)")
            seen.add(slot)

    def layout_for(self, key: KeyInfo) -> Layout | None:
        """Keys that differ only in their chunk hash share a layout: parse one key per stem."""
        if not self.layouts:
            return None
        stem, _, tail = key.name.rpartition("@")
        if not _HEX.fullmatch(tail):  # not a chunk hash: this key is not vLLM's, or not like its stem's
            stem = key.name
        if stem not in self._cache:
            fields = key.parsed_fields()
            if fields.get("scheme") != "vllm":
                return None
            try:
                self._cache[stem] = select_layout(self.layouts, fields.get("model"), fields.get("group"),
                                                  self.layout_for_all)
            except LayoutError as error:
                raise AuditError(str(error)) from None
        return self._cache[stem]

    def table_entry(self, key: KeyInfo):
        return None if self.tables is None else self.tables.get(key.name)


def load_layouts(*, model_configs=(), layout_files=(), model_name: str | None = None, tp_size: int = 1,
                 state_dtype: str = "bfloat16", ssm_dtype: str | None = None, block_size: int | None = None,
                 conv_layout: str = "SD") -> list[Layout]:
    """Layouts from HuggingFace config.json files (model name: `model_name`, else the config's
    directory name, as vLLM puts the model path's basename in keys) and from layout files."""
    from pathlib import Path

    from audit.layouts import layouts_from_hf_config, load_hf_config, load_layout_file

    layouts: list[Layout] = []
    try:
        for path in model_configs:
            path = Path(path)
            name = model_name or (path.name if path.is_dir() else path.resolve().parent.name)
            layouts += layouts_from_hf_config(load_hf_config(path), model=name, tp_size=tp_size,
                                              state_dtype=state_dtype, ssm_dtype=ssm_dtype,
                                              block_size=block_size, conv_layout=conv_layout)
        for path in layout_files:
            layouts += load_layout_file(path)
    except LayoutError as error:
        raise AuditError(str(error)) from None
    return layouts
