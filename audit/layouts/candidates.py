"""The layouts of one setting of vLLM's, and every setting the operator's flags leave open.

The third step of laying a model out (docs/layouts.md §11). `layouts_from_hf_config` fixes every
setting (vLLM's rules fill in what is not given: dtypes in ``audit.layouts.dtypes``, default
blocks per platform and family, the release's rules in ``audit.layouts.versions``) and asks the
config's family for its layouts. A `LayoutRequest` is what the operator said, None where vLLM's
default decides; `candidates` lists the settings it leaves open (TP sizes, dtypes, blocks, vLLM
release x GPU rules), most likely first, for `audit.layouts.infer` to fit to the listed sizes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from .dtypes import resolve_dtypes
from .families import Options, family_of
from .hf_config import model_type_of, read_config
from .hybrid import PLATFORM_BLOCKS
from .model import LayoutError, Layout
from .serve_flags import version_refusal
from .versions import (CUDA_PLATFORMS, DEFAULT_PLATFORM, DEFAULT_VLLM_VERSION, VLLM_VERSIONS, base_platform,
                       cuda_platforms, prefill_checkpoint_alignment, rules_key)

MODEL_DTYPES = ("bfloat16", "float16", "float32")
KERNEL_BLOCKS = (16, 32, 64)
TP_SIZES = (1, 2, 4, 8)


def layouts_from_hf_config(config: dict, *, model: str, tp_size: int = 1,
                           state_dtype: str | None = None, ssm_dtype: str | None = None,
                           block_size: int | None = None, conv_layout: str = "SD",
                           kv_cache_dtype: str | None = None,
                           kernel_block_size: int | None = None, platform: str = DEFAULT_PLATFORM,
                           model_dtype: str | None = None, vllm_version: str | None = None,
                           memo: dict | None = None) -> list[Layout]:
    """One Layout per KV-cache group, in vLLM's group order (``@group:g`` is list index g).

    ``model``: the model path or name; its basename is what vLLM puts in keys.
    ``state_dtype``: vLLM's ``--mamba-cache-dtype`` (None: the model dtype, vLLM's "auto").
    ``ssm_dtype``: ``--mamba-ssm-cache-dtype`` (None: vLLM's per-model and per-platform rules,
    see ``audit.layouts.dtypes``).
    ``model_dtype``: vLLM's ``--dtype`` (None: "auto", from the config).
    ``block_size``: vLLM's ``--block-size`` (None: the platform's default: 16 on CUDA, 128 on CPU;
    an MLA model's backend's, 16).
    ``kv_cache_dtype``: attention ``--kv-cache-dtype`` (None: the model dtype).
    ``kernel_block_size``: the attention backend's smallest kernel block, the alignment of a
    hybrid model's block (None: the platform's, 16 on CUDA and 32 on CPU; ROCm AITER 64; a
    hybrid with MLA attention aligns to 128 at least).
    ``platform``: one of ``versions.PLATFORMS``: "cpu" (vLLM's CPU build forces float32 ssm states),
    "sm90", "sm100", "sm120" (rules of those GPUs), "cuda" (a CUDA GPU none of their rules applies to).
    ``vllm_version``: the producer's release, "0.32" or "0.33" (None: 0.32; ``audit.layouts.versions``).
    ``memo``: a dict kept by a caller that builds many candidates of this one ``config`` (unchanged
    meanwhile): settings that resolve to the same family and `Options` (``--dtype`` None or the
    config's own, block and kernel None or the platform's) are built once (layouts are frozen).
    """
    version = vllm_version or DEFAULT_VLLM_VERSION
    parsed = _memoized(memo, ("config",), lambda: read_config(config))
    family = _memoized(memo, ("family", vllm_version), lambda: family_of(parsed, vllm_version))
    name = model.rstrip("/").split("/")[-1]
    if not name:
        raise LayoutError(f"model name {model!r} has no basename")
    if tp_size < 1:
        raise LayoutError(f"tp_size must be >= 1, got {tp_size}")
    dtypes = _memoized(memo, ("dtypes", model_dtype, state_dtype, ssm_dtype, kv_cache_dtype, platform),
                       lambda: resolve_dtypes(model_type=parsed.model_type or "", text=parsed.text, config=config,
                                              model_dtype=model_dtype, conv_dtype=state_dtype, ssm_dtype=ssm_dtype,
                                              kv_cache_dtype=kv_cache_dtype, platform=platform))
    refused = version_refusal(version, dtypes.kv, dtypes.model)
    if refused is not None:
        raise LayoutError(refused)
    default_block, default_kernel = PLATFORM_BLOCKS[base_platform(platform)]
    options = Options(
        model=name, model_type=parsed.model_type or "", tp_size=tp_size, conv_dtype=dtypes.conv,
        ssm_dtype=dtypes.ssm, kv_dtype=dtypes.kv, conv_layout=conv_layout,
        block_size=block_size if block_size is not None else family.default_block or default_block,
        kernel_block_size=default_kernel if kernel_block_size is None else kernel_block_size,
        checkpoint_alignment=prefill_checkpoint_alignment(parsed.model_type, parsed.text, version, platform))
    if memo is None:
        return family.build(parsed.text, options)
    return list(_memoized(memo, (family, options), lambda: family.build(parsed.text, options)))


def _memoized(memo: dict | None, key: tuple, make):
    """``make()``, or what it gave (or the LayoutError it raised) for `key` before, in `memo`."""
    if memo is None:
        return make()
    found = memo.get(key, _MISSING)
    if found is _MISSING:
        try:
            found = make()
        except LayoutError as error:
            found = error
        memo[key] = found
    if isinstance(found, LayoutError):
        raise LayoutError(*found.args)
    return found


_MISSING = object()


def reading_signature(layout: Layout) -> tuple:
    """What decides how a value's bytes are read: every region's place, length, kind and dtype."""
    return tuple((region.offset, region.length, region.kind, region.dtype) for _, region in layout.regions())


@dataclass(frozen=True, slots=True)
class LayoutRequest:
    """What the operator said about one model config: None means "not given, vLLM's default"."""

    config: dict
    model: str
    tp_size: int = 1
    state_dtype: str | None = None
    ssm_dtype: str | None = None
    block_size: int | None = None
    kernel_block_size: int | None = None
    kv_cache_dtype: str | None = None
    conv_layout: str = "SD"
    platform: str | None = None
    model_dtype: str | None = None
    tp_given: bool = False
    vllm_version: str | None = None  # "0.32" or "0.33"; None: either

    @property
    def name(self) -> str:
        return self.model.rstrip("/").split("/")[-1]

    def settings(self) -> dict:
        return {"tp_size": self.tp_size, "platform": self.platform or DEFAULT_PLATFORM, "model_dtype": self.model_dtype,
                "state_dtype": self.state_dtype, "ssm_dtype": self.ssm_dtype, "block_size": self.block_size,
                "kernel_block_size": self.kernel_block_size, "kv_cache_dtype": self.kv_cache_dtype,
                "vllm_version": self.vllm_version}

    def layouts(self, memo: dict | None = None, **changes) -> list[Layout]:
        """The layouts of the request with `changes`; `memo`: see `layouts_from_hf_config`."""
        settings = {**self.settings(), **changes}
        return layouts_from_hf_config(self.config, model=self.model, conv_layout=self.conv_layout, memo=memo,
                                      **settings)

    def described(self, memo: dict | None = None, **changes) -> dict:
        """The settings a candidate assumes, with the dtypes vLLM's rules then give (`memo`: see
        `layouts_from_hf_config`)."""
        settings = {**self.settings(), **changes}
        parsed = _memoized(memo, ("config",), lambda: read_config(self.config))
        dtypes = _memoized(memo, ("dtypes", settings["model_dtype"], settings["state_dtype"], settings["ssm_dtype"],
                                  settings["kv_cache_dtype"], settings["platform"]),
                           lambda: resolve_dtypes(model_type=parsed.model_type or "", text=parsed.text,
                                                  config=self.config, model_dtype=settings["model_dtype"],
                                                  conv_dtype=settings["state_dtype"], ssm_dtype=settings["ssm_dtype"],
                                                  kv_cache_dtype=settings["kv_cache_dtype"],
                                                  platform=settings["platform"]))
        block, kernel = PLATFORM_BLOCKS[base_platform(settings["platform"])]
        family = _memoized(memo, ("family", settings["vllm_version"]), lambda: family_of(parsed, settings["vllm_version"]))
        block = family.default_block or block  # MLA: 16
        return {"platform": settings["platform"], "vllm_version": settings["vllm_version"],
                "tp_size": settings["tp_size"], **dtypes.as_dict(), "block_size": settings["block_size"] or block,
                "kernel_block_size": settings["kernel_block_size"] or kernel}

    def variants(self, scope: str | None = None) -> list[list[dict]]:
        """The (vLLM release, platform) pairs the request leaves open (within `scope`, a platform,
        where the request names none), as changes, grouped by the rules they share (a group's
        pairs give the same bytes); the first pair of all is vLLM 0.32 on CUDA, today's default."""
        text, model_type = model_type_of(self.config)
        groups: dict[tuple, list[dict]] = {}
        for platform in cuda_platforms(self.platform or scope):
            for version in (self.vllm_version,) if self.vllm_version else VLLM_VERSIONS:
                key = rules_key(model_type, text, version, platform, self.kv_cache_dtype)
                groups.setdefault(key, []).append({"vllm_version": version, "platform": platform})
        return list(groups.values())

    def releases(self) -> list[tuple[str, list[Layout] | str]]:
        """What each vLLM release the request leaves open registers (on a CUDA GPU unless it names
        a platform), releases and GPUs that give the same bytes together: (who, layouts), or
        (who, why that release refuses the request)."""
        views: dict[tuple, list] = {}
        for alike in self.variants("cuda"):
            try:
                layouts = self.layouts(**alike[0])
                signature = tuple((layout.group, reading_signature(layout)) for layout in layouts)
            except LayoutError as error:
                layouts = signature = str(error)
            views.setdefault(signature, [[], layouts])[0].extend(alike)
        return [(_who(pairs), layouts) for pairs, layouts in views.values()]


def _where(platforms: list[str]) -> str:
    if set(CUDA_PLATFORMS) <= set(platforms):
        return "any CUDA GPU"
    return ", ".join("other CUDA GPUs" if platform == "cuda" else platform for platform in platforms)


def _who(pairs: list[dict]) -> str:
    """The (release, platform) pairs of one view, as ``vLLM 0.32 on any CUDA GPU; vLLM 0.33 on
    other CUDA GPUs`` (``cuda``: a GPU none of the SM90+ rules applies to)."""
    by_version: dict[str, list[str]] = {}
    for pair in pairs:
        by_version.setdefault(pair["vllm_version"], []).append(pair["platform"])
    return "; ".join(f"vLLM {version} on {_where(platforms)}" for version, platforms in by_version.items())


def candidates(request: LayoutRequest) -> Iterator[list[dict]]:
    """Changes to the request, most likely first, each with the changes that give the same bytes
    (other vLLM releases and GPUs whose rules agree); the first is vLLM's defaults. An attention
    cache not given a dtype may be fp8 (`--kv-cache-dtype fp8`, e4m3): a page of twice the tokens
    in the bytes of a 16-bit one, so a size alone never rules it out."""
    variants = request.variants()
    model_dtypes = (request.model_dtype,) if request.model_dtype else (None, *MODEL_DTYPES)
    ssm_dtypes = (request.ssm_dtype,) if request.ssm_dtype else (None, "float32", *MODEL_DTYPES[:2])
    kv_dtypes = (request.kv_cache_dtype,) if request.kv_cache_dtype or not _holds_attention(request) \
        else (None, "fp8")
    kernels = (request.kernel_block_size,) if request.kernel_block_size else (None, *KERNEL_BLOCKS)
    blocks = (request.block_size,) if request.block_size else (None, 16, 32, 64, 128, 256)
    tps = (request.tp_size,) + (() if request.tp_given else tuple(tp for tp in TP_SIZES if tp != request.tp_size))
    # vLLM's defaults before any flag: the block and kernel defaults (they follow the platform),
    # then the dtype flags, each tried on every platform and release
    for tp, block, kernel, model_dtype, kv, ssm, alike in itertools.product(
            tps, blocks, kernels, model_dtypes, kv_dtypes, ssm_dtypes, variants):
        yield [{"tp_size": tp, "model_dtype": model_dtype, "ssm_dtype": ssm, "kernel_block_size": kernel,
                "block_size": block, "kv_cache_dtype": kv, **variant} for variant in alike]


def _holds_attention(request: LayoutRequest) -> bool:
    """Whether the request's model keeps an attention KV cache (as configured)."""
    try:
        return any(region.kind == "kv" for layout in request.layouts() for _, region in layout.regions())
    except LayoutError:
        return True
