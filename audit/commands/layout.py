"""`mooncake-audit layout`: the byte layout of one key's value."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from audit.commands.common import check_choice, fail, model_layouts
from audit.commands.options import (BlockSize, BlockTablesOpt, ConvLayout, KernelBlockSize, KvCacheDtype, LayoutFile,
                                    ModelConfig, ModelDtype, ModelName, Platform, SsmDtype, StateDtype, TpSize,
                                    VllmConfig, VllmVersion)
from audit.errors import AuditError


def layout_command(
    model_config: ModelConfig = None, model: ModelName = None, tp_size: TpSize = None, dtype: ModelDtype = None,
    state_dtype: StateDtype = None, ssm_dtype: SsmDtype = None, block_size: BlockSize = None,
    conv_layout: ConvLayout = "SD", layout: LayoutFile = None,
    fmt: Annotated[str, typer.Option("--format", help="human, or json (a layout file you can edit)")] = "human",
    kernel_block_size: KernelBlockSize = None, kv_cache_dtype: KvCacheDtype = None, platform: Platform = None,
    vllm_config: VllmConfig = None, block_tables: BlockTablesOpt = None, vllm_version: VllmVersion = None,
) -> None:
    """Print the byte layout of one key's value: segments, regions, offsets, bytes per key; for each
    vLLM release (and GPU) whose rules give other bytes, unless --vllm-version names one."""
    from audit.judge.plan import CheckPlan
    from audit.layouts import dump_layout_file
    from audit.report.views import print_layouts

    check_choice("--format", fmt, ("human", "json"))
    if not model_config and not layout and not block_tables:
        raise fail("give --model-config PATH, --layout PATH or --block-tables DIR (the recorder's manifests)")
    try:
        layouts = model_layouts(model_config, model, conv_layout, layout, kernel_block_size=kernel_block_size,
                                platform=platform, tp_size=tp_size, dtype=dtype, state_dtype=state_dtype,
                                ssm_dtype=ssm_dtype, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                                vllm_config=vllm_config, vllm_version=vllm_version)
        plan = CheckPlan(layouts=layouts)
        if block_tables:  # a manifest's layouts replace those of the models it covers
            plan.use_manifests(block_tables)
    except AuditError as error:
        raise fail(str(error)) from None
    if block_tables and plan.manifests is None and not plan.layouts:
        raise fail(f"no manifest-*.json in {', '.join(map(str, block_tables))}")
    releases = {} if block_tables else {request.name: request.releases() for request in plan.requests}
    if fmt == "json":
        typer.echo(json.dumps(dump_layout_file(plan.layouts), indent=1))
        for name, views in releases.items():
            for who, _ in views[1:]:
                typer.echo(f"layout: {name}: printed for {views[0][0]}; {who} registers others "
                           f"(give --vllm-version and --platform)", err=True)
        return
    shown = [layout for layout in plan.layouts if len(releases.get(layout.model, ())) < 2]
    print_layouts(shown, source_of=plan.manifests.source_of if plan.manifests else None)
    for name, views in releases.items():
        if len(views) < 2:
            continue
        for who, layouts_of_release in views:
            typer.echo(f"{name} as {who}:")
            if isinstance(layouts_of_release, str):
                typer.echo(f"  {layouts_of_release}")
            else:
                print_layouts(layouts_of_release)
