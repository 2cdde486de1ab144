"""What to check in each key besides its bytes: its layout and its producer block-table entry."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from audit.blocktables import BlockTables
from audit.errors import AuditError
from audit.layouts import Layout, LayoutError, select_layout
from audit.layouts.infer import LayoutRequest, infer_layouts, observed_sizes
from audit.records import KeyInfo


_HEX = re.compile(r"[0-9a-fA-F]+")
_SHARDED_FORMATS = ("tp_shared_lbhnc", "tp_shared_lbnhc")


@dataclass
class CheckPlan:
    layouts: list[Layout] = field(default_factory=list)
    layout_for_all: bool = False       # the layouts describe every vLLM key, whatever its model name
    tables: BlockTables | None = None
    keep_regions: bool = False         # per-region results for every key, not only findings
    requests: list[LayoutRequest] = field(default_factory=list)  # configs whose layouts may be re-fitted
    inference: list[dict] | None = None  # what fit_sizes inferred, for the report's layout_inference
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.requests:
            self.requests = list(getattr(self.layouts, "requests", ()))
        self._check_unique()

    def fit_sizes(self, keys) -> list[dict]:
        """Re-fit the layouts built from model configs to the listed keys' sizes (per model and
        group, among vLLM's candidate dtypes, platforms, block sizes and TP sizes), before the
        scan; returns (and keeps in ``inference``) one row per (model, group) for the report."""
        if not self.requests:
            self.inference = []
            return self.inference
        observed = observed_sizes(keys)
        rows: list[dict] = []
        fitted: dict[str, list[Layout]] = {}
        for request in self.requests:
            try:
                fitted[request.name], found = infer_layouts(request, observed)
            except LayoutError as error:
                raise AuditError(str(error)) from None
            rows += found
        from_configs = {layout.model for layouts in fitted.values() for layout in layouts} | set(fitted)
        self.layouts = ([layout for layout in self.layouts if layout.model not in from_configs]
                        + [layout for layouts in fitted.values() for layout in layouts])
        self._cache.clear()
        self._check_unique()
        self.inference = rows
        return rows

    def _check_unique(self) -> None:
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
            if fields.get("scheme") != "vllm" or fields.get("store_format") in _SHARDED_FORMATS:
                return None  # not vLLM's, or a Store-TP shard (a slice of heads: not modelled)
            try:
                self._cache[stem] = select_layout(self.layouts, fields.get("model"), fields.get("group"),
                                                  self.layout_for_all)
            except LayoutError as error:
                raise AuditError(str(error)) from None
        return self._cache[stem]

    def table_entry(self, key: KeyInfo):
        return None if self.tables is None else self.tables.get(key.name)


class LayoutList(list):
    """Layouts, plus the model configs they were built from (``requests``), so that a plan can
    re-fit them to the listed value sizes (``CheckPlan.fit_sizes``)."""

    requests: list[LayoutRequest]


def load_layouts(*, model_configs=(), layout_files=(), model_name: str | None = None, tp_size: int = 1,
                 state_dtype: str | None = None, ssm_dtype: str | None = None, block_size: int | None = None,
                 conv_layout: str = "SD", kv_cache_dtype: str | None = None,
                 kernel_block_size: int | None = None, platform: str | None = None,
                 tp_given: bool = False) -> LayoutList:
    """Layouts from HuggingFace config.json files (model name: `model_name`, else the config's
    directory name, as vLLM puts the model path's basename in keys) and from layout files.

    Dtypes, block sizes and the platform left None follow vLLM's defaults and rules (see
    `audit.layouts.dtypes`); `CheckPlan.fit_sizes` may then infer them from the listed sizes.
    `tp_given`: the operator said the TP size (otherwise other TP sizes are candidates too)."""
    from pathlib import Path

    from audit.layouts import load_hf_config, load_layout_file

    layouts = LayoutList()
    layouts.requests = []
    try:
        for path in model_configs:
            path = Path(path)
            name = model_name or (path.name if path.is_dir() else path.resolve().parent.name)
            request = LayoutRequest(load_hf_config(path), name, tp_size=tp_size, state_dtype=state_dtype,
                                    ssm_dtype=ssm_dtype, block_size=block_size, kernel_block_size=kernel_block_size,
                                    kv_cache_dtype=kv_cache_dtype, conv_layout=conv_layout, platform=platform,
                                    tp_given=tp_given)
            layouts += request.layouts()
            layouts.requests.append(request)
        for path in layout_files:
            layouts += load_layout_file(path)
    except LayoutError as error:
        raise AuditError(str(error)) from None
    return layouts
