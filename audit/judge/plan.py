"""What to check in each key besides its bytes: its layout and its producer block-table entry."""

from __future__ import annotations

from dataclasses import dataclass, field

from audit.blocktables import BlockTables
from audit.errors import AuditError
from audit.layouts import Layout, LayoutError, select_layout
from audit.judge.binding import Bindings
from audit.judge.readings import SAMPLE_KEYS, SampleTally
from audit.layouts.infer import (MANIFEST_FLAG, LayoutRequest, describe_reading, infer_layouts, observed_sizes,
                                 settling_flags)
from audit.layouts.manifest import ProducerManifests, read_manifests
from audit.records import KeyInfo


_SHARDED_FORMATS = ("tp_shared_lbhnc", "tp_shared_lbnhc")


@dataclass
class CheckPlan:
    layouts: list[Layout] = field(default_factory=list)
    layout_for_all: bool = False       # the layouts describe every vLLM key, whatever its model name
    tables: BlockTables | None = None
    keep_regions: bool = False         # per-region results for every key, not only findings
    requests: list[LayoutRequest] = field(default_factory=list)  # configs whose layouts may be re-fitted
    inference: list[dict] | None = None  # what fit_sizes inferred, for the report's layout_inference
    readings: dict = field(default_factory=dict)  # (model, group) -> its Readings, while undecided
    manifests: ProducerManifests | None = None  # the producer's own layouts (use_manifests)
    bindings: Bindings | None = None   # the checkpoints given: layer-0 binding (WEIGHTS_MISMATCH)
    _cache: dict = field(default_factory=dict, repr=False)
    _readings_of: dict = field(default_factory=dict, repr=False)  # id(layout) -> (layout, readings, tuple)
    _samples: dict = field(default_factory=dict, repr=False)  # (model, group) -> its SampleTally, while sampling

    def __post_init__(self) -> None:
        if not self.requests:
            self.requests = list(getattr(self.layouts, "requests", ()))
        self._check_unique()

    def fit_sizes(self, keys) -> list[dict]:
        """Re-fit the layouts built from model configs to the listed keys' sizes (per model and
        group, among vLLM's candidate dtypes, platforms, block sizes and TP sizes), before the
        scan; returns (and keeps in ``inference``) one row per (model, group) for the report.
        Groups whose size fits several readings keep them all in ``readings`` until
        `decide_readings` picks one; until then each key is judged under every one of them
        (`readings_of`), its bytes checked once for all."""
        observed = observed_sizes(keys)
        rows: list[dict] = [] if self.manifests is None else self.manifests.rows(observed)
        if not self.requests:
            self.inference = rows
            return rows
        fitted: dict[str, list[Layout]] = {}
        self.readings = {}
        for request in self.requests:
            try:
                inference = infer_layouts(request, observed)
            except LayoutError as error:
                raise AuditError(str(error)) from None
            fitted[request.name] = inference.layouts
            rows += inference.rows
            self.readings.update(inference.readings)
        from_configs = {layout.model for layouts in fitted.values() for layout in layouts} | set(fitted)
        self.layouts = ([layout for layout in self.layouts if layout.model not in from_configs]
                        + [layout for layouts in fitted.values() for layout in layouts])
        self._cache.clear()
        self._check_unique()
        self.inference = rows
        return rows

    def use_manifests(self, paths) -> None:
        """The manifests in `paths` (the --block-tables paths) decide their models' layouts: one
        reading per group, as the producer registered it, instead of any config's inference."""
        try:
            self.manifests = read_manifests(paths)
        except LayoutError as error:
            raise AuditError(str(error)) from None
        if self.manifests is None:
            return
        covered = self.manifests.models
        self.layouts = [layout for layout in self.layouts if layout.model not in covered] + self.manifests.layouts
        self.requests = [request for request in self.requests if request.name not in covered]
        self._cache.clear()
        self._check_unique()

    def reading_samples(self, keys, per_group: int = SAMPLE_KEYS) -> list[KeyInfo]:
        """Keys to read for choosing each ambiguous group's reading: spread over the group."""
        wanted: dict[tuple, list[KeyInfo]] = {slot: [] for slot in self.readings}
        for key in keys:
            layout = self.layout_for(key)
            slot = None if layout is None else (layout.model, layout.group)
            if slot in wanted and key.size == layout.size:
                wanted[slot].append(key)
        samples = []
        for members in wanted.values():
            step = max(1, len(members) // per_group)
            samples += members[::step][:per_group]
        return samples

    def add_sample(self, key: KeyInfo, value) -> None:
        """One of `reading_samples`' keys and its value (uint8, host memory), weighed under each of
        its group's readings at once: the reader's buffer may take the next batch right after."""
        layout = self.layout_for(key)
        slot = (layout.model, layout.group)
        tally = self._samples.get(slot)
        if tally is None:
            tally = self._samples[slot] = SampleTally([reading.layout for reading in self.readings[slot]])
        tally.add(value)

    def decide_readings(self) -> None:
        """Choose each ambiguous group's reading from the samples added (`add_sample`); a group the
        bytes cannot decide stays ambiguous, and its row says what would settle it."""
        rows = {(row["model"], row["group"]): row for row in self.inference or ()}
        samples, self._samples = self._samples, {}
        for slot, readings in list(self.readings.items()):
            tally = samples.get(slot) or SampleTally([reading.layout for reading in readings])
            kept, evidence = tally.choose()
            row = rows.get(slot, {})
            row["bytes"] = evidence
            self._replace_layout(readings[kept[0]].layout)
            if len(kept) == 1:
                row.update(status="from_bytes", assumed=readings[kept[0]].assumed)
                row.pop("candidates", None)
                row.pop("settle_with", None)
                del self.readings[slot]
            else:
                self.readings[slot] = [readings[i] for i in kept]
                row["candidates"] = [describe_reading(readings[i]) for i in kept]
                row["settle_with"] = settling_flags(self.readings[slot]) + [MANIFEST_FLAG]

    def _replace_layout(self, layout: Layout) -> None:
        self.layouts = [layout if (old.model, old.group) == (layout.model, layout.group) else old
                        for old in self.layouts]
        self._cache.clear()

    def readings_of(self, layout: Layout) -> tuple[Layout, ...]:
        """`layout`, then the other layouts its undecided group may be read with: one tuple per
        group and decision, the same object for every key of the group (a checker keys its
        plans and its runs of like values on it)."""
        readings = self.readings.get((layout.model, layout.group)) if self.readings else None
        entry = self._readings_of.get(id(layout))
        if entry is None or entry[0] is not layout or entry[1] is not readings:
            others = [reading.layout for reading in readings or () if reading.layout is not layout]
            entry = self._readings_of[id(layout)] = (layout, readings, (layout, *others))
        return entry[2]

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
        stem = key.stem()  # no chunk hash: this key is not vLLM's, or not like its stem's
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
                 tp_given: bool = False, model_dtype: str | None = None,
                 vllm_version: str | None = None) -> LayoutList:
    """Layouts from HuggingFace config.json files (model name: `model_name`, else the config's
    directory name, as vLLM puts the model path's basename in keys) and from layout files.

    Dtypes, block sizes and the platform left None follow vLLM's defaults and rules (see
    `audit.layouts.dtypes`); `CheckPlan.fit_sizes` may then infer them from the listed sizes.
    `tp_given`: the operator said the TP size (otherwise other TP sizes are candidates too);
    `vllm_version`: the producer's release (otherwise 0.32's and 0.33's rules are candidates)."""
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
                                    tp_given=tp_given, model_dtype=model_dtype, vllm_version=vllm_version)
            layouts += request.layouts()
            layouts.requests.append(request)
        for path in layout_files:
            layouts += load_layout_file(path)
    except LayoutError as error:
        raise AuditError(str(error)) from None
    return layouts
