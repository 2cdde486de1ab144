"""`mooncake-audit verify`: production values against a reference producer's recomputation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.commands.common import check_choice, check_plan, fail, resolve_settings, serve_flags
from audit.commands.options import (Sample, Seed, block_table_options, connection_options, key_options,
                                    model_options, pick, report_options, takes)
from audit.errors import AuditError
from audit.report import FORMATS, make_sink


@takes(connection_options, key_options, model_options, block_table_options, after=(report_options,))
def verify(*, reference_prefix: Annotated[Optional[str], typer.Option(
               "--reference-prefix", envvar="MOONCAKE_AUDIT_REFERENCE_PREFIX",
               help="The reference producer's cache_prefix (its keys are '<prefix>@<model>@...'). Required.")] = None,
           rtol: Annotated[Optional[float], typer.Option(
               "--rtol", min=0.0, help="Largest relative L2 error of a region within tolerance.",
               show_default="0.01 (docs/verify.md)")] = None,
           min_cosine: Annotated[Optional[float], typer.Option(
               "--min-cosine", min=-1.0, max=1.0, help="Smallest cosine similarity of a region within tolerance.",
               show_default="0.999")] = None,
           sample: Sample = None, seed: Seed = 0,
           engine: Annotated[Optional[str], typer.Option(
               "--engine", metavar="PYTHON", help="A python with vLLM: run --prompts through it first, publishing "
                                                  "under --reference-prefix (needs --model-config MODEL_DIR).")] = None,
           prompts: Annotated[Optional[Path], typer.Option(
               "--prompts", help="JSONL, one prompt per line as token ids (for --engine).")] = None,
           engine_arg: Annotated[Optional[list[str]], typer.Option(
               "--engine-arg", metavar="NAME=JSON", help="One more vLLM LLM(...) argument for the reference "
                                                         "engine (dtype=\"float32\", block_size=16). Repeatable.")] = None,
           cut_at_boundaries: Annotated[bool, typer.Option(
               "--cut-at-boundaries/--no-cut-at-boundaries",
               help="With --engine: run every prompt cut one token after each block boundary too, so every "
                    "chunk of it has a reference key (cut at --block-size, else the producer's manifest in "
                    "--block-tables, else the engine's own block size).")] = True,
           **options) -> None:
    """Compare production values with a reference producer's recomputation of the same keys.

    Every production key with a twin under --reference-prefix (same model, ranks, group and chunk
    hash) is read with it and compared region by region: DIVERGENT_STATE beyond the tolerances.
    Keys without a twin are counted and named with the reason (summary 'verify'), not flagged. Exit codes: 0 clean,
    1 findings, 2 could not run, 3 incomplete.
    """
    from audit.sources.selection import parse_sample
    from audit.verify import Tolerances
    from audit.verify.compare import DEFAULT_MIN_COSINE, DEFAULT_RTOL
    from audit.verify.run import VerifyOptions
    from audit.verify.run import verify as run_verify

    report_values = pick(options, report_options)
    fmt, output, include_all = report_values["fmt"], report_values["output"], report_values["include_all"]
    check_choice("--format", fmt, FORMATS)
    if not reference_prefix:
        raise fail("give --reference-prefix PREFIX: the reference producer's cache_prefix")
    if (engine is None) != (prompts is None):
        raise fail("--engine and --prompts go together")
    try:
        connection = pick(options, connection_options)
        settings = resolve_settings(**connection)
        keys = pick(options, key_options)
        model_values = pick(options, model_options)
        plan = check_plan(**model_values, **pick(options, block_table_options), include_all=include_all)
        reference_run = None
        if engine is not None:
            reference_run = _reference_engine(engine, prompts, engine_arg or [], reference_prefix, settings,
                                              connection["config"], model_values, plan,
                                              cut_at_boundaries=cut_at_boundaries)
        report = run_verify(settings, VerifyOptions(
            reference_prefix=reference_prefix, plan=plan, prefix=keys["prefix"], match=keys["match"],
            tolerances=Tolerances(DEFAULT_RTOL if rtol is None else rtol,
                                  DEFAULT_MIN_COSINE if min_cosine is None else min_cosine),
            sample=parse_sample(sample), seed=seed, reference_run=reference_run))
        sink = make_sink(fmt, output, include_all=include_all)
    except AuditError as error:
        raise fail(str(error)) from None
    for record in report.records:
        sink.record(record)
    sink.finish(report)
    summary = report.summary["verify"]
    typer.echo(f"verify: {summary['pairs_compared']} pair(s) compared, {summary['divergent']} divergent; "
               f"{summary['unverified']} production key(s) unverified (no twin), "
               f"{summary['reference_without_twin']} reference key(s) without a production twin", err=True)
    for reason, count in summary["unverified_reasons"].items():
        typer.echo(f"verify: {count} unverified: {reason}", err=True)
    raise typer.Exit(report.exit_code)


def _reference_engine(engine, prompts, engine_args, reference_prefix, settings, config, model_values, plan,
                      cut_at_boundaries=True) -> dict:
    """Run the reference producer (audit/verify/driver.py) with the operator's vLLM python."""
    from audit.verify.engine import cut_block_size, manifest_engine_block_size, read_prompts, run_reference
    from audit.verify.pairing import normalize_prefix

    model_dirs = [path for path in model_values.get("model_config") or () if Path(path).is_dir()]
    if len(model_dirs) != 1:
        raise AuditError("--engine needs exactly one --model-config MODEL_DIR (the weights production serves)")
    model_dir = model_dirs[0].resolve()
    if model_values.get("model") and model_values["model"] != model_dir.name:
        raise AuditError(f"vLLM names keys by the model directory's basename ({model_dir.name!r}), not "
                         f"--model {model_values['model']!r}: serve the reference from a directory of that name")
    flags = serve_flags(**{name: model_values.get(name) for name in (
        "tp_size", "dtype", "state_dtype", "ssm_dtype", "block_size", "kv_cache_dtype", "vllm_config")})
    spec = {"model": str(model_dir), "prompts": read_prompts(prompts), "cache_prefix": normalize_prefix(reference_prefix),
            "tp": flags["tp_size"]}
    if any(layout.kind != "attention" for layout in plan.layouts):
        spec["mamba_cache_mode"] = "align"
    for name, option in (("block_size", "block_size"), ("dtype", "model_dtype"), ("mamba_cache_dtype", "state_dtype"),
                         ("mamba_ssm_cache_dtype", "ssm_dtype"), ("kv_cache_dtype", "kv_cache_dtype")):
        if flags.get(option):
            spec[name] = flags[option]
    if "block_size" not in spec and (produced := manifest_engine_block_size(plan.manifests, model_dir.name)):
        spec["block_size"] = produced  # the producer's, from its manifest: chunk hashes are per block
    spec["cut_at_boundaries"] = bool(cut_at_boundaries)
    if cut_at_boundaries:
        size, source = cut_block_size(flags.get("block_size"), plan.manifests, model_dir.name)
        if size:  # else the driver cuts at its engine's own block size
            spec.update(cut_block_size=size, cut_block_size_from=source)
    for item in engine_args:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise AuditError(f"--engine-arg {item!r}: give NAME=JSON")
        try:
            spec[name] = json.loads(value)
        except json.JSONDecodeError:
            spec[name] = value
    cuts = "" if not cut_at_boundaries else (f", each cut at every {spec['cut_block_size']} tokens"
                                              if spec.get("cut_block_size") else ", each cut at every block")
    typer.echo(f"verify: running {len(spec['prompts'])} prompt(s) through the reference engine{cuts} ...", err=True)
    return run_reference(engine, spec, settings, config)
