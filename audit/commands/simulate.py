"""`mooncake-audit simulate`: publish a labelled vLLM #53084 workload into a test cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.commands.common import check_choice, fail, resolve_settings
from audit.commands.options import SsmDtype, StateDtype, TpSize, connection_options, takes
from audit.errors import AuditError


@takes(connection_options)
def simulate(
    out: Annotated[Path, typer.Option("--out", help="Directory for block tables, labels and layout.")], *,
    preset: Annotated[str, typer.Option("--preset", help="tiny-mamba1, tiny-mamba2 or mamba-130m.")] = "tiny-mamba1",
    model_config: Annotated[Optional[Path], typer.Option("--model-config", help="A mamba/mamba2 config.json instead of a preset.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Model name in keys.", show_default="the preset's")] = None,
    requests: Annotated[int, typer.Option(min=1)] = 2, tokens: Annotated[int, typer.Option(min=1)] = 3000,
    block_size: Annotated[int, typer.Option("--block-size", min=1)] = 128, tp_size: TpSize = 1,
    seed: Annotated[int, typer.Option(min=0)] = 0, cache_prefix: Annotated[str, typer.Option()] = "",
    state_dtype: StateDtype = "bfloat16", ssm_dtype: SsmDtype = None,
    null_boundary: Annotated[Optional[list[int]], typer.Option("--null-boundary", help="Token count that must be null-backed. Repeatable.")] = None,
    null_block_fill: Annotated[str, typer.Option(help="Bytes of block 0: zero or garbage.")] = "zero",
    inject_nan: Annotated[int, typer.Option(min=0)] = 0, truncate: Annotated[int, typer.Option(min=0)] = 0,
    zero_layers: Annotated[int, typer.Option(min=0)] = 0, tricky_good: Annotated[int, typer.Option(min=0)] = 0,
    **options,
) -> None:
    """Publish a labelled vLLM #53084 workload into a cluster (writes to the store: not for production)."""
    from audit.layouts import load_hf_config
    from audit.simulate import MAMBA_130M, TINY_MAMBA1, TINY_MAMBA2, SimulationOptions
    from audit.simulate import simulate as run_simulation

    presets = {"tiny-mamba1": TINY_MAMBA1, "tiny-mamba2": TINY_MAMBA2, "mamba-130m": MAMBA_130M}
    check_choice("--preset", preset, tuple(presets))
    check_choice("--null-block-fill", null_block_fill, ("zero", "garbage"))
    try:
        settings = resolve_settings(**options)
        model_dict = load_hf_config(model_config) if model_config else presets[preset]
        name = model or (model_config.resolve().parent.name if model_config else
                         {"mamba-130m": "mamba-130m-hf"}.get(preset, preset))
        options = SimulationOptions(
            requests=requests, tokens=tokens, block_size=block_size, tp_size=tp_size, seed=seed,
            cache_prefix=cache_prefix, state_dtype=state_dtype, ssm_dtype=ssm_dtype,
            null_boundaries=tuple(null_boundary or ()), null_block_fill=null_block_fill, inject_nan=inject_nan,
            truncate=truncate, zero_layers=zero_layers, tricky_good=tricky_good)
        result = run_simulation(settings, model_config=model_dict, model=name, out_dir=out, options=options)
    except (AuditError, ValueError) as error:
        raise fail(str(error)) from None
    typer.echo(json.dumps({"keys": len(result.labels), "counts": result.counts,
                           "bytes_published": result.bytes_published,
                           "block_tables": str(result.block_tables_path), "labels": str(result.labels_path),
                           "layout": str(result.layout_path)}, indent=1))
